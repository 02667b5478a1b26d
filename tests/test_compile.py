"""torch.compile composition: compiled blocks under fully_shard, as torchtitan runs them.

Every case trains ``tests.models.Transformer`` (dim 32, 2 blocks, vocab 67) for ``STEPS``
AdamW steps on 2 gloo ranks, each block compiled with ``fullgraph=True`` and the root left
eager, and compares losses and parameters (``full_tensor()``) with

* the same model under fully_shard, not compiled: bitwise for the ``eager`` and
  ``aot_eager`` backends; ``INDUCTOR_LOSS_TOL`` / ``INDUCTOR_PARAM_TOL`` for ``inductor``
  (its fused CPU kernels round differently; measured on torch 2.13, with or without
  activation checkpointing: losses 4.8e-7 apart, parameters 8.0e-6);
* torch's FSDP2 (``torch.distributed.fsdp.fully_shard``) compiled the same way with the
  same backend: bitwise for every backend, inductor included (same graphs, same kernels).

Placements: the block is compiled before or after ``fully_shard``, in place
(``block.compile()``, torchtitan) or by replacing it (``model.layers[i] =
torch.compile(block)``; parameter names then gain ``_orig_mod.``, stripped to compare);
``GROUPED`` shards both blocks in one call. ``fullgraph=True`` everywhere: a fully_shard
hook that dynamo traced would raise (before the hook entry points were wrapped in
``torch.compiler.disable`` it did; torch FSDP2's hooks live in a file dynamo skips).

``test_no_recompile_after_first_step``: after one warm-up step, ``error_on_recompile``
through ``set_reshard_after_forward`` changes and gradient accumulation with
``set_requires_gradient_sync(False)``.

Runtime: dynamo is reset before every case (a shared cache could hand a case another
case's graph, or hit the recompile limit and silently run eagerly), so every case traces
again; aot_eager (no cache) is the slowest to trace. Inductor's on-disk caches make each
inductor case after the first cost a second or two; with a cold cache the first one
compiles a block's forward and backward kernels (g++, about a minute on two busy cores),
once without and once with activation checkpointing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from tests.harness import device_type, run_distributed
from tests.models import ModelArgs, Transformer, batch, loss_fn

ARGS = ModelArgs(vocab_size=67, dim=32, n_layers=2, ffn_dim=64)
STEPS = 3
# (when, how[, grouping]): compile before/after fully_shard; in place (block.compile()),
# or replace the block (model.layers[i] = torch.compile(block)); "grouped": both blocks in
# one fully_shard call (one group, hooks that run on the first block in and the last out)
Placement = tuple[str, ...]
PLACEMENTS: list[Placement] = [("before", "inplace"), ("before", "replace"), ("after", "inplace"), ("after", "replace")]
TORCHTITAN: Placement = ("before", "inplace")
GROUPED: Placement = ("after", "inplace", "grouped")
# inductor against eager (measured: losses 4.8e-7, parameters 8.0e-6 apart after 3 steps)
INDUCTOR_LOSS_TOL = dict(rtol=1e-5, atol=1e-5)
INDUCTOR_PARAM_TOL = dict(rtol=1e-5, atol=5e-5)
# bitwise on any CPU: eager/aot_eager run the same ATen kernels as eager; vs torch FSDP2: the same graphs
BITWISE = dict(rtol=0, atol=0)
_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.")


def _shard_fn(impl: str) -> Callable[..., Any]:
    if impl == "ours":
        from fully_shard import fully_shard

        return fully_shard
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    return torch_fully_shard


def _build(impl: str, placement: Placement | None, backend: Any, ac: bool = False) -> nn.Module:
    """The model, sharded block by block then at the root, blocks compiled per ``placement``
    (None: eager). ``ac``: each block in a checkpoint_wrapper first (torchtitan: AC, then
    compile, then fully_shard)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    model = Transformer(ARGS)
    if ac:
        for i, block in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(block)
    shard = _shard_fn(impl)
    mesh = init_device_mesh(device_type(), (dist.get_world_size(),))

    def compile_blocks() -> None:
        assert placement is not None
        for i, block in enumerate(model.layers):
            if placement[1] == "inplace":
                block.compile(backend=backend, fullgraph=True)
            else:
                model.layers[i] = torch.compile(block, backend=backend, fullgraph=True)

    assert placement is None or placement[0] in ("before", "after"), placement
    if placement is not None and placement[0] == "before":
        compile_blocks()
    if placement is not None and placement[2:] == ("grouped",):
        shard(list(model.layers), mesh=mesh)
    else:
        for block in model.layers:
            shard(block, mesh=mesh)
    if placement is not None and placement[0] == "after":
        compile_blocks()
    shard(model, mesh=mesh)
    return model


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    x = batch(step, dist.get_rank(), ARGS)
    loss = loss_fn(model(x), x)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _name(fqn: str) -> str:
    for prefix in _PREFIXES:
        fqn = fqn.replace(prefix, "")
    return fqn


