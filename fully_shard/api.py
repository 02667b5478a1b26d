"""The public API: ``fully_shard``, ``FSDPModule``, ``UnshardHandle``, ``register_fsdp_forward_method``."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from . import traced
from .compat import mark_fully_sharded
from .group import GroupOptions, ParamGroup
from .mesh import MeshInfo, mesh_info_for, mesh_info_of, resolve_reshard_after_forward, separate_group
from .param import OWNER_ATTR, ShardedParam, param_dtypes
from .policy import (
    CPUOffloadPolicy,
    DataParallelMeshDims,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardedDeepcopyError,
    ShardedUsageError,
)
from .state import STATE_ATTR, FSDPState, state_of
from .streams import Streams, has_streams


@dataclass
class ShardPlacementResult:
    """What ``shard_placement_fn`` may return to give a parameter a mesh of its own as well as its placement:
    ``mesh_info`` is torch's ``FSDPMeshInfo`` / ``HSDPMeshInfo`` (as torchtitan builds them), a ``DeviceMesh`` or
    anything with a ``mesh``. Such parameters (e.g. expert weights) are gathered and reduced in collectives of their
    own mesh, as torch's FSDP2 does with one parameter group per mesh.

    Example::

        >>> expert_mesh = mesh  # the ranks that hold the experts; here, the world of one rank
        >>> experts = set(moe.experts.parameters())  # sharded over the ranks of expert_mesh
        >>> place = lambda p: ShardPlacementResult(Shard(0), expert_mesh) if p in experts else None
        >>> fully_shard(moe, mesh=mesh, shard_placement_fn=place)
        FSDPMoE(...)
    """

    placement: Shard | None
    mesh_info: Any


@dataclass(eq=False)
class _Owner:
    """Which fully_shard call sharded a parameter, kept on the original and the sharded one (``OWNER_ATTR``): a later
    call reaching it runs top-down, or gathers it too (Note [tied parameters])."""

    fqn: str  # relative to ``modules``
    modules: tuple[nn.Module, ...]
    label: str
    param: ShardedParam  # the call's: a later call reaching the parameter ties its own to it

    def encloses(self, module: nn.Module) -> bool:
        return any(sub is module for m in self.modules for sub in m.modules())


class _ReplacedParameter(nn.Parameter):
    """The class of a parameter fully_shard replaced by a sharded one. Reading its ``.grad`` raises, because an
    optimizer built before fully_shard (its step or ``zero_grad``) would update a dead tensor."""

    @property
    def grad(self) -> torch.Tensor | None:  # type: ignore[override]
        from .tools.checks import callers_self

        owner: _Owner = self.__dict__[OWNER_ATTR]
        who = next((type(o).__name__ for o in callers_self() if isinstance(o, torch.optim.Optimizer)), "This code")
        raise RuntimeError(f"{who} holds parameter {owner.fqn!r} of {owner.label} as it was before fully_shard "
                           "replaced it with a sharded DTensor: this step would update a tensor the model no longer "
                           "uses. Build the optimizer after fully_shard, from model.parameters().")


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
) -> Any:
    """Shard ``module``'s parameters across the data-parallel ranks of ``mesh`` (ZeRO-3).

    Every parameter that ``module`` owns, and that no earlier (nested) ``fully_shard`` call owns, joins one group.
    Between iterations each is an ``nn.Parameter`` wrapping a DTensor sharded on dim 0 (``torch.chunk`` semantics),
    so each rank keeps ``1/N`` of the parameters, gradients and optimizer state. One all-gather rebuilds the group's
    full parameters before the module's forward; they are freed after it and gathered again for backward; one
    reduce-scatter then leaves each rank the averaged gradient of its rows in the sharded ``.grad``. The module's
    class is swapped in place for a subclass that also inherits :class:`FSDPModule`; nothing wraps it. Call it
    bottom-up: on each block, then on the root (the first module to run forward, which keeps its parameters after
    forward).

    Args:
        module: a module, or a list of modules that form one group together, gathered when the first member starts
            forward and resharded when every member has run. A member the model's forward skips (a chunked loss
            calling ``model.output`` once per chunk) works as in torch: the group's forward ends with the root's,
            and the member may then be called on its own any number of times.
        mesh: the data-parallel :class:`DeviceMesh`. 1-D: FSDP, parameters ``Shard(0)`` over it. 2-D, read as
            (replicate, shard): HSDP, parameters ``(Replicate(), Shard(0))``; gradients are reduce-scattered within
            the shard dim and all-reduced across the replicate dim (a ``(N, 1)`` mesh: DDP). Default: a 1-D mesh
            over the default process group on the current accelerator, else CPU.
        reshard_after_forward: ``True`` frees the full parameters after forward (gathered again in backward);
            ``False`` keeps them until after backward (more memory). An int ``k`` dividing the shard size ``N``
            (e.g. ranks per node) keeps ``k/N`` of them after forward, so backward all-gathers within ``k``
            consecutive ranks; ``k == N`` means ``True``, ``k == 1`` ``False`` (per mesh, with a
            :class:`ShardPlacementResult`'s). ``None``: ``True`` but for the root.
        shard_placement_fn: called with each parameter; returns ``Shard(dim)`` to shard it on ``dim`` (which the
            shard size must divide evenly when ``dim != 0``), a :class:`ShardPlacementResult` (a mesh of its own
            too) or ``None`` (``Shard(0)``).
        mp_policy: dtypes for the all-gather and compute (``param_dtype``), the gradient reduction
            (``reduce_dtype``) and outputs; see :class:`MixedPrecisionPolicy`. Sharded parameters, gradients and
            optimizer state keep their own dtype.
        offload_policy: :class:`CPUOffloadPolicy` keeps the sharded parameters, gradients and optimizer state in
            host memory (``optimizer.step()`` runs on the CPU), copied to the mesh device for each all-gather and
            back after each reduce-scatter.
        ignored_params: parameters left alone: not sharded, not moved, gradients not reduced. As in torch, one set
            may go to every call of a walk (``keep = {model.norm.weight}``, then ``ignored_params=keep`` for each
            block and for the model): a call leaves out those it would shard and passes over the rest, so a parameter
            under a nested call's module is that call's to ignore. The root's first forward refuses a tensor in the
            set that is no module's parameter (e.g. a detached EMA copy), and a trainable parameter of the enclosing
            model that no call shards or ignores (a forgotten ``fully_shard(model)``); its second forward warns, once,
            about a parameter of a module outside the model that no call keeps out (``ema.norm.weight`` of an EMA
            model where ``model.norm.weight`` was meant).
        dp_mesh_dims: ``mesh`` is then the full SPMD mesh (e.g. ``("dp", "tp")``) and every parameter a DTensor on
            it, ``Replicate()`` on the data-parallel dims this names; fully_shard shards over ``shard`` (HSDP:
            replicates over ``replicate``) and the sharded parameters stay DTensors on the full mesh, laid out as
            torch's. Several names per role are flattened into one dim (shard names: adjacent, in mesh order);
            ``replicate`` alone is DDP (parameters replicated, gradients averaged).

    Returns:
        ``module``, its class now also an :class:`FSDPModule`.

    Example::

        >>> mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        >>> for block in model.layers:
        ...     fully_shard(block, mesh=mesh)
        FSDPTransformerBlock(...)
        FSDPTransformerBlock(...)
        >>> fully_shard(model, mesh=mesh)
        FSDPTransformer(...)
        >>> opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        >>> model(tokens).sum().backward(); opt.step(); opt.zero_grad()
    """
    modules = _as_modules(module)
    mp_policy, offload_policy, dp_mesh_dims = (_own_policy(p) for p in (mp_policy, offload_policy, dp_mesh_dims))
    check_options(mp_policy, offload_policy, reshard_after_forward)
    mesh_info = mesh_info_for(mesh, dp_mesh_dims)
    device = mesh_info.device
    if has_streams(device):  # an accelerator: its process group may be gloo
        from .tools.pools import warn_gloo_on_accelerator

        warn_gloo_on_accelerator(mesh_info.shard.group, device)
    ignored = set(ignored_params or ())
    label = ", ".join(type(m).__name__ for m in modules)
    if odd := [x for x in ignored if not isinstance(x, torch.Tensor)]:
        raise ValueError(f"fully_shard({label}): ignored_params must hold parameters, got a {type(odd[0]).__name__} "
                         f"({odd[0]!r:.60}); pass the parameters themselves, e.g. "
                         "ignored_params={model.norm.weight}")

    found = _collect_params(modules, ignored)
    offload = isinstance(offload_policy, CPUOffloadPolicy)
    pin = offload and offload_policy.pin_memory  # type: ignore[attr-defined]
    meshes = [mesh_info]  # and those shard_placement_fn names (ShardPlacementResult)
    sharded = []
    for p, (fqn, uses, first) in found.items():
        dim, info = _placement(shard_placement_fn, p, fqn, mesh_info, meshes)
        if first is not None:
            from .tools.tied import check_alike  # Note [tied parameters]: one sharded parameter, so one layout

            check_alike(fqn, modules, first, (info, dim % p.dim(), offload, param_dtypes(p.dtype, mp_policy)))
        sharded.append(ShardedParam(p, fqn, uses, info, device, mp_policy, offload, pin, dim, first))
    reshard, post_forward = resolve_reshard_after_forward(reshard_after_forward, mesh_info,
                                                          [(p.local_fqn, p.mesh_info) for p in sharded])
    ext = next((sp.local_fqn for sp in sharded if sp.extension and id(sp.mesh_info) in post_forward), None)
    if ext is not None:  # torch raises NotImplementedError too, at the backward all-gather
        raise NotImplementedError(f"fully_shard({label}): reshard_after_forward=<int> is not supported for "
                                  f"tensor-subclass parameters that all-gather themselves ({ext!r}); "
                                  "pass True or False")
    _move_buffers(modules, device)
    for original, sp in zip(found, sharded):
        if sp.owner is None:  # not tied to an earlier call's, which owns it
            sp.set_owner(_Owner(sp.local_fqn, modules, label, sp))
            original.__dict__[OWNER_ATTR] = sp.owner
            if type(original) is nn.Parameter:
                original.__class__ = _ReplacedParameter
        sp.register(unsharded=False)
    group = ParamGroup(sharded, mesh_info, device, label) if sharded else None
    state = FSDPState(modules, group, device, reshard, post_forward, mp_policy, ignored)
    for m in modules:
        for sub in m.modules():  # the earlier calls this one encloses (the traced path's reshard default reads it)
            if (inner := getattr(sub, STATE_ATTR, None)) is not None:
                inner.enclosed = True
    for m in modules:
        m.__dict__[STATE_ATTR] = state
        mark_fully_sharded(m)  # torch's replicate leaves its parameters to us, as it does for torch's FSDP2
        m.__class__ = _fsdp_class(type(m))
    return module


def check_options(mp_policy: Any, offload_policy: Any, reshard_after_forward: Any) -> None:
    """The checks ``fully_shard`` makes of its policies and ``reshard_after_forward`` before it looks at the mesh
    (which ``mesh.resolve_reshard_after_forward`` checks an int against)."""
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise ValueError(f"mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    if not isinstance(offload_policy, OffloadPolicy):
        raise ValueError(f"offload_policy must be an OffloadPolicy, got {type(offload_policy).__name__}")
    if not (reshard_after_forward is None or isinstance(reshard_after_forward, int)):
        raise ValueError(f"reshard_after_forward must be a bool, an int or None, got {reshard_after_forward!r}")


_POLICIES = {cls.__name__: cls for cls in (MixedPrecisionPolicy, OffloadPolicy, CPUOffloadPolicy, DataParallelMeshDims)}


def _own_policy(value: Any) -> Any:
    """A policy built from torch's FSDP2 class of the same name (by a framework, before ``fully_shard.install()``),
    rebuilt as fully_shard's. The same fields mean the same."""
    ours = _POLICIES.get(type(value).__name__)
    if ours is None or isinstance(value, ours) or not type(value).__module__.startswith("torch.distributed.fsdp"):
        return value
    return ours(**{f.name: getattr(value, f.name) for f in dataclasses.fields(value)})


def _placement(fn: Callable[[nn.Parameter], Any] | None, param: nn.Parameter, fqn: str, info: MeshInfo,
               meshes: list[MeshInfo]) -> tuple[int, MeshInfo]:
    """The shard dim and mesh ``shard_placement_fn`` gives ``param`` (default: 0 on ``info``'s)."""
    placement: Any = fn(param) if fn is not None else None
    if hasattr(placement, "mesh_info") and hasattr(placement, "placement"):  # a ShardPlacementResult
        info = mesh_info_of(placement.mesh_info, fqn, meshes)
        placement = placement.placement
    if placement is None:
        return 0, info
    if type(placement) is not Shard:
        raise ValueError("shard_placement_fn must return Shard(dim), a ShardPlacementResult or None, got "
                         f"{placement!r} for parameter {fqn!r}")
    dim = placement.dim
    if not -param.dim() <= dim < param.dim():
        raise ValueError(f"shard_placement_fn returned {placement!r} for parameter {fqn!r} of {param.dim()} dims")
    return dim, info


def _as_modules(module: nn.Module | Iterable[nn.Module]) -> tuple[nn.Module, ...]:
    modules = (module,) if isinstance(module, nn.Module) else tuple(module)
    if not modules:
        raise ValueError("fully_shard needs at least one module")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise ValueError(f"fully_shard expects nn.Module(s), got {type(m).__name__}")
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward:
            raise ValueError(f"fully_shard cannot shard a {type(m).__name__}: it has no forward, so its parameters "
                             "would never be gathered. Shard each member, or pass the members as a list: "
                             "fully_shard(list(container))")
        if getattr(m, STATE_ATTR, None) is not None:
            raise ShardedUsageError(f"fully_shard was already called on this {type(m).__name__}; "
                                    "call it once per module")
    return modules


def _collect_params(modules: tuple[nn.Module, ...], ignored: set[nn.Parameter]
                    ) -> dict[nn.Parameter, tuple[str, list[tuple[nn.Module, str]], ShardedParam | None]]:
    """The parameters this call gathers, those reachable from ``modules`` without passing through a module an earlier
    call sharded. Maps each to its name, every place it is registered, and an earlier call's ShardedParam of it (a
    parameter tied across calls, Note [tied parameters])."""
    found: dict[nn.Parameter, tuple[str, list[tuple[nn.Module, str]], ShardedParam | None]] = {}
    for fqn, module, name, p in walk_params(modules, lambda m: getattr(m, STATE_ATTR, None) is not None):
        if p in ignored:
            continue
        owner: _Owner | None = p.__dict__.get(OWNER_ATTR)
        if owner is not None and any(owner.encloses(m) for m in modules):
            raise ValueError(f"fully_shard({type(module).__name__}): parameter {fqn!r} is already sharded by the "
                             f"fully_shard call on {owner.label}, an enclosing module. Apply fully_shard bottom-up: "
                             "inner modules (e.g. each block) first, the root last.")
        found.setdefault(p, (fqn, [], None if owner is None else owner.param))[1].append((module, name))
    return found


def walk_params(modules: tuple[nn.Module, ...],
                is_sharded: Callable[[nn.Module], bool]) -> Iterator[tuple[str, nn.Module, str, nn.Parameter]]:
    """Every registration ``(fqn, module, name, parameter)`` that a ``fully_shard`` call on ``modules`` reaches. Each
    module is visited once, children before its own parameters, and a module that ``is_sharded`` says an earlier
    (inner) call sharded is not entered. A parameter registered in several places comes once per place. Pure:
    ``fully_shard.quant`` walks a sharded module with it.

    Example::

        >>> blocks = set(model.layers)  # as if earlier, inner calls had sharded them
        >>> [fqn for fqn, *_ in walk_params((model,), lambda m: m in blocks)]
        ['tok_embeddings.weight', 'norm.weight', 'output.weight']
    """
    visited: set[int] = set()

    def visit(module: nn.Module, prefix: str, top: bool) -> Iterator[tuple[str, nn.Module, str, nn.Parameter]]:
        if id(module) in visited:
            return
        visited.add(id(module))
        if not top and is_sharded(module):
            return  # owned by an inner call
        # post-order, as torch's FSDP2 lays out its flat buffers: the same collectives, element for element
        for child_name, child in module._modules.items():
            if child is not None:
                yield from visit(child, f"{prefix}{child_name}.", False)
        for name, p in module._parameters.items():
            if p is not None:
                yield prefix + name, module, name, p

    for i, m in enumerate(modules):
        yield from visit(m, f"{i}." if len(modules) > 1 else "", True)


def _move_buffers(modules: tuple[nn.Module, ...], device: torch.device) -> None:
    for m in modules:
        for sub in m.modules():
            for name, buf in sub._buffers.items():
                if buf is not None and not buf.is_meta and buf.device != device:
                    sub._buffers[name] = buf.to(device)


def _fsdp_class(cls: type) -> type:
    """``FSDP<cls>``, made once per class while its modules live (found among the class's own subclasses, so sharded
    modules of one class share one type)."""
    if issubclass(cls, FSDPModule):
        return cls
    for sub in cls.__subclasses__():
        if sub.__bases__ == (FSDPModule, cls):
            return sub
    return type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__deepcopy__": _no_deepcopy})


def _no_deepcopy(self: nn.Module, memo: Any) -> Any:
    raise ShardedDeepcopyError(f"copy.deepcopy is not supported on {type(self).__name__}, a module sharded by "
                               "fully_shard: its parameters alternate between sharded DTensors and views of "
                               "communication buffers. Deep-copy the model before calling fully_shard, or build a new "
                               "model and load_state_dict(model.state_dict()).")


class UnshardHandle:
    """The all-gather issued by ``FSDPModule.unshard(async_op=True)`` (``UnshardHandle()``: nothing to wait for).

    Example::

        >>> fully_shard(block)
        FSDPTransformerBlock(...)
        >>> handle = block.unshard(async_op=True)
        >>> h = model.tok_embeddings(tokens)  # other work overlaps the all-gather
        >>> handle.wait()  # block's full parameters are now in place
    """

    _group: ParamGroup | None = None  # set by unshard()

    def wait(self) -> None:
        """Block until the all-gather finished and the full parameters are in place."""
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group = None


class FSDPModule:
    """Mixed into the class of every module passed to :func:`fully_shard` (``isinstance`` with the original class still
    holds). The methods below control communication.

    Example::

        >>> fully_shard(model)
        FSDPTransformer(...)
        >>> x1, x2 = tokens.chunk(2)  # two microbatches
        >>> model.set_requires_gradient_sync(False)  # accumulate gradients locally
        >>> model(x1).sum().backward()
        >>> model.set_requires_gradient_sync(True)
        >>> model(x2).sum().backward()  # reduce-scatters the accumulated gradients
    """

    # as torch's FSDP2 marks its modules: Hugging Face transformers' is_fsdp_managed_module()
    # reads the first, and torch.compile (dynamo) reads both
    _is_fsdp_managed_module = True
    _fsdp_use_orig_params = True

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # nn.Sequential / nn.ModuleList slicing builds ``self.__class__(...)``: an unsharded original-class instance
        orig_cls = cls.__mro__[cls.__mro__.index(FSDPModule) + 1]
        self = orig_cls.__new__(orig_cls, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    def _fully_shard_states(self, recurse: bool) -> list[FSDPState]:
        found = (getattr(m, STATE_ATTR, None) for m in (self.modules() if recurse else [self]))  # type: ignore[attr-defined]
        return list({id(s): s for s in found if s is not None}.values())

    def _groups(self, recurse: bool) -> list[ParamGroup]:
        return [s.group for s in self._fully_shard_states(recurse) if s.group is not None]

    def _update(self, recurse: bool, change: Callable[[ParamGroup], GroupOptions]) -> None:
        """Every setter's one path: this module's group, and every group below it with ``recurse``, takes the options
        ``change`` returns for it (a ``dataclasses.replace`` of ``group.options``, which mypy checks by name)."""
        for group in self._groups(recurse):
            group.options = change(group)

    def no_sync(self) -> Any:
        """DDP's ``no_sync()`` does not exist here; raises with the fully_shard equivalent."""
        raise RuntimeError(f"{type(self).__name__} is sharded by fully_shard, which has no no_sync() context (that is "
                           "DistributedDataParallel's). To accumulate gradients without reducing them, call "
                           "model.set_requires_gradient_sync(False) before the accumulating backwards and "
                           "model.set_requires_gradient_sync(True) before the last one.")

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
        for group in self._groups(recurse=False):
            group.reshard()

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters now, e.g. to prefetch ahead of forward, which then finds them gathered.
        With ``async_op=True`` it returns an :class:`UnshardHandle` to wait on; otherwise it waits."""
        group = state_of(self).group  # type: ignore[arg-type]
        if group is not None:
            for p in group.params:
                p.check_materialized()
            group.unshard(async_op=True)
        handle = UnshardHandle()
        handle._group = group
        if async_op:
            return handle
        handle.wait()
        return None

    def reset_iter_state(self) -> None:
        """After an exception in forward or backward, return every group to its sharded, idle state, dropping the
        failed iteration's gradients. Call it on the root."""
        state_of(self).reset_iter_state()  # type: ignore[arg-type]

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last before the optimizer step. Only then does its end wait for the last
        gradient reduction (useful when pipelining microbatches)."""
        state_of(self).lazy_init().is_last_backward = is_last_backward  # type: ignore[arg-type]

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Turn gradient reduction on or off (off: gradients accumulate unsharded, locally, until a backward with it
        on). Applies to submodules too unless ``recurse=False``."""
        self._update(recurse, lambda g: replace(g.options, requires_gradient_sync=requires_gradient_sync))
        for group in self._groups(recurse) if not requires_gradient_sync else ():
            traced.make_sinks(group)  # for torch.compile of the whole model (a leaf cannot be made while tracing)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: turn the all-reduce across replicas on or off (the reduce-scatter still runs)."""
        self._update(recurse, lambda g: replace(g.options, requires_all_reduce=requires_all_reduce))

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether to free full parameters after forward (and gather them again in backward)."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward must be a bool, got {reshard_after_forward!r}")
        for state in self._fully_shard_states(recurse):
            state.reshard_after_forward = reshard_after_forward
            state.post_forward_ranks = {}  # a bool replaces reshard_after_forward=k, as in torch

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Whether to free full parameters after backward (False keeps them for the next forward, e.g. between
        gradient-accumulation microbatches)."""
        self._update(recurse, lambda g: replace(g.options, reshard_after_backward=reshard_after_backward))

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' parameters as this module's forward starts, instead of the implicit choice (the
        module that ran next in the previous iteration)."""
        state_of(self).forward_prefetch = _states_of(self, modules, "set_modules_to_forward_prefetch")  # type: ignore[arg-type]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' parameters as this module's backward starts, instead of the implicit choice (the
        module that ran before it in forward)."""
        state_of(self).backward_prefetch = _states_of(self, modules, "set_modules_to_backward_prefetch")  # type: ignore[arg-type]

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this module's summed gradients by ``factor`` instead of averaging over the ranks (this module's group
        only, as in torch: call it on each FSDP module)."""
        if not factor > 0:
            raise ValueError(f"gradient divide factor must be positive, got {factor!r}")
        self._update(False, lambda g: replace(g.options, gradient_divide_factor=float(factor)))

    def set_post_optim_event(self, event: torch.Event) -> None:
        """Make the next forward's first all-gather wait for ``event`` (recorded after the optimizer step) rather than
        for the whole current stream. No-op on the CPU."""
        state_of(self).lazy_init().post_optim_event = event  # type: ignore[arg-type]

    # -- torch 2.13's communication controls ---------------------------------------------

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Whether backward all-gathers this module's parameters again. ``False`` saves that all-gather for modules
        whose backward does not need the parameters (e.g. an embedding); backward must then really not use them."""
        self._update(False, lambda g: replace(g.options, unshard_in_backward=unshard_in_backward))

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """Reduce-scatter zeros for parameters that got no gradient this backward, so ranks using different parameters
        of a group (mixture-of-experts routing) still issue the same collective. A module skipping forward on some
        ranks must be gathered on every rank (prefetched, ``reshard_after_forward=False``): every rank then reduces
        it at the end of backward, found by one small all-reduce per forward (docs/troubleshooting.md).

        Example::

            >>> fully_shard(moe)  # router and all experts in one group
            FSDPMoE(...)
            >>> moe.set_reduce_scatter_unused_params(True)
            >>> moe(torch.randn(3, 16)).sum().backward()  # three tokens: at least one expert left out
        """
        self._update(recurse, lambda g: replace(g.options, reduce_scatter_unused_params=reduce_scatter_unused_params))

    def set_custom_all_gather(self, comm: Any) -> None:
        """Use ``comm`` for this module's all-gathers: torch's ``AllGather`` interface, i.e. ``comm.allocate(size, *,
        dtype, device)`` for the output buffer and ``comm(output_tensor, input_tensor, group, async_op=False)``
        returning a Work or None.

        Example::

            >>> class MyAllGather:
            ...     def allocate(self, size, *, dtype, device):
            ...         return torch.empty(size, dtype=dtype, device=device)
            ...     def __call__(self, output_tensor, input_tensor, group, async_op=False):
            ...         return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
            >>> fully_shard(block)
            FSDPTransformerBlock(...)
            >>> block.set_custom_all_gather(MyAllGather())
        """
        _check_comm(comm, "set_custom_all_gather")
        self._update(False, lambda g: replace(g.options, all_gather_comm=comm))

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Use ``comm`` for this module's reduce-scatters: torch's ``ReduceScatter`` interface, ``comm.allocate(...)``
        for both buffers and ``comm(output_tensor, input_tensor, group, op, async_op=False)``."""
        _check_comm(comm, "set_custom_reduce_scatter")
        self._update(False, lambda g: replace(g.options, reduce_scatter_comm=comm))

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: torch.Stream | None = None) -> None:
        """Call ``hook(output)`` on each reduced flat gradient shard (the reduce-scatter or, HSDP, the all-reduce
        output) before it is divided and accumulated, on the reduce-scatter stream or on ``stream`` (not with HSDP,
        as in torch), ordered after the reduction and before what follows.

        Example::

            >>> other_replicas = dist.new_group()  # e.g. the ranks of a mesh dimension not given to fully_shard
            >>> fully_shard(block)
            FSDPTransformerBlock(...)
            >>> block.set_all_reduce_hook(lambda g: dist.all_reduce(g, group=other_replicas), stream=torch.Stream())
        """
        def change(group: ParamGroup) -> GroupOptions:
            if stream is not None and group.mesh_info.replicate is not None:
                raise ValueError("set_all_reduce_hook: stream cannot be set when using HSDP (a 2-D mesh)")
            kept = group.options.all_reduce_hook_stream if stream is None else stream  # as in torch
            return replace(group.options, all_reduce_hook=hook, all_reduce_hook_stream=kept)

        self._update(False, change)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated in torch: use :meth:`set_gradient_divide_factor`."""
        warnings.warn("set_reduce_scatter_divide_factor is deprecated: use set_gradient_divide_factor", FutureWarning,
                      stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce this module's gradients with ``ReduceOp.SUM`` only (never ``AVG``), dividing in a separate step (this
        module's group only, as in torch)."""
        self._update(False, lambda g: replace(g.options, force_sum_reduction=enable))

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """Keep up to this many reductions (reduce-scatter inputs) in flight in backward (1: the previous group's is
        finished once the next is issued). The largest under a root applies, as in torch.

        Example::

            >>> fully_shard(model)
            FSDPTransformer(...)
            >>> model.set_reduce_scatter_max_input_buffers(2)  # more overlap, two inputs' memory
        """
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        from .tools.pools import check_symm_buffers

        def change(group: ParamGroup) -> GroupOptions:
            check_symm_buffers(self, max_input_buffers, getattr(group.options.reduce_scatter_comm, "symmetric", False))
            return replace(group.options, max_input_buffers=max_input_buffers)

        self._update(recurse, change)
        if (ctx := state_of(self).ctx) is not None:  # type: ignore[arg-type]
            ctx.resolve_max_in_flight()

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Run reduce-scatters on process groups of their own (one per set of shard ranks per call, created here: call
        it on every rank), so they can overlap with all-gathers."""
        made: dict[tuple[int, ...], dist.ProcessGroup] = {}

        def change(group: ParamGroup) -> GroupOptions:
            infos = {id(p.mesh_info): p.mesh_info for p in group.params}  # one per mesh of the call
            old = group.options.reduce_scatter_groups
            groups = {k: separate_group(i, made, old.get(k)) for k, i in infos.items()} if enable else {}
            return replace(group.options, reduce_scatter_groups=groups)

        self._update(recurse, change)

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Allocate this module's communication buffers from the process group's own allocator where its backend has
        one (NCCL: zero-copy transfers), else as before (gloo); not with a custom Comm.

        Example::

            >>> fully_shard(block)
            FSDPTransformerBlock(...)
            >>> block.set_allocate_memory_from_process_group_for_comm(True)  # each module: not recursive, as in torch
        """
        from .tools.pools import process_group_pool

        self._update(False, lambda group: process_group_pool(self, group, enable))

    def set_symm_mem_for_comm(self, backend: Literal["NCCL"] = "NCCL") -> None:
        """Allocate this module's all-gather output (and, with force-sum reduction, reduce-scatter buffers) from
        ``backend``'s symmetric memory, as torch does, for NCCL's symmetric-memory collectives; refused at once
        where the process group cannot (untested: needs NCCL on GPUs).

        Example::

            >>> fully_shard(block)
            FSDPTransformerBlock(...)
            >>> block.set_symm_mem_for_comm()  # an NCCL process group on GPUs  # doctest: +SKIP
        """
        from .tools.pools import symm_mem_pool

        self._update(False, lambda group: symm_mem_pool(self, group, backend))


