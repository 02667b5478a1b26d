"""One training step of fully_shard itself, on a fake process group and fake tensors: what the planner measures.

The planner has no model of fully_shard's schedule: it runs it. ``fake_world`` gives this process a process group of
any size whose collectives complete without moving data (torch's ``FakeProcessGroup``) and a mesh over it, on which
the real ``fully_shard`` shards the meta-device model. ``measure_step`` materialises the model under
``FakeTensorMode`` (tensors with shapes and storage sizes but no bytes) and takes two training steps, the second one
measured: every hook, prefetch, reduction in flight and the end-of-backward callback are fully_shard's own. What the
modules compute does not matter to memory, only which parameters they use and when, so each sharded module's forward
is replaced by a stand-in that calls its sharded children and uses its own parameters in registration order, and in
backward gives each parameter a gradient of its shape and dtype, as autograd does.

Two seams observe the step. A ``Ledger`` (a dispatch mode) keeps the live bytes of every tensor storage by kind: what
fully_shard allocates, by the group method on the stack (``_KINDS``); the parameters' gradients and the activations,
which the stand-ins allocate. ``comm.monitor`` reports every collective. On a device with streams the root gets
``Streams`` whose backend does nothing (``NoStreams``, the ``streams.Backend`` protocol), so the runtime holds its
buffers as it does there (the last all-gather's until the next copy-in, the gradients read by a reduction until it is
finished).
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._C._distributed_c10d import FakeProcessGroup
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ... import comm
from ...group import ParamGroup
from ...state import STATE_ATTR, FSDPState
from ...streams import Streams

__all__ = ["KINDS", "Activations", "Ledger", "NoStreams", "Step", "fake_world", "measure_step"]

# sharded state (gradients); unsharded parameters; unsharded gradients; optimizer temporaries; activations
KINDS = ("state", "param", "grad", "optim", "act")

# the group methods whose allocations are of one kind (the innermost on the stack decides), and how a step names them
_KINDS = {"accumulate_sharded_grads": "state", "finish_reduce": "grad", "reduce_grads": "grad",
          "wait_for_unshard": "param", "unshard": "param", "reshard": "param"}
_WHAT = {"finish_reduce": "end of reduce-scatter of", "reduce_grads": "reduce-scatter of",
         "wait_for_unshard": "all-gather of", "unshard": "all-gather of", "reshard": "reshard of"}
_CORE = __file__.rsplit("/tools/", 1)[0] + "/"  # fully_shard/, where those methods live


# -- a process group of any size, in this process -------------------------------------------------------------------


def _fake_group(common: Any, options: Any) -> Any:
    return FakeProcessGroup._create_internal(common.group_rank, common.group_size, options)  # type: ignore[call-arg]


@contextlib.contextmanager
def fake_world(shape: tuple[int, ...], rank: int) -> Iterator[DeviceMesh]:
    """A CPU mesh of ``shape`` over a fake process group in which this process is ``rank``.

    Example::

        >>> with fake_world((8, 64), rank=0) as mesh:  # HSDP: 8 replicas of a 64-way shard
        ...     model = fully_shard(model, mesh=mesh)
        ...     mesh.shape, tuple(model.output.weight.to_local().shape)  # 32 rows over 64 ranks: rank 0 holds 1
        ((8, 64), (1, 16))
    """
    if dist.is_initialized():
        raise RuntimeError("fully_shard.plan runs fully_shard on a fake process group of its own, but this process "
                           "has initialised torch.distributed already: plan before init_process_group, or in a process "
                           "of its own (python -m fully_shard.plan)")
    dist.Backend.register_backend("fake", _fake_group, extended_api=True, devices=["cpu"])
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=math.prod(shape))
    try:
        yield init_device_mesh("cpu", shape)
    finally:
        dist.destroy_process_group()


class NoStreams:
    """A ``streams.Backend`` that does nothing: the runtime takes a device's path (buffers held for other streams)."""

    def current_stream(self, device: torch.device) -> Any:
        return "current"

    def new_stream(self, device: torch.device, name: str) -> Any:
        return name

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def wait_stream(self, waiter: Any, waited: Any) -> None:
        pass

    def record_event(self, stream: Any) -> Any:
        return stream

    def wait_event(self, stream: Any, event: Any) -> None:
        pass

    def synchronize(self, event: Any) -> None:
        pass


