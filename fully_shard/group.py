"""One group: the parameters of one fully_shard call, gathered and reduced together. A ``Note [name]`` points to the
invariant of that name in docs/design.md's Invariants section."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any, TypeVar

import torch

from . import comm
from .layout import reduced_parts
from .mesh import MeshInfo
from .param import ShardedParam, accumulate_sharded_grads
from .streams import Streams

E = TypeVar("E", bound=Enum)


def transition(who: str, table: Mapping[E, Collection[E]], current: E, new: E) -> E:
    """``new`` if ``table`` lets ``who`` go there from ``current``, else an internal error. Every state machine's."""
    if new not in table[current]:
        raise AssertionError(f"fully_shard internal error: {who} cannot go from {current.name} to {new.name}")
    return new


class GroupState(Enum):
    """Where a group's parameters are, and what memory they hold."""

    SHARDED = auto()  # at first and by reshard(): modules hold the sharded DTensor parameters; no unsharded storage
    POST_FORWARD = auto()  # by reshard(keep=...) (reshard_after_forward=k): as SHARDED, plus this rank's 1/k slice
    UNSHARDING = auto()  # by unshard(): the all-gather is issued, not yet waited; its flat buffers are in flight
    UNSHARDED = auto()  # by wait_for_unshard(): modules hold the full parameters; unsharded storage allocated


# the transitions a group may make (reset() may go to SHARDED from anywhere)
_TRANSITIONS = {
    GroupState.SHARDED: {GroupState.UNSHARDING, GroupState.SHARDED},
    GroupState.POST_FORWARD: {GroupState.UNSHARDING, GroupState.SHARDED},
    GroupState.UNSHARDING: {GroupState.UNSHARDED},
    GroupState.UNSHARDED: {GroupState.SHARDED, GroupState.POST_FORWARD},
}


class GradState(Enum):
    """What a group owes the backward. Gradients kept with gradient sync off are data, not state: each parameter's
    ``accumulated_grad`` (one full gradient, in the reduce dtype) holds them whatever the member."""

    NONE = auto()  # owes nothing: entered by its post-backward (reduce_grads) and by reset()
    DUE = auto()  # entered when a forward under grad mode, or a backward, reaches it: autograd leaves full gradients on
    #               the unsharded parameters, which its post-backward reduces (from _PostBackward, else at the end)
    AT_END = auto()  # as DUE, but its module ran on some ranks only (reduce_scatter_unused_params): entered by the
    #                  root's agreement; only the end-of-backward callback reduces it, on every rank in module order


# reduce_grads may run owing nothing (a second call's inputs; gradients that arrived after its post-backward); AT_END
# is left only when the agreement or the end of backward makes it DUE again
_NONE, _DUE, _AT_END = GradState
_GRAD_TRANSITIONS = {_NONE: {_DUE, _AT_END, _NONE}, _DUE: {_NONE, _AT_END}, _AT_END: {_DUE}}


@dataclass(frozen=True)
class GroupOptions:
    """A group's settings from the ``FSDPModule`` setters (per group, as in torch; ``reshard_after_forward`` and the
    prefetch lists are per ``FSDPState``, ``is_last_backward`` per root). Frozen: setters ``dataclasses.replace`` it."""

    requires_gradient_sync: bool = True  # off: gradients accumulate unsharded until a backward with it on
    requires_all_reduce: bool = True  # HSDP: all-reduce across replicas after the reduce-scatter
    reshard_after_backward: bool = True
    unshard_in_backward: bool = True
    reduce_scatter_unused_params: bool = False  # reduce zeros for unused parameters
    force_sum_reduction: bool = False
    gradient_divide_factor: float | None = None  # None: average over the data-parallel ranks
    max_input_buffers: int = 1  # reductions kept in flight (the root's RootContext takes the largest)
    all_gather_comm: Any = None  # torch's Comm API (set_custom_all_gather, or a PoolComm)
    reduce_scatter_comm: Any = None
    reduce_scatter_groups: Mapping[int, torch.distributed.ProcessGroup] = field(default_factory=dict)  # by id(MeshInfo)
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None
    all_reduce_hook_stream: Any = None  # the user's stream to run it on (a torch.Stream)


