"""Train a small Llama-style transformer with fully_shard on N processes.

Run it directly; it starts its own workers (N local CPU processes by default):

    python3 examples/train.py                   # 2 processes
    python3 examples/train.py --nproc 4 --steps 50

or under torchrun, on one node or many (it then uses the world torchrun gives it and
ignores --nproc):

    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:29500 examples/train.py --dim 512 --n-layers 8

Data: byte-level tokens (vocab 256). By default the corpus is the Python standard
library's own ``.py`` sources, so nothing is downloaded; ``--data PATH`` trains on any
file instead. Each rank draws different batches, determined by (seed, step, rank).

The recipe is the one for torch's FSDP2: ``fully_shard`` each transformer block, then
the root module, and build the optimizer over ``model.parameters()`` (the sharded
DTensor parameters). Options: an HSDP mesh (``--hsdp R``), bf16 mixed precision,
activation checkpointing, periodic sharded checkpoints (``--ckpt-dir``, ``--ckpt-every``)
and ``--resume``, which continues the loss curve bitwise where it stopped. At the end it
prints a summary (loss, tokens/s, per-rank memory of the training state) and saves the
loss curve as a PNG. See docs/recipes.md.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Callable

# torch (and what needs it) is imported inside the functions that use it: importing it
# takes seconds, and a bad flag or --help should answer at once, before any of that.
if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

EXAMPLES = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CORPUS_MB = 1.0
DEFAULT_PLOT = os.path.join("outputs", "loss_curve.png")
# the flags that fix the model's shapes: a checkpoint only loads into the same ones
MODEL_FLAGS = ("dim", "n_layers", "n_heads", "seq_len")
# the flags that, changed on --resume, make the run differ from the uninterrupted one
RUN_FLAGS = ("seed", "batch_size", "lr", "max_norm", "data", "mixed_precision")


# -- command line ----------------------------------------------------------------------


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


RESHARD_CHOICES = {"true": True, "false": False, "none": None}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train a small Llama-style transformer with fully_shard (FSDP2 API).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--nproc", type=positive_int, default=2,
                        help="processes to start on this machine (ignored under torchrun)")
    parser.add_argument("--steps", type=positive_int, default=120,
                        help="optimizer steps (in all: a resumed run stops at this step too)")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=positive_int, default=128, help="tokens (bytes) per sequence")
    parser.add_argument("--dim", type=positive_int, default=128, help="model width")
    parser.add_argument("--n-layers", type=positive_int, default=4, help="transformer blocks")
    parser.add_argument("--n-heads", type=positive_int, default=4, help="attention heads")
    parser.add_argument("--lr", type=positive_float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                        help="muon: fully_shard.optim.MuonAdamW (Muon on the block matrices, AdamW on the "
                             "rest, both at --lr: Muon's update is scaled to AdamW's RMS)")
    parser.add_argument("--max-norm", type=non_negative_float, default=1.0,
                        help="clip the global gradient norm to this (0: no clipping)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the model init and the batches")
    parser.add_argument("--data", default=None, metavar="PATH",
                        help="train on this file's bytes instead of the Python standard library's sources")
    parser.add_argument("--log-every", type=positive_int, default=20, help="print every this many steps")
    parser.add_argument("--exact-loss", action="store_true",
                        help="print each loss with all its digits (repr of the float), e.g. to check "
                             "that a resumed run continues bitwise")
    parser.add_argument("--no-progress", action="store_true",
                        help="no tqdm progress bar, only the log lines (the bar needs the 'progress' "
                             "extra, tqdm, and a terminal on stderr)")
    parser.add_argument("--plot", default=DEFAULT_PLOT, metavar="PNG",
                        help="save the loss curve here at the end (needs the 'plot' extra, matplotlib)")
    parser.add_argument("--no-plot", action="store_true", help="do not save the loss curve")

    fsdp = parser.add_argument_group("sharding")
    fsdp.add_argument("--hsdp", type=positive_int, default=None, metavar="R",
                      help="HSDP: a 2-D (R, N/R) mesh, parameters replicated across R groups and "
                           "sharded within each; R must divide the world size N (None: a 1-D "
                           "mesh, parameters sharded over all N ranks)")
    fsdp.add_argument("--mixed-precision", choices=("none", "bf16"), default="none",
                      help="bf16: MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32); "
                           "the sharded parameters and the optimizer stay in float32")
    fsdp.add_argument("--activation-checkpointing", action="store_true",
                      help="wrap each block in checkpoint_wrapper (before fully_shard): its "
                           "activations are recomputed in backward instead of kept")
    fsdp.add_argument("--reshard-after-forward", choices=sorted(RESHARD_CHOICES), default="none",
                      help="fully_shard's reshard_after_forward for every module "
                           "(none: free after forward except the root)")

    ckpt = parser.add_argument_group("checkpoints (torch.distributed.checkpoint, sharded)")
    ckpt.add_argument("--ckpt-dir", default=None, metavar="DIR",
                      help="save checkpoints into DIR/step_<k> (every rank must see DIR)")
    ckpt.add_argument("--ckpt-every", type=positive_int, default=None, metavar="K",
                      help="save every K steps and at the last step (None: at the last step only)")
    ckpt.add_argument("--resume", action="store_true",
                      help="continue from the latest complete checkpoint in --ckpt-dir (model, "
                           "optimizer, RNG, data position, loss history); starts from step 0 if "
                           "there is none")
    args = parser.parse_args(argv)

    # checks argparse cannot express: exit code 2 and a usage line, like any bad flag
    if args.dim % args.n_heads != 0:
        parser.error(f"--dim ({args.dim}) must be divisible by --n-heads ({args.n_heads})")
    if (args.dim // args.n_heads) % 2 != 0:
        parser.error(f"--dim / --n-heads ({args.dim // args.n_heads}) must be even (rotary embeddings)")
    if args.seq_len < 2:
        parser.error("--seq-len must be at least 2")
    if args.data is not None:
        if not os.path.isfile(args.data):
            parser.error(f"--data {args.data!r} is not a file")
        if os.path.getsize(args.data) < args.seq_len + 2:
            parser.error(f"--data {args.data!r} is shorter than --seq-len + 2 bytes")
    if args.hsdp is not None:
        # under torchrun the world is torchrun's; otherwise the workers this script starts
        world, where = ((int(os.environ["WORLD_SIZE"]), "the world size")
                        if "WORLD_SIZE" in os.environ else (args.nproc, "--nproc"))
        if world % args.hsdp != 0:
            parser.error(f"--hsdp {args.hsdp} must divide {where} ({world}): the mesh is "
                         f"(replicate, shard) = ({args.hsdp}, {where} / {args.hsdp})")
    if args.ckpt_dir is None:
        for flag, given in (("--ckpt-every", args.ckpt_every is not None), ("--resume", args.resume)):
            if given:
                parser.error(f"{flag} needs --ckpt-dir")
    elif os.path.exists(args.ckpt_dir) and not os.path.isdir(args.ckpt_dir):
        parser.error(f"--ckpt-dir {args.ckpt_dir!r} exists and is not a directory")
    if not args.no_plot and not args.plot.lower().endswith(".png"):
        parser.error(f"--plot {args.plot!r} must name a .png file")
    return args


# -- launching ------------------------------------------------------------------------


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The flags for the workers, spelled out in full: the launcher's own parser would
    otherwise take ``--nproc`` for an abbreviation of its ``--nproc-per-node``."""
    argv = [
        f"--steps={args.steps}", f"--batch-size={args.batch_size}", f"--seq-len={args.seq_len}",
        f"--dim={args.dim}", f"--n-layers={args.n_layers}", f"--n-heads={args.n_heads}",
        f"--lr={args.lr!r}", f"--max-norm={args.max_norm!r}", f"--seed={args.seed}",
        f"--log-every={args.log_every}", f"--reshard-after-forward={args.reshard_after_forward}",
        f"--mixed-precision={args.mixed_precision}", f"--plot={os.path.abspath(args.plot)}",
        f"--optimizer={args.optimizer}",
    ]
    if args.data is not None:
        argv.append(f"--data={os.path.abspath(args.data)}")
    if args.hsdp is not None:
        argv.append(f"--hsdp={args.hsdp}")
    if args.ckpt_dir is not None:
        argv.append(f"--ckpt-dir={os.path.abspath(args.ckpt_dir)}")
    if args.ckpt_every is not None:
        argv.append(f"--ckpt-every={args.ckpt_every}")
    for flag in ("exact_loss", "no_progress", "no_plot", "activation_checkpointing", "resume"):
        if getattr(args, flag):
            argv.append("--" + flag.replace("_", "-"))
    return argv


