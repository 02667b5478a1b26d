"""The memory planner: per-rank bytes and communication of a fully_shard setup, from shapes alone.

``plan()`` builds the model on the meta device (nothing is allocated), groups its
parameters the way ``fully_shard`` would (one group per wrapped module, plus the root),
lays each parameter out with fully_shard's padding rules (dim 0, ``torch.chunk``
semantics, a padded per-rank slot of ``ceil(rows / N) * row_numel`` elements) and then
replays one steady-state training step (forward, backward, optimizer step) buffer by
buffer, mirroring what ``state.py``, ``group.py`` and ``comm.py`` allocate and free:

* forward: each group's all-gather (input: its padded slots; output: N times that) is
  issued one group ahead (implicit prefetch), the unsharded parameters are allocated when
  it is waited, and freed after the group's forward unless it keeps them
  (``reshard_after_forward``; the root keeps its parameters by default);
* backward: groups run in reverse, each prefetching the one before it; a group's
  unsharded gradients (compute dtype) live until its post-backward, which packs them into
  the reduce-scatter input (N times the padded slots, cast to the reduce dtype on the way),
  frees the unsharded parameters, and only then finishes the *previous* group's
  reduce-scatter: one group's reduction, with its gradients, stays in flight;
* the sharded gradients are views of the reduce-scatter output when its dtype is the
  parameter's (padded slots), else copies (this rank's rows);
* optimizer step: AdamW/Adam keep two states per parameter in its dtype, SGD with momentum
  one; a foreach step adds one temporary per parameter (``exp_avg_sq.sqrt()``), a
  per-tensor step two of the largest.

On a device with streams (CUDA and alike) the last waited all-gather's buffers stay
referenced until the next all-gather is issued (``streams.py``); ``device_type="cpu"``
models the CPU, where they are dropped at once. Activations are not modelled: add them.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence, Union

import torch
import torch.nn as nn

from ..policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ..streams import accelerator_type, has_streams
from . import llama

__all__ = ["plan", "Plan", "GroupPlan", "shard_layout", "OPTIMIZERS", "load_model"]

WrapSpec = Union[type, Iterable[type], Callable[[nn.Module], bool], None]

# optimizer name -> states per parameter (each shaped and typed like the parameter)
OPTIMIZERS: dict[str, int] = {"adamw": 2, "adam": 2, "sgd": 0, "sgd-momentum": 1, "none": 0}


def shard_layout(shape: Sequence[int], world: int, rank: int) -> tuple[int, int]:
    """``(local_numel, slot_numel)`` of a parameter of ``shape`` on ``rank`` of ``world``.

    fully_shard's dim-0 layout: ``c = ceil(rows / world)`` rows per slot; rank ``r`` holds
    rows ``[r*c, min((r+1)*c, rows))`` (the last ranks may hold fewer, or none) and every
    rank's slot in the flat collective buffers is ``c`` rows.
    """
    if len(shape) == 0:
        raise ValueError("fully_shard cannot shard a scalar parameter: give it shape (1,)")
    rows, row_numel = shape[0], math.prod(shape[1:])
    chunk = math.ceil(rows / world)
    start = min(rank * chunk, rows)
    return (min(start + chunk, rows) - start) * row_numel, chunk * row_numel


# -- the result -----------------------------------------------------------------------------


@dataclass
class GroupPlan:
    """One ``fully_shard`` call's parameters, per rank. Byte counts are per call of each
    collective (``all_gathers`` per step: 1, or 2 when resharded after forward)."""

    name: str  # the wrapped module's name; "(root)" for the root's own parameters
    tensors: int  # parameter tensors in the group
    numel: int  # parameter elements (unsharded, unpadded)
    sharded_bytes: int  # this rank's rows of the parameters, in their own dtype
    grad_bytes: int  # sharded gradients as stored (views of padded slots, or copies)
    optimizer_bytes: int  # optimizer state of this rank's rows
    unsharded_bytes: int  # padded unsharded parameters (N slots), all-gather dtype
    unsharded_grad_bytes: int  # full gradients autograd computes, compute dtype
    all_gather_input_bytes: int
    all_gather_output_bytes: int
    reduce_scatter_input_bytes: int
    reduce_scatter_output_bytes: int
    all_reduce_bytes: int  # HSDP, across replicas
    reshard_after_forward: Union[bool, int]
    all_gathers: int  # per step


@dataclass
class Plan:
    """Per-rank memory and communication of one training step under fully_shard.

    Bytes are tensor bytes (what the caching allocator is asked for, not what it reserves)
    on ``rank``; activations are left out. ``peak_bytes`` is the most device memory live at
    once during the step (sharded state, in-flight parameters and gradients, optimizer
    temporaries) and ``peak_at`` says when. ``str(plan)`` is a readable table;
    ``plan.to_json()`` has every field.
    """

    model: str
    mesh_shape: tuple[int, ...]
    rank: int
    shard_size: int
    replicate_size: int
    param_dtype: str | None  # MixedPrecisionPolicy.param_dtype (None: the parameters' own)
    reduce_dtype: str | None
    storage_dtypes: list[str]  # dtypes of the sharded parameters
    optimizer: str
    offload: bool
    reshard_after_forward: Union[bool, int, None]
    device_type: str
    num_params: int
    groups: list[GroupPlan]
    # sharded state, per rank
    sharded_param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    buffer_bytes: int  # module buffers, replicated on every rank
    device_state_bytes: int  # what of the above lives on the device
    host_bytes: int  # what of it lives in host memory (CPU offload)
    # transients, per rank, on the device
    peak_unsharded_param_bytes: int  # unsharded parameters + all-gather buffers
    peak_unsharded_grad_bytes: int  # unsharded gradients + reduce-scatter buffers
    optimizer_step_bytes: int  # temporaries of optimizer.step()
    peak_bytes: int
    peak_at: str
    # communication per step, per rank (buffer sizes summed over calls)
    all_gathers: int
    all_gather_input_bytes: int
    all_gather_output_bytes: int
    reduce_scatters: int
    reduce_scatter_input_bytes: int
    reduce_scatter_output_bytes: int
    all_reduces: int
    all_reduce_bytes: int
    send_bytes: int  # bytes this rank sends per step with ring algorithms
    notes: list[str] = field(default_factory=list)
    # device bytes over the replayed step, after every allocation and free:
    # [phase, sharded state, unsharded params, unsharded grads, optimizer temporaries]
    memory_trace: list[list[Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def __str__(self) -> str:
        return _format(self)


# -- building the groups ----------------------------------------------------------------------


@dataclass
class _Param:
    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    unsharded_dtype: torch.dtype
    reduce_dtype: torch.dtype
    local: int  # elements on this rank
    slot: int  # padded per-rank slot, elements


@dataclass
class _Node:
    """One fully_shard call (an FSDPState): its module, its group and the calls nested in it."""

    name: str
    params: list[_Param]
    children: list[_Node]
    reshard: Union[bool, int]  # resolved reshard_after_forward
    # sizes, filled by _size
    ag_in: int = 0
    unsharded: int = 0
    ugrad: list[tuple[int, int]] = field(default_factory=list)  # per param: (compute, reduce) bytes
    rs_in: int = 0
    grad_view: int = 0  # reduce-scatter output kept as the sharded grads' storage
    grad_copy: int = 0  # sharded grads copied out of it (this rank's rows)
    sharded: int = 0
    optim: int = 0


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).replace("torch.", "")


def load_model(spec: Union[nn.Module, Callable[[], nn.Module], str]) -> tuple[nn.Module, str]:
    """The meta-device model for ``spec`` and a label: a model already on meta, a constructor
    (called under ``torch.device("meta")``), a preset name (``"llama3-8b"``) or
    ``"package.module:Constructor"``."""
    if isinstance(spec, nn.Module):
        not_meta = [n for n, p in spec.named_parameters() if not p.is_meta]
        if not_meta:
            raise ValueError(
                f"plan() never allocates the model, but parameter {not_meta[0]!r} of "
                f"{type(spec).__name__} is on {spec.get_parameter(not_meta[0]).device}: build it "
                "under `with torch.device('meta'):`, or pass its constructor instead"
            )
        return spec, type(spec).__name__
    label: str
    if isinstance(spec, str):
        label = spec
        if spec in llama.PRESETS:
            name = spec

            def ctor() -> nn.Module:
                return llama.preset(name)

        elif ":" in spec:
            module_name, _, attr = spec.partition(":")
            try:
                ctor = getattr(importlib.import_module(module_name), attr)
            except (ImportError, AttributeError) as e:
                raise ValueError(f"cannot load model constructor {spec!r}: {e}") from e
        else:
            raise ValueError(
                f"unknown model {spec!r}: use a preset ({', '.join(llama.PRESETS)}) or "
                "'package.module:Constructor'"
            )
    elif callable(spec):
        ctor, label = spec, getattr(spec, "__qualname__", getattr(spec, "__name__", repr(spec)))
    else:
        raise ValueError(f"plan() expects a model, a constructor or a model name, got {type(spec).__name__}")
    with torch.device("meta"):
        model = ctor()
    if not isinstance(model, nn.Module):
        raise ValueError(f"the model constructor {label} returned a {type(model).__name__}, not an nn.Module")
    return load_model(model)[0], label


def _wrapped_modules(model: nn.Module, wrap: WrapSpec) -> set[int]:
    """ids of the modules that get their own fully_shard call (the root aside)."""
    chosen: list[nn.Module] = []
    if wrap is None:  # default: the blocks, i.e. children of any ModuleList named "layers"
        for name, m in model.named_modules():
            if isinstance(m, nn.ModuleList) and name.rpartition(".")[2] == "layers":
                chosen.extend(m.children())
    else:
        if isinstance(wrap, type):
            classes: tuple[type, ...] | None = (wrap,)
        elif callable(wrap):
            classes = None
        else:
            classes = tuple(wrap)
            if not all(isinstance(c, type) for c in classes):
                raise ValueError("plan(): wrap must be a module class, a set of them, or a callable(module) -> bool")
        for m in model.modules():
            if m is model:
                continue
            if (isinstance(m, classes) if classes is not None else wrap(m)):  # type: ignore[operator]
                chosen.append(m)
    for m in chosen:
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            raise ValueError(
                f"plan(): wrap selects a {type(m).__name__}, which fully_shard cannot shard (it has "
                "no forward); select its members instead"
            )
    return {id(m) for m in chosen}


def _build_nodes(
    model: nn.Module,
    wrapped: set[int],
    shard: int,
    rank: int,
    mp: MixedPrecisionPolicy,
    reshard_after_forward: Union[bool, int, None],
) -> _Node:
    """The tree of fully_shard calls, each with the parameters it would own (calls made
    bottom-up, as fully_shard requires: a call owns what no call below it owns)."""
    names = {id(m): n for n, m in model.named_modules()}
    owner: dict[int, str] = {}  # id(param) -> the group that owns it

    def collect(top: nn.Module) -> list[_Param]:
        found: list[_Param] = []
        seen_params: set[int] = set()
        visited: set[int] = set()
        group = names[id(top)] or "(root)"

        def visit(module: nn.Module, prefix: str, is_top: bool) -> None:
            if id(module) in visited:
                return
            visited.add(id(module))
            if not is_top and id(module) in wrapped:
                return  # owned by an inner call
            for pname, p in module._parameters.items():
                if p is None or id(p) in seen_params:
                    continue
                fqn = prefix + pname
                if id(p) in owner:
                    raise ValueError(
                        f"plan(): parameter {fqn!r} is shared with the group of {owner[id(p)]}, "
                        "which fully_shard refuses (tied parameters must be in one group): shard "
                        "their common parent instead, or leave one of the modules out of wrap"
                    )
                seen_params.add(id(p))
                owner[id(p)] = group
                if p.dim() == 0:
                    raise ValueError(f"plan(): fully_shard cannot shard the scalar parameter {fqn!r}")
                unsharded = (mp.param_dtype if p.dtype.is_floating_point else None) or p.dtype
                local, slot = shard_layout(tuple(p.shape), shard, rank)
                found.append(
                    _Param(fqn, tuple(p.shape), p.dtype, p.requires_grad, unsharded,
                           mp.reduce_dtype or unsharded, local, slot)
                )
            for cname, child in module._modules.items():
                if child is not None:
                    visit(child, f"{prefix}{cname}.", False)

        visit(top, f"{names[id(top)]}." if names[id(top)] else "", True)
        return found

    def build(module: nn.Module, is_root: bool) -> _Node:
        # children first (bottom-up), then this call's own parameters
        children: list[_Node] = []

        def find(m: nn.Module) -> None:
            for child in m.children():
                if id(child) in wrapped:
                    children.append(build(child, False))
                else:
                    find(child)

        find(module)
        params = collect(module)
        if reshard_after_forward is None:
            reshard: Union[bool, int] = not is_root
        else:
            reshard = reshard_after_forward
        return _Node(names[id(module)] or "(root)", params, children, reshard)

    return build(model, True)


def _size(node: _Node, shard: int, device_grads: bool) -> None:
    """Byte sizes of one group's buffers (see group.py / comm.py / param.py)."""
    node.ag_in = sum(p.slot * _itemsize(p.unsharded_dtype) for p in node.params)
    node.unsharded = shard * node.ag_in
    trainable = [p for p in node.params if p.requires_grad]
    node.ugrad = [
        (
            math.prod(p.shape) * _itemsize(p.unsharded_dtype),
            math.prod(p.shape) * _itemsize(p.reduce_dtype) if p.reduce_dtype != p.unsharded_dtype else 0,
        )
        for p in trainable
    ]
    node.rs_in = shard * sum(p.slot * _itemsize(p.reduce_dtype) for p in trainable)
    # one reduce-scatter output per reduce dtype; kept alive if any gradient is a view of it
    buckets: dict[torch.dtype, list[_Param]] = {}
    for p in trainable:
        buckets.setdefault(p.reduce_dtype, []).append(p)
    node.grad_view = node.grad_copy = 0
    for dtype, bucket in buckets.items():
        views = device_grads and any(p.dtype == dtype for p in bucket)
        if views:
            node.grad_view += sum(p.slot for p in bucket) * _itemsize(dtype)
        node.grad_copy += sum(p.local * _itemsize(p.dtype) for p in bucket if not (device_grads and p.dtype == dtype))
    node.sharded = sum(p.local * _itemsize(p.dtype) for p in node.params)


