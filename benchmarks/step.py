"""Step time, peak memory and collectives of one model under fully_shard, torch FSDP2, DDP and one unsharded
process, on 2 gloo ranks (4 for HSDP), and what fully_shard's planner predicts of them.

Every implementation starts from the same initial weights (one model built with seed 0 on every rank, deep-copied)
and sees the same per-rank token batches. The peak memory of each library is the tracker's (``support/storages.py``)
over one steady-state step; the plan (``fully_shard.plan`` with the job's own sharding as ``shard_fn``) is compared
with fully_shard's peak without activations, and its collectives with those recorded for both libraries.
"""

from __future__ import annotations

import copy
import functools
import gc
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from support.llama import FSDP_IMPLS, Llama, LlamaArgs, loss_fn, param_count, shard_model, tokens
from support.storages import StorageTracker

from .fmt import mib, ms, save_figure, table
from .models import BENCH_OVERHEAD, BENCH_SMALL, BENCH_TINY


def _mesh(job: dict[str, Any], world: int) -> Any:
    shape = tuple(job.get("mesh_shape") or (world,))
    names = ("dp_replicate", "dp_shard") if len(shape) == 2 else ("dp",)
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _build(impl: str, base: Llama, job: dict[str, Any], mesh: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    model: nn.Module = copy.deepcopy(base)
    if impl in FSDP_IMPLS:
        shard_model(model, impl, mesh, job["reshard"], job["mp"])  # type: ignore[arg-type]
    elif impl == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    # foreach=True for every implementation (the CUDA default; on CPU torch defaults to a
    # per-parameter loop, whose per-op DTensor dispatch would dominate the FSDP steps)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    return model, opt


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, mem: StorageTracker | None = None) -> float:
    if mem is not None:
        mem.phase("forward")
    loss = loss_fn(model(x), x)
    if mem is not None:
        mem.phase("backward")
    loss.backward()
    if mem is not None:
        mem.phase("optimizer")
    opt.step()
    opt.zero_grad(set_to_none=True)
    if mem is not None:
        mem.phase(None)
    return float(loss.detach())


class _Runner:
    """One model + optimizer + its own step counter over the shared batch sequence."""

    def __init__(self, impl: str, base: Llama, job: dict[str, Any], mesh: Any, batches: list[torch.Tensor]) -> None:
        self.impl = impl
        self.model, self.opt = _build(impl, base, job, mesh)
        self.batches = batches
        self.n = 0
        self.last_loss = float("nan")

    def steps(self, k: int) -> None:
        for _ in range(k):
            self.last_loss = _step(self.model, self.opt, self.batches[self.n % len(self.batches)])
            self.n += 1


def _timed(runner: _Runner, k: int) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    runner.steps(k)
    return (time.perf_counter() - t0) / k


def _max_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _summary(samples: list[float]) -> dict[str, Any]:
    return {
        "median_s": statistics.median(samples),
        "min_s": min(samples),
        "max_s": max(samples),
        "samples_s": samples,
    }


def _dtype_bytes(name: str) -> int:
    return torch.empty((), dtype=getattr(torch, name)).element_size()


def _record_collectives(runner: _Runner) -> dict[str, Any]:
    from support.collectives import CollectiveRecorder

    x = runner.batches[runner.n % len(runner.batches)]
    runner.n += 1
    with CollectiveRecorder() as rec:
        loss = loss_fn(runner.model(x), x)
        rec.mark("backward")
        loss.backward()
        rec.mark("optimizer")
        runner.opt.step()
        runner.opt.zero_grad(set_to_none=True)
    out: dict[str, Any] = {}
    for phase, records in rec.phases().items():
        name = phase or "forward"
        kinds: dict[str, Any] = {}
        for r in records:
            k = kinds.setdefault(r.kind, {"count": 0, "input_bytes": 0, "dtypes": []})
            k["count"] += 1
            k["input_bytes"] += r.numel * _dtype_bytes(r.dtype)
            if r.dtype not in k["dtypes"]:
                k["dtypes"].append(r.dtype)
        out[name] = kinds
    return out


