"""``plan()``: per-rank memory and communication of training a model under fully_shard, measured on fully_shard itself.

The model is built on the meta device and sharded by the real ``fully_shard`` on a fake process group of the mesh's
size (``run.fake_world``), bottom-up on the modules ``wrap`` picks and then on the root, or by the caller's own
``shard_fn`` (any ``fully_shard`` calls and ``FSDPModule`` settings a training script makes). One steady-state
training step then runs on fake tensors (``run.measure_step``): the peak, when it happens and what it is made of are
those of the runtime's own allocations, and the communication is the collectives it issued. What the planner adds
itself is what that step does not show: the optimizer's state (AdamW/Adam keep two states per parameter in its
dtype, SGD with momentum one) and its step's temporaries (a foreach step one per parameter, ``exp_avg_sq.sqrt()``;
a per-tensor step two of the largest), and, given ``batch_size`` and ``seq_len``, the activations of a
``transformers`` Llama-family model (``activations.py``), which the stand-in modules hold as their forward would.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any, Union

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ...api import fully_shard
from ...comm import CollectiveEvent
from ...mesh import reshard_setting
from ...param import ShardedParam
from ...policy import MixedPrecisionPolicy, OffloadPolicy
from ...state import STATE_ATTR, FSDPState
from ...streams import accelerator_type, has_streams
from ..tied import tie_notes
from .activations import estimate_activations
from .models import load_model
from .report import GroupPlan, Plan
from .run import Activations, Ledger, Step, fake_world, measure_step

__all__ = ["plan", "OPTIMIZERS"]

WrapSpec = Union[type, Iterable[type], Callable[[nn.Module], bool], None]  # noqa: UP007  # a runtime alias

# optimizer name -> states per parameter (each shaped and typed like the parameter)
OPTIMIZERS: dict[str, int] = {"adamw": 2, "adam": 2, "sgd": 0, "sgd-momentum": 1, "none": 0}


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).replace("torch.", "")


def _wrapped_names(model: nn.Module, wrap: WrapSpec) -> list[str]:
    """The names of the modules that get their own fully_shard call (the root aside), inner ones first."""
    if wrap is None:  # default: the blocks, i.e. children of any ModuleList named "layers"
        chosen = [f"{name}.{child}" for name, m in model.named_modules()
                  if isinstance(m, nn.ModuleList) and name.rpartition(".")[2] == "layers"
                  for child, _ in m.named_children()]
    else:
        if isinstance(wrap, type):
            classes: tuple[type, ...] | None = (wrap,)
        elif callable(wrap):
            classes = None
        else:
            classes = tuple(wrap)
            if not all(isinstance(c, type) for c in classes):
                raise ValueError("plan(): wrap must be a module class, a set of them, or a callable(module) -> bool")
        chosen = [name for name, m in model.named_modules() if m is not model
                  and (isinstance(m, classes) if classes is not None else wrap(m))]  # type: ignore[operator]
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return sorted(chosen, key=lambda name: -order[name])  # bottom-up, as fully_shard requires


def _mesh(mesh_shape: int | Sequence[int]) -> tuple[int, ...]:
    shape = (mesh_shape,) if isinstance(mesh_shape, int) else tuple(mesh_shape)
    if not 1 <= len(shape) <= 2 or not all(isinstance(s, int) and s >= 1 for s in shape):
        raise ValueError(
            f"mesh_shape must be (N,) for FSDP or (R, N) for HSDP with positive sizes, got {mesh_shape!r}"
        )
    return shape


def _activations(model: nn.Module, states: list[FSDPState], batch_size: int, seq_len: int, compute: torch.dtype,
                 checkpointing: bool | Collection[str]) -> tuple[dict[FSDPState, Activations], int]:
    """Each call's activations (``run.Activations``) and one block's bytes. A block's go to the innermost call that
    contains it, the rest of the model's (embedding, final norm, loss) to the root. ``checkpointing``: every block,
    none, or the names of the checkpointed ones."""
    est = estimate_activations(model, batch_size, seq_len, compute)
    names = {id(m): n for n, m in model.named_modules()}
    fqn = {s: names[id(s.modules[0])] for s in states}
    acts = {s: Activations() for s in states}
    root = next(s for s in states if fqn[s] == "")
    acts[root].rest = est.rest_bytes
    for layer in est.layers:
        owner = max((s for s in states if fqn[s] == "" or layer == fqn[s] or layer.startswith(fqn[s] + ".")),
                    key=lambda s: len(fqn[s]))
        if checkpointing is True or (not isinstance(checkpointing, bool) and layer in checkpointing):
            acts[owner].kept += est.block_input_bytes
            acts[owner].rebuilt = max(acts[owner].rebuilt, est.block_bytes)  # one block rebuilt at a time
        else:
            acts[owner].kept += est.block_bytes
    return acts, est.block_bytes


def plan(
    model_or_constructor: nn.Module | Callable[[], nn.Module] | str,
    mesh_shape: int | Sequence[int],
    *,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    optimizer: str = "adamw",
    reshard_after_forward: bool | int | None = None,
    wrap: WrapSpec = None,
    shard_fn: Callable[[nn.Module, DeviceMesh], Any] | None = None,
    rank: int = 0,
    device_type: str = accelerator_type(),
    foreach: bool | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    activation_checkpointing: bool | Collection[str] = False,
) -> Plan:
    """Per-rank memory and communication of training a model under fully_shard, without allocating it.

    The model is built on the meta device and sharded by ``fully_shard`` itself on a fake process group of the mesh's
    size: each module chosen by ``wrap`` gets its own call (made bottom-up) and the root one more for the parameters
    left, all with the options below, unless ``shard_fn`` shards it as a training script does. One training step of
    fully_shard then runs on fake tensors (shapes, no bytes), and its allocations and collectives are the plan.

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
        shard_fn: instead of ``wrap`` and the three options before it, ``shard_fn(model, mesh)`` shards the model as
            the training script does (its ``fully_shard`` calls, with any options, then any ``FSDPModule`` setting:
            ``set_reduce_scatter_max_input_buffers``, explicit prefetch lists, ``set_reshard_after_backward``, ...);
            ``mesh`` is the fake mesh of ``mesh_shape``.
        rank: the rank to plan for; rank 0 holds the most (the last ranks may hold fewer
            rows of a parameter whose dim 0 the shard size does not divide).
        device_type: a device type with streams (default: this machine's accelerator, else
            CUDA's) or ``"cpu"``.
        foreach: whether the optimizer step is a foreach one (default: as torch chooses,
            foreach on an accelerator, per tensor on the CPU).
        batch_size, seq_len: sequences per rank per step and tokens per sequence; given
            both, the activations of a ``transformers`` Llama-family model (what autograd
            saves for backward, per block, in the compute dtype) join the step: kept
            through forward, freed through backward. Left out: activations not counted.
        activation_checkpointing: every block checkpointed (e.g. transformers'
            ``gradient_checkpointing_enable()``), or the names of the checkpointed blocks
            (``{"model.layers.0", ...}``): such a block keeps only its input through
            forward and rebuilds its activations during its own backward.

    Returns:
        A :class:`Plan`; ``print(plan)`` shows a table, ``plan.to_json()`` every field.

    Example::

        >>> p = plan("llama3-8b", 64, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        >>> round(p.peak_bytes / 2**30, 2)  # GiB per rank, before activations
        6.97
        >>> p = plan("llama3-8b", 64, batch_size=1, seq_len=8192, activation_checkpointing=True)
        >>> p.activation_bytes, p.peak_activation_bytes  # kept at the end of forward; most at once
        (8908865536, 8908865536)
        >>> def my_recipe(model, mesh):  # a training script's own fully_shard calls and settings
        ...     for block in model.model.layers:
        ...         fully_shard(block, mesh=mesh, reshard_after_forward=False)
        ...     fully_shard(model, mesh=mesh)
        ...     model.set_reduce_scatter_max_input_buffers(2)
        >>> round(plan("llama3-8b", 64, shard_fn=my_recipe).peak_bytes / 2**30, 2)  # fp32, kept forward to backward
        36.56
    """
    shape = _mesh(mesh_shape)
    replicate, shard = (1, shape[0]) if len(shape) == 1 else shape
    if not 0 <= rank < shard:
        raise ValueError(f"rank must index the shard dim of the mesh (0..{shard - 1}), got {rank}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {', '.join(OPTIMIZERS)}")
    if shard_fn is not None and (mp_policy != MixedPrecisionPolicy() or offload_policy != OffloadPolicy()
                                 or reshard_after_forward is not None or wrap is not None):
        raise ValueError("plan(): shard_fn shards the model itself; give mp_policy, offload_policy, "
                         "reshard_after_forward and wrap to its fully_shard calls instead")
    if (batch_size is None) != (seq_len is None):
        raise ValueError("batch_size and seq_len go together: give both to count activations, or neither")
    if activation_checkpointing and batch_size is None:
        raise ValueError("activation_checkpointing needs batch_size and seq_len "
                         "(activations are not counted without them)")
    streams = has_streams(torch.device(device_type))
    foreach = streams if foreach is None else foreach
    model, label = load_model(model_or_constructor)
    wrapped = _wrapped_names(model, wrap) if shard_fn is None else []  # on the caller's model: wrap may compare modules
    if isinstance(model_or_constructor, nn.Module):
        model = copy.deepcopy(model)  # fully_shard changes the model it shards: the caller's stays as it is
    with fake_world(shape, rank) as mesh:
        if shard_fn is not None:
            shard_fn(model, mesh)
        else:
            for module in [*(model.get_submodule(name) for name in wrapped), model]:
                fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
                            offload_policy=offload_policy)
        root: FSDPState | None = getattr(model, STATE_ATTR, None)
        if root is None:
            raise ValueError("plan(): shard_fn must call fully_shard on the model (the root) last")
        if getattr(model, "_compiled_call_impl", None) is not None:
            raise ValueError("plan(): shard_fn compiles the whole model (model.compile() after fully_shard), which "
                             "plan() cannot plan: it runs fully_shard's eager step, and the compiled step's schedule "
                             "is inductor's (docs/compile.md: the overlap passes gather every block at the start of "
                             "forward). Plan without the compile; docs/compile.md has the measured peaks")
        states = list(dict.fromkeys(s for m in model.modules() if (s := getattr(m, STATE_ATTR, None)) is not None))
        acts: dict[FSDPState, Activations] = {}
        block_act = 0
        if batch_size is not None and seq_len is not None:
            floats = [p.dtype for p in model.parameters() if p.is_floating_point()]
            compute = root.mp_policy.param_dtype or (floats[0] if floats else torch.float32)
            acts, block_act = _activations(model, states, batch_size, seq_len, compute, activation_checkpointing)
        sharded = _owned(states)
        offload = any(p.offload for p in sharded)
        on_device = not offload or not streams  # where the sharded state lives
        opt = _Optimizer(optimizer, foreach, [p for p in sharded if p.sharded_param.requires_grad], on_device,
                         device_type)
        step = measure_step(model, streams=streams, activations=acts, optimizer_step=opt.step)
    fields = _memory(step, model, on_device, opt) | _communication(step.collectives)
    groups = [_group(s, model, step.collectives, shard, opt.states, on_device) for s in states if s.group is not None]
    notes = ["CPU offload changes nothing on a CPU mesh: everything is host memory"] if offload and not streams else []
    notes += tie_notes([(g.name, s.group.params) for g, s in zip(groups, (s for s in states if s.group is not None))])
    if kept := [r for s in states for r in s.post_forward_ranks.values()]:  # the runtime's own k-rank groups
        k, mine = kept[0].size, len({id(r.group) for r in kept})
        notes.append(f"reshard_after_forward={k}: one set of {k}-rank process groups ({replicate * shard // k} in all, "
                     f"this rank in {mine}), shared by the {len(kept)} calls on this mesh (torch's FSDP2 makes a set "
                     f"per call), and their complements ({k} groups of {shard // k} ranks per replica, this rank in 1: "
                     "the whole-model compile's first all-gather)")
    return Plan(
        model=label, mesh_shape=shape, rank=rank, shard_size=shard, replicate_size=replicate,
        param_dtype=_dtype_name(root.mp_policy.param_dtype), reduce_dtype=_dtype_name(root.mp_policy.reduce_dtype),
        storage_dtypes=sorted({str(_dtype_name(p.dtype)) for p in sharded}), optimizer=optimizer, offload=offload,
        reshard_after_forward=reshard_setting(reshard_after_forward, shard), device_type=device_type,
        groups=groups, notes=notes,
        batch_size=batch_size, seq_len=seq_len,
        activation_checkpointing=(activation_checkpointing if isinstance(activation_checkpointing, bool)
                                  else sorted(activation_checkpointing)),
        block_activation_bytes=block_act, activation_bytes=sum(a.kept + a.rest for a in acts.values()), **fields,
    )


class _Optimizer:
    """What the optimizer adds: its state (AdamW/Adam two per parameter, SGD with momentum one, each like the
    parameter's local shard) and its step's temporaries (AdamW/Adam: a foreach step one per parameter,
    ``exp_avg_sq.sqrt()``; a per-tensor step two of the largest; SGD updates in place), on the device unless the
    sharded state is offloaded. AdamW/Adam also count steps in a float32 scalar per parameter (``counters``), kept
    on the host (not capturable, not fused): device memory only when the device is the CPU."""

    def __init__(self, name: str, foreach: bool, trainable: list[ShardedParam], on_device: bool,
                 device_type: str) -> None:
        self.states = OPTIMIZERS[name]
        self.counters = 4 * len(trainable) if self.states == 2 and on_device and device_type == "cpu" else 0
        local = [p.local_shard.numel() * p.local_shard.element_size() for p in trainable]
        if self.states == 2:
            self.temporaries = sum(local) if foreach else 2 * max(local, default=0)
        else:
            self.temporaries = 0
        self.on_device = on_device
        self.where = f"optimizer step ({name}{', foreach' if foreach else ''})"

    def step(self, ledger: Ledger) -> None:
        if self.on_device:
            ledger.add("optim", self.temporaries, self.where)
            ledger.add("optim", -self.temporaries, self.where)


def _storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local part)."""
    seen = {}
    for t in tensors:
        if t is not None:
            st = (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage()
            seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def _owned(states: list[FSDPState]) -> list[ShardedParam]:
    """The sharded parameters of ``states``' groups, a parameter tied across calls once (in the first call's group,
    which keeps its state: Note [tied parameters])."""
    return [p for s in states if s.group is not None for p in s.group.params if p.tie.params[0] is p]


def _grad_bytes(params: list[ShardedParam], on_device: bool) -> int:
    """The sharded gradients: the reduce-scatter outputs they are views of, or, offloaded to a host, copies of this
    rank's rows (the fake step keeps the views: its device is the host)."""
    if on_device:
        return _storage_bytes(p.sharded_param.grad for p in params)
    return _storage_bytes(p.sharded_param for p in params if p.sharded_param.grad is not None)


def _group(state: FSDPState, model: nn.Module, events: list[CollectiveEvent], shard: int, states: int,
           on_device: bool) -> GroupPlan:
    """One call's row: sizes read off its sharded parameters, buffers off the collectives it issued."""
    assert state.group is not None
    params = _owned([state])
    mine = [e for e in events if e.label == state.group.label]
    gathers = [e for e in mine if e.kind == "all_gather"]
    forward = [e for e in gathers if not e.backward] or gathers  # the forward all-gathers: the whole group's
    reductions = [e for e in mine if e.kind == "reduce_scatter"]
    k = min((e.group_size for e in gathers if e.backward), default=shard)  # reshard_after_forward=k: within k ranks
    trainable = [p for p in params if p.sharded_param.requires_grad]
    return GroupPlan(
        name=next(n for n, m in model.named_modules() if m is state.modules[0]) or "(root)", tensors=len(params),
        numel=sum(p.sharded_param.numel() for p in params),
        sharded_bytes=_storage_bytes(p.sharded_param for p in params),
        grad_bytes=_grad_bytes(params, on_device),
        optimizer_bytes=states * _storage_bytes(p.sharded_param for p in trainable),
        unsharded_bytes=sum(e.nbytes * e.group_size for e in forward),
        unsharded_grad_bytes=sum(p.sharded_param.numel() * p.unsharded_param.element_size() for p in state.group.params
                                 if p.sharded_param.requires_grad and p.unsharded_param is not None),
        all_gather_input_bytes=sum(e.nbytes for e in forward),
        all_gather_output_bytes=sum(e.nbytes * e.group_size for e in forward),
        reduce_scatter_input_bytes=sum(e.nbytes for e in reductions),
        reduce_scatter_output_bytes=sum(e.nbytes // e.group_size for e in reductions),
        all_reduce_bytes=sum(e.nbytes for e in mine if e.kind == "all_reduce"),
        reshard_after_forward=k if k < shard else bool(state.reshard_after_forward), all_gathers=len(gathers),
    )


def _memory(step: Step, model: nn.Module, on_device: bool, opt: _Optimizer) -> dict[str, Any]:
    """The memory fields of the plan, off the ledger: device bytes held through the step (the sharded parameters and
    the optimizer state, unless offloaded, and the buffers), plus what the step allocated and freed."""
    sharded = _owned(step.states)
    params = _storage_bytes(p.sharded_param for p in sharded)
    grads = _grad_bytes(sharded, on_device)
    optim = opt.states * _storage_bytes(p.sharded_param for p in sharded if p.sharded_param.requires_grad)
    buffers = _storage_bytes(model.buffers())
    base = (params + optim if on_device else 0) + buffers + opt.counters
    trace = [["start of step", *step.start.values()], *step.rows]
    rows = [[where, base + (state - step.start["state"] if on_device else 0), *rest] for where, state, *rest in trace]
    totals = [sum(r[1:]) for r in rows]
    top = max(range(len(rows)), key=totals.__getitem__)
    return {
        "num_params": sum(p.sharded_param.numel() for p in sharded), "sharded_param_bytes": params, "grad_bytes": grads,
        "optimizer_bytes": optim, "buffer_bytes": buffers, "device_state_bytes": base + (grads if on_device else 0),
        "host_bytes": 0 if on_device else params + grads + optim, "peak_unsharded_param_bytes": max(r[2] for r in rows),
        "peak_unsharded_grad_bytes": max(r[3] for r in rows), "optimizer_step_bytes": opt.temporaries,
        "peak_bytes": totals[top], "peak_at": rows[top][0], "memory_trace": rows,
        "peak_activation_bytes": max(r[5] for r in rows),
    }


def _communication(events: list[CollectiveEvent]) -> dict[str, Any]:
    """The communication fields of the plan, off the collectives of the step (``send_bytes``: ring algorithms)."""
    out: dict[str, Any] = {"send_bytes": 0}
    for kind, plural in (("all_gather", "all_gathers"), ("reduce_scatter", "reduce_scatters"),
                         ("all_reduce", "all_reduces")):
        these = [e for e in events if e.kind == kind]
        out[plural] = len(these)
        if kind == "all_reduce":
            out["all_reduce_bytes"] = sum(e.nbytes for e in these)
        else:
            out[f"{kind}_input_bytes"] = sum(e.nbytes for e in these)
            out[f"{kind}_output_bytes"] = sum(e.nbytes * e.group_size if kind == "all_gather"
                                              else e.nbytes // e.group_size for e in these)
    for e in events:
        n = e.group_size
        out["send_bytes"] += {"all_gather": (n - 1) * e.nbytes, "reduce_scatter": (n - 1) * e.nbytes // n,
                              "all_reduce": 2 * (n - 1) * e.nbytes // n}[e.kind]
    return out
