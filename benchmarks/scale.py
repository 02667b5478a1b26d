"""The scale simulation: memory and communication per rank of Llama 3 shapes at 8 to 1,024 ranks, and how long
fully_shard and torch's FSDP2 take to shard them, in one process.

Memory and communication are the planner's (``fully_shard.plan``): fully_shard itself, sharding every block then the
root on a fake process group of each size, and one training step of it on fake tensors (docs/tools.md), with
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, fp32 sharded state, AdamW, activations left out, for
rank 0 (which holds the most). No second model of the step: what the planner measures is what this page shows. The
application time is the wall time of the ``fully_shard`` calls alone on a meta-device model over the same fake world,
for both libraries (torch's at fewer sizes: it grows with the world size).
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch

import fully_shard
from fully_shard import MixedPrecisionPolicy
from fully_shard.tools.planner.run import fake_world
from support.llama import FSDP_IMPLS, Llama, LlamaArgs, shard_model

from .fmt import gib, save_figure, table
from .models import BENCH_TINY, SIM_MODELS

WORLDS, TORCH_WORLDS = [8, 32, 128, 512, 1024], [8, 128, 1024]
POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
FIELDS = ("num_params", "sharded_param_bytes", "grad_bytes", "optimizer_bytes", "peak_unsharded_param_bytes",
          "peak_unsharded_grad_bytes", "peak_bytes", "peak_at", "all_gathers", "all_gather_input_bytes",
          "reduce_scatters", "reduce_scatter_input_bytes")
TARGET_APPLY_405B_1024_S = 10.0
TARGET_PLAN_8B_1024_S = 10.0


def apply_s(impl: str, args: LlamaArgs, world: int) -> float:
    """Seconds ``impl``'s ``fully_shard`` calls take on a meta-device ``Llama(args)`` over ``world`` fake ranks."""
    with fake_world((world,), 0) as mesh:
        with torch.device("meta"):
            model = Llama(args)
        start = time.perf_counter()
        shard_model(model, impl, mesh, True, "bf16")
        return time.perf_counter() - start


def point(name: str, args: LlamaArgs, world: int, impls: tuple[str, ...]) -> dict[str, Any]:
    start = time.perf_counter()
    plan = fully_shard.plan(functools.partial(Llama, args), world, mp_policy=POLICY)
    plan_s = time.perf_counter() - start
    return {"model": name, "world_size": world, "plan_s": plan_s, "plan": {k: getattr(plan, k) for k in FIELDS},
            "apply_s": {impl: apply_s(impl, args, world) for impl in impls}}


def run(quick: bool, log: Any) -> dict[str, Any]:
    for impl in FSDP_IMPLS:  # imports, caches and lazy kernels are paid once, untimed
        apply_s(impl, BENCH_TINY, 8)
    models = {"llama3-8b": SIM_MODELS["llama3-8b"]} if quick else SIM_MODELS
    points = []
    for name, args in models.items():
        for world in [8, 64] if quick else WORLDS:
            impls = FSDP_IMPLS if world in ([8] if quick else TORCH_WORLDS) else ("fully_shard",)
            points.append(point(name, args, world, impls))
            log(f"  scale {name} W={world}: planned in {points[-1]['plan_s']:.1f} s")
    return {"param_dtype": "bfloat16", "reduce_dtype": "float32", "points": points}


def render(sim: dict[str, Any]) -> list[str]:
    rows = []
    for p in sim["points"]:
        plan, applied = p["plan"], p["apply_s"]
        rows.append([p["model"], p["world_size"], gib(plan["sharded_param_bytes"]), gib(plan["grad_bytes"]),
                     gib(plan["optimizer_bytes"]), gib(plan["peak_unsharded_param_bytes"]),
                     gib(plan["peak_unsharded_grad_bytes"]), f"**{gib(plan['peak_bytes'])}**", plan["peak_at"],
                     gib(plan["all_gather_input_bytes"]), gib(plan["reduce_scatter_input_bytes"]), f"{p['plan_s']:.1f}",
                     f"{applied['fully_shard']:.2f}",
                     f"{applied['torch_fsdp2']:.2f}" if "torch_fsdp2" in applied else "-"])
    return ["## Scale simulation (fully_shard.plan: fully_shard on a fake process group, fake tensors)", "",
            "Per rank (rank 0, which holds the most): every block then the root sharded, param_dtype="
            f"{sim['param_dtype']}, reduce_dtype={sim['reduce_dtype']}, fp32 sharded state, AdamW, activations left "
            "out; from one training step of fully_shard itself on a fake process group of W ranks "
            "(benchmarks/scale.py, docs/tools.md). Unsharded parameters and gradients: their peaks, all-gather and "
            "reduce-scatter buffers included; the step's peak is not their sum. All-gather and reduce-scatter: input "
            "bytes per rank per step. Plan s: the whole plan; apply s: the `fully_shard` calls alone on a meta-device "
            "model.", "",
            table(["model", "W", "params GiB", "grads GiB", "AdamW GiB", "unsharded params GiB", "unsharded grads GiB",
                   "peak GiB", "peak at", "AG in GiB", "RS in GiB", "plan s", "fully_shard apply s",
                   "torch FSDP2 apply s"], rows), ""]


def targets(sim: dict[str, Any]) -> list[list[str]]:
    rows = []
    for p in sim["points"]:
        if p["world_size"] == 1024 and p["model"] == "llama3-405b":
            t = p["apply_s"]["fully_shard"]
            rows.append(["fully_shard on 405B / 1024 ranks < 10 s", f"{t:.2f} s",
                         "met" if t < TARGET_APPLY_405B_1024_S else "not met"])
        if p["world_size"] == 1024 and p["model"] == "llama3-8b":
            t = p["plan_s"]
            rows.append(["fully_shard.plan of 8B / 1024 ranks in seconds (< 10 s)", f"{t:.1f} s",
                         "met" if t < TARGET_PLAN_8B_1024_S else "not met"])
    return rows


def plots(sim: dict[str, Any], plt: Any, out_dir: str, stem: str) -> list[str]:
    models = list(dict.fromkeys(p["model"] for p in sim["points"]))
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        pts = [p for p in sim["points"] if p["model"] == model]
        for label, key in (("params (fp32)", "sharded_param_bytes"), ("AdamW state", "optimizer_bytes"),
                           ("unsharded params, peak (bf16)", "peak_unsharded_param_bytes"),
                           ("step peak", "peak_bytes")):
            ax.plot([p["world_size"] for p in pts], [p["plan"][key] / 2**30 for p in pts], marker="o", label=label)
        ax.set(xscale="log", yscale="log", xlabel="world size", ylabel="GiB per rank", title=model)
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    paths = [save_figure(plt, fig, out_dir, f"{stem}-memory-vs-world-size.png")]
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, model in enumerate(models):
        for impl, style in (("fully_shard", "-o"), ("torch_fsdp2", "--s")):
            pts = [p for p in sim["points"] if p["model"] == model and impl in p["apply_s"]]
            ax.plot([p["world_size"] for p in pts], [p["apply_s"][impl] for p in pts], style, color=f"C{i}",
                    label=f"{'torch FSDP2' if impl == 'torch_fsdp2' else impl} {model}")
    ax.axhline(TARGET_APPLY_405B_1024_S, color="gray", lw=0.8, ls=":")
    ax.set(yscale="log", xlabel="world size (fake process group)", ylabel="seconds to apply fully_shard")
    ax.set_xscale("log", base=2)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    return paths + [save_figure(plt, fig, out_dir, f"{stem}-apply-time.png")]

