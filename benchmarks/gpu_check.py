"""The GPU check: fully_shard vs torch FSDP2 on one accelerator, world size 1.

    python -m benchmarks.gpu_check              # on a machine with a GPU (CUDA, NCCL)
    python -m benchmarks.gpu_check --dry-run    # the same code on the CPU, a tiny model

A Llama-style model of about 1.5B parameters (Llama 3.2 1B shapes, untied output) trains
with bf16 parameters and fp32 gradient reduction under each library, on the same GPU, one
library after the other. World size 1 on NCCL still runs every stream, event and copy path
of fully_shard: the copy-in, the all-gather, the copy-out and the reduce-scatter are real
kernels on their own streams. The table gives, per library: step time (median), tokens/s,
MFU, peak allocated and reserved memory, the caching allocator's cudaMalloc retries, and
the same with pinned-memory CPU offload (a smaller model: the optimizer step runs on the
host), whose steps are also timed by phase (forward, backward, optimizer step). One
fully_shard step is profiled (``torch.profiler``): the chrome trace and a picture of the
device streams are written beside the table, and the table says on which streams the
all-gather and reduce-scatter kernels ran and how much of their time overlaps compute.
The results go to ``benchmarks/results/<date>-<gpu>.md``.

On a machine without an accelerator it exits (status 2) saying so. ``--dry-run`` runs the
same code on the CPU (gloo, a tiny model, memory columns "n/a") so that its logic is
tested in the CPU suite (tests/test_gpu_ready.py, which runs it as a process).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import gzip
import json
import os
import re
import shutil
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from support.llama import Llama, LlamaArgs, fsdp_api, loss_fn, param_count, tokens

# Llama 3.2 1B shapes (https://github.com/meta-llama/llama-models), output not tied: 1.50e9
GPU_1B = LlamaArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, vocab_size=128256, max_seq_len=2048)
# --dry-run: tiny, the same code path
DRY_RUN = LlamaArgs(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=48, vocab_size=67, max_seq_len=16)
# dense bf16 peak FLOP/s (no sparsity), by a substring of the device name
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}
IMPLS = ("fully_shard", "torch_fsdp2")
DEFAULT_OUT = os.path.join(os.path.dirname(__file__), "results")


def _device() -> torch.device | None:
    if not torch.accelerator.is_available():
        return None
    accelerator = torch.accelerator.current_accelerator()
    assert accelerator is not None
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def _init_world_of_one(dev: torch.device) -> None:
    if dev.type == "cpu":
        backend = "gloo"
    else:  # NCCL (or the device's own backend) for device tensors, gloo for host ones
        backend = f"cpu:gloo,{dev.type}:{dist.get_default_backend_for_device(dev.type)}"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def _sync(dev: torch.device) -> None:
    if dev.type != "cpu":
        torch.accelerator.synchronize(dev)


def _memory(dev: torch.device) -> dict[str, Any]:
    if dev.type == "cpu":
        return {"max_allocated": None, "max_reserved": None, "alloc_retries": None}
    return {
        "max_allocated": torch.accelerator.max_memory_allocated(dev),
        "max_reserved": torch.accelerator.max_memory_reserved(dev),
        "alloc_retries": torch.accelerator.memory_stats(dev).get("num_alloc_retries", 0),
    }


def flops_per_token(args: LlamaArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 x (parameters that do matmuls) + causal attention
    (12 x layers x dim x seq_len, halved for the causal mask)."""
    matmul_params = param_count(args) - args.vocab_size * args.dim  # the embedding is a lookup
    return 6 * matmul_params + 6 * args.n_layers * args.dim * seq_len


