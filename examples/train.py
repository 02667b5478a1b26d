"""Train a small Llama-style transformer with fully_shard on N processes.

    python3 examples/train.py                                   # 2 local processes
    python3 examples/train.py --config examples/llama_small.toml --steps 50
    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:29500 examples/train.py --config my_job.toml
    python3 examples/train.py --config examples/llama_ft.toml   # fault tolerant: 2 replica groups x 2

Run directly it starts its own workers; under torchrun it uses torchrun's world. A TOML
job config (``--config``) sets any flag; flags on the command line override it. ``--device
auto`` (the default) trains on the accelerator when it has a device for each local process,
else on the CPU with a one-line note; ``--device cuda`` insists (an error when too few).

Data: a byte-level BPE tokenizer trained at start-up on the corpus with ``tokenizers``
(the Python standard library's sources by default, or ``--data FILE``: nothing is
downloaded); the last 5% of the tokens are held out for the eval loss. A stateful
sampler feeds a DataLoader; its position is in the checkpoint, so ``--resume`` continues
the exact data stream, and the loss curve bitwise. The recipe is torch's FSDP2 one:
``fully_shard`` each block, then the root. See docs/recipes.md.

Fault tolerant (``--ft-enable``, torchft): the data-parallel replicas become replica groups of ``--nproc`` workers
that agree on a quorum each step; a group that loses a worker is restarted and recovers live from a healthy one while
the others train on. Run directly it starts a Lighthouse and ``--ft-group-size`` groups; on several machines run one
torchrun per group. See docs/fault-tolerance.md.
"""

from __future__ import annotations

import argparse
import gc
import ipaddress
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

STARTED = time.monotonic()  # this process's start, near enough: fault tolerance measures its start-up from here
EXAMPLES = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, EXAMPLES)
from common import (  # the helpers the examples share (examples/ is on sys.path just above)
    Metrics, Progress, StatefulBatchSampler, WindowDataset, eval_loss, flops_per_token, fmt_bytes,
    choose_device, launch_script, leave_worker, load_text, lr_lambda, non_negative_float, parse_with_config, peak_flops,
    positive_float, positive_int, save_loss_curve, start_profiler, state_digest, tokenize, training_state_bytes,
)
from fault_tolerance import LOOPBACK, Chaos, parse_kill

if TYPE_CHECKING:  # torch is imported where it is used: --help and the launcher answer before it loads
    import torch
    from torch.distributed.device_mesh import DeviceMesh


MODEL_FLAGS = ("dim", "n_layers", "n_heads", "seq_len", "tokenizer", "vocab_size")  # shapes a checkpoint fixes
RESHARD = {"true": True, "false": False, "none": None}

# The recipe, top to bottom: 1. config (flags, TOML) -> 2. the world (process group, mesh, log) -> 3. data ->
# 4. model, parallelized -> 5. optimizer and schedule -> 6. fault tolerance (torchft) -> 7. checkpoint restore ->
# 8. the training loop (one step: forward/backward, commit, optimizer) -> 9. eval, checkpoint, log -> 10. summary.


