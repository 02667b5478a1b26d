"""``python -m fully_shard.plan``: the memory planner from the command line (the table it prints is ``report.py``'s).

    python -m fully_shard.plan --model llama3-8b --mesh 64 --param-dtype bf16 --reduce-dtype fp32
    python -m fully_shard.plan --model llama3-70b --mesh 8,64 --json
    python -m fully_shard.plan --model mypkg.models:build --mesh 16 --wrap Block
    python -m fully_shard.plan --model llama3-8b --mesh 64 --batch-size 1 --seq-len 8192 --ac
    python -m fully_shard.plan --model llama3-70b --mesh 64 --fit 80GiB --batch-size 1 --seq-len 8192 --mixed-precision

Bad arguments print a message and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch
import torch.nn as nn

from ...policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ...streams import accelerator_type
from .api import OPTIMIZERS, plan
from .cost import PROFILES
from .fit import fit
from .models import PRESETS, load_model

__all__ = ["main", "DTYPES"]

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
    p.add_argument("--fit", metavar="BUDGET", help="instead of planning one configuration, find the fastest that fits "
                   "BUDGET per rank (80GiB, 24GB): prints the recipe, its peak, and why not the settings next to it "
                   "that use less memory")
    p.add_argument("--mixed-precision", action="store_true", help="with --fit: allow bf16 all-gathers and compute")
    p.add_argument("--profile", default="h100", choices=list(PROFILES), help="with --fit: the device of the "
                   "step-time model")
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
        {
          "model": "llama3-8b",
        ...
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
    if args.fit:
        try:
            recipe = fit(build, mesh, args.fit, profile=args.profile, batch_size=args.batch_size, seq_len=args.seq_len,
                         mixed_precision=args.mixed_precision, optimizer=args.optimizer, device_type=args.device,
                         explain=True)
        except ValueError as e:
            parser.error(str(e))
        print(f"{recipe}\n\n{recipe.to_toml()}", end="")
        return 0
    try:
        result = plan(build, mesh, mp_policy=mp, offload_policy=offload, optimizer=args.optimizer,
                      reshard_after_forward=reshard, wrap=wrap, rank=args.rank, device_type=args.device,
                      batch_size=args.batch_size, seq_len=args.seq_len, activation_checkpointing=args.ac)
    except ValueError as e:
        parser.error(str(e))
    print(result.to_json() if args.json else result)
    if args.plot:
        from .plot import save_memory_plot

        print(f"memory over the step: {save_memory_plot(result, args.plot)}",
              file=sys.stderr if args.json else sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
