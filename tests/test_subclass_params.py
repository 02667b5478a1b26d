"""Parameters that are tensor subclasses taking over their own all-gather through torch's
FSDP2 extension contract (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``).

``HalfGather`` is our own subclass: it sends its shard in ``mp_policy.param_dtype`` (bf16
here), counts its hook calls, and on later all-gathers relies on ``out=`` (the unsharded
parameter aliases the gathered buffer, which must be refilled in place). Each test trains
the same model with ``fully_shard`` and with torch's FSDP2 (the oracle) on 2 gloo ranks (the
own-subclass test on 4 too): bitwise, because both run the same casts and the same gloo
reduce-scatter (AVG) over the same layout, so the same sums in the same order. Also with
tensor parallelism (the hooks see the TP-local part), ``Shard(1)`` and ``dp_mesh_dims``. Then torch's own
extension test programs: hooks patched onto a plain or ``TwoTensor`` parameter's local tensor (looked up at every
all-gather), ``TwoTensor``'s class hooks, on FSDP and HSDP meshes, against torch's FSDP2 and the unsharded model.
torchao's float8 (also with TP) and int8 recipes are in the last part (skipped without torchao).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from tests.harness import device, device_type, run_distributed
from tests.oracle import ShardwiseOptimizer, average_gradients, close, ref_tol, rows
from tests.torch_features import skip_without_torch_feature

aten = torch.ops.aten
# ops whose results stay HalfGather (what sharding needs: torch's FSDP2 uses split/new_zeros)
_WRAP = {
    aten.slice.Tensor, aten.split.Tensor, aten.narrow.default, aten.clone.default, aten.detach.default,
    aten.alias.default, aten.view.default, aten.as_strided.default, aten._to_copy.default,
    aten.new_zeros.default, aten.empty_like.default,
}


class HalfGather(torch.Tensor):
    """An fp32 weight that all-gathers itself in ``mp_policy.param_dtype``."""

    calls: dict[str, int] = {"pre": 0, "post": 0, "post_out": 0}
    gathered_dtypes: list[torch.dtype] = []
    meshes: set[str] = set()  # the ranks of each mesh fsdp_pre_all_gather was given

    @staticmethod
    def __new__(cls, t: torch.Tensor) -> HalfGather:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[return-value]
            cls, t.shape, dtype=t.dtype, device=t.device, strides=t.stride(), requires_grad=t.requires_grad
        )

    def __init__(self, t: torch.Tensor) -> None:
        self._t = t

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["_t"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], meta: Any, size: Any, stride: Any) -> HalfGather:
        return HalfGather(inner["_t"])

    def __repr__(self) -> str:  # type: ignore[override]
        return f"HalfGather({self._t!r})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        unwrapped = pytree.tree_map_only(HalfGather, lambda x: x._t, (args, kwargs or {}))
        out = func(*unwrapped[0], **unwrapped[1])
        if args and isinstance(args[0], HalfGather) and out is args[0]._t:
            return args[0]  # in place (copy_, add_ of the optimizer)
        if func in _WRAP:
            return pytree.tree_map_only(torch.Tensor, cls, out)
        return out

    def fsdp_pre_all_gather(self, mesh: Any, outer_size: Any, outer_stride: Any, module: nn.Module,
                            mp_policy: Any) -> Any:
        HalfGather.calls["pre"] += 1
        HalfGather.meshes.add(str(mesh.mesh.tolist()))
        dtype = mp_policy.param_dtype or self.dtype
        HalfGather.gathered_dtypes.append(dtype)
        return (self._t.to(dtype),), ("meta", dtype)

    def fsdp_post_all_gather(
        self, outputs: tuple[torch.Tensor, ...], metadata: Any, param_dtype: torch.dtype, *,
        out: torch.Tensor | None = None
    ) -> Any:
        assert metadata[0] == "meta" and param_dtype == metadata[1], (metadata, param_dtype)
        (data,) = outputs
        HalfGather.calls["post"] += 1
        if out is not None:
            HalfGather.calls["post_out"] += 1
            return None  # ``out`` already aliases ``data``, refilled in place
        return data, (data,)


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    for lin in (model[0], model[2]):
        lin.weight = nn.Parameter(HalfGather(lin.weight.detach().clone()))
    return model


def _train(use_torch: bool, bf16: bool, tp: bool = False, shard_dim: int = 0) -> dict[str, Any]:
    """With ``tp``: a (dp=2, tp=world/2) mesh, the first Linear column-wise and the second
    row-wise parallel on mesh["tp"], then fully_shard on mesh["dp"] (the 2-D recipe);
    ``shard_dim`` 1: ``shard_placement_fn`` puts the weights on Shard(1)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from fully_shard import MixedPrecisionPolicy, fully_shard

    shard, mp_cls = (torch_fully_shard, TorchMP) if use_torch else (fully_shard, MixedPrecisionPolicy)
    mp = mp_cls(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else mp_cls()
    HalfGather.calls.update(pre=0, post=0, post_out=0)
    HalfGather.gathered_dtypes.clear()
    HalfGather.meshes.clear()
    model, data_rank = _model(), dist.get_rank()
    if tp:
        mesh_2d = init_device_mesh(device_type(), (2, dist.get_world_size() // 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh_2d["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        mesh, data_rank = mesh_2d["dp"], mesh_2d["dp"].get_local_rank()
    else:
        mesh = init_device_mesh(device_type(), (dist.get_world_size(),))
    place = {"shard_placement_fn": lambda p: Shard(shard_dim) if p.dim() == 2 else None}
    for lin in (model[0], model[2]):
        shard(lin, mesh=mesh, mp_policy=mp, **place)
    shard(model, mesh=mesh, mp_policy=mp, **place)
    local_types = [type(p._local_tensor).__name__ for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    losses = []
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + data_rank), device="cpu").to(device())
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {
        "losses": losses,
        "params": [p.full_tensor() if not isinstance(p._local_tensor, HalfGather) else _full(p)
                   for p in model.parameters()],
        "placements": [str(p.placements) for p in model.parameters()],
        "local_types": local_types,
        "calls": dict(HalfGather.calls),
        "dtypes": sorted({str(d) for d in HalfGather.gathered_dtypes}),
        "meshes": sorted(HalfGather.meshes),
    }


def _full(p: DTensor) -> torch.Tensor:
    """The full fp32 value of a HalfGather DTensor parameter (its local values, redistributed
    by DTensor as a plain tensor)."""
    return DTensor.from_local(p._local_tensor._t.contiguous(), p.device_mesh, p.placements,
                              run_check=False).full_tensor()


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_own_subclass_matches_torch_fsdp2(bf16: bool, world_size: int) -> None:
    ours = run_distributed(_train, world_size, False, bf16)
    theirs = run_distributed(_train, world_size, True, bf16)
    assert len(ours) == len(theirs) == world_size
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        # the sharded weights stay HalfGather (never silently plain)
        assert a["local_types"] == b["local_types"] == ["HalfGather", "Tensor", "HalfGather",
                                                        "Tensor"], a["local_types"]
        # 2 weights x 3 steps x (forward + backward) all-gathers; the first of each builds the
        # unsharded parameter, every later one refills it through out=
        assert a["calls"] == b["calls"] == {"pre": 12, "post": 12, "post_out": 10}, (a["calls"], b["calls"])
        assert a["dtypes"] == [("torch.bfloat16" if bf16 else "torch.float32")], a["dtypes"]
        # bitwise: see docstring
        assert a["losses"] == b["losses"], f"rank {rank}: {a['losses']} != torch's {b['losses']}"
        assert a["placements"] == b["placements"], (a["placements"], b["placements"])
        for p, q in zip(a["params"], b["params"]):
            torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("world_size", "tp", "shard_dim"), [(2, False, 1), (4, False, 1), (4, True, 0), (4, True, 1)],
    ids=["shard1-2", "shard1-4", "tp-4", "tp-shard1-4"],
)
def test_own_subclass_with_tp_or_shard_1_matches_torch_fsdp2(world_size: int, tp: bool, shard_dim: int) -> None:
    """Tensor parallelism and Shard(1): the subclass gathers its TP-local part; a Shard(1) part
    lands side by side on dim 1. Bitwise, as above: the same casts, collectives and layout."""
    ours = run_distributed(_train, world_size, False, True, tp, shard_dim)
    theirs = run_distributed(_train, world_size, True, True, tp, shard_dim)
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        assert a["local_types"] == b["local_types"] == ["HalfGather", "Tensor", "HalfGather",
                                                        "Tensor"], a["local_types"]
        assert a["calls"] == b["calls"] == {"pre": 12, "post": 12, "post_out": 10}, (a["calls"], b["calls"])
        assert a["dtypes"] == ["torch.bfloat16"], a["dtypes"]
        assert a["placements"] == b["placements"], (a["placements"], b["placements"])
        assert a["meshes"] == b["meshes"] and len(a["meshes"]) == 1, (a["meshes"], b["meshes"])  # the dp mesh
        assert (f"Shard(dim={shard_dim})" in a["placements"][0]
                and ("Shard(dim=1)" in a["placements"][2]) == (tp or shard_dim == 1))
        assert a["losses"] == b["losses"], f"rank {rank}: {a['losses']} != torch's {b['losses']}"
        for p, q in zip(a["params"], b["params"]):
            torch.testing.assert_close(p, q, rtol=0, atol=0)


def _patched_mid_training() -> dict[str, Any]:
    """Hooks patched onto the local tensors after a step, removed after two more: each all-gather follows what the
    local tensor has then (the unsharded tensors the other way built are dropped). Oracle: the unsharded model,
    rounding its weights to bf16 in the same steps."""
    from fully_shard import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = nn.Sequential(*[_MLP() for _ in range(2)]).to(device())
    model = copy.deepcopy(ref)
    for mlp in model:
        fully_shard(mlp)
    fully_shard(model)
    adam = lambda ps: torch.optim.Adam(ps, lr=1e-2)  # noqa: E731
    opt, ref_opt = adam(model.parameters()), ShardwiseOptimizer(ref.parameters(), world, adam)
    calls = []
    for step, hooked in enumerate((False, True, True, False)):
        for p in model.parameters():
            local = p._local_tensor
            if hooked and not hasattr(local, "fsdp_pre_all_gather"):
                local.fsdp_pre_all_gather, local.fsdp_post_all_gather = (_bf16_pre.__get__(local),
                                                                         _bf16_post.__get__(local))
            elif not hooked and hasattr(local, "fsdp_pre_all_gather"):
                del local.fsdp_pre_all_gather, local.fsdp_post_all_gather
        for mlp in ref:
            mlp.round_to = torch.bfloat16 if hooked else None
        _SEEN.update(pre=0)
        xs = [torch.randn(2, 8, generator=torch.Generator().manual_seed(10 * step + r)).to(device())
              for r in range(world)]
        model(xs[rank]).sum().backward()
        (sum(ref(x).sum() for x in xs) / world).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        calls.append(_SEEN["pre"])
    for p, q in zip(model.parameters(), ref.parameters()):
        close(p._local_tensor, rows(q.detach()), 0.0, "after 4 steps")  # bitwise: an exact 2-rank average, see oracle
    return {"calls": calls}


def test_hooks_patched_and_removed_between_steps_follow_the_local_tensor() -> None:
    for r in run_distributed(_patched_mid_training, 2):
        assert r["calls"] == [0, 8, 8, 0], r  # 4 weights, forward + backward all-gathers, only while patched


def _refused() -> dict[str, Any]:
    """What is refused at the all-gather (where torch's FSDP2 looks the hooks up), on 4 ranks: a wrapper subclass
    without hooks (torch gathers it as a plain tensor), one hook without the other, and hooks patched onto the local
    tensor after a ``reshard_after_forward=2`` call (refused at the call when they are there already)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fully_shard import fully_shard

    x = torch.ones(2, 4, device=device())

    def first_forward(module: nn.Module) -> str:
        try:
            module(x)
        except NotImplementedError as e:
            return str(e)
        return "no error"

    lin = nn.Linear(4, 4)
    lin.weight = nn.Parameter(torch.Tensor._make_subclass(torch.Tensor, torch.zeros(4, 4)))  # plain: fine
    fully_shard(lin)
    out = {"plain": type(lin.weight._local_tensor).__name__}
    lin(x)
    lin = nn.Linear(4, 4)
    lin.weight = nn.Parameter(_Opaque(torch.zeros(4, 4)))
    fully_shard(lin)
    out["opaque"] = first_forward(lin)
    theirs = nn.Linear(4, 4)
    theirs.weight = nn.Parameter(_Opaque(torch.zeros(4, 4)))
    torch_fully_shard(theirs)
    theirs.unshard()
    out["torch_opaque_unsharded"] = type(theirs.weight).__name__
    lin = nn.Linear(4, 4)
    fully_shard(lin)
    lin.weight._local_tensor.fsdp_pre_all_gather = _self_pre.__get__(lin.weight._local_tensor)
    out["one_hook"] = first_forward(lin)
    block = nn.Sequential(nn.Linear(4, 4))
    fully_shard(block, reshard_after_forward=2)
    local = block[0].weight._local_tensor
    local.fsdp_pre_all_gather, local.fsdp_post_all_gather = _self_pre.__get__(local), _self_post.__get__(local)
    out["int_reshard"] = first_forward(block)
    return out


class _Opaque(HalfGather):
    """A wrapper subclass without the extension hooks: cannot be gathered as such."""

    def __getattribute__(self, name: str) -> Any:
        if name in ("fsdp_pre_all_gather", "fsdp_post_all_gather"):
            raise AttributeError(name)
        return super().__getattribute__(name)


def test_subclass_without_hooks_and_half_hooks_are_refused_at_the_all_gather() -> None:
    for r in run_distributed(_refused, 4):
        assert r["plain"] == "Tensor", r
        # accepted by fully_shard (hooks may be patched on later), refused at the first all-gather
        msg = r["opaque"]
        assert "'weight'" in msg and "_Opaque" in msg and "plain tensor" in msg and "param._local_tensor" in msg, msg
        assert r["torch_opaque_unsharded"] == "Parameter", r  # what torch's FSDP2 does: a plain tensor, silently
        assert ("'weight'" in r["one_hook"]
                and "has fsdp_pre_all_gather but not fsdp_post_all_gather" in r["one_hook"]), r
        assert "'0.weight'" in r["int_reshard"] and "reshard_after_forward=<int>" in r["int_reshard"], r


def _spmd(case: str, use_torch: bool) -> dict[str, Any]:
    """dp_mesh_dims: HalfGather weights as DTensors on the whole SPMD mesh (test_drop_in's
    ``SpmdMLP`` and cases), trained 2 steps."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from fully_shard import DataParallelMeshDims, fully_shard
    from tests.test_drop_in import SPMD_CASES, SpmdMLP

    shape, names, tp, fields = SPMD_CASES[case]
    if use_torch:  # torch 2.13 and later
        from torch.distributed.fsdp import DataParallelMeshDims as TorchDims
    shard, dims = (torch_fully_shard, TorchDims) if use_torch else (fully_shard, DataParallelMeshDims)
    mesh = init_device_mesh(device_type(), shape, mesh_dim_names=names)
    model = SpmdMLP(mesh, tp)
    for name, p in list(model.named_parameters()):
        setattr(model, name, nn.Parameter(DTensor.from_local(HalfGather(p._local_tensor.clone()), mesh, p.placements,
                                                             run_check=False)))
        getattr(model, name)._spec = dataclasses.replace(p._spec, mesh=mesh)  # `mesh` itself: see test_drop_in's _spmd
    HalfGather.calls.update(pre=0, post=0, post_out=0)
    HalfGather.meshes.clear()
    shard(model, mesh=mesh, dp_mesh_dims=dims(**fields))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    for step in range(2):
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(step), device="cpu").to(device())
        loss = model(distribute_tensor(x, mesh, [Replicate() if n == tp else Shard(0)
                                                 for n in names])).pow(2).sum().full_tensor()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    local = [p._local_tensor for p in model.parameters()]
    return {
        "losses": losses, "calls": dict(HalfGather.calls), "meshes": sorted(HalfGather.meshes),
        "types": [type(t).__name__ for t in local], "local": [t._t.clone() for t in local],
    }


