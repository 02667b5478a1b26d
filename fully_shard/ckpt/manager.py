"""Crash-safe distributed checkpoints: write to ``step_<k>.tmp``, then rename.

A ``torch.distributed.checkpoint`` (DCP) save writes one file per rank and, last, a
``.metadata`` file from the coordinator rank. A job killed mid-save, or a rank whose write
fails, leaves a partial directory behind; if that directory already has its final name, a
restart may try to load it. The pattern here makes "a directory named ``step_<k>``" mean
"a complete checkpoint":

1. every rank saves into ``<root>/step_<k>.tmp`` (``dcp.save`` or ``dcp.async_save``; a
   failure on any rank raises ``CheckpointException`` on every rank, so nobody waits);
2. barrier: every rank's files are written;
3. rank 0 renames ``step_<k>.tmp`` to ``step_<k>`` with ``os.replace`` (atomic on POSIX
   file systems) and fsyncs ``<root>``;
4. barrier: every rank sees the new checkpoint.

:func:`latest_checkpoint` returns the newest ``step_<k>`` (never a ``.tmp``), so a save
that failed or was interrupted leaves the previous checkpoint as the one to resume from.
:class:`CheckpointManager` adds a save interval, keep-latest-k and asynchronous saves.
``root`` must be a directory every rank sees (a shared file system on several nodes).
Everything here works for any model whose state dict holds DTensors: ``fully_shard``,
torch's FSDP2, HSDP, FSDP x TP.

Example, exact resumption (see ``docs/checkpointing.md``)::

    >>> from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    >>> from fully_shard.ckpt import CheckpointManager
    >>> sharded = [fully_shard(m) for m in (*model.layers, model)]  # each block, then the root
    >>> optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    >>> def training_state(step):
    ...     model_sd, optim_sd = get_state_dict(model, optimizer)
    ...     return {"model": model_sd, "optim": optim_sd, "step": step}
    >>> manager = CheckpointManager("ckpt", interval=100, keep_latest_k=3, async_save=True)
    >>> step, total_steps = 0, 3
    >>> state = manager.load_latest(training_state(0))  # None when there is no checkpoint
    >>> if state is not None:
    ...     set_state_dict(model, optimizer, model_state_dict=state["model"],
    ...                    optim_state_dict=state["optim"])
    ...     step = state["step"]
    >>> while step < total_steps:
    ...     model(tokens).sum().backward(); optimizer.step(); optimizer.zero_grad()  # a training step
    ...     step += 1
    ...     path = manager.maybe_save(step, lambda: training_state(step), force=step == total_steps)
    >>> manager.close()  # waits for the last asynchronous save
    >>> manager.latest()
    'ckpt/step_3'
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.storage import StorageWriter

from .safe import load_checkpoint

__all__ = ["CheckpointManager", "latest_checkpoint", "list_checkpoints", "save_checkpoint"]

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
    tmp = _prepare(os.fspath(root), step, process_group)
    dcp.save(state, storage_writer=storage_writer(tmp), process_group=process_group)
    return _commit(tmp, process_group)


def _prepare(root: str, step: int, process_group: dist.ProcessGroup | None) -> str:
    """Phase 1: an empty ``<root>/step_<step>.tmp`` to write into; returns its path."""
    tmp = os.path.join(root, f"step_{step}.tmp")
    if dist.get_rank(process_group) == 0:
        os.makedirs(root, exist_ok=True)
        if os.path.exists(tmp):  # left by an earlier failed save of this step
            shutil.rmtree(tmp)
    dist.barrier(group=process_group)  # nobody writes into tmp before it is clean
    return tmp


def _commit(tmp: str, process_group: dist.ProcessGroup | None) -> str:
    """Phase 3: every rank has written ``tmp``; rank 0 renames it to its final name."""
    final = tmp[: -len(".tmp")]
    dist.barrier(group=process_group)  # every rank's files are written
    if dist.get_rank(process_group) == 0:
        if os.path.exists(final):  # saving the same step again: replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(os.path.dirname(final))
    dist.barrier(group=process_group)  # every rank sees step_<step> from here on
    return final


def list_checkpoints(root: str | os.PathLike[str]) -> list[tuple[int, str]]:
    """The complete checkpoints under ``root`` as ``(step, path)``, oldest first.

    Skips ``step_<k>.tmp`` directories (a save that failed or was interrupted) and any
    ``step_<k>`` without DCP's ``.metadata``.

    Example::

        >>> for step in (100, 200):
        ...     path = save_checkpoint({"model": model.state_dict()}, "ckpt", step)
        >>> list_checkpoints("ckpt")
        [(100, 'ckpt/step_100'), (200, 'ckpt/step_200')]
    """
    root = os.fspath(root)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _STEP_DIR.match(name)
        path = os.path.join(root, name)
        if match is not None and os.path.isfile(os.path.join(path, _METADATA)):
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(root: str | os.PathLike[str]) -> str | None:
    """The newest complete checkpoint ``<root>/step_<k>`` (largest ``k``), or None.

    Needs no collective: every rank reads the same directory and gets the same answer
    (call it after the last save returned).

    Example::

        >>> path = latest_checkpoint("ckpt")  # 'ckpt/step_200', or None for a fresh start
    """
    found = list_checkpoints(root)
    return found[-1][1] if found else None


class CheckpointManager:
    """Periodic crash-safe DCP checkpoints of one run, kept to the newest ``keep_latest_k``.

    Construct it on every rank (with ``async_save=True`` the constructor is a collective:
    it creates the gloo process group the background saves communicate on, so they never
    interleave with the training's collectives). Then call :meth:`maybe_save` on every
    rank after each step; it saves when ``step % interval == 0`` (or ``force``).

    With ``async_save`` the state is copied to CPU memory (``dcp.async_save``'s staging)
    and written by a background thread while training goes on; the checkpoint gets its
    final name ``step_<k>`` only once every rank has written it, at the next
    :meth:`maybe_save` that saves, at :meth:`wait` or at :meth:`close`. Until then
    :func:`latest_checkpoint` still names the previous one, so a crash never leaves a
    partial checkpoint under a final name.

    Args:
        root: the checkpoint directory, the same path on every rank.
        interval: save every this many steps (``maybe_save`` with ``step % interval == 0``).
        keep_latest_k: after each completed save, delete all but the newest ``k``
            complete checkpoints (``None``: keep all).
        async_save: save with ``dcp.async_save`` on a background thread.
        process_group: the ranks taking part (default: all).

    Example::

        >>> from torch.distributed.checkpoint.state_dict import get_model_state_dict
        >>> fully_shard(model)
        FSDPTransformer(...)
        >>> optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        >>> manager = CheckpointManager("ckpt", interval=3, keep_latest_k=2)
        >>> for step in range(1, 10):
        ...     model(tokens).sum().backward(); optimizer.step(); optimizer.zero_grad()
        ...     path = manager.maybe_save(step, lambda: {"model": get_model_state_dict(model)})  # None off the interval
        >>> manager.close()
        >>> manager.latest(), list_checkpoints("ckpt")
        ('ckpt/step_9', [(6, 'ckpt/step_6'), (9, 'ckpt/step_9')])
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        interval: int = 1,
        keep_latest_k: int | None = None,
        async_save: bool = False,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if not isinstance(interval, int) or interval < 1:
            raise ValueError(f"CheckpointManager: interval must be a positive int, got {interval!r}")
        if keep_latest_k is not None and (not isinstance(keep_latest_k, int) or keep_latest_k < 1):
            raise ValueError(
                f"CheckpointManager: keep_latest_k must be a positive int or None (keep all), got {keep_latest_k!r}"
            )
        self.root = os.fspath(root)
        self.interval = interval
        self.keep_latest_k = keep_latest_k
        self.async_save = async_save
        self.process_group = process_group
        # background saves talk on their own gloo group: a collective of theirs must not
        # meet one of the training step's on the same group
        self._save_group = process_group
        if async_save:
            ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
            self._save_group = dist.new_group(ranks=ranks, backend="gloo")
        self._pending: tuple[Future[Any], str] | None = None

    def should_save(self, step: int) -> bool:
        """Whether :meth:`maybe_save` saves at ``step``."""
        return step % self.interval == 0

    def maybe_save(self, step: int, state: Callable[[], dict[str, Any]], *, force: bool = False) -> str | None:
        """Save ``state()`` as ``<root>/step_<step>`` if ``step`` is on the interval or
        ``force``; returns the checkpoint's path (with ``async_save``: the path it will
        have once written), or None when this step saves nothing. ``state`` is only
        called when saving. Call on every rank."""
        if not (force or self.should_save(step)):
            return None
        self.wait()  # one save in flight at a time; this also commits the previous one
        tmp = _prepare(self.root, step, self.process_group)
        if self.async_save:
            future = dcp.async_save(state(), checkpoint_id=tmp, process_group=self._save_group)
            self._pending = (future, tmp)  # type: ignore[assignment]
            return tmp[: -len(".tmp")]
        dcp.save(state(), checkpoint_id=tmp, process_group=self.process_group)
        return self._finish(tmp)

    def wait(self) -> str | None:
        """Wait for the asynchronous save in flight, if any, and give it its final name;
        returns its path (None if there was none). Call on every rank."""
        if self._pending is None:
            return None
        future, tmp = self._pending
        self._pending = None
        future.result()  # re-raises the background save's error, on this rank
        return self._finish(tmp)

    def close(self) -> None:
        """Finish the save in flight (see :meth:`wait`). Call before the process group
        is destroyed."""
        self.wait()

    def latest(self) -> str | None:
        """The newest complete checkpoint under ``root`` (see :func:`latest_checkpoint`)."""
        return latest_checkpoint(self.root)

    def load_latest(self, state: dict[str, Any]) -> dict[str, Any] | None:
        """Load the newest complete checkpoint into ``state`` in place (``dcp.load``, each
        rank reading its shards) and return it, or None when there is no checkpoint.

        It runs no code from the checkpoint (:func:`~fully_shard.ckpt.load_checkpoint`): a file
        that names anything but DCP's metadata classes, or an entry that ``torch.load`` refuses
        with ``weights_only=True``, raises :class:`~fully_shard.ckpt.UnsafeCheckpointError`
        naming the file."""
        path = self.latest()
        if path is None:
            return None
        load_checkpoint(state, path, process_group=self.process_group)
        return state

    def _finish(self, tmp: str) -> str:
        final = _commit(tmp, self.process_group)
        if self.keep_latest_k is not None and dist.get_rank(self.process_group) == 0:
            for _, old in list_checkpoints(self.root)[: -self.keep_latest_k]:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier(group=self.process_group)  # nobody lists the directory mid-delete
        return final


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
