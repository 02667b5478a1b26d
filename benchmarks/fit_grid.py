"""``fully_shard.plan.fit`` on the Llama 3 presets: the recipe, its planned peak and the search's own time (wall and
CPU: the cores may be shared) for each model, world size and budget (1 x 8192 tokens per rank, bf16 allowed, the H100
profile). Writes ``benchmarks/results/<date>-<machine>-fit-grid.json``, which docs/gen_figures.py renders into
docs/tools.md.

    python -m benchmarks.fit_grid [--models llama3-8b,llama3-70b] [--worlds 8,64,512] [--budgets 24,40,80]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time

from fully_shard.tools.planner import fit


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="llama3-8b,llama3-70b")
    p.add_argument("--worlds", default="8,64,512")
    p.add_argument("--budgets", default="24,40,80", help="GiB per rank")
    args = p.parse_args(argv)
    rows: list[dict[str, object]] = []
    machine = f"{platform.system().lower()}-{platform.machine()}-{os.cpu_count()}cpu"
    path = os.path.join(os.path.dirname(__file__), "results", f"{datetime.date.today()}-{machine}-fit-grid.json")
    for model in args.models.split(","):
        for world in (int(w) for w in args.worlds.split(",")):
            for budget in (int(b) for b in args.budgets.split(",")):
                start, cpu = time.perf_counter(), time.process_time()
                try:
                    r = fit(model, world, f"{budget}GiB", batch_size=1, seq_len=8192, mixed_precision=True)
                    row = {"recipe": r.setting.describe(), "peak_bytes": r.peak_bytes, "peak_at": r.peak_at,
                           "step_seconds": r.step_seconds, "send_bytes": r.send_bytes, "planned": r.planned}
                except ValueError as e:
                    row = {"error": str(e)}
                row |= {"model": model, "world": world, "budget_gib": budget,
                        "search_seconds": round(time.perf_counter() - start, 2),
                        "cpu_seconds": round(time.process_time() - cpu, 2), "load": os.getloadavg()[0]}
                print(json.dumps(row), flush=True)
                rows.append(row)
                with open(path, "w") as f:  # after each row: a run cut short keeps what it found
                    json.dump({"tokens_per_rank": [1, 8192], "profile": "h100", "rows": rows}, f, indent=1)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
