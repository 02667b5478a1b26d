"""A memory plan and how it reads: ``Plan`` (per rank, every field as data) and ``format_plan``, the table that
``str(plan)`` and ``python -m fully_shard.plan`` print."""

from __future__ import annotations

import dataclasses
import json
import re
import textwrap
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Plan", "GroupPlan", "format_plan", "fmt_bytes", "fmt_count"]


@dataclass
class GroupPlan:
    """One ``fully_shard`` call's parameters, per rank. Byte counts are per call of each
    collective (``all_gathers`` per step: 1, or 2 when resharded after forward)."""

    name: str  # the wrapped module's name; "(root)" for the root's own parameters
    tensors: int  # parameter tensors in the group
    numel: int  # parameter elements (unsharded, unpadded)
    sharded_bytes: int  # this rank's rows of the parameters, in their own dtype
    grad_bytes: int  # sharded gradients as stored (views of padded slots, or copies)
    optimizer_bytes: int  # optimizer state of this rank's rows
    unsharded_bytes: int  # padded unsharded parameters (N slots), all-gather dtype
    unsharded_grad_bytes: int  # full gradients autograd computes, compute dtype
    all_gather_input_bytes: int
    all_gather_output_bytes: int
    reduce_scatter_input_bytes: int
    reduce_scatter_output_bytes: int
    all_reduce_bytes: int  # HSDP, across replicas
    reshard_after_forward: bool | int
    all_gathers: int  # per step


@dataclass
class Plan:
    """Per-rank memory and communication of one training step under fully_shard.

    Bytes are tensor bytes (what the caching allocator is asked for, not what it reserves)
    on ``rank``; activations are counted only when ``batch_size`` is set (else left out).
    ``peak_bytes`` is the most device memory live at once during the step (sharded state,
    in-flight parameters and gradients, optimizer temporaries, activations) and ``peak_at``
    says when. ``str(plan)`` is a readable table;
    ``plan.to_json()`` has every field.

    Example::

        >>> p = plan("llama3-8b", 64)
        >>> p.peak_bytes, p.peak_at, p.groups[0].unsharded_bytes
        (13030327808, 'backward: reduce-scatter of LlamaForCausalLM (root)', 4202708992)
        >>> plan("llama3-8b", 64, batch_size=1, seq_len=8192, activation_checkpointing=True).activation_bytes
        8908865536
    """

    model: str
    mesh_shape: tuple[int, ...]
    rank: int
    shard_size: int
    replicate_size: int
    param_dtype: str | None  # MixedPrecisionPolicy.param_dtype (None: the parameters' own)
    reduce_dtype: str | None
    storage_dtypes: list[str]  # dtypes of the sharded parameters
    optimizer: str
    offload: bool
    reshard_after_forward: bool | int | None
    device_type: str
    num_params: int
    groups: list[GroupPlan]
    # sharded state, per rank
    sharded_param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    buffer_bytes: int  # module buffers, replicated on every rank
    device_state_bytes: int  # what of the above lives on the device
    host_bytes: int  # what of it lives in host memory (CPU offload)
    # transients, per rank, on the device
    peak_unsharded_param_bytes: int  # unsharded parameters + all-gather buffers
    peak_unsharded_grad_bytes: int  # unsharded gradients + reduce-scatter buffers
    optimizer_step_bytes: int  # temporaries of optimizer.step()
    peak_bytes: int
    peak_at: str
    # communication per step, per rank (buffer sizes summed over calls)
    all_gathers: int
    all_gather_input_bytes: int
    all_gather_output_bytes: int
    reduce_scatters: int
    reduce_scatter_input_bytes: int
    reduce_scatter_output_bytes: int
    all_reduces: int
    all_reduce_bytes: int
    send_bytes: int  # bytes this rank sends per step with ring algorithms
    notes: list[str] = field(default_factory=list)
    # device bytes over the measured step, after every allocation and free: [phase, sharded
    # state, unsharded params, unsharded grads, optimizer temporaries, activations]
    memory_trace: list[list[Any]] = field(default_factory=list)
    # activations (None / 0 unless batch_size and seq_len were given), per rank
    batch_size: int | None = None
    seq_len: int | None = None
    activation_checkpointing: bool | list[str] = False  # every block, or the names of the checkpointed ones
    block_activation_bytes: int = 0  # saved for backward by one block (rebuilt in its backward under AC)
    activation_bytes: int = 0  # kept from forward to backward, all of the model, at the end of forward
    peak_activation_bytes: int = 0  # the most live at once in the step (with AC: plus one rebuilt block)

    def to_dict(self) -> dict[str, Any]:
        """Every field, as plain data."""
        return dataclasses.asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        """Every field, as JSON."""
        return json.dumps(self.to_dict(), indent=indent)

    def __str__(self) -> str:
        return format_plan(self)




