"""The public API: ``fully_shard``, ``FSDPModule``, ``UnshardHandle``, ``register_fsdp_forward_method``."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable
from typing import Any, Callable, overload

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.distributed.tensor import DTensor, Shard

from .group import GroupState, ParamGroup
from .mesh import mesh_info_for, post_forward_info
from .param import ShardedParam
from .policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from .state import STATE_ATTR, FSDPState, state_of

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method"]


class _Owner:
    """Which fully_shard call sharded a parameter: to tell a later call that reaches the same
    parameter whether it runs top-down or ties parameters across groups."""

    def __init__(self, sharded: ShardedParam, original: torch.Tensor, modules: tuple[nn.Module, ...], label: str) -> None:
        self.fqn = sharded.local_fqn
        self.sharded = weakref.ref(sharded)
        self.original = weakref.ref(original)
        self.modules = [weakref.ref(m) for m in modules]
        self.label = label

    def owns(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is the original or the sharded parameter (ids alone can be reused)."""
        sharded = self.sharded()
        return p is self.original() or (sharded is not None and p is sharded.sharded_param)

    def encloses(self, module: nn.Module) -> bool:
        return any(m() is not None and any(sub is module for sub in m().modules()) for m in self.modules)  # type: ignore[union-attr]


# id(parameter) -> its owner, for originals and sharded parameters alike. Weak references
# only: a tensor with a weak reference cannot be swapped by Module._apply (to_empty, to()).
_OWNERS: dict[int, _Owner] = {}
_FSDP_CLASSES: dict[type, type] = {}


