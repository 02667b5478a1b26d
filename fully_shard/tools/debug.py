"""Debug mode: check that every rank issues the same collectives, in the same order."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .. import comm

__all__ = ["debug_collectives", "CollectiveMismatchError"]

CollectiveMismatchError = comm.CollectiveMismatchError


@contextlib.contextmanager
def debug_collectives() -> Iterator[None]:
    """Within this context, before each collective fully_shard issues, the ranks of its group
    exchange what they are about to issue (kind, group, size, dtype) and raise
    :class:`CollectiveMismatchError` naming the first divergence, instead of hanging in
    mismatched collectives. Costs one small extra collective per collective: for debugging.
    Enter it on every rank. The environment variable ``FULLY_SHARD_DEBUG=1`` turns the
    same checks on for the whole run, without changing code.

    Example::

        >>> with fully_shard.tools.debug_collectives():
        ...     loss = model(x).sum(); loss.backward()
    """
    was_on = comm.is_debug()  # e.g. FULLY_SHARD_DEBUG=1: stays on after the context
    comm.set_debug(True)
    try:
        yield
    finally:
        comm.set_debug(was_on)
