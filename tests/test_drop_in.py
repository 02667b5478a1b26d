"""Drop-in with torch 2.13's FSDP2: the same public names, signatures and methods, and the
communication controls behaving as torch's do on the same model.

Behaviour tests train two copies of one small transformer side by side on 2 gloo ranks:
``fully_shard`` from this package and ``torch.distributed.fsdp.fully_shard`` (the oracle),
each configured through the same method calls, and compare losses and parameters.
Bitwise where noted: with 2 ranks both reduce the same flat layout with the same op, and an
average (or sum) of two numbers does not depend on the order of the reduction.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import fully_shard as ours_pkg
from tests.harness import device, device_type, run_distributed
from tests.models import ModelArgs, Transformer, batch, loss_fn
from tests.torch_features import has_torch_feature, requires_torch_feature, skip_without_torch_feature

ARGS = ModelArgs(n_layers=2, dim=32, ffn_dim=48, vocab_size=37)

# ---------------------------------------------------------------------------
# The public surface: every torch 2.13 FSDP2 name and method, with its signature
# ---------------------------------------------------------------------------


def _torch_fsdp2_names() -> list[str]:
    import torch.distributed.fsdp._fully_shard as torch_fsdp2

    return list(torch_fsdp2.__all__)


def _public_methods(cls: type) -> list[str]:
    return sorted(n for n, v in vars(cls).items() if callable(v) and (not n.startswith("_") or n == "__init__"))


def _shape(obj: Any) -> list[tuple[str, Any, str]]:
    """A signature without annotations: (name, kind, default as text) per parameter."""
    sig = inspect.signature(obj)
    return [(p.name, p.kind, repr(p.default)) for p in sig.parameters.values()]


@requires_torch_feature("DataParallelMeshDims", "ShardPlacementResult")  # torch 2.11: 8 names, other signatures
def test_every_torch_fsdp2_name_exists_with_the_same_signature() -> None:
    import torch.distributed.fsdp as torch_fsdp

    names = _torch_fsdp2_names()
    assert len(names) >= 9, names
    for name in names:
        assert hasattr(ours_pkg, name), f"fully_shard lacks torch's {name}"
        theirs, mine = getattr(torch_fsdp, name), getattr(ours_pkg, name)
        assert _shape(mine) == _shape(theirs), (f"{name}: {inspect.signature(mine)} != torch's "
                                                f"{inspect.signature(theirs)}")
    # torch's shard_placement_fn result type, used for expert weights
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult

    assert _shape(ours_pkg.ShardPlacementResult) == _shape(ShardPlacementResult)


@pytest.mark.parametrize("cls_name", ["FSDPModule", "UnshardHandle"])
def test_every_torch_method_exists_with_the_same_signature(cls_name: str) -> None:
    import torch.distributed.fsdp as torch_fsdp

    theirs_cls, mine_cls = getattr(torch_fsdp, cls_name), getattr(ours_pkg, cls_name)
    methods = _public_methods(theirs_cls)
    assert methods, cls_name
    for name in methods:
        if name == "__init__" and "__init__" not in vars(theirs_cls):
            continue
        mine = getattr(mine_cls, name, None)
        assert mine is not None, f"{cls_name}.{name} is missing"
        assert _shape(mine) == _shape(getattr(theirs_cls, name)), (
            f"{cls_name}.{name}: {inspect.signature(mine)} != torch's {inspect.signature(getattr(theirs_cls, name))}"
        )
    assert _shape(mine_cls) == _shape(theirs_cls), f"{cls_name}'s constructor differs"


def test_data_parallel_mesh_dims_and_unshard_handle() -> None:
    dims = ours_pkg.DataParallelMeshDims(shard=("a", "b"), replicate="r")
    assert dims.shard_names == ("a", "b") and dims.replicate_names == ("r",)
    with pytest.raises(ValueError, match="shard, replicate or both"):
        ours_pkg.DataParallelMeshDims()
    assert ours_pkg.UnshardHandle().wait() is None  # torch: a handle with nothing to wait for


# ---------------------------------------------------------------------------
# Behaviour, against torch's FSDP2 on the same model
# ---------------------------------------------------------------------------


class CountingAllGather:
    """torch's AllGather Comm interface, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> Any:
        self.calls += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class CountingReduceScatter:
    def __init__(self) -> None:
        self.calls = 0

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Any:
        self.calls += 1
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def _configure(model: Transformer, case: str) -> dict[str, Any]:
    """Apply a torch communication control to a sharded model; what to check afterwards."""
    seen: dict[str, Any] = {}
    sharded = [m for m in model.modules() if hasattr(m, "set_force_sum_reduction_for_comms")]
    if case == "force_sum":
        for m in sharded:  # per module, as in torch
            m.set_force_sum_reduction_for_comms(True)
    elif case == "separate_rs_group":
        model.set_separate_reduce_scatter_group()
    elif case == "max_input_buffers":
        model.set_reduce_scatter_max_input_buffers(3)
    elif case == "divide_factor":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for m in sharded:
                # torch's custom factor needs PREMUL_SUM otherwise, which gloo lacks
                m.set_force_sum_reduction_for_comms(True)
                m.set_reduce_scatter_divide_factor(4.0)
        seen["deprecated"] = any("set_gradient_divide_factor" in str(w.message) for w in caught)
    elif case == "custom_comms":
        seen["ag"], seen["rs"] = CountingAllGather(), CountingReduceScatter()
        for block in model.layers:
            block.set_custom_all_gather(seen["ag"])
            block.set_custom_reduce_scatter(seen["rs"])
    elif case == "all_reduce_hook":
        seen["hook"] = []

        def hook(t: torch.Tensor) -> None:  # halve the reduced gradient of every block
            seen["hook"].append(t.numel())
            t.mul_(0.5)

        for block in model.layers:
            block.set_all_reduce_hook(hook)
    elif case == "unshard_in_backward":
        model.tok_embeddings.set_unshard_in_backward(False)  # embedding backward never reads its weight
    else:
        raise AssertionError(case)
    return seen


