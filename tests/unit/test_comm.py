"""comm.py on a fake process group, in this process: how the flat buffers are packed before each collective, what
the copy-out writes, how gradients are divided, and what the checks and observers see. The collectives themselves
move no data here (the multi-process tests check their results)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from fully_shard import comm
from tests.unit.fake_pg import fake_world


def _ranks(mesh: Any) -> comm.Ranks:
    return comm.Ranks(mesh.get_group(), mesh.size(), mesh.get_local_rank())


def test_all_gather_packs_each_shard_at_its_slot_in_this_ranks_block() -> None:
    seen: list[Any] = []
    with fake_world((4,), 2) as mesh:
        comm.monitor.checks.append(lambda kind, what, group, inp: seen.append((kind, what, group.size(), inp.numel())))
        comm.add_observer(seen.append)
        a, b = torch.arange(1.0, 4.0), torch.tensor([7.0])
        work = comm.all_gather([a, b], [4, 2], _ranks(mesh), torch.float32, torch.device("cpu"), "all-gather of x", "x")
        assert work.output is not None and work.input is not None and work.output.numel() == 4 * 6
        # the input is rank 2's block of the output itself: an in-place all-gather
        assert work.input.data_ptr() == work.output.data_ptr() + 2 * 6 * 4
        assert torch.equal(work.input[:3], a) and torch.equal(work.input[4:5], b)
        assert seen == [("all_gather", "all-gather of x", 4, 6)]
        work.wait()
        event = seen[1]
        assert ((event.kind, event.nbytes, event.group_size, event.label, event.backward)
                == ("all_gather", 24, 4, "x", False))
        assert event.end is not None and event.end >= event.start


def test_all_gather_over_one_rank_issues_nothing_and_copies_the_shards() -> None:
    with fake_world((1,)) as mesh:
        events: list[comm.CollectiveEvent] = []
        comm.add_observer(events.append)
        shard = torch.arange(6.0)
        work = comm.all_gather([shard], [6], _ranks(mesh), torch.float32, torch.device("cpu"), "x")
        assert work.work is None and work.output is None and events == []
        dest = torch.zeros(6)
        comm.copy_out(work, [6], [dest.view(1, 6)])
        assert torch.equal(dest, shard)


def test_copy_out_keeps_the_destinations_versions() -> None:
    """Autograd may have saved the unsharded parameters: refilling them is not an in-place change it must see."""
    output = torch.arange(12.0)
    dests = [torch.zeros(2, 4), torch.zeros(4, 2).t()]  # a 2-D block; a strided view (another shard dim)
    versions = [d._version for d in dests]
    comm.copy_out(comm.CollectiveWork(None, None, output, 2, "x"), [4, 2], dests[:1] + [torch.zeros(2, 2)])
    comm.copy_out(comm.CollectiveWork(None, None, torch.arange(8.0), 2, "x"), [4], dests[1:])
    assert [d._version for d in dests] == versions
    assert torch.equal(dests[0], torch.tensor([[0.0, 1, 2, 3], [6, 7, 8, 9]]))
    assert torch.equal(dests[1].reshape(2, 4), torch.arange(8.0).view(2, 4))


@pytest.mark.parametrize(("dtype", "factor", "pre", "post"), [
    (torch.float32, None, None, None),  # ReduceOp.AVG: no division of ours
    (torch.float32, 3.0, 3.0, None),  # a custom factor: divided first, then summed (gloo has no PREMUL_SUM)
    (torch.float16, None, 2.0, 2.0),  # narrow: half before the sum, half after
])
def test_reduce_scatter_input_is_the_chunk_concatenated_gradients(dtype: torch.dtype, factor: float | None,
                                                                   pre: float | None, post: float | None) -> None:
    with fake_world((4,), 1) as mesh:
        events: list[comm.CollectiveEvent] = []
        comm.add_observer(events.append)
        # 5 rows in slots of 2: rank 2 has 1, rank 3 none
        grads = [torch.arange(1.0, 11.0).view(5, 2), torch.arange(1.0, 5.0)]
        work = comm.reduce_scatter(grads, _ranks(mesh), dtype, dp_size=4, divide_factor=factor, force_sum=False,
                                   what="reduce-scatter of x", label="x")
        assert work.input is not None and work.input.shape == (4, 4 + 1) and work.input.dtype == dtype
        expected = torch._chunk_cat([g.to(dtype) for g in grads], dim=0, num_chunks=4) / (pre or 1)
        assert torch.equal(work.input, expected)
        padded = torch.tensor([[9.0, 10, 0, 0, 3], [0, 0, 0, 0, 4]], dtype=dtype) / (pre or 1)  # padding: zeros
        assert torch.equal(work.input[2:], padded)
        assert work.post_divide == post
        assert work.all_reduce_op == (dist.ReduceOp.AVG if factor is None and dtype is torch.float32
                                      else dist.ReduceOp.SUM)
        output = work.wait()
        assert output.shape == (5,) and work.input is None  # the input is dropped once waited for
        assert [(e.kind, e.nbytes) for e in events] == [("reduce_scatter", 4 * 5 * dtype.itemsize)]


def test_reduce_scatter_over_one_rank_is_its_input() -> None:
    with fake_world((1,)) as mesh:
        grad = torch.arange(6.0).view(3, 2)
        work = comm.reduce_scatter([grad], _ranks(mesh), torch.float32, dp_size=1, divide_factor=None, force_sum=False,
                                   what="x")
        assert work.work is None and torch.equal(work.wait(), grad.view(-1))
