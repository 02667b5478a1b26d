"""Parameters tied across ``fully_shard`` calls (Note [tied parameters], docs/design.md): the refusal of a tie whose
calls shard it differently, and the one-time warning where two groups keep such a parameter gathered at once. Off the
hot path: the core imports this module only where a parameter is tied across calls. It imports no module above it
(``api``, ``state``: their objects are typed ``Any`` here), so the core's lazy imports of it close no import cycle."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch.nn as nn

from .checks import module_paths


def _user_class(module: nn.Module) -> type:
    """The class a module had before fully_shard swapped it for ``FSDP<Class>`` (bases: FSDPModule, the class)."""
    bases = type(module).__bases__
    swapped = len(bases) == 2 and bases[0].__name__ == "FSDPModule" and bases[0].__module__ == "fully_shard.api"
    return bases[1] if swapped else type(module)


def _names(fqn: str, modules: tuple[nn.Module, ...], owner: Any) -> tuple[str, str, str, str]:
    """(this call, this parameter, the owner's parameter, the owner's call), each by its name in the outermost model
    that holds both calls' modules where there is one, else by the calls' module classes and the parameters' names
    under them."""
    paths = module_paths(modules[0])

    def where(mods: tuple[nn.Module, ...], local: str) -> tuple[str, str] | None:  # (the call, the parameter)
        index, rest = local.split(".", 1) if len(mods) > 1 else ("0", local)
        base = paths.get(id(mods[int(index)]))
        # FSDP<cls>
        classes = [_user_class(m).__name__ for m in mods]
        calls = [f"{paths[id(m)]} ({c})" if paths.get(id(m)) else c for m, c in zip(mods, classes)]
        call = calls[0] if len(mods) == 1 else "[" + ", ".join(calls) + "]"
        return None if base is None else (call, f"{base}.{rest}" if base else rest)

    mine, theirs = where(modules, fqn), where(owner.modules, owner.fqn)
    if mine is None or theirs is None:
        return ", ".join(type(m).__name__ for m in modules), fqn, owner.fqn, owner.label
    return mine[0], mine[1], theirs[1], theirs[0]


def check_alike(fqn: str, modules: tuple[nn.Module, ...], first: Any,
                mine: tuple[Any, int, bool, tuple[Any, Any]]) -> None:
    """Raise for a call reaching a parameter an earlier call sharded (``first``, its ShardedParam) on another mesh, dim,
    offload policy or mixed precision ``(mesh info, shard dim, offloaded, (param dtype, reduce dtype))``: both calls
    gather the one sharded parameter and sum into one gradient, so they must shard and cast it alike."""
    theirs = (first.mesh_info, first.layout.dim, first.offload, (first.unsharded_dtype, first.reduce_dtype))
    if mine == theirs:
        return
    this_call, this_name, owner_name, owner_call = _names(fqn, modules, first.owner)
    said = {0: "mesh", 1: "shard dim (shard_placement_fn)", 2: "offload policy", 3: "mp_policy"}
    shown: dict[int, Callable[[Any], str]] = {0: lambda info: f"a mesh of shape {tuple(info.mesh.shape)}",
                                              1: lambda d: f"Shard({d})",
                                              2: lambda off: "CPUOffloadPolicy" if off else "no offload",
                                              3: lambda d: f"param_dtype {d[0]}, reduce_dtype {d[1]}"}
    diff = [f"{said[i]}: {shown[i](a)} here, {shown[i](b)} there" for i, (a, b) in enumerate(zip(mine, theirs))
            if a != b]
    raise ValueError(f"fully_shard({this_call}): parameter {this_name!r} is tied to (or shared with) parameter "
                     f"{owner_name!r}, which the fully_shard call on {owner_call} sharded differently "
                     f"({'; '.join(diff)}). A parameter tied across calls stays one sharded tensor that each call "
                     "gathers, so they must shard it alike: pass the same mesh, shard_placement_fn placement, "
                     "offload_policy and mp_policy to both calls, or both modules to one call, fully_shard([a, b]).")


def warn_held_twice(root: Any, states: list[Any]) -> None:
    """At lazy init, once per parameter tied across calls: where two or more of the groups gathering it keep it between
    forward and backward (``reshard_after_forward=False``, the root's default), each holds a full copy at the peak of
    activation memory, where one would do. Names the one call over its modules that holds one copy: those calls'
    modules, but for a call enclosing another's (the root), only the modules that use the parameter."""
    paths = {id(m): n for top in root.modules for n, m in top.named_modules()}
    by_group = {id(s.group): s for s in states if s.group is not None}
    seen: set[int] = set()
    for p in (p for s in states if s.group is not None for p in s.group.params):
        if len(p.tie.params) < 2 or id(p.tie) in seen:
            continue
        seen.add(id(p.tie))
        holding = [(by_group[id(q.group)], q) for q in p.tie.params
                   if by_group[id(q.group)].reshard_after_forward is False]
        if len(holding) < 2:
            continue
        inner: list[nn.Module] = []
        outer: list[nn.Module] = []
        for state, q in holding:
            others = [m for t, _ in holding if t is not state for m in t.modules]
            encloses = any(sub is m for top in state.modules for sub in top.modules() for m in others)
            if encloses:  # it holds the parameter whenever the others' modules run: only its uses join the call
                outer.extend(m for m, _ in q.uses)
            else:
                inner.extend(state.modules)
        modules = list({id(m): m for m in inner + outer}.values())
        grouping = ", ".join(paths.get(id(m)) or type(m).__name__ for m in modules)
        nbytes = p.size.numel() * p.unsharded_dtype.itemsize
        calls = " and ".join("the root's" if s.is_root
                             else "the call on [" + ", ".join(paths.get(id(m), "?") for m in s.modules) + "]"
                             for s, _ in holding)
        first, *names = (q.fqn for q in p.tie.params)
        warnings.warn(f"fully_shard: parameter {first!r} is tied across {len(p.tie.params)} fully_shard calls (as "
                      f"{', '.join(repr(n) for n in names)}), and {len(holding)} of their groups keep it gathered "
                      f"between forward and backward ({calls}, with reshard_after_forward=False, the root's default): "
                      f"{len(holding)} full copies of {nbytes:,} bytes at the peak of activation memory, where one "
                      "would do. One fully_shard call over the modules that use it holds one: "
                      f"fully_shard([{grouping}]) (by their names under the root), before the root's call. See "
                      "docs/design.md, tied parameters.", stacklevel=2)


def tie_notes(groups: list[tuple[str, list[Any]]]) -> list[str]:
    """The planner's notes (``tools/planner/api.py``: the name and ``ShardedParam``s of each group fully_shard made on
    its fake process group): each parameter tied across calls, the groups that gather it and what one call over its
    modules would save (Note [tied parameters])."""
    group = {id(p): name for name, params in groups for p in params}
    return [f"parameter {p.fqn!r} is tied to {first.fqn!r} (the group of {group[id(first)]}): the group of {name} "
            f"gathers it too, one more all-gather of {p.size.numel() * p.unsharded_dtype.itemsize:,} bytes (unsharded) "
            "per forward, and one reduce-scatter sums both groups' gradients, held until the later post-backward; one "
            "fully_shard call over the modules that use it gathers it once (docs/design.md, tied parameters across "
            "calls)"
            for name, params in groups for p in params if (first := p.tie.params[0]) is not p]
