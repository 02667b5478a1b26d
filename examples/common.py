"""What the examples share, so that each recipe reads top to bottom: launching, job
config (TOML + flags), data (a BPE tokenizer trained offline, a stateful loader), the
learning-rate schedule, metrics (log, JSONL, TensorBoard, MFU, memory), progress bar and
loss plot. Nothing here is specific to fully_shard; the recipes are.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where it is used: --help answers before it loads
    import torch

DEFAULT_CORPUS_MB = 1.0


# -- launching and config -----------------------------------------------------------------


def launch_script(script: str, nproc: int, argv: list[str]) -> int:
    """``torchrun --standalone --nproc-per-node=nproc script *argv``, from Python; returns
    the exit status (the first failed worker's, 130 on Ctrl-C)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    # torchrun would set OMP_NUM_THREADS=1 (and warn); share the cores out instead
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    try:
        torchrun_main(["--standalone", f"--nproc-per-node={nproc}", script, *argv])
    except ChildFailedError as e:  # torchrun has printed which rank failed and why
        _, failure = e.get_first_failure()
        return failure.exitcode if failure.exitcode > 0 else 1
    except (KeyboardInterrupt, SignalException):  # Ctrl-C: torchrun has stopped the workers
        print("interrupted", file=sys.stderr)
        return 130
    return 0


def choose_device(requested: str, accelerator: str | None, count: int, local_procs: int) -> tuple[str, str | None]:
    """The device type the job's processes train on, and a note to print (or None).

    ``auto``: the accelerator where each of the ``local_procs`` processes on this machine gets a device of its own (as
    torchrun jobs run, one process per GPU; NCCL refuses two on one), else the CPU with a note saying so. ``cpu``. Or
    the accelerator's type (``cuda``): refused with a ValueError that says what to pass where there is none or too few.

    Example::

        >>> choose_device("auto", "cuda", 1, 2)[0]  # 2 processes, 1 GPU: the CPU, and a note
        'cpu'
    """
    if requested == "cpu" or (requested == "auto" and accelerator is None):
        return "cpu", None
    if requested == "auto":
        if count >= local_procs:
            return accelerator, None  # type: ignore[return-value]
        return "cpu", (f"note: {local_procs} processes here but {count} {accelerator} device(s), one per process is "
                       f"needed: training on the CPU (gloo); --nproc {count} trains on the {accelerator} device(s)")
    if requested != accelerator:
        raise ValueError(f"--device {requested}: this machine's accelerator is {accelerator or 'none'}: pass --device "
                         "auto or --device cpu")
    if count < local_procs:
        raise ValueError(f"--device {requested}: {local_procs} processes here but {count} {requested} device(s), and "
                         f"each process needs its own: pass --nproc {count} (torchrun: --nproc-per-node={count}) or "
                         "--device cpu")
    return requested, None


def leave_worker(code: int) -> None:
    """End a CPU (gloo) worker after ``destroy_process_group`` without interpreter shutdown.

    A gloo thread frees a finished collective a moment after ``wait()`` returned; when that
    moment falls inside Python's shutdown the process dies with ``terminate called without
    an active exception`` after all its work is done (torch, not fully_shard; seen on loaded
    machines). Leaving through ``os._exit`` skips that shutdown. NCCL runs are unaffected.
    """
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def parse_with_config(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv`` with ``--config FILE.toml`` supplying the defaults: flags given on
    the command line override the file. TOML tables only group keys (``[training]
    steps = 100`` sets ``--steps``); a key is a flag's name with ``-`` or ``_``, except in
    ``[fault_tolerance]``, whose keys are torchtitan's (``enable`` sets ``--ft-enable``)."""
    import tomllib

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    if known.config is not None:
        try:
            with open(known.config, "rb") as f:
                table = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as e:
            parser.error(f"--config {known.config!r}: {e}")
        flat: dict[str, Any] = {}
        for key, value in table.items():  # [fault_tolerance] enable = ...: torchtitan's names for the --ft-* flags
            prefix = "ft_" if key == "fault_tolerance" else ""
            flat.update({prefix + k: v for k, v in value.items()} if isinstance(value, dict) else {key: value})
        dests = {a.dest: a for a in parser._actions}
        defaults = {}
        for key, value in flat.items():
            dest = key.replace("-", "_")
            if dest not in dests or dest in ("help", "config"):
                parser.error(f"--config {known.config!r}: unknown key {key!r} (keys are the flags' names; "
                             f"see --help)")
            action = dests[dest]
            if isinstance(value, bool) and action.nargs == "?":  # compile = true: the flag alone (its const)
                value = action.const if value else None
            if action.type is not None and not isinstance(value, bool):
                try:
                    value = action.type(str(value))
                except (argparse.ArgumentTypeError, ValueError) as e:
                    parser.error(f"--config {known.config!r}: {key} = {value!r}: {e}")
            if action.choices is not None and value is not None and value not in action.choices:
                parser.error(f"--config {known.config!r}: {key} = {value!r} is not one of {list(action.choices)}")
            defaults[dest] = value
        parser.set_defaults(**defaults)
    return parser.parse_args(argv)


# -- data ---------------------------------------------------------------------------------


def load_text(path: str | None, max_mb: float = DEFAULT_CORPUS_MB) -> str:
    """``path``'s text, or the standard library's .py files (sorted, up to ``max_mb`` MB),
    which every Python installation has: nothing is downloaded."""
    if path is not None:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    lib, limit = os.path.dirname(os.__file__), int(max_mb * 2**20)
    parts: list[str] = []
    size = 0
    for name in sorted(os.listdir(lib)):
        file = os.path.join(lib, name)
        if size >= limit:
            break
        if name.endswith(".py") and os.path.isfile(file):
            with open(file, encoding="utf-8", errors="replace") as f:
                parts.append(f.read())
            size += len(parts[-1])
    return "".join(parts)[:limit]


def load_corpus(path: str | None, max_mb: float = DEFAULT_CORPUS_MB) -> torch.Tensor:
    """Byte-level tokens (vocabulary 256) of :func:`load_text`, as int64."""
    import torch

    data = load_text(path, max_mb).encode("utf-8")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def train_tokenizer(text: str, vocab_size: int) -> Any:
    """A byte-level BPE tokenizer trained on ``text`` with Hugging Face ``tokenizers``
    (offline, deterministic: the same text gives the same merges)."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as e:
        raise ImportError("the BPE tokenizer needs the 'tokenizers' package: pip install -e '.[examples]', "
                          "or run with --tokenizer bytes") from e

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text[i : i + 65536] for i in range(0, len(text), 65536)], trainer)
    return tok


def tokenize(text: str, kind: str, vocab_size: int) -> tuple[torch.Tensor, int]:
    """``text`` as int64 tokens and the vocabulary size: ``kind`` "bpe", a tokenizer that
    rank 0 trains (:func:`train_tokenizer`) and encodes the text with, then sends the
    tokens to the other ranks (one encoding, not one per rank); or "bytes" (vocabulary
    256). Call on every rank."""
    import torch
    import torch.distributed as dist

    if kind == "bytes":
        return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8).long(), 256
    box = [None]
    if dist.get_rank() == 0:
        box = [torch.tensor(train_tokenizer(text, vocab_size).encode(text).ids, dtype=torch.long)]
    dist.broadcast_object_list(box, src=0)
    return box[0], vocab_size


class WindowDataset:
    """Non-overlapping ``seq_len + 1`` windows of a 1-D token tensor: (inputs, targets)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.tokens[i * self.seq_len : (i + 1) * self.seq_len + 1]
        return w[:-1], w[1:]


class StatefulBatchSampler:
    """This rank's batches of window indices: each epoch a seeded permutation of all
    windows, cut into global batches of ``batch_size x world_size``; rank ``r`` takes
    its slice. ``state_dict()`` is the position (epoch, batch), the same on every rank,
    so a checkpoint holding it resumes the exact data stream. Use as a DataLoader's
    ``batch_sampler`` with ``num_workers=0`` (nothing read ahead of the position)."""

    def __init__(self, n: int, batch_size: int, rank: int, world_size: int, seed: int) -> None:
        self.n, self.batch_size, self.rank, self.world_size, self.seed = n, batch_size, rank, world_size, seed
        self.per_epoch = n // (batch_size * world_size)
        if self.per_epoch == 0:
            raise ValueError(f"{n} windows are fewer than one global batch ({batch_size} x {world_size} ranks): "
                             "use more data, a smaller --batch-size or --seq-len")
        self.epoch, self.batch = 0, 0

    def __iter__(self) -> Any:
        import torch

        while True:
            order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch))
            while self.batch < self.per_epoch:
                start = (self.batch * self.world_size + self.rank) * self.batch_size
                self.batch += 1
                yield order[start : start + self.batch_size].tolist()
            self.epoch, self.batch = self.epoch + 1, 0

    def __len__(self) -> int:
        return self.per_epoch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.batch}

    def seek(self, k: int) -> None:
        """Go to the ``k``-th batch of the stream (counted from the start of epoch 0)."""
        self.epoch, self.batch = divmod(k, self.per_epoch)

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])


