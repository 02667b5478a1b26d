"""Pytest configuration shared by all tests."""

from __future__ import annotations

import gc

# Python's automatic collection of its oldest generation walks every live object, and importing torch, the test
# modules and what they import makes several: half of each pytest process's collection time (2.1 of 4.3 CPU-s here).
# Off until the tests are collected; then what was imported is frozen out of every later collection (the in-process
# tests' and pytest's own at the end) and the automatic collection runs again.
gc.disable()

import pytest  # noqa: E402
from _pytest.terminal import TerminalReporter  # noqa: E402

from tests.harness import THREAD_LIMIT, pool_starts, shutdown_pools, thread_peaks  # noqa: E402


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session: pytest.Session) -> object:
    yield
    gc.freeze()
    gc.enable()


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
    gc.enable()  # had no collection run (an xdist controller may not collect)
    shutdown_pools()