def _tracked_step(mem: Any, runner: _Runner, batches: list[torch.Tensor]) -> dict[str, Any]:
    """One step inside ``mem`` from a fresh peak: its peaks, breakdown and model-state peak (absolute bytes)."""
    gc.collect()
    before = mem.current
    mem.reset_peak(snapshot=True)
    x = batches[runner.n % len(batches)]
    runner.n += 1
    mem.phase("forward")
    loss = loss_fn(runner.model(x), x)
    mem.phase("backward")
    loss.backward()
    params = [p for p in runner.model.parameters()]
    grads = [p.grad for p in params if p.grad is not None]
    opt_state = [v for s in runner.opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    mem.phase("optimizer")
    runner.opt.step()
    mem.phase(None)
    breakdown = mem.breakdown({"params": params, "grads": grads, "optimizer": opt_state})
    state = {"params": mem.bytes_of(params), "grads": mem.bytes_of(grads), "optimizer": mem.bytes_of(opt_state)}
    runner.opt.zero_grad(set_to_none=True)
    del loss, x, params, grads, opt_state
    gc.collect()
    return {"before": before, "after": mem.current, "peak": mem.peak, "phase_peaks": dict(mem.phase_peaks),
            "breakdown": breakdown, "state": state,
            "model_state": mem.report(existing=False)["model_state"]}  # activations and gloo's copies aside


def _measure_memory(impl: str, base: Llama, job: dict[str, Any], mesh: Any,
                    batches: list[torch.Tensor]) -> dict[str, Any]:
    """Peak live storage bytes of a steady-state step, built inside the tracker.

    Two steps are tracked (the 2nd and 3rd: optimizer state exists) and the one with the smaller peak without
    activations is reported, both peaks beside it: what gloo does on its own threads is invisible to the tracker
    and once, on a loaded CI machine, one step counted one more block-sized buffer (a reduce-scatter input's
    worth) than the plan and than every other run.
    """
    gc.collect()
    with StorageTracker() as mem:  # counts what is allocated inside: not base, not the batches
        start = mem.current
        runner = _Runner(impl, base, job, mesh, batches)
        runner.steps(1)  # optimizer state now exists
        steps = [_tracked_step(mem, runner, batches) for _ in range(2)]
    del runner
    gc.collect()
    best = min(steps, key=lambda s: s["model_state"])
    return {
        "peak_bytes": best["peak"] - start,
        "phase_peak_bytes": {k: v - start for k, v in best["phase_peaks"].items()},
        "live_before_step_bytes": best["before"] - start,
        "live_after_step_bytes": best["after"] - start,
        "at_peak": best["breakdown"],
        "model_state_bytes": best["model_state"],
        "model_state_bytes_per_step": [s["model_state"] for s in steps],
        "state_bytes": best["state"],
    }


def step_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(0)
    args = LlamaArgs(**job["args"])
    base = Llama(args)
    mesh = _mesh(job, world)
    batches = [tokens(s, rank, args, job["batch"], job["seq"]) for s in range(4)]
    result: dict[str, Any] = {"world_size": world, "mesh_shape": list(mesh.shape)}
    k = job["steps_per_sample"]
    clock = time.perf_counter()
    phase_s: dict[str, float] = {}

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        phase_s[name] = now - clock
        clock = now

    result["phase_s"] = phase_s

    # -- fully_shard vs torch FSDP2, interleaved in the same processes ----------------
    runners = {impl: _Runner(impl, base, job, mesh, batches) for impl in FSDP_IMPLS}
    for impl in FSDP_IMPLS:
        runners[impl].steps(job["warmup"])
    samples: dict[str, list[float]] = {impl: [] for impl in FSDP_IMPLS}
    for i in range(job["pairs"]):
        order = FSDP_IMPLS if i % 2 == 0 else FSDP_IMPLS[::-1]
        for impl in order:
            samples[impl].append(_timed(runners[impl], k))
    for impl in FSDP_IMPLS:
        samples[impl] = _max_over_ranks(samples[impl])
    ratios = [a / b for a, b in zip(samples["fully_shard"], samples["torch_fsdp2"])]
    result["step_time"] = {impl: _summary(samples[impl]) for impl in FSDP_IMPLS}
    result["ratio"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "pairs": ratios}
    result["final_loss"] = {impl: runners[impl].last_loss for impl in FSDP_IMPLS}
    result["steps_taken"] = {impl: runners[impl].n for impl in FSDP_IMPLS}

    lap("fsdp_timing")
    # -- collectives of one step (after the timed ones: prefetch order is established) --
    if job.get("collectives", True):
        result["collectives"] = {impl: _record_collectives(runners[impl]) for impl in FSDP_IMPLS}
    del runners
    gc.collect()

    lap("collectives")
    # -- baselines: DDP (both ranks), one unsharded process (rank 0 alone) -------------
    if job.get("baselines", True):
        ddp = _Runner("ddp", base, job, mesh, batches)
        ddp.steps(job["warmup"])
        ddp_samples = _max_over_ranks([_timed(ddp, k) for _ in range(job["pairs"])])
        result["step_time"]["ddp"] = _summary(ddp_samples)
        result["final_loss"]["ddp"] = ddp.last_loss
        del ddp
        gc.collect()
        dist.barrier()
        if rank == 0:
            single = _Runner("unsharded", base, job, mesh, batches)
            single.steps(job["warmup"])
            times = []
            for _ in range(job["pairs"]):
                t0 = time.perf_counter()
                single.steps(k)
                times.append((time.perf_counter() - t0) / k)
            result["step_time"]["unsharded"] = _summary(times)
            del single
            gc.collect()
        dist.barrier()

    lap("baselines")
    # -- peak memory per rank ------------------------------------------------------------
    if job.get("memory", True):
        memory: dict[str, Any] = {}
        impls = list(FSDP_IMPLS) + (["ddp"] if job.get("baselines", True) else [])
        for impl in impls:
            dist.barrier()
            memory[impl] = _measure_memory(impl, base, job, mesh, batches)
        dist.barrier()
        if job.get("baselines", True) and rank == 0:
            memory["unsharded"] = _measure_memory("unsharded", base, job, mesh, batches)
        dist.barrier()
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, memory)
        result["memory_per_rank"] = gathered
    lap("memory")
    return result


