"""``python -m fully_shard.plan``: the memory planner's command line (``fully_shard.tools.cli``).
Imported, this module (then ``fully_shard.plan``) still plans when called, as the function does."""

from __future__ import annotations

import sys
import types
from typing import Any

from .tools.cli import main
from .tools.plan import Plan
from .tools.plan import plan as _plan


class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Plan:
        return _plan(*args, **kwargs)


if __name__ == "__main__":
    sys.exit(main())
else:
    sys.modules[__name__].__class__ = _CallableModule
