"""fully_shard against its peers on one job (issue 39): DeepSpeed ZeRO-3 (and ZeRO++) and SimpleFSDP.

    /work/venvs/peers/bin/python -m benchmarks.peers [--worlds 2,4] [--rounds 8] [--quick]

Writes ``<out>/<date>-<machine>-peers.{json,md}``; docs/gen_figures.py renders the newest into docs/performance.md and
docs/benchmarks.md. Every implementation trains the same model (``BENCH_SMALL``) from the same weights on the same
per-rank batches with ``AdamW(lr=1e-3, foreach=True)``, in the same gloo processes. First each runs ``PARITY_STEPS``
steps whose loss (the mean over ranks) is compared with one unsharded model stepping on every rank's batch at once;
only those within the tolerance are timed: rounds of one step each, every implementation once per round in a rotating
order, the slowest rank per round; ratio = fully_shard / peer per round (median and min-max). Peak memory: the storage
tracker (``support/storages.py``) over the build and two steps of each eager implementation.

The peers' setup lives here and only here:

* DeepSpeed (``pip install -e '.[peers]'``, in its own venv so the system Python keeps torch as it is):
  ``DS_ACCELERATOR=cpu`` before its import; ``deepspeed.initialize`` over the gloo group already made, with a
  torch ``AdamW`` as client optimizer (``zero_allow_untested_optimizer``) and the config of :func:`ds_config`: stage 3,
  ``stage3_param_persistence_threshold: 0`` (its default, 1e5 elements, would keep every weight of this small model
  unsharded: at real sizes every weight is above it), bf16 with ``communication_data_type: fp32`` (the gradient
  reduction in fp32, as fully_shard's ``reduce_dtype``), ZeRO++'s ``zero_quantized_weights`` and
  ``zero_quantized_gradients``. Its first ``init_distributed`` on CPU compiles a shared-memory extension with ninja
  (minutes, once; cached in ``~/.cache/torch_extensions``).
* SimpleFSDP (torchtitan 0.3.0): ``data_parallel(model, mesh, mode="fully_shard")`` on the whole model; its gradients
  are summed over ranks (``Partial("sum")``: torchtitan divides the loss by the global token count), so its loss is
  divided by the world size here, which makes the step equal to the others'. Compiled: ``torch.compile(model)``.
* Megatron-FSDP runs on a GPU only (0.6.1 calls ``torch.cuda.current_device()`` whatever device it is given).

``IMPLS`` maps a name to its builder; a new row (e.g. a fully_shard whole-step compiled mode) is one entry there and
one pair in ``PAIRS``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys
import time
from typing import Any

PARITY_STEPS = 4
RTOL = {"fp32": 1e-4, "bf16": 3e-2, "quant": 3e-2}  # bf16: against the fp32 oracle; quant: int8 collectives
# (ours, peer) ratios reported per row; the compiled SimpleFSDP against fully_shard with compiled blocks
PAIRS = [("fully_shard", "zero3"), ("fully_shard_int8", "zero3_pp"), ("fully_shard", "simple_fsdp"),
         ("fully_shard_compiled_blocks", "simple_fsdp_compiled")]
BATCH, SEQ = 4, 64


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


def _deepspeed(model: Any, mp: str, world: int, quant: bool) -> tuple[Any, Any, Any]:
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(mp, world, quant))

    def step(x: Any, loss_of: Any) -> float:
        loss = loss_of(engine(x), x)
        engine.backward(loss)
        engine.step()  # also zeroes the gradients
        return float(loss.detach())
    return engine, opt, step


def _build(impl: str, base: Any, mp: str, mesh: Any, world: int) -> Any:
    """(step function, modules) of one implementation; ``step(x, loss_fn) -> loss``."""
    import torch

    model = copy.deepcopy(base)
    if impl.startswith("zero3"):
        return _deepspeed(model, mp, world, impl == "zero3_pp")[2]
    scale = 1.0
    if impl.startswith("simple_fsdp"):
        from torchtitan.experiments.graph_trainer.simple_fsdp import MixedPrecisionPolicy, data_parallel

        pol = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if mp == "bf16" else None
        model = data_parallel(model, mesh, mode="fully_shard", mp_policy=pol)
        scale = 1.0 / world  # its gradients are sums over ranks
        if impl.endswith("compiled"):
            model = torch.compile(model)
    elif impl.startswith("fully_shard"):
        from support.llama import shard_model

        if impl.endswith("compiled_blocks"):
            for block in model.layers:  # as torchtitan compiles: each block, before sharding
                block.compile()
        shard_model(model, "fully_shard", mesh, True, mp)
        if impl.endswith("int8"):
            from fully_shard.quant import quantize_comms

            quantize_comms(model, weights="int8", grads="int8")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)

    def step(x: Any, loss_of: Any) -> float:
        loss = loss_of(model(x), x)
        (loss * scale).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())
    return step


IMPLS = ("fully_shard", "fully_shard_int8", "fully_shard_compiled_blocks", "zero3", "zero3_pp", "simple_fsdp",
         "simple_fsdp_compiled")
EAGER = ("fully_shard", "fully_shard_int8", "zero3", "zero3_pp", "simple_fsdp")


def peers_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from support.llama import Llama, loss_fn, tokens
    from support.storages import StorageTracker

    from .models import BENCH_SMALL, BENCH_TINY

    for k, v in {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world, "LOCAL_SIZE": world}.items():
        os.environ[k] = str(v)  # DeepSpeed reads them
    args = BENCH_TINY if job["quick"] else BENCH_SMALL
    torch.manual_seed(0)
    base, mesh, mp = Llama(args), init_device_mesh("cpu", (world,)), job["mp"]
    batch = [tokens(s, rank, args, BATCH, SEQ) for s in range(4)]
    out: dict[str, Any] = {"world": world, "mp": mp, "errors": {}, "parity": {}, "memory": {}}

    # -- the oracle: one unsharded fp32 model stepping on every rank's batch, the mean over ranks of the losses
    oracle, losses = copy.deepcopy(base), []
    opt = torch.optim.AdamW(oracle.parameters(), lr=1e-3, foreach=True)
    for s in range(PARITY_STEPS):
        x = torch.cat([tokens(s % 4, r, args, BATCH, SEQ) for r in range(world)])
        loss = loss_fn(oracle(x), x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    del oracle, opt
    steps, n = {}, {}
    for impl in (i for i in IMPLS if i in job["impls"]):
        try:
            steps[impl] = _build(impl, base, mp, mesh, world)
            mine = [steps[impl](batch[s % 4], loss_fn) for s in range(PARITY_STEPS)]
            t = torch.tensor(mine, dtype=torch.float64)
            dist.all_reduce(t)
            mean = (t / world).tolist()
            diff = max(abs(a - b) / abs(b) for a, b in zip(mean, losses))
            tol = RTOL["quant" if impl.endswith(("int8", "_pp")) else mp]
            out["parity"][impl] = {"losses": mean, "oracle": losses, "max_rel_diff": diff, "rtol": tol,
                                   "ok": diff <= tol}
            n[impl] = PARITY_STEPS
            if diff > tol:
                del steps[impl]
        except Exception as exc:  # a peer that does not run here: its error is the row
            out["errors"][impl] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            steps.pop(impl, None)
    # -- timing: rounds of one step each, rotating order, the slowest rank per round
    names = list(steps)
    samples: dict[str, list[float]] = {impl: [] for impl in names}
    for i in range(job["rounds"] + 1):  # round 0 is a warm-up (a compiled step may still recompile once)
        for impl in names[i % len(names):] + names[:i % len(names)]:
            dist.barrier()
            t0 = time.perf_counter()
            steps[impl](batch[n[impl] % 4], loss_fn)
            if i:
                samples[impl].append(time.perf_counter() - t0)
            n[impl] += 1
    if job.get("profile") and rank == 0:  # one more step each under torch.profiler: its busiest ops, rank 0's
        for impl in names:
            with torch.profiler.profile() as prof:
                steps[impl](batch[n[impl] % 4], loss_fn)
            out.setdefault("profile", {})[impl] = prof.key_averages().table(sort_by="self_cpu_time_total",
                                                                            row_limit=20)
        dist.barrier()
    elif job.get("profile"):
        dist.barrier()
    if names:
        t = torch.tensor([samples[i] for i in names], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        samples = dict(zip(names, t.tolist()))
    out["samples_s"] = samples
    del steps
    gc.collect()
    # -- peak memory of the eager implementations: build and two steps inside the tracker, rank 0's
    for impl in (i for i in EAGER if i in names and job["memory"]):
        dist.barrier()
        gc.collect()
        try:
            with StorageTracker() as mem:
                start = mem.current
                step = _build(impl, base, mp, mesh, world)
                step(batch[0], loss_fn)
                step(batch[1], loss_fn)
                out["memory"][impl] = mem.peak - start
            del step
        except Exception as exc:
            out["errors"][f"memory {impl}"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        gc.collect()
    return out


def summarize(res: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (ours, peer) pair that both ran: medians and the per-round ratio's median, min and max."""
    rows, s = [], res["samples_s"]
    for ours, peer in PAIRS:
        if ours in s and peer in s:
            r = [a / b for a, b in zip(s[ours], s[peer])]
            rows.append({"ours": ours, "peer": peer, "ours_s": statistics.median(s[ours]),
                         "peer_s": statistics.median(s[peer]), "ratio": statistics.median(r), "min": min(r),
                         "max": max(r), "mem_ratio": (res["memory"][ours] / res["memory"][peer]
                                                      if peer in res["memory"] and ours in res["memory"] else None)})
    return rows


