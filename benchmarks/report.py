"""Render benchmark results: a Markdown report, the raw JSON, and PNG plots (matplotlib)."""

from __future__ import annotations

import json
import os
from typing import Any

IMPL_NAMES = {"fully_shard": "fully_shard", "torch_fsdp2": "torch FSDP2", "ddp": "DDP", "unsharded": "unsharded (1 proc)"}

# Targets from the issue.
TARGET_RATIO_TRANSFORMER = 0.9
TARGET_RATIO_OVERHEAD = 0.5
TARGET_MEMORY_SLACK = 0.05
TARGET_APPLY_405B_1024_S = 10.0


def mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.1f}"


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _ok(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """The result of a config that ran (None: error or not supported)."""
    res = cfg.get("result")
    if not res or res.get("not_supported"):
        return None
    return res


def verdict(ratio: dict[str, float]) -> str:
    if ratio["max"] < 1.0:
        return "fully_shard faster in every pair"
    if ratio["min"] > 1.0:
        return "fully_shard slower in every pair"
    return "no difference beyond the spread"


# -- derived quantities ------------------------------------------------------------------


def analytic_min_memory(cfg: dict[str, Any], rank: int) -> dict[str, Any] | None:
    """A lower bound for the per-rank peak of any FSDP implementation, taken at the moment
    the single unsharded process peaks in forward+backward: its activations and temporaries (everything but
    parameters, gradients and optimizer state) are needed as they are; its parameters and
    AdamW state shrink to this rank's shard; the gradients it held then shrink by the same
    fraction; and at least the parameters of the group being computed must be unsharded:
    the largest group with reshard_after_forward=True, every group with False (they stay
    gathered from forward to backward). None where the single-process baseline does not
    exist or does not run in the same dtype (bf16: the baseline is fp32)."""
    res = _ok(cfg) or {}
    mem = res.get("memory_per_rank")
    if not mem or "unsharded" not in mem[0] or cfg["job"]["mp"] != "fp32":
        return None
    single = mem[0]["unsharded"]
    # forward+backward only: the optimizer's temporaries are parameter-sized, so they shrink too
    at_peak = single["at_fwd_bwd_peak"]
    a = res["analytic"]
    state = a["state_bytes_per_rank"][rank]
    fraction = state["params"] / single["state_bytes"]["params"]
    sharded_state = state["params"] + state["optimizer"] + round(at_peak["grads"] * fraction)
    groups = a["group_unsharded_bytes"]
    in_flight = groups[0] if cfg["job"]["reshard"] else a["all_groups_unsharded_bytes"]
    return {
        "sharded_state": sharded_state,
        "activations": at_peak["other"],
        "unsharded_in_flight": in_flight,
        "total": sharded_state + at_peak["other"] + in_flight,
    }


def targets(results: dict[str, Any]) -> list[list[str]]:
    rows: list[list[str]] = []
    for cfg in results["configs"]:
        res = _ok(cfg)
        if not res:
            continue
        target = TARGET_RATIO_OVERHEAD if cfg["kind"] == "overhead" else TARGET_RATIO_TRANSFORMER
        r = res["ratio"]
        ok = "met" if r["max"] <= target else ("not met" if r["min"] > target else "unclear (spread straddles it)")
        rows.append([f"step time `{cfg['name']}` <= {target}x torch", f"{r['median']:.2f}x [{r['min']:.2f}, {r['max']:.2f}]", ok])
    for cfg in results["configs"]:
        res = _ok(cfg) or {}
        mem = res.get("memory_per_rank")
        if not mem:
            continue
        worst = max(m["fully_shard"]["peak_bytes"] / m["torch_fsdp2"]["peak_bytes"] for m in mem)
        rows.append([f"peak memory `{cfg['name']}` <= torch", f"max over ranks {worst:.3f}x torch", "met" if worst <= 1.0 else "not met"])
        mins = [analytic_min_memory(cfg, r) for r in range(len(mem))]
        if all(mins):
            worst_a = max(m["fully_shard"]["peak_bytes"] / a["total"] for m, a in zip(mem, mins))  # type: ignore[index]
            worst_t = max(m["torch_fsdp2"]["peak_bytes"] / a["total"] for m, a in zip(mem, mins))  # type: ignore[index]
            rows.append([
                f"peak memory `{cfg['name']}` within 5% of analytic minimum",
                f"max over ranks {worst_a:.3f}x the minimum (torch FSDP2: {worst_t:.3f}x)",
                "met" if worst_a <= 1 + TARGET_MEMORY_SLACK else "not met",
            ])
    exact = []
    for cfg in results["configs"]:
        res = _ok(cfg) or {}
        if "collectives" in res:
            exact.append(all(collectives_match(res, impl) for impl in ("fully_shard", "torch_fsdp2")))
    sim = results.get("simulation") or {}
    for c in sim.get("fake_step_checks", []):
        exact.append(bool(c.get("fully_shard", {}).get("matches_analytic")))
    for p in sim.get("points", []):
        exact.append(bool(p.get("measured_equals_analytic")))
    if exact:
        rows.append(["collective bytes exactly analytic", f"{sum(exact)}/{len(exact)} checks", "met" if all(exact) else "not met"])
    for p in sim.get("points", []):
        if p["model"] == "llama3-405b" and p["world_size"] == 1024:
            t = p.get("fully_shard", {}).get("apply_s")
            if t is not None:
                rows.append(["fully_shard on 405B / 1024 ranks < 10 s", f"{t:.2f} s", "met" if t < TARGET_APPLY_405B_1024_S else "not met"])
    return rows


def collectives_match(res: dict[str, Any], impl: str) -> bool:
    got = res["collectives"][impl]
    want = res["analytic"]["collectives"]
    for phase, kinds in want.items():
        for kind, v in kinds.items():
            g = got.get(phase, {}).get(kind, {})
            if g.get("count", 0) != v["count"] or g.get("input_bytes", 0) != v["input_bytes"]:
                return False
    extra = {(ph, k) for ph, ks in got.items() for k in ks} - {(ph, k) for ph, ks in want.items() for k in ks}
    return not extra


# -- markdown ----------------------------------------------------------------------------


def render_markdown(results: dict[str, Any], plots: list[str], plot_note: str | None) -> str:
    env = results["environment"]
    out: list[str] = []
    out.append(f"# fully_shard benchmarks: {env['date']} on {env['machine']}")
    out.append("")
    run_kind = "quick smoke run" if results["quick"] else "full run" if results["configs"] else "partial run"
    out.append(f"Command: `{env['command']}` ({run_kind}), "
               f"wall time {results['wall_s']:.0f} s.")
    out.append("")
    out.append(_table(["", ""], [
        ["CPU", f"{env['cpu']} ({env['cores']} cores)"],
        ["torch", env["torch"]],
        ["python", env["python"]],
        ["commit", env["commit"]],
        ["load average before / after", f"{env['load_before']} / {env['load_after']}"],
        ["machine shared", env["shared_note"]],
    ]))
    out.append("")
    if not results["configs"] and "simulation" not in results and (results.get("muon") or results.get("overhead")):
        # --skip-steps --skip-sim: the Muon and/or overhead tables only
        from .muon import render as render_muon
        from .overhead import render as render_overhead

        if results.get("muon"):
            out += render_muon(results["muon"])
        if results.get("overhead"):
            out += render_overhead(results["overhead"])
        return "\n".join(out) + "\n"
    out.append("Every 2-rank job is one spawn of 2 processes (gloo on CPU, 1 intra-op thread each). "
               "Step = forward + backward + AdamW step + zero_grad. Step times are the maximum over the "
               "2 ranks of each sample (a sample = the mean of several steps); fully_shard and torch FSDP2 "
               "run interleaved in the same processes, alternating which goes first. The ratio is "
               "fully_shard / torch FSDP2 per pair; its min/max is the spread. Two identical runs on this "
               "machine differ by ~10%: only ratios whose whole spread is on one side of 1 are a difference.")
    out.append("")

    # step time
    out.append("## Step time")
    out.append("")
    rows = []
    for cfg in results["configs"]:
        res = cfg.get("result")
        if res is None:
            rows.append([cfg["name"], cfg.get("description", ""), "error (see Errors)", "", "", "", "", "", ""])
            continue
        if res.get("not_supported"):
            rows.append([cfg["name"], cfg.get("description", ""), "**not yet**", "", "", res["not_supported"], "", "", ""])
            continue
        st = res["step_time"]
        r = res["ratio"]
        loss = res["final_loss"]
        same = "bitwise equal" if loss["fully_shard"] == loss["torch_fsdp2"] else f"{loss['fully_shard']:.6g} vs {loss['torch_fsdp2']:.6g}"
        rows.append([
            cfg["name"],
            cfg["description"],
            ms(st["fully_shard"]["median_s"]),
            ms(st["torch_fsdp2"]["median_s"]),
            f"**{r['median']:.2f}** [{r['min']:.2f}, {r['max']:.2f}] ({len(r['pairs'])} pairs)",
            verdict(r),
            ms(st.get("ddp", {}).get("median_s")),
            ms(st.get("unsharded", {}).get("median_s")),
            same,
        ])
    out.append(_table(
        ["config", "model / batch", "fully_shard ms", "torch FSDP2 ms", "ratio median [min, max]", "verdict",
         "DDP ms", "unsharded ms", "loss after the timed steps (ours vs torch)"],
        rows,
    ))
    out.append("")
    out.append("`unsharded` is one process (rank 0 alone, rank 1 idle) running the per-rank batch: the "
               "compute floor of one rank. DDP and unsharded run in fp32 in every config (also `bf16`).")
    out.append("")
    out.append("HSDP runs on 4 ranks (2 replicas x 2 shards), so 4 processes share the 2 cores: compare "
               "its ratio, not its absolute times, with the 2-rank rows. If fully_shard rejects a 2-D mesh "
               "the row says **not yet** with its error instead of a number.")
    out.append("")

    # memory
    out.append("## Peak memory per rank (exact storage bytes)")
    out.append("")
    out.append("Peak of live tensor-storage bytes during one steady-state step (the 2nd: optimizer state "
               "exists), from `benchmarks.memory.StorageTracker` (a TorchDispatchMode that follows every "
               "untyped storage and `UntypedStorage.resize_`; not RSS). The model is built inside the "
               "tracker. `at peak` splits the peak into the sharded params / grads / optimizer state and "
               "the rest (activations, unsharded parameters and gradients, communication buffers).")
    out.append("")
    rows = []
    for cfg in results["configs"]:
        mem = (_ok(cfg) or {}).get("memory_per_rank")
        if not mem:
            continue
        for rank, m in enumerate(mem):
            a = analytic_min_memory(cfg, rank)
            ours, theirs = m["fully_shard"], m["torch_fsdp2"]
            bd = ours["at_peak"]
            tbd = theirs["at_peak"]
            rows.append([
                cfg["name"], rank,
                mib(ours["peak_bytes"]), mib(theirs["peak_bytes"]),
                f"{ours['peak_bytes'] / theirs['peak_bytes']:.3f}",
                mib(m.get("ddp", {}).get("peak_bytes")),
                mib(m.get("unsharded", {}).get("peak_bytes")),
                "-" if a is None else mib(a["total"]),
                "-" if a is None else f"{ours['peak_bytes'] / a['total']:.3f} / {theirs['peak_bytes'] / a['total']:.3f}",
                f"{mib(bd['params'] + bd['grads'] + bd['optimizer'])} + {mib(bd['other'])}",
                f"{mib(tbd['params'] + tbd['grads'] + tbd['optimizer'])} + {mib(tbd['other'])}",
                max(ours["phase_peak_bytes"], key=ours["phase_peak_bytes"].get),
            ])
    out.append(_table(
        ["config", "rank", "fully_shard MiB", "torch FSDP2 MiB", "ours/torch", "DDP MiB", "unsharded MiB",
         "analytic minimum MiB", "ours / torch vs minimum", "ours at peak: state + rest", "torch at peak: state + rest",
         "ours peak phase"],
        rows,
    ))
    out.append("")
    out.append("Analytic minimum (fp32 configs): a lower bound for any FSDP implementation, taken at "
               "the moment the single unsharded process peaks in forward+backward (the optimizer's "
               "temporaries are parameter-sized and shrink with the shard). Its activations and temporaries are needed "
               "as they are; its parameters and AdamW state shrink to this rank's shard (exact local "
               "shapes) and the gradients it held then by the same fraction; and the parameters of the "
               "group being computed must be unsharded (reshard_after_forward=True: the largest group; "
               "False: every group, as they stay gathered from forward to backward). It counts no "
               "prefetched group, no communication buffer and no unsharded gradient, so even an ideal "
               "implementation that overlaps communication sits somewhat above it. Not computed for bf16 "
               "(the unsharded baseline is fp32).")
    out.append("")

    # collectives
    out.append("## Collectives per step per rank")
    out.append("")
    out.append("Recorded with `tests.collectives.CollectiveRecorder` over one steady-state step; bytes are "
               "the input tensor of each collective on this rank (all-gather: the padded shard; "
               "reduce-scatter: W x the padded shard). Analytic: forward all-gather = sum of padded shards "
               "of every group, backward all-gather = the same for groups resharded after forward (the "
               "blocks with reshard_after_forward=True; the root is never resharded), reduce-scatter = "
               "W x padded shards in the reduce dtype.")
    out.append("")
    rows = []
    for cfg in results["configs"]:
        res = _ok(cfg) or {}
        if "collectives" not in res:
            continue
        want = res["analytic"]["collectives"]

        def cell(d: dict[str, Any], phase: str, kind: str) -> str:
            v = d.get(phase, {}).get(kind)
            return "0" if not v else f"{v['count']} / {v['input_bytes']:,} B"

        extra_want = sorted({k for ph in want.values() for k in ph} - {"all_gather", "reduce_scatter"})
        rows.append([cfg["name"], "analytic", cell(want, "forward", "all_gather"), cell(want, "backward", "all_gather"),
                     cell(want, "backward", "reduce_scatter"),
                     ", ".join(f"{k}: {cell(want, 'backward', k)}" for k in extra_want) or "none", ""])
        for impl in ("fully_shard", "torch_fsdp2"):
            got = res["collectives"][impl]
            main_kinds = {(p, k) for p in got for k in ("all_gather", "reduce_scatter")}
            others = sorted({(ph, k) for ph, ks in got.items() for k in ks} - main_kinds)
            rows.append([cfg["name"], IMPL_NAMES[impl], cell(got, "forward", "all_gather"), cell(got, "backward", "all_gather"),
                         cell(got, "backward", "reduce_scatter"),
                         ", ".join(f"{k} ({ph}): {cell(got, ph, k)}" for ph, k in others) or "none",
                         "exact" if collectives_match(res, impl) else "**differs**"])
    out.append(_table(["config", "who", "fwd all-gather (n / bytes)", "bwd all-gather", "reduce-scatter",
                       "other collectives", "vs analytic"], rows))
    out.append("")

    # meta apply
    meta = results.get("meta_apply")
    if meta:
        out.append("## fully_shard application time on a meta-device model (2 gloo ranks)")
        out.append("")
        res = meta.get("result")
        if res is None:
            out.append(f"error: {meta.get('error')}")
        else:
            rows = [[meta["description"], f"{res['n_params'] / 1e9:.2f} B", IMPL_NAMES[i], f"{res[i]['median_s']:.3f}",
                     f"{res[i]['min_s']:.3f} - {res[i]['max_s']:.3f}"] for i in ("fully_shard", "torch_fsdp2")]
            out.append(_table(["model", "params", "library", "median s", "min - max s"], rows))
            out.append("")
            out.append(f"Every block then the root, `reshard_after_forward=True`; {len(res['fully_shard']['samples_s'])} "
                       f"repetitions each, a fresh meta model each time (meta build alone: {res['build_median_s']:.2f} s).")
        out.append("")

    # simulation
    sim = results.get("simulation")
    if sim:
        out.append("## Scale simulation (fake process group + meta device, one process)")
        out.append("")
        out.append(f"Per rank (rank 0, which holds the most), fully_shard on every block then the root, "
                   f"param_dtype={sim['param_dtype'].removeprefix('torch.')}, reduce_dtype="
                   f"{sim['reduce_dtype'].removeprefix('torch.')}, sharded state in fp32. Read off the sharded "
                   "DTensors fully_shard produced; `= analytic` says whether every column equals the formula "
                   "computed from the global shapes. Unsharded peak = the two largest groups in flight, in "
                   "bf16 (the root group, embeddings + output, is the largest; with the default root "
                   "reshard_after_forward it stays gathered through forward, so forward holds root + two "
                   "blocks: see `root+2 blocks`). All-gather bytes: input per rank (the padded shard); "
                   "reduce-scatter: input per rank (W x the shard, fp32). Apply times are wall seconds of the "
                   "fully_shard calls alone.")
        out.append("")
        rows = []
        for p in sim["points"]:
            ours = p.get("fully_shard", {})
            m = ours.get("measured")
            th = p.get("torch_fsdp2", {})
            if m is None:
                rows.append([p["model"], p["world_size"], f"error: {ours.get('error')}"] + [""] * 11)
                continue
            total = m["params_bytes"] + m["grads_bytes"] + m["optimizer_bytes"] + m["unsharded_peak_bytes"]
            rows.append([
                p["model"], p["world_size"], gib(m["params_bytes"]), gib(m["grads_bytes"]), gib(m["optimizer_bytes"]),
                gib(m["unsharded_peak_bytes"]), gib(m["root_plus_two_blocks_bytes"]), gib(total),
                gib(m["ag_forward_input_bytes"]), gib(m["ag_backward_input_bytes"]), gib(m["rs_input_bytes"]),
                "yes" if p.get("measured_equals_analytic") else "**no**",
                f"{ours['apply_s']:.2f}",
                f"{th['apply_s']:.2f}" if "apply_s" in th else th.get("error", "-"),
            ])
        out.append(_table(["model", "W", "params GiB", "grads GiB", "AdamW GiB", "unsharded peak GiB",
                           "root+2 blocks GiB", "total excl. activations GiB", "fwd AG GiB", "bwd AG GiB", "RS in GiB",
                           "= analytic", "fully_shard apply s", "torch FSDP2 apply s"], rows))
        out.append("")
        if sim.get("fake_step_checks"):
            out.append("One real forward+backward of a tiny model over the fake group, collectives recorded "
                       "(count / input bytes per rank) and compared with the formula:")
            out.append("")
            rows = []
            for c in sim["fake_step_checks"]:
                for impl in ("fully_shard", "torch_fsdp2"):
                    v = c.get(impl, {})
                    if "error" in v:
                        rows.append([c["world_size"], IMPL_NAMES[impl], f"error: {v['error']}", "", "", ""])
                        continue
                    g = v["recorded"]

                    def cell(phase: str, kind: str) -> str:
                        x = g.get(phase, {}).get(kind)
                        return "0" if not x else f"{x['count']} / {x['input_bytes']:,} B"

                    rows.append([c["world_size"], IMPL_NAMES[impl], cell("forward", "all_gather"), cell("backward", "all_gather"),
                                 cell("backward", "reduce_scatter"), "exact" if v["matches_analytic"] else "**differs**"])
            out.append(_table(["W", "library", "fwd all-gather", "bwd all-gather", "reduce-scatter", "vs analytic"], rows))
            out.append("")

    # targets
    out.append("## Targets from the issue")
    out.append("")
    out.append(_table(["target", "measured", "status"], targets(results)))
    out.append("")

    if results.get("muon"):
        from .muon import render as render_muon

        out.extend(render_muon(results["muon"]))

    if results.get("overhead"):
        from .overhead import render as render_overhead

        out.extend(render_overhead(results["overhead"]))

    # plots
    out.append("## Plots")
    out.append("")
    if plots:
        for p in plots:
            out.append(f"![{os.path.basename(p)}]({os.path.basename(p)})")
            out.append("")
    if plot_note:
        out.append(plot_note)
        out.append("")

    errors = [(c["name"], c["error"]) for c in results["configs"] if c.get("error")]
    if meta and meta.get("error"):
        errors.append(("meta_apply", meta["error"]))
    if errors:
        out.append("## Errors")
        out.append("")
        for name, err in errors:
            out.append(f"### {name}\n\n```\n{err}\n```\n")
    return "\n".join(out) + "\n"


# -- plots -------------------------------------------------------------------------------


def _save(plt: Any, fig: Any, out_dir: str, name: str) -> str:
    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def make_plots(results: dict[str, Any], out_dir: str, stem: str) -> tuple[list[str], str | None]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], ("Plots skipped: matplotlib is not installed (`pip install -e '.[plot]'` or "
                    "`pip install matplotlib`, then run again).")
    paths: list[str] = []

    sim = results.get("simulation")
    if sim and sim["points"]:
        models = list(dict.fromkeys(p["model"] for p in sim["points"]))
        fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
        for ax, model in zip(axes[0], models):
            pts = [p for p in sim["points"] if p["model"] == model and "measured" in p.get("fully_shard", {})]
            ws = [p["world_size"] for p in pts]
            m = [p["fully_shard"]["measured"] for p in pts]
            series = {
                "params (fp32)": [x["params_bytes"] for x in m],
                "AdamW state": [x["optimizer_bytes"] for x in m],
                "unsharded peak (2 groups, bf16)": [x["unsharded_peak_bytes"] for x in m],
                "total excl. activations": [x["params_bytes"] + x["grads_bytes"] + x["optimizer_bytes"]
                                            + x["unsharded_peak_bytes"] for x in m],
            }
            for label, ys in series.items():
                ax.plot(ws, [y / 2**30 for y in ys], marker="o", label=label)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("world size")
            ax.set_ylabel("GiB per rank")
            ax.set_title(model)
            ax.grid(True, which="both", alpha=0.3)
        axes[0][0].legend(fontsize=8)
        paths.append(_save(plt, fig, out_dir, f"{stem}-memory-vs-world-size.png"))

        fig, ax = plt.subplots(figsize=(6, 4))
        for i, model in enumerate(models):
            for impl, style, marker in (("fully_shard", "-", "o"), ("torch_fsdp2", "--", "s")):
                pts = [p for p in sim["points"] if p["model"] == model and "apply_s" in p.get(impl, {})]
                if pts:
                    ax.plot([p["world_size"] for p in pts], [p[impl]["apply_s"] for p in pts], style, marker=marker,
                            color=f"C{i}", label=f"{IMPL_NAMES[impl]} {model}")
        ax.axhline(TARGET_APPLY_405B_1024_S, color="gray", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("world size (fake process group)")
        ax.set_ylabel("seconds to apply fully_shard")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        paths.append(_save(plt, fig, out_dir, f"{stem}-apply-time.png"))

    ovh = results.get("overhead") or {}
    runs = [(r, title) for r, title in ((ovh.get("result"), "world size 1"), ((ovh.get("two_ranks") or {}).get("result"), "2 ranks")) if r]
    if runs:  # issue 20: library overhead (median minus the plain model's) per phase
        fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4), squeeze=False)
        phases, impls = ("forward", "backward", "optimizer", "step"), ("fully_shard", "fully_shard_local_step", "torch_fsdp2")
        labels = {"fully_shard": "fully_shard", "fully_shard_local_step": "fully_shard + local_step", "torch_fsdp2": "torch FSDP2"}
        for ax, (r, title) in zip(axes[0], runs):
            med = r["median_s"]
            for i, impl in enumerate(impls):
                ys = [(med[impl][ph] - med["plain"][ph]) * 1e3 for ph in phases]
                ax.bar([x + (i - 1) * 0.27 for x in range(len(phases))], ys, width=0.27, label=labels[impl])
            ax.set_xticks(range(len(phases)))
            ax.set_xticklabels(["forward", "backward", "optimizer.step\n+ zero_grad", "whole step"], fontsize=8)
            ax.set_ylabel("overhead vs the plain model (ms, median)")
            ax.set_title(f"framework overhead, {title}")
            ax.grid(True, axis="y", alpha=0.3)
            ax.legend(fontsize=7)
        paths.append(_save(plt, fig, out_dir, f"{stem}-overhead.png"))

    cfgs = [c for c in results["configs"] if _ok(c)]
    if cfgs:
        fig, ax = plt.subplots(figsize=(max(4, 1.5 * len(cfgs)), 4))
        xs = range(len(cfgs))
        med = [c["result"]["ratio"]["median"] for c in cfgs]
        lo = [m - c["result"]["ratio"]["min"] for m, c in zip(med, cfgs)]
        hi = [c["result"]["ratio"]["max"] - m for m, c in zip(med, cfgs)]
        ax.errorbar(xs, med, yerr=[lo, hi], fmt="o", capsize=5)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.axhline(TARGET_RATIO_TRANSFORMER, color="gray", lw=0.8, ls="--", label="target 0.9 (transformer)")
        ax.axhline(TARGET_RATIO_OVERHEAD, color="gray", lw=0.8, ls=":", label="target 0.5 (overhead)")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([c["name"] for c in cfgs], rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("step time fully_shard / torch FSDP2")
        ax.set_title("median ratio, bars = min/max over pairs")
        ax.legend(fontsize=7)
        paths.append(_save(plt, fig, out_dir, f"{stem}-step-time-ratio.png"))
    return paths, None


def write(results: dict[str, Any], out_dir: str, stem: str) -> dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    plots, note = make_plots(results, out_dir, stem)
    results["plots"] = [os.path.basename(p) for p in plots]
    results["plot_note"] = note
    md_path = os.path.join(out_dir, f"{stem}.md")
    json_path = os.path.join(out_dir, f"{stem}.json")
    with open(json_path, "w") as f:
        json.dump(results, f, indent=1, default=str)
        f.write("\n")
    with open(md_path, "w") as f:
        f.write(render_markdown(results, plots, note))
    return {"md": md_path, "json": json_path, **{f"plot{i}": p for i, p in enumerate(plots)}}
