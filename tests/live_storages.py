"""A dispatch-level tracker of live tensor storages, by who allocated them (for test_plan).

:class:`LiveStorages` is a ``TorchDispatchMode``. On entry it registers every tensor storage
that already exists (found through ``gc``: the sharded parameters, optimizer state,
buffers, and fully_shard's unsharded buffers, whose storage is resized to 0 between
uses). While active it registers the storage of every op output it has not seen,
follows ``UntypedStorage.resize_`` (how fully_shard frees and re-grows unsharded
parameters; it bypasses the dispatcher) and sees a storage freed through a weakref
callback on its (preserved) Python object. Each storage gets a category when first seen:

* ``existing``: before entry;
* ``fully_shard``: allocated with a frame of the fully_shard package on the stack
  (all-gather and reduce-scatter buffers, unsharded parameters, sharded gradients);
* ``forward`` / ``backward`` / ``optimizer``: allocated by other code in that phase
  (``phase()``): activations, activation gradients, optimizer temporaries;
* ``unsharded_grad``: a ``backward`` storage that fully_shard later reads in backward
  (its post-backward hook casts or packs the parameters' full gradients), so the
  parameter gradients are told apart from the activation gradients;
* ``backend``: first seen as the *input* of an op, so allocated where no op showed it:
  inside a process-group backend. gloo's reduce-scatter copies its whole input and
  works on the copy until ``wait()``, where an ``aten.split`` of it is the first sight.
  It is reported apart (a gloo detail: NCCL reduces in place), and is only visible from
  that ``wait()`` on.

Categories can change after the fact, so the tracker keeps the event log (storage,
byte delta) and :meth:`report` replays it: the peak of all storages, the peak of
everything but activations (``forward`` + unread ``backward``) and ``backend``
storages, the peak of activations and of ``backend``.
Blind spots: memory gloo allocates itself, temporaries that live and die inside one
DTensor op, allocator rounding.
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


def _storages(t: Any) -> list[torch.UntypedStorage]:
    if isinstance(t, DTensor):
        return _storages(t._local_tensor)
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return []
    try:
        return [t.untyped_storage()]
    except (RuntimeError, NotImplementedError):  # sparse, or no storage
        return []


class LiveStorages(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self._package = os.path.dirname(os.path.abspath(fully_shard.__file__)) + os.sep
        self._refs: dict[int, tuple[int, weakref.ref[Any]]] = {}  # StorageImpl address -> (uid, ref)
        self._size: dict[int, int] = {}  # uid -> bytes now
        self.category: dict[int, str] = {}  # uid -> category
        self.events: list[tuple[int, int, str]] = []  # (uid, byte delta, phase)
        self._phase = "setup"
        self._orig_resize: Any = None
        self._active = False

    # -- phases and the report --------------------------------------------------------------

    def phase(self, name: str) -> None:
        self._phase = name

    def report(self) -> dict[str, Any]:
        """Peaks in bytes: ``total`` (every storage), ``model_state`` (all but activations
        and backend storages), ``activations``, ``backend``, and the split of
        ``model_state``'s peak by category and phase."""
        by_cat: dict[str, int] = {}
        peaks = {"total": 0, "model_state": 0, "activations": 0, "backend": 0}
        at_model_peak: dict[str, Any] = {}
        for uid, delta, phase in self.events:
            cat = self.category[uid]
            by_cat[cat] = by_cat.get(cat, 0) + delta
            if delta <= 0:
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

    def _register(self, st: torch.UntypedStorage, category: str) -> None:
        key = st._cdata
        if key in self._refs:
            return
        uid = len(self._size)
        self._refs[key] = (uid, weakref.ref(st, lambda _r, key=key, uid=uid: self._freed(key, uid)))
        self._size[uid] = n = st.nbytes()
        self.category[uid] = category
        self.events.append((uid, n, self._phase))

    def _freed(self, key: int, uid: int) -> None:
        if self._refs.get(key, (None,))[0] == uid:
            del self._refs[key]
        n, self._size[uid] = self._size[uid], 0
        if self._active and n:
            self.events.append((uid, -n, self._phase))

    def _resized(self, st: torch.UntypedStorage) -> None:
        entry = self._refs.get(st._cdata)
        if entry is None:
            self._register(st, "existing")
            return
        uid = entry[0]
        n = st.nbytes()
        if n != self._size[uid]:
            self.events.append((uid, n - self._size[uid], self._phase))
            self._size[uid] = n

    def _allocator(self) -> str:
        f = sys._getframe(2)
        while f is not None:
            if f.f_code.co_filename.startswith(self._package):
                return "fully_shard"
            f = f.f_back
        return self._phase

    # -- the mode ------------------------------------------------------------------------------

    def __enter__(self) -> LiveStorages:
        gc.collect()
        with warnings.catch_warnings():  # isinstance() on deprecated torch objects warns
            warnings.simplefilter("ignore")
            tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
        for t in tensors:
            for st in _storages(t):
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
                uid = self._refs[st._cdata][0]
                if self.category[uid] == "backward":
                    self.category[uid] = "unsharded_grad"
        for t in tree_leaves(out):
            for st in _storages(t):
                entry = self._refs.get(st._cdata)
                if entry is None:
                    self._register(st, who)
                elif st.nbytes() != self._size[entry[0]]:
                    self._resized(st)
        return out
