"""Pytest configuration shared by all tests."""

from __future__ import annotations

import pytest
from _pytest.terminal import TerminalReporter

from tests.harness import THREAD_LIMIT, pool_starts, shutdown_pools, thread_peaks


def pytest_terminal_summary(terminalreporter: TerminalReporter) -> None:
    """The most threads a pooled worker held during a call, per world size (a call fails over the limit), and how many
    pools were started (each costs its ranks' start-up: a failed call replaces its pool)."""
    peaks = thread_peaks()
    if peaks:
        seen = ", ".join(f"{n} (world size {w}, rank {rank}, {what})" for w, (n, what, rank) in sorted(peaks.items()))
        terminalreporter.write_line(f"tests.harness: most threads in a worker (limit {THREAD_LIMIT}): {seen}")
        started = ", ".join(f"world size {w}: {n}" for w, n in sorted(pool_starts().items()))
        terminalreporter.write_line(f"tests.harness: worker pools started: {started}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop the cached multi-process worker pools of tests.harness."""
    shutdown_pools()
