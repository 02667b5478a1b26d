"""param.py and layout.py on a fake process group, in this process: one ``ShardedParam`` per layout (dim 0 padded,
another dim, HSDP, tensor parallel, ``dp_mesh_dims``, a local tensor that gathers itself), seen from every rank.

The sharded DTensors are compared with torch's FSDP2 sharding the same parameters (placements, mesh, shapes, local
values); the unsharded side is filled by ``comm.copy_out`` from an all-gather output built by hand from every rank's
part, since the fake process group moves no data.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from fully_shard import DataParallelMeshDims, MixedPrecisionPolicy, comm
from fully_shard.layout import EvenLayout, JoinedMesh, MeshLayout, RowLayout, SpmdMesh, layout_for
from fully_shard.mesh import mesh_info_for
from fully_shard.param import ShardedParam, accumulate_sharded_grads
from tests.torch_features import skip_without_torch_feature
from tests.unit.fake_pg import fake_world


def _sharded(param: nn.Parameter, mesh: DeviceMesh, shard_dim: int = 0, dims: DataParallelMeshDims | None = None,
             **kw: Any) -> ShardedParam:
    module = nn.Module()
    module.w = param
    info = mesh_info_for(mesh, dims)
    options = {"mp_policy": MixedPrecisionPolicy(), "offload": False, "pin_memory": False, **kw}
    return ShardedParam(param, "w", [(module, "w")], info, torch.device("cpu"), shard_dim=shard_dim, **options)


def _torch_sharded(param: nn.Parameter, mesh: DeviceMesh, shard_dim: int = 0, **kw: Any) -> DTensor:
    """torch's FSDP2 sharding of the same parameter: the oracle of the sharded layout."""
    module = nn.Module()
    module.w = nn.Parameter(param.detach().clone())
    if isinstance(param, DTensor):  # torch's FSDP2 wants the very mesh object it is given
        module.w._spec = dataclasses.replace(param._spec, mesh=mesh if kw.get("dp_mesh_dims") else param._spec.mesh)
    module.forward = lambda: None  # type: ignore[method-assign]
    torch_fully_shard(module, mesh=mesh, shard_placement_fn=lambda p: Shard(shard_dim), **kw)
    return module.w  # type: ignore[return-value]


def _same_sharding(ours: DTensor, theirs: DTensor) -> None:
    assert ours.placements == theirs.placements
    assert ours.device_mesh.shape == theirs.device_mesh.shape
    assert ours.device_mesh.mesh_dim_names == theirs.device_mesh.mesh_dim_names
    assert ours.shape == theirs.shape and ours.stride() == theirs.stride()
    assert torch.equal(ours.to_local(), theirs.to_local())


def _gather(sp: ShardedParam, full: torch.Tensor) -> None:
    """Fill ``sp``'s unsharded buffer as an all-gather would: every rank's part in its slot, the padding NaN."""
    lay = sp.layout
    slots = torch.full((lay.world, lay.slot_numel), float("nan"), dtype=full.dtype)
    for r in range(lay.world):
        part = layout_for(lay.size, lay.dim, lay.world, r, "w").local_part(full)
        slots[r, : part.numel()] = part.reshape(-1)
    sp.alloc_unsharded()
    comm.copy_out(comm.CollectiveWork(None, None, slots.view(-1), lay.world, "test"), [lay.slot_numel],
                  [sp.gather_dest(lay.world)])


@pytest.mark.parametrize(("shape", "shard_dim"), [((10, 3), 0), ((3, 1), 0), ((3, 8), 1), ((2, 4, 3), -2)])
def test_plain_parameter_at_every_rank_matches_torch(shape: tuple[int, ...], shard_dim: int) -> None:
    """Rows (padded: 10 rows on 4 ranks are 3, 3, 3, 1; 3 rows leave rank 3 none) or another dim (even)."""
    full = torch.randn(shape)
    for rank in range(4):
        with fake_world((4,), rank) as mesh:
            sp = _sharded(nn.Parameter(full.clone()), mesh, shard_dim)
            assert (type(sp.layout) is (RowLayout if shard_dim == 0 else EvenLayout)
                    and type(sp.mesh_layout) is MeshLayout)
            _same_sharding(sp.sharded_param, _torch_sharded(nn.Parameter(full.clone()), mesh, shard_dim))
            _gather(sp, full)
            assert isinstance(sp.unsharded_param, nn.Parameter) and not isinstance(sp.unsharded_param, DTensor)
            assert torch.equal(sp.unsharded_param, full)  # every rank's part in place, no padding (NaN) in it
            storage = sp.unsharded_param.untyped_storage()
            sp.free_unsharded()
            assert storage.size() == 0  # freed, but the same tensor objects stay for autograd
            unsharded = sp.unsharded_param
            _gather(sp, full * 2)
            assert sp.unsharded_param is unsharded and torch.equal(unsharded, full * 2)