def _walk(node: _Node) -> list[_Node]:
    """Pre-order: the forward order of the calls (modules run in registration order)."""
    out = [node]
    for c in node.children:
        out += _walk(c)
    return out


def _post_order(node: _Node) -> list[_Node]:
    out: list[_Node] = []
    for c in node.children:
        out += _post_order(c)
    return out + [node]


# -- replaying one step ----------------------------------------------------------------------------


class _Timeline:
    """Live device bytes by kind; peaks are checked at every allocation."""

    KINDS = ("param", "grad", "state", "optim")

    def __init__(self, base: int) -> None:
        self.live: dict[tuple[str, str, str], int] = {}
        self.by_kind = {k: 0 for k in self.KINDS}
        self.base = base
        self.peak = base
        self.peak_at = "start of step"
        self.kind_peak = {k: 0 for k in self.KINDS}
        self.where = ""
        # after every allocation and free: [phase, sharded state, params, grads, optimizer temps]
        self.trace: list[list[Any]] = []

    def _record(self) -> None:
        k = self.by_kind
        self.trace.append([self.where, self.base + k["state"], k["param"], k["grad"], k["optim"]])

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

    def free(self, kind: str, what: str, node: str, nbytes: int | None = None) -> None:
        key = (kind, what, node)
        have = self.live.get(key, 0)
        n = have if nbytes is None else min(nbytes, have)
        if n:
            self.by_kind[kind] -= n
            if have - n:
                self.live[key] = have - n
            else:
                del self.live[key]
            self._record()


