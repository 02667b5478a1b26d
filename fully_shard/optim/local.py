"""``local_step``: step an elementwise ``torch.optim`` optimizer on the DTensors' local tensors.

Between steps nothing changes: the parameters stay ``nn.Parameter(DTensor)``, their
gradients DTensors, the optimizer's state DTensors laid out like their parameters (what
``get_optimizer_state_dict`` and DCP expect, as torch's FSDP2 leaves it). For the duration
of ``optimizer.step()`` the optimizer sees each DTensor parameter's local tensor instead
(its ``.grad`` set to the gradient's local tensor, its state the states' local tensors),
so its own, unmodified algorithm runs on plain tensors, without a DTensor dispatch per op.
An elementwise optimizer updates each element from the same element of the parameter,
gradient and states, which is exactly what DTensor's dispatch runs on each rank's shard:
the same kernels on the same local tensors, so the result is bitwise the DTensor step's.

Example::

    >>> from fully_shard.optim import local_step
    >>> fully_shard(model)
    FSDPTransformer(...)
    >>> optimizer = local_step(torch.optim.AdamW(model.parameters(), lr=3e-4))
    >>> scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    >>> x, y = batches[0]
    >>> loss = loss_fn(model(x), y)
    >>> loss.backward(); optimizer.step(); scheduler.step(); optimizer.zero_grad()

See docs/optimizers.md.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

__all__ = ["local_step", "ELEMENTWISE_OPTIMIZERS"]

# Known elementwise: every state is a tensor shaped like the parameter (created with
# ``*_like(param or grad)``) or a scalar, and each element's update reads only the same
# element of the parameter, gradient and states plus scalars. Not here, on purpose:
# Adafactor (row and column statistics), LBFGS (dot products over all parameters, several
# closure calls), SparseAdam (sparse gradients), Muon and other matrix optimizers.
ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.Adamax,
    torch.optim.ASGD,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
)

_MARK = "_fully_shard_local_step"
_Groups = list[tuple[dict[str, Any], list[torch.Tensor]]]  # (param group, its own "params" list)
OptimizerT = TypeVar("OptimizerT", bound=torch.optim.Optimizer)


def local_step(optimizer: OptimizerT, *, elementwise: bool = False) -> OptimizerT:
    """Make ``optimizer.step()`` run on the local tensors of its DTensor parameters, and
    return the same optimizer.

    Per step: every DTensor parameter is replaced in the optimizer's ``param_groups`` by its
    local tensor (this rank's shard; its ``.grad`` set to the gradient's local tensor), and
    its state entry by one keyed by that local tensor, holding the states' local tensors.
    The optimizer's own ``step`` runs; then everything is put back, in place and in the same
    order: the original parameter objects, the same state dicts (updated in place, as the
    optimizer updated the local tensors), and each new state tensor shaped like the local
    shard becomes a DTensor laid out like its parameter (scalars such as ``step`` stay as
    the optimizer made them). It is put back also when the step raises. Plain-tensor
    parameters (``ignored_params``, unsharded models) step as before, in the same step.

    Only optimizers known to be elementwise are accepted: the types in
    ``ELEMENTWISE_OPTIMIZERS`` exactly (not subclasses, which may override ``step``). For
    another optimizer whose update of each element reads only the same element of the
    parameter, its gradient and its states (and scalars), pass ``elementwise=True``. An
    optimizer that needs whole parameters (``full_tensor()``, norms, matrix products:
    Muon, Shampoo, Adafactor, LBFGS) must step on the DTensors: do not wrap it (wrapped with
    ``elementwise=True``, one that calls a DTensor-only method such as ``full_tensor()``
    raises ``TypeError`` at ``step()``).

    A ``closure`` passed to ``step`` is called first, with gradients enabled, then the step
    runs without it (``torch.optim``'s elementwise optimizers call it first too). Hooks
    registered with ``register_step_pre_hook`` / ``register_step_post_hook`` run inside the
    local step and see the local tensors. Call ``local_step`` before creating an LR
    scheduler (either order works; this one avoids the scheduler's "optimizer.step()
    has been overridden" warning). ``torch.compile`` of the step (``torch.compile(opt.step)``
    or a compiled function that calls ``opt.step()``, before or after ``local_step``)
    compiles the optimizer's own step on the local tensors; the swaps run eagerly around it.
    Calling it twice changes nothing. A deep copy or a pickle of the optimizer is not
    wrapped (``Optimizer.__getstate__`` keeps only ``defaults``, ``state`` and
    ``param_groups``): wrap the copy again.

    Args:
        optimizer: a ``torch.optim.Optimizer`` over fully_shard's (or torch FSDP2's)
            parameters, plain parameters, or both.
        elementwise: accept an optimizer type that is not in ``ELEMENTWISE_OPTIMIZERS``.

    Example::

        >>> optimizer = local_step(torch.optim.AdamW(model.parameters(), lr=3e-4))
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"local_step expects a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if getattr(optimizer.step, _MARK, False):
        return optimizer
    if type(optimizer) not in ELEMENTWISE_OPTIMIZERS and not elementwise:
        known = ", ".join(t.__name__ for t in ELEMENTWISE_OPTIMIZERS)
        raise ValueError(
            f"local_step does not know {type(optimizer).__qualname__} to be elementwise: it runs the step on each "
            "rank's local shards, which is only right when each element's update reads the same element of the "
            f"parameter, its gradient and its states. Known elementwise: {known}. If it is elementwise, pass "
            "local_step(optimizer, elementwise=True); if it needs whole parameters (full_tensor(), norms, matrix "
            "products: Muon, Adafactor, LBFGS), step it on the DTensors: do not wrap it"
        )
    current: Any = optimizer.step
    # the step to run inside: the class's step, called with the optimizer the wrapper is bound
    # to, or an LR scheduler's wrapper (a plain function that holds the optimizer itself)
    inner: Callable[..., Any] = current.__func__ if getattr(current, "__self__", None) is optimizer else current
    bound = inner is not current

    def step(opt: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        undo: list[_Swapped] = []
        groups: _Groups = []
        try:
            _swap_in_eagerly(opt, undo, groups)
            inner(opt) if bound else inner()
        except AttributeError as e:  # e.g. p.full_tensor() on a local tensor: not elementwise
            if e.name is None or not hasattr(DTensor, e.name) or hasattr(torch.Tensor, e.name):
                raise
            raise TypeError(
                f"local_step: {type(opt).__qualname__}.step uses {e.name!r}, which only DTensors have, so it is not "
                "elementwise: inside local_step it sees each DTensor parameter's local tensor. Step it on the "
                "DTensors: do not wrap it with local_step (drop elementwise=True)"
            ) from e
        finally:
            _swap_out_eagerly(opt, undo, groups)
        return loss

    step._fully_shard_local_step = True  # type: ignore[attr-defined]
    if hasattr(current, "_wrapped_by_lr_sched"):  # a scheduler wrapped step already: keep its mark
        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    # a bound method, as LR schedulers expect (they rebind ``optimizer.step.__func__``)
    optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]
    return optimizer