# -- the configurations, run and planned -------------------------------------------------------------------------


def _describe(args: LlamaArgs, batch: int, seq: int) -> str:
    return (f"{param_count(args) / 1e6:.2f}M params, {args.n_layers} blocks of dim {args.dim} "
            f"(ffn {args.ffn_dim}, vocab {args.vocab_size}), batch {batch}x{seq} per rank")


def configs(quick: bool) -> list[dict[str, Any]]:
    if quick:
        job = dict(args=BENCH_TINY.as_dict(), batch=2, seq=16, mp="fp32", reshard=True, warmup=1, pairs=1,
                   steps_per_sample=1)
        return [{"name": "tiny-fsdp", "description": _describe(BENCH_TINY, 2, 16), "job": job}]
    common = dict(args=BENCH_SMALL.as_dict(), batch=4, seq=64, warmup=2, pairs=5, steps_per_sample=2)
    desc = _describe(BENCH_SMALL, 4, 64)
    # memory is not the point of the overhead config (and tracking 32 blocks is slow)
    overhead = dict(args=BENCH_OVERHEAD.as_dict(), batch=1, seq=8, mp="fp32", reshard=True, warmup=1, pairs=5,
                    steps_per_sample=2, memory=False)
    return [
        {"name": "transformer-fsdp", "description": desc + ", fp32, reshard_after_forward=True",
         "job": dict(common, mp="fp32", reshard=True)},
        {"name": "transformer-no-reshard", "description": desc + ", fp32, reshard_after_forward=False",
         "job": dict(common, mp="fp32", reshard=False)},
        {"name": "transformer-bf16",
         "description": desc + ", MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)",
         "job": dict(common, mp="bf16", reshard=True)},
        {"name": "hsdp-2x2", "world_size": 4, "description": _describe(BENCH_SMALL, 2, 64) + ", fp32, HSDP mesh "
         "(replicate 2, shard 2) on 4 ranks",
         "job": dict(common, batch=2, mp="fp32", reshard=True, mesh_shape=[2, 2], warmup=1)},
        {"name": "overhead", "description": _describe(BENCH_OVERHEAD, 1, 8) + ", fp32", "job": overhead},
    ]


