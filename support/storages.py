"""Exact tensor-storage accounting at the dispatcher level (not RSS), for the benchmarks and the tests.

:class:`StorageTracker` is a ``TorchDispatchMode``. On entry it registers every tensor storage
that already exists (found through ``gc``: a model built before, its optimizer state, the
input batches, fully_shard's unsharded buffers resized to 0 between uses). While active it
registers the storage of every op output it has not seen, follows ``UntypedStorage.resize_``
(how both fully_shard and torch's FSDP2 free and re-grow unsharded parameters; it bypasses the
dispatcher, so it is patched while the tracker is active) and sees a storage freed through a
weakref callback on its (preserved) Python object. DTensor ops are let through to their local
ops, which are tracked. Each storage gets a category when first seen:

* ``existing``: before entry;
* ``fully_shard``: allocated with a frame of the fully_shard package on the stack
  (all-gather and reduce-scatter buffers, unsharded parameters, sharded gradients), but for
  its mixed-precision casts of a module's inputs and outputs (activations: the phase's);
* the phase (``phase()``; ``setup`` before the first): allocated by other code then, e.g.
  ``forward`` / ``backward`` / ``optimizer``: activations, activation gradients, optimizer
  temporaries (and, in a benchmark, everything torch's FSDP2 or DDP allocate);
* ``unsharded_grad``: a ``backward`` storage that fully_shard later reads in backward
  (its post-backward hook casts or packs the parameters' full gradients), so the
  parameter gradients are told apart from the activation gradients;
* ``backend``: first seen as the *input* of an op, so allocated where no op showed it:
  inside a process-group backend. gloo's reduce-scatter copies its whole input and
  works on the copy until ``wait()``, where an ``aten.split`` of it is the first sight
  (a gloo detail: NCCL reduces in place).

Two views of the same storages:

* running, over the storages allocated while active (all but ``existing``): ``current``,
  ``peak`` and ``phase_peaks`` (from :meth:`reset_peak` on) and :meth:`breakdown` of the
  peak by tensors (``benchmarks/step.py``);
* :meth:`report`, which replays the event log (storage, byte delta, phase) with the final
  categories, since a category can change after the fact: the peak of all storages, of
  everything but activations and backend storages, of activations and of backend storages
  (``tests/test_plan.py``; ``benchmarks/step.py`` for its planned-against-measured column).

Blind spots (the same for every library measured): memory that gloo allocates on its own
threads, temporaries that live and die inside one DTensor op, allocator rounding and
fragmentation (these are storage bytes, not what the allocator reserves).
"""

from __future__ import annotations

import gc
import os
import sys
import warnings
import weakref
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import fully_shard

ACTIVATIONS = ("forward", "backward")
_CASTS = frozenset({"_cast_inputs", "_cast_output"})  # fully_shard's mixed-precision casts of a module's inputs/outputs
_FROZEN: list[weakref.ref[torch.Tensor]] = []  # the tensors among the objects freeze_heap() took out of gc's reach


def _tensors(objects: list[Any]) -> list[torch.Tensor]:
    with warnings.catch_warnings():  # isinstance() on deprecated torch objects warns
        warnings.simplefilter("ignore")
        return [obj for obj in objects if isinstance(obj, torch.Tensor)]


def live_storages() -> list[torch.UntypedStorage]:
    """The storages of every tensor alive now (after a collection), the frozen ones (:func:`freeze_heap`) too."""
    gc.collect()
    tensors = _tensors(gc.get_objects()) + [t for ref in _FROZEN if (t := ref()) is not None]
    return [st for t in tensors for st in _storages(t)]


def freeze_heap() -> None:
    """``gc.freeze()`` what is alive now, the tensors among it remembered for :class:`StorageTracker`.

    A process that imported torch and fully_shard holds about 285,000 objects that live as long as it does; every full
    collection walks them all (0.1-0.15 s here), and the tracker collects and scans on each entry. Frozen, they are
    out of every later collection and out of ``gc.get_objects()``, so the tracker finds the frozen tensors through
    weak references kept here. Call it once, after the imports and before any process group but the default one
    exists (a frozen object in a reference cycle is never collected: a mesh frozen so would keep its groups' threads).
    The test harness's workers and the benchmarks' ranks call it at start-up.
    """
    gc.collect()
    _FROZEN.extend(weakref.ref(t) for t in _tensors(gc.get_objects()))
    gc.freeze()