class _Swapped:
    """One DTensor parameter swapped for its local tensor during a step."""

    __slots__ = ("param", "local", "state")

    def __init__(self, param: DTensor, local: torch.Tensor, state: dict[str, Any] | None) -> None:
        self.param = param
        self.local = local  # this rank's shard of param, the object the optimizer steps
        self.state = state  # param's state dict before the step (updated in place after it)


def _same_layout(a: DTensorSpec, b: DTensorSpec, meshes: dict[tuple[int, int], bool]) -> bool:
    # this runs per tensor per step, and DeviceMesh.__eq__ is a Python call: identity first,
    # then what this step found for the same two mesh objects (``meshes``, alive during the step)
    if a.placements != b.placements:
        return False
    if a.mesh is b.mesh:
        return True
    key = (id(a.mesh), id(b.mesh))
    same = meshes.get(key)
    if same is None:
        same = meshes[key] = a.mesh == b.mesh
    return same


def _where(group: int, index: int, p: DTensor) -> str:
    return f"param_groups[{group}]['params'][{index}] (shape {tuple(p.shape)}, placements {p.placements})"


def _swap_in(opt: torch.optim.Optimizer, undo: list[_Swapped], groups: _Groups) -> None:
    state = opt.state
    swapped: dict[int, _Swapped] = {}  # by id(param): Tensor.__hash__ is a Python call
    meshes: dict[tuple[int, int], bool] = {}
    for gi, group in enumerate(opt.param_groups):
        params = group["params"]
        local_params = None
        for i, p in enumerate(params):
            if not isinstance(p, DTensor):
                continue
            spec = p._spec
            local = p._local_tensor
            g = p.grad
            if g is not None and not (isinstance(g, DTensor) and _same_layout(g._spec, spec, meshes)):
                layout = g.placements if isinstance(g, DTensor) else "a plain tensor"
                raise RuntimeError(
                    f"local_step: the gradient of {_where(gi, i, p)} is {layout}, laid out unlike its parameter; "
                    "the local step needs gradients laid out like their parameters (fully_shard's are)"
                )
            s = state.get(p)
            if s is not None:
                for k, v in s.items():
                    if isinstance(v, DTensor) and not _same_layout(v._spec, spec, meshes):
                        raise RuntimeError(
                            f"local_step: optimizer state {k!r} of {_where(gi, i, p)} is laid out as {v.placements}, "
                            "unlike its parameter; load optimizer state with "
                            "torch.distributed.checkpoint.state_dict.set_optimizer_state_dict, which lays it out "
                            "like the parameters"
                        )
            entry = _Swapped(p, local, s)
            undo.append(entry)  # from here on, _swap_out puts this parameter back
            swapped[id(p)] = entry
            local.grad = None if g is None else g._local_tensor
            if local_params is None:
                local_params = list(params)
                group["params"] = local_params
                groups.append((group, params))
            local_params[i] = local
    if not swapped:
        return
    # same keys in the same order, DTensor parameters replaced by their local tensors
    _rekey(state, swapped, lambda e: e.local,
           lambda e, v: {k: t._local_tensor if isinstance(t, DTensor) else t for k, t in v.items()})