def _train_side_by_side(case: str) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fully_shard import fully_shard

    mesh = init_device_mesh(device_type(), (dist.get_world_size(),))
    base = Transformer(ARGS)
    models, opts, seen = [], [], []
    for shard in (fully_shard, torch_fully_shard):
        model = copy.deepcopy(base)
        if case == "unshard_in_backward":
            shard(model.tok_embeddings, mesh=mesh)
        for block in model.layers:
            shard(block, mesh=mesh)
        shard(model, mesh=mesh)
        seen.append(_configure(model, case))
        models.append(model)
        opts.append(torch.optim.AdamW(model.parameters(), lr=1e-2))
    rank = dist.get_rank()
    for step in range(2):
        tokens = batch(step, rank, ARGS)
        losses = []
        for model, opt in zip(models, opts):
            loss = loss_fn(model(tokens), tokens)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        # bitwise: see the module docstring
        assert losses[0] == losses[1], f"step {step}: loss {losses[0]} != torch FSDP2's {losses[1]}"
    for (name, mine), theirs in zip(models[0].named_parameters(), models[1].parameters()):
        assert isinstance(mine, DTensor), name
        torch.testing.assert_close(mine.full_tensor(), theirs.full_tensor(), rtol=0, atol=0, msg=name)
    mine_seen = seen[0]
    return {
        "deprecated": mine_seen.get("deprecated"),
        "ag": mine_seen["ag"].calls if "ag" in mine_seen else None,
        "rs": mine_seen["rs"].calls if "rs" in mine_seen else None,
        "hook": mine_seen.get("hook"),
        "torch_hook": seen[1].get("hook"),
    }


CASES = ["force_sum", pytest.param("separate_rs_group",
                                   marks=requires_torch_feature("FSDPModule.set_separate_reduce_scatter_group")),
         pytest.param("max_input_buffers",
                      marks=requires_torch_feature("FSDPModule.set_reduce_scatter_max_input_buffers")),
         "divide_factor", "custom_comms", "all_reduce_hook", "unshard_in_backward"]


@pytest.mark.parametrize("case", CASES)
def test_comm_controls_match_torch_fsdp2(case: str) -> None:
    results = run_distributed(_train_side_by_side, 2, case)
    r = results[0]
    if case == "divide_factor":
        assert r["deprecated"], "set_reduce_scatter_divide_factor must warn, as torch's does"
    if case == "custom_comms":
        # 2 steps x 2 blocks: forward + backward all-gather each (blocks reshard after forward)
        assert r["ag"] == 8 and r["rs"] == 4, r
    if case == "all_reduce_hook":
        assert len(r["hook"]) == 4 and r["hook"] == r["torch_hook"], r


def _unsupported_calls() -> list[str]:
    from torch.distributed.device_mesh import DeviceMesh

    from fully_shard import fully_shard

    # a gloo group on the suite's device: on an accelerator it carries that device's tensors, and is still not NCCL
    gloo = DeviceMesh.from_group(dist.new_group(backend="gloo"), device_type())
    model = fully_shard(nn.Linear(4, 4), mesh=gloo)
    messages = []
    for call in (
        lambda: model.set_symm_mem_for_comm(),  # gloo (see test_comm_controls.py)
        lambda: model.set_reduce_scatter_max_input_buffers(0),
        lambda: model.set_custom_all_gather(object()),
    ):
        try:
            call()
            messages.append("no error")
        except (NotImplementedError, ValueError) as e:
            messages.append(str(e))
    return messages


def test_unsupported_backend_features_raise_at_the_call() -> None:
    symm, buffers, comm = run_distributed(_unsupported_calls, 1)[0]
    assert "symmetric memory needs a NCCL process group" in symm and "not the results" in symm
    # the backend that carries the module's tensors is named: gloo on an accelerator too (the first GPU run's world of
    # one used NCCL, on which set_symm_mem_for_comm is rightly accepted; this group is gloo on purpose)
    assert ("this module has gloo on cuda" if device_type() == "cuda"
            else "this module has no accelerator on cpu") in symm, symm
    assert "positive int" in buffers
    assert "allocate" in comm


# ---------------------------------------------------------------------------
# Container modules with a forward, fully_shard.state, Hugging Face detection
# ---------------------------------------------------------------------------


class SequentialList(nn.ModuleList):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self:
            x = m(x)
        return x


