"""One group: the parameters of one fully_shard call, gathered and reduced together."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto
from typing import Callable

import torch

from . import comm
from .mesh import MeshInfo
from .param import ShardedParam


class GroupState(Enum):
    """Where a group's parameters are, and what memory they hold."""

    SHARDED = auto()  # modules hold the sharded DTensor parameters; no unsharded storage
    UNSHARDING = auto()  # all-gather issued, not yet waited: its flat output is in flight
    UNSHARDED = auto()  # modules hold the full parameters; unsharded storage allocated


class ParamGroup:
    """All-gathers and reduce-scatters the parameters of one ``fully_shard`` call.

    One all-gather rebuilds every parameter of the group; one reduce-scatter leaves each
    rank with the averaged gradient of its own rows.
    """

    def __init__(self, params: list[ShardedParam], mesh_info: MeshInfo, device: torch.device, label: str) -> None:
        self.params = params
        self.mesh_info = mesh_info
        self.device = device
        self.label = label  # fully-qualified name(s) of the module(s), for messages and traces
        self.state = GroupState.SHARDED
        # one all-gather per unsharded dtype: one in all but mixed-dtype groups
        self._gather_buckets = _buckets(params, lambda p: p.unsharded_dtype)
        self._all_gathers: list[comm.AllGatherWork] = []  # in flight while UNSHARDING
        # user controls (FSDPModule setters)
        self.requires_gradient_sync = True
        self.requires_all_reduce = True
        self.reshard_after_backward = True
        self.gradient_divide_factor: float | None = None
        # set by pre-forward under grad mode; cleared once post-backward has run
        self.needs_post_backward = False

    # -- unshard / reshard ---------------------------------------------------------

    def unshard(self, async_op: bool = False) -> None:
        """Issue the all-gather (no-op unless sharded); wait for it unless ``async_op``."""
        if self.state is GroupState.SHARDED:
            self._all_gathers = [
                comm.all_gather(
                    [p.local_shard for p in bucket],
                    [p.shard_numel for p in bucket],
                    self.mesh_info.shard_group,
                    self.mesh_info.shard_size,
                    bucket[0].unsharded_dtype,
                    self.device,
                    async_op=True,
                )
                for bucket in self._gather_buckets
            ]
            self.state = GroupState.UNSHARDING
        if not async_op:
            self.wait_for_unshard()

    def wait_for_unshard(self) -> None:
        """Finish an issued all-gather: copy out and point the modules at full parameters."""
        if self.state is not GroupState.UNSHARDING:
            return
        for bucket, work in zip(self._gather_buckets, self._all_gathers):
            dests = [p.alloc_unsharded() for p in bucket]
            comm.copy_out(work.wait(), self.mesh_info.shard_size, [p.shard_numel for p in bucket], dests)
        self._all_gathers = []
        for p in self.params:
            p.register(unsharded=True)
        self.state = GroupState.UNSHARDED

    def reshard(self) -> None:
        """Free the full parameters and point the modules back at the sharded ones."""
        if self.state is GroupState.UNSHARDING:
            for work in self._all_gathers:
                work.wait()  # the collective must complete before its buffers go
            self._all_gathers = []
        elif self.state is GroupState.UNSHARDED:
            for p in self.params:
                p.free_unsharded()
        for p in self.params:
            p.register(unsharded=False)
        self.state = GroupState.SHARDED

    def reset(self) -> None:
        """Back to SHARDED whatever happened, dropping in-flight buffers and partial grads."""
        self._all_gathers = []
        if self.state is GroupState.UNSHARDED:
            for p in self.params:
                p.free_unsharded()
        for p in self.params:
            p.register(unsharded=False)
            p.accumulated_grad = None
            if p.unsharded_param is not None:
                p.unsharded_param.grad = None
        self.state = GroupState.SHARDED
        self.needs_post_backward = False

    @property
    def is_unsharded(self) -> bool:
        return self.state is not GroupState.SHARDED

    # -- gradients -----------------------------------------------------------------

    def reduce_grads(self) -> PendingReduce | None:
        """Reduce-scatter this group's gradients, or accumulate them while sync is off.

        Returns the reduction in flight; its ``finish`` assigns the result. Parameters
        whose gradient is None (unused this iteration) take no part, as in torch's FSDP2:
        which parameters are used must then be the same on every rank.
        """
        self.needs_post_backward = False
        with_grad: list[ShardedParam] = []
        grads: dict[int, torch.Tensor] = {}
        for p in self.params:
            grad = p.unsharded_grad
            if grad is not None:
                assert p.unsharded_param is not None
                p.unsharded_param.grad = None
            if p.accumulated_grad is not None:
                if grad is not None:
                    p.accumulated_grad.add_(grad)
                grad = p.accumulated_grad
            if grad is None:
                continue
            if grad.dtype != p.reduce_dtype:
                grad = grad.to(p.reduce_dtype)
            if not self.requires_gradient_sync:
                p.accumulated_grad = grad  # kept unsharded, in reduce dtype, until a synced backward
                continue
            p.accumulated_grad = None
            with_grad.append(p)
            grads[id(p)] = grad
        if not with_grad:
            return None
        info = self.mesh_info
        reductions = []
        for bucket in _buckets(with_grad, lambda p: p.reduce_dtype):  # one per reduce dtype
            work = comm.reduce_scatter(
                [grads[id(p)] for p in bucket],
                info.shard_group,
                info.shard_size,
                bucket[0].reduce_dtype,
                self.gradient_divide_factor,
                info.replicate_group if self.requires_all_reduce else None,
                async_op=True,
            )
            reductions.append((work, bucket))
        return PendingReduce(reductions)


def _buckets(params: list[ShardedParam], key: Callable[[ShardedParam], torch.dtype]) -> list[list[ShardedParam]]:
    """Split ``params`` by ``key``, keeping their order (one bucket when all agree)."""
    buckets: dict[torch.dtype, list[ShardedParam]] = {}
    for p in params:
        buckets.setdefault(key(p), []).append(p)
    return list(buckets.values())


@dataclass
class PendingReduce:
    """A group's gradient reduction in flight and the parameters it belongs to."""

    reductions: list[tuple[comm.ReduceScatterWork, list[ShardedParam]]]

    def finish(self) -> None:
        """Wait for the reductions and add each rank's rows to the sharded gradients."""
        for work, params in self.reductions:
            output = work.wait()  # 1-D, the packed padded shards of params
            offset = 0
            for p in params:
                flat = output[offset : offset + p.shard_numel]
                offset += p.shard_numel
                p.accumulate_sharded_grad(flat.view(p.chunk_rows, *p.size[1:])[: p.local_rows])