def peak_flops(dev: torch.device, override_tflops: float | None) -> float | None:
    if override_tflops is not None:
        return override_tflops * 1e12
    if dev.type == "cpu":
        return None
    name = getattr(torch, dev.type).get_device_name(dev)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def train(impl: str, args: LlamaArgs, dev: torch.device, cfg: argparse.Namespace, *, offload: bool,
          profile_to: str | None = None) -> dict[str, Any]:
    """Shard a fresh model with ``impl``, run warm-up + timed steps; times and peak memory."""
    fully_shard, MP = fsdp_api(impl)
    if impl == "fully_shard":
        from fully_shard import CPUOffloadPolicy, OffloadPolicy
    else:
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy  # type: ignore[assignment]
    gc.collect()
    if dev.type != "cpu":
        torch.accelerator.empty_cache()
        torch.accelerator.reset_peak_memory_stats(dev)
    torch.manual_seed(0)
    mesh = init_device_mesh(dev.type, (1,))
    with torch.device(dev):
        model = Llama(args)
    # pinned host memory needs an accelerator (torch's FSDP2 crashes pinning without one)
    policy = CPUOffloadPolicy(pin_memory=dev.type != "cpu") if offload else OffloadPolicy()
    mp = MP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(i: int, marks: list[float] | None = None) -> float:
        def mark() -> None:  # offload: the end of each phase (a device sync costs little beside host copies)
            if marks is not None:
                _sync(dev)
                marks.append(time.perf_counter())

        x = tokens(i, 0, args, cfg.batch_size, cfg.seq_len).to(dev)
        loss = loss_fn(model(x), x)
        mark()
        loss.backward()
        mark()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    steps = cfg.offload_steps if offload else cfg.steps
    times, losses, phases = [], [], []
    for i in range(cfg.warmup + steps):
        _sync(dev)
        start = time.perf_counter()
        marks = [start] if offload else None
        losses.append(step(i, marks))  # float(): waits for the step's last kernel
        _sync(dev)
        end = time.perf_counter()
        if i >= cfg.warmup:
            times.append(end - start)
            if marks is not None:
                phases.append([b - a for a, b in zip(marks, marks[1:] + [end])])
    out: dict[str, Any] = {"impl": impl, "offload": offload, "pinned": offload and dev.type != "cpu",
                           "step_s": statistics.median(times),
                           "losses": losses, **_memory(dev)}
    if phases:  # forward, backward, optimizer step + zero_grad: medians
        out["phases_s"] = [statistics.median(p[k] for p in phases) for k in range(3)]
    if profile_to is not None:
        out["trace"] = profile_step(dev, lambda: step(cfg.warmup + steps), profile_to)
    return out