def _container_with_forward() -> list[Any]:
    from fully_shard import FSDPModule, fully_shard

    torch.manual_seed(0)
    model = SequentialList([nn.Linear(8, 8), nn.Linear(8, 3)])
    ref = copy.deepcopy(model)
    fully_shard(model)
    x = torch.randn(4, 8)
    out = model(x)
    out.sum().backward()
    ref(x).sum().backward()
    # bitwise: one rank's gradient reduced over 1 rank is itself
    torch.testing.assert_close(out, ref(x), rtol=0, atol=0)
    torch.testing.assert_close(model[0].weight.grad.full_tensor(), ref[0].weight.grad, rtol=0, atol=0)
    try:
        fully_shard(nn.ModuleList([nn.Linear(2, 2)]))
        plain_list = "accepted"
    except ValueError as e:
        plain_list = str(e)
    from transformers.distributed.fsdp import is_fsdp_managed_module

    return [
        isinstance(model, FSDPModule),
        fully_shard.state(model) is not None,
        fully_shard.state(nn.Linear(2, 2)) is None,
        plain_list,
        is_fsdp_managed_module(model),
    ]


def test_containers_with_forward_state_accessor_and_hf_detection() -> None:
    pytest.importorskip("transformers")
    is_fsdp, has_state, none_state, plain_list, hf = run_distributed(_container_with_forward, 1)[0]
    assert is_fsdp and has_state and none_state
    assert "has no forward" in plain_list
    assert hf, "transformers' is_fsdp_managed_module must recognise a fully_shard model"


# ---------------------------------------------------------------------------
# set_reduce_scatter_unused_params: ranks route through different experts
# ---------------------------------------------------------------------------


class MoE(nn.Module):
    """Top-1 routing without a router: each rank sends its tokens to one expert of its own,
    so on 2 ranks each expert gets a gradient on one rank only."""

    def __init__(self, dim: int = 12, n_experts: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n_experts))
        self.out = nn.Linear(dim, 2)

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return self.out(self.experts[expert](self.inp(x)))


def _moe(use_torch: bool) -> list[float]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fully_shard import fully_shard

    shard = torch_fully_shard if use_torch else fully_shard
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = MoE()
    ref = copy.deepcopy(model)
    shard(model, mesh=init_device_mesh(device_type(), (world,)))
    model.set_reduce_scatter_unused_params(True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        xs = [torch.randn(4, 12, generator=torch.Generator().manual_seed(10 * step + r), device="cpu").to(device())
              for r in range(world)]
        # expert of rank r at step s: (r + s) % 3, so ranks differ and the choice moves
        model(xs[rank], (rank + step) % 3).sum().backward()
        opt.step()
        opt.zero_grad()
        # oracle: the unsharded model, the gradient averaged over the ranks' batches
        ref_loss = sum(ref(xs[r], (r + step) % 3).sum() for r in range(world)) / world
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        # sums of per-rank gradients run in another order than the reference's autograd sum
        torch.testing.assert_close(p.full_tensor(), q, rtol=1e-6, atol=1e-6, msg=name)
    return [p.full_tensor().sum().item() for p in model.parameters()]


@pytest.mark.parametrize("world_size", [2, 4])
def test_reduce_scatter_unused_params_with_per_rank_experts(world_size: int) -> None:
    ours = run_distributed(_moe, world_size, False)  # checked against the unsharded model in the body
    skip_without_torch_feature("FSDPModule.set_reduce_scatter_unused_params")
    theirs = run_distributed(_moe, world_size, True)
    # equal to torch FSDP2 on the same model on every rank: the same layout and the same gloo
    # reduce-scatter (zeros for the unused experts), so the same sums in the same order: bitwise
    assert ours == theirs and len(ours) == world_size


class SkippingMoE(nn.Module):
    """Each expert its own group, run only where routed (``if tokens.numel(): expert(x)``); the
    experts are registered first, so the end of backward settles them before ``inp``."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(12, 12) for _ in range(3))
        self.inp = nn.Linear(8, 12)
        self.out = nn.Linear(12, 2)

    def forward(self, x: torch.Tensor, route: list[int]) -> torch.Tensor:
        h = self.inp(x)
        return self.out(sum((self.experts[e](h) for e in route), h))


# routes[step][rank]: the experts each rank runs. With experts prefetched by ``inp`` (gathered on
# every rank) torch FSDP2 reduces a skipped expert's zeros at its end of backward, where the
# other ranks reduce it when its backward ends: right only when nothing is reduced in between
SKIP_ROUTES = {
    "skip_last_in_backward": [[[0, 1], [0, 1]], [[0, 1], [1]]],  # torch: right
    "never_run": [[[0], [0]], [[0], [0]]],  # torch: right (experts 1, 2 gathered, run nowhere)
    "skip_first_in_backward": [[[0, 1], [0, 1]], [[0, 1], [0]]],  # torch: experts 0 and 1 mispaired, silently
    "skip_in_first_step": [[[0, 1], [1]]],  # torch: rank 1 reduces nothing for expert 0 (never used there): mismatch
    "disjoint": [[[0, 1], [0, 1]], [[0], [1]], [[2], [0, 1]]],  # torch: mispaired, silently
}


def _moe_meshes(layout: str, world: int, result: Any) -> tuple[Any, dict[str, Any]]:
    """The mesh of every call, and the experts' own fully_shard arguments: ``fsdp`` 1-D; ``hsdp`` (2, world/2);
    ``experts_mesh`` 1-D, the experts' parameters on a (2, world/2) HSDP mesh of their own (a ShardPlacementResult, as
    torchtitan places them); ``experts_sub_mesh`` their calls on a world/2-rank sub-mesh, their parameters on the
    1-D."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo

    if layout == "hsdp":
        return init_device_mesh(device_type(), (2, world // 2), mesh_dim_names=("rep", "shard")), {}
    mesh = init_device_mesh(device_type(), (world,))
    if layout == "fsdp":
        return mesh, {}
    grid = init_device_mesh(device_type(), (2, world // 2), mesh_dim_names=("rep", "efsdp"))
    sub = layout == "experts_sub_mesh"  # torch: one info object per process group
    info = FSDPMeshInfo(mesh, 0) if sub else HSDPMeshInfo(grid, shard_mesh_dim=1, replicate_mesh_dim=0)
    return mesh, {"shard_placement_fn": lambda p: result(Shard(0), info), **({"mesh": grid["efsdp"]} if sub else {})}


def _ours_or_torch(use_torch: bool, placement_result: bool = False) -> tuple[Any, Any]:
    """(fully_shard, ShardPlacementResult) of ours or torch's; torch's result type only where asked for (torch 2.13)."""
    if not use_torch:
        from fully_shard import ShardPlacementResult, fully_shard

        return fully_shard, ShardPlacementResult
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    if not placement_result:
        return torch_fully_shard, None
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult as TorchResult

    return torch_fully_shard, TorchResult


def _skipping_moe(use_torch: bool, routes: list[list[list[int]]], prefetch: bool = True, layout: str = "fsdp",
                  accumulate: int = 1) -> Any:
    """Train on ``routes`` (each entry a microbatch; the optimizer steps after every ``accumulate``, the others run
    with gradient sync off); check the gradients and parameters against the unsharded model."""
    shard, result = _ours_or_torch(use_torch, layout.startswith("experts"))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = SkippingMoE().to(device())
    ref = copy.deepcopy(model)
    mesh, place = _moe_meshes(layout, world, result)
    for m in [*model.experts, model.inp, model.out, model]:
        # with prefetch, no module gathers again in backward (a skipped one would not)
        shard(m, **{"mesh": mesh, "reshard_after_forward": not prefetch, **(place if m in model.experts else {})})
    if prefetch:
        model.inp.set_modules_to_forward_prefetch(list(model.experts))
    model.set_reduce_scatter_unused_params(True)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    no_grad = []
    for step, route in enumerate(routes):
        xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + r), device="cpu").to(device())
              for r in range(world)]
        sync = (step + 1) % accumulate == 0
        model.set_requires_gradient_sync(sync)
        try:
            model(xs[rank], route[rank]).sum().backward()
        except RuntimeError as e:
            return str(e)
        (sum(ref(xs[r], route[r]).sum() for r in range(world)) / world).backward()
        if not sync:
            continue
        no_grad += [p.grad is None for p in model.parameters()]
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            # used nowhere in this step: no gradient in either (or a zero one, where every rank reduced zeros)
            got, want = (torch.zeros_like(q) if g is None else g
                         for g in (None if p.grad is None else p.grad.full_tensor(), q.grad))
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=f"step {step}: {name}.grad")
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    full = [p.full_tensor() for p in model.parameters()]
    for (name, _), p, q in zip(model.named_parameters(), full, ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6, msg=name)  # the unsharded model, batches averaged
    return full, no_grad


