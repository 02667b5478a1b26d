"""Pytest configuration shared by all tests."""

from __future__ import annotations

import pytest
from _pytest.terminal import TerminalReporter

from tests.harness import THREAD_LIMIT, shutdown_pools, thread_peaks


def pytest_terminal_summary(terminalreporter: TerminalReporter) -> None:
    """The most threads a pooled worker held during a call, per world size (each call fails over the limit)."""
    peaks = thread_peaks()
    if peaks:
        seen = ", ".join(f"{n} (world size {w}, rank {rank}, {what})" for w, (n, what, rank) in sorted(peaks.items()))
        terminalreporter.write_line(f"tests.harness: most threads in a worker (limit {THREAD_LIMIT}): {seen}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop the cached multi-process worker pools of tests.harness."""
    shutdown_pools()
