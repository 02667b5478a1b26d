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
import os
import sys
import time
import traceback
from datetime import timedelta

EXAMPLES = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, EXAMPLES)
from common import (  # the helpers the examples share (examples/ is on sys.path just above)
    Metrics, Progress, StatefulBatchSampler, WindowDataset, eval_loss, flops_per_token, fmt_bytes,
    choose_device, launch_script, leave_worker, load_text, lr_lambda, non_negative_float, parse_with_config, peak_flops,
    positive_float, positive_int, save_loss_curve, start_profiler, state_digest, tokenize, training_state_bytes,
)
from fault_tolerance import Chaos, parse_kill

MODEL_FLAGS = ("dim", "n_layers", "n_heads", "seq_len", "tokenizer", "vocab_size")  # shapes a checkpoint fixes
RESHARD = {"true": True, "false": False, "none": None}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
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
    args = parse_with_config(p, argv)
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
        if not 0 <= args.ft_replica_id < args.ft_group_size:
            p.error(f"--ft-replica-id {args.ft_replica_id} must be in [0, --ft-group-size {args.ft_group_size})")
    for flag in ("ckpt_every", "ckpt_keep", "ckpt_async", "resume"):
        if getattr(args, flag) and args.ckpt_dir is None:
            p.error(f"--{flag.replace('_', '-')} needs --ckpt-dir")
    if not args.no_plot and not args.plot.lower().endswith(".png"):
        p.error(f"--plot {args.plot!r} must name a .png file")
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


