"""``python3 -m benchmarks [--quick] [--out benchmarks/results]``

Benchmarks fully_shard against torch's FSDP2, DDP and one unsharded process on CPU/gloo at
world size 2, the Muon optimizer step (benchmarks/muon.py) at world 2 and 4, the framework
overhead at world size 1 and on 2 ranks (benchmarks/overhead.py: plain model / fully_shard / torch FSDP2), then simulates
8..1024 ranks in one process (fake process group + meta device). Writes
``<out>/<yyyy-mm-dd>-<machine>.md`` and ``.json`` (and PNG plots when matplotlib is
installed). See docs/benchmarks.md.
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
from .models import (
    BENCH_OVERHEAD,
    BENCH_SMALL,
    BENCH_TINY,
    META_APPLY_MODEL,
    META_APPLY_MODEL_QUICK,
    SIM_MODELS,
    LlamaArgs,
    param_count,
)

SIM_WORLDS = [8, 32, 128, 512, 1024]
SIM_CHECK_WORLDS = [8, 128, 1024]
SIM_TORCH_WORLDS = [8, 128, 1024]  # torch FSDP2's application time grows with W: fewer points


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _describe(args: LlamaArgs, batch: int, seq: int) -> str:
    return (f"{param_count(args) / 1e6:.2f}M params, {args.n_layers} blocks of dim {args.dim} "
            f"(ffn {args.ffn_dim}, vocab {args.vocab_size}), batch {batch}x{seq} per rank")


def step_configs(quick: bool) -> list[dict[str, Any]]:
    if quick:
        job = dict(args=BENCH_TINY.as_dict(), batch=2, seq=16, mp="fp32", reshard=True,
                   warmup=1, pairs=1, steps_per_sample=1)
        return [{"name": "tiny-fsdp", "kind": "transformer", "description": _describe(BENCH_TINY, 2, 16), "job": job}]
    common = dict(args=BENCH_SMALL.as_dict(), batch=4, seq=64, warmup=2, pairs=5, steps_per_sample=2)
    desc = _describe(BENCH_SMALL, 4, 64)
    # memory is not the point of the overhead config (and tracking 32 blocks is slow)
    overhead = dict(args=BENCH_OVERHEAD.as_dict(), batch=1, seq=8, mp="fp32", reshard=True,
                    warmup=1, pairs=5, steps_per_sample=2, memory=False)
    return [
        {"name": "transformer-fsdp", "kind": "transformer", "description": desc + ", fp32, reshard_after_forward=True",
         "job": dict(common, mp="fp32", reshard=True)},
        {"name": "transformer-no-reshard", "kind": "transformer",
         "description": desc + ", fp32, reshard_after_forward=False", "job": dict(common, mp="fp32", reshard=False)},
        {"name": "transformer-bf16", "kind": "transformer",
         "description": desc + ", MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)",
         "job": dict(common, mp="bf16", reshard=True)},
        {"name": "hsdp-2x2", "kind": "transformer", "world_size": 4,
         "description": _describe(BENCH_SMALL, 2, 64) + ", fp32, HSDP mesh (replicate 2, shard 2) on 4 ranks",
         "job": dict(common, batch=2, mp="fp32", reshard=True, mesh_shape=[2, 2], pairs=5, warmup=1)},
        {"name": "overhead", "kind": "overhead", "description": _describe(BENCH_OVERHEAD, 1, 8) + ", fp32",
         "job": overhead},
    ]


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

    from .spawn import run_job
    from .step import meta_apply_job, quick_job, step_job

    results: dict[str, Any] = {"quick": args.quick, "environment": env, "configs": []}
    meta_job = {"args": (META_APPLY_MODEL_QUICK if args.quick else META_APPLY_MODEL).as_dict(), "reps": 1 if args.quick else 3,
                "mp": "bf16"}
    meta_desc = ("tiny Llama (quick)" if args.quick else "Llama-3.2-3B shapes (untied output)") + ", bf16 mp policy"
    if not args.skip_steps:
        for cfg in step_configs(args.quick):
            _log(f"[benchmarks] {cfg['name']}: {cfg['description']}")
            job = dict(cfg["job"])
            if args.quick:
                job["meta_apply"] = meta_job  # one spawn in quick mode
            res, err, wall = run_job(quick_job if args.quick else step_job, job, nprocs=cfg.get("world_size", 2),
                                     timeout_s=480)
            if args.quick and res is not None:
                results["meta_apply"] = {"description": meta_desc, "result": res.pop("meta_apply"), "wall_s": wall}
            cfg = dict(cfg, result=res, error=err, wall_s=wall)
            results["configs"].append(cfg)
            _log(f"[benchmarks]   done in {wall:.0f} s" + (f" (error: {err.splitlines()[-1] if err else ''})" if err else ""))
        if not args.quick:
            _log(f"[benchmarks] meta-device application time: {meta_desc}")
            res, err, wall = run_job(meta_apply_job, meta_job, nprocs=2, timeout_s=300)
            results["meta_apply"] = {"description": meta_desc, "result": res, "error": err, "wall_s": wall}
            _log(f"[benchmarks]   done in {wall:.0f} s")

    if not args.skip_muon:
        from . import muon

        results["muon"] = muon.run(args.quick, _log)

    if not args.skip_overhead:
        from . import overhead

        results["overhead"] = overhead.run(args.quick, _log, two_ranks=not args.skip_overhead_2rank)

    if not args.skip_sim:
        from .simulate import run_simulation

        _log("[benchmarks] scale simulation (fake process group, meta device)")
        elapsed = time.perf_counter() - t_start
        torch_worlds = SIM_TORCH_WORLDS if elapsed < 420 else [8, 1024]  # keep the full run under 10 min
        if args.quick:
            sim = run_simulation({"llama3-8b": SIM_MODELS["llama3-8b"]}, [8, 64], check_worlds=[8], log=_log)
        else:
            sim = run_simulation(SIM_MODELS, SIM_WORLDS, check_worlds=SIM_CHECK_WORLDS, log=_log,
                                 torch_worlds=torch_worlds)
        results["simulation"] = sim

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