# -- 1. config: every flag is declared here; a TOML job config (--config) may set any of them -----------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--config", metavar="TOML", help="job config: any flag below as a key (tables only group keys)")
    a("--nproc", type=positive_int, default=2, help="processes to start here (ignored under torchrun)")
    a("--device", default="auto", help="auto: the accelerator when it has a device for each process here, else the CPU "
      "(with a note); cpu; or the accelerator's type (cuda), refused when it has too few devices")
    a("--steps", type=positive_int, default=120, help="optimizer steps in all (a resumed run too)")
    a("--batch-size", type=positive_int, default=8, help="sequences per rank per micro-batch")
    a("--grad-accum", type=positive_int, default=1, help="micro-batches per optimizer step")
    a("--seq-len", type=positive_int, default=128, help="tokens per sequence")
    a("--dim", type=positive_int, default=128, help="model width")
    a("--n-layers", type=positive_int, default=4, help="transformer blocks")
    a("--n-heads", type=positive_int, default=4, help="attention heads")
    a("--lr", type=non_negative_float, default=3e-3, help="peak learning rate")
    a("--optimizer", choices=("adamw", "muon"), default="adamw", help="muon: fully_shard.optim.MuonAdamW, Muon on "
      "the block matrices and AdamW on the rest, both at --lr (Muon's update scaled to AdamW's RMS)")
    a("--optimizer-in-backward", action="store_true", help="AdamW per parameter, stepped inside backward as each "
                                                           "gradient is reduced, which it then frees "
                                                           "(fully_shard.optim.in_backward): no step holds every "
                                                           "gradient. The same losses; needs --max-norm 0 (clipping "
                                                           "needs every gradient first)")
    a("--warmup", type=int, default=10, help="linear warmup steps, then cosine decay to lr/10")
    a("--max-norm", type=non_negative_float, default=1.0, help="clip the gradient norm (0: off)")
    a("--seed", type=int, default=0, help="seeds the model init and the data order")
    a("--gc-freq", type=int, default=50, help="collect Python's young garbage every K steps, automatic collection "
      "being off (torchtitan's practice: a full collection walks every object torch made); 0: Python's automatic")
    a("--data", metavar="FILE", help="train on this text file instead of the standard library's sources")
    a("--tokenizer", choices=("bpe", "bytes"), default="bpe", help="BPE trained on the corpus, or raw bytes")
    a("--vocab-size", type=positive_int, default=1024, help="BPE vocabulary size")
    a("--eval-every", type=int, default=40, help="eval loss on held-out data every K steps (0: at the end)")
    a("--eval-batches", type=positive_int, default=4, help="held-out batches per rank per eval")
    a("--log-every", type=positive_int, default=20, help="print every K steps")
    a("--exact-loss", action="store_true", help="print losses with all digits (to compare runs)")
    a("--metrics", default=os.path.join("outputs", "metrics.jsonl"), help="per-step metrics, JSON lines")
    a("--tensorboard", metavar="DIR", help="also write TensorBoard scalars here (needs tensorboard)")
    a("--peak-tflops", type=non_negative_float, help="device peak TFLOP/s for MFU (known GPUs: looked up)")
    a("--profile", metavar="DIR", help="torch.profiler Chrome/Perfetto trace of steps 3-4, DIR/rank<r>.json")
    a("--no-progress", action="store_true", help="no tqdm bar, log lines only")
    a("--plot", default=os.path.join("outputs", "loss_curve.png"), help="save the loss curve here (PNG)")
    a("--no-plot", action="store_true", help="do not save the loss curve")
    s = p.add_argument_group("sharding").add_argument
    s("--hsdp", type=positive_int, metavar="R", help="HSDP: a (R, N/R) mesh, replicated over R groups")
    s("--mixed-precision", choices=("none", "bf16"), default="none", help="bf16 params, fp32 reductions")
    s("--activation-checkpointing", action="store_true", help="recompute each block in backward")
    s("--compile", nargs="?", const="block", choices=("block", "whole"), default=None,
      help="torch.compile each block (block, the default: after AC, before fully_shard), or the whole model after "
      "fully_shard (whole: the collectives in the graph; docs/compile.md)")
    s("--reshard-after-forward", choices=sorted(RESHARD), default="none", help="none: all but the root")
    s("--fit", metavar="BUDGET", help="shard by the fastest recipe whose planned peak fits BUDGET per rank (e.g. 2GiB; "
      "fully_shard.plan.fit; --mixed-precision bf16 allows bf16) instead of the two options before")
    s("--comm-quant", choices=("none", "int8", "int4"), default="none",
      help="quantized collectives (fully_shard.quant): "
      "int8 weight all-gathers and int8 (or int4) gradient reductions; embeddings and norms stay exact")
    s("--comm-quant-block", type=positive_int, default=256, help="values per fp32 scale in --comm-quant")
    s("--fsdp", choices=("fully_shard", "torch"), default="fully_shard", help="torch: torch's FSDP2 "
      "(torch.distributed.fsdp) instead, to compare")
    f = p.add_argument_group("fault tolerance (torchft; TOML table [fault_tolerance], keys without 'ft_')").add_argument
    f("--ft-enable", action="store_true", help="replica groups of --nproc workers (each shards the model over its "
      "own ranks) that survive the loss of a group: see docs/fault-tolerance.md")
    f("--ft-replica-id", type=int, default=0, help="this replica group (set by the launcher; under torchrun: yours)")
    f("--ft-group-size", type=positive_int, default=2, help="the number of replica groups")
    f("--ft-min-replica-size", type=positive_int, default=1, help="commit a step only with this many groups in it")
    f("--ft-max-restarts", type=int, default=3, help="restarts of a replica group before the job gives up "
      "(the launcher that this script starts when run directly)")
    f("--ft-timeout", type=positive_float, default=60.0, help="seconds any collective, quorum or recovery may take")
    f("--ft-lighthouse", metavar="URL", help="an existing Lighthouse (default: $TORCHFT_LIGHTHOUSE under torchrun, "
      "else one started here)")
    f("--ft-lighthouse-bind", metavar="HOST", default=LOOPBACK, help="the address the Lighthouse started here listens "
      "on: loopback (only this machine's workers reach it), or :: / 0.0.0.0 (every interface) for replica groups on "
      "other machines; see docs/fault-tolerance.md for what else listens")
    f("--ft-join-at", metavar="STEPS", default="", help="testing: groups (re)join only at these steps (comma-"
      "separated), which wait for every group as step 1 does; other steps' quorums only shrink (deterministic runs)")
    f("--ft-kill", metavar="R:K:STEP:WHERE", type=parse_kill, action="append", help="testing (repeatable): SIGKILL "
      "rank K of replica group R once (in the first attempt), at STEP's forward, inside its optimizer step (optim) "
      "or while sending its state to a recovering group (send, at STEP or later); without --ft-enable: R is 0, "
      "forward only (a torchrun restart)")
    f("--digest", action="store_true", help="print a SHA-256 of each rank's parameter shards and optimizer state "
      "at the end (to compare runs bitwise)")
    a("--dist-timeout", type=positive_float, metavar="SECONDS", help="how long the process group may wait to "
      "connect or for a collective before failing (torch's default: 30 min on gloo; --ft-timeout with --ft-enable)")
    c = p.add_argument_group("checkpoints (fully_shard.ckpt, sharded DCP)").add_argument
    c("--ckpt-dir", metavar="DIR", help="save into DIR/step_<k> (every rank must see DIR)")
    c("--ckpt-every", type=positive_int, metavar="K", help="save every K steps, and at the last")
    c("--ckpt-keep", type=positive_int, metavar="K", help="keep only the newest K checkpoints")
    c("--ckpt-async", action="store_true", help="save with dcp.async_save while training goes on")
    c("--resume", action="store_true", help="continue from the newest checkpoint in --ckpt-dir: "
      "model, optimizer, schedule, RNG and data position")
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse combinations that cannot work, naming the flags (``p.error``: status 2, before any worker starts)."""
    if args.dim % args.n_heads or (args.dim // args.n_heads) % 2:
        p.error(f"--dim ({args.dim}) must be divisible by --n-heads ({args.n_heads}), into an even head size")
    if args.data is not None and not os.path.isfile(args.data):
        p.error(f"--data {args.data!r} is not a file")
    world, where = ((int(os.environ["WORLD_SIZE"]), "the world size") if "WORLD_SIZE" in os.environ
                    else (args.nproc, "--nproc"))
    if args.optimizer_in_backward and (args.max_norm > 0 or args.optimizer != "adamw"):
        p.error("--optimizer-in-backward steps each parameter as soon as its gradient is reduced, before the others "
                "exist: pass --max-norm 0 (clipping needs the norm of every gradient) and --optimizer adamw (Muon's "
                f"matrices are orthogonalized together); got --max-norm {args.max_norm} --optimizer {args.optimizer}")
    if args.hsdp is not None and world % args.hsdp:
        p.error(f"--hsdp {args.hsdp} must divide {where} ({world})")
    if args.ft_enable:
        why = {"hsdp": "the replicate dimension is torchft's replica groups; use --ft-group-size",
               "ckpt-dir": "a fault-tolerant job recovers from a live replica group, not from disk; checkpoints of one "
                           "group are not supported yet",
               "optimizer-in-backward": "the optimizer may step only once every group has committed the step"}
        for flag, reason in why.items():
            if getattr(args, flag.replace("-", "_")) not in (None, False):
                p.error(f"--ft-enable and --{flag}: {reason}")
        try:
            ipaddress.ip_address(args.ft_lighthouse_bind)
        except ValueError:
            p.error(f"--ft-lighthouse-bind {args.ft_lighthouse_bind!r} is not an IP address of this machine: pass "
                    f"{LOOPBACK} (loopback, the default), :: or 0.0.0.0 (every interface), or one interface's address")
        if not 0 <= args.ft_replica_id < args.ft_group_size:
            p.error(f"--ft-replica-id {args.ft_replica_id} must be in [0, --ft-group-size {args.ft_group_size})")
    for flag in ("ckpt_every", "ckpt_keep", "ckpt_async", "resume"):
        if getattr(args, flag) and args.ckpt_dir is None:
            p.error(f"--{flag.replace('_', '-')} needs --ckpt-dir")
    if not args.no_plot and not args.plot.lower().endswith(".png"):
        p.error(f"--plot {args.plot!r} must name a .png file")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = parse_with_config(p, argv)
    check_args(p, args)
    return args


def worker_argv(args: argparse.Namespace) -> list[str]:
    """Every setting spelled out as ``--flag=value`` (the config already applied)."""
    out = []
    for key, value in vars(args).items():
        if key in ("config", "nproc", "ft_replica_id") or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, list):  # a repeatable flag
            out += [f"{flag}={v}" for v in value]
            continue
        out.append(flag if value is True else f"{flag}={value!r}" if isinstance(value, float) else f"{flag}={value}")
    return out


# -- 2. the world: this process's rank and device, the mesh, the log -------------------------------------------------


@dataclass
class World:
    rank: int
    size: int  # ranks of this process group (with --ft-enable: of this replica group)
    device: torch.device
    mesh: DeviceMesh
    replica: int  # fault tolerant: this replica group; the data-parallel replicas are the groups x the ranks
    replicas: int
    out: Progress  # log lines and the progress bar, on rank 0
    log: Callable[[str], None]


def init_world(args: argparse.Namespace) -> World:
    """The process group is up (main); this rank's device, the (FSDP or HSDP) mesh and the log."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    rank, size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu") if args.device == "cpu" else torch.device(args.device, int(os.environ["LOCAL_RANK"]))
    # fault tolerant: this process group is one replica group, sharding over its own ranks; the replicas of the data
    # are the groups (ranks replica * world + rank of the data-parallel world)
    replica, replicas = (args.ft_replica_id, args.ft_group_size) if args.ft_enable else (0, 1)
    mesh = (init_device_mesh(device.type, (size,)) if args.hsdp is None
            else init_device_mesh(device.type, (args.hsdp, size // args.hsdp)))
    out = Progress(enabled=rank == 0, want_bar=not args.no_progress and not args.ft_enable)
    log = out.log if not args.ft_enable else (lambda msg: out.log(f"[replica {replica}] {msg}"))
    if args.ft_enable:  # one metrics file and plot per replica group
        args.metrics, args.plot = (f"{os.path.splitext(f)[0]}.replica{replica}{os.path.splitext(f)[1]}"
                                   for f in (args.metrics, args.plot))
    return World(rank, size, device, mesh, replica, replicas, out, log)


# -- 3. data: BPE (rank 0 trains it, the others receive it) or bytes; 5% held out for eval ---------------------------


@dataclass
class Data:
    tokens: int
    vocab: int
    train_set: WindowDataset
    eval_set: WindowDataset
    sampler: StatefulBatchSampler  # this rank's batches; its position is in the checkpoint


def build_data(args: argparse.Namespace, world: World) -> Data:
    tokens, vocab = tokenize(load_text(args.data), args.tokenizer, args.vocab_size)
    split = int(len(tokens) * 0.95)
    train_set, eval_set = WindowDataset(tokens[:split], args.seq_len), WindowDataset(tokens[split:], args.seq_len)
    sampler = StatefulBatchSampler(len(train_set), args.batch_size, world.replica * world.size + world.rank,
                                   world.replicas * world.size, args.seed)
    return Data(len(tokens), vocab, train_set, eval_set, sampler)


# -- 4. model: the same init on every rank, then parallelized --------------------------------------------------------


def build_model(args: argparse.Namespace, vocab: int, device: torch.device) -> torch.nn.Module:
    import torch
    from model import ModelArgs, Transformer

    torch.manual_seed(args.seed)
    margs = ModelArgs(dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads, vocab_size=vocab,
                      max_seq_len=args.seq_len)
    with torch.device(device):
        model = Transformer(margs)
        model.init_weights()
    return model


def parallelize(model: torch.nn.Module, args: argparse.Namespace, mesh: DeviceMesh, log: Callable[[str], None]) -> None:
    """torch's FSDP2 recipe, in place: (activation checkpointing, compile,) ``fully_shard`` each block, then the root,
    which takes the embeddings, the final norm and the output; then (--comm-quant) quantized collectives."""
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if args.fsdp == "torch":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    else:
        from fully_shard import MixedPrecisionPolicy, fully_shard  # type: ignore[assignment]

    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if args.mixed_precision == "bf16" else MixedPrecisionPolicy())
    if args.fit:  # fully_shard.plan.fit: its fully_shard calls, checkpointing and settings instead of those below
        from functools import partial

        from fully_shard.tools.planner import fit
        recipe = fit(partial(type(model), model.args), tuple(mesh.shape), args.fit, device_type=mesh.device_type,
                     mixed_precision=args.mixed_precision == "bf16")
        recipe.apply(model, mesh)
        log(f"fit {args.fit}: {recipe.setting.describe()}; planned peak {recipe.peak_bytes:,} B at {recipe.peak_at}")
    layers: Any = model.layers if not args.fit else []
    for i, block in enumerate(layers):
        if args.activation_checkpointing:
            block = layers[i] = checkpoint_wrapper(block)
        if args.compile == "block":
            block.compile()  # in place: parameter names and state-dict keys unchanged
        fully_shard(block, mesh=mesh, reshard_after_forward=RESHARD[args.reshard_after_forward], mp_policy=mp)
    if not args.fit:
        fully_shard(model, mesh=mesh, reshard_after_forward=RESHARD[args.reshard_after_forward], mp_policy=mp)
    if args.compile == "whole":  # in place, after fully_shard: every group's collectives in one graph, under compute
        from fully_shard import compile_options, compile_whole

        compile_whole(model, options=compile_options())
    if args.comm_quant != "none":  # after fully_shard: the Comm objects go on every sharded module
        from fully_shard.quant import quantize_comms

        quantized = quantize_comms(model, weights="int8", grads=args.comm_quant, block_size=args.comm_quant_block)
        log("quantized collectives: "
            + "; ".join(f"{name or '(root)'}: {how}" for name, how in list(quantized.items())[:2])
            + (f"; ... ({len(quantized)} modules)" if len(quantized) > 2 else ""))


# -- 5. optimizer and learning-rate schedule --------------------------------------------------------------------------


def build_optimizers(args: argparse.Namespace, model: torch.nn.Module) -> tuple[list[Any], list[Any]]:
    """The optimizers (one, or one per parameter with --optimizer-in-backward) and a warmup-cosine schedule each."""
    import torch

    from fully_shard.optim import in_backward, local_step

    adamw = dict(lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    if args.optimizer == "muon":  # each block matrix orthogonalized once, on its owner rank
        from fully_shard.optim import MuonAdamW, muon_param_groups

        optimizers: list[torch.optim.Optimizer] = [MuonAdamW(
            muon_param_groups(model), lr=args.lr, weight_decay=0.1, adjust_lr_fn="match_rms_adamw", adamw_lr=args.lr,
            adamw_betas=(0.9, 0.95), adamw_weight_decay=0.1)]
    elif args.optimizer_in_backward:  # one AdamW per parameter, stepped by the parameter's hook once its gradient lands
        optimizers = list(in_backward(model, lambda ps, **kw: local_step(torch.optim.AdamW(ps, **kw)),
                                      **adamw).values())
    else:  # local_step: AdamW steps on the local shards as plain tensors (bitwise the same, state stays DTensor)
        optimizers = [local_step(torch.optim.AdamW(model.parameters(), **adamw))]
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lr_lambda(args.warmup, args.steps)) for o in optimizers]
    return optimizers, schedulers


# -- 6. fault tolerance: the cross-group reduction, quorum and live recovery (torchft, fully_shard.tools.ft) ----------


class FaultTolerance:
    """This replica group's torchft side: each step joins a quorum (a group that is behind receives its state there),
    and commits only if every group in it finished the step.

    Its waits follow what this worker measured, not fixed times, so that a loaded machine slows them down with it:
    its start-up (process start to the first quorum: what a restarted group has to go through again) and its steps
    (the median time of the committed ones)."""

    def __init__(self, args: argparse.Namespace, world: World, model: Any, optimizers: list[Any],
                 schedulers: list[Any], chaos: Chaos) -> None:
        from fault_tolerance import make_manager

        from fully_shard.tools.ft import FaultTolerantHSDP

        (optimizer,), (scheduler,) = optimizers, schedulers  # one each: --optimizer-in-backward is refused
        self.args, self.world, self.optimizer = args, world, optimizer
        self.manager = manager = make_manager(args, world.device, args.ft_timeout)
        self.ft = FaultTolerantHSDP(manager, model, optimizer)  # the model's and optimizer's shards; the schedule too:
        manager.register_state_dict_fn("schedule", scheduler.load_state_dict,
                                       lambda: (chaos("send", manager.current_step()), scheduler.state_dict())[1])
        optimizer.register_step_post_hook(lambda *_: chaos("optim", manager.current_step()))  # after the commit
        self.join_steps = {1} | {int(x) for x in args.ft_join_at.split(",") if x}
        self.last_commit = time.monotonic()
        self.startup_s: float | None = None  # measured at the first quorum
        self.step_s: list[float] = []  # the committed steps, quorum to commit

    def measured(self) -> str:
        step = f", median step {statistics.median(self.step_s):.2f} s" if self.step_s else ""
        return f"this group's start-up {self.startup_s or 0.0:.0f} s{step}, measured"

    def join_wait(self) -> float:
        """How long a step of --ft-join-at waits for every group, and any quorum may take (it waits for a group that
        is (re)starting, or for a restarted Lighthouse): a restart goes through about the start-up this worker
        measured, so three of those (at least --ft-timeout)."""
        return max(self.args.ft_timeout, 3 * (self.startup_s or 0.0))

    def commit_limit(self) -> float:
        """How long a group may go without committing a step before it gives up: twice --ft-timeout (a lost peer is
        detected within one), or longer if a restart (3 start-ups) and 20 steps as measured here take longer."""
        step = statistics.median(self.step_s) if self.step_s else 0.0
        return max(2 * self.args.ft_timeout, 3 * (self.startup_s or 0.0) + 20 * step)

    def start_step(self) -> int:
        """Join this step's quorum; returns the step the group is at (later than before after a live recovery)."""
        from fault_tolerance import wait_for_all

        if self.startup_s is None:
            self.startup_s = time.monotonic() - STARTED
        self.step_start = time.monotonic()
        before = self.manager.current_step()
        if before + 1 in self.join_steps:
            wait_for_all(self.ft, self.world.replicas, self.join_wait(), self.world.log,
                         f"{self.join_wait():.0f} s: 3 x {self.measured()}, at least --ft-timeout")
        else:
            self.ft.start_step(shrink_only=bool(self.args.ft_join_at), timeout=self.join_wait())
        step = int(self.manager.current_step())
        if step != before:
            self.world.log(f"recovered live at step {step} from a healthy replica group (each rank: its peer's shards)")
        return step

    def commit(self, step: int) -> bool:
        """Whether every rank of every group in the quorum finished ``step``; if not, its gradients are dropped (the
        step runs again), and a group that has committed nothing for longer than :meth:`commit_limit` raises."""
        if self.ft.should_commit():
            self.last_commit = time.monotonic()
            self.step_s.append(self.last_commit - self.step_start)
            return True
        self.optimizer.zero_grad(set_to_none=True)
        error = getattr(self.manager.errored(), "original_exception", None)
        why = str(error).splitlines()[0][:160] if error else "too few replica groups"
        self.world.log(f"step {step} not committed ({why}); running it again")
        if time.monotonic() - self.last_commit > self.commit_limit():
            raise RuntimeError(f"fault tolerance: no step committed for {time.monotonic() - self.last_commit:.0f} s "
                               f"(replica group {self.world.replica}, step {step}; the limit: "
                               f"{self.commit_limit():.0f} s, from 2 x --ft-timeout and {self.measured()}); the last "
                               f"failure: {why}")
        return False

    def row(self) -> dict[str, int]:
        """Which groups this step averaged over, and the batches committed in all (all groups)."""
        return {"participants": self.manager.num_participants(), "batches_committed": self.manager.batches_committed()}

    def close(self) -> None:
        self.world.log(f"fault tolerance: at step {self.manager.current_step()}, {self.manager.batches_committed()} "
                       "batches committed by all replica groups")
        self.manager.shutdown(wait=False)


# -- 7-10. the trainer: restore, the loop, its step, eval / checkpoint / log, the summary -----------------------------


class Trainer:
    """The job, built in the recipe's order; :meth:`train` runs the loop."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch.distributed as dist

        from fully_shard.ckpt import CheckpointManager

        self.args = args
        self.world = world = init_world(args)
        self.data = build_data(args, world)
        self.model = build_model(args, self.data.vocab, world.device)
        self.n_params = sum(p.numel() for p in self.model.parameters())
        parallelize(self.model, args, world.mesh, world.log)
        self.optimizers, self.schedulers = build_optimizers(args, self.model)
        self.chaos = Chaos(args.ft_kill, world.replica, world.rank)
        self.ft = (FaultTolerance(args, world, self.model, self.optimizers, self.schedulers, self.chaos)
                   if args.ft_enable else None)
        world.log(f"fully_shard on {world.size} ranks ({dist.get_backend()}, {world.device.type}) | "
                  f"{self.n_params:,} parameters, optimizer {type(self.optimizers[0]).__name__}"
                  + (" in backward" if args.optimizer_in_backward else "") + ", "
                  f"{args.n_layers} blocks, dim {args.dim} | mesh {tuple(world.mesh.shape)} | data: "
                  f"{self.data.tokens:,} tokens ({args.tokenizer}, vocabulary {self.data.vocab}), "
                  f"{len(self.data.train_set):,} train / {len(self.data.eval_set):,} eval windows")
        if world.out.note:
            world.log(world.out.note)
        self.ckpt = None if args.ckpt_dir is None else CheckpointManager(
            args.ckpt_dir, interval=args.ckpt_every or args.steps, keep_latest_k=args.ckpt_keep,
            async_save=args.ckpt_async)
        self.losses: list[float] = []
        self.evals: list[tuple[int, float]] = []
        self.start = self.restore() if args.resume and self.ckpt is not None and self.ckpt.latest() is not None else 0
        self.batches = self.data_from(self.data.sampler)
        self.train_time, self.mem = 0.0, 0
        if not gc.isenabled():  # main() turned it off for the imports
            gc.freeze()  # what importing and building the job made lives as long as the job: out of every collection
            if args.gc_freq <= 0:
                gc.enable()

    def data_from(self, sampler: StatefulBatchSampler) -> Iterator[Any]:
        from torch.utils.data import DataLoader

        return iter(DataLoader(self.data.train_set, batch_sampler=sampler, num_workers=0))  # type: ignore[arg-type]

    # 7. checkpoints: everything that makes a resumed run the uninterrupted one

    def state(self, step: int) -> dict[str, object]:
        import torch
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizers)
        flags = {k: getattr(self.args, k) for k in MODEL_FLAGS}
        return {"model": model_sd, "optim": optim_sd, "sched": self.schedulers[0].state_dict(),
                "data": self.data.sampler.state_dict(),
                "train": {"step": step, "losses": list(self.losses), "evals": [list(e) for e in self.evals],
                          "flags": flags, "world_size": self.world.size},
                f"rng_rank{self.world.rank}": torch.get_rng_state()}

    def restore(self) -> int:
        """Load the newest checkpoint of --ckpt-dir (refused, status 2, if saved with other shapes); its step."""
        import torch
        from torch.distributed.checkpoint.state_dict import set_state_dict

        assert self.ckpt is not None
        args, world, rng = self.args, self.world, f"rng_rank{self.world.rank}"
        path, template = self.ckpt.latest(), self.state(0)
        meta = {"train": template.pop("train")}
        self.ckpt.load_latest(meta)
        saved: Any = meta["train"]
        wrong = [f"--{k.replace('_', '-')} {saved['flags'][k]!r} (now {getattr(args, k)!r})"
                 for k in MODEL_FLAGS if saved["flags"][k] != getattr(args, k)]
        if wrong:  # exit 2, like a bad flag
            if world.rank == 0:
                print(f"train.py: error: {path} was saved with other shapes: {', '.join(wrong)}; resume with "
                      "the flags it was saved with, or use another --ckpt-dir", file=sys.stderr, flush=True)
            raise SystemExit(2)
        if saved["world_size"] != world.size:  # DCP reshards the state; the old ranks' RNG keys are not ours
            del template[rng]
            world.log(f"note: saved on {saved['world_size']} ranks, resumed on {world.size}: weights, optimizer and "
                      "schedule continue, but the data order and RNG differ from the uninterrupted run")
        self.ckpt.load_latest(template)
        set_state_dict(self.model, self.optimizers, model_state_dict=template["model"],
                       optim_state_dict=template["optim"])
        for scheduler in self.schedulers:
            scheduler.load_state_dict(template["sched"])
        self.data.sampler.load_state_dict(template["data"])  # type: ignore[arg-type]
        if rng in template:
            torch.set_rng_state(template[rng])  # type: ignore[arg-type]
        self.losses, self.evals = [float(x) for x in saved["losses"]], [tuple(e) for e in saved["evals"]]
        world.log(f"resumed from {path}: step {int(saved['step'])}, model, optimizer, schedule, RNG and data position "
                  f"(epoch {self.data.sampler.epoch}, batch {self.data.sampler.batch}) restored")
        return int(saved["step"])

    # 8. the training loop

    def train(self) -> None:
        args, world = self.args, self.world
        self.tokens_per_step = args.batch_size * args.seq_len * world.size * args.grad_accum
        self.flops = flops_per_token(self.n_params, args.n_layers, args.dim, args.seq_len)
        self.peak = peak_flops(world.device, args.peak_tflops)
        restarted = args.ft_enable and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"  # append to its file
        self.metrics = Metrics(args.metrics if world.rank == 0 else None,
                               args.tensorboard if world.rank == 0 else None, self.start > 0 or restarted)
        self.fmt = repr if args.exact_loss else (lambda x: f"{x:.4f}")
        self.prof = None if args.profile is None else start_profiler(args.profile, world.rank, world.device)
        world.out.start(total=args.steps, initial=self.start)
        step = self.start
        while step < args.steps:
            if self.ft is not None:  # join the step's quorum; a group that is behind receives its state here
                step = self.ft.start_step()
                if step >= args.steps:
                    break
                self.data.sampler.seek(step * args.grad_accum)  # this step's batches, whichever attempt runs it
                self.batches = self.data_from(self.data.sampler)
            self.chaos("forward", step + 1)
            t0 = time.perf_counter()
            total = self.forward_backward()
            if self.ft is not None and not self.ft.commit(step + 1):  # every rank of every group must agree
                continue
            step += 1
            lr = self.optimizer_step()
            self.after_step(step, total, lr, t0)
            if args.gc_freq > 0 and step % args.gc_freq == 0:
                gc.collect(1)
        self.finish()

    def forward_backward(self) -> torch.Tensor:
        """One step's micro-batches: forward, loss, backward (the gradients reduced once, at the last); clipping."""
        import torch

        args, model = self.args, self.model
        total = torch.zeros((), device=self.world.device)
        for micro in range(args.grad_accum):
            model.set_requires_gradient_sync(micro == args.grad_accum - 1)  # reduce-scatter once per step
            x, y = (t.to(self.world.device) for t in next(self.batches))
            loss = torch.nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten()) / args.grad_accum
            loss.backward()  # --optimizer-in-backward: the synced one steps every parameter
            total += loss.detach()
        if args.max_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
        return total

    def optimizer_step(self) -> float:
        """Step the optimizer (unless it stepped in backward) and the schedule; the learning rate the step used."""
        if not self.args.optimizer_in_backward:
            self.optimizers[0].step()
        self.mem = max(self.mem, training_state_bytes(self.model, *self.optimizers))
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        lr = float(self.schedulers[0].get_last_lr()[0])
        for scheduler in self.schedulers:
            scheduler.step()
        return lr

    # 9. eval, checkpoint, log

    def after_step(self, step: int, total: torch.Tensor, lr: float, t0: float) -> None:
        """The step's loss (mean over ranks) and metrics row; eval, log and checkpoint when due."""
        import torch
        import torch.distributed as dist

        args, world = self.args, self.world
        dist.all_reduce(total)  # mean over ranks; .item() also syncs the device
        self.losses.append(total.item() / world.size)
        dt = time.perf_counter() - t0  # the step, through the device's sync
        self.train_time += dt
        tps = self.tokens_per_step / dt
        row = {"loss": self.losses[-1], "lr": lr, "tokens_per_s": tps,
               "tflops_per_device": self.flops * tps / world.size / 1e12, "state_bytes": self.mem}
        if self.peak is not None:
            row["mfu"] = self.flops * tps / world.size / self.peak
        if world.device.type == "cuda":
            row["max_memory_allocated"] = torch.cuda.max_memory_allocated(world.device)
        if self.ft is not None:
            row.update(self.ft.row())
        if step == args.steps or (args.eval_every and step % args.eval_every == 0):
            self.evals.append((step, eval_loss(self.model, self.data.eval_set, args.batch_size, args.eval_batches,
                                               world.device)))
            row["eval_loss"] = self.evals[-1][1]
        self.metrics.write(step, row)
        world.out.update(self.losses[-1], tps)
        if self.prof is not None:
            self.prof.step()
        if step % args.log_every == 0 or step == self.start + 1 or step == args.steps:
            self.log_step(step, row)
        if self.ckpt is not None and self.ckpt.maybe_save(step, lambda s=step: self.state(s),
                                                          force=step == args.steps):
            world.log(f"checkpoint: {args.ckpt_dir}/step_{step}"
                      + (" (writing in the background)" if args.ckpt_async else ""))

    def log_step(self, step: int, row: dict[str, float]) -> None:
        fmt, mem = self.fmt, self.mem
        extra = f" | eval {fmt(self.evals[-1][1])}" if "eval_loss" in row else ""
        mfu = f"MFU {row['mfu']:.1%}" if "mfu" in row else f"{row['tflops_per_device']:.3g} TFLOP/s/device"
        self.world.log(f"step {step:>5}/{self.args.steps} | loss {fmt(self.losses[-1])} | lr {row['lr']:.2e} | "
                       f"{row['tokens_per_s']:,.0f} tokens/s | {mfu} | state {fmt_bytes(mem)}"
                       + (f" | max allocated {fmt_bytes(row['max_memory_allocated'])}"
                          if "max_memory_allocated" in row else "") + extra)

    # 10. the summary

    def finish(self) -> None:
        args, world, fmt = self.args, self.world, self.fmt
        if self.prof is not None:
            self.prof.stop()
            world.log(f"profile: {args.profile}/rank<r>.json (open in https://ui.perfetto.dev or chrome://tracing)")
        for closing in (self.ckpt, world.out, self.metrics):  # the manager waits for an asynchronous save
            if closing is not None:
                closing.close()
        if args.digest:
            params, optim = state_digest(self.model, *self.optimizers)
            who = f"replica {world.replica} rank {world.rank}" if args.ft_enable else f"rank {world.rank}"
            sys.stdout.write(f"digest {who}: parameters {params} optimizer {optim}\n")
            sys.stdout.flush()
        if self.ft is not None:
            self.ft.close()
        if self.start >= args.steps or not self.losses:
            world.log(f"nothing to do: the checkpoint is at step {self.start}, and --steps is {args.steps}")
            return
        tps = (args.steps - self.start) * self.tokens_per_step / self.train_time
        world.log(f"summary: final loss {fmt(self.losses[-1])} (first {fmt(self.losses[0])}) | eval loss "
                  f"{fmt(self.evals[-1][1])} | {tps:,.0f} tokens/s | {self.train_time:.1f} s | parameters + gradients "
                  f"+ optimizer state per rank {fmt_bytes(self.mem)}")
        world.log(f"metrics: {args.metrics}")
        if world.rank == 0 and not args.no_plot:
            title = (f"examples/train.py: {args.n_layers} blocks, dim {args.dim}, {world.size} ranks, "
                     f"mesh {tuple(world.mesh.shape)}")
            world.log(save_loss_curve(args.plot, self.losses, self.evals, self.start, title))


