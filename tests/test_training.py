"""End-to-end parity: fully_shard training equals the unsharded model with averaged grads."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from fully_shard import FSDPModule, fully_shard
from tests.harness import run_distributed
from tests.models import Transformer, batch, loss_fn


def _train_vs_reference(steps: int) -> list[float]:
    ws = dist.get_world_size()
    ref = Transformer()
    model = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (ws,))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert isinstance(model, FSDPModule) and isinstance(model, Transformer)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # world size 2: bitwise. 4: gloo sums 4 ranks in a different order in
    # reduce-scatter than in all-reduce, so allow fp32 rounding.
    tol = 0 if ws == 2 else 1e-5
    losses = []
    for step in range(steps):
        x = batch(step, dist.get_rank())
        ref_loss = loss_fn(ref(x), x)
        ref_loss.backward()
        for p in ref.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        ref_opt.step()
        ref_opt.zero_grad()
        loss = loss_fn(model(x), x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(loss, ref_loss, rtol=tol, atol=tol)
        losses.append(loss.item())
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(p.full_tensor(), p_ref, rtol=tol, atol=tol, msg=lambda m, name=name: f"{name}: {m}")
    return losses


def test_parity_world_size_2() -> None:
    losses = run_distributed(_train_vs_reference, 2, 5)
    assert losses[0] != losses[1]  # ranks saw different data


def test_parity_world_size_4() -> None:
    run_distributed(_train_vs_reference, 4, 3)
