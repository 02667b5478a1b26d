"""The memory planner: per-rank bytes and communication of a fully_shard setup, from shapes alone.

``plan()`` takes a model on the meta device (nothing is allocated) and makes the decisions
fully_shard makes, with fully_shard's own pure functions: which parameters each call owns
(``api.walk_params``, calls made bottom-up), how each is laid out (``param.shard_layout``)
and in which dtypes (``param.param_dtypes``), which options it accepts
(``api.check_options``, ``mesh.reshard_setting``). It sizes each group's
buffers as ``group.py`` and ``comm.py`` allocate them, replays one steady-state step
(``replay.py``, through ``group.next_state``) to find the peak, and adds the optimizer
step: AdamW/Adam keep two states per parameter in its dtype, SGD with momentum one; a
foreach step adds one temporary per parameter (``exp_avg_sq.sqrt()``), a per-tensor step
two of the largest. Given ``batch_size`` and ``seq_len``, the activations of a
``transformers`` Llama-family model are added (``activations.py``: the tensors saved for
backward, per block, with or without activation checkpointing); otherwise they are left
out. The table that ``str(plan)`` prints is made by ``report.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Union

import torch
import torch.nn as nn

from ...api import _as_modules, check_options, walk_params
from ...mesh import reshard_setting
from ...param import ShardLayout, param_dtypes, shard_layout
from ...policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ...streams import accelerator_type, has_streams
from .activations import estimate_activations
from .models import load_model
from .replay import Call, Replay, Timeline, pre_order
from .report import GroupPlan, Plan

__all__ = ["plan", "Plan", "GroupPlan", "OPTIMIZERS"]

WrapSpec = Union[type, Iterable[type], Callable[[nn.Module], bool], None]  # noqa: UP007  # a runtime alias

# optimizer name -> states per parameter (each shaped and typed like the parameter)
OPTIMIZERS: dict[str, int] = {"adamw": 2, "adam": 2, "sgd": 0, "sgd-momentum": 1, "none": 0}


# -- the fully_shard calls, as fully_shard would make them ------------------------------------


@dataclass
class _Param:
    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype  # of the sharded parameter, its gradient and optimizer state
    requires_grad: bool
    unsharded_dtype: torch.dtype  # all-gather and compute
    reduce_dtype: torch.dtype
    layout: ShardLayout


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).replace("torch.", "")


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
            if m is not model and (isinstance(m, classes) if classes is not None else wrap(m)):  # type: ignore[operator]
                chosen.append(m)
    if chosen:
        _as_modules(tuple(chosen))  # what fully_shard refuses to shard (a ModuleList has no forward)
    return {id(m) for m in chosen}


def _build_nodes(model: nn.Module, wrapped: set[int], shard: int, rank: int, mp: MixedPrecisionPolicy,
                 reshard_after_forward: bool | int | None) -> Call:
    """The tree of fully_shard calls, each with the parameters it owns: calls made bottom-up,
    as fully_shard requires, each walking its module as fully_shard does (``walk_params``)."""
    names = {id(m): n for n, m in model.named_modules()}
    owner: dict[int, str] = {}  # id(param) -> the group that owns it

    def build(module: nn.Module, is_root: bool) -> Call:
        children: list[Call] = []

        def find(m: nn.Module) -> None:
            for child in m.children():
                if id(child) in wrapped:
                    children.append(build(child, False))
                else:
                    find(child)

        find(module)  # the inner calls first
        name, prefix = names[id(module)] or "(root)", f"{names[id(module)]}." if names[id(module)] else ""
        params: list[_Param] = []
        for fqn, _, _, p in walk_params((module,), lambda m: id(m) in wrapped):
            if owner.get(id(p)) == name:
                continue  # registered in several places of this group
            if id(p) in owner:
                raise ValueError(
                    f"plan(): parameter {prefix + fqn!r} is shared with the group of {owner[id(p)]}, "
                    "which fully_shard refuses (tied parameters must be in one group): shard "
                    "their common parent instead, or leave one of the modules out of wrap"
                )
            owner[id(p)] = name
            if p.dim() == 0:
                raise ValueError(f"plan(): fully_shard cannot shard the scalar parameter {prefix + fqn!r}")
            unsharded, reduce = param_dtypes(p.dtype, mp)
            params.append(_Param(prefix + fqn, tuple(p.shape), p.dtype, p.requires_grad, unsharded, reduce,
                                 shard_layout(tuple(p.shape), shard, rank)))
        reshard = (not is_root) if reshard_after_forward is None else reshard_after_forward
        return Call(name, params, children, reshard)

    return build(model, True)


def _size(node: Call, shard: int, device_grads: bool) -> None:
    """Byte sizes of one group's buffers (see group.py / comm.py / param.py)."""
    node.ag_in = sum(p.layout.slot_numel * _itemsize(p.unsharded_dtype) for p in node.params)
    node.unsharded = shard * node.ag_in
    trainable = [p for p in node.params if p.requires_grad]
    node.ugrad = [math.prod(p.shape) * _itemsize(p.unsharded_dtype) for p in trainable]
    node.rs_in = shard * sum(p.layout.slot_numel * _itemsize(p.reduce_dtype) for p in trainable)
    # one reduce-scatter output per reduce dtype; kept alive if any gradient is a view of it
    buckets: dict[torch.dtype, list[_Param]] = {}
    for p in trainable:
        buckets.setdefault(p.reduce_dtype, []).append(p)
    node.grad_view = node.grad_copy = 0
    for dtype, bucket in buckets.items():
        if device_grads and any(p.dtype == dtype for p in bucket):
            node.grad_view += sum(p.layout.slot_numel for p in bucket) * _itemsize(dtype)
        node.grad_copy += sum(p.layout.local_numel * _itemsize(p.dtype) for p in bucket
                              if not (device_grads and p.dtype == dtype))
    node.sharded = sum(p.layout.local_numel * _itemsize(p.dtype) for p in node.params)


