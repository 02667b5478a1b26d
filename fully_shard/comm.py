"""Flat-buffer collectives: the only file that calls torch.distributed collectives.

An all-gather packs a group's local shards (each padded to its per-rank slot) into one flat input, gathers it and
copies the result out into the unsharded buffers; a reduce-scatter chunk-concatenates the group's unsharded gradients
into one flat input and leaves each rank its flat shard. Layouts: docs/design.md, "Buffer layouts".
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
from torch.profiler import record_function as _record_function

from .compat import ALL_GATHER as _ALL_GATHER
from .compat import REDUCE_SCATTER as _REDUCE_SCATTER

# dtypes whose sum over ranks is safe from overflow: reduced with ReduceOp.AVG directly
_AVG_SAFE_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


@dataclass
class CollectiveEvent:
    """One collective fully_shard issued, for observers (``fully_shard.tools.trace_comm``).

    The one internal interface the tools build on (``add_observer``). Read the fields; ``what`` is for people, never
    parse it.
    """

    kind: str  # "all_gather" | "reduce_scatter" | "all_reduce"
    what: str  # e.g. "all-gather of layers.0's parameters"
    group_size: int
    nbytes: int  # this rank's input bytes
    backward: bool  # issued while autograd ran backward
    start: float  # time.perf_counter() at issue
    end: float | None = None  # ... when its wait returned (on accelerators: CPU-side time)
    label: str = ""  # the fully_shard group it is for: the module's FQN, "<Class> (root)" for the root


DEBUG_ENV = "FULLY_SHARD_DEBUG"  # "1": the debug mode (fully_shard.tools.debug) from the start, no code change needed


class CollectiveMonitor:
    """Who watches fully_shard's collectives: ``checks`` called before each is issued, with ``(kind, what, group,
    input)`` (the debug mode, ``fully_shard.tools.debug``), and observers after it completes (traces). The one piece of
    process-wide mutable state in fully_shard (``comm.monitor``); the test harness ``reset()``s it."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """No checks, no observers; the failure hint not shown yet."""
        self.checks: list[Callable[[str, str, dist.ProcessGroup, torch.Tensor], None]] = []
        self.observers: list[Callable[[CollectiveEvent], None]] = []
        self.hint_printed = False

    def add_observer(self, fn: Callable[[CollectiveEvent], None]) -> None:
        """Call ``fn`` with every collective fully_shard completes (until removed)."""
        self.observers.append(fn)

    def remove_observer(self, fn: Callable[[CollectiveEvent], None]) -> None:
        self.observers.remove(fn)


monitor = CollectiveMonitor()
add_observer, remove_observer = monitor.add_observer, monitor.remove_observer


def record_function(name: str) -> contextlib.AbstractContextManager[Any]:
    """A range in a profiler's trace; a no-op when no profiler runs (a range costs ~5 us)."""
    return _record_function(name) if torch._C._autograd._profiler_enabled() else contextlib.nullcontext()


def _issue(kind: str, what: str, group: dist.ProcessGroup, inp: torch.Tensor, call: Callable[[], Any],
           label: str = "") -> tuple[Any, CollectiveEvent | None]:
    """Issue a collective, checked (debug mode) and observed (traces)."""
    for check in monitor.checks:
        check(kind, what, group, inp)
    event = None
    if monitor.observers:
        backward = torch._C._current_graph_task_id() != -1
        event = CollectiveEvent(kind, what, group.size(), inp.numel() * inp.element_size(), backward,
                                time.perf_counter(), label=label)
    with record_function(f"fully_shard::{kind} {label}" if label else f"fully_shard::{kind}"):  # as torch's, named
        return call(), event


def _finish(event: CollectiveEvent | None) -> None:
    if event is not None:
        event.end = time.perf_counter()
        for fn in list(monitor.observers):
            fn(event)


class CollectiveError(RuntimeError):
    """A collective of fully_shard failed or timed out, usually because another rank failed."""