def launch(args: argparse.Namespace) -> int:
    """Start ``args.nproc`` copies of this script through torch's elastic launcher."""
    return launch_script(os.path.abspath(__file__), args.nproc, worker_argv(args))


def launch_script(script: str, nproc: int, argv: list[str]) -> int:
    """``torchrun --standalone --nproc-per-node=nproc script *argv``, from Python; returns
    the exit status (the first failed worker's, 130 on Ctrl-C). The other examples use it too."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    # torchrun would set OMP_NUM_THREADS=1 (and warn); share the cores out instead
    threads = max(1, (os.cpu_count() or 1) // nproc)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    try:
        torchrun_main(["--standalone", f"--nproc-per-node={nproc}", script, *argv])
    except ChildFailedError as e:  # torchrun has printed which rank failed and why
        _, failure = e.get_first_failure()
        return failure.exitcode if failure.exitcode > 0 else 1
    except (KeyboardInterrupt, SignalException):  # Ctrl-C: torchrun has stopped the workers
        print("interrupted", file=sys.stderr)
        return 130
    return 0


# -- data -------------------------------------------------------------------------------


def load_corpus(path: str | None, max_mb: float = DEFAULT_CORPUS_MB) -> torch.Tensor:
    """Bytes as int64 tokens: ``path``'s, or the standard library's .py files (sorted,
    up to ``max_mb`` MB), which every Python installation has."""
    import torch

    if path is not None:
        with open(path, "rb") as f:
            data = f.read()
    else:
        lib = os.path.dirname(os.__file__)
        limit = int(max_mb * 2**20)
        parts: list[bytes] = []
        size = 0
        for name in sorted(os.listdir(lib)):
            if size >= limit:
                break
            file = os.path.join(lib, name)
            if name.endswith(".py") and os.path.isfile(file):
                with open(file, "rb") as f:
                    parts.append(f.read())
                size += len(parts[-1])
        data = b"".join(parts)[:limit]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def get_batch(corpus: torch.Tensor, args: argparse.Namespace, step: int, rank: int,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows, the same for a given (seed, step, rank) on every run:
    the step alone is the position in the data stream, so a resumed run reads on exactly
    where the interrupted one stopped."""
    import torch

    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 65_537 + rank)
    starts = torch.randint(0, len(corpus) - args.seq_len - 1, (args.batch_size,), generator=g)
    windows = torch.stack([corpus[s : s + args.seq_len + 1] for s in starts.tolist()])  # (B, T+1)
    windows = windows.to(device)
    return windows[:, :-1], windows[:, 1:]  # inputs, next-byte targets