class _Replay:
    """One steady-state step (prefetch order known from the previous one)."""

    SHARDED, POST_FORWARD, UNSHARDING, UNSHARDED = range(4)

    def __init__(self, root: _Node, shard: int, streams: bool, timeline: _Timeline, device_grads: bool) -> None:
        self.root, self.shard, self.streams, self.t = root, shard, streams, timeline
        self.device_grads = device_grads
        self.forward_order = _walk(root)
        self.post_forward_order = _post_order(root)
        self.state = {id(n): self.SHARDED for n in self.forward_order}
        self.needs_post_backward = {id(n): False for n in self.forward_order}
        self.held: _Node | None = None  # streams: the last waited all-gather's buffers
        self.pending: _Node | None = None  # the reduce-scatter in flight

    # unshard / reshard (group.py)
    def _release_held(self) -> None:
        if self.held is not None:
            self.t.free("param", "all-gather", self.held.name)
            self.held = None

    def issue(self, n: _Node) -> None:
        state = self.state[id(n)]
        if not n.params or state not in (self.SHARDED, self.POST_FORWARD):
            return
        self._release_held()
        if state == self.SHARDED:
            self.t.alloc("param", "all-gather", n.name, n.ag_in)
        else:  # from the k-rank slices kept after forward
            assert isinstance(n.reshard, int)
            self.t.alloc("param", "all-gather", n.name, n.unsharded // n.reshard)
            self.t.free("param", "slice", n.name)
        self.t.alloc("param", "all-gather", n.name, n.unsharded)
        self.state[id(n)] = self.UNSHARDING

    def wait(self, n: _Node) -> None:
        if self.state[id(n)] != self.UNSHARDING:
            return
        self.t.alloc("param", "unsharded", n.name, n.unsharded)
        if self.streams:
            self._release_held()
            self.held = n
        else:
            self.t.free("param", "all-gather", n.name)
        self.state[id(n)] = self.UNSHARDED

    def reshard(self, n: _Node, post_forward: bool) -> None:
        keep = post_forward and type(n.reshard) is int and self.state[id(n)] == self.UNSHARDED
        if self.state[id(n)] == self.UNSHARDED:
            if keep:
                self.t.alloc("param", "slice", n.name, n.unsharded // int(n.reshard))
            self.t.free("param", "unsharded", n.name)
        self.state[id(n)] = self.POST_FORWARD if keep else self.SHARDED

    def is_unsharded(self, n: _Node) -> bool:
        return self.state[id(n)] in (self.UNSHARDING, self.UNSHARDED)

    # forward (state.py pre_forward / post_forward)
    def forward(self, n: _Node) -> None:
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
        if n.reshard:
            self.reshard(n, post_forward=type(n.reshard) is int)

    # backward (pre_backward / post_backward)
    def backward(self, n: _Node) -> None:
        self.t.where = f"backward: all-gather of {n.name}"
        self.issue(n)
        i = self.post_forward_order.index(n)
        if i > 0:
            target = self.post_forward_order[i - 1]
            if target.params and self.needs_post_backward[id(target)] and not self.is_unsharded(target):
                self.issue(target)
        self.wait(n)
        self.t.where = f"backward: gradients of {n.name}"
        for compute, _ in n.ugrad:  # all present by the group's post-backward
            self.t.alloc("grad", "unsharded grad", n.name, compute)
        for c in reversed(n.children):
            self.backward(c)
        self.post_backward(n)

    def post_backward(self, n: _Node) -> None:
        self.t.where = f"backward: reduce-scatter of {n.name}"
        self.needs_post_backward[id(n)] = False
        if n.ugrad:
            # the reduce-scatter input is packed (and cast) straight from the gradients
            self.t.alloc("grad", "reduce-scatter input", n.name, n.rs_in)
            self.t.alloc("grad", "reduce-scatter output", n.name, n.rs_in // self.shard)
        self.reshard(n, post_forward=False)
        if n.ugrad:
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
        for n in self.forward_order:
            self.state[id(n)] = self.SHARDED
        self.forward(self.root)
        self.backward(self.root)
        self.finish_reduce()  # end of backward (is_last_backward)
        for n in self.forward_order:
            if self.state[id(n)] != self.SHARDED:
                self.reshard(n, post_forward=False)


# -- plan() -----------------------------------------------------------------------------------------


def _mesh(mesh_shape: Union[int, Sequence[int]]) -> tuple[int, ...]:
    shape = (mesh_shape,) if isinstance(mesh_shape, int) else tuple(mesh_shape)
    if not 1 <= len(shape) <= 2 or not all(isinstance(s, int) and s >= 1 for s in shape):
        raise ValueError(
            f"mesh_shape must be (N,) for FSDP or (R, N) for HSDP with positive sizes, got {mesh_shape!r}"
        )
    return shape


def plan(
    model_or_constructor: Union[nn.Module, Callable[[], nn.Module], str],
    mesh_shape: Union[int, Sequence[int]],
    *,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    optimizer: str = "adamw",
    reshard_after_forward: Union[bool, int, None] = None,
    wrap: WrapSpec = None,
    rank: int = 0,
    device_type: str = accelerator_type(),
    foreach: bool | None = None,
) -> Plan:
    """Per-rank memory and communication of training a model under fully_shard, without
    allocating it.

    The model is built on the meta device; each module chosen by ``wrap`` gets its own
    ``fully_shard`` call (made bottom-up), and the root one more for the parameters left.
    Parameters are laid out as fully_shard does (dim 0, ``torch.chunk`` rows, padded
    slots), and one steady-state step is replayed buffer by buffer to find the peak.

    Args:
        model_or_constructor: a model already on the meta device, a callable building one
            (called under ``torch.device("meta")``), a preset name (``"llama3-8b"``,
            ``"llama3-70b"``, ``"llama3-405b"``) or ``"package.module:Constructor"``.
        mesh_shape: ``N`` or ``(N,)`` for FSDP over N ranks, ``(R, N)`` for HSDP
            (replicate over R, shard over N).
        mp_policy: as given to fully_shard: ``param_dtype`` for the all-gather and
            compute, ``reduce_dtype`` for the reduce-scatter.
        offload_policy: :class:`CPUOffloadPolicy` puts the sharded parameters, gradients
            and optimizer state in host memory (no effect with ``device_type="cpu"``).
        optimizer: ``"adamw"`` or ``"adam"`` (two states per parameter), ``"sgd"`` (none),
            ``"sgd-momentum"`` (one), ``"none"``.
        reshard_after_forward: as given to every fully_shard call (``None``: True except
            the root; an int k keeps a 1/k slice for a k-rank backward all-gather).
        wrap: which modules get their own fully_shard call: a module class, a set of
            classes, or a callable ``(module) -> bool``. Default: the children of every
            ``nn.ModuleList`` named ``layers`` (transformer blocks).
        rank: the rank to plan for; rank 0 holds the most (the last ranks may hold fewer
            rows of a parameter whose dim 0 the shard size does not divide).
        device_type: a device type with streams (default: this machine's accelerator, else
            CUDA's) or ``"cpu"``.
        foreach: whether the optimizer step is a foreach one (default: as torch chooses,
            foreach on an accelerator, per tensor on the CPU).

    Returns:
        A :class:`Plan`; ``print(plan)`` shows a table, ``plan.to_json()`` every field.

    Example::

        >>> p = plan("llama3-8b", 64, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        >>> p.peak_bytes / 2**30  # GiB per rank, before activations
    """
    shape = _mesh(mesh_shape)
    replicate, shard = (1, shape[0]) if len(shape) == 1 else shape
    if not 0 <= rank < shard:
        raise ValueError(f"rank must index the shard dim of the mesh (0..{shard - 1}), got {rank}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {', '.join(OPTIMIZERS)}")
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise ValueError(f"mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    if not isinstance(offload_policy, OffloadPolicy):
        raise ValueError(f"offload_policy must be an OffloadPolicy, got {type(offload_policy).__name__}")
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, int):
        raise ValueError(f"reshard_after_forward must be a bool, an int or None, got {reshard_after_forward!r}")
    if type(reshard_after_forward) is int:
        if not (1 <= reshard_after_forward <= shard and shard % reshard_after_forward == 0):
            raise ValueError(
                f"reshard_after_forward={reshard_after_forward} must be a divisor of the shard size "
                f"{shard} ({shard} means True, 1 means False); or pass True or False"
            )
        if reshard_after_forward in (1, shard):  # as fully_shard reads them
            reshard_after_forward = reshard_after_forward != 1
    notes: list[str] = []
    offload = isinstance(offload_policy, CPUOffloadPolicy)
    on_device = not offload or device_type == "cpu"  # where the sharded state lives
    if offload and device_type == "cpu":
        notes.append("CPU offload changes nothing on a CPU mesh: everything is host memory")
    streams = has_streams(torch.device(device_type))
    if foreach is None:
        foreach = streams

    model, label = load_model(model_or_constructor)
    root = _build_nodes(model, _wrapped_modules(model, wrap), shard, rank, mp_policy, reshard_after_forward)
    nodes = _walk(root)
    states = OPTIMIZERS[optimizer]
    for n in nodes:
        _size(n, shard, device_grads=on_device)
        n.optim = states * sum(p.local * _itemsize(p.dtype) for p in n.params if p.requires_grad)

    params = [p for n in nodes for p in n.params]
    sharded = sum(n.sharded for n in nodes)
    grads = sum(n.grad_view + n.grad_copy for n in nodes)
    optim = sum(n.optim for n in nodes)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    trainable = [p for p in params if p.requires_grad]
    if states == 2 and foreach:  # Adam(W): exp_avg_sq.sqrt() for every parameter at once
        step_tmp = sum(p.local * _itemsize(p.dtype) for p in trainable)
    elif states == 2:  # per tensor: sqrt() and its quotient, for one parameter at a time
        step_tmp = 2 * max((p.local * _itemsize(p.dtype) for p in trainable), default=0)
    else:  # SGD updates in place
        step_tmp = 0

    device_state = (sharded + optim if on_device else 0) + buffers
    timeline = _Timeline(device_state)
    replay = _Replay(root, shard, streams, timeline, on_device)
    replay.step()
    timeline.where = f"optimizer step ({optimizer}{', foreach' if foreach else ''})"
    if on_device:
        timeline.alloc("optim", "step temporaries", "", step_tmp)
        timeline.free("optim", "step temporaries", "")

    # communication per step
    counts = {"ag": 0, "rs": 0, "ar": 0}
    ag_in = ag_out = rs_in = rs_out = ar = send = 0
    rows: list[GroupPlan] = []
    for n in nodes:
        if not n.params:
            continue
        gathers = [(n.ag_in, shard)]  # (input bytes, ranks) of each all-gather
        if n.reshard is True:  # gathered again for backward
            gathers.append((n.ag_in, shard))
        elif type(n.reshard) is int:  # ... within k ranks, from the 1/k slices
            gathers.append((n.unsharded // n.reshard, n.reshard))
        for inp, ranks in gathers:
            counts["ag"] += 1
            ag_in += inp
            ag_out += n.unsharded
            send += (ranks - 1) * inp
        out = n.rs_in // shard
        if n.ugrad:
            counts["rs"] += 1
            rs_in += n.rs_in
            rs_out += out
            send += (shard - 1) * out
            if replicate > 1:
                counts["ar"] += 1
                ar += out
                send += 2 * (replicate - 1) * out // replicate
        rows.append(
            GroupPlan(
                name=n.name,
                tensors=len(n.params),
                numel=sum(math.prod(p.shape) for p in n.params),
                sharded_bytes=n.sharded,
                grad_bytes=n.grad_view + n.grad_copy,
                optimizer_bytes=n.optim,
                unsharded_bytes=n.unsharded,
                unsharded_grad_bytes=sum(c for c, _ in n.ugrad),
                all_gather_input_bytes=n.ag_in,
                all_gather_output_bytes=n.unsharded,
                reduce_scatter_input_bytes=n.rs_in if n.ugrad else 0,
                reduce_scatter_output_bytes=out if n.ugrad else 0,
                all_reduce_bytes=out if n.ugrad and replicate > 1 else 0,
                reshard_after_forward=n.reshard,
                all_gathers=len(gathers),
            )
        )

    return Plan(
        model=label,
        mesh_shape=shape,
        rank=rank,
        shard_size=shard,
        replicate_size=replicate,
        param_dtype=_dtype_name(mp_policy.param_dtype),
        reduce_dtype=_dtype_name(mp_policy.reduce_dtype),
        storage_dtypes=sorted({str(_dtype_name(p.dtype)) for p in params}),
        optimizer=optimizer,
        offload=offload,
        reshard_after_forward=reshard_after_forward,
        device_type=device_type,
        num_params=sum(math.prod(p.shape) for p in params),
        groups=rows,
        sharded_param_bytes=sharded,
        grad_bytes=grads,
        optimizer_bytes=optim,
        buffer_bytes=buffers,
        device_state_bytes=device_state + (grads if on_device else 0),
        host_bytes=0 if on_device else sharded + grads + optim,
        peak_unsharded_param_bytes=timeline.kind_peak["param"],
        peak_unsharded_grad_bytes=timeline.kind_peak["grad"],
        optimizer_step_bytes=step_tmp,
        peak_bytes=timeline.peak,
        peak_at=timeline.peak_at,
        all_gathers=counts["ag"],
        all_gather_input_bytes=ag_in,
        all_gather_output_bytes=ag_out,
        reduce_scatters=counts["rs"],
        reduce_scatter_input_bytes=rs_in,
        reduce_scatter_output_bytes=rs_out,
        all_reduces=counts["ar"],
        all_reduce_bytes=ar,
        send_bytes=send,
        notes=notes,
        memory_trace=timeline.trace,
    )


# -- the table --------------------------------------------------------------------------------------


def fmt_bytes(n: float) -> str:
    """Binary units: ``512 B``, ``1.50 KiB``, ..., ``2.00 TiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError  # unreachable


def fmt_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))


_ROW_FIELDS = (
    "tensors", "numel", "sharded_bytes", "grad_bytes", "optimizer_bytes", "unsharded_bytes",
    "all_gather_input_bytes", "all_gather_output_bytes", "reduce_scatter_input_bytes",
    "reduce_scatter_output_bytes", "all_gathers",
)


def _collapse(groups: list[GroupPlan]) -> list[tuple[str, int, GroupPlan]]:
    """Runs of identical groups named ``prefix.<i>`` with consecutive i: one row each."""
    out: list[tuple[str, int, GroupPlan]] = []
    run: list[GroupPlan] = []

    def key(g: GroupPlan) -> tuple[Any, ...]:
        m = re.fullmatch(r"(.*\.)(\d+)", g.name)
        return (m.group(1) if m else None, *(getattr(g, f) for f in _ROW_FIELDS))

    def flush() -> None:
        if not run:
            return
        if len(run) == 1:
            out.append((run[0].name, 1, run[0]))
        else:
            prefix = key(run[0])[0]
            first, last = run[0].name[len(prefix):], run[-1].name[len(prefix):]
            out.append((f"{prefix}{first}-{last}", len(run), run[0]))
        run.clear()

    for g in groups:
        if run:
            k, prev = key(g), key(run[-1])
            same = k == prev and k[0] is not None
            if not (same and int(g.name.rpartition(".")[2]) == int(run[-1].name.rpartition(".")[2]) + 1):
                flush()
        run.append(g)
    flush()
    return out


def _format(p: Plan) -> str:
    kind = "FSDP" if p.replicate_size == 1 else f"HSDP ({p.replicate_size} replicas)"
    mesh = "x".join(str(s) for s in p.mesh_shape)
    raf = p.reshard_after_forward
    raf_text = "None (True; root keeps its parameters)" if raf is None else str(raf)
    storage = "/".join(p.storage_dtypes)
    lines = [
        f"fully_shard memory plan: {p.model} ({fmt_count(p.num_params)} parameters) on mesh {mesh}, "
        f"{kind}, {p.shard_size}-way shard, rank {p.rank}",
        f"  sharded {storage}; all-gather/compute {p.param_dtype or storage}; reduce "
        f"{p.reduce_dtype or p.param_dtype or storage}; optimizer {p.optimizer}; "
        f"reshard_after_forward={raf_text}; offload {'on' if p.offload else 'off'}; device {p.device_type}",
        "",
    ]
    header = ("group", "x", "params", "sharded", "grads", "optim", "unsharded", "AG in", "AG out", "RS in", "RS out", "AGs")
    table: list[tuple[str, ...]] = [header]
    for name, count, g in _collapse(p.groups):
        table.append((
            name, str(count), fmt_count(g.numel), fmt_bytes(g.sharded_bytes), fmt_bytes(g.grad_bytes),
            fmt_bytes(g.optimizer_bytes), fmt_bytes(g.unsharded_bytes), fmt_bytes(g.all_gather_input_bytes),
            fmt_bytes(g.all_gather_output_bytes), fmt_bytes(g.reduce_scatter_input_bytes),
            fmt_bytes(g.reduce_scatter_output_bytes), str(g.all_gathers),
        ))
    table.append((
        "total", str(len(p.groups)), fmt_count(p.num_params), fmt_bytes(p.sharded_param_bytes),
        fmt_bytes(p.grad_bytes), fmt_bytes(p.optimizer_bytes),
        *(fmt_bytes(sum(getattr(g, f) for g in p.groups)) for f in (
            "unsharded_bytes", "all_gather_input_bytes", "all_gather_output_bytes",
            "reduce_scatter_input_bytes", "reduce_scatter_output_bytes")),
        str(p.all_gathers),
    ))
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for i, r in enumerate(table):
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
        if i == 0 or i == len(table) - 2:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("(per group and call: AG = all-gather, RS = reduce-scatter buffers; AGs = all-gathers per step)")
    lines.append("")
    where = "host" if p.host_bytes else "device"
    lines += [
        f"per rank{'' if p.rank == 0 else f' (rank {p.rank})'}:",
        f"  sharded parameters        {fmt_bytes(p.sharded_param_bytes):>12}  {where}",
        f"  gradients                 {fmt_bytes(p.grad_bytes):>12}  {where}",
        f"  optimizer state           {fmt_bytes(p.optimizer_bytes):>12}  {where}",
    ]
    if p.buffer_bytes:
        lines.append(f"  buffers                   {fmt_bytes(p.buffer_bytes):>12}  device")
    lines += [
        f"  sharded state on device   {fmt_bytes(p.device_state_bytes):>12}",
    ]
    if p.host_bytes:
        lines.append(f"  sharded state on host     {fmt_bytes(p.host_bytes):>12}")
    lines += [
        f"  unsharded params (peak)   {fmt_bytes(p.peak_unsharded_param_bytes):>12}  all-gather buffers included",
        f"  unsharded grads (peak)    {fmt_bytes(p.peak_unsharded_grad_bytes):>12}  reduce-scatter buffers included",
        f"  optimizer step temps      {fmt_bytes(p.optimizer_step_bytes):>12}  {where}",
        f"  peak on device            {fmt_bytes(p.peak_bytes):>12}  at {p.peak_at}; plus activations",
        "",
        f"communication per step per rank: {p.all_gathers} all-gathers "
        f"(in {fmt_bytes(p.all_gather_input_bytes)}, out {fmt_bytes(p.all_gather_output_bytes)}), "
        f"{p.reduce_scatters} reduce-scatters (in {fmt_bytes(p.reduce_scatter_input_bytes)}, out "
        f"{fmt_bytes(p.reduce_scatter_output_bytes)})"
        + (f", {p.all_reduces} all-reduces ({fmt_bytes(p.all_reduce_bytes)})" if p.all_reduces else "")
        + f"; sends ~{fmt_bytes(p.send_bytes)} (ring algorithms)",
    ]
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)