@pytest.mark.parametrize("case", ["fsdp", "fsdp_two_shard_dims_tp", "hsdp_two_shard_dims"])
def test_own_subclass_with_dp_mesh_dims_matches_torch_fsdp2(case: str) -> None:
    ours = run_distributed(_spmd, 4, case, False)
    skip_without_torch_feature("DataParallelMeshDims")  # torch 2.11: ours trains, the comparison is skipped
    theirs = run_distributed(_spmd, 4, case, True)
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        assert a["types"] == b["types"] == ["HalfGather", "HalfGather"], a["types"]
        assert a["calls"] == b["calls"] == {"pre": 4, "post": 4, "post_out": 2}, (a["calls"], b["calls"])
        assert a["meshes"] == b["meshes"], (a["meshes"], b["meshes"])  # the mesh float8 reduces its amax over
        # bitwise: fp32 gathered exactly, the same gradient reductions as torch over the same layout
        assert a["losses"] == b["losses"], f"rank {rank}: {a['losses']} != torch's {b['losses']}"
        for p, q in zip(a["local"], b["local"]):
            torch.testing.assert_close(p, q, rtol=0, atol=0)

# ---------------------------------------------------------------------------
# Hooks looked up on the local tensor at each all-gather (the programs of torch's test_fully_shard_extensions.py):
# patched onto a plain or TwoTensor parameter's local tensor after fully_shard (and to_empty()), on TwoTensor's class
# (both signatures), on FSDP and HSDP meshes, with and without mixed precision.
# ---------------------------------------------------------------------------