def planned(job: dict[str, Any], world: int) -> list[dict[str, Any]]:
    """``fully_shard.plan`` of the job's step on every rank: its sharding as ``shard_fn``, AdamW with ``foreach``."""
    import fully_shard

    shape = tuple(job.get("mesh_shape") or (world,))
    out = []
    for rank in range(world):  # rank r of the world is shard rank r % N (the shard dim is the inner one)
        plan = fully_shard.plan(functools.partial(Llama, LlamaArgs(**job["args"])), shape, rank=rank % shape[-1],
                                shard_fn=lambda model, mesh: shard_model(model, "fully_shard", mesh, job["reshard"],
                                                                         job["mp"]),
                                device_type="cpu", foreach=True)
        out.append({k: getattr(plan, k) for k in ("peak_bytes", "peak_at", *_COUNTS.values(), *_BYTES.values())})
    return out


def run(quick: bool, log: Any) -> list[dict[str, Any]]:
    from .spawn import run_job

    done = []
    for cfg in configs(quick):
        log(f"[benchmarks] {cfg['name']}: {cfg['description']}")
        world = cfg.get("world_size", 2)
        res, err, wall = run_job(step_job, cfg["job"], nprocs=world, timeout_s=480)
        done.append(dict(cfg, result=res, error=err, wall_s=wall, planned=planned(cfg["job"], world)))
        log(f"[benchmarks]   done in {wall:.0f} s" + (f" (error: {err.splitlines()[-1]})" if err else ""))
    return done


# -- the page --------------------------------------------------------------------------------------------------------

_COUNTS = {"all_gather": "all_gathers", "reduce_scatter": "reduce_scatters", "all_reduce": "all_reduces"}  # the plan's
_BYTES = {"all_gather": "all_gather_input_bytes", "reduce_scatter": "reduce_scatter_input_bytes",
          "all_reduce": "all_reduce_bytes"}
IMPL_NAMES = {"fully_shard": "fully_shard", "torch_fsdp2": "torch FSDP2", "ddp": "DDP",
              "unsharded": "unsharded (1 proc)"}
TARGET_RATIO_TRANSFORMER, TARGET_RATIO_OVERHEAD, TARGET_PLAN = 0.9, 0.5, 0.01


def recorded(res: dict[str, Any], impl: str) -> dict[str, tuple[int, int]]:
    """(count, input bytes) per kind of the recorded step's collectives, all phases together."""
    out: dict[str, tuple[int, int]] = {}
    for kinds in res["collectives"][impl].values():
        for kind, k in kinds.items():
            n, b = out.get(kind, (0, 0))
            out[kind] = (n + k["count"], b + k["input_bytes"])
    return out


def _of_plan(plan: dict[str, Any]) -> dict[str, tuple[int, int]]:
    return {kind: (plan[_COUNTS[kind]], plan[_BYTES[kind]]) for kind in _COUNTS if plan[_COUNTS[kind]]}


