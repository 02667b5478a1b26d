"""Quantized collectives (``fully_shard.quant``, issue 32): bytes, error, step time and convergence.

    python3 -m benchmarks.quant_comm                        # every part (the convergence runs take long)
    python3 -m benchmarks.quant_comm --parts bytes,error,steps
    python3 -m benchmarks.quant_comm --parts convergence --train-steps 300 --seeds 3

Writes ``<out>/<date>-<machine>-quant-comm.json`` and ``.md``; a part that is not run keeps its previous result
from that file (``--into`` names another). docs/gen_figures.py renders the tables of docs/performance.md from the
newest such file.

* ``bytes``: one training step of a model shaped like the main job's (``examples/train.py``: 4 blocks of dim 128,
  vocabulary 1024), each block sharded then the root, recorded with the tests' ``CollectiveRecorder``, exact and
  quantized (int8 weights; int8 and int4 gradients; embeddings and norms exact), at 2 ranks (FSDP) and 4 ranks
  (HSDP 2 x 2): input bytes per rank and collective, against ``quantized_collective_bytes`` from the
  shapes alone.
* ``error``: ``--error-steps`` AdamW steps with ``measure=True`` (every quantized collective also runs the exact one
  on the same input): per step, the max over groups of the error in the block scheme's units (the block's largest
  magnitude; for a reduction the sum over ranks of those, divided as the op divides), next to the analytic bound in
  the same units, and the largest error / bound, elementwise; fp32 and bf16 parameters (reductions in fp32).
* ``steps``: step time of the same model, exact and quantized, interleaved in the same processes (rounds of one
  step each, the slowest rank per round, medians), at 2 and 4 ranks on gloo.
* ``convergence``: ``examples/train.py`` for ``--train-steps`` steps with each of ``--seeds`` seeds, without
  quantization and with ``--comm-quant int8`` and ``int4``, one run at a time under ``nice``: final train loss (the
  mean of the last 20 steps, and the last) and eval loss, and the seed-to-seed spread.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ("bytes", "error", "steps", "convergence")
MODES = {"exact": (None, None), "int8": ("int8", "int8"), "int4": ("int8", "int4")}  # (weights, grads)
BLOCK = 256
# the main job's model (examples/train.py defaults): SwiGLU hidden 384 = 64 * ceil(2/3 * 4 * 128 / 64)
MODEL = dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=384, vocab_size=1024, max_seq_len=128)
BATCH, SEQ = 8, 128


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _is_exact(name: str) -> bool:
    """The parameters ``default_skip`` keeps exact in this model: the embedding's and the norms'."""
    return "norm" in name or "embeddings" in name


def _build(world_mesh: Any, weights: str | None, grads: str | None, mp: str,
           measure: bool = False) -> tuple[Any, Any, Any]:
    import torch

    from fully_shard import MixedPrecisionPolicy, fully_shard
    from fully_shard.quant import quantize_comms
    from support.llama import Llama, LlamaArgs

    torch.manual_seed(0)
    model = Llama(LlamaArgs(**MODEL))
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mp == "bf16"
              else MixedPrecisionPolicy())
    for block in model.layers:
        fully_shard(block, mesh=world_mesh, mp_policy=policy)
    fully_shard(model, mesh=world_mesh, mp_policy=policy)
    report = None
    if weights or grads:
        report = quantize_comms(model, weights=weights, grads=grads, block_size=BLOCK, measure=measure)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True), report


def _mesh(shape: tuple[int, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape):])


def _step(model: Any, opt: Any, step: int, rank: int) -> float:
    from support.llama import LlamaArgs, loss_fn, tokens

    x = tokens(step, rank, LlamaArgs(**MODEL), BATCH, SEQ)
    loss = loss_fn(model(x), x)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


# -- bytes -------------------------------------------------------------------------------------------------------


def bytes_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    import torch

    from support.collectives import CollectiveRecorder
    from support.llama import Llama, LlamaArgs, loss_fn, tokens

    shape = tuple(job["mesh"])
    shard = shape[-1]
    replicate = world // shard
    base = Llama(LlamaArgs(**MODEL))
    blocks = [[p for p in b.parameters()] for b in base.layers]
    in_blocks = {id(p) for b in blocks for p in b}
    names = {id(p): n for n, p in base.named_parameters()}
    groups = [([(names[id(p)], p) for p in g], True) for g in blocks]  # the blocks reshard after forward
    groups.append(([(n, p) for n, p in base.named_parameters() if id(p) not in in_blocks], False))  # the root
    bits = {"int8": 8, "int4": 4}
    out: dict[str, Any] = {}
    for mp, mode in [("fp32", m) for m in MODES] + [("bf16", "exact"), ("bf16", "int8")]:
        weights, grads = MODES[mode]
        model, opt, _ = _build(_mesh(shape), weights, grads, mp)
        _step(model, opt, 0, rank)  # prefetch order known: the recorded step is a steady one
        x = tokens(1, rank, LlamaArgs(**MODEL), BATCH, SEQ)
        with CollectiveRecorder() as rec:
            loss = loss_fn(model(x), x)
            rec.mark("backward")
            loss.backward()
        counted: dict[str, dict[str, int]] = {}
        for phase, records in rec.phases("forward").items():
            for r in records:
                kinds = counted.setdefault(phase, {})
                kinds[r.kind] = (kinds.get(r.kind, 0)
                                 + r.numel * torch.empty((), dtype=getattr(torch, r.dtype)).element_size())
        dtypes = (torch.bfloat16, torch.float32) if mp == "bf16" else (None, None)
        expected = quantized_collective_bytes(
            groups, shard, bits.get(weights or ""), bits.get(grads or ""), BLOCK, _is_exact, *dtypes,
            replicate=replicate)
        out[f"{mp}-{mode}"] = {"counted": counted, "analytic": expected,
                     "total": sum(v for kinds in counted.values() for v in kinds.values()),
                     "analytic_total": sum(v for kinds in expected.values() for v in kinds.values())}
    return {"mesh": list(shape), "modes": out, "n_params": sum(p.numel() for p in base.parameters())}


def quantized_collective_bytes(
    groups: list[tuple[list[tuple[str, Any]], bool]], world: int, weight_bits: int | None, grad_bits: int | None,
    block: int, is_exact: Any, param_dtype: Any = None, reduce_dtype: Any = None, replicate: int = 1,
) -> dict[str, Any]:
    """Input bytes per rank of one forward+backward under ``fully_shard.quant``, by phase and collective, as the
    recorder counts them, from the shapes: per group (its ``(name, parameter)`` pairs and whether it reshards after
    forward), the quantized elements of a rank's padded row (``ceil(rows / world)`` rows of each parameter) in blocks
    of ``block`` (4 scale bytes and ``block * bits / 8`` code bytes each, the last block padded) and the elements of
    the parameters ``is_exact(name)`` keeps in their dtype. All-gather: one all-gather of that row. Reduce-scatter:
    one all-to-all of ``world`` rows. HSDP (``replicate > 1``): the all-reduce of the shard is an all-to-all of
    ``replicate`` chunks of its quantized part, an all-gather of one chunk and an fp32 all-reduce of its exact
    elements. ``None`` bits: the exact collective."""
    import math

    def row(quant: int, exact: int, bits: int, exact_itemsize: int) -> int:
        return math.ceil(quant / block) * (4 + block * bits // 8) + exact * exact_itemsize

    out: dict[str, Any] = {"forward": {}, "backward": {}}

    def add(phase: str, kind: str, nbytes: int) -> None:
        out[phase][kind] = out[phase].get(kind, 0) + nbytes

    for params, resharded in groups:
        slot = {n: math.ceil(p.shape[0] / world) * math.prod(p.shape[1:]) for n, p in params}
        quant = sum(k for n, k in slot.items() if not is_exact(n))
        exact = sum(k for n, k in slot.items() if is_exact(n))
        pdt = param_dtype or params[0][1].dtype
        size, rsize = pdt.itemsize, (reduce_dtype or pdt).itemsize
        ag = (quant + exact) * size if weight_bits is None or not quant else row(quant, exact, weight_bits, size)
        for phase in ("forward", "backward") if resharded else ("forward",):
            add(phase, "all_gather", ag)
        if grad_bits is None or not quant:
            add("backward", "reduce_scatter", world * (quant + exact) * rsize)
            if replicate > 1:
                add("backward", "all_reduce", (quant + exact) * rsize)
            continue
        add("backward", "all_to_all", world * row(quant, exact, grad_bits, rsize))
        if replicate > 1:
            c = math.ceil(quant / replicate)
            add("backward", "all_to_all", replicate * row(c, 0, grad_bits, 0))
            add("backward", "all_gather", row(c, 0, grad_bits, 0))
            if exact:
                add("backward", "all_reduce", exact * 4)
    return out


# -- error -------------------------------------------------------------------------------------------------------


def error_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    shape = tuple(job["mesh"])
    out: dict[str, Any] = {}
    for mp in ("fp32", "bf16"):
        for mode in ("int8", "int4"):
            weights, grads = MODES[mode]
            model, opt, report = _build(_mesh(shape), weights, grads, mp, measure=True)
            comms = [c for m in report.values() for c in (m.all_gather, m.reduce_scatter) if c is not None]
            steps: list[dict[str, Any]] = []
            for step in range(job["steps"]):
                for c in comms:
                    c.errors.clear()
                loss = _step(model, opt, step, rank)
                per_kind: dict[str, dict[str, float]] = {}
                for c in comms:
                    for r in c.errors:
                        k = per_kind.setdefault(r.kind,
                                                {"max_error": 0.0, "bound": 0.0, "max_ratio": 0.0, "rel_l2": 0.0})
                        for field in k:
                            k[field] = max(k[field], getattr(r, field))
                steps.append({"loss": loss, "kinds": per_kind})
            out[f"{mp}-{mode}"] = steps
    # the max over ranks of every figure
    import torch
    import torch.distributed as dist

    flat = [v for steps in out.values() for s in steps for k in sorted(s["kinds"]) for v in s["kinds"][k].values()]
    t = torch.tensor(flat, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    it = iter(t.tolist())
    for steps in out.values():
        for s in steps:
            for k in sorted(s["kinds"]):
                for field in s["kinds"][k]:
                    s["kinds"][k][field] = next(it)
    return {"mesh": list(shape), "configs": out}


def summarize_errors(configs: dict[str, Any]) -> dict[str, Any]:
    """Per configuration and collective: the max over steps (and groups, ranks) of each figure."""
    out: dict[str, Any] = {}
    for name, steps in configs.items():
        kinds: dict[str, dict[str, float]] = {}
        for s in steps:
            for kind, fig in s["kinds"].items():
                k = kinds.setdefault(kind, dict.fromkeys(fig, 0.0))
                for field, v in fig.items():
                    k[field] = max(k[field], v)
        out[name] = {"steps": len(steps), "kinds": kinds}
    return out


# -- steps -------------------------------------------------------------------------------------------------------


def steps_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    shape = (world,)
    runners = {mode: _build(_mesh(shape), *MODES[mode], job["mp"])[:2] for mode in MODES}
    n = {mode: 0 for mode in MODES}
    for mode, (model, opt) in runners.items():
        for _ in range(job["warmup"]):
            _step(model, opt, n[mode], rank)
            n[mode] += 1
    samples: dict[str, list[float]] = {mode: [] for mode in MODES}
    order = list(MODES)
    for i in range(job["rounds"]):
        for mode in order[i % len(order):] + order[: i % len(order)]:  # the first one rotates
            model, opt = runners[mode]
            dist.barrier()
            t0 = time.perf_counter()
            _step(model, opt, n[mode], rank)
            n[mode] += 1
            samples[mode].append(time.perf_counter() - t0)
    t = torch.tensor([samples[m] for m in MODES], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # per round, the slowest rank
    per_mode = dict(zip(MODES, t.tolist()))
    result = {mode: {"median_s": statistics.median(v), "samples_s": v} for mode, v in per_mode.items()}
    for mode in ("int8", "int4"):
        ratios = [a / b for a, b in zip(per_mode[mode], per_mode["exact"])]
        result[mode]["ratio_median"] = statistics.median(ratios)
    return {"world": world, "mp": job["mp"], "modes": result}


# -- convergence -------------------------------------------------------------------------------------------------


def convergence(steps: int, seeds: int, nice: int, log: Any) -> dict[str, Any]:
    """``examples/train.py`` runs, one at a time, under ``nice``; their metrics files are read back."""
    runs: list[dict[str, Any]] = []
    env = dict(os.environ, PYTHONPATH=ROOT)
    with tempfile.TemporaryDirectory(prefix="quant_conv_") as tmp:
        for seed in range(seeds):
            for mode in MODES:
                metrics = os.path.join(tmp, f"{mode}-{seed}.jsonl")
                cmd = ["nice", "-n", str(nice), sys.executable, os.path.join(ROOT, "examples", "train.py"),
                       f"--steps={steps}",
                       f"--seed={seed}", f"--comm-quant={'none' if mode == 'exact' else mode}", f"--metrics={metrics}",
                       "--no-plot", "--no-progress", f"--log-every={steps}", f"--eval-every={steps // 3}"]
                t0 = time.perf_counter()
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
                wall = time.perf_counter() - t0
                if proc.returncode != 0:
                    raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
                with open(metrics) as f:
                    rows = [json.loads(line) for line in f]
                losses = [r["loss"] for r in rows]
                evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
                runs.append({"mode": mode, "seed": seed, "wall_s": wall, "final_loss": losses[-1],
                             "final_loss_mean20": statistics.fmean(losses[-20:]), "eval": evals,
                             "final_eval": evals[-1][1],
                             "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows[1:])})
                log(f"  {mode} seed {seed}: loss {losses[-1]:.4f} (last 20: {runs[-1]['final_loss_mean20']:.4f}), "
                    f"eval {evals[-1][1]:.4f}, {wall:.0f} s")
    return {"steps": steps, "seeds": seeds, "runs": runs, "summary": summarize_convergence(runs)}


def summarize_convergence(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode: mean, min and max over seeds; and whether each quantized mode's mean lies within the exact runs'
    seed-to-seed spread (min..max) and differs from the exact mean by less than that spread (max - min)."""
    out: dict[str, Any] = {}
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        out[mode] = {k: {"mean": statistics.fmean(r[k] for r in mine), "min": min(r[k] for r in mine),
                         "max": max(r[k] for r in mine)} for k in ("final_loss_mean20", "final_loss", "final_eval")}
        out[mode]["wall_s"] = sum(r["wall_s"] for r in mine)
    for mode in ("int8", "int4"):
        for k in ("final_loss_mean20", "final_eval"):
            ref, got = out["exact"][k], out[mode][k]
            spread = ref["max"] - ref["min"]
            got["within_spread"] = bool(abs(got["mean"] - ref["mean"]) <= spread)
    return out


