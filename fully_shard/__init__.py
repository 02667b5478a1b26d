"""fully_shard: per-module fully sharded data parallelism (FSDP2 / ZeRO-3) for PyTorch.

Drop-in compatible with ``torch.distributed.fsdp.fully_shard``::

    from fully_shard import fully_shard

or, for a framework that calls torch's ``fully_shard`` for you (accelerate, the Hugging Face Trainer, torchtitan)::

    import fully_shard; fully_shard.install()
"""

from __future__ import annotations

import gc
import importlib
import os
from typing import TYPE_CHECKING, Any

# Python's automatic collections while torch and this package import (each one of the oldest generation walks every
# object made so far, and the imports make a few hundred thousand): `import fully_shard` took 1.85 s with them, 1.5 s
# paused, on a quiet core. Paused here only, and back on as the importer had it, whatever the imports raise.
_collecting = gc.isenabled()
gc.disable()
try:
    from .api import (
        FSDPModule,
        ShardedDeepcopyError,
        ShardedUsageError,
        ShardPlacementResult,
        UnshardHandle,
        fully_shard,
        register_fsdp_forward_method,
        share_comm_ctx,
    )
    from .comm import DEBUG_ENV, CollectiveError
    from .policy import CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy
    from .traced import compile_options, compile_whole
finally:
    if _collecting:
        gc.enable()

if TYPE_CHECKING:  # the names below, for type checkers; loaded by __getattr__ at first use
    from .switch import install, uninstall
    from .tools import CollectiveMismatchError, broadcast_full_state_dict, clip_grad_norm_, materialize, plan

__all__ = [
    # torch's FSDP2 names
    "fully_shard", "FSDPModule", "UnshardHandle", "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy",
    "register_fsdp_forward_method", "DataParallelMeshDims", "share_comm_ctx", "ShardPlacementResult",
    # beyond torch's FSDP2
    "materialize", "broadcast_full_state_dict", "plan", "clip_grad_norm_", "install", "uninstall",
    "compile_options", "compile_whole",
    # exceptions to catch
    "CollectiveError", "CollectiveMismatchError", "ShardedUsageError", "ShardedDeepcopyError",
]

__version__ = "0.1.0"

# the names loaded at first use (PEP 562), so that importing fully_shard loads no tool; the switch is the one module
# that imports torch's FSDP2 namespaces (to replace names there)
_LAZY = {**dict.fromkeys(("install", "uninstall"), ".switch"), **dict.fromkeys(
    ("materialize", "broadcast_full_state_dict", "plan", "clip_grad_norm_", "CollectiveMismatchError"), ".tools")}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name], __name__), name)


if os.environ.get(DEBUG_ENV, "") == "1":  # the collective debug mode for the whole run, without a code change
    importlib.import_module(".tools.debug", __name__).set_debug(True)
