"""The accelerator memory model, checked on the CPU with a recording stream double.

``fully_shard.streams.Streams(device, backend)``, installed as the root's shared streams,
routes every stream operation through a double that logs it; collectives and the copies
around them are logged with the stream that was current.
The tests assert the orderings that make overlap safe without ``record_stream``.
"""

from __future__ import annotations

import contextlib
import pathlib
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import fully_shard.comm as comm
from fully_shard import CPUOffloadPolicy, fully_shard
from fully_shard import streams as fs_streams
from tests.harness import device_type, run_distributed
from tests.models import ModelArgs, Transformer, batch, loss_fn
from tests.transfers import Transfer, record_transfers


class RecordingBackend:
    """Streams are names; events are numbers; everything goes to ``log``."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.stack = ["current"]
        self.events = 0

    def current_stream(self, device: torch.device) -> str:
        return self.stack[-1]

    def new_stream(self, device: torch.device, name: str) -> str:
        return name

    @contextlib.contextmanager
    def use(self, stream: str) -> Iterator[None]:
        self.stack.append(stream)
        try:
            yield
        finally:
            self.stack.pop()

    def wait_stream(self, waiter: str, waited: str) -> None:
        self.log.append(("wait_stream", waiter, waited))

    def record_event(self, stream: str) -> int:
        self.events += 1
        self.log.append(("record", stream, self.events))
        return self.events

    def wait_event(self, stream: str, event: Any) -> None:
        self.log.append(("wait_event", stream, event))

    def synchronize(self, event: Any) -> None:
        self.log.append(("synchronize", event))


@contextlib.contextmanager
def _recording() -> Iterator[RecordingBackend]:
    """Install the double and log collectives and copies with the current stream."""
    backend = RecordingBackend()
    originals: dict[tuple[Any, str], Any] = {}
    alive: dict[int, Any] = {}

    def patch(owner: Any, name: str, label: str) -> None:
        orig = getattr(owner, name)
        originals[(owner, name)] = orig

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            backend.log.append((label, backend.stack[-1]))
            return orig(*args, **kwargs)

        setattr(owner, name, wrapper)

    patch(torch, "_foreach_copy_", "copy_in")
    patch(torch, "split_with_sizes_copy", "copy_out")
    patch(torch, "_chunk_cat", "chunk_cat")
    patch(dist, comm._ALL_GATHER, "all_gather")
    patch(dist, comm._REDUCE_SCATTER, "reduce_scatter")
    orig_all_gather = comm.all_gather

    def all_gather(*args: Any, **kwargs: Any) -> Any:
        work = orig_all_gather(*args, **kwargs)
        backend.log.append(("ag_output", id(work.output)))
        alive[id(work.output)] = weakref.ref(work.output)
        return work

    comm.all_gather = all_gather  # type: ignore[assignment]
    backend.alive = alive  # type: ignore[attr-defined]
    try:
        yield backend
    finally:
        comm.all_gather = orig_all_gather  # type: ignore[assignment]
        for (owner, name), orig in originals.items():
            setattr(owner, name, orig)


def _train_step_log(post_optim_event: bool) -> list[tuple[Any, ...]]:
    mesh = init_device_mesh(device_type(), (dist.get_world_size(),))
    with _recording() as backend:
        model = Transformer(ModelArgs(n_layers=3))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        root = fully_shard.state(model)  # type: ignore[attr-defined]
        root.shared_streams = fs_streams.Streams(root.device, backend)  # the seam share_comm_ctx uses
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        checks = []
        original_wait_event = backend.wait_event

        def wait_event(stream: str, event: Any) -> None:
            # when the copy-in stream waits for a held all-gather's event, its buffers still live
            original_wait_event(stream, event)
            live = [ref() is not None for ref in backend.alive.values()]  # type: ignore[attr-defined]
            checks.append(("alive_at_wait", stream, event, sum(live)))

        backend.wait_event = wait_event  # type: ignore[method-assign]
        for step in range(2):
            backend.log.append(("step", step))
            if post_optim_event and step == 1:
                model.set_post_optim_event("optimizer-done")  # any token: the double only logs it
            x = batch(step, dist.get_rank())
            loss_fn(model(x), x).backward()
            opt.step()
            opt.zero_grad()
        return backend.log + checks


def _step(log: list[tuple[Any, ...]], step: int) -> list[tuple[Any, ...]]:
    start = log.index(("step", step))
    end = log.index(("step", step + 1)) if ("step", step + 1) in log else len(log)
    return [e for e in log[start + 1 : end] if e[0] != "alive_at_wait"]


def test_all_gather_waits_for_copy_in_and_buffers_outlive_copy_out() -> None:
    log = run_distributed(_train_step_log, 2, False)[0]
    step = _step(log, 1)
    gathers = [i for i, e in enumerate(step) if e[0] == "all_gather"]
    assert len(gathers) == 4 + 3  # forward: every group; backward: the 3 resharded blocks
    for i in gathers:
        assert step[i][1] == "copy_in", step[i]  # issued from the copy-in stream ...
        assert step[i - 1] == ("copy_in", "copy_in"), step[i - 1]  # ... right after packing there
    for e in step:
        if e[0] == "copy_out":
            assert e[1] == "current", e  # copy-out on the compute stream
    # each all-gather's buffers are held after its copy-out (an event on the current stream)
    # and released only once the copy-in stream has waited for that event
    both = _step(log, 0) + step  # the first wait of step 1 releases step 0's last buffers
    records = {e[2]: i for i, e in enumerate(both) if e[0] == "record" and e[1] == "current"}
    waits = [(i, e[2]) for i, e in enumerate(both) if e[0] == "wait_event" and e[1] == "copy_in"]
    assert waits, step
    for i, event in waits:
        assert event in records and records[event] < i, (event, both)
        last_copy_out = max(j for j, e in enumerate(both) if e[0] == "copy_out" and j < records[event])
        gathers_between = [e for e in both[last_copy_out : records[event]] if e[0] == "all_gather"]
        assert not gathers_between or both[records[event] - 1][0] != "all_gather", "held after its copy-out"
    # before every copy-in (which allocates the next all-gather's buffers on the copy-in
    # stream), that stream has waited for every hold event recorded so far: the last use of
    # every earlier all-gather output is behind it
    copy_ins = [i for i, e in enumerate(both) if e == ("copy_in", "copy_in")]
    assert len(copy_ins) == 2 * len(gathers), copy_ins
    for k in copy_ins:
        held = {ev for ev, i in records.items() if i < k}
        waited = {ev for i, ev in waits if i < k}
        assert held <= waited, (k, sorted(held - waited), both[: k + 1])


def test_held_buffers_are_alive_when_released() -> None:
    log = run_distributed(_train_step_log, 2, False)[0]
    alive = [e for e in log if e[0] == "alive_at_wait" and e[1] == "copy_in"]
    assert alive
    # the previous group's buffers are still referenced when the copy-in stream waits
    # for their last use: at least the held all-gather's output is alive at each wait
    assert all(e[3] >= 1 for e in alive), alive


def test_reduce_scatter_waits_for_gradients_and_optimizer_waits_for_it() -> None:
    log = run_distributed(_train_step_log, 2, False)[0]
    step = _step(log, 1)
    scatters = [i for i, e in enumerate(step) if e[0] == "reduce_scatter"]
    assert len(scatters) == 4
    for i in scatters:
        assert step[i][1] == "reduce_scatter", step[i]
        assert step[i - 1] == ("chunk_cat", "reduce_scatter"), step[i - 1]
        assert step[i - 2] == ("wait_stream", "reduce_scatter", "current"), step[i - 2]
    # each reduction finishes on the reduce-scatter stream, and the compute stream waits for it
    rs_records = [(i, e[2]) for i, e in enumerate(step) if e[0] == "record" and e[1] == "reduce_scatter"]
    assert len(rs_records) == 4
    for i, event in rs_records:
        assert step[i + 1] == ("wait_event", "current", event), step[i + 1]


def test_first_all_gather_waits_for_the_optimizer() -> None:
    log = run_distributed(_train_step_log, 2, False)[0]
    step = _step(log, 1)
    first_copy_in = step.index(("copy_in", "copy_in"))
    assert ("wait_stream", "copy_in", "current") in step[:first_copy_in], step[:first_copy_in]
    log = run_distributed(_train_step_log, 2, True)[0]
    step = _step(log, 1)
    first_copy_in = step.index(("copy_in", "copy_in"))
    before = step[:first_copy_in]
    assert ("wait_event", "copy_in", "optimizer-done") in before, before
    assert ("wait_stream", "copy_in", "current") not in before, before


def _offload_log(pin_memory: bool) -> list[tuple[Any, ...]]:
    """Two backwards under CPU offload, the second adding to the first's gradients; the transfers in the stream log."""
    mesh = init_device_mesh(device_type(), (dist.get_world_size(),))
    with _recording() as backend:
        model = Transformer(ModelArgs(n_layers=2))
        for module in (*model.layers, model):
            fully_shard(module, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=pin_memory))
        root = fully_shard.state(model)  # type: ignore[attr-defined]
        root.shared_streams = fs_streams.Streams(root.device, backend)
        shards = {p.to_local().untyped_storage().data_ptr() for p in model.parameters()}
        for step in range(2):
            backend.log.append(("step", step))
            x = batch(step, dist.get_rank())
            with record_transfers(shards, lambda: backend.stack[-1], backend.log):
                loss_fn(model(x), x).backward()
            backend.log.append(("backward returned",))
        return backend.log