def _swap_out(opt: torch.optim.Optimizer, undo: list[_Swapped], groups: _Groups) -> None:
    for group, params in groups:
        group["params"] = params
    if not undo:
        return
    _rekey(opt.state, {id(e.local): e for e in undo}, lambda e: e.param, _state_back)
    for entry in undo:
        entry.local.grad = None


# Both swaps run eagerly under torch.compile: traced, they would add graphs of their own and
# recompile once per new state tensor (a guard on its identity). So a compiled step
# (``torch.compile(opt.step)``) compiles the optimizer's own step, on the local tensors: the
# same graph as on the DTensors.
_swap_in_eagerly: Callable[[torch.optim.Optimizer, list[_Swapped], _Groups], None] = torch.compiler.disable(_swap_in)
_swap_out_eagerly: Callable[[torch.optim.Optimizer, list[_Swapped], _Groups], None] = torch.compiler.disable(_swap_out)


def _rekey(
    state: Any,
    entries: dict[int, _Swapped],
    new_key: Callable[[_Swapped], torch.Tensor],
    new_value: Callable[[_Swapped, dict[str, Any]], dict[str, Any]],
) -> None:
    """Re-key the optimizer's ``state`` in place, keeping its order: each key whose id is in
    ``entries`` becomes ``new_key(entry)``, its value ``new_value(entry, value)``."""
    items = list(state.items())
    state.clear()
    for key, value in items:
        entry = entries.get(id(key))
        if entry is None:
            state[key] = value
        else:
            state[new_key(entry)] = new_value(entry, value)


def _state_back(entry: _Swapped, local_state: dict[str, Any]) -> dict[str, Any]:
    """``local_state`` (keyed like the param's state, values local) as the param's state:
    the same dict as before the step, each tensor that was a DTensor's local tensor that
    DTensor again, each new tensor shaped like the local shard a DTensor like the param."""
    out: dict[str, Any] = {} if entry.state is None else entry.state
    local = entry.local
    for k, v in local_state.items():
        prev = out.get(k)
        if prev is v or (isinstance(prev, DTensor) and prev._local_tensor is v):
            continue  # unchanged, or updated in place: the DTensor holds it
        if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.dim() > 0 and v.shape == local.shape:
            v = _like_param(v, entry.param)
        out[k] = v  # a new key goes last, where the optimizer put it
    if len(out) != len(local_state):  # the optimizer deleted a state
        for k in [k for k in out if k not in local_state]:
            del out[k]
    return out


def _like_param(local: torch.Tensor, param: DTensor) -> DTensor:
    """``local`` as a DTensor laid out like ``param`` (what ``torch.zeros_like(param)`` on the
    DTensor gives)."""
    spec = param._spec
    meta = TensorMeta(param.shape, param.stride(), local.dtype)
    return DTensor(local, DTensorSpec(spec.mesh, spec.placements, tensor_meta=meta), requires_grad=False)