def test_full_tensor_loads_as_this_ranks_part() -> None:
    full = torch.randn(10, 3)
    with fake_world((4,), 3) as mesh:
        sp = _sharded(nn.Parameter(torch.zeros(10, 3)), mesh)
        assert torch.equal(sp.full_to_sharded(full, "m.w").to_local(), full[9:])
        with pytest.raises(ValueError, match=r"load_state_dict: 'm.w' has shape \(10, 4\), the parameter \(10, 3\)"):
            sp.full_to_sharded(torch.zeros(10, 4), "m.w")


def test_uneven_other_dim_and_scalar_are_refused() -> None:
    with fake_world((4,)) as mesh:
        with pytest.raises(ValueError,
                           match=r"'w' of shape \(3, 6\) on Shard\(1\), which 4 ranks do not divide evenly"):
            _sharded(nn.Parameter(torch.zeros(3, 6)), mesh, 1)
        with pytest.raises(ValueError, match="cannot shard the scalar parameter 'w'"):
            _sharded(nn.Parameter(torch.zeros(())), mesh)


def test_hsdp_replicates_on_the_first_mesh_dim() -> None:
    full = torch.randn(5, 2)
    with fake_world((2, 2), 3, ("rep", "shard")) as mesh:
        sp = _sharded(nn.Parameter(full.clone()), mesh)
        _same_sharding(sp.sharded_param, _torch_sharded(nn.Parameter(full.clone()), mesh))
        assert sp.sharded_param.placements == (Replicate(), Shard(0))


@pytest.mark.parametrize(("tp_placement", "shard_dim", "expected"), [
    (Shard(0), 0, (_StridedShard(0, split_factor=2), Shard(0))),  # colwise: FSDP cuts within each TP piece
    (Shard(1), 0, (Shard(0), Shard(1))),  # rowwise
    (Shard(1), 1, (_StridedShard(1, split_factor=2), Shard(1))),
])
def test_tensor_parallel_parameter_joins_the_meshes(tp_placement: Shard, shard_dim: int,
                                                    expected: tuple[Any, ...]) -> None:
    with fake_world((2, 2), 1, ("dp", "tp")) as mesh:
        local = torch.randn(4, 6)  # this rank's TP part
        param = nn.Parameter(DTensor.from_local(local, mesh["tp"], [tp_placement], run_check=False))
        sp = _sharded(param, mesh["dp"], shard_dim)
        assert type(sp.mesh_layout) is JoinedMesh and sp.layout.size == local.shape
        assert sp.sharded_param.placements == expected
        _same_sharding(sp.sharded_param, _torch_sharded(param, mesh["dp"], shard_dim))
        _gather(sp, local)
        unsharded = sp.unsharded_param
        # what the module computes with
        assert isinstance(unsharded, DTensor) and unsharded.placements == (tp_placement,)
        assert torch.equal(unsharded.to_local(), local)
        # its gradient: the TP-local tensor; one in the TP placements is taken as it is
        grad = DTensor.from_local(torch.ones(4, 6), mesh["tp"], [tp_placement], run_check=False)
        unsharded.grad = grad
        assert sp.unsharded_grad is grad._local_tensor
        unsharded.grad = DTensor.from_local(torch.ones(param.shape), mesh["tp"], [Replicate()], run_check=False)
        assert sp.unsharded_grad is not None and sp.unsharded_grad.shape == local.shape  # redistributed first
        with pytest.raises(ValueError, match="'m.w' is a tensor-parallel parameter; load it as a DTensor"):
            sp.full_to_sharded(torch.zeros(8, 6), "m.w")


