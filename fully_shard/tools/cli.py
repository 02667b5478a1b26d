"""``python -m fully_shard.plan``: the memory planner from the command line, and the table
that it and ``str(plan)`` print (``format_plan``).

    python -m fully_shard.plan --model llama3-8b --mesh 64 --param-dtype bf16 --reduce-dtype fp32
    python -m fully_shard.plan --model llama3-70b --mesh 8,64 --json
    python -m fully_shard.plan --model mypkg.models:build --mesh 16 --wrap Block
    python -m fully_shard.plan --model llama3-8b --mesh 64 --batch-size 1 --seq-len 8192 --ac

Bad arguments print a message and exit with status 2.
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from ..policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ..streams import accelerator_type
from .models import PRESETS, load_model
from .plan import OPTIMIZERS, GroupPlan, Plan, plan

__all__ = ["main", "DTYPES", "format_plan", "fmt_bytes", "fmt_count"]

DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "fp64": torch.float64, "float64": torch.float64, "double": torch.float64,
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fully_shard.plan",
        description="Per-rank memory and communication of training a model under fully_shard, "
        "computed from parameter shapes (the model is built on the meta device).",
    )
    p.add_argument("--model", required=True, metavar="NAME|MODULE:CONSTRUCTOR|CONFIG.json",
                   help="package.module:Constructor (called with no arguments under torch.device('meta')), "
                   f"or, built by transformers, a preset ({', '.join(PRESETS)}) or a Hugging Face config.json")
    p.add_argument("--mesh", required=True, metavar="N|R,N",
                   help="shard size N (FSDP), or R,N for HSDP (R replicas of an N-way shard)")
    p.add_argument("--param-dtype", metavar="DTYPE", help="MixedPrecisionPolicy.param_dtype (bf16, fp16, fp32, ...)")
    p.add_argument("--reduce-dtype", metavar="DTYPE", help="MixedPrecisionPolicy.reduce_dtype")
    p.add_argument("--model-dtype", metavar="DTYPE",
                   help="dtype of the (sharded) parameters; default: as the constructor builds them")
    p.add_argument("--optimizer", default="adamw", choices=list(OPTIMIZERS))
    p.add_argument("--reshard-after-forward", metavar="true|false|K",
                   help="for every fully_shard call; default: true except the root")
    p.add_argument("--offload", action="store_true", help="CPUOffloadPolicy: sharded state in host memory")
    p.add_argument("--wrap", metavar="CLASS[,CLASS...]",
                   help="class names of the modules that get their own fully_shard call "
                   "(default: the children of every ModuleList named 'layers')")
    p.add_argument("--rank", type=int, default=0, help="the rank to plan for (default 0, which holds the most)")
    p.add_argument("--device", default=accelerator_type(), choices=[accelerator_type(), "cpu"],
                   help=f"{accelerator_type()}: any device with streams (default); cpu: a CPU (gloo) mesh")
    p.add_argument("--batch-size", type=int, metavar="B",
                   help="sequences per rank per step: with --seq-len, count the activations of a transformers "
                   "Llama-family model (default: activations left out)")
    p.add_argument("--seq-len", type=int, metavar="T", help="tokens per sequence (with --batch-size)")
    p.add_argument("--ac", action="store_true",
                   help="activation checkpointing of every block: keep only block inputs, rebuild one block "
                   "in its backward (needs --batch-size and --seq-len)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    p.add_argument("--plot", metavar="PNG", help="also draw device memory over the step into this file "
                   "(needs matplotlib)")
    return p


def _dtype(parser: argparse.ArgumentParser, flag: str, value: str | None) -> torch.dtype | None:
    if value is None:
        return None
    if value.lower() not in DTYPES:
        parser.error(f"{flag}: unknown dtype {value!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[value.lower()]


def _mesh(parser: argparse.ArgumentParser, value: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(s) for s in value.split(","))
    except ValueError:
        shape = ()
    if not 1 <= len(shape) <= 2 or any(s < 1 for s in shape):
        parser.error(f"--mesh: expected N or R,N with positive integers, got {value!r}")
    return shape


def _reshard(parser: argparse.ArgumentParser, value: str | None) -> bool | int | None:
    if value is None:
        return None
    low = value.lower()
    if low in ("true", "yes", "1"):
        return True
    if low in ("false", "no", "0"):
        return False
    if low.isdigit():
        return int(low)
    parser.error(f"--reshard-after-forward: expected true, false or an integer, got {value!r}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line on ``argv`` (default: ``sys.argv[1:]``); returns the exit status.

    Example::

        >>> main(["--model", "llama3-8b", "--mesh", "64", "--json"])
        0
    """
    parser = _parser()
    args = parser.parse_args(argv)
    mesh = _mesh(parser, args.mesh)
    mp = MixedPrecisionPolicy(
        param_dtype=_dtype(parser, "--param-dtype", args.param_dtype),
        reduce_dtype=_dtype(parser, "--reduce-dtype", args.reduce_dtype),
    )
    model_dtype = _dtype(parser, "--model-dtype", args.model_dtype)
    reshard = _reshard(parser, args.reshard_after_forward)
    try:
        model, label = load_model(args.model)
    except (ValueError, OSError) as e:
        parser.error(f"--model: {e}")
    if model_dtype is not None:
        model = model.to(model_dtype)
    wrap = None
    if args.wrap:
        names = {n.strip() for n in args.wrap.split(",") if n.strip()}
        classes = {type(m) for m in model.modules() if type(m).__name__ in names}
        missing = names - {c.__name__ for c in classes}
        if missing:
            parser.error(f"--wrap: no module of class {', '.join(sorted(missing))} in {label}")
        wrap = classes

    def build() -> nn.Module:
        return model

    build.__qualname__ = label
    offload = CPUOffloadPolicy() if args.offload else OffloadPolicy()
    if (args.batch_size is None) != (args.seq_len is None):
        parser.error("--batch-size and --seq-len go together: give both to count activations, or neither")
    if args.ac and args.batch_size is None:
        parser.error("--ac needs --batch-size and --seq-len (activations are not counted without them)")
    try:
        result = plan(build, mesh, mp_policy=mp, offload_policy=offload, optimizer=args.optimizer,
                      reshard_after_forward=reshard, wrap=wrap, rank=args.rank, device_type=args.device,
                      batch_size=args.batch_size, seq_len=args.seq_len, activation_checkpointing=args.ac)
    except ValueError as e:
        parser.error(str(e))
    print(result.to_json() if args.json else result)
    if args.plot:
        from .plan_plot import save_memory_plot

        print(f"memory over the step: {save_memory_plot(result, args.plot)}", file=sys.stderr if args.json else sys.stdout)
    return 0


# -- the table ----------------------------------------------------------------------------------


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


def format_plan(p: Plan) -> str:
    """The readable table of a plan (what ``str(plan)`` and the command line print); no
    line is longer than 100 columns (long group names are elided at the start, long
    sentences wrapped).

    Example::

        >>> print(format_plan(plan("llama3-8b", 64)))
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
        f"{p.reduce_dtype or p.param_dtype or storage}; optimizer {p.optimizer}; offload {'on' if p.offload else 'off'}",
        f"  reshard_after_forward={raf_text}",
    ]
    if p.batch_size is not None:
        head.append(f"  activations: batch {p.batch_size} x {p.seq_len} tokens per rank, activation "
                    f"checkpointing {'on' if p.activation_checkpointing else 'off'}")
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


if __name__ == "__main__":
    sys.exit(main())
