"""Imported by the test harness's fork server before it forks any worker (``tests.harness._context``). Python's
automatic garbage collection is off while it imports (each collection of the oldest generation walks everything
imported so far); ``preload`` freezes what it imported and turns it on again."""

import gc

gc.disable()

from tests.harness import preload  # noqa: E402

preload()
