"""fully_shard against its peers (issue 39): DeepSpeed ZeRO-3 (and ZeRO++) and SimpleFSDP, eager and compiled.

    /work/venvs/peers/bin/python -m benchmarks.peers [--worlds 2,4] [--mps fp32,bf16] [--rounds 6] [--profile]

Writes ``<out>/<date>-<machine>-peers.{json,md}`` after every job; docs/gen_figures.py renders it into docs/ (the
method: docs/benchmarks.md). The peers' setup lives here and only here:

* DeepSpeed (the ``peers`` extra, in a venv of its own): ``DS_ACCELERATOR=cpu`` before its import;
  ``deepspeed.initialize`` over the gloo group already made, a torch ``AdamW`` as client optimizer, the config of
  :func:`ds_config`: stage 3 with ``stage3_param_persistence_threshold: 0`` (its default, 1e5 elements, would leave
  every weight of this small model unsharded); bf16 with ``communication_data_type: fp32``; ZeRO++'s quantized
  weights and gradients. Its first ``init_distributed`` on CPU builds a shared-memory extension with ninja (once).
* SimpleFSDP (torchtitan 0.3.0): ``data_parallel(model, mesh, mode="fully_shard")``, ``torch.compile(model)`` for the
  compiled row. Its gradients are sums over ranks, so its loss is divided by the world size: the same step.
* Megatron-FSDP: GPU only (0.6.1 calls ``torch.cuda.current_device()`` whatever device it is given).
A new row (fully_shard with the whole step compiled) is one name in ``NAMES``, a case in ``_build``, a ``PAIRS`` pair.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

PARITY_STEPS, BATCH, SEQ = 4, 4, 64
RTOL = {"fp32": 1e-4, "bf16": 3e-2, "quant": 3e-2}  # bf16: against the fp32 oracle; quant: int8 collectives
NAMES = {"fully_shard": "fully_shard", "fully_shard_int8": "fully_shard int8 weights+grads",
         "fully_shard_compiled_blocks": "fully_shard, compiled blocks",
         "fully_shard_compiled_whole": "fully_shard, torch.compile whole",
         "fully_shard_compiled_whole_bucketed": "fully_shard, torch.compile whole, bucketed",
         "fully_shard_compiled_whole_reordered": "fully_shard, torch.compile whole, overlap passes",
         "zero3": "DeepSpeed ZeRO-3",
         "zero3_pp": "DeepSpeed ZeRO++ (qW+qG)", "simple_fsdp": "SimpleFSDP",
         "simple_fsdp_compiled": "SimpleFSDP, torch.compile"}
IMPLS = tuple(NAMES)
# (ours, peer) per row; SimpleFSDP compiled against fully_shard compiled per block and whole (issue 37: the whole
# step against our eager and per-block steps too)
PAIRS = [("fully_shard", "zero3"), ("fully_shard_int8", "zero3_pp"), ("fully_shard", "simple_fsdp"),
         ("fully_shard_compiled_blocks", "simple_fsdp_compiled"),
         ("fully_shard_compiled_whole", "simple_fsdp_compiled"), ("fully_shard_compiled_whole", "fully_shard"),
         ("fully_shard_compiled_whole", "fully_shard_compiled_blocks"),
         ("fully_shard_compiled_whole_bucketed", "simple_fsdp_compiled"),
         ("fully_shard_compiled_whole_bucketed", "fully_shard"),
         ("fully_shard_compiled_whole_bucketed", "fully_shard_compiled_whole"),
         ("fully_shard_compiled_whole_reordered", "simple_fsdp_compiled"),
         ("fully_shard_compiled_whole_reordered", "fully_shard"),
         ("fully_shard_compiled_whole_reordered", "fully_shard_compiled_whole")]
# inductor's passes (fully_shard.compile_options, docs/compile.md): bucketed, every all-gather of a graph in one and
# every reduce-scatter in one; reordered, its scheduler's overlap passes (skipped under deterministic algorithms)
PASSES = {"bucketed": {"bucket": True, "overlap": False}, "reordered": {"bucket": False, "overlap": True}}


def ds_config(mp: str, world: int, quant: bool) -> dict[str, Any]:
    """DeepSpeed's config of the job (see the module docstring)."""
    zero: dict[str, Any] = {"stage": 3, "stage3_param_persistence_threshold": 0, "overlap_comm": False}
    if quant:
        zero.update(zero_quantized_weights=True, zero_quantized_gradients=True)
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
                           "train_batch_size": BATCH * world, "zero_optimization": zero, "gradient_clipping": 0.0,
                           "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    if mp == "bf16":
        cfg.update(bf16={"enabled": True}, communication_data_type="fp32")
    return cfg