def eval_loss(model: Any, data: WindowDataset, batch_size: int, n_batches: int, device: torch.device) -> float:
    """Mean cross-entropy over the first ``n_batches`` global batches of ``data`` (the same
    windows at every eval), averaged over ranks. Call on every rank."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    model.eval()
    with torch.no_grad():
        total = torch.zeros((), device=device)
        for b in range(n_batches):
            idx = [((b * world + rank) * batch_size + j) % len(data) for j in range(batch_size)]
            x, y = (torch.stack(t).to(device) for t in zip(*(data[i] for i in idx)))
            total += torch.nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        dist.all_reduce(total)
    model.reshard()  # no backward follows: free the root's gathered parameters (FSDP2 keeps them)
    model.train()
    return total.item() / (world * n_batches)


def lr_lambda(warmup: int, total: int, min_ratio: float = 0.1) -> Any:
    """Linear warmup over ``warmup`` steps, then cosine decay to ``min_ratio`` at ``total``
    (torchtitan's schedule; for ``torch.optim.lr_scheduler.LambdaLR``)."""

    def factor(step: int) -> float:  # step: optimizer steps taken so far
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


# -- metrics --------------------------------------------------------------------------------


def flops_per_token(n_params: int, n_layers: int, dim: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 per parameter (forward + backward) plus attention's
    12 x layers x dim x seq_len (PaLM's appendix B, as torchtitan counts it)."""
    return 6 * n_params + 12 * n_layers * dim * seq_len


def peak_flops(device: torch.device, given_tflops: float | None) -> float | None:
    """The device's peak dense bf16 FLOP/s: ``given_tflops``, or a known GPU's; None if unknown."""
    import torch

    if given_tflops:
        return given_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in (("H200", 989), ("H100", 989), ("A100", 312), ("L4", 121), ("A10", 125)):
            if key in name:
                return tflops * 1e12
    return None


def start_profiler(out_dir: str, rank: int, device: torch.device) -> Any:
    """A started ``torch.profiler`` that skips one step, warms up one and records two (call
    its ``step()`` after each training step), then writes a Chrome/Perfetto trace to
    ``out_dir/rank<r>.json``. fully_shard's phases show as ``fully_shard::<phase>`` ranges."""
    from torch.profiler import ProfilerActivity, profile, schedule

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    trace = os.path.join(out_dir, f"rank{rank}.json")
    os.makedirs(out_dir, exist_ok=True)
    prof = profile(activities=acts, schedule=schedule(wait=1, warmup=1, active=2, repeat=1),
                   on_trace_ready=lambda p: p.export_chrome_trace(trace))
    prof.start()
    return prof


class Metrics:
    """Per-step metrics of rank 0: one JSON object per line in ``path`` and, when
    TensorBoard is installed and ``tb_dir`` is given, scalars for TensorBoard."""

    def __init__(self, path: str | None, tb_dir: str | None, resumed: bool) -> None:
        self.file = None
        if path is not None:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.file = open(path, "a" if resumed else "w")
        self.tb: Any = None
        if tb_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                self.note = "tensorboard: not installed, writing JSONL only (pip install tensorboard)"
            else:
                self.tb = SummaryWriter(tb_dir)

    def write(self, step: int, values: dict[str, float]) -> None:
        if self.file is not None:
            self.file.write(json.dumps({"step": step, "time": time.time(), **values}) + "\n")
            self.file.flush()
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()


def training_state_bytes(model: torch.nn.Module, *optimizers: torch.optim.Optimizer) -> int:
    """Bytes of this rank's parameters, gradients and optimizer state (of one optimizer, or one per
    parameter): the storages its local tensors (a DTensor's local shard) live in, each storage once."""
    seen: set[int] = set()
    total = 0
    tensors = [*model.parameters(), *(p.grad for p in model.parameters())]
    tensors += [v for o in optimizers for s in o.state.values() for v in s.values() if hasattr(v, "untyped_storage")]
    for t in tensors:
        if t is None:
            continue
        storage = (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()
        if storage.data_ptr() not in seen and storage.nbytes():
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def state_digest(model: torch.nn.Module, *optimizers: torch.optim.Optimizer) -> tuple[str, str]:
    """SHA-256 of this rank's parameter shards (and buffers), and of its optimizers' state, in name order: equal
    digests, bitwise equal states."""
    import hashlib

    import torch

    from fully_shard.tools.ft import sharded_state_dict

    optim = {f"{n}.{k}": v for o in optimizers
             for n, entry in sharded_state_dict(model, o)["optim"]["state"].items() for k, v in entry.items()}
    out = []
    for tensors in (sharded_state_dict(model)["model"], optim):
        h = hashlib.sha256()
        for name in sorted(tensors):
            t = tensors[name]
            h.update(name.encode())
            h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                     if isinstance(t, torch.Tensor) else repr(t).encode())
        out.append(h.hexdigest()[:16])
    return out[0], out[1]


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# -- progress and plot ------------------------------------------------------------------------


class Progress:
    """Rank 0's output: log lines on stdout and, with tqdm and a terminal on stderr, a
    progress bar with loss and tokens/s on stderr (log lines are written above it)."""

    def __init__(self, enabled: bool, want_bar: bool) -> None:
        self.enabled, self.bar, self.tqdm, self.note = enabled, None, None, ""
        if not (enabled and want_bar):
            return
        try:
            from tqdm import tqdm  # the 'examples' extra
        except ImportError:
            self.note = ("progress: tqdm is not installed, printing log lines only "
                         "(pip install -e '.[examples]' for a progress bar)")
            return
        if not sys.stderr.isatty():
            self.note = "progress: stderr is not a terminal, printing log lines only"
            return
        self.tqdm = tqdm

    def start(self, total: int, initial: int) -> None:
        if self.tqdm is not None:
            self.bar = self.tqdm(total=total, initial=initial, desc="train", unit="step",
                                 dynamic_ncols=True, file=sys.stderr)

    def log(self, msg: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(msg, file=sys.stdout)
        else:
            sys.stdout.write(msg + "\n")  # one write: other processes' lines do not cut into it
        sys.stdout.flush()

    def update(self, loss: float, tokens_per_s: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.4f}, {tokens_per_s:,.0f} tokens/s", refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def save_loss_curve(path: str, losses: list[float], evals: list[tuple[int, float]], resumed_at: int,
                    title: str) -> str:
    """Plot the training loss (one per step from step 1) and the eval losses into the PNG
    ``path``; returns a line saying where it went, or why it was skipped."""
    try:
        from matplotlib.figure import (
            Figure,  # the 'examples' extra; no pyplot, no GUI backend
        )
    except ImportError:
        return "loss curve: skipped, matplotlib is not installed (pip install -e '.[examples]')"
    fig = Figure(figsize=(7, 4), dpi=120)
    ax = fig.subplots()
    ax.plot(range(1, len(losses) + 1), losses, linewidth=1.2, label="train loss (mean over ranks)")
    if evals:
        ax.plot(*zip(*evals), "o-", markersize=3, linewidth=1, label="eval loss (held-out data)")
    if resumed_at > 0:
        ax.axvline(resumed_at + 0.5, color="gray", linestyle="--", linewidth=1,
                   label=f"resumed after step {resumed_at}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per token)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    return f"loss curve: {path} ({len(losses)} steps)"
