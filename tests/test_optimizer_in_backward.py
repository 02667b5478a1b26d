"""Post-accumulate-grad hooks on the sharded parameters, and the optimizer stepped inside backward.

torch's FSDP2 runs each sharded parameter's ``register_post_accumulate_grad_hook`` hooks once its reduced gradient is
in ``.grad`` (after the reduce-scatter, and the all-reduce under HSDP), which is how an optimizer steps in backward.

Oracles: torch's FSDP2 running the same program in the same processes (which hooks fire, in which order, in which
micro-batch, and the gradient each sees: bitwise, the same reductions), the unsharded model (each hook's gradient is
this rank's rows of the averaged gradient, ``ref_tol``), and the usual step (``optimizer.step()`` after backward:
bitwise for elementwise optimizers, which update each shard element from the same element either way).
"""

from __future__ import annotations

import copy
import functools
import gc
import weakref
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from fully_shard import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from fully_shard.optim import in_backward, local_step
from tests.harness import mesh, run_distributed
from tests.models import Transformer, batch, loss_fn
from tests.oracle import REF_TOL, ShardwiseOptimizer, average_gradients, close, ref_tol, rows

# case -> (world size, HSDP, micro-batches per step, how the micro-batches before the last skip the reduction)
CASES: dict[str, tuple[int, bool, int, str | None]] = {
    "fsdp-1": (1, False, 1, None),  # one rank: the reduction is the identity (no collective), the hooks still run
    "fsdp-2": (2, False, 1, None),
    "fsdp-4-accum": (4, False, 3, "sync"),  # set_requires_gradient_sync(False): no hook before the synced one
    "accum-2": (2, False, 3, "sync"),
    "not-last-2": (2, False, 3, "last"),  # set_is_last_backward(False): reduced, so hooked, every micro-batch
    "offload-2": (2, False, 1, None),
    "mp-2": (2, False, 2, "sync"),
    "hsdp-4": (4, True, 1, None),
    "hsdp-4-all-reduce": (4, True, 3, "all_reduce"),  # set_requires_all_reduce(False): no hook before the all-reduce
    "hsdp-4-accum": (4, True, 2, "sync"),
}