NAMES = {"fully_shard": "fully_shard", "fully_shard_int8": "fully_shard int8 weights+grads",
         "fully_shard_compiled_blocks": "fully_shard, compiled blocks", "zero3": "DeepSpeed ZeRO-3",
         "zero3_pp": "DeepSpeed ZeRO++ (qW+qG)", "simple_fsdp": "SimpleFSDP", "simple_fsdp_compiled":
         "SimpleFSDP, torch.compile"}


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
        for impl, p in res["parity"].items():
            parity.append([tag, NAMES[impl], f"{p['max_rel_diff']:.1e}", f"{p['rtol']:.0e}",
                           "ok" if p["ok"] else "**failed: not timed**"])
        errors += [f"* {tag}: {NAMES.get(i, i)} did not run: `{e}`" for i, e in res["errors"].items()]
    return ["| run | ours | peer | ours ms | peer ms | ours / peer [min, max] | spread | peak MiB ours / peer |",
            *table(["a"] * 8, rows).splitlines()[1:], "",
            f"Loss parity over the first {PARITY_STEPS} steps (mean over ranks) against one unsharded fp32 model "
            "stepping on all ranks' batches, before anything is timed:", "",
            table(["run", "implementation", "max relative difference", "tolerance", "parity"], parity),
            *([""] + errors if errors else [])]