def _add_activations(model: nn.Module, root: Call, nodes: list[Call], batch_size: int, seq_len: int,
                     mp: MixedPrecisionPolicy, checkpointing: bool) -> int:
    """Give each call the activations its forward keeps (``Call.act``) and, with activation
    checkpointing, rebuilds in its backward (``Call.recompute``); returns one block's bytes.
    A block's activations go to the innermost call that contains it (the root if none), the
    rest of the model's to the root."""
    floats = [p.dtype for p in model.parameters() if p.is_floating_point()]
    compute = mp.param_dtype or (floats[0] if floats else torch.float32)
    est = estimate_activations(model, batch_size, seq_len, compute)
    root.act_rest += est.rest_bytes
    for layer in est.layers:
        owner = max((n for n in nodes if n is root or layer == n.name or layer.startswith(n.name + ".")),
                    key=lambda n: 0 if n is root else len(n.name))
        if checkpointing:
            owner.act += est.block_input_bytes
            owner.recompute = max(owner.recompute, est.block_bytes)  # one block rebuilt at a time
        else:
            owner.act += est.block_bytes
    return est.block_bytes


# -- plan() -----------------------------------------------------------------------------------------


def _mesh(mesh_shape: int | Sequence[int]) -> tuple[int, ...]:
    shape = (mesh_shape,) if isinstance(mesh_shape, int) else tuple(mesh_shape)
    if not 1 <= len(shape) <= 2 or not all(isinstance(s, int) and s >= 1 for s in shape):
        raise ValueError(
            f"mesh_shape must be (N,) for FSDP or (R, N) for HSDP with positive sizes, got {mesh_shape!r}"
        )
    return shape


