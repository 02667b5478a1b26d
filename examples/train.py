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
DTensor parameters).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import TYPE_CHECKING

# torch (and what needs it) is imported inside the functions that use it: importing it
# takes seconds, and a bad flag or --help should answer at once, before any of that.
if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

EXAMPLES = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CORPUS_MB = 1.0


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
    parser.add_argument("--steps", type=positive_int, default=120, help="optimizer steps")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=positive_int, default=128, help="tokens (bytes) per sequence")
    parser.add_argument("--dim", type=positive_int, default=128, help="model width")
    parser.add_argument("--n-layers", type=positive_int, default=4, help="transformer blocks")
    parser.add_argument("--n-heads", type=positive_int, default=4, help="attention heads")
    parser.add_argument("--lr", type=positive_float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--max-norm", type=non_negative_float, default=1.0,
                        help="clip the global gradient norm to this (0: no clipping)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the model init and the batches")
    parser.add_argument("--data", default=None, metavar="PATH",
                        help="train on this file's bytes instead of the Python standard library's sources")
    parser.add_argument("--log-every", type=positive_int, default=20, help="print every this many steps")
    parser.add_argument("--reshard-after-forward", choices=sorted(RESHARD_CHOICES), default="none",
                        help="fully_shard's reshard_after_forward for every module "
                             "(none: free after forward except the root)")
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
    ]
    if args.data is not None:
        argv.append(f"--data={os.path.abspath(args.data)}")
    return argv


def launch(args: argparse.Namespace) -> int:
    """Start ``args.nproc`` copies of this script through torch's elastic launcher."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    # torchrun would set OMP_NUM_THREADS=1 (and warn); share the cores out instead
    threads = max(1, (os.cpu_count() or 1) // args.nproc)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    try:
        torchrun_main([
            "--standalone",
            f"--nproc-per-node={args.nproc}",
            os.path.abspath(__file__),
            *worker_argv(args),
        ])
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
    """``batch_size`` random windows, the same for a given (seed, step, rank) on every run."""
    import torch

    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 65_537 + rank)
    starts = torch.randint(0, len(corpus) - args.seq_len - 1, (args.batch_size,), generator=g)
    windows = torch.stack([corpus[s : s + args.seq_len + 1] for s in starts.tolist()])  # (B, T+1)
    windows = windows.to(device)
    return windows[:, :-1], windows[:, 1:]  # inputs, next-byte targets


# -- training ------------------------------------------------------------------------


def param_bytes(model: torch.nn.Module) -> int:
    """Bytes of this rank's parameters: the local shards once the model is sharded."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def train(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

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
        mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))
        run(args, mesh, device, rank, world_size)
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace, mesh: DeviceMesh, device: torch.device, rank: int, world_size: int) -> None:
    import torch
    import torch.distributed as dist

    from fully_shard import fully_shard

    sys.path.insert(0, EXAMPLES)
    from model import ModelArgs, Transformer

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

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
    n_params = sum(p.numel() for p in model.parameters())

    # The FSDP2 recipe: each block is one group (one all-gather, one reduce-scatter);
    # the root takes what is left (embeddings, final norm, output projection).
    reshard = RESHARD_CHOICES[args.reshard_after_forward]
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))

    corpus_desc = args.data or f"Python {sys.version_info.major}.{sys.version_info.minor} standard library sources"
    log(f"fully_shard on {world_size} ranks ({dist.get_backend()}, {device.type}) | "
        f"{n_params:,} parameters, {args.n_layers} blocks, dim {args.dim} | "
        f"data: {len(corpus):,} bytes of {corpus_desc}")

    tokens_per_step = args.batch_size * args.seq_len * world_size
    start = window_start = time.perf_counter()
    window_step = 0
    first_loss = loss_value = float("nan")
    for step in range(1, args.steps + 1):
        inputs, targets = get_batch(corpus, args, step, rank, device)
        logits = model(inputs)  # (B, T, 256)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        if args.max_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        if step % args.log_every == 0 or step == 1 or step == args.steps:
            # mean loss over ranks (each saw different data); .item() also syncs the device
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            loss_value = mean.item() / world_size
            if step == 1:
                first_loss = loss_value
            now = time.perf_counter()
            tps = (step - window_step) * tokens_per_step / (now - window_start)
            log(f"step {step:>5}/{args.steps} | loss {loss_value:.4f} | {tps:,.0f} tokens/s")
            window_start, window_step = now, step
    elapsed = time.perf_counter() - start

    # per-rank bytes of the sharded parameters, gathered for the summary
    local = torch.tensor([param_bytes(model)], dtype=torch.int64, device=device)
    gathered = [torch.zeros_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local)
    per_rank = [int(t.item()) for t in gathered]
    tps = args.steps * tokens_per_step / elapsed
    log(f"summary: final loss {loss_value:.4f} (first {first_loss:.4f}) | {tps:,.0f} tokens/s | "
        f"{elapsed:.1f} s | parameter bytes per rank {per_rank} vs {unsharded_bytes:,} unsharded "
        f"({max(per_rank) / unsharded_bytes:.1%} on the largest shard)")


def main() -> int:
    args = parse_args()
    if "LOCAL_RANK" not in os.environ:
        return launch(args)
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
