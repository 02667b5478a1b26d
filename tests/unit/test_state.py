"""state.py and api.py on a fake process group, in this process: the collectives one training step issues, through
the public API (``fully_shard`` on each block, then the root). Design invariant: forward issues one all-gather per
group; backward one all-gather per group resharded after forward and one reduce-scatter per group with gradients; no
more, no fewer. The fake process group moves no data: the multi-process tests check values."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fully_shard import FSDPModule, comm, fully_shard
from tests.unit.fake_pg import fake_world


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def _step(model: nn.Module, events: list[comm.CollectiveEvent]) -> list[tuple[str, str, bool]]:
    """One forward and backward; the collectives issued, as (kind, group, in backward)."""
    start = len(events)
    model(torch.randn(3, 4)).sum().backward()
    return [(e.kind, e.label, e.backward) for e in events[start:]]


@pytest.mark.parametrize(("reshard_after_forward", "regathered"), [(True, 3), (False, 0), (None, 2)])
def test_a_step_issues_one_all_gather_per_group_and_one_reduce_scatter(reshard_after_forward: bool | None,
                                                                      regathered: int) -> None:
    with fake_world((4,), 1) as mesh:
        model = _model()
        for block in (model[0], model[2]):
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
        events: list[comm.CollectiveEvent] = []
        comm.add_observer(events.append)
        for _ in range(2):  # the second step prefetches in the order the first recorded
            issued = _step(model, events)
            groups = {label for _, label, _ in issued}
            assert len(groups) == 3  # the two blocks and the root's last Linear
            forward = [label for kind, label, bwd in issued if kind == "all_gather" and not bwd]
            backward_gathers = [label for kind, label, bwd in issued if kind == "all_gather" and bwd]
            reductions = [label for kind, label, bwd in issued if kind == "reduce_scatter"]
            assert sorted(forward) == sorted(groups) and sorted(reductions) == sorted(groups)
            # None: every group reshards after forward but the root, which backward needs first
            assert len(backward_gathers) == regathered
            assert all(isinstance(p, DTensor) and isinstance(p.grad, DTensor) for p in model.parameters())


def test_no_sync_skips_the_reduce_scatters_until_the_last_micro_batch() -> None:
    with fake_world((2,)) as mesh:
        model = _model()
        fully_shard(model[2], mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert isinstance(model, FSDPModule)
        events: list[comm.CollectiveEvent] = []
        comm.add_observer(events.append)
        model.set_requires_gradient_sync(False)
        assert "reduce_scatter" not in [kind for kind, _, _ in _step(model, events)]
        assert all(p.grad is None for p in model.parameters())
        model.set_requires_gradient_sync(True)
        assert [kind for kind, _, _ in _step(model, events)].count("reduce_scatter") == 2


def test_frozen_group_is_gathered_but_not_reduced() -> None:
    with fake_world((2,)) as mesh:
        model = _model()
        model[2].requires_grad_(False)
        for block in (model[0], model[2]):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        events: list[comm.CollectiveEvent] = []
        comm.add_observer(events.append)
        issued = _step(model, events)
        assert sorted(label for kind, label, _ in issued if kind == "reduce_scatter") == ["0", "Sequential (root)"]
        assert [label for kind, label, _ in issued if kind == "all_gather"].count("2") == 2  # needed for backward
