"""Record every ``torch.distributed`` collective a process issues, for tests.

Usage (inside a ``run_distributed`` body)::

    from support.collectives import CollectiveRecorder

    with CollectiveRecorder() as rec:
        loss = model(x).sum()
        rec.mark("backward")
        loss.backward()
    print(rec.table())
    # all_gather      2  42600
    # ...
    # -- backward --
    # reduce_scatter  2  85200

The recorder patches the collectives in the ``torch.distributed`` module namespace
(``all_gather_single``, ``all_gather_into_tensor``, ``reduce_scatter_single``,
``reduce_scatter_tensor``, ``all_reduce``, ``broadcast``, ``all_gather``,
``reduce_scatter``, ``all_to_all_single``; those that exist in this torch). Code that looks them up on the module
at call time is seen: ``fully_shard/comm.py`` (``getattr(dist, name)(...)``) and torch's
FSDP2 (``dist.all_gather_single(...)``). Functional collectives
(``torch.distributed._functional_collectives``, used by ``DTensor.full_tensor``) and a
collective called from inside another recorded one are not recorded.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CollectiveRecord", "CollectiveRecorder", "format_records", "split_phases"]

# function name -> (normalised kind, name of the argument whose numel is recorded)
_PATCHED: dict[str, tuple[str, str]] = {
    "all_gather_single": ("all_gather", "input_tensor"),
    "all_gather_into_tensor": ("all_gather", "input_tensor"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "all_reduce": ("all_reduce", "tensor"),
    "broadcast": ("broadcast", "tensor"),
    "all_gather": ("all_gather", "tensor"),
    "reduce_scatter": ("reduce_scatter", "input_list"),
    "all_to_all_single": ("all_to_all", "input"),
}
_REDUCTIONS = {"reduce_scatter", "all_reduce"}

# A marker line in the record list: kind is MARK, the label in ``op``.
MARK = "--"


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective: ``kind`` normalised (``all_gather_single`` -> ``all_gather``)."""

    kind: str
    group_size: int
    numel: int  # elements of the input tensor(s) on this rank
    dtype: str  # e.g. "float32"
    op: str | None  # reductions: "SUM", "AVG", ...; None otherwise
    api: str  # the torch.distributed function called
    # all_to_all_single: elements sent to / received from each rank (None: even splits)
    input_splits: tuple[int, ...] | None = None
    output_splits: tuple[int, ...] | None = None

    @property
    def is_mark(self) -> bool:
        return self.kind == MARK

    def key(self) -> tuple[str, int, int]:
        return (self.kind, self.group_size, self.numel)


def _op_name(op: Any) -> str:
    name = getattr(op, "name", None)
    if isinstance(name, str):
        return name
    text = str(op)
    return text.rsplit(".", 1)[-1]


def _numel(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, (list, tuple)):
        return sum(_numel(v) for v in value)
    return 0