def verdict(ratio: dict[str, float]) -> str:
    if ratio["max"] < 1.0:
        return "fully_shard faster in every pair"
    if ratio["min"] > 1.0:
        return "fully_shard slower in every pair"
    return "no difference beyond the spread"


def _time_row(c: dict[str, Any]) -> list[Any]:
    if not c["result"]:
        return [c["name"], c["description"], "error (see Errors)"] + [""] * 6
    st, r, loss = c["result"]["step_time"], c["result"]["ratio"], c["result"]["final_loss"]
    same = loss["fully_shard"] == loss["torch_fsdp2"]
    return [c["name"], c["description"], ms(st["fully_shard"]["median_s"]), ms(st["torch_fsdp2"]["median_s"]),
            f"**{r['median']:.2f}** [{r['min']:.2f}, {r['max']:.2f}] ({len(r['pairs'])} pairs)", verdict(r),
            ms(st.get("ddp", {}).get("median_s")), ms(st.get("unsharded", {}).get("median_s")),
            "bitwise equal" if same else f"{loss['fully_shard']:.6g} vs {loss['torch_fsdp2']:.6g}"]


def _cells(got: dict[str, tuple[int, int]]) -> list[str]:
    return [f"{n} / {b:,} B" if n else "0" for n, b in (got.get(kind, (0, 0)) for kind in _COUNTS)]


def render(done: list[dict[str, Any]]) -> list[str]:
    ran = [c for c in done if c["result"]]
    out = ["## Step time", "",
           table(["config", "model / batch", "fully_shard ms", "torch FSDP2 ms", "ratio median [min, max]",
                                      "verdict", "DDP ms", "unsharded ms",
                  "loss after the timed steps (ours vs torch)"],
                                     [_time_row(c) for c in done]), "",
           "`unsharded` is one process (rank 0 alone, rank 1 idle) running the per-rank batch: the compute floor of "
           "one rank. DDP and unsharded run in fp32 in every config (also `bf16`). HSDP runs on 4 ranks (2 replicas x "
           "2 shards), so 4 processes share the cores: compare its ratio, not its absolute times, with the 2-rank "
           "rows.",
           ""]
    rows = []
    for c in ran:
        for rank, m in enumerate(c["result"].get("memory_per_rank") or []):
            ours, theirs, plan = m["fully_shard"], m["torch_fsdp2"], c["planned"][rank]["peak_bytes"]
            rows.append([c["name"], rank, mib(ours["peak_bytes"]), mib(theirs["peak_bytes"]),
                         f"{ours['peak_bytes'] / theirs['peak_bytes']:.3f}", mib(m.get("ddp", {}).get("peak_bytes")),
                         mib(m.get("unsharded", {}).get("peak_bytes")), mib(ours["model_state_bytes"]), mib(plan),
                         f"{plan / ours['model_state_bytes'] - 1:+.2%}",
                         max(ours["phase_peak_bytes"], key=ours["phase_peak_bytes"].get)])
    out += ["## Peak memory per rank (exact storage bytes)", "",
            "Peak of live tensor-storage bytes during one steady-state step (of the 2nd and 3rd, optimizer state "
            "existing, the one with the smaller peak without activations), from "
            "`support/storages.py`'s `StorageTracker` (a TorchDispatchMode that follows every untyped storage and "
            "`UntypedStorage.resize_`; not RSS); the model is built inside the tracker. `without activations`: "
            "fully_shard's peak of parameters, gradients, optimizer state and buffers in flight (activations and "
            "gloo's private copies aside), against `fully_shard.plan` of the same sharding on a fake process group "
            "(docs/tools.md).", "",
            table(["config", "rank", "fully_shard MiB", "torch FSDP2 MiB", "ours/torch", "DDP MiB", "unsharded MiB",
                   "fully_shard without activations MiB", "planned MiB", "plan vs measured", "ours peak phase"], rows),
            ""]
    rows = []
    for c in (c for c in ran if "collectives" in c["result"]):
        want = _of_plan(c["planned"][0])
        rows.append([c["name"], "fully_shard.plan", *_cells(want), ""])
        for impl in ("fully_shard", "torch_fsdp2"):
            got = recorded(c["result"], impl)
            rows.append([c["name"], IMPL_NAMES[impl], *_cells(got), "equal" if got == want else "**differs**"])
    out += ["## Collectives per step per rank", "",
            "Recorded with `support.collectives.CollectiveRecorder` over one steady-state step (forward, backward, "
            "optimizer step), rank 0: count / input bytes (all-gather: the padded shard; reduce-scatter: W x it), "
            "against the plan's, which are the collectives fully_shard issued on the fake process group.", "",
            table(["config", "who", "all-gathers", "reduce-scatters", "all-reduces", "vs plan"], rows), ""]
    return out


