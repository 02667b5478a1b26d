"""Checkpoint helpers for sharded training, built on ``torch.distributed.checkpoint``.

Crash-safe saves (:func:`save_checkpoint`, :class:`CheckpointManager` with an interval,
keep-latest-k and ``dcp.async_save``), finding the newest complete checkpoint
(:func:`latest_checkpoint`), and converting a sharded checkpoint into one file
(:func:`consolidate`, or ``python -m fully_shard.ckpt.convert CKPT OUT``, like
DeepSpeed's ``zero_to_fp32.py``). Every loader here runs no code from the checkpoint
(:class:`SafeFileSystemReader`, also a reader for your own ``dcp.load``). Not imported by ``import fully_shard``.

Example::

    >>> from fully_shard.ckpt import CheckpointManager, consolidate
    >>> manager = CheckpointManager("ckpt", interval=100, keep_latest_k=3)
    >>> for step in range(1, 201):  # training
    ...     path = manager.maybe_save(step, lambda: {"model": model.state_dict()})
    >>> manager.close()
    >>> sd = consolidate(manager.latest(), "model.safetensors")  # on one process, no GPU
    >>> sd["layers.0.attention.wq.weight"].shape
    torch.Size([16, 16])
"""

from .convert import consolidate, load_consolidated
from .manager import (
    CheckpointManager,
    latest_checkpoint,
    list_checkpoints,
    save_checkpoint,
)
from .safe import SafeFileSystemReader, UnsafeCheckpointError, load_checkpoint, read_metadata

__all__ = [
    "CheckpointManager",
    "SafeFileSystemReader",
    "UnsafeCheckpointError",
    "consolidate",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_consolidated",
    "read_metadata",
    "save_checkpoint",
]
