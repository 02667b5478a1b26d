"""The switch: torch's public FSDP2 names resolve to fully_shard's, for code you did not write.

accelerate (``fsdp_version=2``), the Hugging Face ``Trainer``, torchtitan's ``parallelize_*`` and others call
``torch.distributed.fsdp.fully_shard`` themselves. :func:`install` replaces torch's public FSDP2 names with
fully_shard's in the namespaces those frameworks import them from, and in the modules that already imported them;
:func:`uninstall` puts torch's objects back. No file is edited and none of torch's code runs: this module imports
torch's FSDP2 namespaces only to replace names there and to restore them (the one module of fully_shard that imports
them at all). For a script you cannot edit, the launcher does the same before running it::

    python -m fully_shard.switch train.py --lr 3e-4
    torchrun --nproc-per-node 8 -m fully_shard.switch -m my_package.train --lr 3e-4

What the switch reaches, and what it cannot, is in docs/frameworks.md.
"""

from __future__ import annotations

import ast
import gc
import importlib
import logging
import os
import runpy
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

from .. import api

__all__ = ["install", "uninstall", "main"]

log = logging.getLogger(__name__)

# torch's public FSDP2 names, each replaced by fully_shard's object of the same name
NAMES = ("fully_shard", "FSDPModule", "UnshardHandle", "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy",
         "register_fsdp_forward_method", "DataParallelMeshDims", "share_comm_ctx", "ShardPlacementResult")
OURS: dict[str, Any] = {name: getattr(api, name) for name in NAMES}
# torch's namespaces that re-export those names; torch's FSDP2 code lives in other modules (``_fully_shard._fsdp_*``,
# ``_fully_shard._fully_shard``), whose globals stay torch's, so a module torch sharded before install() keeps working
NAMESPACES = ("torch.distributed.fsdp", "torch.distributed.fsdp._fully_shard", "torch.distributed._composable.fsdp",
              "torch.distributed._composable.fsdp.fully_shard")
# torch's own clients of FSDP2 that drive torch's internals through the names (pipelining reads ``fully_shard.state(m)
# ._state_ctx``): imported before the names change, so they keep torch's and run fully_shard's modules as plain ones
_TORCH_CLIENTS = ("torch.distributed.pipelining",)

# (module, name, torch's object, ours) for every name install() replaced, in the order it replaced them
_patches: list[tuple[ModuleType, str, Any, Any]] = []
_torch_objects: dict[str, Any] = {}  # public name -> torch's object
_before: set[str] = set()  # the modules imported when install() ran


def install() -> list[str]:
    """Make torch's public FSDP2 names (``fully_shard``, ``FSDPModule``, ``MixedPrecisionPolicy``, ...) resolve to
    fully_shard's, so frameworks that call ``torch.distributed.fsdp.fully_shard`` for you shard with fully_shard.

    Replaced: each of those names in ``torch.distributed.fsdp``, ``torch.distributed.fsdp._fully_shard`` and the old
    ``torch.distributed._composable.fsdp`` (and its ``fully_shard`` module), and every module-level reference to
    torch's objects in modules already imported outside torch (a framework's ``from torch.distributed.fsdp import
    fully_shard`` that ran before install). A framework's ``isinstance(m, FSDPModule)`` then sees fully_shard's
    modules. Call it before the framework shards the model: a module torch's FSDP2 sharded earlier keeps running on
    torch's code and is not an instance of the switched ``FSDPModule`` (a warning counts them). References held
    elsewhere (a default argument, a ``functools.partial``) keep torch's objects; policies built from torch's
    classes are taken as fully_shard's by ``fully_shard()``. Calling it again changes nothing.

    Returns:
        what it replaced, as ``"module.name"`` strings (also logged at INFO by the ``fully_shard.switch`` logger).

    Example::

        >>> import fully_shard
        >>> fully_shard.install()  # before the framework shards
        ['torch.distributed.fsdp.fully_shard', ...]
        >>> from torch.distributed.fsdp import fully_shard as torch_fully_shard  # what accelerate, torchtitan... call
        >>> torch_fully_shard(model)  # fully_shard's
        FSDPTransformer(...)
        >>> isinstance(model, fully_shard.FSDPModule)
        True
        >>> restored = fully_shard.uninstall()  # torch's names are torch's again; sharded modules stay fully_shard's
    """
    if _patches:
        return _describe(_patches)
    for name in _TORCH_CLIENTS:
        importlib.import_module(name)
    # every namespace first: one imported after another was switched would take fully_shard's names as torch's
    namespaces = [importlib.import_module(name) for name in NAMESPACES]
    for module in namespaces:
        for name in NAMES:
            if name in vars(module):
                _torch_objects[name] = vars(module)[name]
                _replace(module, name, OURS[name])
    public_name = {id(original): name for _, name, original, _ in _patches}
    for module in _modules(outside_torch=True):  # modules that bound torch's objects before install
        for attr, value in list(vars(module).items()):
            if id(value) in public_name:
                _replace(module, attr, OURS[public_name[id(value)]])
    _before.update(sys.modules)
    done = _describe(_patches)
    log.info("fully_shard.install(): torch's FSDP2 names now resolve to fully_shard's: %s", _summary(done))
    _warn_torch_sharded()
    return done