def targets(done: list[dict[str, Any]]) -> list[list[str]]:
    rows: list[list[str]] = []
    for c in (c for c in done if c["result"]):
        target = TARGET_RATIO_OVERHEAD if c["name"] == "overhead" else TARGET_RATIO_TRANSFORMER
        r = c["result"]["ratio"]
        ok = "met" if r["max"] <= target else ("not met" if r["min"] > target else "unclear (spread straddles it)")
        rows.append([f"step time `{c['name']}` <= {target}x torch",
                     f"{r['median']:.2f}x [{r['min']:.2f}, {r['max']:.2f}]", ok])
        mem = c["result"].get("memory_per_rank")
        if mem:
            worst = max(m["fully_shard"]["peak_bytes"] / m["torch_fsdp2"]["peak_bytes"] for m in mem)
            rows.append([f"peak memory `{c['name']}` <= torch", f"max over ranks {worst:.3f}x torch",
                         "met" if worst <= 1.0 else "not met"])
            error = max(abs(p["peak_bytes"] / m["fully_shard"]["model_state_bytes"] - 1)
                        for m, p in zip(mem, c["planned"]))
            rows.append([f"planned peak `{c['name']}` within 1% of measured", f"max over ranks {error:.3%}",
                         "met" if error <= TARGET_PLAN else "not met"])
    checks = [recorded(c["result"], impl) == _of_plan(c["planned"][0]) for c in done
              if c["result"] and "collectives" in c["result"] for impl in ("fully_shard", "torch_fsdp2")]
    if checks:
        rows.append(["collectives (count and bytes) as planned", f"{sum(checks)}/{len(checks)} checks",
                     "met" if all(checks) else "not met"])
    return rows


def plots(done: list[dict[str, Any]], plt: Any, out_dir: str, stem: str) -> list[str]:
    ran = [c for c in done if c["result"]]
    if not ran:
        return []
    fig, ax = plt.subplots(figsize=(max(4, 1.5 * len(ran)), 4))
    ratios = [c["result"]["ratio"] for c in ran]
    ax.errorbar(range(len(ran)), [r["median"] for r in ratios], fmt="o", capsize=5,
                yerr=[[r["median"] - r["min"] for r in ratios], [r["max"] - r["median"] for r in ratios]])
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(TARGET_RATIO_TRANSFORMER, color="gray", lw=0.8, ls="--", label="target 0.9 (transformer)")
    ax.axhline(TARGET_RATIO_OVERHEAD, color="gray", lw=0.8, ls=":", label="target 0.5 (overhead)")
    ax.set_xticks(list(range(len(ran))))
    ax.set_xticklabels([c["name"] for c in ran], rotation=20, ha="right", fontsize=8)
    ax.set(ylabel="step time fully_shard / torch FSDP2", title="median ratio, bars = min/max over pairs")
    ax.legend(fontsize=7)
    return [save_figure(plt, fig, out_dir, f"{stem}-step-time-ratio.png")]
