"""``python -m fully_shard.plan``: the memory planner from the command line, and the table
that it and ``str(plan)`` print (``format_plan``).

    python -m fully_shard.plan --model llama3-8b --mesh 64 --param-dtype bf16 --reduce-dtype fp32
    python -m fully_shard.plan --model llama3-70b --mesh 8,64 --json
    python -m fully_shard.plan --model mypkg.models:build --mesh 16 --wrap Block

Bad arguments print a message and exit with status 2.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any, Sequence

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
    try:
        result = plan(build, mesh, mp_policy=mp, offload_policy=offload, optimizer=args.optimizer,
                      reshard_after_forward=reshard, wrap=wrap, rank=args.rank, device_type=args.device)
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


def format_plan(p: Plan) -> str:
    """The readable table of a plan (what ``str(plan)`` and the command line print).

    Example::

        >>> print(format_plan(plan("llama3-8b", 64)))
    """
    kind = "FSDP" if p.replicate_size == 1 else f"HSDP ({p.replicate_size} replicas)"
    mesh = "x".join(str(s) for s in p.mesh_shape)
    raf = p.reshard_after_forward
    raf_text = "None (True; root keeps its parameters)" if raf is None else str(raf)
    storage = "/".join(p.storage_dtypes)
    lines = [
        f"fully_shard memory plan: {p.model} ({fmt_count(p.num_params)} parameters) on mesh {mesh}, "
        f"{kind}, {p.shard_size}-way shard, rank {p.rank}",
        f"  sharded {storage}; all-gather/compute {p.param_dtype or storage}; reduce "
        f"{p.reduce_dtype or p.param_dtype or storage}; optimizer {p.optimizer}; "
        f"reshard_after_forward={raf_text}; offload {'on' if p.offload else 'off'}; device {p.device_type}",
        "",
    ]
    header = ("group", "x", "params", "sharded", "grads", "optim", "unsharded", "AG in", "AG out", "RS in", "RS out", "AGs")
    table: list[tuple[str, ...]] = [header]
    for name, count, g in _collapse(p.groups):
        table.append((
            name, str(count), fmt_count(g.numel), fmt_bytes(g.sharded_bytes), fmt_bytes(g.grad_bytes),
            fmt_bytes(g.optimizer_bytes), fmt_bytes(g.unsharded_bytes), fmt_bytes(g.all_gather_input_bytes),
            fmt_bytes(g.all_gather_output_bytes), fmt_bytes(g.reduce_scatter_input_bytes),
            fmt_bytes(g.reduce_scatter_output_bytes), str(g.all_gathers),
        ))
    table.append((
        "total", str(len(p.groups)), fmt_count(p.num_params), fmt_bytes(p.sharded_param_bytes),
        fmt_bytes(p.grad_bytes), fmt_bytes(p.optimizer_bytes),
        *(fmt_bytes(sum(getattr(g, f) for g in p.groups)) for f in (
            "unsharded_bytes", "all_gather_input_bytes", "all_gather_output_bytes",
            "reduce_scatter_input_bytes", "reduce_scatter_output_bytes")),
        str(p.all_gathers),
    ))
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for i, r in enumerate(table):
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
        if i == 0 or i == len(table) - 2:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("(per group and call: AG = all-gather, RS = reduce-scatter buffers; AGs = all-gathers per step)")
    lines.append("")
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
        f"  peak on device            {fmt_bytes(p.peak_bytes):>12}  at {p.peak_at}; plus activations",
        "",
        f"communication per step per rank: {p.all_gathers} all-gathers "
        f"(in {fmt_bytes(p.all_gather_input_bytes)}, out {fmt_bytes(p.all_gather_output_bytes)}), "
        f"{p.reduce_scatters} reduce-scatters (in {fmt_bytes(p.reduce_scatter_input_bytes)}, out "
        f"{fmt_bytes(p.reduce_scatter_output_bytes)})"
        + (f", {p.all_reduces} all-reduces ({fmt_bytes(p.all_reduce_bytes)})" if p.all_reduces else "")
        + f"; sends ~{fmt_bytes(p.send_bytes)} (ring algorithms)",
    ]
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
