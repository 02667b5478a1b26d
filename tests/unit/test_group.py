"""group.py on a fake process group, in this process: a group's states and what each holds, the modules' parameters in
each, one all-gather per unsharded dtype and one reduce-scatter per reduce dtype, and gradients accumulated while sync
is off. Groups are made by ``fully_shard`` (its public options set them up); the fake process group moves no data, so
values are not checked here (the multi-process tests do)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fully_shard import FSDPModule, comm, fully_shard
from fully_shard.group import GroupState, ParamGroup
from tests.unit.fake_pg import fake_world


class Mixed(nn.Module):
    """Two dtypes: two all-gathers and two reduce-scatters per step."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 5)
        self.table = nn.Parameter(torch.randn(7, 3, dtype=torch.float64))


def _group(module: nn.Module, **kw: Any) -> ParamGroup:
    fully_shard(module, **kw)
    group = fully_shard.state(module).group  # type: ignore[attr-defined]
    assert group is not None
    return group


def _kinds(events: list[comm.CollectiveEvent]) -> list[tuple[str, int]]:
    return [(e.kind, e.nbytes) for e in events]


def test_unshard_and_reshard_move_the_modules_between_sharded_and_full_parameters() -> None:
    with fake_world((4,), 3) as mesh:  # rank 3: 5 rows -> none of lin's, 7 rows -> one of the table's
        module = Mixed()
        group = _group(module, mesh=mesh)
        events: list[comm.CollectiveEvent] = []
        comm.add_observer(events.append)
        assert group.state is GroupState.SHARDED and all(isinstance(p, DTensor) for p in module.parameters())
        group.unshard(async_op=True)
        assert group.state is GroupState.UNSHARDING and group.is_unsharded
        group.wait_for_unshard()
        assert group.state is GroupState.UNSHARDED
        assert [tuple(p.shape) for p in module.parameters()] == [(7, 3), (5, 6), (5,)]
        assert not any(isinstance(p, DTensor) for p in module.parameters())
        # one all-gather per unsharded dtype, each of every rank's padded slots: fp32 2*6 + 2, fp64 2*3
        assert _kinds(events) == [("all_gather", (12 + 2) * 4), ("all_gather", 6 * 8)]
        full = list(module.parameters())
        group.reshard()
        assert group.state is GroupState.SHARDED and all(isinstance(p, DTensor) for p in module.parameters())
        assert all(p.untyped_storage().size() == 0 for p in full)  # freed; the objects stay for autograd
        group.unshard()
        assert list(module.parameters()) == full and full[0].untyped_storage().size() > 0  # the same tensors, refilled
        group.reshard()


def test_gradients_reduce_per_reduce_dtype_into_sharded_grads() -> None:
    with fake_world((4,), 0) as mesh:
        module = Mixed()
        group = _group(module, mesh=mesh)
        events: list[comm.CollectiveEvent] = []
        comm.add_observer(events.append)
        group.unshard()
        for p in module.parameters():
            p.grad = torch.ones_like(p)
        pending = group.reduce_grads()
        assert pending is not None and len(pending.reductions) == 2
        group.finish_reduce(pending)
        group.reshard()
        assert [e.kind for e in events] == ["all_gather", "all_gather", "reduce_scatter", "reduce_scatter"]
        for p in module.parameters():
            assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements
            assert p.grad.to_local().shape == p.to_local().shape


def test_unused_parameters_take_no_part_unless_asked() -> None:
    with fake_world((2,)) as mesh:
        module = Mixed()
        group = _group(module, mesh=mesh)
        events: list[comm.CollectiveEvent] = []
        comm.add_observer(events.append)
        group.unshard()
        module.lin.weight.grad = torch.ones(5, 6)  # the table and the bias unused
        group.finish_reduce(group.reduce_grads())  # type: ignore[arg-type]
        assert _kinds(events)[-1] == ("reduce_scatter", 2 * 3 * 6 * 4)
        group.reshard()
        assert module.lin.weight.grad is not None and module.table.grad is None and module.lin.bias.grad is None
        assert isinstance(module, FSDPModule)
        module.set_reduce_scatter_unused_params(True)
        group.unshard()
        module.lin.weight.grad = torch.ones(5, 6)
        group.finish_reduce(group.reduce_grads())  # type: ignore[arg-type]
        assert [e.kind for e in events[-2:]] == ["reduce_scatter"] * 2  # fp32 (weight, zero bias), fp64 (zero table)
        group.reshard()
        assert module.table.grad is not None and module.lin.bias.grad is not None


def test_gradients_accumulate_unsharded_while_sync_is_off() -> None:
    with fake_world((2,)) as mesh:
        module = Mixed()
        group = _group(module, mesh=mesh)
        assert isinstance(module, FSDPModule)
        events: list[comm.CollectiveEvent] = []
        comm.add_observer(events.append)
        module.set_requires_gradient_sync(False)
        for _ in range(2):
            group.unshard()
            module.table.grad = torch.ones(7, 3, dtype=torch.float64)
            assert group.reduce_grads() is None
            group.reshard()
        assert [e.kind for e in events] == ["all_gather"] * 4  # no reduction
        kept = [p.accumulated_grad for p in group.params if p.accumulated_grad is not None]
        assert len(kept) == 1 and torch.equal(kept[0], torch.full((7, 3), 2.0, dtype=torch.float64))
        module.set_requires_gradient_sync(True)
        group.unshard()
        pending = group.reduce_grads()
        assert pending is not None
        group.finish_reduce(pending)  # observers see a collective once it is waited for
        assert [e.kind for e in events][4:] == ["all_gather", "all_gather", "reduce_scatter"]
        assert all(p.accumulated_grad is None for p in group.params)
        group.reshard()


def test_reshard_keeping_a_slice_gathers_within_k_ranks_for_backward() -> None:
    """``reshard_after_forward=2`` on 4 ranks: after forward each rank keeps its half of the padded parameters, and the
    backward all-gather runs within 2 ranks."""
    with fake_world((4,), 1) as mesh:
        module = nn.Linear(6, 5)
        group = _group(module, mesh=mesh, reshard_after_forward=2)
        events: list[comm.CollectiveEvent] = []
        comm.add_observer(events.append)
        out = module(torch.randn(2, 6))
        assert group.state is GroupState.POST_FORWARD
        slices = [p.post_forward_slice for p in group.params]
        assert [s.numel() for s in slices if s is not None] == [8 * 6 // 2, 8 // 2]  # half of 4 slots of 2 rows
        out.sum().backward()
        assert [(e.kind, e.group_size, e.backward) for e in events] == [
            ("all_gather", 4, False), ("all_gather", 2, True), ("reduce_scatter", 4, True)]
        assert "within 2 ranks, for backward" in [e.what for e in events][1]
        assert group.state is GroupState.SHARDED


def test_a_transition_outside_the_table_is_an_internal_error() -> None:
    with fake_world((2,), 0) as mesh:
        group = _group(Mixed(), mesh=mesh)
        with pytest.raises(AssertionError, match="internal error: group Mixed cannot go from SHARDED to UNSHARDED$"):
            group._move_to(GroupState.UNSHARDED)
        assert group.state is GroupState.SHARDED
        group._move_to(GroupState.UNSHARDING)
        assert group.state is GroupState.UNSHARDING
