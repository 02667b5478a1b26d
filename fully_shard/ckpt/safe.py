"""Read a DCP checkpoint without running code from it: an allowlisting reader for ``dcp.load``.

torch's ``FileSystemReader`` unpickles a checkpoint's ``.metadata`` with :mod:`pickle`, and DCP's default load
planner reads every non-tensor entry (an int ``step``, a scheduler's dict, extra state saved as ``BytesIO``) with
``torch.load(..., weights_only=False)``: a checkpoint someone else wrote can run any command on the machine that
loads it. :class:`SafeFileSystemReader` is a ``FileSystemReader`` that instead

- reads ``.metadata`` with an unpickler that builds only DCP's metadata classes, ``torch.Size``, dtypes, layouts,
  memory formats and ``pathlib`` paths (:data:`METADATA_GLOBALS`; the same objects in every torch from 2.11 on),
  and refuses every other global before calling anything;
- reads each non-tensor entry with ``torch.load(weights_only=True)`` before the load planner sees it (tensor
  data DCP already reads with ``weights_only=True``).

Anything refused raises :class:`UnsafeCheckpointError`, naming the file and the global. Every loader of
``fully_shard.ckpt`` reads through it; pass it to ``dcp.load`` yourself as ``storage_reader``.

Example::

    >>> import torch.distributed.checkpoint as dcp
    >>> from fully_shard.ckpt import SafeFileSystemReader, save_checkpoint
    >>> path = save_checkpoint({"model": model.state_dict(), "step": 7}, "ckpt", 7)
    >>> state = {"model": model.state_dict(), "step": 0}
    >>> dcp.load(state, storage_reader=SafeFileSystemReader(path))  # like checkpoint_id=path, but runs no code
    >>> state["step"]
    7
"""

from __future__ import annotations

import dataclasses
import io
import os
import pathlib
import pickle
import re
from collections.abc import Callable, Iterable
from typing import IO, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

__all__ = ["METADATA_GLOBALS", "SafeFileSystemReader", "UnsafeCheckpointError", "load_checkpoint", "read_metadata"]

# What a DCP ``.metadata`` pickle may name: "module.name" -> where to find it now. DCP's dataclasses are built
# without running their __init__ (NEWOBJ, then their __dict__ or __setstate__); the rest are called with plain
# values: torch.Size(list), _MEM_FORMAT_ENCODING(int), _get_layout("torch.strided") (a lookup in torch),
# PosixPath("a", "b") (StorageMeta.checkpoint_id). dtypes, layouts and memory formats are looked up by name.
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
}
_PATHS = ("PurePath", "PurePosixPath", "PureWindowsPath", "Path", "PosixPath", "WindowsPath")


def _metadata_globals() -> dict[str, Any]:
    modules = {"torch.distributed.checkpoint.metadata": dcp_metadata,
               "torch.distributed.checkpoint.filesystem": dcp_filesystem}
    found: dict[str, Any] = {}
    for module, names in _DCP_CLASSES.items():
        found.update({f"{module}.{n}": getattr(modules[module], n) for n in names if hasattr(modules[module], n)})
    found["torch.Size"] = torch.Size
    found["torch.serialization._get_layout"] = torch.serialization._get_layout
    for name, value in vars(torch).items():
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            found[f"torch.{name}"] = value
    for name in _PATHS:  # Python 3.13 pickles them as pathlib._local.<name>
        found[f"pathlib.{name}"] = found[f"pathlib._local.{name}"] = getattr(pathlib, name)
    return found


METADATA_GLOBALS: dict[str, Any] = _metadata_globals()
"""The globals a ``.metadata`` file may name, ``"module.name" -> object``: DCP's metadata classes, ``torch.Size``,
every dtype, layout and memory format, ``torch.serialization._get_layout`` and ``pathlib``'s path classes."""