# -- the ledger of live storages -------------------------------------------------------------------------------------


class Ledger(TorchDispatchMode):
    """Live bytes of the tensor storages of fake tensors, by kind (``KINDS``), after every allocation, free or
    ``UntypedStorage.resize_`` (how fully_shard frees and regrows unsharded parameters; it bypasses the dispatcher, so
    it is patched while the ledger is active). A storage's kind is decided when it is first seen: the group method on
    the stack (``_KINDS``), or ``tagged`` by a stand-in; storages of neither kind (the model's sharded parameters made
    by ``to_empty``, the stand-ins' own plumbing) are not counted. The reduce-scatter output a sharded gradient is a
    view of becomes ``state``. ``rows`` (while ``recording``): ``[where, state, param, grad, optim, act]``.

    The one value fully_shard reads out of a tensor, the skipped-module exchange of ``reduce_scatter_unused_params``,
    is read as 0 (every rank ran every module), the planner's premise; a fake tensor has no value to read."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._refs: dict[int, tuple[int, weakref.ref[torch.UntypedStorage]]] = {}  # storage impl -> (id, ref)
        self._bytes: list[int] = []  # by id (ids are never reused; impl addresses are)
        self._kind: list[str | None] = []
        self.live = dict.fromkeys(KINDS, 0)
        self.rows: list[list[Any]] = []
        self.recording = False
        self._tag: tuple[str, str] | None = None
        self._resize: Any = None

    @contextlib.contextmanager
    def tagged(self, kind: str, where: str) -> Iterator[None]:
        """Storages first seen inside are of ``kind``, allocated at ``where``."""
        self._tag = (kind, where)
        try:
            yield
        finally:
            self._tag = None

    def add(self, kind: str, nbytes: int, where: str) -> None:
        """Bytes the step holds that no tensor shows (the optimizer step's temporaries)."""
        self._change(kind, nbytes, where)

    def _change(self, kind: str | None, delta: int, where: str) -> None:
        if kind is None or delta == 0:
            return
        self.live[kind] += delta
        if self.recording:
            self.rows.append([where, *self.live.values()])

    def _who(self) -> tuple[str | None, str]:
        """The kind of what is allocated now and where the step is, from the stack."""
        phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        if self._tag is not None:
            return self._tag[0], f"{phase}: {self._tag[1]}"
        kind: str | None = None
        frame: FrameType | None = sys._getframe(2)
        while frame is not None:
            name = frame.f_code.co_name
            if frame.f_code.co_filename.startswith(_CORE) and name in _KINDS:
                kind = kind or _KINDS[name]
                group = frame.f_locals.get("self")
                if name in _WHAT and isinstance(group, ParamGroup):
                    return kind, f"{phase}: {_WHAT[name]} {group.label}"
            frame = frame.f_back
        return kind, phase

    def _see(self, st: torch.UntypedStorage) -> None:
        entry = self._refs.get(st._cdata)
        if entry is not None and self._kind[entry[0]] != "grad":
            self._resized(st)  # a view, or an in-place op: nothing new
            return
        kind, where = self._who()
        if entry is None:
            uid = len(self._bytes)
            self._refs[st._cdata] = (uid, weakref.ref(st, functools.partial(self._freed, st._cdata, uid)))
            self._bytes.append(st.nbytes())
            self._kind.append(kind)
            self._change(kind, st.nbytes(), where)
            return
        uid = entry[0]
        if kind == "state":  # a reduce-scatter output, now sharded gradients
            self._change("grad", -self._bytes[uid], where)
            self._kind[uid] = "state"
            self._change("state", self._bytes[uid], where)
        self._resized(st)

    def _resized(self, st: torch.UntypedStorage) -> None:
        entry = self._refs.get(st._cdata)
        if entry is not None and st.nbytes() != self._bytes[entry[0]]:
            uid = entry[0]
            delta, self._bytes[uid] = st.nbytes() - self._bytes[uid], st.nbytes()
            self._change(self._kind[uid], delta, self._who()[1])

    def _freed(self, key: int, uid: int, _: Any = None) -> None:
        if self._refs.get(key, (None,))[0] == uid:
            del self._refs[key]
        nbytes, self._bytes[uid] = self._bytes[uid], 0
        self._change(self._kind[uid], -nbytes, "backward" if torch._C._current_graph_task_id() != -1 else "forward")

    def __enter__(self) -> Ledger:
        self._resize = resize = torch.UntypedStorage.resize_
        ledger = self

        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            out = resize(st, size)
            ledger._resized(st)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        super().__exit__(*exc)  # type: ignore[no-untyped-call]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.prim.device.default:  # the most frequent op by far, and no tensor
            return func(*args)
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor runs its local ops, which come back here
        if func is torch.ops.aten._local_scalar_dense.default:
            return 0  # see the class docstring
        if _fills_only(func):  # nothing to compute on fake tensors, nothing allocated
            written = [a for a, arg in zip(args, func._schema.arguments) if arg.alias_info is not None]
            written += [v for k, v in (kwargs or {}).items() if k in _written(func)]
            return written[0] if len(func._schema.returns) == 1 else None
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._see(t.untyped_storage())
        return out


def _written(func: Any) -> set[str]:
    return {a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write}


@functools.cache
def _fills_only(func: Any) -> bool:
    """Whether ``func`` only writes values into tensors it is given, and returns just those: an in-place or ``out=``
    op that changes neither a shape (``inplace_view`` ops do) nor a storage (``resize_``, ``set_``)."""
    if not func._schema.is_mutable or torch.Tag.inplace_view in func.tags or func._schema.name in _STORAGE_OPS:
        return False
    returns = func._schema.returns
    return bool(_written(func)) and all(r.alias_info is not None and r.alias_info.is_write for r in returns)


_STORAGE_OPS = {"aten::resize_", "aten::resize_as_", "aten::set_", "aten::_resize_output_"}


# -- the stand-ins for the modules' forward ---------------------------------------------------------------------------


@dataclass
class Activations:
    """The activations of one ``fully_shard`` call's modules, in bytes (see ``activations.py``): ``kept`` from the end
    of its forward to its post-backward, ``rest`` (the root: embedding, head, loss) until its backward starts, and
    ``rebuilt`` under activation checkpointing, from the start of its backward to its post-backward."""

    kept: int = 0
    rest: int = 0
    rebuilt: int = 0
    held: list[torch.Tensor] = field(default_factory=list)  # while alive: [kept, rest] then [kept, rebuilt]


class _Use(torch.autograd.Function):
    """Parameters used by a module: identity on ``h``; backward gives each parameter a gradient of its own shape and
    dtype, as autograd does (all of a module's exist by its post-backward)."""

    @staticmethod
    def forward(ctx: Any, ledger: Ledger, state: FSDPState, h: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.ledger, ctx.state, ctx.specs = ledger, state, [(p.shape, p.dtype) for p in params]
        return h.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        with ctx.ledger.tagged("grad", f"gradients of {_label(ctx.state)}"):
            needed = ctx.needs_input_grad[3:]
            grads = [torch.empty(s, dtype=d) if need else None for (s, d), need in zip(ctx.specs, needed)]
        return (None, None, grad, *grads)


class _Keep(torch.autograd.Function):
    """The end of a call's forward: its activations appear; its backward starts by rebuilding them (activation
    checkpointing) and by letting the root's ``rest`` go (the loss and the head are differentiated first)."""

    @staticmethod
    def forward(ctx: Any, ledger: Ledger, state: FSDPState, acts: Activations, h: torch.Tensor) -> torch.Tensor:
        ctx.ledger, ctx.state, ctx.acts = ledger, state, acts
        with ledger.tagged("act", f"activations of {_label(state)}"):
            acts.held = [torch.empty(n, dtype=torch.uint8) for n in (acts.kept, acts.rest)]
        return h.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        acts = ctx.acts
        with ctx.ledger.tagged("act", f"recompute of {_label(ctx.state)}"):
            acts.held = [acts.held[0], torch.empty(acts.rebuilt, dtype=torch.uint8)]
        return None, None, None, grad


class _Drop(torch.autograd.Function):
    """The start of a call's forward: in backward, where its post-backward follows, its activations go."""

    @staticmethod
    def forward(ctx: Any, acts: Activations, h: torch.Tensor) -> torch.Tensor:
        ctx.acts = acts
        return h.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        ctx.acts.held = []
        return None, grad


def _stretches(module: nn.Module) -> list[nn.Module | list[tuple[nn.Module, str]]]:
    """What ``module``'s forward runs, in registration order: each sharded submodule (a call of its own) and, between
    them, the (module, name) registrations of the parameters it uses itself, children before a module's own."""
    items: list[nn.Module | list[tuple[nn.Module, str]]] = []
    seen: set[int] = set()

    def visit(m: nn.Module, top: bool) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        if not top and getattr(m, STATE_ATTR, None) is not None:
            items.append(m)
            return
        for child in m._modules.values():
            if child is not None:
                visit(child, False)
        own = [(m, name) for name, p in m._parameters.items() if p is not None]
        if own and items and isinstance(items[-1], list):
            items[-1].extend(own)
        elif own:
            items.append(own)

    visit(module, True)
    return items


def _label(state: FSDPState) -> str:
    """A call's name in the step (its group's label, as the runtime names it after lazy init)."""
    return state.group.label if state.group is not None else type(state.modules[0]).__name__.removeprefix("FSDP")


def _stand_in(module: nn.Module, state: FSDPState, ledger: Ledger,
              acts: Activations | None) -> Callable[..., torch.Tensor]:
    """``module``'s forward, as far as memory goes: its sharded children called and its own parameters used, in
    registration order, between the start and the end of the call's activations."""
    items = _stretches(module)

    def forward(h: torch.Tensor) -> torch.Tensor:
        dropped = acts is None
        for item in items:
            if not dropped and h.requires_grad:
                h, dropped = _Drop.apply(acts, h), True  # type: ignore[no-untyped-call]
            if isinstance(item, nn.Module):
                h = item(h)
            else:
                params = [m._parameters[name] for m, name in item]  # the unsharded ones, while the group is gathered
                h = _Use.apply(ledger, state, h, *params)  # type: ignore[no-untyped-call]
        if acts is not None:
            h = _Keep.apply(ledger, state, acts, h)  # type: ignore[no-untyped-call]
        return h

    return forward


# -- the step ---------------------------------------------------------------------------------------------------------


@dataclass
class Step:
    """What the measured step did on this rank: the ledger's rows and the live bytes before it, the collectives
    (``comm.CollectiveEvent``, in the order they completed) and the states of the model's ``fully_shard`` calls."""

    rows: list[list[Any]]
    start: dict[str, int]
    collectives: list[comm.CollectiveEvent]
    states: list[FSDPState]
    ledger: Ledger


def measure_step(model: nn.Module, *, streams: bool, activations: dict[FSDPState, Activations],
                 optimizer_step: Callable[[Ledger], None]) -> Step:
    """Materialise ``model`` (sharded on the meta device, in a ``fake_world``) as fake tensors and run two training
    steps of it, the second measured; ``optimizer_step`` adds the optimizer's temporaries to the ledger after that
    step's backward. ``streams``: run as on a device with streams (``NoStreams``)."""
    states = list({id(s): s for m in model.modules() if (s := getattr(m, STATE_ATTR, None)) is not None}.values())
    ledger = Ledger()
    events: list[comm.CollectiveEvent] = []
    with FakeTensorMode(allow_non_fake_inputs=True), ledger:
        model.to_empty(device="cpu")
        shared = Streams(torch.device("cpu"), NoStreams()) if streams else None
        for state in states:
            state.shared_streams = shared
            for module in state.modules:  # a call of several modules: its activations are the first one's
                first = activations.get(state) if module is state.modules[0] else None
                module.forward = _stand_in(module, state, ledger, first)

        def forward_backward() -> None:
            out = model(torch.zeros(1))
            if out.requires_grad:
                out.sum().backward()

        forward_backward()  # the prefetch order, buffers kept after backward: from now on as in every later step
        for acts in activations.values():
            acts.held = []  # a call whose activations no node of its own backward let go
        for state in states:
            for p in state.group.params if state.group is not None else ():
                p.sharded_param.grad = None  # optimizer.zero_grad()
        start = dict(ledger.live)
        ledger.recording = True
        comm.add_observer(events.append)
        try:
            forward_backward()
            optimizer_step(ledger)
        finally:
            comm.remove_observer(events.append)
            ledger.recording = False
    return Step(ledger.rows, start, events, states, ledger)