def plan(
    model_or_constructor: nn.Module | Callable[[], nn.Module] | str,
    mesh_shape: int | Sequence[int],
    *,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    optimizer: str = "adamw",
    reshard_after_forward: bool | int | None = None,
    wrap: WrapSpec = None,
    rank: int = 0,
    device_type: str = accelerator_type(),
    foreach: bool | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    activation_checkpointing: bool = False,
) -> Plan:
    """Per-rank memory and communication of training a model under fully_shard, without
    allocating it.

    The model is on the meta device; each module chosen by ``wrap`` gets its own
    ``fully_shard`` call (made bottom-up), and the root one more for the parameters left.
    Ownership, layout, dtypes and option checks are fully_shard's own functions; one
    steady-state step is replayed buffer by buffer to find the peak.

    Args:
        model_or_constructor: a model already on the meta device, a callable building one
            (called under ``torch.device("meta")``), ``"package.module:Constructor"``, or,
            with ``transformers`` installed, a preset name (``"llama3-8b"``, ``"llama3-70b"``,
            ``"llama3-405b"``) or a Hugging Face ``config.json`` path.
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
        batch_size, seq_len: sequences per rank per step and tokens per sequence; given
            both, the activations of a ``transformers`` Llama-family model (what autograd
            saves for backward, per block, in the compute dtype) join the replay: kept
            through forward, freed through backward. Left out: activations not counted.
        activation_checkpointing: every block checkpointed (e.g. transformers'
            ``gradient_checkpointing_enable()``): a block keeps only its input through
            forward and rebuilds its activations during its own backward.

    Returns:
        A :class:`Plan`; ``print(plan)`` shows a table, ``plan.to_json()`` every field.

    Example::

        >>> p = plan("llama3-8b", 64, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        >>> p.peak_bytes / 2**30  # GiB per rank, before activations
        >>> p = plan("llama3-8b", 64, batch_size=1, seq_len=8192, activation_checkpointing=True)
        >>> p.activation_bytes, p.peak_activation_bytes  # kept at the end of forward; most at once
    """
    shape = _mesh(mesh_shape)
    replicate, shard = (1, shape[0]) if len(shape) == 1 else shape
    if not 0 <= rank < shard:
        raise ValueError(f"rank must index the shard dim of the mesh (0..{shard - 1}), got {rank}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {', '.join(OPTIMIZERS)}")
    check_options(mp_policy, offload_policy, reshard_after_forward)
    reshard_after_forward = reshard_setting(reshard_after_forward, shard)
    notes: list[str] = []
    offload = isinstance(offload_policy, CPUOffloadPolicy)
    on_device = not offload or device_type == "cpu"  # where the sharded state lives
    if offload and device_type == "cpu":
        notes.append("CPU offload changes nothing on a CPU mesh: everything is host memory")
    if foreach is None:
        foreach = has_streams(torch.device(device_type))

    if (batch_size is None) != (seq_len is None):
        raise ValueError("batch_size and seq_len go together: give both to count activations, or neither")
    if activation_checkpointing and batch_size is None:
        raise ValueError("activation_checkpointing needs batch_size and seq_len (activations are not counted without them)")

    model, label = load_model(model_or_constructor)
    root = _build_nodes(model, _wrapped_modules(model, wrap), shard, rank, mp_policy, reshard_after_forward)
    nodes = pre_order(root)
    block_act = 0
    if batch_size is not None and seq_len is not None:
        block_act = _add_activations(model, root, nodes, batch_size, seq_len, mp_policy, activation_checkpointing)
    states = OPTIMIZERS[optimizer]
    for n in nodes:
        _size(n, shard, device_grads=on_device)
        n.optim = states * sum(p.layout.local_numel * _itemsize(p.dtype) for p in n.params if p.requires_grad)

    params = [p for n in nodes for p in n.params]
    sharded = sum(n.sharded for n in nodes)
    grads = sum(n.grad_view + n.grad_copy for n in nodes)
    optim = sum(n.optim for n in nodes)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    local_bytes = [p.layout.local_numel * _itemsize(p.dtype) for p in params if p.requires_grad]
    if states == 2 and foreach:  # Adam(W): exp_avg_sq.sqrt() for every parameter at once
        step_tmp = sum(local_bytes)
    elif states == 2:  # per tensor: sqrt() and its quotient, for one parameter at a time
        step_tmp = 2 * max(local_bytes, default=0)
    else:  # SGD updates in place
        step_tmp = 0

    device_state = (sharded + optim if on_device else 0) + buffers
    timeline = Timeline(device_state)
    Replay(root, shard, has_streams(torch.device(device_type)), timeline, on_device).step()
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
        rows.append(GroupPlan(
            name=n.name, tensors=len(n.params), numel=sum(math.prod(p.shape) for p in n.params),
            sharded_bytes=n.sharded, grad_bytes=n.grad_view + n.grad_copy, optimizer_bytes=n.optim,
            unsharded_bytes=n.unsharded, unsharded_grad_bytes=sum(n.ugrad),
            all_gather_input_bytes=n.ag_in, all_gather_output_bytes=n.unsharded,
            reduce_scatter_input_bytes=n.rs_in if n.ugrad else 0,
            reduce_scatter_output_bytes=out if n.ugrad else 0,
            all_reduce_bytes=out if n.ugrad and replicate > 1 else 0,
            reshard_after_forward=n.reshard, all_gathers=len(gathers),
        ))

    return Plan(
        model=label, mesh_shape=shape, rank=rank, shard_size=shard, replicate_size=replicate,
        param_dtype=_dtype_name(mp_policy.param_dtype), reduce_dtype=_dtype_name(mp_policy.reduce_dtype),
        storage_dtypes=sorted({str(_dtype_name(p.dtype)) for p in params}), optimizer=optimizer,
        offload=offload, reshard_after_forward=reshard_after_forward, device_type=device_type,
        num_params=sum(math.prod(p.shape) for p in params), groups=rows,
        sharded_param_bytes=sharded, grad_bytes=grads, optimizer_bytes=optim, buffer_bytes=buffers,
        device_state_bytes=device_state + (grads if on_device else 0),
        host_bytes=0 if on_device else sharded + grads + optim,
        peak_unsharded_param_bytes=timeline.kind_peak["param"],
        peak_unsharded_grad_bytes=timeline.kind_peak["grad"],
        optimizer_step_bytes=step_tmp, peak_bytes=timeline.peak, peak_at=timeline.peak_at,
        all_gathers=counts["ag"], all_gather_input_bytes=ag_in, all_gather_output_bytes=ag_out,
        reduce_scatters=counts["rs"], reduce_scatter_input_bytes=rs_in, reduce_scatter_output_bytes=rs_out,
        all_reduces=counts["ar"], all_reduce_bytes=ar, send_bytes=send, notes=notes,
        memory_trace=timeline.trace, batch_size=batch_size, seq_len=seq_len,
        activation_checkpointing=activation_checkpointing, block_activation_bytes=block_act,
        activation_bytes=sum(n.act + n.act_rest for n in nodes), peak_activation_bytes=timeline.kind_peak["act"],
    )