@pytest.mark.parametrize(("shape", "names", "fields", "placements"), [
    ((2, 2), ("dp", "tp"), {"shard": "dp"}, (Replicate(), Shard(0))),
    ((2, 2), ("dp", "cp"), {"shard": ("dp", "cp")}, (Replicate(), Replicate())),  # flattened: one 4-way dim
    ((2, 2), ("rep", "dp"), {"shard": "dp", "replicate": "rep"}, (Replicate(), Replicate())),
])
def test_dp_mesh_dims_parameter_matches_torch(shape: tuple[int, ...], names: tuple[str, ...], fields: dict[str, Any],
                                              placements: tuple[Any, ...]) -> None:
    with fake_world(shape, 2, names) as mesh:
        param = nn.Parameter(DTensor.from_local(torch.randn(4, 6), mesh, placements, run_check=False))
        sp = _sharded(param, mesh, dims=DataParallelMeshDims(**fields))
        assert type(sp.mesh_layout) is SpmdMesh
        skip_without_torch_feature("DataParallelMeshDims")  # torch 2.11: ours checked, the comparison skipped
        from torch.distributed.fsdp import DataParallelMeshDims as TorchDims

        _same_sharding(sp.sharded_param, _torch_sharded(param, mesh, dp_mesh_dims=TorchDims(**fields)))


def test_dp_mesh_dims_refuses_plain_and_dp_sharded_parameters() -> None:
    with fake_world((2, 2), 0, ("dp", "tp")) as mesh:
        dims = DataParallelMeshDims(shard="dp")
        with pytest.raises(ValueError,
                           match="parameter 'w' must be a DTensor on the mesh passed to fully_shard.*a plain tensor"):
            _sharded(nn.Parameter(torch.zeros(4, 4)), mesh, dims=dims)
        on_dp = DTensor.from_local(torch.zeros(2, 4), mesh, [Shard(0), Replicate()], run_check=False)
        with pytest.raises(ValueError,
                           match=r"'w' has placement S\(0\) on the data-parallel mesh dim 'dp'; it must be Replicate"):
            _sharded(nn.Parameter(on_dp), mesh, dims=dims)


