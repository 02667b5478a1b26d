"""``python3 -m benchmarks.optim_step [--steps N] [--foreach]``: the optimizer step over sharded
parameters, with and without ``fully_shard.optim.local_step``. ``--in-backward``: peak memory of a
training step with the optimizer stepped inside backward against the usual step (see
:func:`in_backward_memory`).

Issue 20's configuration: one process (gloo, world size 1, so no communication at all), one
thread, 24 blocks of dim 64 (ffn 128, vocabulary 256), ``fully_shard`` per block and on the
root, AdamW with its defaults (on the CPU ``foreach=None`` means the per-tensor loop; ``--foreach``
times ``foreach=True``). Gradients come from one real forward/backward (batch 2x16) and stay
in place, so each timed call is one ``optimizer.step()`` (no ``zero_grad``). Three optimizers,
timed in turns (one step of each per round, so a busy machine slows all three alike):

* ``plain``: AdamW over plain tensors of the local shards' sizes (copies of them, with copies of
  the gradients): what the step costs without DTensor,
* ``dtensor``: AdamW over fully_shard's ``nn.Parameter(DTensor)`` parameters (every op through
  DTensor dispatch),
* ``local_step``: the same, wrapped in ``fully_shard.optim.local_step``.

Prints the median and the ratio to ``plain``. Speed is measured here, never asserted in a test.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from typing import Any

ISSUE20 = dict(dim=64, n_layers=24, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256)


def measure(steps: int = 50, foreach: bool | None = None, args: dict[str, int] | None = None) -> dict[str, Any]:
    """Median seconds per ``optimizer.step()`` for ``plain`` / ``dtensor`` / ``local_step``
    (the process group must be initialised)."""
    import torch
    from torch.distributed.tensor import DTensor

    from fully_shard import fully_shard
    from fully_shard.optim import local_step
    from support.llama import Llama, LlamaArgs, loss_fn, tokens

    largs = LlamaArgs(**(args or ISSUE20))

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        model = Llama(largs)
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
        x = tokens(0, 0, largs, 2, 16)
        loss_fn(model(x), x).backward()
        return model

    dt_model, ls_model = build(), build()
    plain_params = []
    for p in dt_model.parameters():
        local = p._local_tensor if isinstance(p, DTensor) else p
        q = torch.nn.Parameter(local.detach().clone())
        g = p.grad
        q.grad = (g._local_tensor if isinstance(g, DTensor) else g).clone()
        plain_params.append(q)
    opts = {
        "plain": torch.optim.AdamW(plain_params, lr=1e-4, foreach=foreach),
        "dtensor": torch.optim.AdamW(dt_model.parameters(), lr=1e-4, foreach=foreach),
        "local_step": local_step(torch.optim.AdamW(ls_model.parameters(), lr=1e-4, foreach=foreach)),
    }
    times: dict[str, list[float]] = {k: [] for k in opts}
    for i in range(steps + 3):  # 3 warm-up rounds (the first creates the state)
        for name, opt in opts.items():
            t0 = time.perf_counter()
            opt.step()
            dt = time.perf_counter() - t0
            if i >= 3:
                times[name].append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "config": dict(largs.as_dict(), params=len(plain_params), foreach=foreach, steps=steps),
        "median_s": med,
        "ratio_to_plain": {k: v / med["plain"] for k, v in med.items()},
    }


PHASES = ("forward", "backward", "step")
# many blocks and few tokens: the model state (parameters, gradients, AdamW's state) sets a step's peak, as in a large
# model, not the root's group or the activations (with many tokens they set it, at the end of forward)
IN_BACKWARD = dict(dim=128, n_layers=16, n_heads=4, n_kv_heads=2, ffn_dim=256, vocab_size=256, max_seq_len=16)


def in_backward_memory(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """Per rank, the peak of live tensor storage over one training step, the second (the optimizer state exists by
    then), of the optimizer stepped inside backward (``fully_shard.optim.in_backward``: an AdamW per parameter, stepped
    from its post-accumulate-grad hook, which frees the gradient) against the usual step (backward, then
    ``AdamW.step()`` and ``zero_grad(set_to_none=True)``), for fully_shard and for torch's FSDP2, with AdamW's
    ``foreach`` off (the CPU default) and on (the CUDA default). Everything the step holds is counted: parameters,
    gradients, optimizer state, activations, communication buffers (``support.storages.StorageTracker``, built
    inside the tracker; the batches are not). The maximum over ranks."""
    import copy
    import functools
    import gc

    import torch
    import torch.distributed as dist

    from fully_shard.optim import in_backward
    from support.llama import FSDP_IMPLS, Llama, LlamaArgs, loss_fn, shard_model, tokens
    from support.storages import StorageTracker

    from .step import _mesh

    largs = LlamaArgs(**job["args"])
    torch.manual_seed(0)
    base = Llama(largs)
    mesh = _mesh(job, world)
    batches = [tokens(s, rank, largs, job["batch"], job["seq"]) for s in range(2)]
    rows = []
    for foreach in (None, True):
        for impl in FSDP_IMPLS:
            for mode in ("step", "in_backward"):
                gc.collect()
                with StorageTracker() as mem:
                    model = shard_model(copy.deepcopy(base), impl, mesh, reshard=True, mp="fp32")
                    make = functools.partial(torch.optim.AdamW, lr=1e-3, foreach=foreach)
                    opts = [make(model.parameters())] if mode == "step" else list(in_backward(model, make).values())
                    for i, x in enumerate(batches):
                        if i == 1:
                            gc.collect()
                            mem.reset_peak(snapshot=False)
                        mem.phase("forward")
                        loss = loss_fn(model(x), x)
                        mem.phase("backward")
                        loss.backward()
                        mem.phase("step")
                        if mode == "step":
                            opts[0].step()
                            opts[0].zero_grad(set_to_none=True)
                        mem.phase(None)
                    params = list(model.parameters())
                    state = [v for o in opts for s in o.state.values() for v in s.values()
                             if isinstance(v, torch.Tensor)]
                    sizes = [mem.peak, *(mem.phase_peaks[p] for p in PHASES), mem.bytes_of(params), mem.bytes_of(state)]
                del model, opts, params, state, loss
                t = torch.tensor(sizes, dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                peaks = [int(v) for v in t.tolist()]
                rows.append({"foreach": foreach, "impl": impl, "mode": mode, "peak_bytes": peaks[0],
                             "phase_peak_bytes": dict(zip(PHASES, peaks[1:4])), "param_bytes": peaks[4],
                             "optimizer_bytes": peaks[5]})
    for r in rows:
        usual = next(u for u in rows if u["foreach"] == r["foreach"] and u["impl"] == r["impl"] and u["mode"] == "step")
        r["ratio_to_step"] = r["peak_bytes"] / usual["peak_bytes"]
    return {"config": dict(largs.as_dict(), batch=job["batch"], seq=job["seq"], world=world), "rows": rows}


def render_in_backward(result: dict[str, Any]) -> list[str]:
    """The table of :func:`in_backward_memory`'s result (docs/gen_figures.py renders it into docs/performance.md)."""
    cfg = result["config"]
    out = [f"{cfg['n_layers']} blocks of dim {cfg['dim']} (ffn {cfg['ffn_dim']}, vocabulary {cfg['vocab_size']}), "
           f"batch {cfg['batch']}x{cfg['seq']} per rank, {cfg['world']} ranks (gloo), fp32, AdamW; peak of live tensor "
           "storage per rank over the second step (parameters, gradients, optimizer state, activations, buffers):", "",
           "| AdamW `foreach` | library | usual step | in backward | in backward / usual |",
           "| --- | --- | --- | --- | --- |"]

    def mib(r: dict[str, Any]) -> str:  # the peak, and the phase it fell in
        phase = max(PHASES, key=lambda p: r["phase_peak_bytes"][p])
        return f"{r['peak_bytes'] / 2**20:.2f} MiB ({phase})"

    for r in (r for r in result["rows"] if r["mode"] == "in_backward"):
        usual = next(u for u in result["rows"] if u["mode"] == "step"
                     and (u["foreach"], u["impl"]) == (r["foreach"], r["impl"]))
        name = {"fully_shard": "fully_shard", "torch_fsdp2": "torch FSDP2"}[r["impl"]]
        out.append(f"| {r['foreach']} | {name} | {mib(usual)} | {mib(r)} | {r['ratio_to_step']:.2f} |")
    first = result["rows"][0]
    out += ["", f"Per rank: parameters {first['param_bytes'] / 2**20:.2f} MiB, their gradients the same, AdamW's state "
            f"{first['optimizer_bytes'] / 2**20:.2f} MiB."]
    return out


