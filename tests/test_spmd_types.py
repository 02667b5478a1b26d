"""Plain parameters annotated with spmd_types under ``dp_mesh_dims`` (issue 40; torch 2.14's FSDP2 shards them): each is
sharded as the DTensor its annotation describes on the full mesh (``Replicate`` on the data-parallel dims, the
annotated placement elsewhere), the module computes with a plain tensor, and the gradient is read with the placements
of the backward types before the reduction.

Compared with torch's FSDP2 bitwise (the same program: the same layouts, collectives and kernels): at world size 2 on
a 1-D ``("dp",)`` mesh, also against the unsharded model with its gradients averaged (bitwise: an average of two
floats is exact in any order); at world size 4 on a ``("dp", "tp")`` mesh whose weights are split over ``tp``
(``spmd.S(0)``, ``spmd.S(1)``), against torch only. On a torch whose FSDP2 does not know spmd_types (before 2.14) the
tests skip, naming the version; a wrong annotation is refused naming the parameter.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from tests.harness import device, device_type, run_distributed
from tests.oracle import average_gradients
from tests.torch_features import requires_torch_feature

pytestmark = requires_torch_feature("spmd_types parameters")


class SplitMLP(nn.Module):
    """Two plain weights: on a ``tp`` dim, column- then row-parallel (this rank's pieces)."""

    def __init__(self, tp: int = 1, rank: int = 0, dim: int = 8, hidden: int = 12) -> None:
        super().__init__()
        torch.manual_seed(0)
        w1, w2 = torch.randn(hidden, dim) / dim**0.5, torch.randn(dim, hidden) / hidden**0.5
        self.w1 = nn.Parameter(w1.chunk(tp, 0)[rank].contiguous().to(device()))
        self.w2 = nn.Parameter(w2.chunk(tp, 1)[rank].contiguous().to(device()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.relu(F.linear(x, self.w1)), self.w2)


def _impl(use_torch: bool) -> tuple[Any, Any]:
    if use_torch:
        from torch.distributed.fsdp import DataParallelMeshDims, fully_shard
    else:
        from fully_shard import DataParallelMeshDims, fully_shard
    return fully_shard, DataParallelMeshDims


def _annotate(model: SplitMLP, mesh: Any, tp: bool) -> None:
    import spmd_types as spmd

    dp = spmd.MeshAxis.of(mesh.get_group("dp"))
    if not tp:
        for p in model.parameters():
            spmd.assert_type(p, {dp: spmd.R})
        return
    tp_axis = spmd.MeshAxis.of(mesh.get_group("tp"))
    spmd.assert_type(model.w1, {dp: spmd.R, tp_axis: spmd.S(0)})
    spmd.assert_type(model.w2, {tp_axis: spmd.S(1)})  # R on dp left out: fully_shard's dims are R anyway


def case_train(use_torch: bool, tp: bool, steps: int = 3) -> dict[str, Any]:
    """Train the annotated model sharded by torch's FSDP2 or ours; on the 1-D mesh also the unsharded model beside it
    (its gradients averaged). Returns losses, layouts and parameters."""
    shard, dims = _impl(use_torch)
    shape, names = ((2, 2), ("dp", "tp")) if tp else ((dist.get_world_size(),), ("dp",))
    mesh = init_device_mesh(device_type(), shape, mesh_dim_names=names)
    tp_size, tp_rank = (mesh.size(1), mesh.get_local_rank("tp")) if tp else (1, 0)
    model = SplitMLP(tp_size, tp_rank)
    ref = copy.deepcopy(model)
    _annotate(model, mesh, tp)
    import spmd_types as spmd

    with spmd.set_current_mesh(mesh):  # w2 is annotated on tp only: the mesh the module computes on fills in dp
        shard(model, mesh=mesh, dp_mesh_dims=dims(shard="dp"))
    layout = [(n, [str(q) for q in p.placements], p.device_mesh.mesh_dim_names) for n, p in model.named_parameters()]
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, ref)]
    dp_rank = mesh.get_local_rank("dp")
    losses, ref_losses = [], []
    for step in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + dp_rank)).to(device())
        loss = model(x).pow(2).sum()
        loss.backward()
        opts[0].step()
        opts[0].zero_grad()
        losses.append(loss.item())
        if not tp:
            ref_loss = ref(x).pow(2).sum()
            ref_loss.backward()
            average_gradients(ref)
            opts[1].step()
            opts[1].zero_grad()
            ref_losses.append(ref_loss.item())
    return {"losses": losses, "ref_losses": ref_losses, "layout": layout,
            "params": [p.to_local() for p in model.parameters()],
            "full": [p.full_tensor() for p in model.parameters()] if not tp else [],
            "ref": [p.detach() for p in ref.parameters()]}


def _compare(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> None:
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        assert a["layout"] == b["layout"], f"rank {rank}: {a['layout']} != torch's {b['layout']}"
        # bitwise: the same shards reduced with the same gloo ops and stepped by the same optimizer
        assert a["losses"] == b["losses"], f"rank {rank}: losses {a['losses']} != torch's {b['losses']}"
        for p, q in zip(a["params"], b["params"]):
            torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_spmd_types_parameters_train_like_torch_fsdp2() -> None:
    ours, theirs = run_distributed(case_train, 2, False, False), run_distributed(case_train, 2, True, False)
    _compare(ours, theirs)
    assert [str(q) for q in ours[0]["layout"][0][1]] == ["S(0)"], ours[0]["layout"]  # as torch: Shard(0) on dp
    for rank, a in enumerate(ours):
        # the unsharded model, gradients averaged over 2 ranks: exact in any order, so bitwise
        assert a["losses"] == a["ref_losses"], f"rank {rank}: {a['losses']} != unsharded {a['ref_losses']}"
        for p, q in zip(a["full"], a["ref"]):
            torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_spmd_types_parameters_split_over_tp_train_like_torch_fsdp2() -> None:
    ours, theirs = run_distributed(case_train, 4, False, True), run_distributed(case_train, 4, True, True)
    _compare(ours, theirs)
    # w1 split on dim 0 by tp already: dp cuts within each tp piece (_StridedShard), as for a TP DTensor
    assert [placements for _, placements, _ in ours[0]["layout"]] == [["_S(0, 2)", "S(0)"], ["S(0)", "S(1)"]]


def case_refused() -> list[str]:
    import spmd_types as spmd

    from fully_shard import DataParallelMeshDims, fully_shard

    mesh = init_device_mesh(device_type(), (dist.get_world_size(),), mesh_dim_names=("dp",))
    dp = spmd.MeshAxis.of(mesh.get_group("dp"))
    messages = []
    for kind in (spmd.I, spmd.V):  # not R on the data-parallel axis: its gradient is fully_shard's to reduce
        model = SplitMLP()
        spmd.assert_type(model.w1, {dp: kind})
        with pytest.raises(ValueError) as info:
            fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
        messages.append(str(info.value))
    return messages


def test_spmd_types_annotation_not_replicated_on_dp_is_refused() -> None:
    for message in run_distributed(case_refused, 2)[0]:
        assert "parameter 'w1' is annotated with spmd_types" in message, message
        assert "on the data-parallel axis" in message and "it must be spmd.R there" in message, message