def _skipping_like_torch(world_size: int, *args: Any) -> list[Any]:
    """Ours, checked against the unsharded model in the body (gradients each step, parameters at the end), and where
    torch FSDP2 trains right, bitwise equal to it: the same gloo collectives on the same layouts, in another order."""
    ours = run_distributed(_skipping_moe, world_size, False, *args)
    experts_mesh = len(args) > 2 and args[2].startswith("experts")
    skip_without_torch_feature("FSDPModule.set_reduce_scatter_unused_params",
                               *(["ShardPlacementResult"] if experts_mesh else []))
    theirs = run_distributed(_skipping_moe, world_size, True, *args)
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        assert all(torch.equal(p, q) for p, q in zip(a[0], b[0])) and a[1] == b[1], f"rank {rank}"
    return ours


@pytest.mark.parametrize("case", SKIP_ROUTES)
def test_reduce_scatter_unused_params_with_an_expert_skipped_on_a_rank(case: str) -> None:
    if case in ("skip_last_in_backward", "never_run"):
        ours = _skipping_like_torch(2, SKIP_ROUTES[case])
        assert case != "never_run" or any(ours[0][1])  # run nowhere: no gradient
    else:
        run_distributed(_skipping_moe, 2, False, SKIP_ROUTES[case])


# 4 ranks, rank = 2 * replica + shard rank (HSDP, and the experts' own mesh). torch FSDP2 (hsdp and
# experts_mesh) trains the first right and hangs in the others: some ranks reduce an expert at the end
MESH_ROUTES = {
    "one_rank_of_one_replica": [[[0, 1]] * 4, [[0, 1], [0, 1], [0, 1], [1]]],
    "whole_replica": [[[0, 1]] * 4, [[0, 1], [0, 1], [0], [0]], [[2], [2], [0, 1], [0, 1]]],
    "mixed": [[[0], [0, 1], [1, 2], [0, 1]], [[2], [0], [1], [0, 2]]],
}


@pytest.mark.parametrize("layout", ["hsdp", "experts_mesh", "experts_sub_mesh"])
@pytest.mark.parametrize("case", MESH_ROUTES)
def test_expert_skipped_on_a_rank_with_hsdp_or_its_own_mesh(layout: str, case: str) -> None:
    if case == "one_rank_of_one_replica" and layout != "experts_sub_mesh":
        _skipping_like_torch(4, MESH_ROUTES[case], True, layout)
    else:
        run_distributed(_skipping_moe, 4, False, MESH_ROUTES[case], True, layout)