def run(args: argparse.Namespace) -> None:
    """The job on this process (the process group is up): build it, train, summarize."""
    Trainer(args).train()


def attempt_store(seconds: float | None) -> dict[str, object]:
    """Under torchrun's c10d rendezvous, a store of this restart attempt's own (as ``init_process_group`` arguments).

    torchrun keeps one store for all restarts of a job, and its workers use it without a prefix: a restarted worker
    can read the address its dead predecessor published and fail with "Gloo connectFullMesh failed ... Connection
    refused", or hang (pytorch/pytorch#167288; docs/troubleshooting.md). Keys prefixed by the attempt cannot be stale.
    """
    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=seconds or 1800))
    return {"store": dist.PrefixStore(f"attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store),
            "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}


def resolve_device(args: argparse.Namespace, local_procs: int) -> None:
    """``args.device`` becomes the device type to train on (see common.choose_device); its note is printed once."""
    import torch

    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    count = torch.accelerator.device_count() if accelerator is not None else 0
    try:
        args.device, note = choose_device(args.device, accelerator and accelerator.type, count, local_procs)
    except ValueError as e:  # as a bad flag: status 2, before any worker starts (from the launcher)
        print(f"examples/train.py: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    if note is not None and os.environ.get("RANK", "0") == "0":
        print(note, flush=True)


def main() -> int:
    # Python's automatic collection of its oldest generation walks every live object (torch's are hundreds of
    # thousands), and runs most while torch imports: a fifth of a small job's CPU here. Off from the start; once the job
    # is built its objects are frozen out of collections, and the training loop collects the young generations every
    # --gc-freq steps, as torchtitan's trainer does (--gc-freq 0: automatic again)
    gc.disable()
    args = parse_args()
    if "LOCAL_RANK" not in os.environ:  # the launcher decides once; its workers get the device type it chose
        resolve_device(args, args.nproc)
        if args.ft_enable:  # a Lighthouse and --ft-group-size replica groups, restarted when they fail
            from fault_tolerance import launch

            code = launch(os.path.abspath(__file__), worker_argv(args), replicas=args.ft_group_size, nproc=args.nproc,
                          max_restarts=args.ft_max_restarts, lighthouse=args.ft_lighthouse, timeout=args.ft_timeout,
                          lighthouse_bind=args.ft_lighthouse_bind)
        else:
            code = launch_script(os.path.abspath(__file__), args.nproc, worker_argv(args))
        # the launcher is done: the shutdown's collection would walk every object torch made (0.7 CPU-s), none of which
        # has anything left to finalize
        gc.freeze()
        return code
    import torch
    import torch.distributed as dist

    resolve_device(args, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))  # under torchrun: each process, the same answer
    if args.device != "cpu":
        torch.accelerator.set_device_index(int(os.environ["LOCAL_RANK"]))
    if args.ft_lighthouse:
        os.environ["TORCHFT_LIGHTHOUSE"] = args.ft_lighthouse
    seconds = args.dist_timeout or (args.ft_timeout if args.ft_enable else None)  # a lost peer: an error, soon
    timeout = {"timeout": timedelta(seconds=seconds)} if seconds else {}
    backend = "gloo" if args.device == "cpu" else dist.get_default_backend_for_device(args.device)
    dist.init_process_group(backend, **timeout, **attempt_store(seconds))
    try:
        run(args)
        dist.barrier()  # rank 0 may still be writing the plot
    except BaseException:
        if not args.ft_enable:
            raise
        traceback.print_exc()  # and leave at once: the launcher restarts the group (torchft's threads would delay it)
        leave_worker(1)
    finally:
        dist.destroy_process_group()
    leave_worker(0)  # gloo: no interpreter shutdown after collectives (see common.py)
    return 0


if __name__ == "__main__":
    sys.exit(main())