def _dtype(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return str(value.dtype).removeprefix("torch.")
    if isinstance(value, (list, tuple)) and value:
        return _dtype(value[0])
    return "?"


class CollectiveRecorder:
    """Context manager: while active, every patched collective appends a
    :class:`CollectiveRecord` to ``records`` (in issue order), then runs unchanged.

    ``mark(label)`` appends a marker (e.g. between forward and backward) that
    :meth:`table` shows as ``-- label --`` and :meth:`phases` splits on.
    """

    def __init__(self) -> None:
        self.records: list[CollectiveRecord] = []
        self._saved: dict[str, Callable[..., Any]] = {}
        self._local = threading.local()

    # -- patching ------------------------------------------------------------------

    def __enter__(self) -> CollectiveRecorder:
        if self._saved:
            raise RuntimeError("CollectiveRecorder is not re-entrant")
        for name in _PATCHED:
            orig = getattr(dist, name, None)
            if orig is not None:
                self._saved[name] = orig
                setattr(dist, name, self._wrap(name, orig))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, orig in self._saved.items():
            setattr(dist, name, orig)
        self._saved = {}

    def _wrap(self, name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
        kind, input_arg = _PATCHED[name]
        try:
            sig: inspect.Signature | None = inspect.signature(orig)
        except (TypeError, ValueError):  # pragma: no cover - builtin without signature
            sig = None

        @functools.wraps(orig)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._local, "depth", 0) == 0:
                self._record(name, kind, input_arg, sig, args, kwargs)
            self._local.depth = getattr(self._local, "depth", 0) + 1
            try:
                return orig(*args, **kwargs)
            finally:
                self._local.depth -= 1

        return wrapper

    def _record(
        self,
        name: str,
        kind: str,
        input_arg: str,
        sig: inspect.Signature | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        bound: dict[str, Any] = dict(kwargs)
        if sig is not None:
            try:
                b = sig.bind(*args, **kwargs)
                b.apply_defaults()
                bound = dict(b.arguments)
            except TypeError:  # let the real function raise its own error
                pass
        group = bound.get("group")
        group_size = dist.get_world_size(group) if group is not None else dist.get_world_size()
        inp = bound.get(input_arg)
        op = _op_name(bound["op"]) if kind in _REDUCTIONS and "op" in bound else None
        splits = [bound.get(k) for k in ("input_split_sizes", "output_split_sizes")]
        input_splits, output_splits = (None if sp is None else tuple(sp) for sp in splits)
        self.records.append(
            CollectiveRecord(kind, group_size, _numel(inp), _dtype(inp), op, name, input_splits, output_splits)
        )

    # -- queries -------------------------------------------------------------------

    def mark(self, label: str) -> None:
        """Append a marker; :meth:`phases` splits the records at markers."""
        self.records.append(CollectiveRecord(MARK, 0, 0, "", label, ""))

    def collectives(self) -> list[CollectiveRecord]:
        """The records without markers."""
        return [r for r in self.records if not r.is_mark]

    def phases(self, first: str = "") -> dict[str, list[CollectiveRecord]]:
        """Records split at markers; see :func:`split_phases`."""
        return split_phases(self.records, first)

    def counts(self) -> dict[str, int]:
        """Number of collectives per kind."""
        return dict(Counter(r.kind for r in self.collectives()))

    def table(self, columns: Iterable[str] = ("kind", "group_size", "numel")) -> str:
        return format_records(self.records, columns)


def format_records(
    records: Iterable[CollectiveRecord], columns: Iterable[str] = ("kind", "group_size", "numel")
) -> str:
    """Render records as a compact aligned table, one collective per line, no header.

    ``columns`` picks any of ``kind``, ``group_size``, ``numel``, ``dtype``, ``op``,
    ``api``. Markers render as ``-- label --``. Stable text for expecttest.
    """
    columns = tuple(columns)
    rows: list[list[str] | str] = []
    for r in records:
        if r.is_mark:
            rows.append(f"-- {r.op} --")
        else:
            rows.append(["" if getattr(r, c) is None else str(getattr(r, c)) for c in columns])
    widths = [0] * len(columns)
    for row in rows:
        if isinstance(row, list):
            widths = [max(w, len(cell)) for w, cell in zip(widths, row)]
    lines = []
    for row in rows:
        if isinstance(row, str):
            lines.append(row)
        else:
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return "\n".join(lines) + ("\n" if lines else "")


def split_phases(records: Iterable[CollectiveRecord], first: str = "") -> dict[str, list[CollectiveRecord]]:
    """Records split at markers: ``{first: before the first marker, label: after it, ...}``
    (a label repeated later continues its list)."""
    out: dict[str, list[CollectiveRecord]] = {first: []}
    current = first
    for r in records:
        if r.is_mark:
            current = r.op or ""
            out.setdefault(current, [])
        else:
            out[current].append(r)
    return out