# microbatches in pairs: the first with gradient sync off, the second synced (2 ranks; 4: HSDP). An expert
# run nowhere in a synced microbatch still reduces what earlier ones accumulated (torch FSDP2 keeps
# it for a later step, or with it on one rank only mismatches the reduce-scatters)
ACCUMULATE_ROUTES = {
    "skip_in_accumulation": [[[0, 1], [1]], [[0, 1], [0, 1]]],  # torch: right
    "skip_in_both": [[[0, 1], [1]], [[0], [0, 1]], [[2], [0]], [[1], [1, 2]]],
    "run_only_in_accumulation": [[[0, 1], [0]], [[0], [0]]],
    "hsdp": [[[0, 1], [0], [0, 1], [0, 1]], [[0], [0], [0], [2]], [[1], [1], [0, 1, 2], [1]], [[2], [2], [2], [2]]],
}


@pytest.mark.parametrize("case", ACCUMULATE_ROUTES)
def test_expert_skipped_on_a_rank_with_gradient_accumulation(case: str) -> None:
    if case == "skip_in_accumulation":
        _skipping_like_torch(2, ACCUMULATE_ROUTES[case], True, "fsdp", 2)
    else:
        routes = ACCUMULATE_ROUTES[case]
        run_distributed(_skipping_moe, len(routes[0]), False, routes, True, "hsdp" if case == "hsdp" else "fsdp", 2)


@pytest.mark.parametrize("routes, message", [
    ([[[0, 1], [0, 1]], [[0, 1], [1]]], "resharded after it: its backward all-gathers there only"),
    ([[[0], [1]]], "was not all-gathered on the others"),  # torch: experts 0 and 1 gathered as each other
])
def test_expert_skipped_without_prefetch_raises(routes: list[Any], message: str) -> None:
    # no explicit prefetch: an expert is gathered where it runs (or where our implicit prefetch,
    # following the last step's order, expects it) and, resharded, gathered again in backward there
    errors = run_distributed(_skipping_moe, 2, False, routes, False)
    assert all(isinstance(e, str) and message in e and "set_modules_to_forward_prefetch" in e for e in errors), errors


# ---------------------------------------------------------------------------
# dp_mesh_dims: parameters are DTensors on the full (dp, tp) mesh
# ---------------------------------------------------------------------------


class SpmdMLP(nn.Module):
    """Column- then row-parallel MLP whose weights live on the whole SPMD mesh: sharded over
    the ``tp`` dim (when there is one), ``Replicate()`` on every other dim."""

    def __init__(self, mesh: Any, tp: str | None = "tp", dim: int = 8, hidden: int = 12) -> None:
        super().__init__()
        torch.manual_seed(0)
        w1, w2 = torch.randn(hidden, dim), torch.randn(dim, hidden)
        names, pl1, pl2 = mesh.mesh_dim_names, [Replicate()] * mesh.ndim, [Replicate()] * mesh.ndim
        if tp is not None:
            i, rank = names.index(tp), mesh.get_local_rank(tp)
            pl1[i], pl2[i] = Shard(0), Shard(1)  # colwise, rowwise
            w1, w2 = w1.chunk(mesh.size(i), 0)[rank].contiguous(), w2.chunk(mesh.size(i), 1)[rank].contiguous()
        self.w1 = nn.Parameter(DTensor.from_local(w1.to(device()), mesh, pl1))
        self.w2 = nn.Parameter(DTensor.from_local(w2.to(device()), mesh, pl2))

    def forward(self, x: Any) -> Any:
        return torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, self.w1)), self.w2)


# on 4 ranks: mesh shape, dim names, the TP dim (or None), DataParallelMeshDims' fields
SPMD_CASES: dict[str, tuple[tuple[int, ...], tuple[str, ...], str | None, dict[str, Any]]] = {
    "fsdp": ((2, 2), ("dp", "tp"), "tp", {"shard": "dp"}),
    "fsdp_two_shard_dims": ((2, 2), ("dp", "cp"), None, {"shard": ("dp", "cp")}),  # flattened: 4-way
    "fsdp_two_shard_dims_tp": ((2, 1, 2), ("dp", "cp", "tp"), "tp", {"shard": ("dp", "cp")}),  # _StridedShard
    "hsdp_two_shard_dims": ((2, 1, 2), ("rep", "dp", "cp"), None, {"shard": ("dp", "cp"), "replicate": "rep"}),
    "hsdp_two_replicate_dims": ((2, 1, 2), ("r1", "r2", "dp"), None, {"shard": "dp", "replicate": ("r1", "r2")}),
    "ddp_tp": ((2, 2), ("dp", "tp"), "tp", {"replicate": "dp"}),
    "ddp_two_replicate_dims": ((2, 2), ("a", "b"), None, {"replicate": ("a", "b")}),
}


