"""Crash-safe distributed checkpoints: write to ``step_<k>.tmp``, then rename.

A ``torch.distributed.checkpoint`` (DCP) save writes one file per rank and, last, a
``.metadata`` file from the coordinator rank. A job killed mid-save, or a rank whose write
fails, leaves a partial directory behind; if that directory already has its final name, a
restart may try to load it. The pattern here makes "a directory named ``step_<k>``" mean
"a complete checkpoint":

1. every rank saves into ``<root>/step_<k>.tmp`` (``dcp.save``; a failure on any rank
   raises ``CheckpointException`` on every rank, so nobody waits forever);
2. barrier: every rank's files are written;
3. rank 0 renames ``step_<k>.tmp`` to ``step_<k>`` with ``os.replace`` (atomic on POSIX
   file systems) and fsyncs ``<root>``;
4. barrier: every rank sees the new checkpoint before ``save_checkpoint`` returns.

:func:`latest_checkpoint` returns the newest ``step_<k>`` (never a ``.tmp``), so a save
that failed or was interrupted simply leaves the previous checkpoint as the one to resume
from. ``root`` must be a directory every rank sees (a shared file system on several
nodes). Both functions work for any model whose state dict holds DTensors:
``fully_shard``, torch's FSDP2, HSDP, FSDP x TP.

Usage, for exact resumption (see ``docs/checkpointing.md``)::

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def training_state(model, optimizer, step):
        model_sd, optim_sd = get_state_dict(model, optimizer)
        rank = dist.get_rank()
        # the RNG state differs per rank: one key per rank, each rank reads back its own
        return {"model": model_sd, "optim": optim_sd, "step": step,
                f"rng_rank{rank}": torch.get_rng_state()}

    # resume (model and optimizer freshly built and sharded as before)
    step = 0
    path = latest_checkpoint(CKPT_DIR)
    if path is not None:
        state = training_state(model, optimizer, 0)
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        torch.set_rng_state(state[f"rng_rank{dist.get_rank()}"])
        step = state["step"]

    while step < total_steps:
        train_one_step(step)  # uses the batch for `step`: the data position is the step
        step += 1
        if step % save_every == 0:
            save_checkpoint(training_state(model, optimizer, step), CKPT_DIR, step)
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Any, Callable

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.storage import StorageWriter

__all__ = ["save_checkpoint", "latest_checkpoint"]

_STEP_DIR = re.compile(r"^step_(\d+)$")
_METADATA = ".metadata"  # written last by DCP's FileSystemWriter, by the coordinator


def save_checkpoint(
    state: dict[str, Any],
    root: str | os.PathLike[str],
    step: int,
    *,
    process_group: dist.ProcessGroup | None = None,
    storage_writer: Callable[[str], StorageWriter] = FileSystemWriter,
) -> str:
    """Save ``state`` with DCP as ``<root>/step_<step>``, never leaving a partial
    checkpoint under that name. Call on every rank of ``process_group`` (default: all).

    Args:
        state: what ``dcp.save`` takes: e.g. ``{"model": ..., "optim": ..., "step": step}``
            from ``get_state_dict(model, optimizer)``; DTensors are saved sharded, plain
            tensors and other objects once (keys that differ per rank, such as a per-rank
            RNG state, need a per-rank name).
        root: the checkpoint directory, the same on every rank (shared file system).
        step: the training step, used in the directory name.
        process_group: the ranks taking part (default: the default process group).
        storage_writer: builds the DCP writer for a directory (default
            ``FileSystemWriter``; e.g. a subclass with other options).

    Returns:
        The path of the completed checkpoint, ``<root>/step_<step>``.

    Raises:
        Whatever the save raised: ``torch.distributed.checkpoint.api.CheckpointException``
        on every rank when any rank failed to write (it derives from ``BaseException``,
        not ``Exception``: catch it by name). ``<root>/step_<step>.tmp`` is then left
        behind, ignored by :func:`latest_checkpoint` and removed by the next save of the
        same step; earlier checkpoints are untouched.
    """
    root = os.fspath(root)
    final = os.path.join(root, f"step_{step}")
    tmp = final + ".tmp"
    coordinator = dist.get_rank(process_group) == 0
    if coordinator:
        os.makedirs(root, exist_ok=True)
        if os.path.exists(tmp):  # left by an earlier failed save of this step
            shutil.rmtree(tmp)
    dist.barrier(group=process_group)  # nobody writes into tmp before it is clean
    dcp.save(state, storage_writer=storage_writer(tmp), process_group=process_group)
    dist.barrier(group=process_group)  # every rank's files are written
    if coordinator:
        if os.path.exists(final):  # saving the same step again: replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    dist.barrier(group=process_group)  # every rank sees step_<step> from here on
    return final


def latest_checkpoint(root: str | os.PathLike[str]) -> str | None:
    """The newest complete checkpoint ``<root>/step_<k>`` (largest ``k``), or None.

    Skips ``step_<k>.tmp`` directories (a save that failed or was interrupted) and any
    ``step_<k>`` without DCP's ``.metadata``. Needs no collective: every rank reads the
    same directory and gets the same answer (call it after the last save returned).
    """
    root = os.fspath(root)
    if not os.path.isdir(root):
        return None
    best: tuple[int, str] | None = None
    for name in os.listdir(root):
        match = _STEP_DIR.match(name)
        path = os.path.join(root, name)
        if match is None or not os.path.isfile(os.path.join(path, _METADATA)):
            continue
        step = int(match.group(1))
        if best is None or step > best[0]:
            best = (step, path)
    return None if best is None else best[1]


def _fsync_dir(path: str) -> None:
    """Make a rename in ``path`` durable (best effort: not every OS can open a directory)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
