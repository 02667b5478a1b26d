"""Tools built on fully_shard's public API: communication trace, wrap policies, debug mode.

Example::

    >>> from fully_shard.tools import apply_fully_shard, debug_collectives, trace_comm
"""

from .debug import CollectiveMismatchError, debug_collectives
from .trace import CommTrace, trace_comm
from .wrap import apply_fully_shard

__all__ = ["apply_fully_shard", "trace_comm", "CommTrace", "debug_collectives", "CollectiveMismatchError"]
