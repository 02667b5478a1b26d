"""Which collectives one training step issues: the exact sequence, and parity with FSDP2.

Model: ``tests.models.Transformer`` with 3 blocks, each block sharded, then the root, at
world size 2. Per rank (dim 100, ffn 150, vocab 67; dim-0 chunks padded to ceil(rows/2)):

* a block's all-gather input is 2*50 (norms) + 4*50*100 (attention) + 3*75*100 or
  3*50*150 (feed-forward) = 42600 elements; its reduce-scatter input is 2 * 42600;
* the root's (tok_embeddings 34*100, norm 50, output 34*100, logit_scale 1) is 6851
  all-gathered, 2 * 6851 = 13702 reduce-scattered.

The recorded step is the second one, so that implicit forward prefetch (the order of the
previous iteration) is in effect.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import expecttest
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from support.collectives import CollectiveRecord, CollectiveRecorder, format_records, split_phases
from tests.harness import device_type, run_distributed
from tests.models import ModelArgs, Transformer, batch, loss_fn
from tests.torch_features import has_torch_feature

N_LAYERS = 3
N_GROUPS = N_LAYERS + 1  # one per block, one for the root's own parameters
BLOCK_ALL_GATHER_NUMEL = 42600  # see the module docstring

# ---------------------------------------------------------------------------
# Bodies (run on the workers)
# ---------------------------------------------------------------------------


def _shard(model: Transformer, impl: str, reshard_after_forward: bool | None) -> None:
    if impl == "ours":
        from fully_shard import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard  # type: ignore[no-redef]
    mesh = init_device_mesh(device_type(), (dist.get_world_size(),))
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)


def _build(impl: str, reshard_after_forward: bool | None, frozen: tuple[int, ...] = ()) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelArgs(n_layers=N_LAYERS))
    for i in frozen:
        model.layers[i].requires_grad_(False)
    _shard(model, impl, reshard_after_forward)
    return model


def _step_collectives(impl: str, reshard_after_forward: bool | None, frozen: tuple[int, ...]) -> list[CollectiveRecord]:
    """The collectives of the 2nd forward+backward, with a "backward" marker between."""
    model = _build(impl, reshard_after_forward, frozen)
    x = batch(0, dist.get_rank())
    loss_fn(model(x), x).backward()  # warm-up: records the forward order for prefetch
    model.zero_grad()
    x = batch(1, dist.get_rank())
    with CollectiveRecorder() as rec:
        loss = loss_fn(model(x), x)
        rec.mark("backward")
        loss.backward()
    return rec.records


def _both_step_collectives(
    reshard_after_forward: bool | None, frozen: tuple[int, ...]
) -> dict[str, list[CollectiveRecord]]:
    return {impl: _step_collectives(impl, reshard_after_forward, frozen) for impl in ("ours", "torch")}


def _accumulation(impl: str) -> dict[str, Any]:
    """Two microbatches, gradient sync off for the first; the collectives of each and the
    resulting (full) gradients."""
    model = _build(impl, None)
    rank = dist.get_rank()
    x = batch(0, rank)
    loss_fn(model(x), x).backward()
    model.zero_grad()
    out: dict[str, Any] = {}
    for name, step, sync in (("no_sync", 1, False), ("sync", 2, True)):
        model.set_requires_gradient_sync(sync)  # type: ignore[operator]
        x = batch(step, rank)
        with CollectiveRecorder() as rec:
            loss = loss_fn(model(x), x)
            rec.mark("backward")
            loss.backward()
        out[name] = rec.records
        if not sync:
            missing = [n for n, p in model.named_parameters() if p.grad is not None]
            assert not missing, f"{impl}: sharded grads set while sync is off: {missing}"
    out["grads"] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return out


def _accumulation_both() -> dict[str, dict[str, Any]]:
    return {impl: _accumulation(impl) for impl in ("ours", "torch")}


def _recorder_selftest() -> str:
    """Each patched collective is recorded once (deprecated aliases that call the new
    names too), with its input's numel, dtype and op; the originals are back after exit."""
    import warnings

    single = hasattr(dist, "all_gather_single")  # torch 2.13's names for the tensor collectives
    originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather_into_tensor")}
    t = torch.ones(6)
    with CollectiveRecorder() as rec, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        dist.broadcast(t, src=0)
        if single:
            dist.all_gather_single(torch.empty(12), t)
        dist.all_gather_into_tensor(torch.empty(12), t)
        dist.all_gather([torch.empty(6), torch.empty(6)], t)
        if single:
            dist.reduce_scatter_single(torch.empty(3), t.clone())
        dist.reduce_scatter_tensor(torch.empty(3, dtype=torch.float64), t.double(), op=dist.ReduceOp.SUM)
        dist.reduce_scatter(torch.empty(2), [torch.ones(2), torch.ones(2)], op=dist.ReduceOp.MAX)
        rec.mark("subgroup")
        dist.all_reduce(t, group=dist.new_group([0, 1]))
    assert all(getattr(dist, n) is f for n, f in originals.items()), "collectives not restored"
    return rec.table(("kind", "group_size", "numel", "dtype", "op", "api"))


