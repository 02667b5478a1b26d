"""Exact tensor-storage accounting at the dispatcher level (not RSS).

:class:`StorageTracker` is a ``TorchDispatchMode`` that sees the output of every ATen op
run while it is active, records each distinct untyped storage it has not seen yet with its
size in bytes, and drops it when the storage is freed (a weakref callback on the storage's
preserved Python object). ``UntypedStorage.resize_`` (how both fully_shard and torch's
FSDP2 free and re-allocate unsharded parameters) does not go through the dispatcher, so
it is patched while the tracker is active. DTensor ops are let through to their local ops,
which are tracked. ``peak`` is the largest sum of live storage bytes seen.

Known blind spots (the same for every library measured): memory that gloo allocates on its
own threads, and allocator rounding/fragmentation (these are storage bytes, not what the
allocator reserves). Storages created before the tracker was entered are invisible unless
an op inside returns a view of them (``param.data``, ``detach``): build the model inside
the tracker and pass the pre-existing tensors it reads (a model it deep-copies, the input
batches) as ``ignore``.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class StorageTracker(TorchDispatchMode):
    """Live and peak bytes of the CPU tensor storages created while active.

    Example::

        with StorageTracker() as mem:
            model = build()
            train_step(model)          # warm-up
            mem.reset_peak()
            mem.phase("forward"); ...; mem.phase("backward"); ...
        mem.peak, mem.phase_peaks
    """

    def __init__(self, ignore: Any = ()) -> None:
        """``ignore``: tensors created before the tracker (e.g. the model a benchmark
        deep-copies, the input batches) whose storages must not be counted when an op
        returns a view of them; they must stay alive while the tracker is used."""
        super().__init__()
        self._ignored = {
            t.untyped_storage()._cdata
            for t in tree_leaves(ignore)
            if isinstance(t, torch.Tensor) and t.device.type != "meta"
        }
        # live storages: key (StorageImpl address) -> bytes, and -> a serial number that is
        # never reused (addresses are, once a storage is freed)
        self._nbytes: dict[int, int] = {}
        self._serial: dict[int, int] = {}
        self._next_serial = 0
        self._refs: dict[int, weakref.ref[Any]] = {}
        self.current = 0
        self.peak = 0
        self.phase_peaks: dict[str, int] = {}
        self._phase: str | None = None
        self._orig_resize: Any = None
        # serial -> bytes of every storage live at the peak (after ``reset_peak``)
        self.peak_storages: dict[int, int] | None = None
        self._snapshot = False

    # -- context --------------------------------------------------------------------

    def __enter__(self) -> StorageTracker:
        orig = torch.UntypedStorage.resize_
        self._orig_resize = orig
        tracker = self

        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            out = orig(st, size)
            tracker._resized(st)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]

    # -- queries ----------------------------------------------------------------------

    def reset_peak(self, snapshot: bool = True) -> None:
        """Start a new peak from the current bytes; with ``snapshot`` remember which storages
        are live at the new peak (to break it down with :meth:`breakdown`)."""
        self.peak = self.current
        self.phase_peaks = {}
        self._phase = None
        self._snapshot = snapshot
        self.peak_storages = self._live_by_serial() if snapshot else None

    def _live_by_serial(self) -> dict[int, int]:
        serial = self._serial
        return {serial[k]: n for k, n in self._nbytes.items()}

    def storage_keys(self, tensors: Any) -> set[int]:
        """Serial numbers of the (live, tracked) storages behind ``tensors``."""
        keys = set()
        for t in tree_leaves(tensors):
            if isinstance(t, DTensor):
                t = t._local_tensor
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                s = self._serial.get(t.untyped_storage()._cdata)
                if s is not None:
                    keys.add(s)
        return keys

    def breakdown(self, categories: dict[str, Any]) -> dict[str, int]:
        """Split the bytes live at the peak by category: ``{"params": [tensors], ...}``;
        the first category that names a storage gets it, the rest is ``"other"``."""
        assert self.peak_storages is not None, "reset_peak(snapshot=True) first"
        out = {name: 0 for name in categories}
        out["other"] = 0
        owner: dict[int, str] = {}
        for name, tensors in categories.items():
            for key in self.storage_keys(tensors):
                owner.setdefault(key, name)
        for key, nbytes in self.peak_storages.items():
            out[owner.get(key, "other")] += nbytes
        return out

    def phase(self, name: str | None) -> None:
        """Attribute the peak from now on to ``name`` (also in ``phase_peaks``)."""
        self._phase = name
        if name is not None:
            self.phase_peaks[name] = max(self.phase_peaks.get(name, 0), self.current)

    def bytes_of(self, tensors: Any) -> int:
        """Bytes of the distinct storages behind ``tensors`` (DTensors: their local shard)."""
        seen: dict[int, int] = {}
        for t in tree_leaves(tensors):
            if isinstance(t, DTensor):
                t = t._local_tensor
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                seen[st._cdata] = st.nbytes()
        return sum(seen.values())

    # -- tracking ---------------------------------------------------------------------

    def _bump(self, delta: int) -> None:
        self.current += delta
        if self.current > self.peak:
            self.peak = self.current
            if self._snapshot:
                self.peak_storages = self._live_by_serial()
        if self._phase is not None and self.current > self.phase_peaks.get(self._phase, 0):
            self.phase_peaks[self._phase] = self.current

    def _track(self, t: torch.Tensor) -> None:
        if t.device.type == "meta" or isinstance(t, DTensor):
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # e.g. sparse / no storage
            return
        key = st._cdata
        if key in self._ignored:
            return
        old = self._nbytes.get(key)
        size = st.nbytes()
        if old is None:
            self._nbytes[key] = size
            self._serial[key] = self._next_serial
            self._next_serial += 1
            self._refs[key] = weakref.ref(st, lambda _r, key=key: self._freed(key))
            self._bump(size)
        elif old != size:
            self._nbytes[key] = size
            self._bump(size - old)

    def _freed(self, key: int) -> None:
        size = self._nbytes.pop(key, 0)
        self._serial.pop(key, None)
        self._refs.pop(key, None)
        self.current -= size

    def _resized(self, st: torch.UntypedStorage) -> None:
        key = st._cdata
        old = self._nbytes.get(key)
        if old is not None:
            size = st.nbytes()
            self._nbytes[key] = size
            self._bump(size - old)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor run its local ops, which we see
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out
