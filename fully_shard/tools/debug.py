"""Debug mode: check that every rank issues the same collectives, in the same order."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from .. import comm

__all__ = ["debug_collectives", "CollectiveMismatchError", "is_debug", "set_debug"]


class CollectiveMismatchError(RuntimeError):
    """Debug mode found that the ranks of a group are about to issue different collectives."""


class _SameEverywhere:
    """A ``comm.monitor`` check: the ranks of the group exchange what they are about to issue (one small
    ``all_gather_object``) and raise on the first divergence instead of hanging in mismatched collectives."""

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}  # collectives issued per group

    def __call__(self, kind: str, what: str, group: dist.ProcessGroup, inp: torch.Tensor) -> None:
        index = self.counts.get(id(group), 0)
        self.counts[id(group)] = index + 1
        gathered: list[Any] = [None] * group.size()
        dist.all_gather_object(gathered, (kind, what, inp.numel(), str(inp.dtype)), group=group)
        if any(f != gathered[0] for f in gathered):
            ranks = dist.get_process_group_ranks(group)
            lines = "\n".join(f"  rank {r}: {f[0]} {f[1]!r}, {f[2]} elements of {f[3]}"
                              for r, f in zip(ranks, gathered))
            raise CollectiveMismatchError(
                f"fully_shard debug mode: collective #{index} of the group of ranks {ranks} differs "
                f"across ranks:\n{lines}\nEvery rank must run the same modules in the same order "
                "(data-dependent control flow around fully_shard modules, or a module used on some "
                f"ranks only, makes them diverge).{_TIED_HINT if any('(with tied ' in f[1] for f in gathered) else ''}"
            )


# Note [tied parameters]: a reduce-scatter's description names the tied parameters whose summed gradient it carries
# (ParamGroup._reduce_scatter: "(with tied 'name', ...)")
_TIED_HINT = (
    " A parameter tied across fully_shard calls is reduced once per backward, by the last of the groups gathering it "
    "to reach its post-backward (the others keep their gradient for it): so every rank must also run forward and "
    "backward through the same groups that use it, under grad mode alike."
)


def is_debug() -> bool:
    """Whether the debug mode is on (``FULLY_SHARD_DEBUG=1``, :func:`set_debug` or inside :func:`debug_collectives`).

    Example::

        >>> from fully_shard.tools import debug_collectives, is_debug
        >>> with debug_collectives():
        ...     assert is_debug()
        >>> is_debug()
        False
    """
    return any(isinstance(c, _SameEverywhere) for c in comm.monitor.checks)


def set_debug(enabled: bool) -> None:
    """Turn the debug mode on or off for the whole process (see :func:`debug_collectives`).

    Example::

        >>> from fully_shard.tools import is_debug, set_debug
        >>> set_debug(True)  # as FULLY_SHARD_DEBUG=1 does when fully_shard is imported
        >>> is_debug()
        True
        >>> set_debug(False)
    """
    comm.monitor.checks = [c for c in comm.monitor.checks if not isinstance(c, _SameEverywhere)]
    if enabled:
        comm.monitor.checks.append(_SameEverywhere())


@contextlib.contextmanager
def debug_collectives() -> Iterator[None]:
    """Within this context, before each collective fully_shard issues, the ranks of its group
    exchange what they are about to issue (kind, group, size, dtype) and raise
    :class:`CollectiveMismatchError` naming the first divergence, instead of hanging in
    mismatched collectives. Costs one small extra collective per collective: for debugging.
    Enter it on every rank. The environment variable ``FULLY_SHARD_DEBUG=1`` turns the
    same checks on for the whole run, without changing code.

    Example::

        >>> from fully_shard.tools import debug_collectives
        >>> sharded = [fully_shard(m) for m in (*model.layers, model)]  # each block, then the root
        >>> with debug_collectives():
        ...     loss = model(x).sum(); loss.backward()
    """
    was_on = is_debug()  # e.g. FULLY_SHARD_DEBUG=1: stays on after the context
    set_debug(True)
    try:
        yield
    finally:
        set_debug(was_on)