def run(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from model import ModelArgs, Transformer
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils.data import DataLoader

    if args.fsdp == "torch":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    else:
        from fully_shard import MixedPrecisionPolicy, fully_shard  # type: ignore[assignment]
    from fully_shard.ckpt import CheckpointManager
    from fully_shard.optim import in_backward, local_step

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu") if args.device == "cpu" else torch.device(args.device, int(os.environ["LOCAL_RANK"]))
    # fault tolerant: this process group is one replica group, sharding over its own ranks; the replicas of the data
    # are the groups (ranks replica * world + rank of the data-parallel world)
    replica, replicas = (args.ft_replica_id, args.ft_group_size) if args.ft_enable else (0, 1)
    mesh = (init_device_mesh(device.type, (world,)) if args.hsdp is None
            else init_device_mesh(device.type, (args.hsdp, world // args.hsdp)))
    out = Progress(enabled=rank == 0, want_bar=not args.no_progress and not args.ft_enable)
    log = out.log if not args.ft_enable else (lambda msg: out.log(f"[replica {replica}] {msg}"))
    if args.ft_enable:  # one metrics file and plot per replica group
        args.metrics, args.plot = (f"{os.path.splitext(f)[0]}.replica{replica}{os.path.splitext(f)[1]}"
                                   for f in (args.metrics, args.plot))

    # 1. data: BPE (rank 0 trains it, the others receive it) or bytes; 5% held out for eval
    tokens, vocab = tokenize(load_text(args.data), args.tokenizer, args.vocab_size)
    split = int(len(tokens) * 0.95)
    train_set, eval_set = WindowDataset(tokens[:split], args.seq_len), WindowDataset(tokens[split:], args.seq_len)
    sampler = StatefulBatchSampler(len(train_set), args.batch_size, replica * world + rank, replicas * world, args.seed)

    # 2. model: the same init on every rank, then (AC, compile,) fully_shard per block, then the root
    torch.manual_seed(args.seed)
    margs = ModelArgs(dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads, vocab_size=vocab,
                      max_seq_len=args.seq_len)
    with torch.device(device):
        model = Transformer(margs)
        model.init_weights()
    n_params = sum(p.numel() for p in model.parameters())
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if args.mixed_precision == "bf16" else MixedPrecisionPolicy())
    for i, block in enumerate(model.layers):
        if args.activation_checkpointing:
            block = model.layers[i] = checkpoint_wrapper(block)
        if args.compile == "block":
            block.compile()  # in place: parameter names and state-dict keys unchanged
        fully_shard(block, mesh=mesh, reshard_after_forward=RESHARD[args.reshard_after_forward], mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=RESHARD[args.reshard_after_forward], mp_policy=mp)
    if args.compile == "whole":
        model.compile(fullgraph=True)  # in place, after fully_shard: the blocks' collectives in one graph
    if args.comm_quant != "none":  # after fully_shard: the Comm objects go on every sharded module
        from fully_shard.quant import quantize_comms

        quantized = quantize_comms(model, weights="int8", grads=args.comm_quant, block_size=args.comm_quant_block)
        log("quantized collectives: "
            + "; ".join(f"{name or '(root)'}: {how}" for name, how in list(quantized.items())[:2])
            + (f"; ... ({len(quantized)} modules)" if len(quantized) > 2 else ""))
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
    ft, chaos = None, Chaos(args.ft_kill, replica, rank)
    if args.ft_enable:  # 2b. torchft: the cross-group reduction, quorum and live recovery (fully_shard.tools.ft)
        from fault_tolerance import make_manager, wait_for_all

        from fully_shard.tools.ft import FaultTolerantHSDP

        (optimizer,), (scheduler,) = optimizers, schedulers  # one each: --optimizer-in-backward is refused
        ft_manager = make_manager(args, device, args.ft_timeout)
        ft = FaultTolerantHSDP(ft_manager, model, optimizer)  # the model's and optimizer's shards; the schedule too:
        ft_manager.register_state_dict_fn("schedule", scheduler.load_state_dict,
                                          lambda: (chaos("send", ft_manager.current_step()), scheduler.state_dict())[1])
        optimizer.register_step_post_hook(lambda *_: chaos("optim", ft_manager.current_step()))  # after the commit
        join_steps = {1} | {int(x) for x in args.ft_join_at.split(",") if x}
    log(f"fully_shard on {world} ranks ({dist.get_backend()}, {device.type}) | {n_params:,} parameters, "
        f"optimizer {type(optimizers[0]).__name__}" + (" in backward" if args.optimizer_in_backward else "") + ", "
        f"{args.n_layers} blocks, dim {args.dim} | mesh {tuple(mesh.shape)} | data: {len(tokens):,} tokens "
        f"({args.tokenizer}, vocabulary {vocab}), {len(train_set):,} train / {len(eval_set):,} eval windows")
    if out.note:
        log(out.note)

    # 3. checkpoints: everything that makes a resumed run the uninterrupted one
    manager = None if args.ckpt_dir is None else CheckpointManager(
        args.ckpt_dir, interval=args.ckpt_every or args.steps, keep_latest_k=args.ckpt_keep, async_save=args.ckpt_async)
    losses: list[float] = []
    evals: list[tuple[int, float]] = []

    def state(step: int) -> dict[str, object]:
        model_sd, optim_sd = get_state_dict(model, optimizers)
        flags = {k: getattr(args, k) for k in MODEL_FLAGS}
        return {"model": model_sd, "optim": optim_sd, "sched": schedulers[0].state_dict(), "data": sampler.state_dict(),
                "train": {"step": step, "losses": list(losses), "evals": [list(e) for e in evals], "flags": flags,
                          "world_size": world}, f"rng_rank{rank}": torch.get_rng_state()}

    start = 0
    if args.resume and manager is not None and manager.latest() is not None:
        path, template = manager.latest(), state(0)
        meta = {"train": template.pop("train")}
        manager.load_latest(meta)
        saved = meta["train"]
        wrong = [f"--{k.replace('_', '-')} {saved['flags'][k]!r} (now {getattr(args, k)!r})"
                 for k in MODEL_FLAGS if saved["flags"][k] != getattr(args, k)]
        if wrong:  # exit 2, like a bad flag
            if rank == 0:
                print(f"train.py: error: {path} was saved with other shapes: {', '.join(wrong)}; resume with "
                      "the flags it was saved with, or use another --ckpt-dir", file=sys.stderr, flush=True)
            raise SystemExit(2)
        if saved["world_size"] != world:  # DCP reshards the state; the old ranks' RNG keys are not ours
            del template[f"rng_rank{rank}"]
            log(f"note: saved on {saved['world_size']} ranks, resumed on {world}: weights, optimizer and schedule "
                "continue, but the data order and RNG differ from the uninterrupted run")
        manager.load_latest(template)
        set_state_dict(model, optimizers, model_state_dict=template["model"], optim_state_dict=template["optim"])
        for scheduler in schedulers:
            scheduler.load_state_dict(template["sched"])  # type: ignore[arg-type]
        sampler.load_state_dict(template["data"])  # type: ignore[arg-type]
        if f"rng_rank{rank}" in template:
            torch.set_rng_state(template[f"rng_rank{rank}"])  # type: ignore[arg-type]
        start, losses, evals = (int(saved["step"]), [float(x) for x in saved["losses"]],
                                [tuple(e) for e in saved["evals"]])
        log(f"resumed from {path}: step {start}, model, optimizer, schedule, RNG and data position "
            f"(epoch {sampler.epoch}, batch {sampler.batch}) restored")
    batches = iter(DataLoader(train_set, batch_sampler=sampler, num_workers=0))  # type: ignore[arg-type]

    # 4. the training loop
    tokens_per_step = args.batch_size * args.seq_len * world * args.grad_accum
    flops = flops_per_token(n_params, args.n_layers, args.dim, args.seq_len)
    peak = peak_flops(device, args.peak_tflops)
    restarted = args.ft_enable and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"  # append to its metrics
    metrics = Metrics(args.metrics if rank == 0 else None, args.tensorboard if rank == 0 else None,
                      start > 0 or restarted)
    fmt = repr if args.exact_loss else (lambda x: f"{x:.4f}")
    prof = None if args.profile is None else start_profiler(args.profile, rank, device)
    train_time, mem = 0.0, 0
    out.start(total=args.steps, initial=start)
    step, last_commit = start, time.monotonic()
    while step < args.steps:
        if ft is not None:  # join the step's quorum; a group that is behind receives its state here
            before = ft_manager.current_step()
            if before + 1 in join_steps:
                wait_for_all(ft, replicas, args.ft_timeout, log)
            else:
                ft.start_step(shrink_only=bool(args.ft_join_at))
            step = ft_manager.current_step()
            if step != before:
                log(f"recovered live at step {step} from a healthy replica group (each rank: its peer's shards)")
            if step >= args.steps:
                break
            sampler.seek(step * args.grad_accum)  # this step's batches, whichever attempt runs it
            batches = iter(DataLoader(train_set, batch_sampler=sampler, num_workers=0))  # type: ignore[arg-type]
        chaos("forward", step + 1)
        step += 1
        t0 = time.perf_counter()
        total = torch.zeros((), device=device)
        for micro in range(args.grad_accum):
            model.set_requires_gradient_sync(micro == args.grad_accum - 1)  # reduce-scatter once per step
            x, y = (t.to(device) for t in next(batches))
            loss = torch.nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten()) / args.grad_accum
            loss.backward()  # --optimizer-in-backward: the synced one steps every parameter
            total += loss.detach()
        if args.max_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
        if ft is not None and not ft.should_commit():  # every rank of every group in the quorum must agree
            optimizers[0].zero_grad(set_to_none=True)
            step -= 1
            error = getattr(ft_manager.errored(), "original_exception", None)
            why = str(error).splitlines()[0][:160] if error else "too few replica groups"
            log(f"step {step + 1} not committed ({why}); running it again")
            if time.monotonic() - last_commit > 2 * args.ft_timeout:
                raise RuntimeError(f"fault tolerance: no step committed for {2 * args.ft_timeout:.0f} s (replica group "
                                   f"{replica}, step {step + 1}); the last failure: {why}")
            continue
        last_commit = time.monotonic()
        if not args.optimizer_in_backward:
            optimizers[0].step()
        mem = max(mem, training_state_bytes(model, *optimizers))
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        lr = schedulers[0].get_last_lr()[0]
        for scheduler in schedulers:
            scheduler.step()
        dist.all_reduce(total)  # mean over ranks; .item() also syncs the device
        losses.append(total.item() / world)
        dt = time.perf_counter() - t0
        train_time += dt
        tps = tokens_per_step / dt
        row = {"loss": losses[-1], "lr": lr, "tokens_per_s": tps, "tflops_per_device": flops * tps / world / 1e12,
               "state_bytes": mem}
        if peak is not None:
            row["mfu"] = flops * tps / world / peak
        if device.type == "cuda":
            row["max_memory_allocated"] = torch.cuda.max_memory_allocated(device)
        if ft is not None:  # which groups this step averaged over, and the batches committed in all (all groups)
            row.update(participants=ft_manager.num_participants(), batches_committed=ft_manager.batches_committed())
        if step == args.steps or (args.eval_every and step % args.eval_every == 0):
            evals.append((step, eval_loss(model, eval_set, args.batch_size, args.eval_batches, device)))
            row["eval_loss"] = evals[-1][1]
        metrics.write(step, row)
        out.update(losses[-1], tps)
        if prof is not None:
            prof.step()
        if step % args.log_every == 0 or step == start + 1 or step == args.steps:
            extra = f" | eval {fmt(evals[-1][1])}" if "eval_loss" in row else ""
            mfu = f"MFU {row['mfu']:.1%}" if "mfu" in row else f"{row['tflops_per_device']:.3g} TFLOP/s/device"
            log(f"step {step:>5}/{args.steps} | loss {fmt(losses[-1])} | lr {lr:.2e} | {tps:,.0f} tokens/s | {mfu} | "
                f"state {fmt_bytes(mem)}" + (f" | max allocated {fmt_bytes(row['max_memory_allocated'])}"
                                             if "max_memory_allocated" in row else "") + extra)
        if manager is not None and manager.maybe_save(step, lambda s=step: state(s), force=step == args.steps):
            log(f"checkpoint: {args.ckpt_dir}/step_{step}"
                + (" (writing in the background)" if args.ckpt_async else ""))
    if prof is not None:
        prof.stop()
        log(f"profile: {args.profile}/rank<r>.json (open in https://ui.perfetto.dev or chrome://tracing)")
    for closing in (manager, out, metrics):  # the manager waits for an asynchronous save
        if closing is not None:
            closing.close()
    if args.digest:
        params, optim = state_digest(model, *optimizers)
        who = f"replica {replica} rank {rank}" if args.ft_enable else f"rank {rank}"
        sys.stdout.write(f"digest {who}: parameters {params} optimizer {optim}\n")
        sys.stdout.flush()
    if ft is not None:
        log(f"fault tolerance: at step {ft_manager.current_step()}, {ft_manager.batches_committed()} batches committed "
            "by all replica groups")
        ft_manager.shutdown(wait=False)
    if start >= args.steps or not losses:
        log(f"nothing to do: the checkpoint is at step {start}, and --steps is {args.steps}")
        return
    tps = (args.steps - start) * tokens_per_step / train_time
    log(f"summary: final loss {fmt(losses[-1])} (first {fmt(losses[0])}) | eval loss {fmt(evals[-1][1])} | {tps:,.0f} "
        f"tokens/s | {train_time:.1f} s | parameters + gradients + optimizer state per rank {fmt_bytes(mem)}")
    log(f"metrics: {args.metrics}")
    if rank == 0 and not args.no_plot:
        title = f"examples/train.py: {args.n_layers} blocks, dim {args.dim}, {world} ranks, mesh {tuple(mesh.shape)}"
        log(save_loss_curve(args.plot, losses, evals, start, title))


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
    args = parse_args()
    if "LOCAL_RANK" not in os.environ:  # the launcher decides once; its workers get the device type it chose
        resolve_device(args, args.nproc)
        if args.ft_enable:  # a Lighthouse and --ft-group-size replica groups, restarted when they fail
            from fault_tolerance import launch

            return launch(os.path.abspath(__file__), worker_argv(args), replicas=args.ft_group_size, nproc=args.nproc,
                          max_restarts=args.ft_max_restarts, lighthouse=args.ft_lighthouse, timeout=args.ft_timeout)
        return launch_script(os.path.abspath(__file__), args.nproc, worker_argv(args))
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
