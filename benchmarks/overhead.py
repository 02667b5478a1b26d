"""Framework overhead (issue 20): the plain model vs fully_shard vs torch FSDP2, at world size 1 and on 2 ranks.

One process, gloo world size 1 (so no communication at all: every collective is over one rank),
one intra-op thread; then the same on 2 gloo ranks (``--skip-overhead-2rank`` leaves it out), where
every rank runs the plain model on its own and the FSDP implementations over a 2-rank mesh. The
issue's configuration: 24 blocks of dim 64 (ffn 128, vocabulary 256),
batch 2x16, ``fully_shard`` on every block and on the root (defaults), ``torch.optim.AdamW`` with
its defaults. Four implementations, built from the same seed-0 model (deep copies) and fed the
same token batches:

* ``plain``: the unsharded model, no FSDP at all;
* ``fully_shard``: ours, AdamW over its ``nn.Parameter(DTensor)`` parameters;
* ``fully_shard_local_step``: ours, ``fully_shard.optim.local_step(AdamW(...))``;
* ``torch_fsdp2``: ``torch.distributed.fsdp.fully_shard``, AdamW over its DTensor parameters.

Every rank sees the same batches (on 2 ranks too: the average of two equal gradients is exact, so
the losses stay comparable with the plain model's).

Each round runs one step of every implementation (round-robin, the first one rotating each
round), so a busy machine slows all of them alike; the warm-up rounds are dropped. Per step:
forward (model + loss), backward, gradient clipping, ``optimizer.step()`` + ``zero_grad()`` and the
whole step (forward + backward + optimizer: the clipping is timed on its own, outside it), each
timed with ``time.perf_counter``; the medians over the timed rounds are reported (on 2 ranks: of
the slower rank's time in each round). Clipping: ``torch.nn.utils.clip_grad_norm_`` for the plain
model and over torch FSDP2's DTensor gradients, ``fully_shard.clip_grad_norm_`` for ours, with
``max_norm=CLIP_MAX_NORM``, far above the gradients' norm: every gradient is still scaled (by 1.0,
so the numerics stay those of an unclipped step).

Library overhead = an implementation's median step minus the plain model's (the same for each
phase). The hook path per group = (forward + backward overhead) / number of FSDP groups.

Exact by construction (and checked by tests/test_benchmarks_smoke.py): every implementation ran
the same number of steps, and their losses agree step by step (the same arithmetic on the same
numbers, up to the order of floating-point reductions); ours with and
without ``local_step`` are bitwise equal (docs/optimizers.md). Speed is measured here, never
asserted in a test.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

from support.llama import LlamaArgs

IMPLS = ("plain", "fully_shard", "fully_shard_local_step", "torch_fsdp2")
IMPL_LABELS = {
    "plain": "plain model",
    "fully_shard": "fully_shard",
    "fully_shard_local_step": "fully_shard + local_step",
    "torch_fsdp2": "torch FSDP2",
}
PHASES = ("forward", "backward", "clip", "optimizer", "step")
PHASE_LABELS = {
    "forward": "forward",
    "backward": "backward",
    "clip": "clip_grad_norm_ (not in the step)",
    "optimizer": "optimizer.step + zero_grad",
    "step": "whole step",
}

# Issue 20's configuration, and the --quick one.
OVERHEAD_MODEL = LlamaArgs(dim=64, n_layers=24, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256, max_seq_len=16)
OVERHEAD_MODEL_QUICK = LlamaArgs(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=48, vocab_size=67, max_seq_len=16)
GOAL_RATIO = 0.3  # library overhead, ours / torch's
GOAL_HOOK_RATIO = 0.5  # hook path per group, ours / torch's
GOAL_OPTIM_RATIO = 1.3  # optimizer step over our sharded parameters / over plain tensors of the shards' sizes
GOAL_CLIP_RATIO = 1.0  # fully_shard.clip_grad_norm_ / torch's over torch FSDP2's gradients
CLIP_MAX_NORM = 1e6  # far above the gradients' norm: the clip coefficient is exactly 1.0
# Loss agreement between implementations (relative, every step): at world size 1 all four do the
# same arithmetic, only the order of some reductions may differ (flat gradient buffers).
LOSS_RTOL = 1e-5


def job_config(quick: bool) -> dict[str, Any]:
    """The same for world size 1 and 2."""
    if quick:
        return {"args": OVERHEAD_MODEL_QUICK.as_dict(), "batch": 2, "seq": 16, "warmup": 1, "steps": 2}
    return {"args": OVERHEAD_MODEL.as_dict(), "batch": 2, "seq": 16, "warmup": 5, "steps": 100}


def overhead_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """Body of the job on 1 or 2 processes (``benchmarks.spawn.run_job(..., nprocs=world)``)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import fully_shard
    from fully_shard.optim import local_step
    from support.llama import Llama, loss_fn, shard_model, tokens

    largs = LlamaArgs(**job["args"])
    torch.manual_seed(0)
    base = Llama(largs)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    clips: dict[str, Callable[..., Any]] = {impl: torch.nn.utils.clip_grad_norm_ for impl in IMPLS}
    clips["fully_shard"] = clips["fully_shard_local_step"] = fully_shard.clip_grad_norm_

    models: dict[str, torch.nn.Module] = {}
    opts: dict[str, torch.optim.Optimizer] = {}
    for impl in IMPLS:
        model = copy.deepcopy(base)
        if impl != "plain":
            shard_model(model, "torch_fsdp2" if impl == "torch_fsdp2" else "fully_shard", mesh, reshard=True, mp="fp32")
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters())  # AdamW's defaults
        if impl == "fully_shard_local_step":
            opt = local_step(opt)
        models[impl], opts[impl] = model, opt
    groups = largs.n_layers + 1  # one per block and the root

    times: dict[str, dict[str, list[float]]] = {impl: {ph: [] for ph in PHASES} for impl in IMPLS}
    losses: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    rounds = job["warmup"] + job["steps"]
    for i in range(rounds):
        x = tokens(i, 0, largs, job["batch"], job["seq"])  # the same on every rank
        order = IMPLS[i % len(IMPLS):] + IMPLS[:i % len(IMPLS)]  # the first one rotates
        for impl in order:
            net, opt = models[impl], opts[impl]
            t0 = time.perf_counter()
            loss = loss_fn(net(x), x)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            clips[impl](net.parameters(), CLIP_MAX_NORM)
            t3 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            t4 = time.perf_counter()
            losses[impl].append(loss.item())
            if i >= job["warmup"]:
                for ph, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0 - (t3 - t2))):
                    times[impl][ph].append(dt)
    if world > 1:  # each round's time is the slower rank's
        for per_phase in times.values():
            for ph, v in per_phase.items():
                t = torch.tensor(v, dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                per_phase[ph] = t.tolist()

    median = {impl: {ph: statistics.median(v) for ph, v in times[impl].items()} for impl in IMPLS}
    max_rel_diff = {
        impl: max(abs(a - b) / abs(b) for a, b in zip(losses[impl], losses["plain"])) for impl in IMPLS
        if impl != "plain"
    }
    return {
        "world_size": world,
        "config": dict(largs.as_dict(), batch=job["batch"], seq=job["seq"], groups=groups,
                       params=sum(1 for _ in base.parameters())),
        "warmup": job["warmup"],
        "steps": job["steps"],
        "steps_run": {impl: len(losses[impl]) for impl in IMPLS},
        "steps_timed": {impl: len(times[impl]["step"]) for impl in IMPLS},
        "median_s": median,
        "samples_s": times,
        "losses": losses,
        "loss_max_rel_diff_to_plain": max_rel_diff,
        "loss_rtol": LOSS_RTOL,
        "losses_agree": all(d <= LOSS_RTOL for d in max_rel_diff.values()),
        "local_step_bitwise_equal": losses["fully_shard_local_step"] == losses["fully_shard"],
        "paired_overhead_s": paired(times),
        **derived(median, groups),
    }


def paired(times: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    """Per implementation: the median over rounds of (its step - the plain model's step in the same
    round), and that over torch FSDP2's (a check on the difference of medians, less exposed to load
    that changes between rounds)."""
    plain = times["plain"]["step"]
    med = {impl: statistics.median(a - b for a, b in zip(times[impl]["step"], plain)) for impl in IMPLS
           if impl != "plain"}
    torch_med = med["torch_fsdp2"]
    return {"step": med, "ratio_to_torch": {k: (v / torch_med if torch_med > 0 else None) for k, v in med.items()}}


def derived(median: dict[str, dict[str, float]], groups: int) -> dict[str, Any]:
    """Overhead (minus the plain model) per implementation and phase, and ours / torch's."""
    fsdp = [impl for impl in IMPLS if impl != "plain"]
    over = {impl: {ph: median[impl][ph] - median["plain"][ph] for ph in PHASES} for impl in fsdp}
    for impl in fsdp:
        over[impl]["hook_per_group"] = (over[impl]["forward"] + over[impl]["backward"]) / groups
    torch_over = over["torch_fsdp2"]

    def ratio(a: float, b: float) -> float | None:
        return a / b if b > 0 else None

    return {
        "overhead_s": over,
        "ratio_to_torch": {impl: {k: ratio(v, torch_over[k]) for k, v in over[impl].items()}
                           for impl in ("fully_shard", "fully_shard_local_step")},
    }


def run(quick: bool, log: Callable[[str], None], two_ranks: bool = True) -> dict[str, Any]:
    """The overhead tables: one spawned process (gloo, world size 1, one thread), then
    (``two_ranks``) the same job on 2 processes."""
    from .spawn import run_job

    job = job_config(quick)
    out: dict[str, Any] = {"job": job}
    for world in (1, 2) if two_ranks else (1,):
        log(f"[benchmarks] overhead at world size {world} (plain / fully_shard / torch FSDP2)")
        # 2 ranks: half the rounds (each is slower), to keep the run's wall time modest
        world_job = job if world == 1 else dict(job, steps=max(2, job["steps"] // 2))
        res, err, wall = run_job(overhead_job, world_job, nprocs=world, timeout_s=480)
        log(f"[benchmarks]   done in {wall:.0f} s" + (f" (error: {err.splitlines()[-1]})" if err else ""))
        part = {"job": world_job, "result": res, "error": err, "wall_s": wall}
        if world == 1:
            out.update(part)
        else:
            out["two_ranks"] = part
    return out


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms"


def _us(s: float) -> str:
    return f"{s * 1e6:.0f} us"


def _ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def render(section: dict[str, Any]) -> list[str]:
    """Markdown lines of the overhead section: world size 1, then 2 ranks if they ran."""
    lines = ["## Framework overhead at world size 1", ""] + _render_world(section, 1)
    if section.get("two_ranks"):
        lines += ["### The same on 2 gloo ranks", ""] + _render_world(section["two_ranks"], 2)
    return lines


def _render_world(section: dict[str, Any], world: int) -> list[str]:
    res = section.get("result")
    if res is None:
        return [f"The run failed:\n\n```\n{section.get('error')}\n```", ""]
    c = res["config"]
    where = ("One process, gloo world size 1 (no communication), 1 thread" if world == 1 else
             f"{world} processes, gloo, 1 thread each; every rank runs the plain model on its own and the FSDP "
             "implementations over a 2-rank mesh; each round counts the slower rank's time")
    lines = [
        f"{where}; {c['n_layers']} blocks of dim {c['dim']} "
        f"(ffn {c['ffn_dim']}, vocab {c['vocab_size']}), batch {c['batch']}x{c['seq']}, fully_shard per block and "
        f"root ({c['groups']} groups), `torch.optim.AdamW` with its defaults. The four implementations start from "
        f"the same weights, see the same batches and run in turns (one step each per round, the first one "
        f"rotating); medians of {res['steps']} rounds after {res['warmup']} warm-up rounds. "
        "Overhead = the median minus the plain model's median, per phase. Clipping: torch's "
        "`clip_grad_norm_` for the plain model and torch FSDP2, `fully_shard.clip_grad_norm_` for ours "
        f"(max_norm {CLIP_MAX_NORM:g}: every gradient scaled by exactly 1.0), timed outside the whole step.",
        "",
    ]
    med, over, rat = res["median_s"], res["overhead_s"], res["ratio_to_torch"]
    phases = [ph for ph in PHASES if ph in med["plain"]]  # results from before the clipping row have none
    header = ["per step, median"] + [IMPL_LABELS[i] for i in IMPLS]
    rows = [[PHASE_LABELS[ph]] + [_ms(med[i][ph]) for i in IMPLS] for ph in phases]
    lines += ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines.append("")
    header = ["overhead (minus plain)", "fully_shard", "fully_shard + local_step", "torch FSDP2",
              "ours / torch", "ours + local_step / torch"]
    lines += ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for key, label in [(ph, PHASE_LABELS[ph]) for ph in phases] + [("hook_per_group", "hook path per group (fwd+bwd / "
                                                                                      "groups)")]:
        fmt = _us if key == "hook_per_group" else _ms
        row = [label] + [fmt(over[i][key]) for i in ("fully_shard", "fully_shard_local_step", "torch_fsdp2")]
        row += [_ratio(rat["fully_shard"][key]), _ratio(rat["fully_shard_local_step"][key])]
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    best = rat["fully_shard_local_step"]["step"]
    hook = rat["fully_shard_local_step"]["hook_per_group"]
    goals = (
        f"Goal (issue 20): library overhead <= {GOAL_RATIO}x torch FSDP2's: with `local_step` "
        f"{_ratio(best)}, **{'met' if best is not None and best <= GOAL_RATIO else 'not met'}**; without "
        f"{_ratio(rat['fully_shard']['step'])}. Hook path per group < {GOAL_HOOK_RATIO}x torch's: {_ratio(hook)}, "
        f"**{'met' if hook is not None and hook < GOAL_HOOK_RATIO else 'not met'}**. "
    )
    if world == 1:  # the local shards are the whole parameters: the plain model's step is the reference
        opt_ratio = med["fully_shard_local_step"]["optimizer"] / med["plain"]["optimizer"]
        goals += (f"Optimizer step + zero_grad with `local_step` / the plain model's (at world size 1 the local "
                  f"shards are the whole parameters): {opt_ratio:.2f}x, goal <= {GOAL_OPTIM_RATIO}x: "
                  f"**{'met' if opt_ratio <= GOAL_OPTIM_RATIO else 'not met'}**. ")
    if "clip" in phases:
        clip = med["fully_shard"]["clip"] / med["torch_fsdp2"]["clip"]
        goals += (f"`fully_shard.clip_grad_norm_` / torch's over torch FSDP2's gradients: {clip:.2f}x, goal <= "
                  f"{GOAL_CLIP_RATIO}x: **{'met' if clip <= GOAL_CLIP_RATIO else 'not met'}**.")
    lines += [
        goals,
        "",
        "Paired check (median over rounds of the step minus the plain model's step in the same round): "
        + ", ".join(f"{IMPL_LABELS[k]} {_ms(v)}" for k, v in res["paired_overhead_s"]["step"].items())
        + f"; ours / torch {_ratio(res['paired_overhead_s']['ratio_to_torch']['fully_shard'])}, with `local_step` "
        f"{_ratio(res['paired_overhead_s']['ratio_to_torch']['fully_shard_local_step'])}.",
        "",
        f"Numerics: losses of every step within {res['loss_rtol']:g} (relative) of the plain model's: "
        f"{'yes' if res['losses_agree'] else 'NO'} (largest difference "
        + ", ".join(f"{IMPL_LABELS[k]} {v:.2g}" for k, v in res["loss_max_rel_diff_to_plain"].items())
        + "); fully_shard with and without `local_step` bitwise equal: "
        f"{'yes' if res['local_step_bitwise_equal'] else 'NO'}.",
        "",
    ]
    return lines


def plots(ovh: dict[str, Any], plt: Any, out_dir: str, stem: str) -> list[str]:
    """Library overhead (median minus the plain model's) per phase, at world size 1 and on 2 ranks."""
    from .fmt import save_figure

    runs = [(r, title) for r, title in ((ovh.get("result"), "world size 1"),
                                        ((ovh.get("two_ranks") or {}).get("result"), "2 ranks")) if r]
    if not runs:
        return []
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4), squeeze=False)
    phases, impls = ("forward", "backward", "optimizer", "step"), ("fully_shard", "fully_shard_local_step",
                                                                   "torch_fsdp2")
    labels = {"fully_shard": "fully_shard", "fully_shard_local_step": "fully_shard + local_step",
              "torch_fsdp2": "torch FSDP2"}
    for ax, (r, title) in zip(axes[0], runs):
        med = r["median_s"]
        for i, impl in enumerate(impls):
            ys = [(med[impl][ph] - med["plain"][ph]) * 1e3 for ph in phases]
            ax.bar([x + (i - 1) * 0.27 for x in range(len(phases))], ys, width=0.27, label=labels[impl])
        ax.set_xticks(range(len(phases)))
        ax.set_xticklabels(["forward", "backward", "optimizer.step\n+ zero_grad", "whole step"], fontsize=8)
        ax.set(ylabel="overhead vs the plain model (ms, median)", title=f"framework overhead, {title}")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    return [save_figure(plt, fig, out_dir, f"{stem}-overhead.png")]
