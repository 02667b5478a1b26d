"""Per-rank bodies of the 2-rank jobs: step time, peak memory and collectives of one model
under fully_shard, torch FSDP2, DDP and one unsharded process; fully_shard application
time on a meta-device model.

Every implementation starts from the same initial weights (one model built with seed 0 on
every rank, deep-copied) and sees the same per-rank token batches.
"""

from __future__ import annotations

import copy
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from . import analytic
from .memory import StorageTracker
from .models import Llama, LlamaArgs, loss_fn, tokens

FSDP_IMPLS = ("fully_shard", "torch_fsdp2")


def _api(impl: str) -> tuple[Callable[..., Any], type]:
    if impl == "fully_shard":
        from fully_shard import MixedPrecisionPolicy, fully_shard
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # type: ignore[assignment]
    return fully_shard, MixedPrecisionPolicy


def shard_model(model: Llama, impl: str, mesh: Any, reshard: bool, mp: str) -> Llama:
    """fully_shard each block (``reshard_after_forward=reshard``), then the root (default)."""
    fully_shard, MP = _api(impl)
    policy = MP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mp == "bf16" else MP()
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def _mesh(job: dict[str, Any], world: int) -> Any:
    shape = tuple(job.get("mesh_shape") or (world,))
    names = ("dp_replicate", "dp_shard") if len(shape) == 2 else ("dp",)
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _hsdp_support(mesh: Any) -> str | None:
    """None if fully_shard accepts this 2-D (replicate, shard) mesh; else why not."""
    from fully_shard import fully_shard

    try:
        fully_shard(nn.Linear(4, 4), mesh=mesh)
    except NotImplementedError as exc:
        return f"NotImplementedError: {exc}"
    return None


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
    from tests.collectives import CollectiveRecorder

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


def _measure_memory(impl: str, base: Llama, job: dict[str, Any], mesh: Any, batches: list[torch.Tensor]) -> dict[str, Any]:
    """Peak live storage bytes of one steady-state step (the 2nd), built inside the tracker."""
    gc.collect()
    with StorageTracker() as mem:  # counts what is allocated inside: not base, not the batches
        start = mem.current
        runner = _Runner(impl, base, job, mesh, batches)
        runner.steps(1)  # optimizer state now exists
        gc.collect()
        before = mem.current
        mem.reset_peak(snapshot=True)
        x = batches[runner.n % len(batches)]
        mem.phase("forward")
        loss = loss_fn(runner.model(x), x)
        mem.phase("backward")
        loss.backward()
        params = [p for p in runner.model.parameters()]
        grads = [p.grad for p in params if p.grad is not None]
        opt_state = [v for s in runner.opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        # the forward+backward peak, split; then the whole step's (the optimizer may top it)
        fwd_bwd_peak = mem.peak
        fwd_bwd_breakdown = mem.breakdown({"params": params, "grads": grads, "optimizer": opt_state})
        mem.phase("optimizer")
        runner.opt.step()
        mem.phase(None)
        breakdown = mem.breakdown({"params": params, "grads": grads, "optimizer": opt_state})
        state = {
            "params": mem.bytes_of(params),
            "grads": mem.bytes_of(grads),
            "optimizer": mem.bytes_of(opt_state),
        }
        runner.opt.zero_grad(set_to_none=True)
        del loss, x, params, grads, opt_state
        gc.collect()
        after = mem.current
        peak = mem.peak
        phase_peaks = dict(mem.phase_peaks)
    del runner
    gc.collect()
    return {
        "peak_bytes": peak - start,
        "phase_peak_bytes": {k: v - start for k, v in phase_peaks.items()},
        "live_before_step_bytes": before - start,
        "live_after_step_bytes": after - start,
        "at_peak": breakdown,
        "fwd_bwd_peak_bytes": fwd_bwd_peak - start,
        "at_fwd_bwd_peak": fwd_bwd_breakdown,
        "state_bytes": state,
    }


def step_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(0)
    args = LlamaArgs(**job["args"])
    base = Llama(args)
    mesh = _mesh(job, world)
    shard_world = mesh.size(mesh.ndim - 1)  # the shard dim is the last one (HSDP: replicate, shard)
    replicate = world // shard_world
    batches = [tokens(s, rank, args, job["batch"], job["seq"]) for s in range(4)]
    result: dict[str, Any] = {"world_size": world, "mesh_shape": list(mesh.shape)}
    if mesh.ndim == 2:
        support = _hsdp_support(mesh)
        if support is not None:
            return {"not_supported": support, "world_size": world, "mesh_shape": list(mesh.shape)}
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

    groups = analytic.plan_groups(base, list(base.layers), reshard_blocks=job["reshard"], reshard_root=False)
    bf16 = job["mp"] == "bf16"
    result["analytic"] = {
        "collectives": analytic.collective_bytes(
            groups, shard_world, torch.bfloat16 if bf16 else None, torch.float32 if bf16 else None, replicate
        ),
        # rank r of the world is shard rank r % shard_world (the shard dim is the inner one)
        "state_bytes_per_rank": [
            analytic.per_rank_state_bytes(groups, shard_world, r % shard_world) for r in range(world)
        ],
        "group_unsharded_bytes": sorted(
            (g.padded_numel(shard_world) * (2 if bf16 else 4) for g in groups), reverse=True
        ),
        "all_groups_unsharded_bytes": sum(g.padded_numel(shard_world) * (2 if bf16 else 4) for g in groups),
        "n_params": sum(p.numel() for p in base.parameters()),
        "n_groups": len(groups),
    }

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


# -- meta-device application time ----------------------------------------------------------


def meta_apply_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    args = LlamaArgs(**job["args"])
    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        Llama(args)  # first meta build pays one-off lazy initialisation
    for impl in FSDP_IMPLS:  # ... and so does each library's first call (imports, caches)
        with torch.device("meta"):
            warm = Llama(LlamaArgs(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=16, vocab_size=16))
        shard_model(warm, impl, mesh, True, job["mp"])
    times: dict[str, list[float]] = {impl: [] for impl in FSDP_IMPLS}
    build: list[float] = []
    n_params = 0
    for rep in range(job["reps"]):
        for impl in FSDP_IMPLS if rep % 2 == 0 else FSDP_IMPLS[::-1]:
            t0 = time.perf_counter()
            with torch.device("meta"):
                model = Llama(args)
            build.append(time.perf_counter() - t0)
            n_params = sum(p.numel() for p in model.parameters())
            gc.collect()
            dist.barrier()
            t0 = time.perf_counter()
            shard_model(model, impl, mesh, True, job["mp"])
            times[impl].append(time.perf_counter() - t0)
            del model
    out: dict[str, Any] = {"n_params": n_params, "build_median_s": statistics.median(build)}
    for impl in FSDP_IMPLS:
        out[impl] = _summary(_max_over_ranks(times[impl]))
    return out


def quick_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """--quick: the step job and the meta application job in one spawn."""
    res = step_job(rank, world, job)
    res["meta_apply"] = meta_apply_job(rank, world, job["meta_apply"])
    return res