def _build(impl: str, base: Any, mp: str, mesh: Any, world: int) -> Any:
    """The step of one implementation: ``step(x, loss_fn) -> loss``."""
    import torch

    model, scale = copy.deepcopy(base), 1.0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    if impl.startswith("zero3"):
        os.environ["DS_ACCELERATOR"] = "cpu"
        import deepspeed

        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(mp, world, impl == "zero3_pp"))
        return lambda x, loss_of: _step(engine, x, loss_of, engine.backward, engine.step)  # step() zeroes the grads
    if impl.startswith("simple_fsdp"):
        from torchtitan.experiments.graph_trainer.simple_fsdp import MixedPrecisionPolicy, data_parallel

        pol = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if mp == "bf16" else None
        model, scale = data_parallel(model, mesh, mode="fully_shard", mp_policy=pol), 1.0 / world  # sums over ranks
        model = torch.compile(model) if impl.endswith("compiled") else model
    elif impl.startswith("fully_shard"):
        from support.llama import shard_model

        if impl.endswith("compiled_blocks"):
            for block in model.layers:  # as torchtitan compiles: each block, before sharding
                block.compile()
        shard_model(model, "fully_shard", mesh, True, mp)
        if "compiled_whole" in impl:  # after sharding: every group's collectives in one graph, the root's too
            from fully_shard import compile_options, compile_whole

            passes = PASSES.get(impl.rsplit("_", 1)[-1])
            compile_whole(model, options=compile_options(**passes) if passes else None)
        if impl.endswith("int8"):
            from fully_shard.quant import quantize_comms

            quantize_comms(model, weights="int8", grads="int8")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)  # over the sharded parameters
    return lambda x, loss_of: _step(model, x, loss_of, lambda loss: (loss * scale).backward(),
                                    lambda: (opt.step(), opt.zero_grad(set_to_none=True)))


def _step(model: Any, x: Any, loss_of: Any, backward: Any, update: Any) -> float:
    loss = loss_of(model(x), x)
    backward(loss)
    update()
    return float(loss.detach())


def _agree(impl: str, errors: dict[str, str], rank: int, world: int) -> None:
    """Every rank learns whether ``impl`` failed on any rank (its build or its parity steps), and with which error.

    A failure on one rank only (seen once: a compiled job's rank left the parity steps while the others waited in a
    collective) would otherwise leave that rank out of the timed steps the others run, and the job hang. A rank that
    fails mid-step leaves the others inside that step's collective, which this cannot mend: its traceback is on
    stderr (``peers_job``)."""
    import torch.distributed as dist

    found: list[Any] = [None] * world
    dist.all_gather_object(found, errors.get(impl))
    failed = [(r, e) for r, e in enumerate(found) if e is not None]
    if failed and impl not in errors:
        r, e = failed[0]
        errors[impl] = f"rank {r}: {e}"