def _spmd(case: str, use_torch: bool, torch_dims: bool = False, ckpt: str | None = None) -> dict[str, Any]:
    """Train the case's model 2 steps; with ``ckpt``, torch saves its parameters there (DCP)
    and ours loads them afterwards into zeroed parameters."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import distribute_tensor

    from fully_shard import DataParallelMeshDims

    shape, names, tp, fields = SPMD_CASES[case]
    shard, dims = _ours_or_torch(use_torch)[0], DataParallelMeshDims
    if use_torch or torch_dims:  # torch's own class (torch 2.13), passed to ours too as torchtitan does
        from torch.distributed.fsdp import DataParallelMeshDims as TorchDims

        dims = TorchDims
    mesh = init_device_mesh(device_type(), shape, mesh_dim_names=names)
    model = SpmdMLP(mesh, tp)
    for p in model.parameters():
        # torch's FSDP2 wants each parameter's mesh to be the very mesh object passed to it,
        # but DTensor's caches may hand nn.Parameter(...) an equal mesh from an earlier test
        p._spec = dataclasses.replace(p._spec, mesh=mesh)
    shard(model, mesh=mesh, dp_mesh_dims=dims(**fields))
    layout = [(n, [str(q) for q in p.placements], p.device_mesh.mesh_dim_names, p.device_mesh.mesh.tolist())
              for n, p in model.named_parameters()]
    state = [(k, [str(q) for q in v.placements], v.device_mesh.mesh_dim_names) for k, v in model.state_dict().items()]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses, grads = [], []
    x_placements = [Replicate() if n == tp else Shard(0) for n in names]  # the batch is split over the dp dims
    for step in range(2):
        x_full = torch.randn(8, 8, generator=torch.Generator().manual_seed(step), device="cpu").to(device())
        loss = model(distribute_tensor(x_full, mesh, x_placements)).pow(2).sum().full_tensor()
        loss.backward()
        grads += [p.grad.full_tensor() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    out = {"losses": losses, "grads": grads, "params": [p.full_tensor() for p in model.parameters()], "layout": layout,
           "state": state}
    if ckpt is not None and use_torch:
        dcp.save(model.state_dict(), checkpoint_id=ckpt)
    elif ckpt is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        dcp.load(model.state_dict(), checkpoint_id=ckpt)
        out["loaded"] = [p.full_tensor() for p in model.parameters()]
    return out


@pytest.mark.parametrize("case", list(SPMD_CASES))
def test_dp_mesh_dims_matches_torch_fsdp2(case: str, tmp_path: Any) -> None:
    ckpt = str(tmp_path / "ckpt")
    if not has_torch_feature("DataParallelMeshDims"):  # torch 2.11: ours trains, then the comparison is skipped
        run_distributed(_spmd, 4, case, False)
        skip_without_torch_feature("DataParallelMeshDims")
    theirs = run_distributed(_spmd, 4, case, True, ckpt=ckpt)
    ours = run_distributed(_spmd, 4, case, False, ckpt=ckpt)
    if case == "fsdp":  # torch's DataParallelMeshDims is accepted by ours and means the same (bitwise: same program)
        for a, c in zip(ours, run_distributed(_spmd, 4, case, False, True)):
            assert a["losses"] == c["losses"] and a["layout"] == c["layout"]
            assert all(torch.equal(p, q) for p, q in zip(a["params"], c["params"]))
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        # the same placements on the same meshes (the flattened dp dims included), in the state dict too
        assert a["layout"] == b["layout"], f"rank {rank}: {a['layout']} != torch's {b['layout']}"
        assert a["state"] == b["state"], f"rank {rank}: {a['state']} != torch's {b['state']}"
        # bitwise: both reduce the same flat layout with the same gloo ops (AVG over the same ranks)
        assert a["losses"] == b["losses"], f"rank {rank}: losses {a['losses']} != torch's {b['losses']}"
        for p, q in zip(a["grads"] + a["params"], b["grads"] + b["params"]):
            torch.testing.assert_close(p, q, rtol=0, atol=0)
        # torch's DCP checkpoint loads into ours (zeroed first): the same layouts, the same values
        for p, q in zip(a["loaded"], b["params"]):
            torch.testing.assert_close(p, q, rtol=0, atol=0)


def _spmd_refusals() -> list[str]:
    from fully_shard import DataParallelMeshDims, fully_shard

    mesh = init_device_mesh(device_type(), (2, 1, 2), mesh_dim_names=("dp", "tp", "cp"))
    messages = []
    for module, dims in (
        (nn.Linear(4, 4), DataParallelMeshDims(shard="dp")),  # a plain parameter
        # not adjacent: torch fails inside DeviceMesh
        (SpmdMLP(mesh, tp=None), DataParallelMeshDims(shard=("dp", "cp"))),
    ):
        try:
            fully_shard(module, mesh=mesh, dp_mesh_dims=dims)
            messages.append("no error")
        except ValueError as e:
            messages.append(str(e))
    return messages


def test_dp_mesh_dims_refusals() -> None:
    plain, apart = run_distributed(_spmd_refusals, 4)[0]
    assert "'weight'" in plain and "DTensor on the mesh" in plain, plain
    assert "('dp', 'cp') must be adjacent dims of the mesh" in apart, apart


# ---------------------------------------------------------------------------
# shard_placement_fn returning ShardPlacementResult: expert weights on a mesh of their own
# ---------------------------------------------------------------------------


class ExpertMLP(nn.Module):
    """A dense stand-in for a mixture of experts: every token goes through every expert."""

    def __init__(self, dim: int = 8, n_experts: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(dim, dim)
        self.experts = nn.Parameter(torch.randn(n_experts, dim, dim) / dim**0.5)  # (E, D, D)
        self.out = nn.Linear(dim, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out((torch.relu(self.inp(x)).unsqueeze(0) @ self.experts).mean(0))  # (E, B, D) -> (B, D)


# the experts' mesh (the others' is 1-D over all ranks; main_hsdp: HSDP (2, world/2), the
# experts' 1-D over all ranks) and their shard dim
EXPERT_CASES = {"hsdp_2x2": 0, "fsdp_2_dim1": 1}


def _experts(
    case: str, use_torch: bool, as_mesh: bool = False, reshard: bool | int | None = None, subclass: bool = False
) -> dict[str, Any]:
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo

    from support.collectives import CollectiveRecorder
    from tests.test_subclass_params import HalfGather, _full

    shard, result = _ours_or_torch(use_torch, placement_result=True)
    world = dist.get_world_size()
    main_hsdp = {"mesh_shape": (2, world // 2), "mesh_dim_names": ("rep", "shard")}
    mesh = (init_device_mesh(device_type(), **main_hsdp) if case == "main_hsdp"
            else init_device_mesh(device_type(), (world,)))
    expert_mesh = init_device_mesh(device_type(), (2, world // 2), mesh_dim_names=("rep", "efsdp"))
    # torch's own mesh infos, as torchtitan builds them, passed to both
    if case == "main_hsdp":
        info = FSDPMeshInfo(init_device_mesh(device_type(), (world,)), 0)
    elif case == "hsdp_2x2":
        info = HSDPMeshInfo(expert_mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
    else:
        info = FSDPMeshInfo(expert_mesh["efsdp"], 0)
    if as_mesh:
        info = info.mesh  # ours also takes the DeviceMesh itself
    model = ExpertMLP()
    if subclass:  # the experts all-gather themselves (HalfGather, tests/test_subclass_params.py)
        model.experts = nn.Parameter(HalfGather(model.experts.detach().clone()))
        HalfGather.meshes.clear()
    place = {"shard_placement_fn": lambda p: result(Shard(EXPERT_CASES.get(case, 0)), info) if p is model.experts
             else None}
    shard(model, mesh=mesh, reshard_after_forward=reshard, **place)
    layout = [(n, [str(q) for q in p.placements], p.device_mesh.mesh.tolist()) for n, p in model.named_parameters()]
    state = [(k, [str(q) for q in v.placements]) for k, v in model.state_dict().items()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    losses, grads = [], []
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()),
                        device="cpu").to(device())
        with CollectiveRecorder() as rec:  # the last step's collectives
            loss = model(x).pow(2).sum()
            rec.mark("backward")
            loss.backward()
        grads += [p.grad.full_tensor() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = [_full(p) if isinstance(p._local_tensor, HalfGather) else p.full_tensor() for p in model.parameters()]
    return {"losses": losses, "grads": grads, "params": params, "layout": layout, "state": state, "comms": rec.table(),
            "types": [type(p._local_tensor).__name__ for p in model.parameters()], "meshes": sorted(HalfGather.meshes)}


def _check_like_torch(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> None:
    """Bitwise: the same layouts reduced with the same gloo ops over the same ranks."""
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        assert a["layout"] == b["layout"] and a["state"] == b["state"], (f"rank {rank}: {a['layout']} != torch's "
                                                                         f"{b['layout']}")
        assert a["losses"] == b["losses"], f"rank {rank}: losses {a['losses']} != torch's {b['losses']}"
        for p, q in zip(a["grads"] + a["params"], b["grads"] + b["params"]):
            torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.parametrize("case", list(EXPERT_CASES))
def test_shard_placement_result_on_another_mesh_matches_torch_fsdp2(case: str) -> None:
    ours = run_distributed(_experts, 4, case, False)
    for rank, a in enumerate(ours):  # the experts live on their own mesh (the others on the 4-rank one)
        assert a["layout"][0][0] == "experts" and a["layout"][1][2] == [0, 1, 2, 3], a["layout"]
        assert a["layout"][0][2] == ([[0, 1], [2, 3]] if case == "hsdp_2x2"
                                     else [[0, 1], [2, 3]][rank // 2]), a["layout"]
    if case == "fsdp_2_dim1":  # experts reduced within their 2 ranks only: the two pairs differ
        assert not torch.equal(ours[0]["params"][0], ours[2]["params"][0])
    for a, c in zip(ours, run_distributed(_experts, 4, case, False, True)):  # the mesh itself: the same program
        assert a["losses"] == c["losses"] and a["layout"] == c["layout"]
        assert all(torch.equal(p, q) for p, q in zip(a["params"], c["params"]))
    skip_without_torch_feature("ShardPlacementResult")
    _check_like_torch(ours, run_distributed(_experts, 4, case, True))


# reshard_after_forward=2 on 4 ranks: each mesh of the call keeps its own 1/2 after forward
# (torch: a post-forward mesh per group), or reshards fully where 2 is its shard size
INT_COMMS = {
    # HSDP (2, 2) others: 2 is their shard size (True); the experts on the 4-rank mesh keep 1/2
    "main_hsdp": ["all_gather 2 45", "all_gather 4 64", "--", "all_gather 2 45", "all_gather 2 128",
                  "reduce_scatter 2 90",
                  "reduce_scatter 4 256", "all_reduce 2 45"],
    # the others on the 4-rank mesh keep 1/2; the experts' shard size is 2 (True)
    "hsdp_2x2": ["all_gather 4 27", "all_gather 2 128", "--", "all_gather 2 54", "all_gather 2 128",
                 "reduce_scatter 4 108",
                 "reduce_scatter 2 256", "all_reduce 2 128"],
}


@pytest.mark.parametrize("case", list(INT_COMMS))
def test_int_reshard_after_forward_with_another_mesh_matches_torch_fsdp2(case: str) -> None:
    ours = run_distributed(_experts, 4, case, False, False, 2)
    for a in ours:
        # (kind, ranks, elements) of each collective of a step: the backward all-gather of the
        # mesh that kept 1/2 runs within 2 ranks, of 2 of its shards; torch's the same per phase
        # (it reduces the second mesh's group first)
        lines = [" ".join(line.split()) for line in a["comms"].replace("-- backward --", "--").splitlines()]
        assert lines == INT_COMMS[case], a["comms"]
    skip_without_torch_feature("ShardPlacementResult")
    theirs = run_distributed(_experts, 4, case, True, False, 2)
    _check_like_torch(ours, theirs)
    for a, b in zip(ours, theirs):
        phases = [[sorted(part.splitlines()) for part in t["comms"].split("-- backward --")] for t in (a, b)]
        assert phases[0] == phases[1], b["comms"]


@pytest.mark.parametrize(("world_size", "case"),
                         [(2, "main_hsdp"), (2, "hsdp_2x2"), (4, "main_hsdp"), (4, "fsdp_2_dim1")])
def test_subclass_on_another_mesh_matches_torch_fsdp2(world_size: int, case: str) -> None:
    """The experts all-gather themselves (HalfGather) on their own mesh: over its ranks, with
    its shard mesh given to ``fsdp_pre_all_gather``; 2 ranks' main_hsdp gathers them over the 2."""
    ours = run_distributed(_experts, world_size, case, False, False, True, True)
    assert all(a["types"][0] == "HalfGather" and len(a["meshes"]) == 1 for a in ours), ours[0]["types"]
    skip_without_torch_feature("ShardPlacementResult")
    theirs = run_distributed(_experts, world_size, case, True, False, True, True)
    _check_like_torch(ours, theirs)
    for a, b in zip(ours, theirs):
        assert a["types"] == b["types"] and a["meshes"] == b["meshes"], (a["meshes"], b["meshes"])