def _names(f: Any) -> set[str]:
    """The function names of frame ``f`` and its callers."""
    out = set()
    while f is not None:
        out.add(f.f_code.co_name)
        f = f.f_back
    return out


def _storages(t: Any) -> list[torch.UntypedStorage]:
    if isinstance(t, DTensor):
        return _storages(t._local_tensor)
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return []
    try:
        return [t.untyped_storage()]
    except (RuntimeError, NotImplementedError):  # sparse, or no storage
        return []


class StorageTracker(TorchDispatchMode):
    """Live and peak bytes of tensor storages, by who allocated them.

    Example (a benchmark: the running view)::

        with StorageTracker() as mem:
            model = build()
            train_step(model)          # warm-up
            mem.reset_peak()
            mem.phase("forward"); ...; mem.phase("backward"); ...
        mem.peak, mem.phase_peaks

    Example (a test: the replayed report)::

        with StorageTracker() as mem:
            mem.phase("forward"); ...
        mem.report()["model_state"]
    """

    def __init__(self, leftovers: list[torch.UntypedStorage] | None = None) -> None:
        """``leftovers``: storages that are not the measured job's (what earlier work in the process left alive, from
        :func:`live_storages` taken before the job began): not registered as ``existing``, so not in any peak."""
        super().__init__()
        self._leftovers = list(leftovers or [])  # held, so that no new storage takes one's address while active
        self._skip = {st._cdata for st in self._leftovers}
        self._package = os.path.dirname(os.path.abspath(fully_shard.__file__)) + os.sep
        self._refs: dict[int, tuple[int, weakref.ref[Any]]] = {}  # StorageImpl address -> (uid, ref)
        self._size: dict[int, int] = {}  # uid -> bytes now (uids are never reused; addresses are)
        self.category: dict[int, str] = {}  # uid -> category
        self.events: list[tuple[int, int, str]] = []  # (uid, byte delta, phase)
        self._phase: str | None = None
        self._orig_resize: Any = None
        self._active = False
        # the running view: storages allocated while active
        self.current = 0
        self.peak = 0
        self.phase_peaks: dict[str, int] = {}
        self.peak_storages: dict[int, int] | None = None  # uid -> bytes live at the peak
        self._snapshot = False
        self._report_from = 0  # the first event report() takes peaks at (reset_peak moves it)

    # -- phases and the running view ------------------------------------------------------------

    def phase(self, name: str | None) -> None:
        """Attribute what follows to ``name`` (its category, its entry in ``phase_peaks``)."""
        self._phase = name
        if name is not None:
            self.phase_peaks[name] = max(self.phase_peaks.get(name, 0), self.current)

    def reset_peak(self, snapshot: bool = True) -> None:
        """Start a new peak from the current bytes; with ``snapshot`` remember which storages
        are live at the new peak (to break it down with :meth:`breakdown`)."""
        self.peak = self.current
        self.phase_peaks = {}
        self._phase = None
        self._report_from = len(self.events)
        self._snapshot = snapshot
        self.peak_storages = self._live() if snapshot else None

    def _live(self) -> dict[int, int]:
        return {uid: self._size[uid] for uid, _ in self._refs.values() if self.category[uid] != "existing"}

    def storage_keys(self, tensors: Any) -> set[int]:
        """The ids of the (live, tracked) storages behind ``tensors``."""
        keys = set()
        for t in tree_leaves(tensors):
            for st in _storages(t):
                entry = self._refs.get(st._cdata)
                if entry is not None:
                    keys.add(entry[0])
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

    @staticmethod
    def bytes_of(tensors: Any) -> int:
        """Bytes of the distinct storages behind ``tensors`` (DTensors: their local shard)."""
        seen = {st._cdata: st.nbytes() for t in tree_leaves(tensors) for st in _storages(t)}
        return sum(seen.values())

    # -- the replayed report ------------------------------------------------------------------

    def report(self, existing: bool = True) -> dict[str, Any]:
        """Peaks in bytes since entry (or since :meth:`reset_peak`): ``total`` (every storage; ``existing``: the
        ones from before entry too), ``model_state`` (all but activations and backend storages), ``activations``,
        ``backend``, and the split of ``model_state``'s peak by category and phase."""
        by_cat: dict[str, int] = {}
        peaks = {"total": 0, "model_state": 0, "activations": 0, "backend": 0}
        at_model_peak: dict[str, Any] = {}
        for i, (uid, delta, phase) in enumerate(self.events):
            cat = self.category[uid]
            if cat == "existing" and not existing:
                continue
            by_cat[cat] = by_cat.get(cat, 0) + delta
            if delta <= 0 or i < self._report_from:
                continue
            act = sum(by_cat.get(c, 0) for c in ACTIVATIONS)
            backend = by_cat.get("backend", 0)
            total = sum(by_cat.values())
            peaks["total"] = max(peaks["total"], total)
            peaks["activations"] = max(peaks["activations"], act)
            peaks["backend"] = max(peaks["backend"], backend)
            if total - act - backend > peaks["model_state"]:
                peaks["model_state"] = total - act - backend
                at_model_peak = {"phase": phase, "by_category": dict(by_cat), "activations": act, "backend": backend}
        return {**peaks, "at_model_state_peak": at_model_peak}

    # -- registration ------------------------------------------------------------------------

    def _event(self, uid: int, delta: int) -> None:
        self.events.append((uid, delta, self._phase or "setup"))
        if self.category[uid] == "existing":
            return
        self.current += delta
        if self.current > self.peak:
            self.peak = self.current
            if self._snapshot:
                self.peak_storages = self._live()
        if self._phase is not None and self.current > self.phase_peaks.get(self._phase, 0):
            self.phase_peaks[self._phase] = self.current

    def _register(self, st: torch.UntypedStorage, category: str) -> None:
        key = st._cdata
        if key in self._refs or st.device.type == "meta" or not isinstance(st.nbytes(), int):
            return  # seen, or no real bytes: a meta or symbolic-size storage (torch.compile's fake tensors)
        uid = len(self._size)
        self._refs[key] = (uid, weakref.ref(st, lambda _r, key=key, uid=uid: self._freed(key, uid)))
        self._size[uid] = n = st.nbytes()
        self.category[uid] = category
        self._event(uid, n)

    def _freed(self, key: int, uid: int) -> None:
        if self._refs.get(key, (None,))[0] == uid:
            del self._refs[key]
        n, self._size[uid] = self._size[uid], 0
        if self._active and n:
            self._event(uid, -n)

    def _resized(self, st: torch.UntypedStorage) -> None:
        entry = self._refs.get(st._cdata)
        if entry is None:
            self._register(st, "existing")
            return
        uid = entry[0]
        n = st.nbytes()
        if n != self._size[uid]:
            delta, self._size[uid] = n - self._size[uid], n
            self._event(uid, delta)

    def _allocator(self) -> str:
        f = sys._getframe(2)
        while f is not None:
            if f.f_code.co_filename.startswith(self._package):
                # a module's inputs or outputs cast to the mixed-precision dtype: activations, not model state
                return self._phase or "setup" if _CASTS.intersection(_names(f)) else "fully_shard"
            f = f.f_back
        return self._phase or "setup"

    # -- the mode ------------------------------------------------------------------------------

    def __enter__(self) -> StorageTracker:
        for st in live_storages():
            if st._cdata not in self._skip:
                self._register(st, "existing")
        orig = torch.UntypedStorage.resize_
        self._orig_resize = orig
        tracker = self

        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            out = orig(st, size)
            tracker._resized(st)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        self._active = True
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: Any) -> None:
        self._active = False
        torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor runs its local ops, which come back here
        inputs = [st for t in tree_leaves((args, kwargs)) for st in _storages(t)]
        for st in inputs:  # allocated where no op showed it: below the dispatcher
            self._register(st, "backend")
        out = func(*args, **(kwargs or {}))
        who = self._allocator()
        if who == "fully_shard" and self._phase == "backward":
            for st in inputs:  # the parameters' full gradients that fully_shard reads
                # None: a meta storage (a fake tensor's: DTensor's sharding propagation)
                entry = self._refs.get(st._cdata)
                if entry is not None and self.category[entry[0]] == "backward":
                    self.category[entry[0]] = "unsharded_grad"
        for t in tree_leaves(out):
            for st in _storages(t):
                entry = self._refs.get(st._cdata)
                if entry is None:
                    self._register(st, who)
                elif st.nbytes() != self._size[entry[0]]:
                    self._resized(st)
        return out
