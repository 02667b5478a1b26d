"""Tools beyond torch's FSDP2, built on fully_shard's public API: the memory planner,
communication trace, wrap policies and a collective debug mode.

Example::

    >>> from fully_shard.tools import apply_fully_shard, debug_collectives, trace_comm
    >>> apply_fully_shard(model, module_classes={TransformerBlock})  # each block, then the root
    FSDPTransformer(...)
    >>> with debug_collectives(), trace_comm() as trace:  # every rank issues the same collectives; record them
    ...     model(tokens).sum().backward()
"""

from ..layout import ShardLayout, shard_layout
from .clip import clip_grad_norm_
from .debug import CollectiveMismatchError, debug_collectives, is_debug, set_debug
from .models import PRESETS, hf_model, load_model
from .plan import GroupPlan, Plan, plan
from .plan_plot import memory_figure, save_memory_plot
from .trace import CommTrace, trace_comm
from .wrap import apply_fully_shard

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
