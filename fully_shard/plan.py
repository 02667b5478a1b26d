"""``python -m fully_shard.plan``: the memory planner's command line (``fully_shard.tools.planner.cli``).

Only run, never imported: ``fully_shard.plan`` is the planner function itself, which importing this file as a module
would hide.
"""

import sys

if __name__ != "__main__":
    raise ImportError("fully_shard.plan is the memory planner function (call fully_shard.plan(model, mesh_shape, "
                      "...)); this file only runs its command line: python -m fully_shard.plan --help")

from fully_shard.tools.planner.cli import main  # noqa: E402  # after the check: importing this file is an error

sys.exit(main())