class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file names a global (a function or class to call) that reading it safely may not: it was not
    written by ``torch.distributed.checkpoint`` as is, or it was written to run code. Nothing from it was run."""


class _AllowlistUnpickler(pickle._Unpickler):
    """:mod:`pickle`'s own unpickler (the Python one: its steps can be checked one by one) that resolves only the
    allowed globals, calls only those, and sets state only on instances of allowed classes (never on a class)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    stack: list[Any]  # pickle's own, set by load()

    def __init__(self, file: IO[bytes], path: str, allowed: dict[str, Any]) -> None:
        super().__init__(file)
        self.path, self.allowed = path, allowed
        self.callables = {id(v) for v in allowed.values()}
        self.classes = tuple(v for v in allowed.values() if isinstance(v, type))

    def find_class(self, module: str, name: str) -> Any:
        if f"{module}.{name}" not in self.allowed:
            raise UnsafeCheckpointError(_refusal(self.path, f"{module}.{name}"))
        return self.allowed[f"{module}.{name}"]

    def _check_call(self, depth: int) -> None:
        func = self.stack[-depth]
        if id(func) not in self.callables:
            raise UnsafeCheckpointError(f"{self.path}: refused to call {func!r:.80}, which is not an allowed global")

    def _check_build(self) -> None:
        inst = self.stack[-2]
        if not isinstance(inst, self.classes) or isinstance(inst, type):
            raise UnsafeCheckpointError(f"{self.path}: refused to set the state of a {type(inst).__name__}")


def _guarded(opcode: bytes, check: Callable[[_AllowlistUnpickler], None]) -> None:
    step = _AllowlistUnpickler.dispatch[opcode[0]]

    def guarded(self: _AllowlistUnpickler) -> None:
        check(self)
        step(self)  # type: ignore[arg-type]

    _AllowlistUnpickler.dispatch[opcode[0]] = guarded  # type: ignore[assignment]


_guarded(pickle.REDUCE, lambda u: u._check_call(2))  # func, args
_guarded(pickle.NEWOBJ, lambda u: u._check_call(2))  # cls, args
_guarded(pickle.NEWOBJ_EX, lambda u: u._check_call(3))  # cls, args, kwargs
_guarded(pickle.BUILD, lambda u: u._check_build())  # inst, state


def _refuse(u: _AllowlistUnpickler) -> None:
    raise UnsafeCheckpointError(f"{u.path}: refused an instance built from the stack or a persistent id, which DCP's "
                                "metadata never holds")


for _op in (pickle.OBJ, pickle.PERSID, pickle.BINPERSID):  # the class from the stack; ids of storages: never
    _guarded(_op, _refuse)

_METADATA_HOLDS = ("a DCP checkpoint's metadata holds only DCP's metadata classes, torch.Size, dtypes and paths, so "
                   "this file was not written by torch.distributed.checkpoint as it is")
_FIX = ("If you wrote the file yourself and trust it, name the global in SafeFileSystemReader(path, "
        "extra_globals=[...])")


def _refusal(path: str, name: str, holds: str = _METADATA_HOLDS, fix: str = _FIX) -> str:
    return (f"{path}: refused to load the global {name!r}: {holds} (it may be written to run code on the machine "
            f"that loads it). Nothing from it was run. {fix}.")


def read_metadata(path: str | os.PathLike[str], extra_globals: Iterable[Any] = ()) -> dcp_metadata.Metadata:
    """Unpickle a DCP ``.metadata`` file with the allowlist (:data:`METADATA_GLOBALS` and ``extra_globals``,
    classes or functions named by their ``__module__`` and ``__qualname__``); raises
    :class:`UnsafeCheckpointError` naming the file and the refused global.

    Example::

        >>> from fully_shard.ckpt import save_checkpoint
        >>> path = save_checkpoint({"model": model.state_dict()}, "ckpt", 1)
        >>> read_metadata(f"{path}/.metadata").state_dict_metadata["model.output.weight"].size
        torch.Size([32, 16])
    """
    path = os.fspath(path)
    allowed = dict(METADATA_GLOBALS)
    allowed.update({f"{g.__module__}.{g.__qualname__}": g for g in extra_globals})
    with open(path, "rb") as f:
        metadata = _AllowlistUnpickler(f, path, allowed).load()
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise UnsafeCheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """``torch.distributed.checkpoint.FileSystemReader`` that runs no code from the checkpoint: ``.metadata``
    through :func:`read_metadata`'s allowlist, every non-tensor entry through ``torch.load(weights_only=True)``
    (then handed to the load planner as a fresh ``torch.save`` of what that returned). Use it wherever you load
    a checkpoint you did not write: ``dcp.load(state, storage_reader=SafeFileSystemReader(path))``.

    Args:
        path: the checkpoint directory (e.g. ``ckpt/step_1000``).
        extra_globals: classes or functions a checkpoint of yours puts in its metadata beyond DCP's own (a custom
            planner's data), allowed too.

    Raises:
        UnsafeCheckpointError: from ``dcp.load``, naming the file and the refused global.

    Example::

        >>> import torch.distributed.checkpoint as dcp
        >>> from fully_shard.ckpt import save_checkpoint
        >>> path = save_checkpoint({"model": model.state_dict(), "sched": {"epoch": 3}}, "ckpt", 2)
        >>> state = {"model": model.state_dict(), "sched": {"epoch": 0}}
        >>> dcp.load(state, storage_reader=SafeFileSystemReader(path))
        >>> state["sched"]
        {'epoch': 3}
    """

    def __init__(self, path: str | os.PathLike[str], *, extra_globals: Iterable[Any] = ()) -> None:
        super().__init__(path)
        self.extra_globals = list(extra_globals)

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        rank = kwargs.get("rank")  # set by a no-process-group load of per-rank metadata (__<rank>.metadata)
        path = os.path.join(os.fspath(self.path), ".metadata" if rank is None else f"__{rank}.metadata")
        metadata = read_metadata(path, self.extra_globals)
        if metadata.storage_meta is None:  # as torch's reader does
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}  # one file at a time, so that a refusal names its file
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        for name, items in per_file.items():
            where = os.path.join(os.fspath(self.path), name)
            try:  # tensors: torch.load(weights_only=True) in torch's reader; the rest: _WeightsOnlyBytes
                super().read_data(dataclasses.replace(plan, items=items),
                                  _WeightsOnlyBytes(planner, where))  # type: ignore[arg-type]
            except pickle.UnpicklingError as e:
                raise _refused_entry(where, e, "a tensor") from None
        done: Future[None] = Future()
        done.set_result(None)
        return done


