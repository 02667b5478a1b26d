"""The core's checks that run once, or only on the way to an error: the root's first-forward refusals (a model whose own
parameters nobody shards, ignored tensors that are no parameter, a parameter replaced after fully_shard) and module
names for messages. Off the hot path: the core imports this module where it needs it. It imports no module above it
(``api``, ``state``: their objects are typed ``Any`` here), so the core's lazy imports of it close no import cycle."""

from __future__ import annotations

import gc
import sys
import warnings
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from ..compat import replicated_params
from ..param import OWNER_ATTR, STATE_ATTR


def _stack() -> Iterator[FrameType]:
    """The frames on the Python stack, innermost first."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        yield frame
        frame = frame.f_back


def callers_self() -> Iterator[Any]:
    """The ``self`` of every frame on the Python stack, innermost first (None where there is none)."""
    return (frame.f_locals.get("self") for frame in _stack())


def check_enclosing_model(root: Any) -> None:
    """Refuse a root inside a model whose own trainable parameters nobody shards (the forgotten
    ``fully_shard(model)``: each rank would train its own copy of them). The enclosing model is the outermost
    module whose forward is running, on the Python stack."""
    mine = set(root.modules)
    outer: nn.Module | None = None
    for obj in callers_self():
        if (isinstance(obj, nn.Module) and obj not in mine and obj is not outer
                and any(m in mine for m in obj.modules())):
            outer = obj
    if outer is None:
        return
    known: set[int] = set()  # the parameters some fully_shard call shards or ignores, or DDP or replicate averages
    for sub in outer.modules():
        if isinstance(sub, DistributedDataParallel):
            known.update(id(p) for n, p in sub.module.named_parameters() if n not in sub.parameters_to_ignore)
        known.update(id(p) for p in replicated_params(sub))
        state = getattr(sub, STATE_ATTR, None)
        if state is not None:
            known.update(id(p) for p in state.ignored_params)
            for p in state.group.params if state.group is not None else ():
                known.update((id(p.sharded_param), id(p.unsharded_param)))
    loose = [n for n, p in outer.named_parameters() if p.requires_grad and id(p) not in known
             and not isinstance(p, DTensor)]
    if loose:
        shown = ", ".join(repr(n) for n in loose[:8]) + (f" and {len(loose) - 8} more" if len(loose) > 8 else "")
        where = next(n for n, m in outer.named_modules() if m in mine)
        cls = type(root.modules[0]).__name__.removeprefix("FSDP")
        raise RuntimeError(f"fully_shard: the sharded module {where!r} ({cls}) runs inside {type(outer).__name__}, "
                           "which is not sharded but has trainable parameters fully_shard does not manage: "
                           f"{shown}. Their gradients would never be averaged across ranks, so every rank would "
                           f"train its own copy. Call fully_shard on the {type(outer).__name__} too, after its "
                           "blocks (e.g. `fully_shard(model)` last); parameters synchronised by other means go in "
                           "that call's ignored_params.")


def check_ignored(root: Any, states: list[Any]) -> list[nn.Parameter]:
    """Refuse an ignored tensor that is no module's parameter (e.g. a detached EMA copy of one): it leaves nothing out
    of sharding. Decided here, where the whole model is known: torch's idiom passes one set to every call, so a call's
    set also holds other calls' parameters (some replaced by the sharded ones), and other roots'. Returns the ignored
    parameters of modules outside this model (another root's, or an EMA model's: :func:`warn_foreign_ignored`)."""
    left = {id(t): t for s in states for t in s.ignored_params if OWNER_ATTR not in t.__dict__}
    for p in (p for m in root.modules for p in m.parameters()) if left else ():
        left.pop(id(p), None)
    foreign = []
    if left:  # another model's parameters, maybe: a scan of every live object (rare)
        for obj in gc.get_objects():
            if issubclass(type(obj), nn.Module):
                for p in obj._parameters.values():
                    if p is not None and left.pop(id(p), None) is not None:
                        foreign.append(p)
    if not left:
        return foreign
    calls = [s._name() for s in states if any(id(t) in left for t in s.ignored_params)]
    buffers = {id(b): n for m in root.modules for n, b in m.named_buffers(remove_duplicate=False)}
    shown = "; ".join(f"a {type(t).__name__} of shape {tuple(t.shape)}, {t.dtype}{_known_as(t, buffers)}"
                      for t in left.values())
    raise ValueError("fully_shard: ignored_params of the call on "
                     f"{', '.join(calls[:3])}{' ...' if len(calls) > 3 else ''} holds {len(left)} tensor(s) that "
                     f"are not a parameter of any module: {shown}. ignored_params keeps a parameter out of "
                     "sharding only when it holds that very object: a copy of one (an EMA or state-dict copy) or a "
                     "buffer leaves everything sharded. Pass the module's own parameters, e.g. "
                     "ignored_params={model.norm.weight}, or drop these from the set.")


def warn_foreign_ignored(root: Any, states: list[Any], foreign: list[nn.Parameter]) -> None:
    """Warn once about an ignored parameter of a module outside this model that no ``fully_shard`` call keeps out of
    sharding, e.g. ``ema.norm.weight`` of an EMA copy where ``model.norm.weight`` was meant: it changes nothing, and the
    parameter meant is sharded. Called at the root's second forward rather than its first, so that another model
    sharded after this one's first step with the same set (torch's idiom, several roots) has made its calls."""
    kept: set[int] = set()  # parameters some call keeps out: in its set and under its modules
    owners: dict[int, tuple[nn.Module, str]] = {}  # id(parameter) -> (a module holding it, its name there)
    wanted = {id(p) for p in foreign}
    for obj in gc.get_objects():
        if issubclass(type(obj), nn.Module):
            state = obj.__dict__.get(STATE_ATTR)
            if state is not None:
                kept.update(id(p) for p in obj.parameters() if p in state.ignored_params)
            for name, p in obj._parameters.items():
                if id(p) in wanted:
                    owners.setdefault(id(p), (obj, name))
    loose = [p for p in foreign if id(p) not in kept and id(p) in owners]
    if not loose:
        return
    mine = {n: p for m in root.modules for n, p in m.named_parameters()}
    shown = []
    for p in loose:
        module, name = owners[id(p)]
        model = outermost(module)
        where = f"{next(n for n, m in model.named_modules() if m is module)}.{name}".lstrip(".")
        meant = mine.get(where)
        shown.append(f"{where!r} of another {type(model).__name__}" + (
            f" (this model's own {where!r} is sharded)" if isinstance(meant, DTensor) else ""))
    calls = [s._name() for s in states if any(p in s.ignored_params for p in loose)]
    more = " ..." if len(calls) > 3 else ""
    warnings.warn(f"fully_shard: ignored_params of the call on {', '.join(calls[:3])}{more} "
                  f"holds {len(loose)} parameter(s) of modules outside this model that no fully_shard call keeps out "
                  f"of sharding: {'; '.join(shown)}. ignored_params keeps out only the very parameters of the model "
                  "being sharded: one of a copy (an EMA model) changes nothing. Pass the model's own, e.g. "
                  "ignored_params={model.norm.weight}, or drop these from the set.", stacklevel=2)


def _known_as(t: torch.Tensor, buffers: dict[int, str]) -> str:
    """`` (the buffer 'x')``, `` (held as 'k' in a dict)`` or nothing: a name for an ignored tensor in a message (not a
    local variable's: the stack's frames are left out)."""
    if id(t) in buffers:
        return f" (the buffer {buffers[id(t)]!r})"
    frames = {id(frame.f_locals) for frame in _stack()}
    for d in gc.get_referrers(t):
        if type(d) is dict and id(d) not in frames:
            key = next((k for k, v in d.items() if v is t and isinstance(k, str)), None)
            if key is not None:
                return f" (held as {key!r} in a dict)"
    return ""


def raise_replaced(state: Any, fqn: str, module: nn.Module, name: str, now: Any) -> None:
    """The error for a parameter replaced after fully_shard (``FSDPState._check_registered_params``)."""
    root = state.modules[0]
    where = next((f"{m_name}.{name}".lstrip(".") for m_name, m in root.named_modules() if m is module), fqn)
    new = next((n for n, q in root.named_parameters(remove_duplicate=False) if q is now and n != where), None)
    what = (f"the parameter {new!r}" if new is not None
            else f"a {type(now).__name__} that is not a parameter of the model")
    raise RuntimeError(f"fully_shard: parameter {where!r} was replaced after fully_shard by {what} (e.g. weights "
                       f"tied afterwards: `model.{where} = model.{new or '...'}`). fully_shard gathers and reduces "
                       "the parameter it registered, so training would silently ignore the change. Tie or replace "
                       "parameters before calling fully_shard.")


def module_paths(module: nn.Module) -> dict[int, str]:
    """id(module) -> its name in the outermost live model holding ``module`` (through parents' ``_modules``, found by a
    scan of the garbage collector's live objects): for error messages only."""
    paths: dict[int, str] = {}
    for name, m in outermost(module).named_modules(remove_duplicate=False):
        paths.setdefault(id(m), name)
    return paths


def outermost(module: nn.Module) -> nn.Module:
    """The outermost live module holding ``module`` (itself when none does): a scan of every live object."""
    parents: dict[int, nn.Module] = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), nn.Module):
            for child in obj._modules.values():
                if child is not None:
                    parents.setdefault(id(child), obj)
    seen = {id(module)}
    while id(module) in parents and id(parents[id(module)]) not in seen:
        module = parents[id(module)]
        seen.add(id(module))
    return module


def name_in_model(anchor: nn.Module, module: Any) -> str:
    """``module``'s fully-qualified name in the outermost model that holds ``anchor``."""
    name = module_paths(anchor).get(id(module))
    if name is None:
        return repr(type(module).__name__)
    return repr(name) if name else "the root module"