_SEEN: dict[str, Any] = {"pre": 0, "meshes": set()}  # per worker: fsdp_pre_all_gather calls, the meshes it was given


class _MLP(nn.Module):
    """torch's test MLP, without biases: dim -> 4 dim -> dim."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.in_proj, self.out_proj = nn.Linear(dim, 4 * dim, bias=False), nn.Linear(4 * dim, dim, bias=False)
        self.round_to: torch.dtype | None = None  # the reference of the bf16 hooks: compute with the weights they send
        self.compute_in: torch.dtype | None = None  # the reference of mixed precision: compute in param_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(self.out_proj, torch.relu(self._linear(self.in_proj, x)))

    def _linear(self, lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        w = lin.weight
        # exactly the rounded weight (Sterbenz: r - w is exact), gradient straight through
        if self.round_to is not None:
            w = w + (w.to(self.round_to).to(w.dtype) - w).detach()
        if self.compute_in is not None:
            w, x = w.to(self.compute_in), x.to(self.compute_in)
        return nn.functional.linear(x, w)


def _record(mesh: Any) -> None:
    _SEEN["pre"] += 1
    _SEEN["meshes"].add(tuple(mesh.mesh.tolist()))


def _bf16_pre(self: torch.Tensor, mesh: Any, outer_size: Any, outer_stride: Any, module: nn.Module,
              mp_policy: Any) -> Any:
    """torch's monkey-patched pair: send the shard in bf16, ..."""
    _record(mesh)
    return (self.to(torch.bfloat16),), None


