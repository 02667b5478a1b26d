"""Process hygiene for the test harness's workers and the benchmarks' ranks."""

from __future__ import annotations

import signal
import sys


def die_with_parent() -> None:
    """Linux: ask the kernel to SIGKILL this process when its parent dies, so no worker (or
    benchmark rank) outlives a test run that was killed hard (a CI timeout, SIGKILL)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # pragma: no cover - no libc prctl
            pass
