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
from tests.oracle import REF_TOL, check_parameters, close, placements_like_torch, train_step

TP_PLAN = {
    "attention.wq": ColwiseParallel(),
    "attention.wk": ColwiseParallel(),
    "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(),
    "feed_forward.w1": ColwiseParallel(),
    "feed_forward.w3": ColwiseParallel(),
    "feed_forward.w2": RowwiseParallel(),
}


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
    models = {"ref": ref, "ours": ours, "torch": theirs}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-2) for k, m in models.items()}
    for step in range(steps):
        losses = train_step(models, opts, batch(step, data_rank), loss_fn)
        # bitwise on any CPU: the same TP plan, flat layout and collectives as torch FSDP2, in one process
        close(losses["ours"], losses["torch"], 0, "loss vs torch FSDP2")
        close(losses["ours"], losses["ref"], 1e-4 if tp else REF_TOL["loss"], "loss vs unsharded")
    # parameters: bitwise torch FSDP2's on any CPU (bitwise gradients, as the losses above, and
    # AdamW over the same shard shapes); AdamW divides by sqrt(v): a near-zero gradient's
    # last-bit difference moves a weight ~1e-5 (REF_TOL); TP's row-wise partial sums add
    # more such differences (seen: 1.8e-4)
    check_parameters(ref, ours, theirs, 1e-3 if tp else REF_TOL["param"])
    return placements_like_torch(ours, theirs)


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
