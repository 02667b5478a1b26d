"""Pytest configuration shared by all tests."""

from __future__ import annotations

import pytest

from tests.harness import shutdown_pools


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop the cached multi-process worker pools of tests.harness."""
    shutdown_pools()