def test_int_reshard_after_forward_with_subclass_on_another_mesh_matches_torch_fsdp2() -> None:
    """reshard_after_forward=2 when the subclass's mesh has 2 ranks: it reshards fully there
    (torch: no post-forward mesh for that group), the others keep 1/2."""
    ours = run_distributed(_experts, 4, "hsdp_2x2", False, False, 2, True)
    assert ours[0]["comms"].count("all_gather") == 4, ours[0]["comms"]
    skip_without_torch_feature("ShardPlacementResult")
    theirs = run_distributed(_experts, 4, "hsdp_2x2", True, False, 2, True)
    _check_like_torch(ours, theirs)
    assert theirs[0]["comms"].count("all_gather") == 4, theirs[0]["comms"]


@pytest.mark.long
def test_int_reshard_after_forward_on_an_expert_sub_mesh() -> None:
    """8 ranks, the experts Shard(1) on the 4-rank sub-mesh ``efsdp`` of a (2, 4) mesh: its
    ``.mesh`` holds this rank's copy only, yet every rank must create the k-rank groups of both
    copies. torch's FSDP2 hangs here (its post-forward mesh is built from that one copy), so
    the oracle is the same program with True: bitwise, as the kept slices are gathered back."""
    ours, plain = (run_distributed(_experts, 8, "fsdp_2_dim1", False, False, reshard) for reshard in (2, True))
    _check_like_torch(ours, plain)
    lines = [" ".join(line.split()) for line in ours[0]["comms"].splitlines()]
    assert lines == ["all_gather 8 18", "all_gather 4 64", "-- backward --", "all_gather 2 72", "all_gather 2 128",
                     "reduce_scatter 8 144", "reduce_scatter 4 256"], ours[0]["comms"]


