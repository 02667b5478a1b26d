"""Record the explicit host <-> device moves (``Tensor.to(<device>, ...)``) a process makes, for tests.

Usage (inside a ``run_distributed`` body)::

    from tests.transfers import record_transfers

    shards = {p.to_local().untyped_storage().data_ptr() for p in model.parameters()}
    with record_transfers(shards) as log:
        loss_fn(model(x), x).backward()
    # [Transfer(source="shard", non_blocking=True, cast=False, stream=None), ...]

The method ``torch.Tensor.to`` is patched rather than watched through a mode: torch-function modes do not reach the
backward hooks, and on a CPU mesh a move to the (same) device dispatches nothing. Only calls that name a device are
logged; a cast to a dtype alone is not a transfer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

__all__ = ["Transfer", "record_transfers"]


class Transfer(NamedTuple):
    source: str  # "shard": reads an offloaded shard (its storage is in ``host_shards``); "other": anything else
    non_blocking: bool
    cast: bool  # the same call changes the dtype
    stream: Any  # what ``where()`` said when it was called (e.g. the recording stream double's current stream)


@contextlib.contextmanager
def record_transfers(host_shards: set[int], where: Callable[[], Any] = lambda: None,
                     log: list[Any] | None = None) -> Iterator[list[Any]]:
    """Log every ``Tensor.to`` that names a device, until the block exits (into ``log`` if given: e.g. the stream
    double's, to see the transfers among the stream operations)."""
    log = [] if log is None else log
    original = torch.Tensor.to

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        assert log is not None
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None:
            source = "shard" if self.untyped_storage().data_ptr() in host_shards else "other"
            log.append(Transfer(source, non_blocking, dtype is not None and dtype != self.dtype, where()))
        return original(self, *args, **kwargs)

    torch.Tensor.to = to  # type: ignore[method-assign, assignment]
    try:
        yield log
    finally:
        torch.Tensor.to = original  # type: ignore[method-assign]
