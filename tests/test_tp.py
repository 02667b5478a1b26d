"""Composition with tensor parallelism, and shard_placement_fn: world size 4 on gloo.

FSDP x TP: a (dp=2, tp=2) mesh, the blocks parallelised with ColwiseParallel /
RowwiseParallel on mesh["tp"], then fully_shard on mesh["dp"]. Oracles: the unsharded model
(each dp rank's batch, gradients averaged) and torch's FSDP2 with the same TP plan.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from fully_shard import fully_shard
from tests.harness import device_type, run_distributed
from tests.models import Transformer, batch, loss_fn

TP_PLAN = {
    "attention.wq": ColwiseParallel(),
    "attention.wk": ColwiseParallel(),
    "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(),
    "feed_forward.w1": ColwiseParallel(),
    "feed_forward.w3": ColwiseParallel(),
    "feed_forward.w2": RowwiseParallel(),
}


def _close(a: torch.Tensor, b: torch.Tensor, tol: float, name: str) -> None:
    torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")


def _train_2d(steps: int, tp: bool) -> list[str]:
    if tp:
        mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("dp", "tp"))
        dp_mesh, data_rank = mesh["dp"], mesh["dp"].get_local_rank()
    else:
        dp_mesh, data_rank = init_device_mesh(device_type(), (4,)), dist.get_rank()
    ref = Transformer()
    ours, theirs = copy.deepcopy(ref), copy.deepcopy(ref)

    def shard_fn(p: torch.nn.Parameter) -> Shard | None:
        return Shard(1) if p.dim() == 2 and p.shape[1] % 4 == 0 else None

    kwargs = {} if tp else {"shard_placement_fn": shard_fn}
    for model, shard in ((ours, fully_shard), (theirs, torch_fully_shard)):
        for block in model.layers:
            if tp:
                parallelize_module(block, mesh["tp"], TP_PLAN)
            shard(block, mesh=dp_mesh, **kwargs)
        shard(model, mesh=dp_mesh, **kwargs)
    models = (ref, ours, theirs)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    for step in range(steps):
        x = batch(step, data_rank)
        losses = []
        for model, opt in zip(models, opts):
            loss = loss_fn(model(x), x)
            loss.backward()
            if model is ref:
                for p in ref.parameters():
                    dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
            opt.step()
            opt.zero_grad()
            losses.append(loss)
        _close(losses[1], losses[2], 0, "loss vs torch FSDP2")
        _close(losses[1], losses[0], 1e-4 if tp else 1e-5, "loss vs unsharded")
    placements = []
    for (name, p_ref), p, tp_ in zip(ref.named_parameters(), ours.parameters(), theirs.parameters()):
        assert p.placements == tp_.placements, (name, p.placements, tp_.placements)
        assert p.to_local().shape == tp_.to_local().shape, name
        _close(p.full_tensor(), tp_.full_tensor(), 0, name)
        # AdamW divides by sqrt(v): a near-zero gradient's last-bit difference moves a weight
        # ~1e-5; TP's row-wise partial sums add more such differences (seen: 1.8e-4)
        _close(p.full_tensor(), p_ref, 1e-3 if tp else 1e-4, name)
        placements.append(f"{name}: {p.placements}")
    sd, tsd = ours.state_dict(), theirs.state_dict()
    assert list(sd) == list(tsd)
    for key in sd:
        assert sd[key].placements == tsd[key].placements, key
    return placements


def test_fsdp_with_tensor_parallel() -> None:
    placements = run_distributed(_train_2d, 4, 3, True)[0]
    assert "layers.0.attention.wq.weight: (_StridedShard(dim=0, sf=2), Shard(dim=0))" in placements, placements
    assert "layers.0.attention.wo.weight: (Shard(dim=0), Shard(dim=1))" in placements, placements
    assert "layers.0.attention_norm.weight: (Shard(dim=0),)" in placements, placements


def test_shard_placement_fn_shard_1() -> None:
    placements = run_distributed(_train_2d, 4, 3, False)[0]
    assert "layers.0.attention.wq.weight: (Shard(dim=1),)" in placements, placements
    assert "layers.0.feed_forward.w2.weight: (Shard(dim=0),)" in placements, placements


def _uneven_shard_1() -> str:
    mesh = init_device_mesh(device_type(), (4,))
    try:
        fully_shard(torch.nn.Linear(6, 3), mesh=mesh, shard_placement_fn=lambda p: Shard(p.dim() - 1))
    except ValueError as e:
        return str(e)
    return "no error"


def test_uneven_shard_dim_is_rejected() -> None:
    message = run_distributed(_uneven_shard_1, 4)[0]
    assert "Shard(1)" in message and "'weight'" in message and "evenly" in message, message