def _wait(work: dist.Work, what: str) -> None:
    try:
        work.wait()
    except RuntimeError as e:
        if not (monitor.hint_printed or monitor.checks):
            # once per process, on stderr: an abort may follow that no exception message survives
            monitor.hint_printed = True
            print("fully_shard: a collective failed. If the ranks ran different modules (an exception or a skipped "
                  f"block on some ranks), rerun with the environment variable {DEBUG_ENV}=1: every collective is then "
                  "checked across ranks first and the first divergence raises CollectiveMismatchError naming it (see "
                  "docs/troubleshooting.md).", file=sys.stderr, flush=True)
        raise CollectiveError(
            f"fully_shard: the {what} did not complete: {e}\n"
            "Another rank has probably failed or stopped issuing the same collectives; this rank waits for it up to "
            "the process group's timeout (init_process_group(timeout=...)). If every rank caught an exception in the "
            "same iteration, call reset_iter_state() on the root module and carry on; otherwise restart from the last "
            f"checkpoint. To find where the ranks diverged, rerun with {DEBUG_ENV}=1."
        ) from e


@dataclass(frozen=True)
class Ranks:
    """The ranks a collective runs over: their process group, how many, this rank's index."""

    group: dist.ProcessGroup
    size: int
    rank: int
    # a k-rank group of reshard_after_forward=k: the ranks at this rank's index in every k-rank group of its shard
    # group, over which the traced path gathers first (traced.py: two-level gather)
    complement: Ranks | None = None


@dataclass
class CollectiveWork:
    """A collective in flight, holding its buffers until ``wait`` returns."""

    work: dist.Work | None
    input: torch.Tensor | None  # all-gather: 1-D, this rank's packed shards, a view of its slot in output
    output: torch.Tensor | None  # all-gather: 1-D, world_size * input.numel(), rank-major; None over one rank
    world_size: int
    what: str  # for error messages
    event: CollectiveEvent | None = None
    shards: tuple[torch.Tensor, ...] = ()  # an all-gather over one rank: its output would be these, packed

    def wait(self) -> torch.Tensor | None:
        if self.work is not None:
            _wait(self.work, self.what)
            self.work = None
        _finish(self.event)
        self.event = None
        return self.output


@dataclass
class ReduceScatterWork(CollectiveWork):
    """A reduce-scatter in flight: ``input`` is the (world_size, shard_numel) chunk-concatenated
    gradients, dropped at ``wait``; ``output`` this rank's reduced (and pre-divided) flat shard."""

    post_divide: float | None = None  # applied once every reduction, all-reduce included, is done
    all_reduce_op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM  # HSDP: the op for the all-reduce across replicas

    def wait(self) -> torch.Tensor:
        self.input = None
        return cast(torch.Tensor, super().wait())


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, op: dist.ReduceOp.RedOpType, what: str, label: str = "",
               custom: Any = None) -> None:
    """HSDP: reduce the reduce-scatter output across replicas, in place. It goes through the reduce-scatter Comm's
    ``all_reduce`` where it has one (our extension of torch's Comm API, e.g. ``fully_shard.quant``; it may return None).
    """
    fn = getattr(custom, "all_reduce", None) or dist.all_reduce
    work, event = _issue("all_reduce", what, group, tensor,
                         lambda: fn(tensor, op=op, group=group, async_op=True), label)
    if work is not None:
        _wait(work, what)
    _finish(event)


def broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None) -> None:
    """Rank ``src``'s ``tensor`` to every rank of ``group``, in place (rank-0 loading in
    ``tools.init.broadcast_full_state_dict``; not observed, not checked by the debug mode)."""
    dist.broadcast(tensor, src, group=group)


