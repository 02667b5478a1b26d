"""Train a small Llama-style transformer with fully_shard on N processes.

    python3 examples/train.py                                   # 2 local processes
    python3 examples/train.py --config examples/llama_small.toml --steps 50
    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:29500 examples/train.py --config my_job.toml

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
"""

from __future__ import annotations

import argparse
import os
import sys
import time

EXAMPLES = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, EXAMPLES)
from common import (  # the helpers the examples share (examples/ is on sys.path just above)
    Metrics, Progress, StatefulBatchSampler, WindowDataset, eval_loss, flops_per_token, fmt_bytes,
    choose_device, launch_script, leave_worker, load_text, lr_lambda, non_negative_float, parse_with_config, peak_flops, positive_int,
    save_loss_curve, start_profiler, tokenize, training_state_bytes,
)

MODEL_FLAGS = ("dim", "n_layers", "n_heads", "seq_len", "tokenizer", "vocab_size")  # shapes a checkpoint fixes
RESHARD = {"true": True, "false": False, "none": None}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
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
      "gradient is reduced, which it then frees (fully_shard.optim.in_backward): no step holds every gradient. The same "
      "losses; needs --max-norm 0 (clipping needs every gradient first)")
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
    s("--compile", action="store_true", help="torch.compile each block (after AC, before fully_shard)")
    s("--reshard-after-forward", choices=sorted(RESHARD), default="none", help="none: all but the root")
    s("--comm-quant", choices=("none", "int8", "int4"), default="none", help="quantized collectives (fully_shard.quant): "
      "int8 weight all-gathers and int8 (or int4) gradient reductions; embeddings and norms stay exact")
    s("--comm-quant-block", type=positive_int, default=256, help="values per fp32 scale in --comm-quant")
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
        p.error("--optimizer-in-backward steps each parameter as soon as its gradient is reduced, before the others exist: "
                "pass --max-norm 0 (clipping needs the norm of every gradient) and --optimizer adamw (Muon's matrices "
                f"are orthogonalized together); got --max-norm {args.max_norm} --optimizer {args.optimizer}")
    if args.hsdp is not None and world % args.hsdp:
        p.error(f"--hsdp {args.hsdp} must divide {where} ({world})")
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
        if key in ("config", "nproc") or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
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

    from fully_shard import MixedPrecisionPolicy, fully_shard
    from fully_shard.ckpt import CheckpointManager
    from fully_shard.optim import in_backward, local_step

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu") if args.device == "cpu" else torch.device(args.device, int(os.environ["LOCAL_RANK"]))
    mesh = (init_device_mesh(device.type, (world,)) if args.hsdp is None
            else init_device_mesh(device.type, (args.hsdp, world // args.hsdp)))
    out = Progress(enabled=rank == 0, want_bar=not args.no_progress)
    log = out.log

    # 1. data: BPE (rank 0 trains it, the others receive it) or bytes; 5% held out for eval
    tokens, vocab = tokenize(load_text(args.data), args.tokenizer, args.vocab_size)
    split = int(len(tokens) * 0.95)
    train_set, eval_set = WindowDataset(tokens[:split], args.seq_len), WindowDataset(tokens[split:], args.seq_len)
    sampler = StatefulBatchSampler(len(train_set), args.batch_size, rank, world, args.seed)  # -> a DataLoader below

    # 2. model: the same init on every rank, then (AC, compile,) fully_shard per block, then the root
    torch.manual_seed(args.seed)
    margs = ModelArgs(dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads, vocab_size=vocab, max_seq_len=args.seq_len)
    with torch.device(device):
        model = Transformer(margs)
        model.init_weights()
    n_params = sum(p.numel() for p in model.parameters())
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if args.mixed_precision == "bf16" else MixedPrecisionPolicy())
    for i, block in enumerate(model.layers):
        if args.activation_checkpointing:
            block = model.layers[i] = checkpoint_wrapper(block)
        if args.compile:
            block.compile()  # in place: parameter names and state-dict keys unchanged
        fully_shard(block, mesh=mesh, reshard_after_forward=RESHARD[args.reshard_after_forward], mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=RESHARD[args.reshard_after_forward], mp_policy=mp)
    if args.comm_quant != "none":  # after fully_shard: the Comm objects go on every sharded module
        from fully_shard.quant import quantize_comms

        quantized = quantize_comms(model, weights="int8", grads=args.comm_quant, block_size=args.comm_quant_block)
        log("quantized collectives: " + "; ".join(f"{name or '(root)'}: {how}" for name, how in list(quantized.items())[:2])
            + (f"; ... ({len(quantized)} modules)" if len(quantized) > 2 else ""))
    adamw = dict(lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    if args.optimizer == "muon":  # each block matrix orthogonalized once, on its owner rank
        from fully_shard.optim import MuonAdamW, muon_param_groups

        optimizers: list[torch.optim.Optimizer] = [MuonAdamW(
            muon_param_groups(model), lr=args.lr, weight_decay=0.1, adjust_lr_fn="match_rms_adamw", adamw_lr=args.lr,
            adamw_betas=(0.9, 0.95), adamw_weight_decay=0.1)]
    elif args.optimizer_in_backward:  # one AdamW per parameter, stepped by the parameter's hook once its gradient lands
        optimizers = list(in_backward(model, lambda ps, **kw: local_step(torch.optim.AdamW(ps, **kw)), **adamw).values())
    else:  # local_step: AdamW steps on the local shards as plain tensors (bitwise the same, state stays DTensor)
        optimizers = [local_step(torch.optim.AdamW(model.parameters(), **adamw))]
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lr_lambda(args.warmup, args.steps)) for o in optimizers]
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
        start, losses, evals = int(saved["step"]), [float(x) for x in saved["losses"]], [tuple(e) for e in saved["evals"]]
        log(f"resumed from {path}: step {start}, model, optimizer, schedule, RNG and data position "
            f"(epoch {sampler.epoch}, batch {sampler.batch}) restored")
    batches = iter(DataLoader(train_set, batch_sampler=sampler, num_workers=0))  # type: ignore[arg-type]

    # 4. the training loop
    tokens_per_step = args.batch_size * args.seq_len * world * args.grad_accum
    flops = flops_per_token(n_params, args.n_layers, args.dim, args.seq_len)
    peak = peak_flops(device, args.peak_tflops)
    metrics = Metrics(args.metrics if rank == 0 else None, args.tensorboard if rank == 0 else None, start > 0)
    fmt = repr if args.exact_loss else (lambda x: f"{x:.4f}")
    prof = None if args.profile is None else start_profiler(args.profile, rank, device)
    train_time, mem = 0.0, 0
    out.start(total=args.steps, initial=start)
    for step in range(start + 1, args.steps + 1):
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
            log(f"checkpoint: {args.ckpt_dir}/step_{step}" + (" (writing in the background)" if args.ckpt_async else ""))
    if prof is not None:
        prof.stop()
        log(f"profile: {args.profile}/rank<r>.json (open in https://ui.perfetto.dev or chrome://tracing)")
    for closing in (manager, out, metrics):  # the manager waits for an asynchronous save
        if closing is not None:
            closing.close()
    if start >= args.steps:
        log(f"nothing to do: the checkpoint is at step {start}, and --steps is {args.steps}")
        return
    tps = (args.steps - start) * tokens_per_step / train_time
    log(f"summary: final loss {fmt(losses[-1])} (first {fmt(losses[0])}) | eval loss {fmt(evals[-1][1])} | "
        f"{tps:,.0f} tokens/s | {train_time:.1f} s | parameters + gradients + optimizer state per rank {fmt_bytes(mem)}")
    log(f"metrics: {args.metrics}")
    if rank == 0 and not args.no_plot:
        title = f"examples/train.py: {args.n_layers} blocks, dim {args.dim}, {world} ranks, mesh {tuple(mesh.shape)}"
        log(save_loss_curve(args.plot, losses, evals, start, title))


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
        return launch_script(os.path.abspath(__file__), args.nproc, worker_argv(args))
    import torch
    import torch.distributed as dist

    resolve_device(args, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))  # under torchrun: each process, the same answer
    if args.device != "cpu":
        torch.accelerator.set_device_index(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("gloo" if args.device == "cpu" else dist.get_default_backend_for_device(args.device))
    try:
        run(args)
        dist.barrier()  # rank 0 may still be writing the plot
    finally:
        dist.destroy_process_group()
    leave_worker(0)  # gloo: no interpreter shutdown after collectives (see common.py)
    return 0


if __name__ == "__main__":
    sys.exit(main())
