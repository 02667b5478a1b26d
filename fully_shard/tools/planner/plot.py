"""A picture of a memory plan: device bytes over the measured training step."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .report import Plan

__all__ = ["memory_figure", "save_memory_plot"]

_KINDS = ("sharded state", "unsharded parameters", "unsharded gradients", "optimizer temporaries", "activations")


def memory_figure(plan: Plan) -> Any:
    """A matplotlib ``Figure``: the plan's device bytes after every allocation and free of
    the step (stacked by kind), the peak marked and named.

    Example::

        >>> memory_figure(plan("llama3-8b", 64)).savefig("memory.png")
    """
    try:
        from matplotlib.figure import Figure  # no pyplot, no GUI backend
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError('the memory plot needs matplotlib: pip install "fully-shard[plot]"') from e
    trace = plan.memory_trace
    if not trace:
        raise ValueError("this plan has no memory_trace (a plan loaded from JSON written before it existed?)")
    gib = 2.0**30
    x = list(range(len(trace)))
    kinds = _KINDS[: len(trace[0]) - 1]  # rows of plans saved before activations have one less
    series = [[row[i + 1] / gib for row in trace] for i in range(len(kinds))]
    fig = Figure(figsize=(10, 4.5), dpi=110)
    ax = fig.subplots()
    ax.stackplot(x, *series, labels=list(kinds), alpha=0.85)
    totals = [sum(row[1:]) for row in trace]
    top = max(range(len(totals)), key=totals.__getitem__)
    ax.annotate(f"peak {totals[top] / gib:.2f} GiB\n{trace[top][0]}", xy=(top, totals[top] / gib),
                xytext=(0.02, 0.97), textcoords="axes fraction", va="top", fontsize=8,
                arrowprops={"arrowstyle": "->", "linewidth": 0.8})
    # phase boundaries: where forward ends and backward begins, and the optimizer step
    for i in range(1, len(trace)):
        if trace[i][0].split(":")[0] != trace[i - 1][0].split(":")[0]:
            ax.axvline(i, color="grey", linewidth=0.4, alpha=0.5)
    ax.set_xlabel("allocations and frees over one step (forward, backward, optimizer step)")
    counted = (f"activations of batch {plan.batch_size} x {plan.seq_len}" if plan.batch_size
               else "activations not included")
    ax.set_ylabel(f"device memory (GiB), {counted}")
    ax.set_title(f"fully_shard memory plan: {plan.model}, mesh {plan.mesh_shape}, rank {plan.rank}", fontsize=9)
    ax.set_ylim(0, totals[top] / gib * 1.25)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=8)  # beside the axis
    fig.tight_layout()
    return fig


def save_memory_plot(plan: Plan, path: str) -> str:
    """Save :func:`memory_figure` as ``path`` (PNG, SVG, ... by extension); returns ``path``.

    Example::

        >>> save_memory_plot(plan("llama3-8b", 64), "memory.png")
        'memory.png'
    """
    memory_figure(plan).savefig(path, bbox_inches="tight")
    return path
