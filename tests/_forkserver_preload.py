"""Imported by the test harness's fork server before it forks any worker (``tests.harness._context``)."""

from tests.harness import preload

preload()