def _policies(case: str, ours: bool) -> dict[str, Any]:
    if case.startswith("offload"):  # no pinning: the CPU has nothing to pin for (torch's would fail)
        return {"offload_policy": (CPUOffloadPolicy if ours else TorchCPUOffloadPolicy)(pin_memory=False)}
    if case.startswith("mp"):
        policy = MixedPrecisionPolicy if ours else TorchMixedPrecisionPolicy
        return {"mp_policy": policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    return {}


def _shard(model: nn.Module, ours: bool, device_mesh: Any, **kw: Any) -> nn.Module:
    shard_fn = fully_shard if ours else torch_fully_shard
    for block in model.layers:
        shard_fn(block, mesh=device_mesh, **kw)
    shard_fn(model, mesh=device_mesh, **kw)
    return model


def _dp_mesh(world: int, hsdp: bool) -> Any:
    return mesh((2, world // 2), ("replicate", "shard")) if hsdp else mesh(world)


def _record(log: list[tuple[Any, ...]], name: str, expected: nn.Parameter, when: list[Any], sharded: list[nn.Parameter],
            param: torch.Tensor) -> None:
    assert param is expected, f"{name}: the hook got another tensor than the parameter it was registered on"
    g = param.grad
    assert isinstance(g, DTensor), f"{name}: the hook saw a {type(g).__name__} gradient"
    # what every sharded gradient holds at this moment: torch sets one parameter's gradient, runs its hooks, then the
    # next
    others = tuple(None if q.grad is None else q.grad.to_local().sum().item() for q in sharded)
    log.append((name, when[0], g.dtype, g.device.type, g.placements, others, g.to_local().clone()))


def _hooks_like_torch(case: str) -> dict[str, Any]:
    world, hsdp, micro, skip = CASES[case]
    device_mesh = _dp_mesh(world, hsdp)
    shard_rank, shard_size = device_mesh.get_local_rank(device_mesh.ndim - 1), device_mesh.size(device_mesh.ndim - 1)
    ref = Transformer()
    models = {name: _shard(copy.deepcopy(ref), name == "ours", device_mesh, **_policies(case, name == "ours"))
              for name in ("ours", "torch")}
    when: list[Any] = [None]  # (step, micro-batch) while that backward runs, "outside" between them
    logs: dict[str, list[tuple[Any, ...]]] = {name: [] for name in models}
    handles = []  # removed at the end: a hook holding its parameter is a cycle gc cannot free (leaks into later tests)
    for name, model in models.items():
        sharded = list(model.parameters())  # outside forward and backward: the sharded parameters
        for pname, p in model.named_parameters():
            handles.append(p.register_post_accumulate_grad_hook(functools.partial(_record, logs[name], pname, p, when,
                                                                                   sharded)))
    steps, ref_grads = 2, []
    for name, model in (*models.items(), ("ref", ref)):
        for step in range(steps):
            for m in range(micro):
                last = m == micro - 1
                if name != "ref" and skip is not None:
                    {"sync": model.set_requires_gradient_sync, "all_reduce": model.set_requires_all_reduce,
                     "last": model.set_is_last_backward}[skip](last)
                x = batch(step * micro + m, dist.get_rank())
                loss = loss_fn(model(x), x)
                when[0] = (step, m)
                loss.backward()
                when[0] = "outside"
            if name == "ref":
                average_gradients(ref)
                ref_grads.append({n: rows(p.grad, shard_size, shard_rank) for n, p in ref.named_parameters()})
            model.zero_grad(set_to_none=True)
    for handle in handles:
        handle.remove()
    ours, theirs = logs["ours"], logs["torch"]
    assert [e[:5] for e in ours] == [e[:5] for e in theirs], (
        "hooks differ from torch's FSDP2 (name, (step, micro-batch), grad dtype, device, placements):\n"
        f"ours:  {[e[:5] for e in ours]}\ntorch: {[e[:5] for e in theirs]}")
    for a, b in zip(ours, theirs):
        assert a[5] == b[5], (f"{case}: when the hook of {a[0]} ran at {a[1]}, the gradients (sums) were {a[5]}, "
                              f"torch's {b[5]}")
        close(a[6], b[6], 0.0, f"{case}: the gradient the hook of {a[0]} saw at {a[1]}, vs torch FSDP2's")  # bitwise
    # each step: every parameter's hooks once, in its last micro-batch (in each one when each one is reduced)
    names = [n for n, _ in models["ours"].named_parameters()]
    fire_at = [(s, m) for s in range(steps) for m in (range(micro) if skip == "last" else [micro - 1])]
    assert sorted((e[1], e[0]) for e in ours) == sorted((w, n) for w in fire_at for n in names), [e[:2] for e in ours]
    worst = 0.0
    if not case.startswith("mp"):  # bf16 compute: torch FSDP2 is the oracle there
        # "last": a sum of averages, not an average of sums
        tol = REF_TOL["grad"] if skip == "last" else ref_tol("grad")
        final = {(e[1][0], e[0]): e[6] for e in ours}  # the last gradient each hook saw in each step
        for (step, name), g in final.items():
            worst = max(worst,
                        close(g, ref_grads[step][name], tol, f"{case}: hook of {name} in step {step} vs reference"))
    return {"order": [e[0] for e in ours], "names": names, "dtypes": sorted({str(e[2]) for e in ours}),
            "devices": sorted({e[3] for e in ours}), "worst_vs_ref": worst}


@pytest.mark.parametrize("case", list(CASES))
def test_post_accumulate_grad_hooks_like_torch(case: str) -> None:
    results = run_distributed(_hooks_like_torch, CASES[case][0], case)
    # backward order: the last block's group first, the root's last (its parameters are reduced at the end of backward)
    first = results[0]["order"][: len(results[0]["names"])]
    assert first[0].startswith("layers.2.") and sorted(first) == sorted(results[0]["names"]), first
    assert first[-4:] == ["tok_embeddings.weight", "norm.weight", "output.weight", "logit_scale"], first
    for r in results:
        assert r["dtypes"] == ["torch.float32"], r  # mixed precision too: the sharded fp32 gradient
        assert r["devices"] == ["cpu"] or not case.startswith("offload"), r


def _in_backward_vs_step(opt_name: str, hsdp: bool, micro: int, local: bool) -> dict[str, float]:
    world = dist.get_world_size()
    device_mesh = _dp_mesh(world, hsdp)
    shard_size = device_mesh.size(device_mesh.ndim - 1)
    make, kw = {"adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
                "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9))}[opt_name]
    ref = Transformer()
    models = {"step": _shard(copy.deepcopy(ref), True, device_mesh),
              "ours": _shard(copy.deepcopy(ref), True, device_mesh),
              "torch": _shard(copy.deepcopy(ref), False, device_mesh)}
    step_opt = make(models["step"].parameters(), **kw)  # the usual step, on the DTensors
    factory: Any = (lambda ps, **k: local_step(make(ps, **k))) if local else make
    in_backwards = [in_backward(models["ours"], factory, **kw), in_backward(models["torch"], factory, **kw)]
    ref_opt = ShardwiseOptimizer(ref.parameters(), shard_size, lambda ps: make(ps, **kw))
    worst = 0.0
    for step in range(3):
        losses: dict[str, torch.Tensor] = {}
        for name, model in (*models.items(), ("ref", ref)):
            for m in range(micro):
                if name != "ref":
                    model.set_requires_gradient_sync(m == micro - 1)
                x = batch(step * micro + m, dist.get_rank())
                loss = loss_fn(model(x), x)
                loss.backward()
                losses[name] = losses.get(name, 0) + loss.detach()
            if name == "step":
                step_opt.step()
                step_opt.zero_grad()
            elif name == "ref":
                average_gradients(ref)
                ref_opt.step()
                ref_opt.zero_grad()
            else:  # stepped inside backward, and each gradient freed there
                assert all(p.grad is None for p in model.parameters()), f"{name}: gradients left after backward"
        for name in ("ours", "torch"):
            close(losses[name], losses["step"], 0.0, f"step {step}: {name} in backward vs the usual step, loss")
        close(losses["ours"], losses["ref"], ref_tol("loss"), f"step {step}: loss vs reference")
    for hooks in in_backwards:
        hooks.remove()  # else the models outlive this call (a cycle through the hooks) and skew later memory tests
    params = {name: dict(m.named_parameters()) for name, m in models.items()}
    for name, p in params["ours"].items():
        # bitwise: an elementwise optimizer updates each element from the same element, in backward or after it
        close(p.to_local(), params["step"][name].to_local(), 0.0, f"{name}: in backward vs the usual step")
        close(p.to_local(), params["torch"][name].to_local(), 0.0, f"{name}: ours vs torch FSDP2, both in backward")
        worst = max(worst, close(p.full_tensor(), dict(ref.named_parameters())[name], ref_tol("param"),
                                 f"{name}: vs the unsharded reference"))
    return {"worst_vs_ref": worst}


@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
@pytest.mark.parametrize("hsdp", [False, True], ids=["fsdp-2", "hsdp-2x2"])
def test_in_backward_is_bitwise_the_usual_step(opt_name: str, hsdp: bool) -> None:
    run_distributed(_in_backward_vs_step, 4 if hsdp else 2, opt_name, hsdp, 2, False)


def test_local_step_optimizer_inside_the_hook() -> None:
    # local_step(AdamW) per parameter, stepped from the hook: bitwise AdamW on the DTensors after backward
    run_distributed(_in_backward_vs_step, 2, "adamw", False, 2, True)


def test_in_backward_on_a_plain_model_and_its_errors() -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    optimizers = in_backward(model, torch.optim.AdamW, lr=1e-2)
    assert list(optimizers) == list(model.parameters())
    for i in range(3):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(i))
        ref(x).square().sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        model(x).square().sum().backward()  # autograd runs the hooks of plain parameters
        assert all(p.grad is None for p in model.parameters())
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    # remove(): backward leaves the gradients in .grad again, and nothing holds the model any more
    optimizers.remove()
    optimizers.remove()  # idempotent
    model(torch.ones(1, 4)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))  # no step ran
    alive = weakref.ref(model[0].weight)
    del model, optimizers, p, q
    gc.collect()
    assert alive() is None, "the model outlived in_backward's remove()"
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError,
                       match=r"in_backward: the module Linear has no parameter that requires grad \(2 parameters"):
        in_backward(frozen, torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match=r"optimizer\(\[param\]\) must return a torch.optim.Optimizer, got list"):
        in_backward(nn.Linear(2, 2), lambda ps, **kw: ps)