def _main_in_backward(out_dir: str | None) -> None:
    from support.llama import LlamaArgs

    from .spawn import run_job

    job = {"args": LlamaArgs(**IN_BACKWARD).as_dict(), "batch": 1, "seq": 16}
    load_before = os.getloadavg()[0]
    result, error, wall = run_job(in_backward_memory, job, nprocs=2, timeout_s=600)
    if error is not None:
        raise SystemExit(f"benchmarks.optim_step --in-backward failed:\n{error}")
    lines = render_in_backward(result)
    print("\n".join(lines))
    if out_dir is not None:
        import torch

        machine = f"{platform.system().lower()}-{platform.machine()}-{os.cpu_count()}cpu"
        stem = os.path.join(out_dir, f"{datetime.date.today().isoformat()}-{machine}-in-backward")
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        result["environment"] = {"date": datetime.date.today().isoformat(), "machine": machine,
                                 "torch": torch.__version__,
                                 "command": "python3 -m benchmarks.optim_step --in-backward", "wall_s": round(wall, 1),
                                 "commit": commit, "load_before": f"{load_before:.2f}",
                                 "load_after": f"{os.getloadavg()[0]:.2f}"}
        with open(stem + ".json", "w") as f:
            json.dump(result, f, indent=1)
        with open(stem + ".md", "w") as f:
            env = result["environment"]
            f.write(f"# Optimizer in backward: peak memory ({env['date']}, {machine})\n\n`{env['command']}`, torch "
                    f"{env['torch']}, commit {commit}; load average {env['load_before']} before, {env['load_after']} "
                    "after (storage bytes do not depend on the load).\n\n" + "\n".join(lines) + "\n")
        print(f"wrote {stem}.json and .md")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--foreach", action="store_true", help="AdamW(foreach=True) instead of the default")
    parser.add_argument("--in-backward", action="store_true", help="peak memory of the optimizer in backward against "
                        "the usual step, on 2 ranks (fully_shard and torch FSDP2)")
    parser.add_argument("--out", help="with --in-backward: write <date>-<machine>-in-backward.{json,md} here")
    cli = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if cli.in_backward:
        _main_in_backward(cli.out)
        return
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        try:
            result = measure(cli.steps, True if cli.foreach else None)
        finally:
            dist.destroy_process_group()
    cfg = result["config"]
    print(f"optimizer.step(), AdamW (foreach={cfg['foreach']}), {cfg['n_layers']} blocks d{cfg['dim']} "
          f"ffn{cfg['ffn_dim']} vocab{cfg['vocab_size']}, {cfg['params']} parameters, world 1 (gloo), 1 thread, "
          f"median of {cfg['steps']}")
    print("| optimizer over | ms per step | x plain |")
    print("| --- | --- | --- |")
    for name, label in (("plain", "plain tensors (local shard sizes)"), ("dtensor", "fully_shard's DTensor parameters"),
                        ("local_step", "the same, local_step(optimizer)")):
        print(f"| {label} | {result['median_s'][name] * 1e3:.2f} | {result['ratio_to_plain'][name]:.2f} |")


if __name__ == "__main__":
    main()