@torch.no_grad()
def _bf16_post(self: torch.Tensor, outputs: Any, metadata: Any, param_dtype: torch.dtype, *, out: Any = None) -> Any:
    """... and upcast the gathered tensor to the parameter's dtype (into ``out`` after the first time)."""
    (t,) = outputs
    assert metadata is None and t.dtype == torch.bfloat16, (metadata, t.dtype)
    if out is not None:
        with _unsafe_preserve_version_counter(out):
            out.copy_(t)
        return None
    up = t.to(param_dtype)
    return up, (t, up)


def _self_pre(self: torch.Tensor, mesh: Any, outer_size: Any, outer_stride: Any, module: nn.Module,
              mp_policy: Any) -> Any:
    """torch's HSDP pair: gather the local tensor itself (a TwoTensor: copied in as a plain tensor) ..."""
    _record(mesh)
    return (self,), None


@torch.no_grad()
def _self_post(self: torch.Tensor, outputs: Any, metadata: Any, param_dtype: torch.dtype, *, out: Any = None) -> Any:
    """... and compute with the gathered output (refilled in place, ``out`` aliases it)."""
    (t,) = outputs
    return None if out is not None else (t, (t,))


def _two_pre_v1(self: Any, mesh: Any) -> Any:
    """TwoTensor's class hooks (torch's, the one-argument signature): gather both inner tensors ..."""
    _record(mesh)
    return (self.a, self.b), None


