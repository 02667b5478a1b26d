"""Newer torch FSDP2 features that some tests compare fully_shard against.

fully_shard itself needs torch>=2.11; its drop-in tests compare against torch 2.13's FSDP2, which has names torch
2.11's lacks (the GPU machine runs 2.11). Where the installed torch lacks what a comparison needs, the test still runs
fully_shard's side where it can, then skips the comparison, naming what is missing and which torch has it::

    ours = run_distributed(_experts, 4, case, False)     # checked on any torch
    skip_without_torch_feature("ShardPlacementResult")   # torch 2.11: skipped here, with the reason
    theirs = run_distributed(_experts, 4, case, True)

or, for a test that is the comparison only, ``@requires_torch_feature("DataParallelMeshDims")``.
"""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch
import torch.distributed as dist

# the torch that has every feature below (the CPU suite's)
HAS_THEM = "torch 2.13"

# feature -> (module, attribute path in it)
FEATURES = {
    "ShardPlacementResult": ("torch.distributed.fsdp._fully_shard._fsdp_common", "ShardPlacementResult"),
    "DataParallelMeshDims": ("torch.distributed.fsdp", "DataParallelMeshDims"),
    "FSDPModule.set_reduce_scatter_max_input_buffers": ("torch.distributed.fsdp",
                                                        "FSDPModule.set_reduce_scatter_max_input_buffers"),
    "FSDPModule.set_separate_reduce_scatter_group": ("torch.distributed.fsdp",
                                                     "FSDPModule.set_separate_reduce_scatter_group"),
    "FSDPModule.set_reduce_scatter_unused_params": ("torch.distributed.fsdp",
                                                    "FSDPModule.set_reduce_scatter_unused_params"),
    "dist.all_gather_single": ("torch.distributed", "all_gather_single"),
    "FSDPModule.reset_iter_state": ("torch.distributed.fsdp", "FSDPModule.reset_iter_state"),
    # torch 2.14's FSDP2 shards plain parameters annotated with spmd_types under dp_mesh_dims; the context it runs its
    # collectives in marks that torch (fully_shard.compat.spmd_types checks the same); spmd_types must be installed
    "spmd_types parameters": ("torch.distributed", "_spmd_no_typecheck"),
}
# features newer than HAS_THEM: the torch that has them
SINCE = {"spmd_types parameters": "torch 2.14 with spmd-types installed"}
# fixes no attribute shows: the first torch seen to have them. torch 2.11's FSDP2 fails in backward on
# tests/test_model_structures.py's ShapesTransformer (a block called twice, reshard_after_forward=True: "setStorage:
# ... out of bounds for storage of size 0"); torch 2.13 and 2.14.1 train it
FIXES = {"FSDP2 running a block called twice": "2.13",
         # torch.autograd.grad's error for an unused input names its index (2.11: "One of the differentiated ...")
         "autograd.grad naming the unused input": "2.13",
         # fully_shard([a, b], mp_policy=...): torch 2.11 casts the first member's inputs only ("mat1 and mat2 must
         # have the same dtype" in the second)
         "FSDP2 casting every grouped module's inputs": "2.13",
         # a parameter tied across fully_shard calls: torch 2.11 trains on where torch 2.13 refuses it
         "FSDP2 refusing a parameter tied across calls": "2.13",
         # the gloo threads of a 2-D DeviceMesh's groups end once the groups are destroyed and no Python object holds
         # them: torch 2.11 keeps 6 threads a call (tests/test_harness.py; the harness replaces such pools)
         "gloo threads ending with their destroyed groups": "2.13"}
# features shown by an object, not a name: how to tell
SHOWN = {"ReduceOp.PREMUL_SUM factor": lambda: hasattr(dist._make_nccl_premul_sum(0.5), "factor")}


def has_torch_feature(name: str) -> bool:
    """Whether the installed torch has ``name`` (a key of :data:`FEATURES`, :data:`FIXES` or :data:`SHOWN`)."""
    if name in SHOWN:
        return bool(SHOWN[name]())
    if name in FIXES:
        return bool(torch.torch_version.TorchVersion(torch.__version__) >= FIXES[name])
    if name == "spmd_types parameters" and importlib.util.find_spec("spmd_types") is None:
        return False
    module, path = FEATURES[name]
    obj: object = importlib.import_module(module)
    for part in path.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def missing_torch_features(*names: str) -> str | None:
    """Why a comparison cannot run here (what is missing, which torch has it), or None where nothing is missing."""
    missing = [n for n in names if not has_torch_feature(n)]
    if not missing:
        return None
    has = " and ".join(sorted({SINCE.get(n, HAS_THEM) for n in missing}))
    return (f"torch {torch.__version__} lacks {', '.join(missing)} ({has} has "
            f"{'it' if len(missing) == 1 else 'them'}): this test compares against it")


def requires_torch_feature(*names: str) -> pytest.MarkDecorator:
    """A mark: skip the test where the installed torch lacks any of ``names``, saying which and why."""
    reason = missing_torch_features(*names)
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def skip_without_torch_feature(*names: str) -> None:
    """Inside a test, after fully_shard's own checks: skip the rest (the comparison) where torch lacks ``names``."""
    reason = missing_torch_features(*names)
    if reason is not None:
        pytest.skip(reason)