# -- the report --------------------------------------------------------------------------------------------------


def _mib(n: float) -> str:
    return f"{n / 2**20:.3f} MiB"


def render(res: dict[str, Any]) -> list[str]:
    """Markdown lines of every part present in ``res``."""
    lines: list[str] = []
    if res.get("bytes"):
        lines += ["### Bytes per step per rank", "",
                  f"One forward+backward of the main job's model ({res['bytes'][0]['n_params']:,} parameters; blocks "
                  "resharded after forward, the root not), collective input bytes per rank as the tests' recorder "
                  f"counts them, against the analytic count from the shapes (blocks of {BLOCK}, fp32 scales; "
                  "embedding and norms exact). bf16: `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`.", "",
                  "| mesh | params | collectives | recorded | analytic | of exact |",
                  "| --- | --- | --- | --- | --- | --- |"]
        labels = {"exact": "exact", "int8": "int8 weights, int8 grads", "int4": "int8 weights, int4 grads"}
        for entry in res["bytes"]:
            modes = entry["modes"]
            for name, m in modes.items():
                mp, mode = name.split("-")
                same = "=" if m["total"] == m["analytic_total"] else "**differs**"
                base = modes[f"{mp}-exact"]["total"]
                lines.append(f"| {' x '.join(map(str, entry['mesh']))} | {mp} | {labels[mode]} | {_mib(m['total'])} | "
                             f"{_mib(m['analytic_total'])} ({same}) | {m['total'] / base:.3f} |")
        lines.append("")
    if res.get("error"):
        lines += ["### Error per step against the exact collective", "",
                  "Max over steps, groups and ranks; error in the block scheme's units (the block's largest "
                  "magnitude; for a reduction the sum over ranks of the blocks' largest magnitudes, divided as the op "
                  "divides), the analytic bound in the same units, the largest error / bound elementwise (<= 1), and "
                  "the relative L2 error of the whole buffer.", "",
                  "| mesh | params | config | collective | steps | max error | analytic bound | max error / bound | "
                  "rel. L2 |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        names = {"all_gather": "weight all-gather", "reduce_scatter": "gradient reduce-scatter",
                 "all_reduce": "HSDP all-reduce"}
        for entry in res["error"]:
            for name, s in summarize_errors(entry["configs"]).items():
                mp, mode = name.split("-")
                for kind in ("all_gather", "reduce_scatter", "all_reduce"):
                    if kind not in s["kinds"]:
                        continue
                    k = s["kinds"][kind]
                    bits = "int8" if kind == "all_gather" else mode
                    lines.append(f"| {' x '.join(map(str, entry['mesh']))} | {mp} | {MODES[mode][0]}/{MODES[mode][1]} "
                                 f"| {names[kind]} ({bits}) | {s['steps']} | {k['max_error']:.5f} | {k['bound']:.5f} | "
                                 f"{k['max_ratio']:.4f} | {k['rel_l2']:.2e} |")
        lines.append("")
    if res.get("steps"):
        lines += ["### Step time (gloo, CPU)", "",
                  "| ranks | params | exact | int8/int8 | int4 grads | int8/int8 : exact | int4 : exact |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for e in res["steps"]:
            m = e["modes"]
            lines.append(f"| {e['world']} | {e['mp']} | {m['exact']['median_s'] * 1e3:.0f} ms | "
                         f"{m['int8']['median_s'] * 1e3:.0f} ms | {m['int4']['median_s'] * 1e3:.0f} ms | "
                         f"{m['int8']['ratio_median']:.2f} | {m['int4']['ratio_median']:.2f} |")
        lines.append("")
    if res.get("convergence"):
        c = res["convergence"]
        s = c["summary"]
        lines += ["### Convergence: the main job", "",
                  f"`examples/train.py --steps {c['steps']}` (2 ranks, gloo), seeds 0..{c['seeds'] - 1}; train loss = "
                  "the mean of the last 20 steps' losses; eval = the held-out loss at the end (computed with the run's "
                  "own all-gathers). Mean over seeds, [min, max]; \"within\": the quantized mean differs from the "
                  "exact mean by at most the exact runs' seed-to-seed spread (max - min).", "",
                  "| run | train loss | eval loss | within the spread (train / eval) | wall time, all seeds |",
                  "| --- | --- | --- | --- | --- |"]
        for mode, label in (("exact", "exact"), ("int8", "`--comm-quant int8`"), ("int4", "`--comm-quant int4`")):
            m = s[mode]
            tr, ev = m["final_loss_mean20"], m["final_eval"]
            within = "" if mode == "exact" else (f"{'yes' if tr['within_spread'] else 'no'} / "
                                                 f"{'yes' if ev['within_spread'] else 'no'}")
            lines.append(f"| {label} | {tr['mean']:.4f} [{tr['min']:.4f}, {tr['max']:.4f}] | {ev['mean']:.4f} "
                         f"[{ev['min']:.4f}, {ev['max']:.4f}] | {within} | {m['wall_s']:.0f} s |")
        lines.append("")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    p.add_argument("--into", help="results JSON to update (default: <out>/<date>-<machine>-quant-comm.json)")
    p.add_argument("--machine", default=f"{platform.system().lower()}-{platform.machine()}-{os.cpu_count()}cpu")
    p.add_argument("--error-steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=10, help="timed rounds per world size")
    p.add_argument("--train-steps", type=int, default=300)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--nice", type=int, default=10)
    args = p.parse_args(argv)
    parts = [x for x in args.parts.split(",") if x]
    if bad := sorted(set(parts) - set(PARTS)):
        p.error(f"unknown parts {bad}")
    sys.path.insert(0, ROOT)
    from benchmarks.spawn import run_job

    date = datetime.date.today().isoformat()
    path = args.into or os.path.join(args.out, f"{date}-{args.machine}-quant-comm.json")
    res: dict[str, Any] = {}
    if os.path.exists(path):
        with open(path) as f:
            res = json.load(f)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    for part in parts:
        t0, load = time.perf_counter(), os.getloadavg()[0]
        _log(f"quant-comm: {part} ...")
        if part == "bytes":
            res[part] = [_job(run_job, bytes_job, {"mesh": mesh}, w) for mesh, w in (([2], 2), ([2, 2], 4))]
        elif part == "error":
            res[part] = [_job(run_job, error_job, {"mesh": mesh, "steps": args.error_steps}, w)
                         for mesh, w in (([2], 2), ([2, 2], 4))]
        elif part == "steps":
            res[part] = [_job(run_job, steps_job, {"mp": "fp32", "warmup": 2, "rounds": args.rounds}, w)
                         for w in (2, 4)]
        else:
            res[part] = convergence(args.train_steps, args.seeds, args.nice, _log)
        res.setdefault("runs", {})[part] = {"date": date, "commit": commit,
                                            "wall_s": round(time.perf_counter() - t0, 1),
                                            "load_before": round(load, 2), "load_after": round(os.getloadavg()[0], 2),
                                            "cores": os.cpu_count()}
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
        with open(path.removesuffix(".json") + ".md", "w") as f:
            f.write("\n".join([f"# Quantized collectives: {os.path.basename(path).removesuffix('.json')}", "",
                               *_run_lines(res), "", *render(res)]))
        _log(f"quant-comm: {part} done in {time.perf_counter() - t0:.0f} s -> {path}")
    return 0


def _run_lines(res: dict[str, Any]) -> list[str]:
    return [f"- {part}: {r['date']}, commit {r['commit']}, {r['wall_s']:.0f} s, load average {r['load_before']} before "
            f"and {r['load_after']} after on {r['cores']} cores" for part, r in res.get("runs", {}).items()]


def _job(run_job: Any, fn: Any, job: dict[str, Any], world: int) -> Any:
    result, error, _ = run_job(fn, job, nprocs=world, timeout_s=3000)
    if error is not None:
        raise RuntimeError(f"{fn.__name__} on {world} ranks: {error}")
    return result


if __name__ == "__main__":
    sys.exit(main())