def _two_pre_v2(self: Any, mesh: Any, outer_size: Any, outer_stride: Any, module: nn.Module, mp_policy: Any) -> Any:
    return _two_pre_v1(self, mesh)


@torch.no_grad()
def _two_post(self: Any, outputs: Any, metadata: Any, param_dtype: torch.dtype, *, out: Any = None) -> Any:
    """... and rebuild a TwoTensor in the parameter dtype (copied into ``out`` when a cast made it separate)."""
    from torch.testing._internal.two_tensor import TwoTensor

    a, b = outputs
    if out is None:
        return TwoTensor(a, b).to(param_dtype), (a, b)
    assert isinstance(out, TwoTensor), type(out)
    if a.dtype != param_dtype:
        out.a.copy_(a)
        out.b.copy_(b)
    return None


_HOOKS = {"bf16": (_bf16_pre, _bf16_post), "self": (_self_pre, _self_post), "v1": (_two_pre_v1, _two_post),
          "v2": (_two_pre_v2, _two_post)}


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A TwoTensor's values (its halves stay equal: every op runs on both), any other tensor as it is."""
    from torch.testing._internal.two_tensor import TwoTensor

    if isinstance(t, TwoTensor):
        assert torch.equal(t.a, t.b)
        return t.a
    return t


def _local_hooks(weights: str, hooks: str, where: str, meta: bool, hsdp: bool, mp: bool) -> dict[str, Any]:
    """One program three ways: fully_shard, torch's FSDP2, the unsharded model (gradients averaged, stepped in the
    shard layout). ``weights``: "plain" or "two" (TwoTensor(w, w.clone())); ``hooks`` patched ``where``: "local"
    (onto each sharded weight's local tensor, after fully_shard and, with ``meta``, after to_empty()) or "class"
    (TwoTensor's); ``hsdp``: a (2, world/2) mesh; ``mp``: param_dtype bf16. Adam, 3 steps, a batch per rank."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import distribute_tensor
    from torch.testing._internal.two_tensor import TwoTensor

    from fully_shard import MixedPrecisionPolicy, fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    shape, names = ((2, world // 2), ("replicate", "shard")) if hsdp else ((world,), None)
    mesh = init_device_mesh(device_type(), shape, mesh_dim_names=names)
    torch.manual_seed(0)
    src = nn.Sequential(*[_MLP() for _ in range(3)]).to(device())
    pre, post = _HOOKS[hooks]

    def build(shard: Any, mp_cls: Any) -> nn.Module:
        with torch.device("meta") if meta else contextlib.nullcontext():
            model = copy.deepcopy(src) if not meta else nn.Sequential(*[_MLP() for _ in range(3)])
            if weights == "two":
                for lin in (m for mlp in model for m in (mlp.in_proj, mlp.out_proj)):
                    lin.weight = nn.Parameter(TwoTensor(lin.weight.detach(), lin.weight.detach().clone()))
        policy = mp_cls(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mp else mp_cls()
        for mlp in model:
            shard(mlp, mesh=mesh, mp_policy=policy)
        shard(model, mesh=mesh, mp_policy=policy)
        if meta:
            model.to_empty(device=device())
            with torch.no_grad():
                for p, q in zip(model.parameters(), src.parameters()):
                    p._local_tensor.copy_(distribute_tensor(q.detach(), p.device_mesh, p.placements).to_local())
        if where == "local":  # after to_empty(): it makes new local tensors
            for p in model.parameters():
                local = p._local_tensor
                local.fsdp_pre_all_gather, local.fsdp_post_all_gather = pre.__get__(local), post.__get__(local)
        return model

    def train(model: nn.Module, ref: bool) -> dict[str, Any]:
        _SEEN.update(pre=0, meshes=set())
        adam = lambda ps: torch.optim.Adam(ps, lr=1e-2)  # noqa: E731
        opt = ShardwiseOptimizer(model.parameters(), shape[-1], adam) if ref else adam(model.parameters())
        types = [type(p._local_tensor).__name__ for p in model.parameters()] if not ref else []
        losses = []
        for step in range(3):
            xs = [torch.randn(2, 8, generator=torch.Generator().manual_seed(10 * step + r)).to(device())
                  for r in range(world)]
            each = [model(x).sum() for x in xs] if ref else [model(xs[rank]).sum()]  # the reference: every rank's batch
            (sum(each) / len(each)).backward()
            opt.step()
            opt.zero_grad()
            losses.append(_plain(each[rank if ref else 0].detach()).item())
        params = [_plain(p.detach()) if ref else _plain(p._local_tensor).clone() for p in model.parameters()]
        return {"losses": losses, "params": params, "types": types, "pre": _SEEN["pre"],
                "meshes": sorted(_SEEN["meshes"])}

    if where == "class":
        TwoTensor.fsdp_pre_all_gather, TwoTensor.fsdp_post_all_gather = pre, post  # type: ignore[attr-defined]
    try:
        out = {"ours": train(build(fully_shard, MixedPrecisionPolicy), False),
               "torch": train(build(torch_fully_shard, TorchMP), False)}
    finally:
        for name in ("fsdp_pre_all_gather", "fsdp_post_all_gather"):
            if hasattr(TwoTensor, name):
                delattr(TwoTensor, name)
    for mlp in src:
        mlp.round_to = torch.bfloat16 if hooks == "bf16" else None
        mlp.compute_in = torch.bfloat16 if mp else None
    out["ref"] = train(src, True)
    shard_rank = mesh.get_local_rank(mesh.ndim - 1)
    out["ref"]["params"] = [p.chunk(shape[-1])[shard_rank] for p in out["ref"]["params"]]  # this rank's rows
    return out


@pytest.mark.parametrize(
    ("world_size", "weights", "hooks", "where", "meta", "hsdp", "mp"),
    [
        (2, "plain", "bf16", "local", True, False, False),  # a plain tensor, hooks patched after to_empty()
        (4, "plain", "bf16", "local", False, False, False),  # ... patched after fully_shard
        (2, "two", "bf16", "local", True, False, False),  # torch's test_all_gather_extensions_monkey_patch
        (2, "two", "v1", "class", False, False, False),  # torch's test_all_gather_extensions_train_parity
        (4, "two", "v2", "class", True, False, True),  # ... and test_all_gather_extensions_end_to_end (meta, bf16)
        (4, "two", "self", "local", False, True, False),  # torch's test_all_gather_extension_hsdp_mesh, trained
        (4, "two", "v2", "class", False, True, True),  # TwoTensor on HSDP with mixed precision
    ],
    ids=["plain-meta-2", "plain-4", "two-local-meta-2", "two-class-v1-2", "two-class-v2-meta-bf16-4",
         "two-local-hsdp-4",
         "two-class-hsdp-bf16-4"],
)
def test_hooks_on_local_tensor_match_torch_fsdp2(world_size: int, weights: str, hooks: str, where: str, meta: bool,
                                                 hsdp: bool,
                                                  mp: bool) -> None:
    """torch's FSDP2 looks the all-gather hooks up on the sharded parameter's local tensor at every all-gather, so a
    wrapper subclass without them (TwoTensor) shards, and hooks patched onto one instance, even of a plain tensor,
    apply. Bitwise against torch (the same gathers, casts and reductions); against the unsharded model bitwise on 2
    ranks (an exact average, Adam on the same chunks), else within the oracle's tolerances (bf16: those of mixed
    precision)."""
    results = run_distributed(_local_hooks, world_size, weights, hooks, where, meta, hsdp, mp)
    shard_size = world_size // 2 if hsdp else world_size
    gathers = 6 * 3 * 2  # 6 weights, 3 steps, forward + backward (resharded after forward)
    for rank, r in enumerate(results):
        ours, theirs, ref = r["ours"], r["torch"], r["ref"]
        kind = "TwoTensor" if weights == "two" else "Tensor"
        # kept, never made plain
        assert ours["types"] == theirs["types"] == [kind] * 6, (ours["types"], theirs["types"])
        # the hooks ran at every all-gather
        assert ours["pre"] == theirs["pre"] == gathers, (ours["pre"], theirs["pre"])
        # the shard mesh only (HSDP: this rank's replica), as torch passes it
        assert ours["meshes"] == theirs["meshes"] and len(ours["meshes"]) == 1, (ours["meshes"], theirs["meshes"])
        assert len(ours["meshes"][0]) == shard_size and rank in ours["meshes"][0], ours["meshes"]
        assert ours["losses"] == theirs["losses"], f"rank {rank}: {ours['losses']} != torch's {theirs['losses']}"
        for p, q in zip(ours["params"], theirs["params"]):
            torch.testing.assert_close(p, q, rtol=0, atol=0)
        close(torch.tensor(ours["losses"]), torch.tensor(ref["losses"]), ref_tol("loss", world_size),
              f"rank {rank} losses")
        for i, (p, q) in enumerate(zip(ours["params"], ref["params"])):
            close(p, q, ref_tol("param", world_size), f"rank {rank} parameter {i} vs the unsharded model")


# ---------------------------------------------------------------------------
# torchao: float8 training with float8 all-gathers, int8 weight-only quantized training
# ---------------------------------------------------------------------------


def _float8(sharded: bool) -> dict[str, Any]:
    """float8 training with torchao, sharded by fully_shard or (the oracle) unsharded with
    gradients averaged over the ranks. torch's own FSDP2 cannot be the oracle here: it
    all-gathers float8 tensors as such, and gloo has no float8 ("Invalid scalar type")."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from fully_shard import fully_shard
    from fully_shard.comm import add_observer, remove_observer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64, bias=False), nn.ReLU(), nn.Linear(64, 32, bias=False))
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    rank, world = dist.get_rank(), dist.get_world_size()
    if sharded:
        mesh = init_device_mesh(device_type(), (world,))
        for lin in (model[0], model[2]):
            fully_shard(lin, mesh=mesh)
        fully_shard(model, mesh=mesh)
    local_types = [type(p._local_tensor if sharded else p).__name__ for p in model.parameters()]
    events: list[Any] = []
    add_observer(events.append)
    make_opt = lambda ps: torch.optim.AdamW(ps, lr=1e-2)  # noqa: E731
    # the reference steps the same dim-0 chunks as the shards (tests/oracle.py)
    opt = make_opt(model.parameters()) if sharded else ShardwiseOptimizer(model.parameters(), world, make_opt)
    losses = []
    try:
        for step in range(3):
            x = torch.randn(16, 32, generator=torch.Generator().manual_seed(10 * step + rank),
                            device="cpu").to(device())
            loss = model(x).pow(2).mean()
            loss.backward()
            if not sharded:
                average_gradients(model)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    finally:
        remove_observer(events.append)
    gathered = sorted({e.nbytes for e in events if e.kind == "all_gather"})
    if sharded:
        params = [p.to_local()._tensor.contiguous() for p in model.parameters()]  # this rank's rows
    else:
        params = [p._tensor.chunk(world)[rank].contiguous() for p in model.parameters()]
    return {"losses": losses, "params": params, "local_types": local_types, "ag_bytes": gathered}