class ParamGroup:
    """All-gathers and reduce-scatters the parameters of one ``fully_shard`` call: one all-gather rebuilds them all (one
    per unsharded dtype when dtypes are mixed, and per mesh when ``shard_placement_fn`` puts parameters on their own);
    one reduce-scatter (per reduce dtype and mesh) leaves each rank with the averaged gradient of its own rows,
    all-reduced across replicas under HSDP."""

    def __init__(self, params: list[ShardedParam], mesh_info: MeshInfo, device: torch.device, label: str) -> None:
        self.params = params
        self.mesh_info = mesh_info
        self.device = device
        self.label = label  # the module(s) of the fully_shard call, for messages and traces
        self.post_forward: dict[int, comm.Ranks] = {}  # while POST_FORWARD: per mesh (id), the k ranks holding slices
        self.state = GroupState.SHARDED
        # _gather_buckets by unsharded dtype and mesh; _ext by mesh: local tensors gathering themselves
        self._split_buckets()
        self._ext_slots: list[list[int]] = []  # their inputs' per-rank slots, in bytes, per bucket
        self._all_gathers: list[comm.CollectiveWork] = []  # in flight while UNSHARDING
        self.streams: Streams | None = None  # the root's, once known (see ``_streams``)
        # HSDP, all-reduce off: reduce-scatter outputs awaiting it
        self._partials: dict[tuple[int, ...], torch.Tensor] = {}
        self.options = GroupOptions()  # the user's settings: FSDPModule._update replaces it
        self.grad_state = GradState.NONE
        for p in params:
            p.group = self

    def _split_buckets(self) -> None:
        self._gather_buckets = _buckets([p for p in self.params if not p.extension], lambda p: p.unsharded_dtype)
        ext = _buckets([p for p in self.params if p.extension], lambda p: torch.uint8)
        self._ext = [[g for p in b if (g := p.self_gather) is not None] for b in ext]

    def _move_to(self, state: GroupState, reset: bool = False) -> None:
        self.state = state if reset else transition(f"group {self.label}", _TRANSITIONS, self.state, state)

    def move_grads(self, state: GradState) -> None:
        self.grad_state = transition(f"group {self.label}'s gradients", _GRAD_TRANSITIONS, self.grad_state, state)

    def owe_post_backward(self) -> None:
        """A forward under grad mode, or a backward, reached the group: its post-backward must run (once)."""
        if self.grad_state is GradState.NONE:
            self.move_grads(GradState.DUE)

    all_gather_comm = property(lambda self: self.options.all_gather_comm)  # the Comms its collectives use
    reduce_scatter_comm = property(lambda self: self.options.reduce_scatter_comm)

    def _streams(self) -> Streams:
        if self.streams is None:  # used before any root forward (e.g. an explicit unshard())
            self.streams = Streams(self.device)
        return self.streams

    # -- unshard / reshard ---------------------------------------------------------

    def unshard(self, async_op: bool = False) -> None:
        """Issue the all-gather (no-op unless sharded); wait for it unless ``async_op``."""
        if self.state in (GroupState.SHARDED, GroupState.POST_FORWARD):
            streams = self._streams()
            streams.release_all_gather()  # the copy-in stream may now reuse the last output
            with streams.use("copy_in"), torch.no_grad():  # pack, then issue from there: the collective waits for it
                self._all_gathers = self._issue_all_gathers()
            self._move_to(GroupState.UNSHARDING)
        if not async_op:
            self.wait_for_unshard()

    def _issue_all_gathers(self) -> list[comm.CollectiveWork]:
        """One all-gather per unsharded dtype and mesh (then one, of bytes, per mesh for the subclasses that gather
        themselves); from POST_FORWARD, a mesh's kept slices within its k ranks."""

        def gather(shards: list[Any], numels: list[int], dtype: torch.dtype, what: str,
                   ranks: comm.Ranks) -> comm.CollectiveWork:
            return comm.all_gather(shards, numels, ranks, dtype, self.device, what, self.label,
                                   self.options.all_gather_comm)

        # which parameters gather themselves is looked up afresh (hooks patched on later); not for kept slices
        if not self.post_forward and any([p.refresh_extension() for p in self.params]):
            self._split_buckets()
        works = []
        for b in self._gather_buckets:
            pf = self.post_forward.get(id(b[0].mesh_info))
            shards = [p.post_forward_slice if pf else p.all_gather_input() for p in b]
            numels = [p.layout.padded_numel // pf.size if pf else p.layout.slot_numel for p in b]
            what = f"all-gather of {self.label}'s parameters" + (f" within {pf.size} ranks, for backward" if pf else "")
            works.append(gather(shards, numels, b[0].unsharded_dtype, what, pf or b[0].mesh_info.shard))
        for p in self.params:
            p.post_forward_slice = None  # packed into the all-gather input
        self._ext_slots = []
        for gathers in self._ext:
            inputs, slots = [], []
            for g in gathers:
                flats, sizes = g.all_gather_inputs()
                inputs += flats
                slots += sizes
            self._ext_slots.append(slots)
            what = f"all-gather of {self.label}'s tensor-subclass parameters"
            works.append(gather(inputs, slots, torch.uint8, what, gathers[0].param.mesh_info.shard))
        return works

    def wait_for_unshard(self) -> None:
        """Finish an issued all-gather: copy out and point the modules at full parameters."""
        if self.state is not GroupState.UNSHARDING:
            return
        if any(w.work is None for w in self._all_gathers):  # over one rank: no collective orders the copy-in
            streams = self._streams()
            streams.current_waits(streams.record("copy_in"))
        for bucket, work in zip(self._gather_buckets, self._all_gathers):
            world = work.world_size
            for p in bucket:
                p.alloc_unsharded()
            comm.copy_out(work, [p.layout.padded_numel // world for p in bucket],
                          [p.gather_dest(world) for p in bucket])
            for p in bucket:
                p.note_unsharded_version()
        for gathers, slots, work in zip(self._ext, self._ext_slots, self._all_gathers[len(self._gather_buckets) :]):
            comm.copy_out(work, slots, [d for g in gathers for d in g.gather_dests()])
            for g in gathers:
                g.post_all_gather()
                g.param.note_unsharded_version()
        self._hold_all_gathers()
        for p in self.params:
            p.register(unsharded=True)
        self._move_to(GroupState.UNSHARDED)

    def reshard(self, keep: dict[int, comm.Ranks] | None = None) -> None:
        """Free the full parameters and point the modules back at the sharded ones. With ``keep``
        (``reshard_after_forward=k``, after forward: per mesh, by ``id``), each rank of such a mesh first keeps its 1/k
        slice so backward can all-gather within those k ranks."""
        if self.state is GroupState.UNSHARDING:
            for work in self._all_gathers:
                work.wait()  # Note [buffer lifetime]: the collective must complete before its buffers go
            self._hold_all_gathers()
            self._move_to(GroupState.UNSHARDED)
        keep = keep if keep and self.state is GroupState.UNSHARDED else {}
        if self.state is GroupState.UNSHARDED:
            for p in self.params:
                p.check_unsharded_version()
            for p in self.params:
                if keep and (ranks := keep.get(id(p.mesh_info))) is not None:
                    p.keep_post_forward_slice(ranks.size, ranks.rank)
                p.free_unsharded()
        self.post_forward = keep
        for p in self.params:
            if not keep:
                p.post_forward_slice = None
            p.register(unsharded=False)
        self._move_to(GroupState.POST_FORWARD if keep else GroupState.SHARDED)

    def _hold_all_gathers(self) -> None:
        """The all-gather buffers were last used on the current stream: keep them until the copy-in stream has waited
        for that use (no-op without streams; Note [buffer lifetime]). Over one rank the buffers are the shards copied
        out, which the copy-in stream made when they were offloaded."""
        self._streams().hold_all_gather(*(t for w in self._all_gathers for t in (w.input, w.output, *w.shards)))
        self._all_gathers = []

    def reset(self) -> None:
        """Back to SHARDED whatever happened, dropping in-flight buffers and partial grads."""
        self._all_gathers = []
        self._partials = {}
        self.post_forward = {}
        if self.state is GroupState.UNSHARDED:
            for p in self.params:
                p.free_unsharded()
        for p in self.params:
            p.register(unsharded=False)
            p.post_forward_slice = None
            p.accumulated_grad = None
            p.clear_unsharded_grad()
            p.sharded_param.grad = None  # part of the failed iteration's gradients
        self._move_to(GroupState.SHARDED, reset=True)
        self.grad_state = GradState.NONE

    def refresh_after_apply(self) -> None:
        """Follow dtype changes made by ``Module._apply`` (``model.double()``)."""
        for p in self.params:
            p.refresh_after_apply()
        self._split_buckets()

    def has_unsharded_grads(self) -> bool:
        """Whether a backward left gradients on the full parameters that no reduction took."""
        return any(p.unsharded_grad is not None for p in self.params)

    @property
    def is_unsharded(self) -> bool:
        """Whether full parameters are (or are being) materialised."""
        return self.state in (GroupState.UNSHARDING, GroupState.UNSHARDED)

    # -- gradients -----------------------------------------------------------------

    def reduce_grads(self) -> PendingReduce | None:
        """Reduce-scatter this group's gradients, or accumulate them while sync is off; returns the reduction in flight
        (``finish_reduce`` assigns its result). Parameters whose gradient is None (unused this iteration) take no part,
        as in torch's FSDP2 (which parameters are used must then be the same on every rank), unless
        ``reduce_scatter_unused_params``: Note [same collectives everywhere]."""
        self.move_grads(GradState.NONE)
        options = self.options
        grads: dict[ShardedParam, torch.Tensor] = {}  # the parameters to reduce, in order
        for p in self.params:
            grad = p.unsharded_grad
            if grad is not None:
                p.clear_unsharded_grad()
            if p.accumulated_grad is not None:
                if grad is not None:
                    p.accumulated_grad.add_(grad)
                grad = p.accumulated_grad
            if (grad is None and options.reduce_scatter_unused_params and options.requires_gradient_sync
                    and p.sharded_param.requires_grad):
                # unused here, maybe used on another rank: every rank reduces the same tensors
                grad = torch.zeros(p.size, dtype=p.reduce_dtype, device=self.device)
            if grad is None:
                continue
            # Note [tied parameters]: while another group gathering it owes a post-backward, that one reduces the sum
            waits = len(p.tie.params) > 1 and any(q.group.grad_state is not GradState.NONE for q in p.tie.params
                                                  if q is not p)
            if waits or not options.requires_gradient_sync:
                # kept unsharded until a synced backward (in the reduce dtype), or as it is until the tie's last group
                p.accumulated_grad = grad if waits or grad.dtype == p.reduce_dtype else grad.to(p.reduce_dtype)
                continue
            p.accumulated_grad = None
            grads[p] = grad
        if grads and self._alias_grads(grads):
            accumulate_sharded_grads(list(grads), list(grads.values()))
            return None
        if not grads:
            return None
        streams = self._streams()
        streams.wait_for_current("reduce_scatter")  # the gradients were computed there
        with streams.use("reduce_scatter"):  # one per reduce dtype and mesh
            reductions = [(self._reduce_scatter(bucket, grads), bucket)
                          for bucket in _buckets(list(grads), lambda p: p.reduce_dtype)]
        # with streams, the gradients are read on the reduce-scatter stream and held until its wait; without, they were
        # packed already and are freed
        return PendingReduce(self, reductions, options.requires_all_reduce,
                             list(grads.values()) if streams.backend is not None else [])

    def _alias_grads(self, grads: dict[ShardedParam, torch.Tensor]) -> bool:
        """Whether reducing these gradients is the identity (one rank, no replicas, no divide factor, hook or cast):
        each sharded gradient is then its unsharded one, no copy."""
        o = self.options
        if o.gradient_divide_factor is not None or o.all_reduce_hook is not None or o.force_sum_reduction:
            return False
        return all(p.mesh_info.shard.size == 1 and p.mesh_info.replicate is None
                   and p.reduce_dtype == p.dtype == g.dtype
                   and g.device == p.shard_device and g.is_contiguous() for p, g in grads.items())

    def _reduce_scatter(self, bucket: list[ShardedParam],
                        grads: dict[ShardedParam, torch.Tensor]) -> comm.ReduceScatterWork:
        info, o = bucket[0].mesh_info, self.options
        ranks = dataclasses.replace(info.shard, group=o.reduce_scatter_groups.get(id(info), info.shard.group))
        # debug mode
        tied = "".join(f" (with tied {p.fqn!r}, its uses' gradients summed)" for p in bucket if len(p.tie.params) > 1)
        return comm.reduce_scatter(
            [p.layout.grad_for_reduce(grads[p]) for p in bucket], ranks, bucket[0].reduce_dtype,
            dp_size=ranks.size * (info.replicate.size if info.replicate else 1), divide_factor=o.gradient_divide_factor,
            force_sum=o.force_sum_reduction, what=f"reduce-scatter of {self.label}'s gradients{tied}", label=self.label,
            custom=o.reduce_scatter_comm,
        )

    def finish_reduce(self, pending: PendingReduce) -> None:
        """Wait for a reduction; all-reduce across replicas (HSDP); add to the sharded grads. Runs on the reduce-scatter
        stream; then the current stream waits for it, so the optimizer sees the gradients and the held unsharded
        gradients may be freed."""
        streams = self._streams()
        to_host = False  # offloaded gradients copied to pinned memory without blocking
        with streams.use("reduce_scatter"):
            for work, params in pending.reductions:
                info = params[0].mesh_info
                output = work.wait()  # 1-D, the packed padded shards of params
                key = tuple(id(p) for p in params)
                partial = self._partials.pop(key, None)
                if partial is not None:
                    output.add_(partial)
                if info.replicate is not None:
                    if not pending.all_reduce:
                        self._partials[key] = output  # reduced within the shard group only
                        continue
                    comm.all_reduce(output, info.replicate.group, work.all_reduce_op,
                                    f"all-reduce of {self.label}'s gradients", self.label,
                                    self.options.reduce_scatter_comm)
                if (hook := self.options.all_reduce_hook) is not None:
                    streams.detour(self.options.all_reduce_hook_stream, lambda: hook(output))
                if work.post_divide is not None and work.post_divide != 1:
                    output.div_(work.post_divide)
                to_host |= accumulate_sharded_grads(params, reduced_parts([p.layout for p in params], output))
        done = streams.record("reduce_scatter")
        streams.current_waits(done)
        if to_host:
            streams.host_waits(done)
        pending.held = []


def _buckets(params: list[ShardedParam], key: Callable[[ShardedParam], torch.dtype]) -> list[list[ShardedParam]]:
    """Split ``params`` by mesh and ``key``, keeping their order (one bucket when all agree)."""
    buckets: dict[tuple[int, torch.dtype], list[ShardedParam]] = {}
    for p in params:
        buckets.setdefault((id(p.mesh_info), key(p)), []).append(p)
    return list(buckets.values())


@dataclass
class PendingReduce:
    """A group's gradient reduction in flight."""

    group: ParamGroup
    reductions: list[tuple[comm.ReduceScatterWork, list[ShardedParam]]]
    all_reduce: bool  # HSDP: whether to all-reduce across replicas when it lands (requires_all_reduce)
    held: list[torch.Tensor]  # the unsharded gradients, read on the reduce-scatter stream: Note [buffer lifetime]

    def runs_hooks(self) -> bool:
        """Whether finishing it runs post-accumulate-grad hooks (an optimizer stepping in backward)."""
        return any(p.sharded_param._post_accumulate_grad_hooks for _, params in self.reductions for p in params)