# -- memory -----------------------------------------------------------------------------


def param_bytes(model: torch.nn.Module) -> int:
    """Bytes of this rank's parameters: the local shards once the model is sharded."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


STATE_KINDS = ("parameters", "gradients", "optimizer")


def training_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[int]:
    """Bytes of this rank's persistent training state: [parameters, gradients, optimizer].

    Measured from the tensors themselves: for each local tensor (a DTensor's local shard,
    or a plain tensor), the size of the storage it lives in, each storage counted once
    (views into one buffer count the buffer once, at its full size, padding included).
    Not counted: activations, and the full parameters a group gathers for its forward
    and backward and frees after (``--reshard-after-forward false`` keeps them longer).
    """
    seen: set[tuple[int, str]] = set()

    def storages(tensors: Any) -> int:
        total = 0
        for t in tensors:
            if t is None:
                continue
            local = t.to_local() if hasattr(t, "to_local") else t
            storage = local.untyped_storage()
            key = (storage.data_ptr(), str(local.device))
            if storage.nbytes() == 0 or key in seen:
                continue
            seen.add(key)
            total += storage.nbytes()
        return total

    params = list(model.parameters())
    optim = [v for s in optimizer.state.values() for v in s.values() if hasattr(v, "untyped_storage")]
    return [storages(params), storages(p.grad for p in params), storages(optim)]


def unsharded_state_bytes(model: torch.nn.Module) -> list[int]:
    """[parameters, gradients, optimizer] bytes of one unsharded replica of ``model``
    (before fully_shard), with AdamW: each parameter's storage, a gradient of the same
    size, AdamW's ``exp_avg`` and ``exp_avg_sq`` of the same size again, and its ``step``
    counter (one float32 scalar per parameter)."""
    params = sum(p.untyped_storage().nbytes() for p in model.parameters())
    n = sum(1 for _ in model.parameters())
    return [params, params, 2 * params + 4 * n]


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# -- checkpoints ------------------------------------------------------------------------


def checkpoint_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int,
                     losses: list[float], args: argparse.Namespace, world_size: int, rank: int) -> dict[str, Any]:
    """What a checkpoint holds, in the layout ``dcp.save`` and ``dcp.load`` take.

    The model and optimizer state dicts hold DTensors: each rank writes (and reads back)
    its own shards. ``train`` (the step, which is also the data position, the loss
    history and the flags) is saved once. The RNG state differs per rank, so each rank
    has its own key."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {
        "model": model_sd,
        "optim": optim_sd,
        "train": train_meta(step, losses, args, world_size),
        f"rng_rank{rank}": torch.get_rng_state(),
    }