# ---------------------------------------------------------------------------
# Helpers (pytest process)
# ---------------------------------------------------------------------------


def _run_ours(reshard_after_forward: bool | None, frozen: tuple[int, ...] = ()) -> list[CollectiveRecord]:
    results = run_distributed(_step_collectives, 2, "ours", reshard_after_forward, frozen)
    assert results[0] == results[1], "ranks issued different collectives"
    return results[0]


def _phases(records: list[CollectiveRecord]) -> dict[str, list[CollectiveRecord]]:
    return split_phases(records, first="forward")


def _summary(records: list[CollectiveRecord]) -> dict[str, Any]:
    """Per phase: counts per kind and the sorted multiset of element counts per kind."""
    summary: dict[str, Any] = {}
    for phase, recs in _phases(records).items():
        summary[phase] = {
            "counts": dict(sorted(Counter(r.kind for r in recs).items())),
            "numels": {k: sorted(r.numel for r in recs if r.kind == k) for k in sorted({r.kind for r in recs})},
            "dtypes": sorted({r.dtype for r in recs}),
        }
    return summary


# ---------------------------------------------------------------------------
# The exact sequence (ours)
# ---------------------------------------------------------------------------


def test_step_sequence_reshard_after_forward_true() -> None:
    # Every group, the root too, frees its parameters after forward and gathers them again
    # in backward; each block's backward prefetches the block before it.
    expecttest.assert_expected_inline(
        format_records(_run_ours(True)),
        """\
all_gather      2  6851
all_gather      2  42600
all_gather      2  42600
all_gather      2  42600
-- backward --
all_gather      2  6851
all_gather      2  42600
all_gather      2  42600
reduce_scatter  2  85200
all_gather      2  42600
reduce_scatter  2  85200
reduce_scatter  2  85200
reduce_scatter  2  13702
""",
    )


def test_step_sequence_reshard_after_forward_false() -> None:
    # Nothing is freed after forward: backward only reduce-scatters.
    expecttest.assert_expected_inline(
        format_records(_run_ours(False)),
        """\
all_gather      2  6851
all_gather      2  42600
all_gather      2  42600
all_gather      2  42600
-- backward --
reduce_scatter  2  85200
reduce_scatter  2  85200
reduce_scatter  2  85200
reduce_scatter  2  13702
""",
    )


def test_step_sequence_reshard_after_forward_default() -> None:
    # None: blocks reshard, the root keeps its parameters (backward needs them first).
    expecttest.assert_expected_inline(
        format_records(_run_ours(None)),
        """\
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
reduce_scatter  2  85200
reduce_scatter  2  13702
""",
    )


# ---------------------------------------------------------------------------
# Parity with torch's FSDP2, and the formula
# ---------------------------------------------------------------------------

_SETTINGS = [
    pytest.param(True, (), id="raf_true"),
    pytest.param(False, (), id="raf_false"),
    pytest.param(None, (), id="raf_default"),
    pytest.param(None, (1,), id="raf_default_block1_frozen"),
]