def _train(impl: str, placement: Placement | None, backend: Any, ac: bool) -> dict[str, Any]:
    """Train one case from a fresh dynamo; return losses, full parameters and counters."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    start = time.perf_counter()
    model = _build(impl, placement, backend, ac)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = [_step(model, opt, step) for step in range(STEPS)]
    params = {_name(n): p.full_tensor().detach() for n, p in model.named_parameters()}
    return {
        "losses": losses,
        "params": params,
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "seconds": time.perf_counter() - start,
    }


Case = tuple[str, str, Placement]  # (impl, backend, placement)


def _matrix_body(cases: list[Case], ac: bool) -> dict[Any, dict[str, Any]]:
    """Eager runs of both implementations, then every case."""
    import torch._dynamo
    import torch._inductor.config

    assert len(set(cases)) == len(cases), "a case listed twice"
    results: dict[Any, dict[str, Any]] = {}
    for impl in ("ours", "torch"):
        results[(impl, "eager-reference")] = _train(impl, None, "", ac)
    # kernels compile in this process: a compile worker pool per rank costs more than it
    # saves on a few CPU cores
    try:
        with torch._inductor.config.patch(compile_threads=1):
            for impl, backend, placement in cases:
                results[(impl, backend, placement)] = _train(impl, placement, backend, ac)
    finally:
        torch._dynamo.reset()  # leave no compiled code behind in the reused workers
    return results


def _check_matrix(results: dict[Any, dict[str, Any]], cases: list[Case]) -> None:
    """Every case of ours against the eager run; against torch FSDP2's same case if run."""
    ref = results[("ours", "eager-reference")]
    # bitwise on any CPU: eager ours vs eager torch FSDP2, the same layout and AVG of two gradients
    assert ref["losses"] == results[("torch", "eager-reference")]["losses"]
    assert ref["losses"][0] != ref["losses"][1] and ref["graphs"] == 0
    for impl, backend, placement in cases:
        if impl != "ours":
            continue
        loss_tol, param_tol = (INDUCTOR_LOSS_TOL, INDUCTOR_PARAM_TOL) if backend == "inductor" else (BITWISE, BITWISE)
        ours = results[(impl, backend, placement)]
        theirs = results.get(("torch", backend, placement))
        what = f"{backend}, {placement}"
        # both blocks share one graph; fullgraph=True would have raised on a graph break
        assert ours["graphs"] == 1 and ours["graph_breaks"] == 0, (f"{what}: {ours['graphs']} graphs, "
                                                                   f"{ours['graph_breaks']} breaks")
        assert list(ours["params"]) == list(ref["params"]), what
        torch.testing.assert_close(
            torch.tensor(ours["losses"]), torch.tensor(ref["losses"]), **loss_tol,
            msg=lambda m: f"{what}, losses vs eager: {m}"
        )
        for name, p in ours["params"].items():
            torch.testing.assert_close(p, ref["params"][name], **param_tol,
                                       msg=lambda m: f"{what}, {name} vs eager: {m}")
        if theirs is None:
            continue
        assert theirs["graphs"] == 1, f"{what}: torch FSDP2 compiled {theirs['graphs']} graphs"
        # bitwise on any CPU: the same graphs (so the same kernels) and collectives as torch FSDP2
        assert ours["losses"] == theirs["losses"], (f"{what}: losses {ours['losses']} != torch FSDP2's "
                                                    f"{theirs['losses']}")
        for name, p in ours["params"].items():
            torch.testing.assert_close(p, theirs["params"][name], **BITWISE,
                                       msg=lambda m: f"{what}, {name} vs torch: {m}")


