"""``python3 -m benchmarks [--quick] [--out benchmarks/results]``

One runner per question, each with its own section of the page: step time, peak memory and collectives against
torch's FSDP2, DDP and one unsharded process on CPU/gloo at world size 2, with fully_shard's plan of them
(``step.py``); the Muon optimizer step at world 2 and 4 (``muon.py``); the framework overhead at world size 1 and on 2
ranks (``overhead.py``); memory, communication and application time at 8 to 1,024 ranks, in one process
(``scale.py``: the planner, fully_shard on a fake process group). Writes ``<out>/<yyyy-mm-dd>-<machine>.md`` and
``.json`` (and PNG plots when matplotlib is installed). See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import subprocess
import sys
import time
from typing import Any

from . import report


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _environment(args: argparse.Namespace, machine: str) -> dict[str, Any]:
    import torch

    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", *cmd], capture_output=True, text=True, timeout=10).stdout.strip()
        except Exception:
            return ""

    if args.commit:
        commit = args.commit
    else:
        commit = git("rev-parse", "--short", "HEAD") or "unknown"
        if git("status", "--porcelain", "--", "fully_shard"):
            commit += " (fully_shard/ has uncommitted changes)"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"model name\s*:\s*(.*)", f.read())
            if m:
                cpu = m.group(1).strip()
    except OSError:
        pass
    return {
        "date": datetime.date.today().isoformat(),
        "machine": machine,
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "commit": commit,
        "command": "python3 -m benchmarks" + (" --quick" if args.quick else "") + "".join(
            f" --skip-{name}" for name in ("steps", "muon", "overhead", "overhead-2rank", "sim")
            if getattr(args, f"skip_{name.replace('-', '_')}")),
    }


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m benchmarks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny smoke run (about 30 CPU-seconds)")
    parser.add_argument("--out", default=os.path.join("benchmarks", "results"), help="output directory")
    parser.add_argument("--machine", default=None, help="machine name in the file names (default: os-arch-Ncpu)")
    parser.add_argument("--note", default=None, help="free text added to the 'machine shared' line")
    parser.add_argument("--commit", default=None, help="label for the code measured (default: git HEAD)")
    parser.add_argument("--skip-sim", action="store_true", help="skip the scale simulation")
    parser.add_argument("--skip-steps", action="store_true", help="skip the 2-rank jobs")
    parser.add_argument("--skip-muon", action="store_true", help="skip the Muon optimizer table")
    parser.add_argument("--skip-overhead", action="store_true",
                        help="skip the overhead tables (plain / fully_shard / torch FSDP2; world size 1 and 2 ranks)")
    parser.add_argument("--skip-overhead-2rank", action="store_true",
                        help="keep the world-size-1 overhead table, skip its 2-rank run")
    args = parser.parse_args(argv)

    t_start = time.perf_counter()
    load_before = _load()
    machine = args.machine or f"{platform.system().lower()}-{platform.machine()}-{os.cpu_count()}cpu"
    machine = re.sub(r"[^A-Za-z0-9_.-]+", "-", machine)
    env = _environment(args, machine)

    results: dict[str, Any] = {"quick": args.quick, "environment": env, "configs": []}
    if not args.skip_steps:
        from . import step

        results["configs"] = step.run(args.quick, _log)
    if not args.skip_muon:
        from . import muon

        results["muon"] = muon.run(args.quick, _log)
    if not args.skip_overhead:
        from . import overhead

        results["overhead"] = overhead.run(args.quick, _log, two_ranks=not args.skip_overhead_2rank)
    if not args.skip_sim:
        from . import scale

        _log("[benchmarks] scale simulation (fully_shard.plan on a fake process group)")
        results["simulation"] = scale.run(args.quick, _log)

    load_after = _load()
    env["load_before"] = f"{load_before:.2f}"
    env["load_after"] = f"{load_after:.2f}"
    busy = load_before > 0.5
    env["shared_note"] = (
        (f"yes: the 1-minute load average was {load_before:.1f} before the run started on {env['cores']} cores "
         "(other jobs were running), so step times are noisy" if busy else
         f"no other load seen before the run (load average {load_before:.1f})")
        + (f"; {args.note}" if args.note else "")
    )
    results["wall_s"] = time.perf_counter() - t_start
    stem = f"{env['date']}-{machine}"
    if args.skip_steps and args.skip_sim:
        # the Muon and/or overhead tables alone: their own page ("-muon", "-overhead" or
        # "-muon-overhead"; docs/gen_figures.py's "muon" and "overhead" regions read the first two)
        stem += "".join(f"-{name}" for name, skipped in (("muon", args.skip_muon), ("overhead", args.skip_overhead))
                        if not skipped)
    paths = report.write(results, args.out, stem)
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    _log(f"[benchmarks] total {results['wall_s']:.0f} s")
    failed = [c["name"] for c in results["configs"] if c.get("error")]
    failed += [f"muon-{m['world']}" for m in results.get("muon", {}).get("steps", []) if m.get("error")]
    failed += ["overhead"] if results.get("overhead", {}).get("error") else []
    failed += ["overhead-2rank"] if results.get("overhead", {}).get("two_ranks", {}).get("error") else []
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