def main(argv: list[str] | None = None) -> int:
    import datetime
    import json
    import platform

    from .spawn import run_job

    p = argparse.ArgumentParser(prog="python -m benchmarks.peers", description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--mps", default="fp32,bf16")
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--quick", action="store_true", help="the tiny model, 2 rounds, no memory")
    p.add_argument("--out", default=os.path.join("benchmarks", "results"))
    p.add_argument("--note", default="")
    p.add_argument("--profile", action="store_true", help="one step each under torch.profiler (rank 0), in the json")
    a = p.parse_args(argv)
    import subprocess

    import torch
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    results: dict[str, Any] = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
                               "cores": os.cpu_count(), "commit": commit, "load_before": round(os.getloadavg()[0], 2),
                               "note": a.note, "quick": a.quick, "runs": []}
    stem = os.path.join(a.out, f"{results['date']}-{platform.system().lower()}-{platform.machine()}-"
                               f"{os.cpu_count()}cpu-peers")
    t0, wanted = time.perf_counter(), a.impls.split(",")
    # the eager rows first (fp32, then bf16), the compiled ones (fp32 only) last: the results are written after each
    jobs = [(w, mp, [i for i in wanted if "compiled" not in i]) for mp in a.mps.split(",") for w in worlds(a)]
    jobs += [(w, "fp32", [i for i in wanted if "compiled" in i]) for w in worlds(a) if "fp32" in a.mps]
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
    print(stem + ".md")
    runs = results["runs"]
    return 0 if all(r["result"] for r in runs) else 1


def worlds(a: argparse.Namespace) -> list[int]:
    return [int(w) for w in a.worlds.split(",")]


def header(results: dict[str, Any]) -> str:
    return (f"`python -m benchmarks.peers` at commit {results['commit']}, torch {results['torch']}, "
            f"{results['cores']} CPU cores, {results['wall_s']:.0f} s; load average {results['load_before']} before "
            f"and {results['load_after']} after: the machine was shared with other jobs, so times are noisy and the "
            f"per-round spread is the measure. {results['note']}").strip()


if __name__ == "__main__":
    sys.exit(main())
