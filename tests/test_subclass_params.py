"""Parameters that are tensor subclasses taking over their own all-gather through torch's
FSDP2 extension contract (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``).

``HalfGather`` is our own subclass: it sends its shard in ``mp_policy.param_dtype`` (bf16
here), counts its hook calls, and on later all-gathers relies on ``out=`` (the unsharded
parameter aliases the gathered buffer, which must be refilled in place). Each test trains
the same model with ``fully_shard`` and with torch's FSDP2 (the oracle) on 2 gloo ranks (the
own-subclass test on 4 too): bitwise, because both run the same casts and the same gloo
reduce-scatter (AVG) over the same layout, so the same sums in the same order. Also with
tensor parallelism (the hooks see the TP-local part), ``Shard(1)`` and ``dp_mesh_dims``.
torchao's float8 (also with TP) and int8 recipes are in the second half (skipped without torchao).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from tests.harness import device, device_type, run_distributed
from tests.oracle import ShardwiseOptimizer, average_gradients

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

    def fsdp_pre_all_gather(self, mesh: Any, outer_size: Any, outer_stride: Any, module: nn.Module, mp_policy: Any) -> Any:
        HalfGather.calls["pre"] += 1
        HalfGather.meshes.add(str(mesh.mesh.tolist()))
        dtype = mp_policy.param_dtype or self.dtype
        HalfGather.gathered_dtypes.append(dtype)
        return (self._t.to(dtype),), ("meta", dtype)

    def fsdp_post_all_gather(
        self, outputs: tuple[torch.Tensor, ...], metadata: Any, param_dtype: torch.dtype, *, out: torch.Tensor | None = None
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
        "params": [p.full_tensor() if not isinstance(p._local_tensor, HalfGather) else _full(p) for p in model.parameters()],
        "placements": [str(p.placements) for p in model.parameters()],
        "local_types": local_types,
        "calls": dict(HalfGather.calls),
        "dtypes": sorted({str(d) for d in HalfGather.gathered_dtypes}),
        "meshes": sorted(HalfGather.meshes),
    }


def _full(p: DTensor) -> torch.Tensor:
    """The full fp32 value of a HalfGather DTensor parameter (its local values, redistributed
    by DTensor as a plain tensor)."""
    return DTensor.from_local(p._local_tensor._t.contiguous(), p.device_mesh, p.placements, run_check=False).full_tensor()


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_own_subclass_matches_torch_fsdp2(bf16: bool, world_size: int) -> None:
    ours = run_distributed(_train, world_size, False, bf16)
    theirs = run_distributed(_train, world_size, True, bf16)
    assert len(ours) == len(theirs) == world_size
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        # the sharded weights stay HalfGather (never silently plain)
        assert a["local_types"] == b["local_types"] == ["HalfGather", "Tensor", "HalfGather", "Tensor"], a["local_types"]
        # 2 weights x 3 steps x (forward + backward) all-gathers; the first of each builds the
        # unsharded parameter, every later one refills it through out=
        assert a["calls"] == b["calls"] == {"pre": 12, "post": 12, "post_out": 10}, (a["calls"], b["calls"])
        assert a["dtypes"] == [("torch.bfloat16" if bf16 else "torch.float32")], a["dtypes"]
        assert a["losses"] == b["losses"], f"rank {rank}: {a['losses']} != torch's {b['losses']}"  # bitwise: see docstring
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
        assert a["local_types"] == b["local_types"] == ["HalfGather", "Tensor", "HalfGather", "Tensor"], a["local_types"]
        assert a["calls"] == b["calls"] == {"pre": 12, "post": 12, "post_out": 10}, (a["calls"], b["calls"])
        assert a["dtypes"] == ["torch.bfloat16"], a["dtypes"]
        assert a["placements"] == b["placements"], (a["placements"], b["placements"])
        assert a["meshes"] == b["meshes"] and len(a["meshes"]) == 1, (a["meshes"], b["meshes"])  # the dp mesh
        assert f"Shard(dim={shard_dim})" in a["placements"][0] and ("Shard(dim=1)" in a["placements"][2]) == (tp or shard_dim == 1)
        assert a["losses"] == b["losses"], f"rank {rank}: {a['losses']} != torch's {b['losses']}"
        for p, q in zip(a["params"], b["params"]):
            torch.testing.assert_close(p, q, rtol=0, atol=0)


def _no_hooks() -> str:
    from fully_shard import fully_shard

    lin = nn.Linear(4, 4)
    lin.weight = nn.Parameter(torch.Tensor._make_subclass(torch.Tensor, torch.zeros(4, 4)))  # plain: fine
    fully_shard(lin)
    lin = nn.Linear(4, 4)
    lin.weight = nn.Parameter(_Opaque(torch.zeros(4, 4)))
    try:
        fully_shard(lin)
    except NotImplementedError as e:
        return str(e)
    return "no error"


class _Opaque(HalfGather):
    """A wrapper subclass without the extension hooks: cannot be sharded as such."""

    def __getattribute__(self, name: str) -> Any:
        if name in ("fsdp_pre_all_gather", "fsdp_post_all_gather"):
            raise AttributeError(name)
        return super().__getattribute__(name)


def test_subclass_without_hooks_is_refused() -> None:
    msg = run_distributed(_no_hooks, 1)[0]
    assert "'weight'" in msg and "_Opaque" in msg and "plain tensor" in msg, msg


def _spmd(case: str, use_torch: bool) -> dict[str, Any]:
    """dp_mesh_dims: HalfGather weights as DTensors on the whole SPMD mesh (test_drop_in's
    ``SpmdMLP`` and cases), trained 2 steps."""
    from torch.distributed.fsdp import DataParallelMeshDims as TorchDims
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from fully_shard import DataParallelMeshDims, fully_shard
    from tests.test_drop_in import SPMD_CASES, SpmdMLP

    shape, names, tp, fields = SPMD_CASES[case]
    shard, dims = (torch_fully_shard, TorchDims) if use_torch else (fully_shard, DataParallelMeshDims)
    mesh = init_device_mesh(device_type(), shape, mesh_dim_names=names)
    model = SpmdMLP(mesh, tp)
    for name, p in list(model.named_parameters()):
        setattr(model, name, nn.Parameter(DTensor.from_local(HalfGather(p._local_tensor.clone()), mesh, p.placements, run_check=False)))
        getattr(model, name)._spec = dataclasses.replace(p._spec, mesh=mesh)  # `mesh` itself: see test_drop_in's _spmd
    HalfGather.calls.update(pre=0, post=0, post_out=0)
    HalfGather.meshes.clear()
    shard(model, mesh=mesh, dp_mesh_dims=dims(**fields))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    for step in range(2):
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(step), device="cpu").to(device())
        loss = model(distribute_tensor(x, mesh, [Replicate() if n == tp else Shard(0) for n in names])).pow(2).sum().full_tensor()
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
            x = torch.randn(16, 32, generator=torch.Generator().manual_seed(10 * step + rank), device="cpu").to(device())
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
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()), device="cpu").to(device())
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    local = [p.to_local() for p in model.parameters()]
    return {
        "losses": losses, "int": [t.int_data.clone() for t in local], "scale": [t.scale.clone() for t in local], "local_types": local_types
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
        xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + r), device="cpu").to(device()) for r in range(world)]
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
    """torchtitan's float8 recipe on a (dp=2, tp=2) mesh: float8 training with float8 FSDP
    all-gathers, torch TP (torchao's float8 TP styles, or torch's plain ones) on mesh["tp"],
    then fully_shard on mesh["dp"] (the weights on ``Shard(shard_dim)``). torch's FSDP2 is the oracle: gloo has no float8, so its
    all-gather is given a custom comm that moves the same bytes as uint8."""
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

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False) -> Any:
            out, inp = output_tensor.view(torch.uint8), input_tensor.view(torch.uint8)
            return dist.all_gather_into_tensor(out, inp, group=group, async_op=async_op)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64, bias=False), nn.ReLU(), nn.Linear(64, 32, bias=False))
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("dp", "tp"))
    styles = (Float8ColwiseParallel(), Float8RowwiseParallel()) if float8_tp else (ColwiseParallel(), RowwiseParallel())
    parallelize_module(model, mesh["tp"], dict(zip(("0", "2"), styles)))
    for module in (model[0], model[2], model):
        (torch_fully_shard if use_torch else fully_shard)(module, mesh=mesh["dp"], shard_placement_fn=lambda p: Shard(shard_dim))
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
        "losses": losses, "params": params, "local_types": local_types, "placements": [str(p.placements) for p in model.parameters()],
        "ag_bytes": sorted({e.nbytes for e in events if e.kind == "all_gather"}),
    }


@pytest.mark.parametrize(
    ("float8_tp", "shard_dim"), [(True, 0), (False, 0), (True, 1)], ids=["float8_tp_styles", "torch_tp_styles", "float8_tp_shard1"]
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