@overload
def fully_shard(module: nn.Module, **kwargs: Any) -> FSDPModule: ...
@overload
def fully_shard(module: list[nn.Module], **kwargs: Any) -> list[FSDPModule]: ...
def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
) -> Any:
    """Shard ``module``'s parameters across the data-parallel ranks of ``mesh`` (ZeRO-3).

    Every parameter that ``module`` owns, and that no earlier (nested) ``fully_shard`` call
    already owns, joins one group. Between iterations each is an ``nn.Parameter`` wrapping a
    DTensor sharded on dim 0 (``torch.chunk`` semantics: the last ranks may hold fewer rows,
    or none), so each rank keeps ``1/N`` of the parameters, gradients and optimizer state.
    Just before the module's forward, one all-gather rebuilds the group's full parameters;
    after forward they are freed (``reshard_after_forward``) and gathered again for backward;
    after backward one reduce-scatter leaves each rank with the averaged gradient of its
    rows, accumulated into the sharded ``.grad``. The module's class is swapped in place for
    a subclass that also inherits :class:`FSDPModule`; nothing wraps it.

    Call it bottom-up: on each block, then on the root. The first forward through an FSDP
    module makes it the root; the root keeps its parameters after forward by default since
    backward needs them first.

    Args:
        module: a module, or a list of modules that form one group together.
        mesh: the data-parallel :class:`DeviceMesh`. 1-D: FSDP, parameters ``Shard(0)``
            over it. 2-D, read as (replicate, shard): HSDP, parameters
            ``(Replicate(), Shard(0))``; gradients are reduce-scattered within the shard dim
            and all-reduced across the replicate dim. A ``(N, 1)`` mesh is plain
            replication (DDP through this API: one all-reduce per group). Default: a 1-D
            mesh over the default process group on the current accelerator (CPU if none).
        reshard_after_forward: ``True`` frees the full parameters after forward (gathered
            again in backward); ``False`` keeps them until after backward (no backward
            all-gather, more memory). An int ``k`` (a divisor of the shard size other than
            1 and itself, e.g. ranks per node) keeps each parameter sharded over ``k``
            consecutive ranks after forward, so the backward all-gather runs within them at
            the cost of ``k/N`` of the parameters more memory. ``None``: ``True`` except for
            the root.
        shard_placement_fn: called with each parameter; returns ``Shard(dim)`` to shard it
            on ``dim`` (which the shard size must divide evenly when ``dim != 0``) or
            ``None`` for the default ``Shard(0)``.
        mp_policy: dtypes for the all-gather and compute (``param_dtype``), the gradient
            reduction (``reduce_dtype``) and outputs; see :class:`MixedPrecisionPolicy`.
            The sharded parameters, their gradients and optimizer state keep their own
            dtype. Parameters of different dtypes may share a group: one all-gather per
            unsharded dtype and one reduce-scatter per reduce dtype.
        offload_policy: :class:`CPUOffloadPolicy` keeps the sharded parameters, gradients
            and optimizer state in host memory (``optimizer.step()`` runs on the CPU); they
            are copied to the mesh device for the all-gather and back after the
            reduce-scatter. On a CPU mesh everything already lives in host memory, so it
            changes nothing there (and never pins memory without an accelerator).
        ignored_params: parameters left alone: not sharded, not moved, gradients not reduced.

    Returns:
        ``module``, its class now also an :class:`FSDPModule`.

    Example::

        >>> mesh = init_device_mesh("cpu", (world_size,))
        >>> for block in model.layers:
        ...     fully_shard(block, mesh=mesh)
        >>> fully_shard(model, mesh=mesh)
        >>> opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        >>> model(tokens).sum().backward(); opt.step(); opt.zero_grad()
    """
    modules = _as_modules(module)
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise ValueError(f"mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    if not isinstance(offload_policy, OffloadPolicy):
        raise ValueError(f"offload_policy must be an OffloadPolicy, got {type(offload_policy).__name__}")
    if not (reshard_after_forward is None or isinstance(reshard_after_forward, int)):
        raise ValueError(f"reshard_after_forward must be a bool, an int or None, got {reshard_after_forward!r}")
    mesh_info = mesh_info_for(mesh)
    post_forward = None
    if type(reshard_after_forward) is int:
        post_forward = post_forward_info(mesh_info, reshard_after_forward)
    device = mesh_info.device
    ignored = set(ignored_params or ())
    label = ", ".join(type(m).__name__ for m in modules)

    for key in [k for k, owner in _OWNERS.items() if owner.sharded() is None]:
        del _OWNERS[key]  # models that are gone
    found = _collect_params(modules, ignored)
    offload = isinstance(offload_policy, CPUOffloadPolicy)
    pin = offload and offload_policy.pin_memory  # type: ignore[attr-defined]
    sharded = [
        ShardedParam(p, fqn, uses, mesh_info, device, mp_policy, offload, pin, _shard_dim(shard_placement_fn, p, fqn))
        for p, (fqn, uses) in found.items()
    ]
    _move_buffers(modules, device)
    for original, sp in zip(found, sharded):
        owner = _Owner(sp, original, modules, label)
        _OWNERS[id(original)] = _OWNERS[id(sp.sharded_param)] = owner
        sp.register(unsharded=False)
    _install_optimizer_check()
    group = ParamGroup(sharded, mesh_info, device, label, post_forward) if sharded else None
    state = FSDPState(modules, group, device, reshard_after_forward, mp_policy)
    for m in modules:
        m.__dict__[STATE_ATTR] = state
        m.__class__ = _fsdp_class(type(m))
    if group is not None:
        _register_state_dict_hooks(group)
    return module


_checked_optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_optimizer_hook: Any = None


def _install_optimizer_check() -> None:
    """Once: before each optimizer's first step, refuse parameters fully_shard replaced."""
    global _optimizer_hook
    if _optimizer_hook is None:
        _optimizer_hook = register_optimizer_step_pre_hook(_check_optimizer)


def _check_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if optimizer in _checked_optimizers:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            owner = _OWNERS.get(id(p))
            if owner is not None and p is owner.original():
                raise RuntimeError(
                    f"{type(optimizer).__name__} holds parameter {owner.fqn!r} of {owner.label} as "
                    "it was before fully_shard replaced it with a sharded DTensor: this step would "
                    "update a tensor the model no longer uses. Build the optimizer after "
                    "fully_shard, from model.parameters()."
                )
    _checked_optimizers.add(optimizer)


def _register_state_dict_hooks(group: ParamGroup) -> None:
    """``load_state_dict`` of full tensors, and ``assign=True``, for sharded parameters.

    Before loading, a full (plain) tensor under a sharded parameter's key becomes this
    rank's shard; after an ``assign=True`` load, the newly assigned DTensor parameter
    becomes the group's sharded parameter.
    """
    by_module: dict[int, tuple[nn.Module, dict[str, ShardedParam]]] = {}
    for sp in group.params:
        for m, name in sp.uses:
            by_module.setdefault(id(m), (m, {}))[1][name] = sp
    for module, params in by_module.values():

        def pre_hook(m: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any, params: dict[str, ShardedParam] = params) -> None:
            for name, sp in params.items():
                key = prefix + name
                value = state_dict.get(key)
                if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
                    state_dict[key] = sp.full_to_sharded(value, key)

        def post_hook(m: nn.Module, incompatible: Any, params: dict[str, ShardedParam] = params) -> None:
            for name, sp in params.items():
                current = m._parameters.get(name)
                if current is not None and current is not sp.sharded_param and isinstance(current, DTensor):
                    sp.adopt(current)

        module.register_load_state_dict_pre_hook(pre_hook)
        module.register_load_state_dict_post_hook(post_hook)

    def save_pre_hook(m: nn.Module, prefix: str, keep_vars: bool) -> None:
        # between forward and backward the full parameters are registered: save the shards
        if group.is_unsharded:
            for sp in group.params:
                sp.register(unsharded=False)

    def save_post_hook(m: nn.Module, state_dict: Any, prefix: str, local_metadata: Any) -> None:
        if group.is_unsharded:
            for sp in group.params:
                sp.register(unsharded=True)

    def load_pre_hook(m: nn.Module, *args: Any) -> None:
        if group.state is not GroupState.SHARDED:
            group.reshard()  # loaded values go into the shards; the next use gathers them

    for m in {id(m): m for sp in group.params for m, _ in sp.uses}.values():
        m.register_state_dict_pre_hook(save_pre_hook)
        m.register_state_dict_post_hook(save_post_hook)
        m.register_load_state_dict_pre_hook(load_pre_hook)


def _shard_dim(shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None, param: nn.Parameter, fqn: str) -> int:
    placement = shard_placement_fn(param) if shard_placement_fn is not None else None
    if placement is None:
        return 0
    if type(placement) is not Shard:
        raise ValueError(
            f"shard_placement_fn must return Shard(dim) or None, got {placement!r} for parameter {fqn!r}"
        )
    dim = placement.dim
    if not -param.dim() <= dim < param.dim():
        raise ValueError(f"shard_placement_fn returned {placement!r} for parameter {fqn!r} of {param.dim()} dims")
    return dim


def _as_modules(module: nn.Module | Iterable[nn.Module]) -> tuple[nn.Module, ...]:
    modules = (module,) if isinstance(module, nn.Module) else tuple(module)
    if not modules:
        raise ValueError("fully_shard needs at least one module")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise ValueError(f"fully_shard expects nn.Module(s), got {type(m).__name__}")
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            raise ValueError(
                f"fully_shard cannot shard a {type(m).__name__}: it has no forward, so its "
                "parameters would never be gathered. Shard each member, or pass the members "
                "as a list: fully_shard(list(container))"
            )
        if getattr(m, STATE_ATTR, None) is not None:
            raise ValueError(
                f"fully_shard was already called on this {type(m).__name__}; call it once per module"
            )
    return modules


def _collect_params(
    modules: tuple[nn.Module, ...], ignored: set[nn.Parameter]
) -> dict[nn.Parameter, tuple[str, list[tuple[nn.Module, str]]]]:
    """The parameters this call owns: reachable from ``modules`` without passing through a
    module an earlier call sharded. Maps each to its name and every place it is registered."""
    found: dict[nn.Parameter, tuple[str, list[tuple[nn.Module, str]]]] = {}
    visited: set[int] = set()

    def visit(module: nn.Module, prefix: str, top: bool) -> None:
        if id(module) in visited:
            return
        visited.add(id(module))
        if not top and getattr(module, STATE_ATTR, None) is not None:
            return  # owned by an inner call
        # children before the module's own parameters (post-order, as torch's FSDP2 lays out
        # its flat buffers): the same layout makes the same collectives, element for element
        for child_name, child in module._modules.items():
            if child is not None:
                visit(child, f"{prefix}{child_name}.", False)
        for name, p in module._parameters.items():
            if p is None or p in ignored:
                continue
            fqn = prefix + name
            owner = _OWNERS.get(id(p))
            if owner is not None and owner.owns(p):
                if any(owner.encloses(m) for m in modules):
                    raise ValueError(
                        f"fully_shard({type(module).__name__}): parameter {fqn!r} is already sharded "
                        f"by the fully_shard call on {owner.label}, an enclosing module. Apply "
                        "fully_shard bottom-up: inner modules (e.g. each block) first, the root last."
                    )
                raise ValueError(
                    f"fully_shard({type(module).__name__}): parameter {fqn!r} is tied to (or shared "
                    f"with) a parameter that the fully_shard call on {owner.label} already sharded. "
                    "Tied parameters must be in one group: pass both modules in one call, "
                    "fully_shard([a, b]), or shard their common parent instead."
                )
            if p in found:
                found[p][1].append((module, name))
            else:
                found[p] = (fqn, [(module, name)])

    for i, m in enumerate(modules):
        visit(m, f"{i}." if len(modules) > 1 else "", True)
    return found


def _move_buffers(modules: tuple[nn.Module, ...], device: torch.device) -> None:
    for m in modules:
        for sub in m.modules():
            for name, buf in sub._buffers.items():
                if buf is not None and not buf.is_meta and buf.device != device:
                    sub._buffers[name] = buf.to(device)


def _fsdp_class(cls: type) -> type:
    if issubclass(cls, FSDPModule):
        return cls
    if cls not in _FSDP_CLASSES:
        _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__deepcopy__": _no_deepcopy})
    return _FSDP_CLASSES[cls]


def _no_deepcopy(self: nn.Module, memo: Any) -> Any:
    raise RuntimeError(
        f"copy.deepcopy is not supported on {type(self).__name__}, a module sharded by "
        "fully_shard: its parameters alternate between sharded DTensors and views of "
        "communication buffers. Deep-copy the model before calling fully_shard, or build a "
        "new model and load_state_dict(model.state_dict())."
    )


class UnshardHandle:
    """The all-gather issued by ``FSDPModule.unshard(async_op=True)``.

    Example::

        >>> handle = block.unshard(async_op=True)
        >>> ...  # overlap other work with the all-gather
        >>> handle.wait()  # block's full parameters are now in place
    """

    def __init__(self, group: ParamGroup | None) -> None:
        self._group = group

    def wait(self) -> None:
        """Block until the all-gather finished and the full parameters are in place."""
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group = None


class FSDPModule:
    """Mixed into the class of every module passed to :func:`fully_shard`.

    ``isinstance(m, FSDPModule)`` tells whether ``m`` was sharded; ``isinstance`` with the
    original class still holds. The methods below control communication.

    Example::

        >>> fully_shard(model)
        >>> model.set_requires_gradient_sync(False)  # accumulate gradients locally
        >>> model(x1).sum().backward()
        >>> model.set_requires_gradient_sync(True)
        >>> model(x2).sum().backward()  # reduce-scatters the accumulated gradients
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # nn.Sequential / nn.ModuleList slicing builds ``self.__class__(...)``: hand back
        # an instance of the original class, which nobody has sharded
        orig_cls = cls.__mro__[cls.__mro__.index(FSDPModule) + 1]
        self = orig_cls.__new__(orig_cls, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    def _fully_shard_states(self, recurse: bool) -> list[FSDPState]:
        modules = self.modules() if recurse else [self]  # type: ignore[attr-defined]
        states: dict[int, FSDPState] = {}
        for m in modules:
            state = getattr(m, STATE_ATTR, None)
            if state is not None:
                states.setdefault(id(state), state)
        return list(states.values())

    def no_sync(self) -> Any:
        """DDP's ``no_sync()`` does not exist here; raises with the fully_shard equivalent."""
        raise RuntimeError(
            f"{type(self).__name__} is sharded by fully_shard, which has no no_sync() context "
            "(that is DistributedDataParallel's). To accumulate gradients without reducing them, "
            "call model.set_requires_gradient_sync(False) before the accumulating backwards and "
            "model.set_requires_gradient_sync(True) before the last one."
        )

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # to_empty(), to(dtype), double(): act on the sharded parameters, then follow them
        group = state_of(self).group  # type: ignore[arg-type]
        if group is not None:
            group.reshard()
        out = super()._apply(*args, **kwargs)  # type: ignore[misc]
        if group is not None:
            group.refresh_after_apply()
        return out

    def reshard(self) -> None:
        """Free this module's full parameters, leaving the sharded ones registered."""
        group = state_of(self).group  # type: ignore[arg-type]
        if group is not None:
            group.reshard()

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters now, e.g. to prefetch ahead of forward.

        With ``async_op=True`` returns an :class:`UnshardHandle` to wait on; otherwise waits
        and returns None. The next forward finds the parameters already gathered.
        """
        group = state_of(self).group  # type: ignore[arg-type]
        if group is not None:
            for p in group.params:
                p.check_materialized()
            group.unshard(async_op=True)
        handle = UnshardHandle(group)
        if async_op:
            return handle
        handle.wait()
        return None

    def reset_iter_state(self) -> None:
        """After an exception in forward or backward, return every group to its sharded,
        idle state so training can go on. Call it on the root. The failed iteration's
        gradients (and any accumulated with sync off) are dropped."""
        state_of(self).reset_iter_state()  # type: ignore[arg-type]

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last before the optimizer step: only then does
        its end wait for the last gradient reduction (useful when pipelining microbatches)."""
        state = state_of(self)  # type: ignore[arg-type]
        state.lazy_init()
        assert state.ctx is not None
        state.ctx.is_last_backward = is_last_backward

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Turn gradient reduction on or off (off: gradients accumulate unsharded, locally,
        until a backward with it on). Applies to submodules too unless ``recurse=False``."""
        for state in self._fully_shard_states(recurse):
            if state.group is not None:
                state.group.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: turn the all-reduce across replicas on or off (the reduce-scatter still runs)."""
        for state in self._fully_shard_states(recurse):
            if state.group is not None:
                state.group.requires_all_reduce = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        """Whether to free full parameters after forward (and gather them again in backward)."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward must be a bool, got {reshard_after_forward!r}")
        for state in self._fully_shard_states(recurse):
            state.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Whether to free full parameters after backward (False keeps them for the next
        forward, e.g. between gradient-accumulation microbatches)."""
        for state in self._fully_shard_states(recurse):
            if state.group is not None:
                state.group.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' parameters as this module's forward starts, instead of
        the implicit choice (the module that ran next in the previous iteration)."""
        state_of(self).forward_prefetch = _states_of(modules, "set_modules_to_forward_prefetch")  # type: ignore[arg-type]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' parameters as this module's backward starts, instead of
        the implicit choice (the module that ran before it in forward)."""
        state_of(self).backward_prefetch = _states_of(modules, "set_modules_to_backward_prefetch")  # type: ignore[arg-type]

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the summed gradients by ``factor`` instead of averaging over the ranks."""
        if not factor > 0:
            raise ValueError(f"gradient divide factor must be positive, got {factor!r}")
        for state in self._fully_shard_states(recurse=True):
            if state.group is not None:
                state.group.gradient_divide_factor = float(factor)

    def set_post_optim_event(self, event: torch.Event) -> None:
        """Make the next forward's first all-gather wait for ``event`` (recorded after the
        optimizer step) rather than for the whole current stream. No-op on the CPU."""
        state = state_of(self)  # type: ignore[arg-type]
        state.lazy_init()
        assert state.ctx is not None
        state.ctx.post_optim_event = event


def _states_of(modules: list[FSDPModule], method: str) -> list[FSDPState]:
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError(f"{method} expects modules sharded by fully_shard, got a {type(m).__name__}")
    return [state_of(m) for m in modules]  # type: ignore[arg-type]


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run fully_shard's forward hooks around ``module.<method_name>`` too.

    For methods other than ``forward`` that use the parameters (e.g. ``generate``). A no-op
    when ``module`` is not an :class:`FSDPModule`, so one code path serves both.

    Example::

        >>> fully_shard(model)
        >>> register_fsdp_forward_method(model, "generate")
        >>> model.generate(prompt)  # parameters gathered, then freed
    """
    if not isinstance(module, FSDPModule):
        return
    if not callable(getattr(module, method_name, None)):
        raise ValueError(f"{type(module).__name__} has no method {method_name!r}")
    orig = getattr(module, method_name)

    @functools.wraps(orig)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        state = state_of(module)
        args, kwargs = state.pre_forward(args, kwargs)
        return state.post_forward(orig(*args, **kwargs))

    module.__dict__[method_name] = wrapped