def profile_step(dev: torch.device, step: Any, path: str) -> str:
    """One step under ``torch.profiler``; writes ``path`` (gzipped chrome trace)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    device_activity = getattr(ProfilerActivity, dev.type.upper(), None)
    if dev.type != "cpu" and device_activity is not None:
        activities.append(device_activity)
    with profile(activities=activities) as prof:
        step()
        _sync(dev)
    raw = path[: -len(".gz")]
    prof.export_chrome_trace(raw)
    with open(raw, "rb") as src, gzip.open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(raw)
    return path


def _kind(name: str) -> str:
    lowered = name.lower()
    if "allgather" in lowered or "all_gather" in lowered:
        return "all-gather"
    if "reducescatter" in lowered or "reduce_scatter" in lowered:
        return "reduce-scatter"
    if "nccl" in lowered:
        return "other collective"
    return "compute"


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _overlap(span: tuple[float, float], union: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(span[1], b) - max(span[0], a)) for a, b in union)


def analyse_trace(path: str) -> dict[str, Any]:
    """Device kernels by stream: the compute stream (the most compute-kernel time), the
    streams that ran all-gather / reduce-scatter kernels, and per stream its kernels, busy
    time and the share of that time overlapping kernels on the compute stream.

    At world size 1 fully_shard issues no collective (a one-rank group has nothing to
    exchange): its side streams then show the copy-in and the gradient packing only."""
    with gzip.open(path, "rt") as f:
        events = json.load(f).get("traceEvents", [])
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    lanes: dict[str, list[tuple[float, float, str]]] = {}
    for e in kernels:
        stream = str(e.get("args", {}).get("stream", e.get("tid")))
        lanes.setdefault(stream, []).append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), _kind(e["name"])))
    if not lanes:  # no device (CPU): fully_shard's phases on the host threads instead
        for e in events:
            if e.get("ph") == "X" and str(e.get("name", "")).startswith("fully_shard::"):
                lane = f"host thread {e.get('tid')}"
                lanes.setdefault(lane, []).append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e["name"]))
        return {"device_kernels": 0, "lanes": lanes, "compute_stream": None, "collectives": {}, "streams": {}}
    busy = {s: sum(b - a for a, b, k in spans if k == "compute") for s, spans in lanes.items()}
    compute_stream = max(busy, key=lambda s: busy[s])
    compute = _union([(a, b) for a, b, k in lanes[compute_stream] if k == "compute"])
    collectives = {kind: sorted(s for s, ss in lanes.items() if any(k == kind for _, _, k in ss))
                   for kind in ("all-gather", "reduce-scatter")}
    streams: dict[str, dict[str, Any]] = {}
    for s, ss in sorted(lanes.items()):
        total = sum(b - a for a, b, _ in ss)
        overlapped = 0.0 if s == compute_stream else sum(_overlap((a, b), compute) for a, b, _ in ss)
        streams[s] = {"kernels": len(ss), "busy_us": total, "kinds": sorted({k for _, _, k in ss}),
                      "overlap": overlapped / total if total else 0.0}
    return {"device_kernels": len(kernels), "lanes": lanes, "compute_stream": compute_stream,
            "collectives": collectives, "streams": streams}


_COLOURS = {"compute": "#4c72b0", "all-gather": "#55a868", "reduce-scatter": "#c44e52", "other collective": "#8172b2"}


def timeline_svg(lanes: dict[str, list[tuple[float, float, str]]], title: str) -> str:
    """A dependency-free picture: one row per stream (or host thread), one box per kernel."""
    width, row, left = 1200, 28, 170
    spans = [s for ss in lanes.values() for s in ss]
    t0 = min((a for a, _, _ in spans), default=0.0)
    t1 = max((b for _, b, _ in spans), default=1.0)
    scale = (width - left - 10) / max(t1 - t0, 1e-9)
    height = 40 + row * len(lanes) + 30
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
             'font-size="12">',
             f'<text x="10" y="20">{title} ({(t1 - t0) / 1000:.1f} ms)</text>']
    for i, (lane, ss) in enumerate(sorted(lanes.items())):
        y = 35 + i * row
        parts.append(f'<text x="10" y="{y + 16}">{lane}</text>')
        for a, b, kind in ss:
            colour = _COLOURS.get(kind, "#999999")
            parts.append(f'<rect x="{left + (a - t0) * scale:.1f}" y="{y}" width="{max((b - a) * scale, 0.5):.1f}" '
                         f'height="{row - 6}" fill="{colour}"><title>{kind}</title></rect>')
    y = 40 + row * len(lanes)
    for j, (kind, colour) in enumerate(_COLOURS.items()):
        parts.append(f'<rect x="{left + j * 160}" y="{y}" width="12" height="12" fill="{colour}"/>'
                     f'<text x="{left + j * 160 + 16}" y="{y + 11}">{kind}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f}"


def streams_table(trace: dict[str, Any]) -> list[str]:
    """The streams of an ``analyse_trace`` result, as Markdown lines."""
    if not trace["device_kernels"]:
        return ["No device kernels in the trace (CPU): the picture shows fully_shard's phases on the host."]
    lines = [f"{trace['device_kernels']} device kernels; compute stream {trace['compute_stream']}; "
             f"all-gather kernels on stream(s) {trace['collectives']['all-gather'] or 'none'}, "
             f"reduce-scatter kernels on {trace['collectives']['reduce-scatter'] or 'none'} (at world "
             "size 1 fully_shard skips the collectives; its side streams hold the copies).", "",
             "| stream | kernels | busy (ms) | kinds | overlaps compute |", "| --- | ---: | ---: | --- | ---: |"]
    for s, st in trace["streams"].items():
        lines.append(f"| {s} | {st['kernels']} | {st['busy_us'] / 1e3:.2f} | {', '.join(st['kinds'])} | "
                     f"{'(compute)' if s == trace['compute_stream'] else format(st['overlap'], '.0%')} |")
    return lines


def render(meta: dict[str, Any], runs: list[dict[str, Any]], trace: dict[str, Any], files: dict[str, str]) -> str:
    lines = [f"# GPU check, {meta['date']}: {meta['device']}", ""]
    if meta["dry_run"]:
        lines += ["**Dry run on the CPU** (tiny model, gloo): it checks the script, not a GPU.", ""]
    lines += [f"torch {meta['torch']}, commit {meta['commit']}, world size 1 ({meta['backend']}); model "
              f"{meta['model']} ({meta['params']:,} parameters), batch {meta['batch_size']} x "
              f"{meta['seq_len']} tokens, bf16 parameters, fp32 reduce, AdamW; median of {meta['steps']} steps "
              f"after {meta['warmup']} warm-up (offload: {meta['offload_steps']} steps, {meta['offload_model']}).", ""]
    lines += ["| library | offload | step (ms) | tokens/s | MFU | max allocated (GiB) | max reserved (GiB) | "
              "cudaMalloc retries |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in runs:
        mfu = "n/a" if r.get("mfu") is None else f"{r['mfu']:.1%}"
        retries = "n/a" if r["alloc_retries"] is None else str(r["alloc_retries"])
        lines.append(f"| {r['impl']} | {('pinned CPU' if r['pinned'] else 'CPU') if r['offload'] else 'no'} | "
                     f"{r['step_s'] * 1e3:.1f} | {r['tokens_per_s']:,.0f} | {mfu} | {_gib(r['max_allocated'])} | "
                     f"{_gib(r['max_reserved'])} | {retries} |")
    timed = [r for r in runs if r.get("phases_s")]
    if timed:
        lines += ["", "Offload steps by phase (medians; the device synchronised at the end of each):", "",
                  "| library | forward (ms) | backward (ms) | optimizer step + zero_grad (ms) |",
                  "| --- | ---: | ---: | ---: |"]
        lines += [f"| {r['impl']} | " + " | ".join(f"{t * 1e3:.1f}" for t in r["phases_s"]) + " |" for r in timed]
    lines += ["", "## Streams (one fully_shard step under torch.profiler)", "", *streams_table(trace)]
    lines += ["", f"Trace: `{files['trace']}` (open in chrome://tracing or ui.perfetto.dev). Picture:", "",
              f"![streams]({files['svg']})", ""]
    return "\n".join(lines)


def _commit() -> str:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(__file__), check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="run the same code on the CPU with a tiny model")
    p.add_argument("--steps", type=int, help="timed steps (default 10; dry run 2)")
    p.add_argument("--warmup", type=int, help="warm-up steps (default 3; dry run 1)")
    p.add_argument("--offload-steps", type=int, help="timed offload steps (default 3; dry run 1)")
    p.add_argument("--batch-size", type=int, help="default 4 (dry run 2)")
    p.add_argument("--seq-len", type=int, help="default 2048 (dry run 16)")
    p.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak, for MFU (default: by name)")
    p.add_argument("--out", default=DEFAULT_OUT, help="folder for the results (default benchmarks/results)")
    p.add_argument("--analyse", metavar="TRACE", help="only analyse this chrome trace (.json.gz) by stream: print the "
                   "analysis as one line of JSON, then the streams table")
    cfg = p.parse_args(argv)
    for name, default, dry in (("steps", 10, 2), ("warmup", 3, 1), ("offload_steps", 3, 1),
                               ("batch_size", 4, 2), ("seq_len", 2048, 16)):
        if getattr(cfg, name) is None:
            setattr(cfg, name, dry if cfg.dry_run else default)
    return cfg


def run(cfg: argparse.Namespace, dev: torch.device) -> dict[str, Any]:
    """Both libraries, without and with offload, on ``dev`` in an initialised world of one;
    writes the results files and returns what they say."""
    small = cfg.dry_run
    args = DRY_RUN if small else GPU_1B
    offload_args = args if small else LlamaArgs(**{**args.as_dict(), "n_layers": 4})
    device_name = "cpu (dry run)" if dev.type == "cpu" else getattr(torch, dev.type).get_device_name(dev)
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    date = datetime.date.today().isoformat()
    os.makedirs(cfg.out, exist_ok=True)
    stem = os.path.join(cfg.out, f"{date}-{slug}")
    files = {"trace": f"{os.path.basename(stem)}-trace.json.gz", "svg": f"{os.path.basename(stem)}-streams.svg"}
    peak = peak_flops(dev, cfg.peak_tflops)
    runs = []
    for offload in (False, True):
        model_args = offload_args if offload else args
        for impl in IMPLS:
            profile = stem + "-trace.json.gz" if impl == "fully_shard" and not offload else None
            r = train(impl, model_args, dev, cfg, offload=offload, profile_to=profile)
            r["tokens_per_s"] = cfg.batch_size * cfg.seq_len / r["step_s"]
            r["mfu"] = r["tokens_per_s"] * flops_per_token(model_args, cfg.seq_len) / peak if peak else None
            runs.append(r)
            print(f"{impl:12s} offload={offload!s:5s} step {r['step_s'] * 1e3:9.1f} ms  "
                  f"max allocated {_gib(r['max_allocated'])} GiB", flush=True)
    trace = analyse_trace(stem + "-trace.json.gz")
    with open(stem + "-streams.svg", "w") as f:
        f.write(timeline_svg(trace["lanes"], f"one fully_shard step on {device_name}"))
    meta = {"date": date, "device": device_name, "dry_run": cfg.dry_run, "torch": torch.__version__,
            "commit": _commit(), "backend": dist.get_backend(), "model": "tiny" if small else "Llama 3.2 1B shapes",
            "params": param_count(args), "batch_size": cfg.batch_size, "seq_len": cfg.seq_len, "steps": cfg.steps,
            "warmup": cfg.warmup, "offload_steps": cfg.offload_steps,
            "offload_model": "the same model" if small else f"{offload_args.n_layers} layers"}
    text = render(meta, runs, trace, files)
    with open(stem + ".md", "w") as f:
        f.write(text)
    with open(stem + ".json", "w") as f:  # every figure of the table, the losses too
        json.dump({"meta": meta, "runs": [{k: v for k, v in r.items() if k != "trace"} for r in runs],
                   "trace": {k: v for k, v in trace.items() if k != "lanes"}}, f, indent=1)
    return {"runs": runs, "trace": trace, "text": text, "stem": stem}


def main(argv: list[str] | None = None) -> int:
    cfg = parse(argv)
    if cfg.analyse:
        trace = analyse_trace(cfg.analyse)
        print(json.dumps({k: v for k, v in trace.items() if k != "lanes"}))
        print("\n".join(streams_table(trace)))
        return 0
    dev = torch.device("cpu") if cfg.dry_run else _device()
    if dev is None:
        print("benchmarks.gpu_check: no GPU here (torch.accelerator.is_available() is False). Run it on a "
              "machine with a GPU, or pass --dry-run to run the same code on the CPU with a tiny model.",
              file=sys.stderr)
        return 2
    _init_world_of_one(dev)
    result = run(cfg, dev)
    print(result["text"])
    stem = result["stem"]
    print(f"written: {stem}.md, {stem}.json, {stem}-trace.json.gz, {stem}-streams.svg")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
