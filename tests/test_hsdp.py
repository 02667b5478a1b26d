"""HSDP on 2-D meshes, reshard_after_forward=k, pure replication: world size 4 on gloo.

Oracles: the unsharded model trained with gradients averaged over all 4 ranks, and torch's
FSDP2 with the same mesh and settings on the same inputs.

The collective tables are element counts (fp32: 4 bytes each) of ``Transformer`` with 3
blocks, derived in :func:`_derived_sizes` from the parameter shapes: a group split over
``S`` ranks holds ``ceil(rows / S)`` rows of each parameter on every rank (``torch.chunk``,
the last ranks padded up to it). At ``S = 2`` a block is 2*50 (norms) + 4*50*100
(attention) + 2*75*100 + 50*150 (feed-forward) = 42600 elements and the root
(tok_embeddings, norm, output, logit_scale) 34*100 + 50 + 34*100 + 1 = 6851.
"""

from __future__ import annotations

import copy
import math
from unittest import mock

import expecttest
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from fully_shard import fully_shard
from fully_shard import mesh as mesh_module
from support.collectives import CollectiveRecorder
from tests.harness import device_type, run_distributed
from tests.models import ModelArgs, Transformer, batch, loss_fn
from tests.oracle import REF_TOL, check_parameters, close, placements_like_torch, train_step

# name -> (mesh shape, reshard_after_forward)
CONFIGS = {
    "hsdp-2x2": ((2, 2), None),
    "reshard-k2": ((4,), 2),
    "replicate-4x1": ((4, 1), None),
    "hsdp-2x2-k": ((2, 2), True),
}


def _mesh(shape: tuple[int, ...]):
    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    return init_device_mesh(device_type(), shape, mesh_dim_names=names)


def _shard(model, shard_fn, mesh, reshard) -> None:
    for block in model.layers:
        shard_fn(block, mesh=mesh, reshard_after_forward=reshard)
    shard_fn(model, mesh=mesh)


def _train(config: str, steps: int) -> list[str]:
    shape, reshard = CONFIGS[config]
    mesh = _mesh(shape)
    ref = Transformer()
    ours, theirs = copy.deepcopy(ref), copy.deepcopy(ref)
    _shard(ours, fully_shard, mesh, reshard)
    _shard(theirs, torch_fully_shard, mesh, reshard)
    models = {"ref": ref, "ours": ours, "torch": theirs}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-2) for k, m in models.items()}
    for step in range(steps):
        losses = train_step(models, opts, batch(step, dist.get_rank()), loss_fn)
        # vs torch's FSDP2, bitwise on any CPU: the same flat layout (params in post-order), the same
        # reduce-scatter and all-reduce over the same buffers in one process: gloo's order by construction
        close(losses["ours"], losses["torch"], 0.0, f"step {step} loss vs torch FSDP2")
        # vs all-reduce over 4 ranks: gloo sums in another order, fp32 rounding
        close(losses["ours"], losses["ref"], REF_TOL["loss"], f"step {step} loss vs reference")
    # parameters: bitwise torch FSDP2's on any CPU (bitwise gradients, as the losses above, and
    # AdamW over the same shard shapes); AdamW divides by sqrt(v): a near-zero gradient's
    # last-bit difference moves a weight ~1e-5 from the reference (REF_TOL["param"])
    check_parameters(ref, ours, theirs, REF_TOL["param"])
    return placements_like_torch(ours, theirs)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_training_matches_reference_and_torch(config: str) -> None:
    placements = run_distributed(_train, 4, config, 3)[0]
    expected = "(Replicate(), Shard(dim=0))" if len(CONFIGS[config][0]) == 2 else "(Shard(dim=0),)"
    assert all(line.endswith(expected) for line in placements), placements


def _step_collectives(config: str, use_torch: bool) -> str:
    shape, reshard = CONFIGS[config]
    model = Transformer(ModelArgs(n_layers=3))
    _shard(model, torch_fully_shard if use_torch else fully_shard, _mesh(shape), reshard)
    x = batch(0, dist.get_rank())
    loss_fn(model(x), x).backward()  # warm-up: the forward order is known from here on
    with CollectiveRecorder() as rec:
        loss = loss_fn(model(x), x)
        rec.mark("backward")
        loss.backward()
    return rec.table(("kind", "group_size", "numel"))