@pytest.mark.parametrize("reshard_after_forward, frozen", _SETTINGS)
def test_counts_match_torch_fsdp2(reshard_after_forward: bool | None, frozen: tuple[int, ...]) -> None:
    results = run_distributed(_both_step_collectives, 2, reshard_after_forward, frozen)
    assert results[0] == results[1], "ranks issued different collectives"
    ours, theirs = _summary(results[0]["ours"]), _summary(results[0]["torch"])
    assert ours == theirs


@pytest.mark.parametrize("reshard_after_forward, frozen", _SETTINGS)
def test_collective_counts_formula(reshard_after_forward: bool | None, frozen: tuple[int, ...]) -> None:
    phases = _phases(_run_ours(reshard_after_forward, frozen))
    fwd, bwd = phases["forward"], phases["backward"]
    resharding = {True: N_GROUPS, False: 0, None: N_GROUPS - 1}[reshard_after_forward]
    with_grads = N_GROUPS - len(frozen)
    count = lambda recs, kind: sum(r.kind == kind for r in recs)  # noqa: E731
    assert count(fwd, "all_gather") == N_GROUPS
    assert count(bwd, "all_gather") == resharding
    assert count(fwd, "reduce_scatter") == 0
    assert count(bwd, "reduce_scatter") == with_grads
    assert {r.kind for r in fwd + bwd} <= {"all_gather", "reduce_scatter"}
    # reduce-scatter input = world_size * all-gather input, group by group (frozen blocks
    # gather but do not reduce)
    gathered = Counter(r.numel for r in fwd if r.kind == "all_gather")
    gathered[BLOCK_ALL_GATHER_NUMEL] -= len(frozen)
    assert Counter(r.numel // 2 for r in bwd if r.kind == "reduce_scatter") == +gathered
    assert all(r.group_size == 2 and r.dtype == "float32" for r in fwd + bwd)
    assert all(r.op == "AVG" for r in bwd if r.kind == "reduce_scatter")


def test_gradient_accumulation_no_sync_skips_reduce_scatter() -> None:
    results = run_distributed(_accumulation_both, 2)
    assert results[0]["ours"]["no_sync"] == results[1]["ours"]["no_sync"]
    ours, theirs = results[0]["ours"], results[0]["torch"]
    no_sync, sync = _phases(ours["no_sync"]), _phases(ours["sync"])
    kinds = lambda recs: dict(Counter(r.kind for r in recs))  # noqa: E731
    # the no-sync microbatch gathers as usual and reduces nothing
    assert kinds(no_sync["forward"]) == {"all_gather": N_GROUPS}
    assert kinds(no_sync["backward"]) == {"all_gather": N_GROUPS - 1}
    # the sync microbatch reduces the accumulated gradients once per group
    assert kinds(sync["backward"]) == {"all_gather": N_GROUPS - 1, "reduce_scatter": N_GROUPS}
    assert _summary(ours["no_sync"]) == _summary(theirs["no_sync"])
    assert _summary(ours["sync"]) == _summary(theirs["sync"])
    assert ours["grads"].keys() == theirs["grads"].keys()
    for name, grad in ours["grads"].items():
        torch.testing.assert_close(grad, theirs["grads"][name], rtol=1e-5, atol=1e-6, msg=name)


RECORDED = """\
all_reduce      2  6  float32  AVG  all_reduce
broadcast       2  6  float32       broadcast
all_gather      2  6  float32       all_gather_single
all_gather      2  6  float32       all_gather_into_tensor
all_gather      2  6  float32       all_gather
reduce_scatter  2  6  float32  SUM  reduce_scatter_single
reduce_scatter  2  6  float64  SUM  reduce_scatter_tensor
reduce_scatter  2  4  float32  MAX  reduce_scatter
-- subgroup --
all_reduce      2  6  float32  SUM  all_reduce
"""


def test_recorder_sees_each_collective_once() -> None:
    tables = run_distributed(_recorder_selftest, 2)
    assert tables[0] == tables[1]
    # torch 2.11 has no *_single names (the test then calls them nowhere): the same table without their two rows
    expected = [line for line in RECORDED.splitlines(keepends=True) if has_torch_feature("dist.all_gather_single")
                or "_single" not in line]
    assert tables[0] == "".join(expected), tables[0]