def _int_refusal(use_torch: bool, subclass: bool) -> str:
    """k not dividing the experts' shard size (ValueError, also torch's); k < the subclass's
    mesh size (NotImplementedError: ours at the call, torch's at the backward all-gather)."""
    try:
        _experts("main_hsdp" if subclass else "hsdp_2x2", use_torch, False, 2 if subclass else 4, subclass)
        return "no error"
    except (NotImplementedError, ValueError) as e:
        return f"{type(e).__name__}: {e}"


def test_int_reshard_after_forward_refusals_like_torch() -> None:
    divisor, subclass = run_distributed(_int_refusal, 4, False, False), run_distributed(_int_refusal, 4, False, True)[0]
    for ours in divisor:
        assert ours.startswith("ValueError"), ours
        assert ("reshard_after_forward=4 must be a divisor of the shard group size 2 of the mesh shard_placement_fn "
                "gave 'experts'") in ours
    assert subclass.startswith("NotImplementedError"), subclass
    assert ("reshard_after_forward=<int> is not supported for tensor-subclass parameters" in subclass
            and "'experts'" in subclass)
    skip_without_torch_feature("ShardPlacementResult")
    assert all(theirs.startswith("ValueError") for theirs in run_distributed(_int_refusal, 4, True, False))
    assert run_distributed(_int_refusal, 4, True, True)[0].startswith("NotImplementedError")


def _expert_refusals() -> list[str]:
    from fully_shard import ShardPlacementResult, fully_shard

    messages = []
    model = ExpertMLP()
    try:
        fully_shard(model, shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), "efsdp") if p is model.experts
                    else None)
        messages.append("no error")
    except ValueError as e:
        messages.append(str(e))
    return messages


def test_shard_placement_result_refusals() -> None:
    (no_mesh,) = run_distributed(_expert_refusals, 4)[0]
    assert "'experts'" in no_mesh and "holds no DeviceMesh" in no_mesh, no_mesh