def test_torchao_float8_all_gathers_float8_and_matches_unsharded() -> None:
    pytest.importorskip("torchao")
    ours = run_distributed(_float8, 2, True)
    ref = run_distributed(_float8, 2, False)
    for rank, (a, b) in enumerate(zip(ours, ref)):
        assert a["local_types"] == b["local_types"] == ["WeightWithDynamicFloat8CastTensor"] * 2, a["local_types"]
        # each weight's shard is 32x32 elements on each rank: 1 byte each on the wire (fp32: 4096)
        assert a["ag_bytes"] == [32 * 32], a["ag_bytes"]
        # bitwise: the same float8 casts (the scale from the all-reduced amax = the full
        # weight's amax); an AVG of two gradients either way; AdamW on the same chunks
        assert a["losses"] == b["losses"], f"rank {rank}: {a['losses']} != unsharded {b['losses']}"
        for p, q in zip(a["params"], b["params"]):
            torch.testing.assert_close(p, q, rtol=0, atol=0)


def _int8(use_torch: bool) -> dict[str, Any]:
    """int8 weight-only quantized training (torchao): the int8 data and fp32 scales of each
    weight travel in one all-gather; torch's FSDP2 is the oracle."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torchao import quantize_
    from torchao.prototype.quantized_training import int8_weight_only_quantized_training

    from fully_shard import fully_shard

    shard = torch_fully_shard if use_torch else fully_shard
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64, bias=False), nn.ReLU(), nn.Linear(64, 32, bias=False))
    quantize_(model, int8_weight_only_quantized_training())
    mesh = init_device_mesh(device_type(), (dist.get_world_size(),))
    for lin in (model[0], model[2]):
        shard(lin, mesh=mesh)
    shard(model, mesh=mesh)
    local_types = [type(p._local_tensor).__name__ for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)  # the int8 weight has no mul_
    losses = []
    for step in range(3):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()),
                        device="cpu").to(device())
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    local = [p.to_local() for p in model.parameters()]
    return {
        "losses": losses, "int": [t.int_data.clone() for t in local], "scale": [t.scale.clone() for t in local],
        "local_types": local_types
    }


def test_torchao_int8_quantized_training_matches_torch_fsdp2() -> None:
    pytest.importorskip("torchao")
    ours = run_distributed(_int8, 2, False)
    theirs = run_distributed(_int8, 2, True)
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        assert a["local_types"] == b["local_types"] == ["Int8QuantizedTrainingLinearWeight"] * 2, a["local_types"]
        # bitwise: the same int8 data and scales gathered, the same AVG of two gradients
        assert a["losses"] == b["losses"], f"rank {rank}: {a['losses']} != torch's {b['losses']}"
        for p, q in zip(a["int"] + a["scale"], b["int"] + b["scale"]):
            torch.testing.assert_close(p, q, rtol=0, atol=0)


def _uneven() -> None:
    """A 5-row HalfGather weight on 2 ranks (3 + 2 rows): the short rank's input is padded
    into its slot and the padding rows cut off the unsharded parameter. Oracle: the plain
    unsharded model, AdamW on the same chunks (tests/oracle.py)."""
    from fully_shard import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 3))
    ref = copy.deepcopy(model)
    model[0].weight = nn.Parameter(HalfGather(model[0].weight.detach().clone()))
    fully_shard(model)
    assert type(model[0].weight._local_tensor) is HalfGather
    rank, world = dist.get_rank(), dist.get_world_size()
    make_opt = lambda ps: torch.optim.AdamW(ps, lr=1e-2)  # noqa: E731
    opt, ref_opt = make_opt(model.parameters()), ShardwiseOptimizer(ref.parameters(), world, make_opt)
    for step in range(3):
        xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + r), device="cpu").to(device())
              for r in range(world)]
        model(xs[rank]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sum(ref(x).pow(2).mean() for x in xs).div(world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    local = model[0].weight._local_tensor._t
    # bitwise: fp32 gathered exactly, a two-rank AVG, AdamW on the same chunks
    torch.testing.assert_close(local, ref[0].weight.detach().chunk(world)[rank], rtol=0, atol=0)


def test_own_subclass_unevenly_sharded_matches_unsharded() -> None:
    run_distributed(_uneven, 2)


def _float8_tp(use_torch: bool, float8_tp: bool, shard_dim: int = 0) -> dict[str, Any]:
    """torchtitan's float8 recipe on a (dp=2, tp=2) mesh: float8 training with float8 FSDP all-gathers, torch TP
    (torchao's float8 TP styles, or torch's plain ones) on mesh["tp"], then fully_shard on mesh["dp"] (the weights on
    ``Shard(shard_dim)``). torch's FSDP2 is the oracle: gloo has no float8, so its all-gather is given a custom comm
    that moves the same bytes as uint8."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    from fully_shard import fully_shard
    from fully_shard.comm import add_observer, remove_observer

    class ByteAllGather(AllGather):
        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                     async_op: bool = False) -> Any:
            out, inp = output_tensor.view(torch.uint8), input_tensor.view(torch.uint8)
            return dist.all_gather_into_tensor(out, inp, group=group, async_op=async_op)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64, bias=False), nn.ReLU(), nn.Linear(64, 32, bias=False))
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("dp", "tp"))
    styles = (Float8ColwiseParallel(), Float8RowwiseParallel()) if float8_tp else (ColwiseParallel(), RowwiseParallel())
    parallelize_module(model, mesh["tp"], dict(zip(("0", "2"), styles)))
    for module in (model[0], model[2], model):
        (torch_fully_shard if use_torch else fully_shard)(module, mesh=mesh["dp"],
                                                          shard_placement_fn=lambda p: Shard(shard_dim))
        if use_torch:
            module.set_custom_all_gather(ByteAllGather())  # type: ignore[operator]
    local_types = [type(p._local_tensor).__name__ for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, events = [], []
    add_observer(events.append)
    try:
        for step in range(3):
            seed = 10 * step + mesh["dp"].get_local_rank()  # one batch per TP group
            x = torch.randn(16, 32, generator=torch.Generator().manual_seed(seed), device="cpu").to(device())
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    finally:
        remove_observer(events.append)
    params = [p.to_local()._tensor.clone() for p in model.parameters()]  # this rank's part, fp32
    return {
        "losses": losses, "params": params, "local_types": local_types,
        "placements": [str(p.placements) for p in model.parameters()],
        "ag_bytes": sorted({e.nbytes for e in events if e.kind == "all_gather"}),
    }


@pytest.mark.parametrize(
    ("float8_tp", "shard_dim"), [(True, 0), (False, 0), (True, 1)],
    ids=["float8_tp_styles", "torch_tp_styles", "float8_tp_shard1"]
)
def test_torchao_float8_with_tensor_parallel_matches_torch_fsdp2(float8_tp: bool, shard_dim: int) -> None:
    pytest.importorskip("torchao")
    ours = run_distributed(_float8_tp, 4, False, float8_tp, shard_dim)
    theirs = run_distributed(_float8_tp, 4, True, float8_tp, shard_dim)
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        assert a["local_types"] == b["local_types"] == ["WeightWithDynamicFloat8CastTensor"] * 2, a["local_types"]
        assert a["placements"] == b["placements"], (a["placements"], b["placements"])
        # each weight's part is 16x32 or 32x16 (TP, then FSDP, halve 64x32): 1 byte each on the wire
        assert a["ag_bytes"] == [16 * 32], a["ag_bytes"]
        assert all(f"Shard(dim={shard_dim})" in p for p in a["placements"]), a["placements"]
        assert len(set(a["losses"])) == 3, a["losses"]  # it trains
        # bitwise: the same float8 casts of the same TP-local weights (scale from the amax
        # all-reduced over the dp mesh, as torch passes it), the same gloo AVG, AdamW on the same parts
        assert a["losses"] == b["losses"], f"rank {rank}: {a['losses']} != torch's {b['losses']}"
        for p, q in zip(a["params"], b["params"]):
            torch.testing.assert_close(p, q, rtol=0, atol=0)