# -- the table ---------------------------------------------------------------------------------------------


def fmt_bytes(n: float) -> str:
    """Binary units: ``512 B``, ``1.50 KiB``, ..., ``2.00 TiB``.

    Example::

        >>> fmt_bytes(3 * 2**29)
        '1.50 GiB'
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError  # unreachable


def fmt_count(n: float) -> str:
    """Decimal counts: ``950``, ``1.05B``, ``218.11M``.

    Example::

        >>> fmt_count(8_030_261_248)
        '8.03B'
    """
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))


_ROW_FIELDS = (
    "tensors", "numel", "sharded_bytes", "grad_bytes", "optimizer_bytes", "unsharded_bytes",
    "all_gather_input_bytes", "all_gather_output_bytes", "reduce_scatter_input_bytes",
    "reduce_scatter_output_bytes", "all_gathers",
)


def _collapse(groups: list[GroupPlan]) -> list[tuple[str, int, GroupPlan]]:
    """Runs of identical groups named ``prefix.<i>`` with consecutive i: one row each."""
    out: list[tuple[str, int, GroupPlan]] = []
    run: list[GroupPlan] = []

    def key(g: GroupPlan) -> tuple[Any, ...]:
        m = re.fullmatch(r"(.*\.)(\d+)", g.name)
        return (m.group(1) if m else None, *(getattr(g, f) for f in _ROW_FIELDS))

    def flush() -> None:
        if not run:
            return
        if len(run) == 1:
            out.append((run[0].name, 1, run[0]))
        else:
            prefix = key(run[0])[0]
            first, last = run[0].name[len(prefix):], run[-1].name[len(prefix):]
            out.append((f"{prefix}{first}-{last}", len(run), run[0]))
        run.clear()

    for g in groups:
        if run:
            k, prev = key(g), key(run[-1])
            same = k == prev and k[0] is not None
            if not (same and int(g.name.rpartition(".")[2]) == int(run[-1].name.rpartition(".")[2]) + 1):
                flush()
        run.append(g)
    flush()
    return out


WIDTH = 100  # columns: every line format_plan returns fits


def _fit(line: str, width: int = WIDTH) -> list[str]:
    """``line`` as is if it fits, else wrapped at spaces, continued 4 columns deeper."""
    if len(line) <= width:
        return [line]
    indent = " " * (len(line) - len(line.lstrip()) + 4)
    return textwrap.wrap(line, width, subsequent_indent=indent, break_long_words=True, break_on_hyphens=False)


def _shorten(text: str, width: int) -> str:
    """``text``, its start elided with ``...`` if longer than ``width`` (group names end in
    what tells them apart)."""
    return text if len(text) <= width else "..." + text[len(text) - width + 3:]


def _ac_text(ac: bool | list[str]) -> str:
    if isinstance(ac, bool):
        return "on" if ac else "off"
    return f"{len(ac)} blocks" if ac else "off"


def format_plan(p: Plan) -> str:
    """The readable table of a plan (what ``str(plan)`` and the command line print); no
    line is longer than 100 columns (long group names are elided at the start, long
    sentences wrapped).

    Example::

        >>> print(format_plan(plan("llama3-8b", 64)))
        fully_shard memory plan: llama3-8b
          8.03B parameters on mesh 64: FSDP, 64-way shard, rank 0, device ...
        ...
    """
    kind = "FSDP" if p.replicate_size == 1 else f"HSDP ({p.replicate_size} replicas)"
    mesh = "x".join(str(s) for s in p.mesh_shape)
    raf = p.reshard_after_forward
    raf_text = "None (True; root keeps its parameters)" if raf is None else str(raf)
    storage = "/".join(p.storage_dtypes)
    head = [
        f"fully_shard memory plan: {_shorten(p.model, WIDTH - len('fully_shard memory plan: '))}",
        f"  {fmt_count(p.num_params)} parameters on mesh {mesh}: {kind}, {p.shard_size}-way shard, "
        f"rank {p.rank}, device {p.device_type}",
        f"  sharded {storage}; all-gather/compute {p.param_dtype or storage}; reduce "
        f"{p.reduce_dtype or p.param_dtype or storage}; optimizer {p.optimizer}; offload "
        f"{'on' if p.offload else 'off'}",
        f"  reshard_after_forward={raf_text}",
    ]
    if p.batch_size is not None:
        head.append(f"  activations: batch {p.batch_size} x {p.seq_len} tokens per rank, activation "
                    f"checkpointing {_ac_text(p.activation_checkpointing)}")
    head.append("")
    lines = head
    header = ("group", "x", "params", "sharded", "grads", "optim", "unsharded", "RS in", "AGs")
    table: list[tuple[str, ...]] = [header]
    for name, count, g in _collapse(p.groups):
        table.append((
            name, str(count), fmt_count(g.numel), fmt_bytes(g.sharded_bytes), fmt_bytes(g.grad_bytes),
            fmt_bytes(g.optimizer_bytes), fmt_bytes(g.unsharded_bytes),
            fmt_bytes(g.reduce_scatter_input_bytes), str(g.all_gathers),
        ))
    table.append((
        "total", str(len(p.groups)), fmt_count(p.num_params), fmt_bytes(p.sharded_param_bytes),
        fmt_bytes(p.grad_bytes), fmt_bytes(p.optimizer_bytes),
        fmt_bytes(sum(g.unsharded_bytes for g in p.groups)),
        fmt_bytes(sum(g.reduce_scatter_input_bytes for g in p.groups)), str(p.all_gathers),
    ))
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    # the group names take what the other columns leave of the width
    widths[0] = max(len(header[0]), min(widths[0], WIDTH - sum(widths[1:]) - 2 * (len(widths) - 1)))
    for i, r in enumerate(table):
        cells = [_shorten(r[0], widths[0]).ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
        if i == 0 or i == len(table) - 2:
            lines.append("  ".join("-" * w for w in widths))
    lines += [
        "(per group and call; unsharded = all-gather output = N x its input; RS in = reduce-scatter",
        " input = N x its output; AGs = all-gathers per step)",
        "",
    ]
    where = "host" if p.host_bytes else "device"
    lines += [
        f"per rank{'' if p.rank == 0 else f' (rank {p.rank})'}:",
        f"  sharded parameters        {fmt_bytes(p.sharded_param_bytes):>12}  {where}",
        f"  gradients                 {fmt_bytes(p.grad_bytes):>12}  {where}",
        f"  optimizer state           {fmt_bytes(p.optimizer_bytes):>12}  {where}",
    ]
    if p.buffer_bytes:
        lines.append(f"  buffers                   {fmt_bytes(p.buffer_bytes):>12}  device")
    lines += [
        f"  sharded state on device   {fmt_bytes(p.device_state_bytes):>12}",
    ]
    if p.host_bytes:
        lines.append(f"  sharded state on host     {fmt_bytes(p.host_bytes):>12}")
    lines += [
        f"  unsharded params (peak)   {fmt_bytes(p.peak_unsharded_param_bytes):>12}  all-gather buffers included",
        f"  unsharded grads (peak)    {fmt_bytes(p.peak_unsharded_grad_bytes):>12}  reduce-scatter buffers included",
        f"  optimizer step temps      {fmt_bytes(p.optimizer_step_bytes):>12}  {where}",
    ]
    if p.batch_size is not None:
        ac = p.activation_checkpointing
        lines += [
            f"  activations, one block    {fmt_bytes(p.block_activation_bytes):>12}  saved for backward"
            + ("; rebuilt in its backward" if ac else ""),
            f"  activations, kept         {fmt_bytes(p.activation_bytes):>12}  at the end of forward"
            + (" (block inputs and the rest)" if ac else ""),
            f"  activations (peak)        {fmt_bytes(p.peak_activation_bytes):>12}",
        ]
    lines += [
        f"  peak on device            {fmt_bytes(p.peak_bytes):>12}  "
        + ("activations included" if p.batch_size is not None else "plus activations (see --batch-size)"),
        f"    at {p.peak_at}",
        "",
        "communication per step per rank:",
        f"  {p.all_gathers} all-gathers: in {fmt_bytes(p.all_gather_input_bytes)}, "
        f"out {fmt_bytes(p.all_gather_output_bytes)}",
        f"  {p.reduce_scatters} reduce-scatters: in {fmt_bytes(p.reduce_scatter_input_bytes)}, "
        f"out {fmt_bytes(p.reduce_scatter_output_bytes)}",
    ]
    if p.all_reduces:
        lines.append(f"  {p.all_reduces} all-reduces: {fmt_bytes(p.all_reduce_bytes)}")
    lines.append(f"  sends ~{fmt_bytes(p.send_bytes)} (ring algorithms)")
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(out for line in lines for out in _fit(line))
