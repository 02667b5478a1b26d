"""``python3 -m benchmarks.optim_step [--steps N] [--foreach]``: the optimizer step over sharded
parameters, with and without ``fully_shard.optim.local_step``.

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
import os
import statistics
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

    from .models import Llama, LlamaArgs, loss_fn, tokens

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--foreach", action="store_true", help="AdamW(foreach=True) instead of the default")
    cli = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
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
