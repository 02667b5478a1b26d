"""The benchmarks' page: a header, each runner's section (its own ``render``), the targets, the plots and the errors;
written as Markdown beside the raw JSON (``write``). ``docs/gen_figures.py`` renders the newest run into the docs."""

from __future__ import annotations

import json
import os
from typing import Any

from . import muon, overhead, scale, step
from .fmt import table


def render_markdown(results: dict[str, Any], plots: list[str], plot_note: str | None) -> str:
    env = results["environment"]
    kind = "quick smoke run" if results["quick"] else "full run" if results.get("configs") else "partial run"
    out = [f"# fully_shard benchmarks: {env['date']} on {env['machine']}", "",
           f"Command: `{env['command']}` ({kind}), wall time {results['wall_s']:.0f} s.", "",
           table(["", ""],
                 [["CPU", f"{env['cpu']} ({env['cores']} cores)"], ["torch", env["torch"]], ["python", env["python"]],
                            ["commit", env["commit"]],
                  ["load average before / after", f"{env['load_before']} / {env['load_after']}"],
                            ["machine shared", env["shared_note"]]]), ""]
    configs, sim = results.get("configs") or [], results.get("simulation")
    if configs:
        out += ["Every 2-rank job is one spawn of 2 processes (gloo on CPU, 1 intra-op thread each). Step = forward + "
                "backward + AdamW step + zero_grad. Step times are the maximum over the ranks of each sample (a sample "
                "= the mean of several steps); fully_shard and torch FSDP2 run interleaved in the same processes, "
                "alternating which goes first. The ratio is fully_shard / torch FSDP2 per pair; its min/max is the "
                "spread. Two identical runs on this machine differ by ~10%: only ratios whose whole spread is on one "
                "side of 1 are a difference.", "", *step.render(configs)]
    if sim:
        out += scale.render(sim)
    goals = (step.targets(configs) if configs else []) + (scale.targets(sim) if sim else [])
    if goals:
        out += ["## Targets from the issue", "", table(["target", "measured", "status"], goals), ""]
    if results.get("muon"):
        out += muon.render(results["muon"])
    if results.get("overhead"):
        out += overhead.render(results["overhead"])
    out += ["## Plots", "", *[f"![{os.path.basename(p)}]({os.path.basename(p)})\n" for p in plots],
            *([plot_note, ""] if plot_note else [])]
    errors = [(c["name"], c["error"]) for c in configs if c.get("error")]
    if errors:
        out += ["## Errors", "", *[f"### {name}\n\n```\n{err}\n```\n" for name, err in errors]]
    return "\n".join(out) + "\n"


def make_plots(results: dict[str, Any], out_dir: str, stem: str) -> tuple[list[str], str | None]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "Plots skipped: matplotlib is not installed (`pip install -e '.[plot]'`, then run again)."
    paths = scale.plots(results["simulation"], plt, out_dir, stem) if results.get("simulation") else []
    paths += overhead.plots(results["overhead"], plt, out_dir, stem) if results.get("overhead") else []
    return paths + step.plots(results.get("configs") or [], plt, out_dir, stem), None


def write(results: dict[str, Any], out_dir: str, stem: str) -> dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    plots, note = make_plots(results, out_dir, stem)
    results["plots"], results["plot_note"] = [os.path.basename(p) for p in plots], note
    md_path, json_path = os.path.join(out_dir, f"{stem}.md"), os.path.join(out_dir, f"{stem}.json")
    with open(json_path, "w") as f:
        json.dump(results, f, indent=1, default=str)
        f.write("\n")
    with open(md_path, "w") as f:
        f.write(render_markdown(results, plots, note))
    return {"md": md_path, "json": json_path, **{f"plot{i}": p for i, p in enumerate(plots)}}