@pytest.mark.parametrize("pin_memory", [True, False])
def test_offloaded_shards_and_gradients_move_without_blocking(pin_memory: bool) -> None:
    log = run_distributed(_offload_log, 2, pin_memory)[0]
    for step in (0, 1):
        events = _step(log, step)
        moves = [e for e in events if isinstance(e, Transfer)]
        # the shards go to the device on the copy-in stream, without blocking, in their own dtype (cast there)
        assert {m for m in moves if m.source == "shard"} == {Transfer("shard", True, False, "copy_in")}, moves
        # the gradients come back on the reduce-scatter stream: into pinned memory without blocking the first time
        # (pin_memory); the second backward adds to them on the host, so its copies block, as in torch's FSDP2
        grads = {m for m in moves if m.source == "other"}
        assert grads == {Transfer("other", pin_memory and step == 0, False, "reduce_scatter")}, moves
        # the host waits for an event recorded on that stream after the last async copy, before backward returns
        waits = [i for i, e in enumerate(events) if e[0] == "synchronize"]
        if not (pin_memory and step == 0):
            assert not waits, events
            continue
        assert len(waits) == 1 and events[waits[0] + 1] == ("backward returned",), events
        last_copy = max(i for i, e in enumerate(events) if isinstance(e, Transfer) and e.source == "other")
        recorded = [i for i, e in enumerate(events) if e[0] == "record" and e[1] == "reduce_scatter"]
        assert events[waits[0]][1] == events[min(i for i in recorded if i > last_copy)][2], events


def test_no_code_path_calls_record_stream() -> None:
    package = pathlib.Path(__file__).resolve().parents[1] / "fully_shard"
    for path in package.rglob("*.py"):
        assert "record_stream(" not in path.read_text(), path
