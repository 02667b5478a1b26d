"""Scale simulation in one process: a fake process group of W ranks plus meta-device models.

``dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=W)`` gives a
process group that reports W ranks and completes every collective without moving data.
Each point builds a Llama-3 shaped model on the meta device (no storage is allocated),
applies ``fully_shard`` (or torch's FSDP2) to every block and then to the root, with
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, and reads the per-rank sizes
off the sharded DTensors that it produced (their local shapes on rank 0, which holds the
most: ``torch.chunk`` leaves the last ranks the remainder). The same quantities are also
computed from the global shapes (:mod:`benchmarks.analytic`) and compared.

A second check runs one real forward+backward of a tiny model (CPU tensors, so the fake
collectives have something to "fill") at each world size with ``CollectiveRecorder``, and
compares the recorded collective bytes with the analytic formula.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from . import analytic
from .models import BENCH_TINY, Llama, LlamaArgs, loss_fn, param_count, tokens
from .step import FSDP_IMPLS, shard_model

PARAM_DTYPE = torch.bfloat16  # all-gather / compute dtype
REDUCE_DTYPE = torch.float32  # reduce-scatter dtype
STATE_DTYPE = torch.float32  # sharded parameters, gradients, AdamW state


def _fsdp_module_classes() -> tuple[type, ...]:
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    from fully_shard import FSDPModule

    return (FSDPModule, TorchFSDPModule)


def sharded_groups(model: nn.Module) -> list[list[nn.Parameter]]:
    """The parameters each fully_shard call manages: those reachable from an FSDP module
    without passing through a nested one (works for both libraries)."""
    classes = _fsdp_module_classes()
    groups: list[list[nn.Parameter]] = []
    for m in model.modules():
        if not isinstance(m, classes):
            continue
        params: list[nn.Parameter] = []
        stack = [m]
        while stack:
            sub = stack.pop()
            params.extend(p for p in sub._parameters.values() if p is not None)
            stack.extend(c for c in sub._modules.values() if c is not None and not isinstance(c, classes))
        groups.append(params)
    return groups


def measured_sizes(model: nn.Module, world: int) -> dict[str, Any]:
    """Per-rank (rank 0) sizes read off the sharded DTensors."""
    groups = sharded_groups(model)
    item = torch.empty((), dtype=PARAM_DTYPE).element_size()
    ritem = torch.empty((), dtype=REDUCE_DTYPE).element_size()
    local_bytes = 0
    group_ag: list[int] = []
    rs = 0
    non_dtensor = 0
    for params in groups:
        ag = 0
        for p in params:
            if not isinstance(p, DTensor):
                non_dtensor += 1
                continue
            local = p.to_local()
            local_bytes += local.numel() * local.element_size()
            # rank 0's slot is ceil(rows/W) rows: exactly the padded slot of the flat buffers
            ag += local.numel() * item
            rs += world * local.numel() * ritem
        group_ag.append(ag)
    unsharded = sorted((world * g for g in group_ag), reverse=True)
    return {
        "n_groups": len(groups),
        "non_dtensor_params": non_dtensor,
        "params_bytes": local_bytes,
        "grads_bytes": local_bytes,
        "optimizer_bytes": 2 * local_bytes,
        "unsharded_peak_bytes": sum(unsharded[:2]),
        "root_plus_two_blocks_bytes": group_ag[0] * world + sum(sorted(group_ag[1:], reverse=True)[:2]) * world,
        "ag_forward_input_bytes": sum(group_ag),
        "ag_backward_input_bytes": sum(group_ag[1:]),  # blocks; the root is not resharded
        "rs_input_bytes": rs,
    }


def analytic_sizes(model: nn.Module, world: int) -> dict[str, Any]:
    groups = analytic.plan_groups(model, list(model.layers), reshard_blocks=True, reshard_root=False)
    state = analytic.per_rank_state_bytes(groups, world, 0)
    comm = analytic.collective_bytes(groups, world, PARAM_DTYPE, REDUCE_DTYPE)
    return {
        "n_groups": len(groups),
        "params_bytes": state["params"],
        "grads_bytes": state["grads"],
        "optimizer_bytes": state["optimizer"],
        "unsharded_peak_bytes": analytic.unsharded_in_flight_bytes(groups, world, PARAM_DTYPE, k=2),
        "ag_forward_input_bytes": comm["forward"]["all_gather"]["input_bytes"],
        "ag_backward_input_bytes": comm["backward"]["all_gather"]["input_bytes"],
        "rs_input_bytes": comm["backward"]["reduce_scatter"]["input_bytes"],
    }


def _init(world: int) -> Any:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    return init_device_mesh("cpu", (world,))


def simulate_point(name: str, args: LlamaArgs, world: int, impls: tuple[str, ...]) -> dict[str, Any]:
    mesh = _init(world)
    point: dict[str, Any] = {"model": name, "world_size": world, "n_params": param_count(args)}
    for impl in impls:
        try:
            t0 = time.perf_counter()
            with torch.device("meta"):
                model = Llama(args)
            build_s = time.perf_counter() - t0
            if "analytic" not in point:
                point["analytic"] = analytic_sizes(model, world)
            gc.collect()
            t0 = time.perf_counter()
            shard_model(model, impl, mesh, True, "bf16")
            apply_s = time.perf_counter() - t0
            measured = measured_sizes(model, world)
            point[impl] = {"apply_s": apply_s, "build_s": build_s, "measured": measured}
            del model
        except Exception as exc:  # report exactly what broke, keep simulating
            point[impl] = {"error": f"{type(exc).__name__}: {exc}"}
    ours = point.get("fully_shard", {}).get("measured")
    if ours is not None and "analytic" in point:
        keys = [k for k in point["analytic"] if k != "n_groups"]
        point["measured_equals_analytic"] = all(ours[k] == point["analytic"][k] for k in keys)
    dist.destroy_process_group()
    return point


def fake_step_check(world: int, impls: tuple[str, ...]) -> dict[str, Any]:
    """One forward+backward of a tiny model over the fake group: recorded vs analytic bytes."""
    from tests.collectives import CollectiveRecorder

    mesh = _init(world)
    out: dict[str, Any] = {"world_size": world}
    args = BENCH_TINY
    for impl in impls:
        try:
            torch.manual_seed(0)
            model = Llama(args)
            groups = analytic.plan_groups(model, list(model.layers), reshard_blocks=True, reshard_root=False)
            expected = analytic.collective_bytes(groups, world, PARAM_DTYPE, REDUCE_DTYPE)
            shard_model(model, impl, mesh, True, "bf16")
            x = tokens(0, 0, args, 2, args.max_seq_len)
            with CollectiveRecorder() as rec:
                loss = loss_fn(model(x), x)
                rec.mark("backward")
                loss.backward()
            got: dict[str, Any] = {}
            for phase, records in rec.phases().items():
                for r in records:
                    k = got.setdefault(phase or "forward", {}).setdefault(r.kind, {"count": 0, "input_bytes": 0})
                    k["count"] += 1
                    k["input_bytes"] += r.numel * torch.empty((), dtype=getattr(torch, r.dtype)).element_size()
            out[impl] = {"recorded": got, "matches_analytic": got == expected}
            out.setdefault("analytic", expected)
        except Exception as exc:
            out[impl] = {"error": f"{type(exc).__name__}: {exc}"}
    dist.destroy_process_group()
    return out


def run_simulation(models: dict[str, LlamaArgs], worlds: list[int], impls: tuple[str, ...] = FSDP_IMPLS,
                   check_worlds: list[int] | None = None, log: Any = None,
                   torch_worlds: list[int] | None = None) -> dict[str, Any]:
    """``torch_worlds``: the world sizes at which torch's FSDP2 is applied too (default: all);
    fully_shard runs at every one of ``worlds``."""
    with torch.device("meta"):
        Llama(BENCH_TINY)  # one-off lazy initialisation of meta kernels, not timed
    mesh = _init(8)
    for impl in impls:  # each library's first call pays imports and caches: not timed either
        with torch.device("meta"):
            shard_model(Llama(BENCH_TINY), impl, mesh, True, "bf16")
    dist.destroy_process_group()
    points = []
    for name, args in models.items():
        for w in worlds:
            t0 = time.perf_counter()
            these = tuple(i for i in impls if i == "fully_shard" or torch_worlds is None or w in torch_worlds)
            points.append(simulate_point(name, args, w, these))
            if log is not None:
                log(f"  sim {name} W={w}: {time.perf_counter() - t0:.1f} s")
    checks = [fake_step_check(w, impls) for w in (check_worlds or [])]
    return {
        "param_dtype": str(PARAM_DTYPE),
        "reduce_dtype": str(REDUCE_DTYPE),
        "state_dtype": str(STATE_DTYPE),
        "points": points,
        "fake_step_checks": checks,
    }


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n}"
