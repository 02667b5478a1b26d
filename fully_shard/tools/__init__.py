"""Tools beyond torch's FSDP2, built on fully_shard's public API: the memory planner,
communication trace, wrap policies and a collective debug mode.

Each is loaded when first used (``import fully_shard`` loads none of them).

Example::

    >>> from fully_shard.tools import apply_fully_shard, debug_collectives, trace_comm
    >>> apply_fully_shard(model, module_classes={TransformerBlock})  # each block, then the root
    FSDPTransformer(...)
    >>> with debug_collectives(), trace_comm() as trace:  # every rank issues the same collectives; record them
    ...     model(tokens).sum().backward()
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ..layout import ShardLayout, shard_layout

if TYPE_CHECKING:  # the names below, for type checkers; loaded by __getattr__ at first use
    from .clip import clip_grad_norm_
    from .debug import CollectiveMismatchError, debug_collectives, is_debug, set_debug
    from .init import broadcast_full_state_dict, materialize  # noqa: F401  # fully_shard's names, loaded from here
    from .planner import PRESETS, GroupPlan, Plan, hf_model, load_model, memory_figure, plan, save_memory_plot
    from .trace import CommTrace, trace_comm
    from .wrap import apply_fully_shard

# name -> the module (relative to this package) that defines it
_WHERE = {
    "clip_grad_norm_": ".clip",
    **dict.fromkeys(("materialize", "broadcast_full_state_dict"), ".init"),
    **dict.fromkeys(("plan", "Plan", "GroupPlan", "memory_figure", "save_memory_plot", "PRESETS", "hf_model",
                     "load_model"), ".planner"),
    **dict.fromkeys(("apply_fully_shard",), ".wrap"),
    **dict.fromkeys(("trace_comm", "CommTrace"), ".trace"),
    **dict.fromkeys(("debug_collectives", "CollectiveMismatchError", "is_debug", "set_debug"), ".debug"),
}

__all__ = [
    "clip_grad_norm_",
    "plan",
    "Plan",
    "GroupPlan",
    "shard_layout",
    "ShardLayout",
    "memory_figure",
    "save_memory_plot",
    "PRESETS",
    "hf_model",
    "load_model",
    "apply_fully_shard",
    "trace_comm",
    "CommTrace",
    "debug_collectives",
    "CollectiveMismatchError",
    "is_debug",
    "set_debug",
]


def __getattr__(name: str) -> Any:
    """Load the tool that defines ``name`` at its first use (PEP 562)."""
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name], __name__), name)
    globals()[name] = value
    return value
