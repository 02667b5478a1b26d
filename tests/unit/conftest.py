"""Every unit test starts and ends with fully_shard's one process-wide object, ``comm.monitor``, at its start-up
state."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fully_shard import comm


@pytest.fixture(autouse=True)
def _fresh_monitor() -> Iterator[None]:
    comm.monitor.reset()
    yield
    comm.monitor.reset()
