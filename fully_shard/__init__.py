"""fully_shard: per-module fully sharded data parallelism (FSDP2 / ZeRO-3) for PyTorch.

Drop-in compatible with ``torch.distributed.fsdp.fully_shard``::

    from fully_shard import fully_shard

or, for a framework that calls torch's ``fully_shard`` for you (accelerate, the Hugging Face Trainer, torchtitan)::

    import fully_shard; fully_shard.install()
"""

from typing import TYPE_CHECKING, Any

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
from .comm import CollectiveError
from .policy import CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy
from .tools.clip import clip_grad_norm_
from .tools.debug import CollectiveMismatchError
from .tools.init import broadcast_full_state_dict, materialize
from .tools.plan import plan

if TYPE_CHECKING:
    from .switch import install, uninstall

__all__ = [
    # torch's FSDP2 names
    "fully_shard", "FSDPModule", "UnshardHandle", "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy",
    "register_fsdp_forward_method", "DataParallelMeshDims", "share_comm_ctx", "ShardPlacementResult",
    # beyond torch's FSDP2
    "materialize", "broadcast_full_state_dict", "plan", "clip_grad_norm_", "install", "uninstall",
    # exceptions to catch
    "CollectiveError", "CollectiveMismatchError", "ShardedUsageError", "ShardedDeepcopyError",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # install/uninstall live in fully_shard.switch, the one module that imports torch's FSDP2 namespaces (to replace
    # names there): imported when first asked for, so `import fully_shard` alone does not load them
    if name in ("install", "uninstall"):
        from . import switch

        return getattr(switch, name)
    raise AttributeError(f"module 'fully_shard' has no attribute {name!r}")
