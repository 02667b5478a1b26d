"""The few formats the benchmarks' pages use: byte and time units, a Markdown table, a saved figure."""

from __future__ import annotations

import os
from typing import Any


def mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.1f}"


def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def save_figure(plt: Any, fig: Any, out_dir: str, name: str) -> str:
    """Save a matplotlib figure as ``out_dir/name`` (PNG); returns the path."""
    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