def train_meta(step: int, losses: list[float], args: argparse.Namespace, world_size: int) -> dict[str, Any]:
    return {
        "step": step,
        "losses": list(losses),
        "world_size": world_size,
        "flags": {name: getattr(args, name) for name in MODEL_FLAGS + RUN_FLAGS},
    }


def save(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, losses: list[float],
         args: argparse.Namespace, world_size: int, rank: int) -> str:
    from fully_shard.ckpt import save_checkpoint  # the crash-safe pattern: step_<k>.tmp, then rename

    state = checkpoint_state(model, optimizer, step, losses, args, world_size, rank)
    return save_checkpoint(state, args.ckpt_dir, step)


class ResumeError(Exception):
    """The checkpoint cannot be resumed with these flags."""


def resume(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
           args: argparse.Namespace, world_size: int, rank: int, log: Callable[[str], None]) -> tuple[int, list[float]]:
    """Load the checkpoint at ``path`` into the (already sharded) model and optimizer, and
    this rank's RNG state; return (step, loss history)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    # first the small part, to check that the rest will fit
    meta = {"train": train_meta(0, [], args, world_size)}
    dcp.load(meta, checkpoint_id=path)
    saved = meta["train"]
    flags = saved["flags"]
    now = {name: getattr(args, name) for name in MODEL_FLAGS + RUN_FLAGS}
    shape_diff = [f"--{k.replace('_', '-')} {flags.get(k)!r} (now {now[k]!r})"
                  for k in MODEL_FLAGS if flags.get(k) != now[k]]
    if shape_diff:
        raise ResumeError(f"{path} was saved with a model of other shapes: {', '.join(shape_diff)}; "
                          "resume with the flags it was saved with, or use another --ckpt-dir")

    same_world = saved["world_size"] == world_size
    state = checkpoint_state(model, optimizer, 0, [], args, world_size, rank)
    del state["train"]
    if not same_world:  # the ranks of the saved run and their RNG keys are not ours
        del state[f"rng_rank{rank}"]
    dcp.load(state, checkpoint_id=path)  # each rank reads its own shards, resharding as needed
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if same_world:
        torch.set_rng_state(state[f"rng_rank{rank}"])
    for group in optimizer.param_groups:  # the flag wins over the saved learning rate
        group["lr"] = args.lr

    step = int(saved["step"])
    restored = ("model, optimizer, RNG and data position" if same_world
                else "model, optimizer and data position (not the RNG)")
    log(f"resumed from {path}: step {step}, {restored} restored")
    changed = [f"--{k.replace('_', '-')} {flags.get(k)!r} -> {now[k]!r}" for k in RUN_FLAGS if flags.get(k) != now[k]]
    if not same_world:
        changed.append(f"world size {saved['world_size']} -> {world_size} (the ranks draw other batches)")
    if changed:
        log(f"note: resuming with other settings than the checkpoint's ({'; '.join(changed)}): "
            "training goes on, but not as the uninterrupted run would have")
    return step, [float(x) for x in saved["losses"]]


# -- progress and plot ------------------------------------------------------------------


class Progress:
    """Rank 0's output: log lines on stdout and, with tqdm and a terminal on stderr, a
    progress bar on stderr (the log lines are written above it)."""

    def __init__(self, enabled: bool, want_bar: bool) -> None:
        self.enabled = enabled
        self.bar: Any = None
        self.tqdm: Any = None
        self.note = ""  # why there is no bar, if the user may wonder
        if not (enabled and want_bar):
            return
        try:
            from tqdm import tqdm  # the 'progress' extra
        except ImportError:
            self.note = ("progress: tqdm is not installed, printing log lines only "
                         "(pip install -e '.[progress]' for a progress bar)")
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
            print(msg, flush=True)
        sys.stdout.flush()

    def update(self, loss: float, tokens_per_s: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.4f}, {tokens_per_s:,.0f} tokens/s", refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def save_loss_curve(path: str, losses: list[float], resumed_at: int, title: str) -> str:
    """Plot ``losses`` (one per step from step 1) into the PNG ``path``; returns a line
    saying where it went, or why it was skipped."""
    try:
        from matplotlib.figure import Figure  # the 'plot' extra; no pyplot, no GUI backend
    except ImportError:
        return "loss curve: skipped, matplotlib is not installed (pip install -e '.[plot]')"
    fig = Figure(figsize=(7, 4), dpi=120)
    ax = fig.subplots()
    ax.plot(range(1, len(losses) + 1), losses, linewidth=1.2, label="loss (mean over ranks)")
    if resumed_at > 0:
        ax.axvline(resumed_at + 0.5, color="gray", linestyle="--", linewidth=1,
                   label=f"resumed after step {resumed_at}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    return f"loss curve: {path} ({len(losses)} steps)"


# -- training ------------------------------------------------------------------------


def build_mesh(device: torch.device, world_size: int, hsdp: int | None) -> DeviceMesh:
    from torch.distributed.device_mesh import init_device_mesh

    if hsdp is None:
        return init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))
    if world_size % hsdp != 0:
        raise ValueError(f"--hsdp {hsdp} must divide the world size ({world_size})")
    return init_device_mesh(device.type, (hsdp, world_size // hsdp), mesh_dim_names=("dp_replicate", "dp_shard"))


def train(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(backend)
    try:
        mesh = build_mesh(device, world_size, args.hsdp)
        status = 0
        try:
            run(args, mesh, device, rank, world_size)
        except ResumeError as e:  # a flag problem found late: the same exit code as a bad flag
            if rank == 0:
                print(f"{os.path.basename(__file__)}: error: {e}", file=sys.stderr, flush=True)
            status = 2
        # leave together: rank 0 may still be writing the summary and the plot, and the
        # other ranks should not tear the process group down under it
        dist.barrier()
        return status
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace, mesh: DeviceMesh, device: torch.device, rank: int, world_size: int) -> None:
    import torch
    import torch.distributed as dist

    from fully_shard import MixedPrecisionPolicy, fully_shard

    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    from fully_shard.ckpt import latest_checkpoint
    from model import ModelArgs, Transformer

    out = Progress(enabled=rank == 0, want_bar=not args.no_progress)
    log = out.log

    corpus = load_corpus(args.data)
    if len(corpus) < args.seq_len + 2:
        raise ValueError(f"corpus has {len(corpus)} bytes, fewer than --seq-len + 2")

    # Every rank builds and initialises the same full model (same seed), then keeps only
    # its shards. (A model too big for one device would be built on the meta device and
    # initialised after sharding: see fully_shard.materialize.)
    torch.manual_seed(args.seed)
    model_args = ModelArgs(dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads,
                           vocab_size=256, max_seq_len=args.seq_len)
    with torch.device(device):
        model = Transformer(model_args)
        model.init_weights()
    unsharded_bytes = param_bytes(model)
    unsharded_state = unsharded_state_bytes(model)
    n_params = sum(p.numel() for p in model.parameters())

    # Activation checkpointing wraps each block *before* fully_shard, so that fully_shard
    # shards the wrapper (torchtitan's order); parameter names are unchanged in state dicts.
    if args.activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, block in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(block)

    # The FSDP2 recipe: each block is one group (one all-gather, one reduce-scatter);
    # the root takes what is left (embeddings, final norm, output projection).
    reshard = RESHARD_CHOICES[args.reshard_after_forward]
    mp_policy = MixedPrecisionPolicy()
    if args.mixed_precision == "bf16":
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp_policy)
    if args.optimizer == "muon":
        from fully_shard.optim import MuonAdamW, muon_param_groups

        # each block matrix orthogonalized once, on its owner rank; "match_rms_adamw" lets
        # Muon share AdamW's learning rate (and so --lr, also on --resume)
        optimizer = MuonAdamW(muon_param_groups(model), lr=args.lr, weight_decay=0.1, adjust_lr_fn="match_rms_adamw",
                              adamw_lr=args.lr, adamw_betas=(0.9, 0.95), adamw_weight_decay=0.1)
        log("optimizer: MuonAdamW (Muon on " + ", ".join(str(len(g["params"])) + (" matrices" if g["use_muon"] else
            " other parameters on AdamW") for g in optimizer.param_groups) + ")")
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))

    corpus_desc = args.data or f"Python {sys.version_info.major}.{sys.version_info.minor} standard library sources"
    mesh_desc = (f"HSDP mesh {tuple(mesh.shape)} (replicate, shard)" if mesh.ndim == 2
                 else f"FSDP mesh ({world_size},)")
    options = [f"mixed precision {args.mixed_precision}"]
    if args.activation_checkpointing:
        options.append("activation checkpointing")
    log(f"fully_shard on {world_size} ranks ({dist.get_backend()}, {device.type}) | "
        f"{n_params:,} parameters, {args.n_layers} blocks, dim {args.dim} | "
        f"data: {len(corpus):,} bytes of {corpus_desc}")
    log(f"{mesh_desc} | {', '.join(options)} | reshard_after_forward {args.reshard_after_forward}")
    if out.note:
        log(out.note)

    start_step, losses = 0, []
    if args.resume:
        path = latest_checkpoint(args.ckpt_dir)
        if path is None:
            log(f"resume: no complete checkpoint in {args.ckpt_dir}, starting from step 0")
        else:
            start_step, losses = resume(path, model, optimizer, args, world_size, rank, log)
    if start_step >= args.steps:
        log(f"nothing to do: the checkpoint is at step {start_step}, and --steps is {args.steps}")
        return

    def fmt_loss(x: float) -> str:
        return repr(x) if args.exact_loss else f"{x:.4f}"

    tokens_per_step = args.batch_size * args.seq_len * world_size
    train_time = window_time = 0.0
    window_step = start_step
    peak = [0, 0, 0]  # per kind
    peak_total = 0
    saves: list[tuple[str, float]] = []
    out.start(total=args.steps, initial=start_step)
    try:
        for step in range(start_step + 1, args.steps + 1):
            t0 = time.perf_counter()
            inputs, targets = get_batch(corpus, args, step, rank, device)
            logits = model(inputs)  # (B, T, 256)
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            loss.backward()
            if args.max_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
            optimizer.step()
            # parameters, gradients and optimizer state all exist now: the state's peak
            now = training_state_bytes(model, optimizer)
            peak = [max(a, b) for a, b in zip(peak, now)]
            peak_total = max(peak_total, sum(now))
            optimizer.zero_grad(set_to_none=True)
            # mean loss over ranks (each saw different data); .item() also syncs the device
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world_size)
            dt = time.perf_counter() - t0
            train_time += dt
            window_time += dt
            out.update(losses[-1], (step - start_step) * tokens_per_step / train_time)

            if step % args.log_every == 0 or step == start_step + 1 or step == args.steps:
                tps = (step - window_step) * tokens_per_step / window_time
                log(f"step {step:>5}/{args.steps} | loss {fmt_loss(losses[-1])} | {tps:,.0f} tokens/s")
                window_time, window_step = 0.0, step
            if args.ckpt_dir is not None and (step == args.steps or (args.ckpt_every and step % args.ckpt_every == 0)):
                t0 = time.perf_counter()
                path = save(model, optimizer, step, losses, args, world_size, rank)
                saves.append((path, time.perf_counter() - t0))
                log(f"checkpoint: saved {path} ({saves[-1][1]:.2f} s)")
    finally:
        out.close()

    summarize(args, model, losses, start_step, train_time, tokens_per_step, unsharded_bytes,
              unsharded_state, peak, peak_total, saves, mesh_desc, device, rank, world_size, log, fmt_loss)


def summarize(args: argparse.Namespace, model: torch.nn.Module, losses: list[float], start_step: int,
              train_time: float, tokens_per_step: int, unsharded_bytes: int, unsharded_state: list[int],
              peak: list[int], peak_total: int, saves: list[tuple[str, float]], mesh_desc: str,
              device: torch.device, rank: int, world_size: int, log: Callable[[str], None],
              fmt_loss: Callable[[float], str]) -> None:
    import torch
    import torch.distributed as dist

    # per-rank numbers, gathered to every rank: sharded parameter bytes (numel x element
    # size) and the peaks of the training state (storage bytes; see training_state_bytes)
    local = torch.tensor([param_bytes(model), *peak, peak_total], dtype=torch.int64, device=device)
    gathered = [torch.zeros_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local)
    if rank != 0:
        return
    rows = [[int(x) for x in t.tolist()] for t in gathered]
    per_rank = [r[0] for r in rows]
    steps = len(losses) - start_step
    tps = steps * tokens_per_step / train_time
    log(f"summary: final loss {fmt_loss(losses[-1])} (first {fmt_loss(losses[0])}) | {tps:,.0f} tokens/s | "
        f"{train_time:.1f} s | parameter bytes per rank {per_rank} vs {unsharded_bytes:,} unsharded "
        f"({max(per_rank) / unsharded_bytes:.1%} on the largest shard)")
    log(f"throughput: {steps} steps x {tokens_per_step:,} tokens ({args.batch_size} sequences x "
        f"{args.seq_len} tokens x {world_size} ranks) in {train_time:.1f} s of training "
        f"(checkpoint saves not included): {tps:,.0f} tokens/s")
    full = sum(unsharded_state)
    log(f"memory per rank: parameters + gradients + AdamW state at their peak, {mesh_desc}")
    for r, row in enumerate(rows):
        params, grads, optim, total = row[1:]
        log(f"  rank {r}: {fmt_bytes(total):>12} = parameters {fmt_bytes(params)} + gradients "
            f"{fmt_bytes(grads)} + optimizer {fmt_bytes(optim)} ({total / full:.1%} of unsharded)")
    log(f"  unsharded: {fmt_bytes(full):>10} = parameters {fmt_bytes(unsharded_state[0])} + gradients "
        f"{fmt_bytes(unsharded_state[1])} + optimizer {fmt_bytes(unsharded_state[2])}")
    log("  (measured after optimizer.step(), when all three exist: the bytes of the storages this "
        "rank's local tensors live in, each storage once;")
    log("  unsharded: one replica's parameter storages, gradients of the same size, AdamW's two "
        "moments again and a 4-byte step per parameter; not included: activations, gathered full parameters)")
    if saves:
        log(f"checkpoints: {len(saves)} saved in {sum(t for _, t in saves):.2f} s, latest {saves[-1][0]} "
            f"(resume with --resume --ckpt-dir {args.ckpt_dir})")
    if args.no_plot:
        return
    title = (f"examples/train.py: {args.n_layers} blocks, dim {args.dim}, {world_size} ranks, "
             f"{mesh_desc}, mixed precision {args.mixed_precision}")
    try:
        log(save_loss_curve(args.plot, losses, start_step, title))
    except Exception as e:  # the run itself went well: say so, but do not fail it
        log(f"loss curve: could not save {args.plot}: {e!r}")


def main() -> int:
    args = parse_args()
    if "LOCAL_RANK" not in os.environ:
        return launch(args)
    return train(args)


if __name__ == "__main__":
    sys.exit(main())