def _buffer(custom: Any, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D communication buffer; ``custom`` (torch's Comm API): the user allocates it."""
    if custom is None:
        return torch.empty(numel, dtype=dtype, device=device)
    return cast(torch.Tensor, custom.allocate((numel,), dtype=dtype, device=device))


def _collective(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, op: Any = None,
                async_op: bool = False) -> Any:
    """The default Comm call: an all-gather or, given ``op``, a reduce-scatter."""
    if op is None:
        return getattr(dist, _ALL_GATHER)(output_tensor, input_tensor, group=group, async_op=async_op)
    return getattr(dist, _REDUCE_SCATTER)(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


class PoolComm:
    """torch's Comm API for both collectives, with buffers from ``group``'s allocator where its backend has
    one (else ``torch.empty``) or, given ``symm_backend``, from symmetric memory (untested: needs NCCL on GPUs)."""

    def __init__(self, group: dist.ProcessGroup, symm_backend: str | None = None) -> None:
        self.group, self.symmetric = group, symm_backend is not None
        if symm_backend is not None:
            if not hasattr(symm_mem, "get_mem_pool"):  # at the call, not at the first all-gather's allocation
                raise NotImplementedError("symmetric-memory buffers need "
                                          "torch.distributed._symmetric_memory.get_mem_pool, which torch "
                                          f"{torch.__version__} lacks (torch 2.13 has it): upgrade torch, or leave "
                                          "set_symm_mem_for_comm out (it changes where buffers live, not the results)")
            symm_mem.set_backend(symm_backend)  # type: ignore[arg-type]
            dist.barrier(group=group)  # the communicator must exist before the first rendezvous

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self.symmetric:  # one pool per device, reused
            with torch.get_device_module(device).use_mem_pool(symm_mem.get_mem_pool(device)):
                return torch.empty(*size, dtype=dtype, device=device)
        backend = self.group._get_backend(device)
        if backend.supports_tensor_alloc(device):
            return backend.allocate_tensor(math.prod(size), dtype=dtype, device=device)
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any = None, async_op: bool = False) -> Any:
        for t in ((output_tensor,) if op is None else (input_tensor, output_tensor)) if self.symmetric else ():
            symm_mem.rendezvous(t, group=group.group_name)  # an all-gather's input is a view of its output
        return _collective(output_tensor, input_tensor, group, op, async_op)


def _start(kind: str, what: str, ranks: Ranks, out: torch.Tensor, inp: torch.Tensor, custom: Any, label: str,
           **op: Any) -> Any:
    """Issue an async all-gather or reduce-scatter of ``inp`` into ``out`` (through the user's ``custom`` Comm)."""
    fn, group = _collective if custom is None else custom, ranks.group
    return _issue(kind, what, group, inp,
                  lambda: fn(output_tensor=out, input_tensor=inp, group=group, async_op=True, **op), label)


def all_gather(shards: list[torch.Tensor], shard_numels: list[int], ranks: Ranks, dtype: torch.dtype,
               device: torch.device, what: str, label: str = "", custom: Any = None) -> CollectiveWork:
    """Pack ``shards`` (1-D, each padded to its ``shard_numels`` entry) into this rank's slot of the output and
    all-gather in place over ``ranks``.

    Each slot's padding is left uninitialised (it lands in padding rows of the unsharded buffers, which no user sees),
    except for a ``custom`` Comm, which may compute on its whole input (a quantizer's scales): zeros, as in torch.
    Over one rank nothing is packed or gathered: ``copy_out`` copies the shards.
    """
    if ranks.size == 1:
        return CollectiveWork(None, None, None, 1, what, shards=tuple(shards))
    total = sum(shard_numels)
    out = _buffer(custom, total * ranks.size, dtype, device)
    inp = out.narrow(0, ranks.rank * total, total)  # packed in place: no separate input buffer
    # one split into (shard, padding) pieces, one copy into the shard pieces
    pieces = inp.split_with_sizes([n for s, slot in zip(shards, shard_numels) for n in (s.numel(), slot - s.numel())])
    torch._foreach_copy_(pieces[::2], shards)
    if custom is not None:
        torch._foreach_zero_(pieces[1::2])
    work, event = _start("all_gather", what, ranks, out, inp, custom, label)
    return CollectiveWork(work, inp, out, ranks.size, what, event)


@torch.no_grad()
def copy_out(work: CollectiveWork, shard_numels: list[int], dests: list[torch.Tensor]) -> None:
    """Wait for an all-gather, then copy its flat output into each parameter's unsharded buffer.

    ``dests[i]`` is a ``(world_size, ...)`` view whose entry ``r`` receives rank ``r``'s slot: ``(world_size,
    shard_numels[i])`` and contiguous, or strided (shard dim > 0). Over one rank (no padding) the shards are copied.
    """
    output, world_size = work.wait(), work.world_size
    # The destinations alias parameters that autograd may have saved for backward:
    # refilling them is not a modification autograd must see (their versions are put back).
    versions = tuple(d._version for d in dests)
    if output is None:
        torch._foreach_copy_([d if d.dim() == 2 else d.view(1, -1) for d in dests], work.shards)
    elif all(d.dim() == 2 for d in dests):  # a strided view has a dim more than its parameter
        gathered = output.view(world_size, -1)  # (world_size, sum of slots), rank-major
        torch.split_with_sizes_copy(gathered, shard_numels, dim=1, out=list(dests))
    else:
        for dest, block in zip(dests, torch.split(output.view(world_size, -1), shard_numels, dim=1)):
            dest.copy_(block.reshape(dest.shape))
    torch._C._autograd._unsafe_set_version_counter(tuple(dests), versions)


def divide_factors(
    dtype: torch.dtype, data_parallel_size: int, factor: float | None, force_sum: bool = False
) -> tuple[dist.ReduceOp.RedOpType, float | None, float | None]:
    """How to average: (reduce op, pre-divide, post-divide).

    fp32/bf16 use ``ReduceOp.AVG``; a custom factor divides first and sums (gloo has no ``PREMUL_SUM``). Narrow dtypes
    (fp16) split the division around the sum, a power of two near the square root first, so neither the summands nor
    the sum leave their range. ``force_sum`` (``set_force_sum_reduction_for_comms``): sum, then divide once after.
    """
    if factor is None and dtype in _AVG_SAFE_DTYPES and not force_sum:
        return (dist.ReduceOp.AVG if data_parallel_size > 1 else dist.ReduceOp.SUM), None, None
    total = float(data_parallel_size if factor is None else factor)
    if force_sum and dtype in _AVG_SAFE_DTYPES:
        return dist.ReduceOp.SUM, None, total
    if dtype in _AVG_SAFE_DTYPES:
        return dist.ReduceOp.SUM, total, None
    pre = float(1 << max(0, math.ceil(math.log2(math.sqrt(total))))) if total > 1 else 1.0
    return dist.ReduceOp.SUM, pre, total / pre


def reduce_scatter(grads: list[torch.Tensor], ranks: Ranks, dtype: torch.dtype, *, dp_size: int,
                   divide_factor: float | None, force_sum: bool, what: str, label: str = "",
                   custom: Any = None) -> ReduceScatterWork:
    """Reduce-scatter ``grads`` (full unsharded gradients) into this rank's flat shard.

    The division covers all ``dp_size`` data-parallel ranks: with HSDP the caller all-reduces
    the output across replicas (``all_reduce_op``) and then applies ``post_divide``.
    """
    op, pre, post = divide_factors(dtype, dp_size, divide_factor, force_sum)
    if len({g.dtype for g in grads}) > 1:
        grads = [g if g.dtype == dtype else g.to(dtype) for g in grads]
    # (world, cols): row r is every gradient's r-th dim-0 chunk, zero-padded, cast on the way (no separate cast copy)
    world = ranks.size
    cols = sum(math.ceil(g.shape[0] / world) * math.prod(g.shape[1:]) for g in grads)
    device, custom = grads[0].device, custom if world > 1 else None
    inp = _buffer(custom, world * cols, dtype, device).view(world, cols)
    torch._chunk_cat(grads, dim=0, num_chunks=world, out=inp)
    if pre is not None and pre != 1:
        inp.div_(pre)
    if world == 1:  # the reduce-scatter of one rank is its input
        return ReduceScatterWork(None, inp, inp.view(-1), world, what, post_divide=post, all_reduce_op=op)
    out = _buffer(custom, cols, dtype, device)
    work, event = _start("reduce_scatter", what, ranks, out, inp.view(-1), custom, label, op=op)
    return ReduceScatterWork(work, inp, out, world, what, event, post_divide=post, all_reduce_op=op)
