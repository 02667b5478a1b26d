"""The name ``tests/test_plan.py`` imports the storage tracker by.

The tests and the benchmarks share one tracker, ``benchmarks.memory.StorageTracker``; its
:meth:`~benchmarks.memory.StorageTracker.report` is the view test_plan.py reads.
"""

from benchmarks.memory import StorageTracker as LiveStorages

__all__ = ["LiveStorages"]