def _check_comm(comm: Any, method: str) -> None:
    if not (callable(comm) and callable(getattr(comm, "allocate", None))):
        raise ValueError(f"{method} expects a Comm: an object with allocate(size, *, dtype, device) and __call__, "
                         f"got {type(comm).__name__}")


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Let several roots (e.g. pipeline stages) share one set of communication streams, so their buffers do not
    fragment memory across streams. Call it before their first forward. No effect on the CPU.

    Example::

        >>> stage0, stage1 = (fully_shard(block) for block in model.layers)  # two pipeline stages on this rank
        >>> share_comm_ctx([stage0, stage1])
    """
    states = _states_of(None, modules, "share_comm_ctx")
    shared = Streams(states[0].device) if states else None
    for state in states:
        state.shared_streams = shared


def _states_of(caller: nn.Module | None, modules: list[Any], method: str) -> list[FSDPState]:
    for i, m in enumerate(modules):
        if not isinstance(m, FSDPModule):
            from .tools.checks import name_in_model

            name = repr(type(m).__name__) if caller is None else name_in_model(caller, m)
            raise ValueError(f"{method} expects modules sharded by fully_shard, got {name} ({type(m).__name__}, item "
                             f"{i} of the list). Pass modules fully_shard was called on, e.g. model.layers[i + 1].")
    return [state_of(m) for m in modules]


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run fully_shard's forward hooks around ``module.<method_name>`` too.

    For methods other than ``forward`` that use the parameters (e.g. ``generate``). A no-op when ``module`` is not
    an :class:`FSDPModule`, so one code path serves both.

    Example::

        >>> class LM(Transformer):
        ...     def generate(self, prompt):  # greedy, one token per position; calls no forward of the root
        ...         return self.output(self.norm(self.tok_embeddings(prompt))).argmax(-1)
        >>> model = LM(args)
        >>> fully_shard(model)
        FSDPLM(...)
        >>> register_fsdp_forward_method(model, "generate")
        >>> model.generate(tokens).shape  # parameters gathered, then freed
        torch.Size([2, 8])
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


def _state(module: nn.Module) -> FSDPState | None:
    """``fully_shard.state(module)``: the module's fully_shard state, or None (as in torch, whose state object has
    other, private, members)."""
    return getattr(module, STATE_ATTR, None)


fully_shard.state = _state  # type: ignore[attr-defined]
