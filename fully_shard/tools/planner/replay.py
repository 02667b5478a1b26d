"""Replaying one training step of fully_shard calls, buffer by buffer: device bytes over time.

The memory planner (``plan.py``) decides the calls and sizes each group's buffers with
fully_shard's own functions; this replays one steady-state step (the prefetch order known
from the previous one) as ``state.py``, ``group.py`` and ``comm.py`` allocate and free:

* forward: each group's all-gather (input: its padded slots; output: N times that) is
  issued one group ahead (implicit prefetch), the unsharded parameters are allocated when
  it is waited, and freed after the group's forward unless it keeps them
  (``reshard_after_forward``; the root keeps its parameters by default);
* backward: groups run in reverse, each prefetching the one before it; a group's
  unsharded gradients (compute dtype) live until its post-backward, which frees the
  unsharded parameters, packs the gradients into the reduce-scatter input (N times the
  padded slots, cast to the reduce dtype on the way), and only then finishes the
  *previous* group's reduce-scatter: one group's reduction stays in flight (on a device
  with streams with the gradients it read, on the CPU without);
* the sharded gradients are views of the reduce-scatter output when its dtype is the
  parameter's (padded slots), else copies (this rank's rows).

Activations, when the plan counts them, are allocated at the end of a call's forward: its
blocks' (``Call.act``) are freed at its post-backward, once its gradients exist (all at
once: autograd frees them op by op, so the moment both are counted is an upper bound);
the root's others (embedding, final norm, loss: ``Call.act_rest``) once the root's
gradients are allocated, before the blocks' backward, since the loss and the head are
differentiated first. With activation checkpointing a call rebuilds one block
(``Call.recompute``) at the start of its backward, freed at its post-backward.

On a device with streams the last waited all-gather's buffers stay referenced until the
next all-gather is issued (``streams.py``); on the CPU they are dropped at once. Each group
moves through fully_shard's ``GroupState`` by ``group.next_state``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...group import GroupState, next_state

__all__ = ["Call", "Timeline", "Replay", "pre_order", "post_order"]


@dataclass
class Call:
    """One fully_shard call (an FSDPState): its group's buffer sizes, per rank, and the calls
    nested in it."""

    name: str
    params: list[Any]  # the group's parameters (none: the call has no group)
    children: list[Call]
    reshard: bool | int  # resolved reshard_after_forward
    ag_in: int = 0  # all-gather input: the padded slots, all-gather dtype
    unsharded: int = 0  # padded unsharded parameters = all-gather output
    ugrad: list[int] = field(default_factory=list)  # per trainable param: unsharded grad bytes
    rs_in: int = 0  # reduce-scatter input (its output is 1/N of it)
    grad_view: int = 0  # reduce-scatter output kept as the sharded grads' storage
    grad_copy: int = 0  # sharded grads copied out of it (this rank's rows)
    sharded: int = 0  # this rank's parameters
    optim: int = 0  # this rank's optimizer state
    act: int = 0  # activations of its blocks that its forward keeps for backward
    act_rest: int = 0  # the root: the rest of the model's (embedding, final norm, loss)
    recompute: int = 0  # activations its backward rebuilds (activation checkpointing)


def pre_order(node: Call) -> list[Call]:
    """The forward order of the calls (modules run in registration order)."""
    return [node] + [m for c in node.children for m in pre_order(c)]


def post_order(node: Call) -> list[Call]:
    """Inner calls before outer ones: the order of their post-forwards."""
    return [m for c in node.children for m in post_order(c)] + [node]


class Timeline:
    """Live device bytes by kind; peaks are checked at every allocation."""

    KINDS = ("param", "grad", "state", "optim", "act")

    def __init__(self, base: int) -> None:
        self.live: dict[tuple[str, str, str], int] = {}
        self.by_kind = {k: 0 for k in self.KINDS}
        self.base = base
        self.peak = base
        self.peak_at = "start of step"
        self.kind_peak = {k: 0 for k in self.KINDS}
        self.where = ""
        # after every allocation and free:
        # [phase, sharded state, params, grads, optimizer temps, activations]
        self.trace: list[list[Any]] = []

    def _record(self) -> None:
        k = self.by_kind
        self.trace.append([self.where, self.base + k["state"], k["param"], k["grad"], k["optim"], k["act"]])

    def alloc(self, kind: str, what: str, node: str, nbytes: int) -> None:
        if nbytes <= 0:
            return
        key = (kind, what, node)
        self.live[key] = self.live.get(key, 0) + nbytes
        self.by_kind[kind] += nbytes
        self.kind_peak[kind] = max(self.kind_peak[kind], self.by_kind[kind])
        total = self.base + sum(self.by_kind.values())
        if total > self.peak:
            self.peak, self.peak_at = total, self.where
        self._record()

    def free(self, kind: str, what: str, node: str) -> None:
        n = self.live.pop((kind, what, node), 0)
        if n:
            self.by_kind[kind] -= n
            self._record()


class Replay:
    """One steady-state step (prefetch order known from the previous one). Each group moves
    through fully_shard's ``GroupState`` with ``next_state``, so the replay can make no
    transition a real group cannot."""

    def __init__(self, root: Call, shard: int, streams: bool, timeline: Timeline, device_grads: bool) -> None:
        self.root, self.shard, self.streams, self.t = root, shard, streams, timeline
        self.device_grads = device_grads
        self.forward_order = pre_order(root)
        self.post_forward_order = post_order(root)
        self.state = {id(n): GroupState.SHARDED for n in self.forward_order}
        self.needs_post_backward = {id(n): False for n in self.forward_order}
        self.held: Call | None = None  # streams: the last waited all-gather's buffers
        self.pending: Call | None = None  # the reduce-scatter in flight

    def _move(self, n: Call, state: GroupState) -> None:
        self.state[id(n)] = next_state(n.name, self.state[id(n)], state)

    # unshard / wait_for_unshard / reshard (group.py)
    def _release_held(self) -> None:
        if self.held is not None:
            self.t.free("param", "all-gather", self.held.name)
            self.held = None

    def issue(self, n: Call) -> None:
        state = self.state[id(n)]
        if not n.params or state not in (GroupState.SHARDED, GroupState.POST_FORWARD):
            return
        self._release_held()
        if state is GroupState.SHARDED:
            self.t.alloc("param", "all-gather", n.name, n.ag_in)
        else:  # from the k-rank slices kept after forward
            self.t.alloc("param", "all-gather", n.name, n.unsharded // int(n.reshard))
            self.t.free("param", "slice", n.name)
        self.t.alloc("param", "all-gather", n.name, n.unsharded)
        self._move(n, GroupState.UNSHARDING)

    def wait(self, n: Call) -> None:
        if self.state[id(n)] is not GroupState.UNSHARDING:
            return
        self.t.alloc("param", "unsharded", n.name, n.unsharded)
        if self.streams:
            self._release_held()
            self.held = n
        else:
            self.t.free("param", "all-gather", n.name)
        self._move(n, GroupState.UNSHARDED)

    def reshard(self, n: Call, post_forward: bool) -> None:
        unsharded = self.state[id(n)] is GroupState.UNSHARDED
        keep = post_forward and type(n.reshard) is int and unsharded
        if unsharded:
            if keep:
                self.t.alloc("param", "slice", n.name, n.unsharded // int(n.reshard))
            self.t.free("param", "unsharded", n.name)
        self._move(n, GroupState.POST_FORWARD if keep else GroupState.SHARDED)

    def is_unsharded(self, n: Call) -> bool:
        return self.state[id(n)] in (GroupState.UNSHARDING, GroupState.UNSHARDED)

    # forward (state.py pre_forward / post_forward)
    def forward(self, n: Call) -> None:
        self.t.where = f"forward: all-gather of {n.name}"
        self.issue(n)
        i = self.forward_order.index(n)
        if i + 1 < len(self.forward_order):
            target = self.forward_order[i + 1]
            if target.params and not self.is_unsharded(target):
                self.issue(target)
        self.wait(n)
        self.needs_post_backward[id(n)] = bool(n.params)
        for c in n.children:
            self.forward(c)
        self.t.where = f"forward: activations of {n.name}"
        self.t.alloc("act", "activations", n.name, n.act)
        self.t.alloc("act", "head", n.name, n.act_rest)
        if n.reshard:
            self.reshard(n, post_forward=type(n.reshard) is int)

    # backward (pre_backward / post_backward)
    def backward(self, n: Call) -> None:
        self.t.where = f"backward: all-gather of {n.name}"
        self.issue(n)
        i = self.post_forward_order.index(n)
        if i > 0:
            target = self.post_forward_order[i - 1]
            if target.params and self.needs_post_backward[id(target)] and not self.is_unsharded(target):
                self.issue(target)
        self.wait(n)
        self.t.where = f"backward: recompute of {n.name}"
        self.t.alloc("act", "recomputed", n.name, n.recompute)
        self.t.where = f"backward: gradients of {n.name}"
        for nbytes in n.ugrad:  # all present by the group's post-backward
            self.t.alloc("grad", "unsharded grad", n.name, nbytes)
        self.t.free("act", "head", n.name)  # the loss and head are differentiated first
        for c in reversed(n.children):
            self.backward(c)
        self.post_backward(n)

    def post_backward(self, n: Call) -> None:
        self.t.where = f"backward: reduce-scatter of {n.name}"
        self.needs_post_backward[id(n)] = False
        self.t.free("act", "activations", n.name)  # all read by now
        self.t.free("act", "recomputed", n.name)
        self.reshard(n, post_forward=False)  # before the reduce-scatter buffers exist
        if n.ugrad:
            # the reduce-scatter input is packed (and cast) straight from the gradients, which
            # without streams go at once (with them: read on the side stream, held until its wait)
            self.t.alloc("grad", "reduce-scatter input", n.name, n.rs_in)
            self.t.alloc("grad", "reduce-scatter output", n.name, n.rs_in // self.shard)
            if not self.streams:
                self.t.free("grad", "unsharded grad", n.name)
            self.finish_reduce()
            self.pending = n

    def finish_reduce(self) -> None:
        p, self.pending = self.pending, None
        if p is None:
            return
        self.t.where = f"backward: end of reduce-scatter of {p.name}"
        self.t.free("grad", "reduce-scatter input", p.name)
        if self.device_grads:
            self.t.alloc("state", "grads", p.name, p.grad_copy)
        self.t.free("grad", "reduce-scatter output", p.name)
        self.t.alloc("state", "grads", p.name, p.grad_view)  # the output, now the sharded grads
        self.t.free("grad", "unsharded grad", p.name)

    def step(self) -> None:
        self.forward(self.root)
        self.backward(self.root)
        self.finish_reduce()  # end of backward (is_last_backward)
        for n in self.forward_order:
            if self.state[id(n)] is not GroupState.SHARDED:
                self.reshard(n, post_forward=False)