def load_checkpoint(state: dict[str, Any], path: str | os.PathLike[str], *,
                    process_group: dist.ProcessGroup | None = None, no_dist: bool = False) -> None:
    """``dcp.load(state, checkpoint_id=path)`` in place, through :class:`SafeFileSystemReader`: it runs no code
    from the checkpoint. A refusal raises :class:`UnsafeCheckpointError` itself (on every rank), not DCP's
    ``CheckpointException`` around it. Call on every rank of ``process_group``, or on one process with
    ``no_dist=True``.

    Example::

        >>> from fully_shard.ckpt import save_checkpoint
        >>> path = save_checkpoint({"model": model.state_dict(), "step": 5}, "ckpt", 5)
        >>> state = {"model": model.state_dict(), "step": 0}
        >>> load_checkpoint(state, path)
        >>> state["step"]
        5
    """
    path = os.fspath(path)
    read_metadata(os.path.join(path, ".metadata"))  # its refusal as it is, before dcp.load's fallbacks wrap it
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(path), process_group=process_group, no_dist=no_dist)
    except CheckpointException as e:
        refused = [exc for exc, _ in e.failures.values() if isinstance(exc, UnsafeCheckpointError)]
        if refused:
            raise refused[0] from None
        raise


_GLOBAL = re.compile(r"GLOBAL (\S+)")
_BYTES_HOLD = ("{} is read with torch.load(weights_only=True), which builds only tensors, containers, numbers, "
               "strings and the classes torch.serialization.add_safe_globals allows")
_BYTES_FIX = ("If you wrote the file yourself and trust that class, allow it with "
              "torch.serialization.add_safe_globals([...])")


def _refused_entry(where: str, e: Exception, what: str) -> UnsafeCheckpointError:
    if isinstance(e, UnsafeCheckpointError):
        return e
    match = _GLOBAL.search(str(e))
    if match is None:
        return UnsafeCheckpointError(f"{where}: refused to read {what} with torch.load(weights_only=True): {e}")
    return UnsafeCheckpointError(_refusal(where, match.group(1), _BYTES_HOLD.format(what), _BYTES_FIX))


class _WeightsOnlyBytes:
    """The load planner, as ``FileSystemReader.read_data`` sees it, whose ``load_bytes`` first reads the entry with
    ``torch.load(weights_only=True)``. The planner itself (DCP's default: ``torch.load(weights_only=False)``) gets
    a fresh ``torch.save`` of the result, so the bytes from the file never reach an unpickler that runs code."""

    def __init__(self, planner: LoadPlanner, where: str) -> None:
        self.planner, self.where = planner, where

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:
            raise _refused_entry(self.where, e, f"the entry {read_item.storage_index.fqn!r}") from None
        clean = io.BytesIO()
        torch.save(obj, clean)
        clean.seek(0)
        self.planner.load_bytes(read_item, clean)

    def __getattr__(self, name: str) -> Any:  # resolve_tensor, commit_tensor, ...: the planner's own
        return getattr(self.planner, name)