def uninstall() -> list[str]:
    """Undo :func:`install`: every name it replaced is torch's object again (the same object: ``is`` holds), unless
    something rebound it since, and so is every name a module imported while the switch was on took from torch's
    namespaces (read from its ``from ... import`` statements; a name it imported from fully_shard stays).
    Modules sharded while the switch was on stay fully_shard's and keep working.

    Returns:
        what it restored, as ``"module.name"`` strings.

    Example::

        >>> import fully_shard
        >>> replaced = fully_shard.install()
        >>> fully_shard.uninstall()
        ['torch.distributed.fsdp.fully_shard', ...]
        >>> import torch.distributed.fsdp
        >>> assert torch.distributed.fsdp.fully_shard is not fully_shard.fully_shard  # torch's own again
    """
    if not _patches:
        return []
    _patches.extend(_imported_while_on())
    restored = []
    while _patches:
        module, name, original, ours = _patches.pop()
        if vars(module).get(name) is ours:
            setattr(module, name, original)
            restored.append((module, name, original, ours))
    _before.clear()
    done = _describe(restored[::-1])
    log.info("fully_shard.uninstall(): restored torch's %s", _summary(done))
    return done


def _modules(outside_torch: bool) -> list[ModuleType]:
    """The imported modules, but fully_shard's (and torch's, with ``outside_torch``)."""
    skip = ("torch", "fully_shard") if outside_torch else ("fully_shard",)
    # vars(): a lazy module's attribute lookup would import what it has not yet
    return [m for m in list(sys.modules.values())
            if isinstance(m, ModuleType) and str(vars(m).get("__name__", "")).split(".")[0] not in skip]


def _imported_while_on() -> list[tuple[ModuleType, str, Any, Any]]:
    """(module, name, torch's object, ours) for each name that a module imported while the switch was on bound with
    ``from <one of NAMESPACES> import ...``: it holds fully_shard's object now, and torch's belongs there."""
    ours = {id(obj) for obj in OURS.values()}
    found = []
    for module in _modules(outside_torch=False):
        path = vars(module).get("__file__")
        if vars(module).get("__name__") in _before or not any(id(v) in ours for v in vars(module).values()):
            continue
        try:
            tree = ast.parse(Path(str(path)).read_text())
        except (OSError, SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            for alias in node.names if isinstance(node, ast.ImportFrom) and node.module in NAMESPACES else []:
                bound = alias.asname or alias.name
                if alias.name in OURS and vars(module).get(bound) is OURS[alias.name]:
                    found.append((module, bound, _torch_objects[alias.name], OURS[alias.name]))
    return found


def _replace(module: ModuleType, name: str, ours: Any) -> None:
    _patches.append((module, name, vars(module)[name], ours))
    setattr(module, name, ours)


def _describe(patches: list[tuple[ModuleType, str, Any, Any]]) -> list[str]:
    return [f"{module.__name__}.{name}" for module, name, _, _ in patches]


def _summary(done: list[str]) -> str:
    """``["m.a", "m.b", "n.a"]`` as ``"m.{a, b}; n.a"``."""
    by_module: dict[str, list[str]] = {}
    for entry in done:
        module, _, name = entry.rpartition(".")
        by_module.setdefault(module, []).append(name)
    return "; ".join(f"{m}.{{{', '.join(names)}}}" if len(names) > 1 else f"{m}.{names[0]}"
                     for m, names in by_module.items())


def _warn_torch_sharded() -> None:
    torch_module = _torch_objects["FSDPModule"]
    found = [type(obj).__name__ for obj in gc.get_objects() if issubclass(type(obj), torch_module)]
    if found:
        warnings.warn(f"fully_shard.install(): {len(found)} module(s) are already sharded by torch's FSDP2 (e.g. "
                      f"{found[0]}); they keep running on torch's code and isinstance(m, FSDPModule) is False for them "
                      "from now on. Call fully_shard.install() before the framework shards the model.", stacklevel=3)


def main(argv: list[str] | None = None) -> None:
    """The launcher: ``python -m fully_shard.switch SCRIPT [ARGS...]`` or ``python -m fully_shard.switch -m MODULE
    [ARGS...]`` runs the script or module as ``__main__`` after :func:`install`, as ``python SCRIPT ARGS`` would
    (``sys.argv``, ``sys.path[0]``), and prints what it replaced on rank 0 (``RANK``) to stderr.

    Example::

        $ torchrun --nproc-per-node 2 -m fully_shard.switch train.py --steps 10
        $ accelerate launch -m fully_shard.switch train.py
    """
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help") or args == ["-m"]:
        sys.exit("usage: python -m fully_shard.switch SCRIPT [ARGS...]  |  python -m fully_shard.switch -m MODULE "
                 "[ARGS...]\n"
                 "runs SCRIPT (or MODULE) with torch's FSDP2 names resolving to fully_shard's (fully_shard.install())")
    done = install()
    if os.environ.get("RANK", "0") == "0":
        print(f"fully_shard.switch: torch's FSDP2 names now resolve to fully_shard's: {_summary(done)}",
              file=sys.stderr)
    if args[0] == "-m":
        sys.argv = args[1:]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
        runpy.run_path(args[0], run_name="__main__")