def _shard_numel(params: list[torch.nn.Parameter], shards: int) -> int:
    """Elements of one rank's padded shard of ``params`` split over ``shards`` ranks in dim 0."""
    return sum(math.ceil(p.shape[0] / shards) * (p.numel() // p.shape[0]) for p in params)


def _derived_sizes(shards: int) -> tuple[int, int]:
    """(root, block): one rank's all-gather input of the root's own parameters and of a block."""
    with torch.device("meta"):
        model = Transformer(ModelArgs(n_layers=3))
    root = [p for name, p in model.named_parameters() if not name.startswith("layers.")]
    return _shard_numel(root, shards), _shard_numel(list(model.layers[0].parameters()), shards)


def _sizes(table: str) -> dict[str, set[int]]:
    """The distinct element counts per "kind group_size" in a table."""
    sizes: dict[str, set[int]] = {}
    for line in table.splitlines():
        if not line.startswith("--"):
            kind, group, numel = line.split()
            sizes.setdefault(f"{kind} {group}", set()).add(int(numel))
    return sizes


def _counts(table: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for line in table.splitlines():
        if not line.startswith("--"):
            key = " ".join(line.split()[:2])
            counts[key] = counts.get(key, 0) + 1
    return counts


class TestCollectives(expecttest.TestCase):
    def test_hsdp_step(self) -> None:
        table = run_distributed(_step_collectives, 4, "hsdp-2x2", False)[0]
        self.assertExpectedInline(table, """\
all_gather      2  6851
all_gather      2  42600
all_gather      2  42600
all_gather      2  42600
-- backward --
all_gather      2  42600
all_gather      2  42600
reduce_scatter  2  85200
all_gather      2  42600
reduce_scatter  2  85200
all_reduce      2  42600
reduce_scatter  2  85200
all_reduce      2  42600
reduce_scatter  2  13702
all_reduce      2  42600
all_reduce      2  6851
""")
        # shards of 2 ranks: all-gathered in the shard group, reduce-scattered there from the
        # whole (2 shards), then all-reduced over the 2 replicas
        root, block = _derived_sizes(2)
        self.assertEqual(_sizes(table), {
            "all_gather 2": {root, block},
            "reduce_scatter 2": {2 * root, 2 * block},
            "all_reduce 2": {root, block},
        })
        torch_table = run_distributed(_step_collectives, 4, "hsdp-2x2", True)[0]
        self.assertEqual(_counts(table), _counts(torch_table))

    def test_reshard_to_2_ranks_step(self) -> None:
        table = run_distributed(_step_collectives, 4, "reshard-k2", False)[0]
        self.assertExpectedInline(table, """\
all_gather      4  3426
all_gather      4  21400
all_gather      4  21400
all_gather      4  21400
-- backward --
all_gather      2  42800
all_gather      2  42800
reduce_scatter  4  85600
all_gather      2  42800
reduce_scatter  4  85600
reduce_scatter  4  85600
reduce_scatter  4  13704
""")
        # shards of 4 ranks; after forward each rank keeps its pair's 2 shards, gathered again
        # in backward within the pair; reduce-scattered from the whole (4 shards)
        root, block = _derived_sizes(4)
        self.assertEqual(_sizes(table), {
            "all_gather 4": {root, block},
            "all_gather 2": {2 * block},
            "reduce_scatter 4": {4 * root, 4 * block},
        })
        torch_table = run_distributed(_step_collectives, 4, "reshard-k2", True)[0]
        self.assertEqual(_counts(table), _counts(torch_table))

    def test_replicate_only_step(self) -> None:
        table = run_distributed(_step_collectives, 4, "replicate-4x1", False)[0]
        self.assertExpectedInline(table, """\
-- backward --
all_reduce  4  85200
all_reduce  4  85200
all_reduce  4  85200
all_reduce  4  13501
""")
        # one shard: the whole parameters, all-reduced over the 4 replicas
        root, block = _derived_sizes(1)
        self.assertEqual(_sizes(table), {"all_reduce 4": {root, block}})


# -- reshard_after_forward=k: one set of k-rank process groups per mesh and k, not one per call ----------------------


def _groups_and_steps(n_layers: int, reshard: bool | int, use_torch: bool) -> dict[str, object]:
    """The process groups this rank joins (``pg_map`` growth) and our ``new_group`` calls while a model of
    ``n_layers`` blocks is sharded with ``reshard`` on 4 ranks (4 blocks: one mesh object; 32: ``mesh=None``, a new,
    equal mesh per call), then 2 AdamW steps: losses and parameters."""
    mesh_module._k_rank_groups.clear()  # as in a new world: earlier tests in this worker may have made these groups
    args = ModelArgs(n_layers=n_layers, dim=16, n_heads=2, ffn_dim=24)
    model, mesh = Transformer(args), _mesh((4,)) if n_layers < 32 else None
    shard_fn = torch_fully_shard if use_torch else fully_shard
    before = len(dist.distributed_c10d._world.pg_map)
    with mock.patch.object(dist, "new_group", wraps=dist.new_group) as new_group:
        _shard(model, shard_fn, mesh, reshard)
    joined = len(dist.distributed_c10d._world.pg_map) - before
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(2):
        x = batch(step, dist.get_rank(), args)
        losses.append(train_step({"m": model}, {"m": opt}, x, loss_fn)["m"])
    return {"joined": joined, "new_group": new_group.call_count, "losses": losses,
            "params": [p.full_tensor() for p in model.parameters()]}


@pytest.mark.parametrize("n_layers", [4, 32])
def test_reshard_to_2_ranks_makes_one_set_of_groups(n_layers: int) -> None:
    """Every call with the same mesh ranks and k shares one set of groups, the k-rank groups and their complements
    (torch: a set per call, an NCCL communicator each); training is bitwise ``reshard_after_forward=True``'s: the
    backward all-gather within 2 ranks rebuilds the same parameters, the reduce-scatter is the same."""
    ours = run_distributed(_groups_and_steps, 4, n_layers, 2, False)
    plain = run_distributed(_groups_and_steps, 4, n_layers, True, False)
    for rank, (a, b) in enumerate(zip(ours, plain)):
        # the set on 4 ranks: [0, 1] and [2, 3], and their complements [0, 2] and [1, 3] (the traced path's first
        # gather), made by every rank (new_group is collective), this rank in one of each
        assert (a["joined"], a["new_group"], b["joined"]) == (2, 4, 0), (rank, a["joined"], a["new_group"], b["joined"])
        assert all(torch.equal(x, y) for x, y in zip(a["losses"], b["losses"])), (rank, a["losses"], b["losses"])
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"])), rank
    if n_layers == 4:  # what torch's FSDP2 does instead: a 2-D post-forward mesh per call, 2 groups each
        # (4 blocks: 8 groups, 24 gloo threads; 8 blocks would pass the harness's THREAD_LIMIT)
        theirs = run_distributed(_groups_and_steps, 4, n_layers, 2, True)
        assert [t["joined"] for t in theirs] == [2 * n_layers] * 4
        assert all(torch.equal(x, y) for a, t in zip(ours, theirs) for x, y in zip(a["losses"], t["losses"]))


def _all_reduce_off(use_torch: bool) -> list[torch.Tensor]:
    mesh = _mesh((2, 2))
    model = Transformer()
    _shard(model, torch_fully_shard if use_torch else fully_shard, mesh, None)
    for micro in range(3):
        model.set_requires_all_reduce(micro == 2)
        x = batch(micro, dist.get_rank())
        loss_fn(model(x), x).backward()
    return [p.grad.full_tensor() for p in model.parameters()]


def test_requires_all_reduce_off_accumulates_across_replicas() -> None:
    ours = run_distributed(_all_reduce_off, 4, False)
    theirs = run_distributed(_all_reduce_off, 4, True)
    for a, b in zip(ours[0], theirs[0]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _bad_k(k: int) -> str:
    mesh = _mesh((4,))
    try:
        fully_shard(Transformer().layers[0], mesh=mesh, reshard_after_forward=k)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("k", [3, 8])
def test_bad_reshard_after_forward_int(k: int) -> None:
    message = run_distributed(_bad_k, 4, k)[0]
    assert f"reshard_after_forward={k} must be a divisor of the shard group size 4" in message


def _tp_named_mesh() -> str:
    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("dp", "tp"))
    try:
        fully_shard(Transformer(), mesh=mesh)
    except ValueError as e:
        return str(e)
    return "no error"


def test_2d_mesh_with_tp_dim_name_is_rejected() -> None:
    message = run_distributed(_tp_named_mesh, 4)[0]
    assert "'tp' is not a data-parallel dim" in message and "mesh['dp']" in message


def _three_d_mesh() -> str:
    mesh = init_device_mesh(device_type(), (1, 2, 2))
    try:
        fully_shard(Transformer(), mesh=mesh)
    except ValueError as e:
        return str(e)
    return "no error"


def test_3d_mesh_is_rejected() -> None:
    assert "got a 3-D mesh" in run_distributed(_three_d_mesh, 4)[0]
