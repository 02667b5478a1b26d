"""The tools: communication trace, wrap policies, debug mode, misuse diagnostics."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from fully_shard import FSDPModule, fully_shard
from fully_shard.tools import CollectiveMismatchError, apply_fully_shard, debug_collectives, trace_comm
from support.collectives import CollectiveRecorder
from tests.harness import device_type, run_distributed
from tests.models import Block, ModelArgs, Transformer, batch, loss_fn


def _mesh():
    return init_device_mesh(device_type(), (dist.get_world_size(),))


def _sharded_model(n_layers: int = 3) -> Transformer:
    model = Transformer(ModelArgs(n_layers=n_layers))
    mesh = _mesh()
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _trace(png_dir: str) -> tuple[str, dict, dict, list]:
    model = _sharded_model()
    x = batch(0, dist.get_rank())
    with CollectiveRecorder() as rec, trace_comm() as trace:
        loss_fn(model(x), x).backward()
    rows = trace.rows()
    path = os.path.join(png_dir, f"comm-rank{dist.get_rank()}.png")
    trace.save_timeline(path)
    # the legend sits beside the axis: it can cover no bar, whatever the bars' extent
    fig = trace.timeline_figure()
    fig.canvas.draw()
    ax = fig.axes[0]
    legend, axis = ax.get_legend().get_window_extent(), ax.get_window_extent()
    assert legend.x0 > axis.x1, (legend, axis)
    import matplotlib.pyplot as plt

    plt.close(fig)
    kinds = {}
    for r in rows:
        kinds[(r["phase"], r["kind"])] = kinds.get((r["phase"], r["kind"]), 0) + 1
    assert os.path.getsize(path) > 1000
    assert all(r["end_ms"] >= r["start_ms"] >= 0 for r in rows)
    return trace.table(), kinds, rec.counts(), [r["group"] for r in rows]


def test_comm_trace_records_every_collective(tmp_path) -> None:
    table, kinds, counts, groups = run_distributed(_trace, 2, str(tmp_path))[0]
    assert kinds == {("forward", "all_gather"): 4, ("backward", "all_gather"): 3, ("backward", "reduce_scatter"): 4}
    assert counts == {"all_gather": 7, "reduce_scatter": 4}  # the same as the collectives seen by torch.distributed
    assert groups[:4] == ["Transformer (root)", "layers.0", "layers.1", "layers.2"], groups
    assert "total     all_gather      7 collectives" in table, table
    assert (tmp_path / "comm-rank0.png").exists() and (tmp_path / "comm-rank1.png").exists()


def _wrap(kind: str) -> tuple[list[str], list[str]]:
    model = Transformer()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if kind == "classes":
            apply_fully_shard(model, module_classes={Block}, mesh=_mesh())
        elif kind == "size":
            apply_fully_shard(model, min_num_params=20_000, mesh=_mesh())
        else:
            apply_fully_shard(model, module_classes={nn.Embedding}, mesh=_mesh())
    sharded = [name or "<root>" for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    x = batch(0, dist.get_rank())
    loss_fn(model(x), x).backward()
    # ranks sharing a GPU under the switch (gloo with CUDA tensors): fully_shard's warning about that is not the
    # helper's
    return sharded, [str(w.message) for w in caught if "tensors over gloo" not in str(w.message)]


def test_wrap_by_module_class() -> None:
    sharded, caught = run_distributed(_wrap, 2, "classes")[0]
    assert sharded == ["<root>", "layers.0", "layers.1", "layers.2"]
    assert not caught


def test_wrap_by_parameter_count() -> None:
    sharded, _ = run_distributed(_wrap, 2, "size")[0]
    # 100x100 attention weights (10k) stay in their block; attention (40k), the feed-forward
    # (45k) and the output (6.7k) ... picked bottom-up once a subtree reaches 20k
    assert "layers.0.attention" in sharded and "layers.0.feed_forward" in sharded, sharded
    assert "layers.0" not in sharded and "layers.0.attention.wq" not in sharded, sharded


def test_wrap_warns_when_the_root_keeps_most_parameters() -> None:
    sharded, caught = run_distributed(_wrap, 2, "root-heavy")[0]
    assert sharded == ["<root>", "tok_embeddings"]
    assert any("root's own group holds" in m and "%" in m for m in caught), caught


def _diverge(debug: bool) -> str:
    model = _sharded_model()
    x = batch(0, dist.get_rank())
    skip = dist.get_rank() == 1  # rank 1 takes a data-dependent shortcut past block 1

    def forward(tokens: torch.Tensor) -> torch.Tensor:
        h = model.tok_embeddings(tokens) + model.pos[: tokens.shape[1]]
        for i, layer in enumerate(model.layers):
            if not (skip and i == 1):
                h = layer(h)
        return model.output(model.norm(h))

    model.forward = forward  # the root's hooks still run around it
    try:
        with debug_collectives():
            model(x)
    except CollectiveMismatchError as e:
        return str(e)
    return "no error"


def test_debug_mode_names_the_first_divergence() -> None:
    messages = run_distributed(_diverge, 2, True, timeout=60)
    for message in messages:
        assert "collective #" in message and "differs across ranks" in message, message
        assert "rank 0: all_gather \"all-gather of layers.1's parameters\"" in message, message
        assert "rank 1: all_gather \"all-gather of layers.2's parameters\"" in message, message


def _debug_mode_consistent() -> tuple[list[tuple[str, int, int]], list[tuple[str, int, int]], int]:
    model = _sharded_model()
    x = batch(0, dist.get_rank())
    loss_fn(model(x), x).backward()  # warm-up: the prefetch order is known from here on
    with CollectiveRecorder() as plain:
        loss_fn(model(x), x).backward()
    exchanges = 0
    original = dist.all_gather_object

    def counting(*args, **kwargs):
        nonlocal exchanges
        exchanges += 1
        return original(*args, **kwargs)

    dist.all_gather_object = counting
    try:
        with debug_collectives(), CollectiveRecorder() as checked:
            loss_fn(model(x), x).backward()
    finally:
        dist.all_gather_object = original
    ours = {"all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor"}
    keep = lambda rec: [r.key() for r in rec.records if r.api in ours]  # noqa: E731
    return keep(plain), keep(checked), exchanges


def test_debug_mode_passes_a_consistent_step() -> None:
    plain, checked, exchanges = run_distributed(_debug_mode_consistent, 2)[0]
    # the checked step issues exactly the collectives of an unchecked one, each preceded by
    # one fingerprint exchange (all_gather_object)
    assert checked == plain and len(plain) > 0, (checked, plain)
    assert exchanges == len(plain), (exchanges, len(plain))


def _optimizer_before_fully_shard() -> str:
    model = Transformer(ModelArgs(n_layers=1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fully_shard(model.layers[0], mesh=_mesh())
    fully_shard(model, mesh=_mesh())
    x = batch(0, dist.get_rank())
    loss_fn(model(x), x).backward()
    try:
        opt.step()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_optimizer_built_before_fully_shard_is_refused() -> None:
    message = run_distributed(_optimizer_before_fully_shard, 1)[0]
    assert "AdamW holds parameter" in message and "Build the optimizer after fully_shard" in message, message


def _modify_unsharded() -> str:
    model = _sharded_model(n_layers=1)
    block = model.layers[0]
    block.unshard()
    with torch.no_grad():
        block.attention.wq.weight.mul_(2)  # the unsharded parameter: lost on reshard
    try:
        block.reshard()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_inplace_change_to_unsharded_parameter_is_caught() -> None:
    message = run_distributed(_modify_unsharded, 1)[0]
    # FQN relative to the block: no root forward ran yet
    assert "attention.wq.weight' was modified in place while it was unsharded" in message, message


def _no_sync() -> str:
    model = _sharded_model(n_layers=1)
    try:
        with model.no_sync():
            pass
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_ddp_no_sync_explains_the_equivalent() -> None:
    message = run_distributed(_no_sync, 1)[0]
    assert "set_requires_gradient_sync(False)" in message, message


@pytest.mark.parametrize("fn", ["table", "rows"])
def test_trace_outside_fully_shard_is_empty(fn: str) -> None:
    with trace_comm() as trace:
        pass
    assert (getattr(trace, fn)()
            in ([], "phase     kind            group                        ranks        bytes  start ms   dur ms"))


def test_set_debug_keeps_one_check_and_debug_collectives_restores_the_mode() -> None:
    from fully_shard import comm
    from fully_shard.tools import is_debug, set_debug

    saved = list(comm.monitor.checks)
    try:
        comm.monitor.checks = []
        set_debug(True)
        set_debug(True)
        assert is_debug() and len(comm.monitor.checks) == 1  # one check, however often it is turned on
        set_debug(False)
        assert not is_debug() and comm.monitor.checks == []
        with debug_collectives():
            assert is_debug()
        assert not is_debug()
        set_debug(True)
        with debug_collectives():
            pass
        assert is_debug()  # on before the context (e.g. FULLY_SHARD_DEBUG=1): stays on after it
    finally:
        comm.monitor.checks = saved
