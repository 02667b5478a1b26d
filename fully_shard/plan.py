"""``python -m fully_shard.plan``: the planner's command line. Never imported: ``fully_shard.plan`` is the planner
function, which this module would hide."""

import sys

if __name__ != "__main__":
    raise ImportError("fully_shard.plan is the memory planner function (call fully_shard.plan(model, mesh_shape, "
                      "...)); this file only runs its command line: python -m fully_shard.plan --help")

import gc  # noqa: E402

# Python's automatic collection of the oldest generation walks every object imported so far, several times while
# torch imports: off while importing, then what was imported is frozen out of the planner's collections
gc.disable()
from fully_shard.tools.planner.cli import main  # noqa: E402  # after the check: importing this file is an error

gc.freeze()
gc.enable()
sys.exit(main())