def _gathers_itself(t: torch.Tensor, calls: list[str]) -> None:
    """Patch torch's all-gather extension hooks onto ``t``: gather a per-row scale (1-D) beside the rows, and build the
    unsharded tensor as rows * scale."""

    def pre(mesh: Any, *args: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        calls.append("pre")
        return (t.detach().clone(), torch.full((t.shape[0],), 2.0)), "meta"

    def post(outputs: tuple[torch.Tensor, ...], meta: Any, dtype: torch.dtype, *, out: Any = None) -> Any:
        calls.append(f"post {meta} out={out is not None}")
        rows, scale = outputs
        if out is not None:
            return None
        return rows * scale[:, None], (rows, scale)

    t.fsdp_pre_all_gather = pre  # type: ignore[attr-defined]
    t.fsdp_post_all_gather = post  # type: ignore[attr-defined]


def test_local_tensor_that_gathers_itself() -> None:
    """Hooks patched onto the local tensor after the call are found at the next all-gather; its inputs are padded to the
    row slots; the outputs go through the byte views of the layout; removing the hooks goes back to the flat buffer."""
    full, calls = torch.randn(10, 3), []
    with fake_world((4,), 3) as mesh:  # rank 3 holds 1 of the 3 rows of its slot
        sp = _sharded(nn.Parameter(full.clone()), mesh)
        assert not sp.extension and not sp.refresh_extension()
        _gathers_itself(sp.local_shard, calls)
        assert sp.refresh_extension() and sp.extension and sp.self_gather is not None
        inputs, nbytes = sp.self_gather.all_gather_inputs()
        assert nbytes == [3 * 3 * 4, 3 * 4] and [t.dtype for t in inputs] == [torch.uint8] * 2
        assert torch.equal(inputs[0].view(torch.float32), full[9:].reshape(-1))
        # the all-gather output: every rank's inputs in its slots, rank-major, as bytes
        blocks = []
        for r in range(4):
            rows = torch.full((3, 3), float("nan"))
            part = full[3 * r : 3 * r + 3]
            rows[: part.shape[0]] = part
            blocks += [rows.view(-1).view(torch.uint8), torch.full((3,), 2.0).view(torch.uint8)]
        output = torch.cat(blocks)
        comm.copy_out(comm.CollectiveWork(None, None, output, 4, "test"), nbytes, sp.self_gather.gather_dests())
        sp.self_gather.post_all_gather()
        assert sp.unsharded_param is not None and torch.equal(sp.unsharded_param, full * 2)  # padded rows left out
        with pytest.raises(NotImplementedError, match="'w' all-gathers itself .* reshard_after_forward=<int>"):
            sp.keep_post_forward_slice(2, 0)
        sp.free_unsharded()
        assert sp.self_gather.outputs is not None and all(t.untyped_storage().size() == 0
                                                          for t in sp.self_gather.outputs)
        sp.self_gather.all_gather_inputs()
        comm.copy_out(comm.CollectiveWork(None, None, output, 4, "test"), nbytes, sp.self_gather.gather_dests())
        sp.self_gather.post_all_gather()
        assert calls == ["pre", "post meta out=False", "pre", "post meta out=True"]
        del sp.local_shard.fsdp_pre_all_gather, sp.local_shard.fsdp_post_all_gather
        assert sp.refresh_extension() and not sp.extension and sp.unsharded_param is None
        _gather(sp, full)
        assert torch.equal(sp.unsharded_param, full)


def test_one_hook_without_the_other_is_refused() -> None:
    with fake_world((2,)) as mesh:
        sp = _sharded(nn.Parameter(torch.zeros(4, 2)), mesh)
        sp.local_shard.fsdp_pre_all_gather = lambda mesh: None  # type: ignore[attr-defined]
        with pytest.raises(NotImplementedError, match="'w' .* has fsdp_pre_all_gather but not fsdp_post_all_gather"):
            sp.refresh_extension()


def test_reduced_parts_accumulate_and_run_hooks_in_order() -> None:
    with fake_world((2,), 1) as mesh:
        a, b = _sharded(nn.Parameter(torch.zeros(3, 2)), mesh), _sharded(nn.Parameter(torch.zeros(4)), mesh)
        seen: list[tuple[str, torch.Tensor]] = []
        a.sharded_param.register_post_accumulate_grad_hook(lambda p: seen.append(("a", p.grad.to_local().clone())))
        b.sharded_param.register_post_accumulate_grad_hook(lambda p: seen.append(("b", p.grad.to_local().clone())))
        parts = [torch.ones(2), torch.full((2,), 3.0)]  # rank 1: a's one row (of a 2-row slot), b's two elements
        accumulate_sharded_grads([a, b], parts)
        assert a.sharded_param.grad.placements == (Shard(0),) and a.sharded_param.grad.to_local().shape == (1, 2)
        accumulate_sharded_grads([a, b], parts)
        assert torch.equal(a.sharded_param.grad.to_local(), torch.full((1, 2), 2.0))
        assert torch.equal(b.sharded_param.grad.to_local(), torch.full((2,), 6.0))
        assert [(n, g.sum().item()) for n, g in seen] == [("a", 2.0), ("b", 6.0), ("a", 4.0), ("b", 12.0)]


def test_dtype_change_follows_into_the_spec_and_the_unsharded_buffer() -> None:
    with fake_world((2,)) as mesh:
        sp = _sharded(nn.Parameter(torch.randn(4, 2)), mesh)
        _gather(sp, torch.zeros(4, 2))
        # as model.double()
        torch.utils.swap_tensors(sp.sharded_param, nn.Parameter(sp.sharded_param.detach().double()))
        sp.refresh_after_apply()
        assert sp.dtype == sp.unsharded_dtype == torch.float64 and sp.unsharded_param is None
        assert sp.to_sharded_dtensor(torch.zeros(2, 2, dtype=torch.float64)).dtype == torch.float64
        _gather(sp, torch.ones(4, 2, dtype=torch.float64))
        assert sp.unsharded_param.dtype == torch.float64