# every placement for ours under eager and aot_eager (the slowest to trace here: no
# cache), grouped blocks under eager; torch FSDP2 in torchtitan's placement per backend
_EAGER_CASES: list[Case] = [
    *(("ours", "eager", placement) for placement in (*PLACEMENTS, GROUPED)),
    ("torch", "eager", TORCHTITAN),
    *(("ours", "aot_eager", placement) for placement in PLACEMENTS),
    ("torch", "aot_eager", TORCHTITAN),
    *((impl, "inductor", TORCHTITAN) for impl in ("ours", "torch")),
]
# inductor (cheap after the first case: its caches) in every placement for both; AC under
# aot_eager in torchtitan's placement (bitwise against eager AC)
_AC_CASES: list[Case] = [
    ("ours", "aot_eager", TORCHTITAN),
    *((impl, "inductor", placement) for placement in PLACEMENTS for impl in ("ours", "torch")),
]


def test_compiled_blocks_match_eager_and_torch() -> None:
    for r in run_distributed(_matrix_body, 2, _EAGER_CASES, False, timeout=600):
        _check_matrix(r, _EAGER_CASES)


def test_compiled_checkpointed_blocks_inductor() -> None:
    """torchtitan's default: checkpoint_wrapper around each block, compile, fully_shard."""
    for r in run_distributed(_matrix_body, 2, _AC_CASES, True, timeout=900):
        _check_matrix(r, _AC_CASES)


def _compile_counts(backend: Any) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    return {
        "graphs_compiled": backend.frame_count,  # calls into the backend: first compiles and recompiles
        "unique_graphs": counters["stats"]["unique_graphs"],
        "all": {k: dict(v) for k, v in counters.items()},
    }


def _recompile_body(impl: str) -> dict[str, Any]:
    """Warm up one step, then forbid recompiles through the controls that change what the
    hooks do between steps."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    try:
        return _recompile_steps(impl, CompileCounterWithBackend("aot_eager"))
    finally:
        torch._dynamo.reset()


def _recompile_steps(impl: str, backend: Any) -> dict[str, Any]:
    model = _build(impl, TORCHTITAN, backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = [_step(model, opt, 0)]  # compiles the block's forward, then (lazily) its backward
    warm = _compile_counts(backend)
    with torch._dynamo.config.patch(error_on_recompile=True):
        losses.append(_step(model, opt, 1))
        model.set_reshard_after_forward(False)  # type: ignore[operator]
        losses.append(_step(model, opt, 2))
        model.set_reshard_after_forward(True)  # type: ignore[operator]
        losses.append(_step(model, opt, 3))
        # gradient accumulation: gradient sync off for the first of two microbatches
        model.set_requires_gradient_sync(False)  # type: ignore[operator]
        x = batch(4, dist.get_rank(), ARGS)
        loss_fn(model(x), x).backward()
        model.set_requires_gradient_sync(True)  # type: ignore[operator]
        losses.append(_step(model, opt, 5))
    after = _compile_counts(backend)
    with torch.no_grad():  # inference: dynamo guards on grad mode, so this compiles once more
        x = batch(6, dist.get_rank(), ARGS)
        model(x)
        model(x)
    inference = _compile_counts(backend)
    params = {_name(n): p.full_tensor().detach() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "warm": warm, "after": after, "inference": inference}


def test_no_recompile_after_first_step() -> None:
    ours, theirs = (run_distributed(_recompile_body, 2, impl)[0] for impl in ("ours", "torch"))
    # one graph, shared by both blocks, compiled in the first step; nothing after it
    for counts in (ours, theirs):
        assert counts["warm"]["graphs_compiled"] == counts["warm"]["unique_graphs"] == 1, counts["warm"]
        assert counts["after"] == counts["warm"], f"recompiled: {counts['warm']} -> {counts['after']}"
    # a no_grad forward compiles an inference graph, once, with either implementation
    assert ours["inference"]["graphs_compiled"] == theirs["inference"]["graphs_compiled"] == 2
    # bitwise on any CPU: the same compiled graphs and collectives as torch FSDP2 on the same layout
    assert ours["losses"] == theirs["losses"]
    for name, p in ours["params"].items():
        # bitwise on any CPU: the same compiled graphs and collectives as torch FSDP2 on the same layout
        torch.testing.assert_close(p, theirs["params"][name], rtol=0, atol=0, msg=lambda m: f"{name} vs torch: {m}")
