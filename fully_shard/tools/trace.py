"""Communication trace: every collective fully_shard issues, as a table and a timeline."""

from __future__ import annotations

import time
from typing import Any

from .. import comm

__all__ = ["CommTrace", "trace_comm"]


class CommTrace:
    """Records the collectives fully_shard completes on this rank while active.

    Each record has the group (module FQN), phase (forward or backward), kind, bytes,
    and start/end times relative to entering the context. Times are CPU-side: on an
    accelerator ``end`` is when the wait returned, i.e. when the stream was told to wait.

    Example::

        >>> from fully_shard.tools import trace_comm
        >>> sharded = [fully_shard(m) for m in (*model.layers, model)]  # each block, then the root
        >>> with trace_comm() as trace:
        ...     model(x).sum().backward()
        >>> print(trace.table())  # a line per collective (one rank issues none), then the totals per kind
        phase     kind            group                        ranks        bytes  start ms   dur ms...
        >>> trace.save_timeline(f"comm-rank{dist.get_rank()}.png")
    """

    def __init__(self) -> None:
        self.events: list[comm.CollectiveEvent] = []
        self.t0 = 0.0

    def __enter__(self) -> CommTrace:
        self.t0 = time.perf_counter()
        comm.add_observer(self.events.append)
        return self

    def __exit__(self, *exc: Any) -> None:
        comm.remove_observer(self.events.append)

    def rows(self) -> list[dict[str, Any]]:
        """One dict per collective: group, phase, kind, group_size, bytes, start_ms, end_ms."""
        rows = []
        for e in self.events:
            rows.append(
                {
                    "group": e.label,
                    "phase": "backward" if e.backward else "forward",
                    "kind": e.kind,
                    "group_size": e.group_size,
                    "bytes": e.nbytes,
                    "start_ms": (e.start - self.t0) * 1e3,
                    "end_ms": ((e.end or e.start) - self.t0) * 1e3,
                }
            )
        return rows

    def table(self) -> str:
        """A readable table, one collective per line, with totals per kind."""
        rows = self.rows()
        lines = [f"{'phase':<9} {'kind':<15} {'group':<28} {'ranks':>5} {'bytes':>12} {'start ms':>9} {'dur ms':>8}"]
        totals: dict[str, int] = {}
        for r in rows:
            lines.append(
                f"{r['phase']:<9} {r['kind']:<15} {r['group']:<28} {r['group_size']:>5} {r['bytes']:>12,} "
                f"{r['start_ms']:>9.2f} {r['end_ms'] - r['start_ms']:>8.2f}"
            )
            totals[r["kind"]] = totals.get(r["kind"], 0) + r["bytes"]
        for kind, nbytes in totals.items():
            count = sum(r["kind"] == kind for r in rows)
            lines.append(f"total     {kind:<15} {count} collectives, {nbytes:,} bytes")
        return "\n".join(lines)

    def save_timeline(self, path: str, title: str | None = None) -> None:
        """Save a PNG timeline (one row per group, forward and backward coloured apart).

        Needs matplotlib: ``pip install "fully-shard[plot]"``.

        Example::

            >>> from fully_shard.tools import trace_comm
            >>> sharded = [fully_shard(m) for m in (*model.layers, model)]  # each block, then the root
            >>> with trace_comm() as trace:
            ...     model(x).sum().backward()
            >>> trace.save_timeline("comm.png", title="step 1, rank 0")
        """
        import matplotlib.pyplot as plt

        fig = self.timeline_figure(title)
        fig.savefig(path, bbox_inches="tight")  # bbox_inches: keep the outside legend in the picture
        plt.close(fig)

    def timeline_figure(self, title: str | None = None) -> Any:
        """The matplotlib ``Figure`` that :meth:`save_timeline` saves: bars per group on
        one axis, the legend to the right of the axis, where it can never cover a bar.

        Example::

            >>> from fully_shard.tools import trace_comm
            >>> sharded = [fully_shard(m) for m in (*model.layers, model)]  # each block, then the root
            >>> with trace_comm() as trace:
            ...     model(x).sum().backward()
            >>> fig = trace.timeline_figure(); fig.savefig("comm.svg")
        """
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError('save_timeline needs matplotlib: pip install "fully-shard[plot]"') from e
        rows = self.rows()
        groups = list(dict.fromkeys(r["group"] for r in rows))
        colours = {"all_gather": "tab:blue", "reduce_scatter": "tab:orange", "all_reduce": "tab:green"}
        fig, ax = plt.subplots(figsize=(10, 0.4 * len(groups) + 1.5))
        for r in rows:
            y = groups.index(r["group"])
            width = max(r["end_ms"] - r["start_ms"], 0.05)
            hatch = "//" if r["phase"] == "backward" else None
            ax.barh(y, width, left=r["start_ms"], color=colours.get(r["kind"], "grey"), hatch=hatch, edgecolor="black",
                    linewidth=0.3)
        ax.set_yticks(range(len(groups)), groups)
        ax.set_xlabel("ms since trace start (hatched: backward)")
        handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
        handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="black", hatch="//"))
        ax.legend(handles, [*colours, "backward"], loc="upper left", bbox_to_anchor=(1.01, 1.0),
                  borderaxespad=0.0, fontsize="small")
        ax.set_title(title or "fully_shard collectives")
        fig.tight_layout()
        return fig


def trace_comm() -> CommTrace:
    """A context manager recording fully_shard's collectives on this rank (see :class:`CommTrace`)."""
    return CommTrace()