def _error(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"


def peers_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from support.llama import Llama, loss_fn, tokens
    from support.storages import StorageTracker

    from .models import BENCH_SMALL, BENCH_TINY

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_SIZE=str(world))  # DeepSpeed
    # an inductor cache per rank: ranks compiling the same graph at once never share (or race on) a cache entry
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"fully_shard_peers_inductor_{rank}")
    args, mp = BENCH_TINY if job["quick"] else BENCH_SMALL, job["mp"]
    torch.manual_seed(0)
    base, mesh = Llama(args), init_device_mesh("cpu", (world,))
    batch = [tokens(s, rank, args, BATCH, SEQ) for s in range(4)]
    out: dict[str, Any] = {"world": world, "mp": mp, "errors": {}, "parity": {}, "memory": {}}
    # -- the oracle: one unsharded fp32 model stepping on every rank's batch at once (= the mean of the ranks' losses)
    step, losses = _build("unsharded", base, "fp32", mesh, world), []
    for s in range(PARITY_STEPS):
        losses.append(step(torch.cat([tokens(s % 4, r, args, BATCH, SEQ) for r in range(world)]), loss_fn))
    steps, n = {}, {}
    for impl in (i for i in IMPLS if i in job["impls"]):
        try:
            steps[impl], n[impl] = _build(impl, base, mp, mesh, world), PARITY_STEPS
            t = torch.tensor([steps[impl](batch[s % 4], loss_fn) for s in range(PARITY_STEPS)], dtype=torch.float64)
            dist.all_reduce(t)
            mean = (t / world).tolist()
            diff = max(abs(a - b) / abs(b) for a, b in zip(mean, losses))
            tol = RTOL["quant" if impl.endswith(("int8", "_pp")) else mp]
            out["parity"][impl] = {"losses": mean, "oracle": losses, "max_rel_diff": diff, "rtol": tol,
                                   "ok": diff <= tol}
        except Exception as exc:  # a peer that does not run here: its error is reported
            out["errors"][impl] = _error(exc)
            print(f"rank {rank}: {impl} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        _agree(impl, out["errors"], rank, world)
        if impl in out["errors"]:  # on some rank: none times it (a rank left out of the others' steps would hang them)
            steps.pop(impl, None)
            out["parity"].pop(impl, None)
    # -- timing (of those with loss parity): rounds of one step each in a rotating order (round 0 a warm-up), the
    # slowest rank per round
    names = [i for i in steps if out["parity"].get(i, {}).get("ok")]
    samples: dict[str, list[float]] = {impl: [] for impl in names}
    for i in range(job["rounds"] + 1):
        for impl in names[i % len(names):] + names[:i % len(names)]:
            dist.barrier()
            t0 = time.perf_counter()
            steps[impl](batch[n[impl] % 4], loss_fn)
            samples[impl] += [time.perf_counter() - t0] if i else []
            n[impl] += 1
    for impl in names if job.get("profile") else []:  # one more step each under torch.profiler, every rank alike
        with torch.profiler.profile() as prof:
            steps[impl](batch[n[impl] % 4], loss_fn)
        out.setdefault("profile", {})[impl] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
    if job["memory"] and any("compiled" in i for i in names):  # the compiled jobs: one more step each, profiled
        for impl in names:
            dist.barrier()
            out["memory"][impl] = _step_peak(functools.partial(steps[impl], batch[n[impl] % 4], loss_fn))
        out["memory_method"] = "step"
    dist.barrier()
    if names:
        t = torch.tensor([samples[i] for i in names], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        samples = dict(zip(names, t.tolist()))
    out["samples_s"] = samples
    del steps
    # -- peak memory of the eager implementations, rank 0's: the build and two steps inside the tracker
    for impl in (i for i in names if job["memory"] and "memory_method" not in out):
        dist.barrier()
        gc.collect()
        try:
            with StorageTracker() as mem:
                start, step = mem.current, _build(impl, base, mp, mesh, world)
                step(batch[0], loss_fn), step(batch[1], loss_fn)
                out["memory"][impl] = mem.peak - start
        except Exception as exc:
            out["errors"][f"memory {impl}"] = _error(exc)
        step = None
    return out


def _step_peak(step: Any) -> int:
    """The most bytes the CPU allocator held during ``step()`` beyond what it held when the step began: the running sum
    of torch.profiler's memory events (every allocation and free, inductor's buffers too, which the storage tracker
    cannot see)."""
    from torch.profiler import profile

    with profile(profile_memory=True) as prof:
        step()
    net = peak = 0
    events = (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")  # type: ignore[union-attr]
    for event in sorted(events, key=lambda e: e.start_ns()):
        net += event.nbytes()
        peak = max(peak, net)
    return peak


def summarize(res: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (ours, peer) pair that both ran: medians and the per-round ratio's median, min and max."""
    rows, s, m = [], res["samples_s"], res["memory"]
    for ours, peer in ((o, p) for o, p in PAIRS if o in s and p in s):
        r = [a / b for a, b in zip(s[ours], s[peer])]
        rows.append({"ours": ours, "peer": peer, "ours_s": statistics.median(s[ours]),
                     "peer_s": statistics.median(s[peer]), "ratio": statistics.median(r), "min": min(r),
                     "max": max(r), "mem_ratio": m[ours] / m[peer] if peer in m and ours in m else None})
    return rows


def render(results: dict[str, Any]) -> list[str]:
    from .fmt import mib, ms, table

    rows, parity, errors = [], [], []
    for run in results["runs"]:
        res, tag = run["result"], f"{run['world']} ranks, {run['mp']}"
        if res is None:
            errors.append(f"* {tag}: the job failed: {run['error'].strip().splitlines()[-1]}")
            continue
        for r in summarize(res):
            spread = "faster in every round" if r["max"] < 1 else "slower in every round" if r["min"] > 1 else "mixed"
            mem = "-" if r["mem_ratio"] is None else (f"{mib(res['memory'][r['ours']])} / "
                                                      f"{mib(res['memory'][r['peer']])} ({r['mem_ratio']:.2f}x)")
            rows.append([tag, NAMES[r["ours"]], NAMES[r["peer"]], ms(r["ours_s"]), ms(r["peer_s"]),
                         f"**{r['ratio']:.2f}x** [{r['min']:.2f}, {r['max']:.2f}]", spread, mem])
        parity += [[tag, NAMES[impl], f"{p['max_rel_diff']:.1e}", f"{p['rtol']:.0e}",
                    "ok" if p["ok"] else "**failed: not timed**"] for impl, p in res["parity"].items()]
        errors += [f"* {tag}: {NAMES.get(i, i)} did not run: `{e}`" for i, e in res["errors"].items()]
    step_peaks = any(run["result"] and run["result"].get("memory_method") == "step" for run in results["runs"])
    return [table(["run", "ours", "peer", "ours ms", "peer ms", "ours / peer [min, max]", "spread",
                   "peak MiB ours / peer"], rows), "",
            *(["Peak MiB, rank 0's: in the eager jobs, what the storage tracker saw over the build and two steps; "
               "in the compiled jobs, for every implementation of the job alike, the most the CPU allocator held "
               "during one step beyond what it held when the step began (torch.profiler's memory events, which "
               "inductor's buffers are in).", ""] if step_peaks else []),
            f"Loss parity over the first {PARITY_STEPS} steps (mean over ranks) against one unsharded fp32 model "
            "stepping on all ranks' batches, before anything is timed:", "",
            table(["run", "implementation", "max relative difference", "tolerance", "parity"], parity),
            *([""] + errors if errors else [])]


def header(results: dict[str, Any]) -> str:
    return (f"`python -m benchmarks.peers` at commit {results['commit']}, torch {results['torch']}, "
            f"{results['cores']} CPU cores, {results['wall_s']:.0f} s; 1-minute load average {results['load_before']} "
            f"before and {results['load_after']} after (the run's own ranks count too); the per-round spread is the "
            f"measure of noise. {results['note']}").strip()


def main(argv: list[str] | None = None) -> int:
    import torch

    from .spawn import run_job

    p = argparse.ArgumentParser(prog="python -m benchmarks.peers", description=__doc__.splitlines()[0])
    for name, default in (("worlds", "2,4"), ("mps", "fp32,bf16"), ("impls", ",".join(IMPLS)), ("note", "")):
        p.add_argument(f"--{name}", default=default)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--quick", action="store_true", help="the tiny model, 2 rounds, no memory")
    p.add_argument("--out", default=os.path.join("benchmarks", "results"))
    p.add_argument("--profile", action="store_true", help="one step each under torch.profiler (rank 0), in the json")
    a = p.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    results: dict[str, Any] = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
                               "cores": os.cpu_count(), "commit": commit, "load_before": round(os.getloadavg()[0], 2),
                               "note": a.note, "quick": a.quick, "runs": []}
    stem = os.path.join(a.out, f"{results['date']}-{platform.system().lower()}-{platform.machine()}-"
                               f"{os.cpu_count()}cpu-peers")
    t0, wanted, worlds = time.perf_counter(), a.impls.split(","), [int(w) for w in a.worlds.split(",")]
    # the eager rows first (fp32, then bf16), the compiled ones (fp32 only) last
    jobs = [(w, mp, [i for i in wanted if "compiled" not in i]) for mp in a.mps.split(",") for w in worlds]
    # (the eager fully_shard again beside them: the compiled whole step against our eager one, in the same job)
    compiled = [i for i in wanted if "compiled" in i] + ["fully_shard"] * ("fully_shard" in wanted)
    jobs += [(w, "fp32", compiled) for w in worlds if "fp32" in a.mps and "compiled" in "".join(compiled)]
    for world, mp, impls in (j for j in jobs if j[2]):
        job = {"mp": mp, "quick": a.quick, "rounds": 2 if a.quick else a.rounds, "memory": not a.quick,
               "impls": impls, "profile": a.profile}
        print(f"[peers] {world} ranks, {mp}: {', '.join(impls)}", file=sys.stderr, flush=True)
        res, err, wall = run_job(peers_job, job, nprocs=world, timeout_s=3000)
        results["runs"].append({"world": world, "mp": mp, "result": res, "error": err, "wall_s": wall})
        results.update(load_after=round(os.getloadavg()[0], 2), wall_s=time.perf_counter() - t0)
        with open(stem + ".json", "w") as f:
            json.dump(results, f, indent=1)
        with open(stem + ".md", "w") as f:
            f.write("\n".join([f"# fully_shard and its peers: {results['date']}", "", header(results), "",
                               *render(results)]) + "\n")
    return 0 if all(r["result"] for r in results["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
