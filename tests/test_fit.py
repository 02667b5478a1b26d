"""``fit()`` (fully_shard.plan.fit): the chosen recipe against every setting of its search space planned one by one,
its peak against a measured step of the applied recipe, ``Recipe.apply`` against the same calls written by hand, the
extrapolation from two depths against a plan of the whole depth, and its errors."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

from fully_shard.tools.planner import Setting, fit, plan
from fully_shard.tools.planner.cli import main as cli_main
from tests.harness import device_type, run_distributed, shutdown_pools
from tests.models import ModelArgs, Transformer, batch, loss_fn

FIT = sys.modules["fully_shard.tools.planner.fit"]  # the module (the package's `fit` is the function)

# the planner's measured grid model: parameters dominate (~2.2M fp32) against a (1, 4) batch; the root and 3 blocks
GRID = ModelArgs(vocab_size=67, dim=256, n_layers=3, n_heads=4, ffn_dim=600, max_seq_len=4)
build = functools.partial(Transformer, GRID)


def _space(world: int) -> list[Setting]:
    """The search space of fit() on a CPU mesh for this model, written out: resharding (k ranks only across nodes,
    so not here), no activations counted (no checkpointing), no streams (no offload)."""
    return [Setting(raf, "none", False, dtype, groups, buffers, prefetch) for raf, dtype, groups, buffers, prefetch
            in itertools.product((True, False), (None, torch.bfloat16), (False, True), (1, 2), (1, 2))]


def _measure_body(settings: list[Setting]) -> list[int]:
    """Each setting applied to the model, a training step, then the peak of the next step (parameters, gradients,
    optimizer state, buffers in flight: the storage tracker's ``model_state``), less the two storages from before the
    step that are no model state: the batch (the plan counts no inputs) and the mesh's table of ranks."""
    from support.storages import StorageTracker, live_storages

    out = []
    mesh = init_device_mesh(device_type(), (dist.get_world_size(),))  # one: a mesh's table of ranks outlives it
    # what earlier calls in this worker left alive is not this step's memory (the mesh's table is subtracted below)
    table = mesh.mesh.untyped_storage()._cdata
    leftovers = [st for st in live_storages() if st._cdata != table]
    for setting in settings:
        model = build()
        setting.shard(model, mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tokens = batch(0, dist.get_rank(), GRID, batch_size=1)
        outside = StorageTracker.bytes_of([tokens, mesh.mesh])
        peaks = []
        for i in range(3):  # the first builds the optimizer state; the lower of two later ones (gloo frees late)
            with StorageTracker(leftovers) as mem:  # the phases tell activations (not model state) from the rest
                mem.phase("forward")
                loss = loss_fn(model(tokens), tokens)
                mem.phase("backward")
                loss.backward()
                mem.phase("optimizer")
                opt.step()
                opt.zero_grad()
            del loss
            if i:
                peaks.append(mem.report()["model_state"] - outside)
        out.append(min(peaks))
    return out


@pytest.mark.long
@pytest.mark.parametrize("world", [2, 4])
def test_fit_is_the_best_that_fits_and_the_step_stays_within(world: int) -> None:
    """For budgets from the smallest to the largest peak of the space: fit() chooses the fastest setting (by the cost
    model) of all those whose planned peak fits, the least memory among ties, and the applied recipe's measured
    step holds its planned peak to the byte on rank 0 (the plan's), at most that on the others."""
    search = FIT._Search(build(), "grid", (world,), device_type="cpu", optimizer="adamw", batch_size=None,
                         seq_len=None, activations=False, profile=FIT.PROFILES["h100"])
    space = _space(world)
    assert set(space) == set(FIT.search_space(world, blocks=3, activations=False, streams=False, mixed_precision=True,
                                              ranks_per_node=8))
    with torch.device("meta"):
        model = build()
    peaks = {s: plan(model, world, shard_fn=s.shard, device_type="cpu").peak_bytes for s in space}
    times = {s: search.time(s)[0] for s in space}
    low, high = min(peaks.values()), max(peaks.values())
    budgets = sorted({low, *(low + (high - low) * i // 4 for i in range(1, 4)), high})
    chosen = []
    for budget in budgets:
        recipe = fit(build, world, budget, device_type="cpu", mixed_precision=True)
        fits = [s for s in space if peaks[s] <= budget]
        fastest = min(times[s] for s in fits)
        best = min((s for s in fits if times[s] <= fastest * (1 + 1e-9)), key=lambda s: peaks[s])
        assert recipe.setting == best, (budget, recipe.setting, best)
        assert recipe.peak_bytes == peaks[best] <= budget
        chosen.append(recipe.setting)
    # In fresh workers: after a torch.compile earlier in the same process (the compile tests' workers), an eager step
    # allocates 150-700 B more than in a process that never compiled; the plan is of a step, not of what ran before.
    shutdown_pools()
    measured = run_distributed(_measure_body, world, chosen, timeout=400)
    for i, (budget, setting) in enumerate(zip(budgets, chosen)):
        for rank in range(world):
            print(f"[{world} ranks] budget {budget:,}: {setting.describe()}: planned {peaks[setting]:,} B, "
                  f"measured {measured[rank][i]:,} B on rank {rank}")
            assert measured[rank][i] <= peaks[setting] <= budget, (budget, setting, rank, measured[rank][i])
        assert measured[0][i] == peaks[setting], (setting, measured[0][i])  # rank 0's, as planned: to the byte
    assert len(set(chosen)) > 1  # the grid of budgets makes it choose differently


def _hand_written(model: Transformer, mesh: Any) -> None:
    """The setting of the bitwise test, as a training script writes it."""
    from fully_shard import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    blocks = list(model.layers)
    for i, block in enumerate(blocks):
        if i % 2 == 0:  # every other block checkpointed
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)  # type: ignore[method-assign]
    fully_shard(model.tok_embeddings, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
    fully_shard([model.norm, model.output], mesh=mesh, reshard_after_forward=False, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.set_reduce_scatter_max_input_buffers(2)  # type: ignore[operator]
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1:i + 3])  # type: ignore[operator]
        block.set_modules_to_backward_prefetch(blocks[max(0, i - 2):i][::-1])  # type: ignore[operator]


def _bitwise_body(recipe: Any) -> bool:
    results = []
    for how in ("recipe", "hand"):
        torch.manual_seed(0)
        model = build()
        mesh = init_device_mesh(device_type(), (dist.get_world_size(),))
        recipe.apply(model, mesh) if how == "recipe" else _hand_written(model, mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(2):
            tokens = batch(step, dist.get_rank(), GRID, batch_size=2)
            loss_fn(model(tokens), tokens).backward()
            opt.step()
            opt.zero_grad()
        results.append([p.to_local().clone() for p in model.parameters()])
    # the same modules, calls and kernels in the same order: bitwise equal
    return all(torch.equal(a, b) for a, b in zip(*results))


def test_applied_recipe_trains_bitwise_as_written_by_hand() -> None:
    setting = Setting(False, "selective", False, torch.bfloat16, True, 2, 2)
    recipe = dataclasses.replace(fit(build, 2, "1GiB", device_type="cpu"), setting=setting)
    assert recipe.to_toml().splitlines()[:4] == ["[parallelism]", 'reshard_after_forward = "false"',
                                                 'mixed_precision = "bf16"', "activation_checkpointing = false"]
    assert run_distributed(_bitwise_body, 2, recipe) == [True, True]


def _tiny_llama(layers: int) -> nn.Module:
    from fully_shard.tools.planner import hf_model

    return hf_model({"model_type": "llama", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": layers,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300})


@pytest.mark.long
@pytest.mark.parametrize("layers", [9, 10])
def test_extrapolated_peak_equals_the_plan_of_every_block(layers: int) -> None:
    """A model deeper than the two depths planned: its peak extrapolated row by row equals that of plan() on the
    whole model, for settings whose peaks fall at different places (activations counted)."""
    with torch.device("meta"):
        model = _tiny_llama(layers)
    search = FIT._Search(model, "tiny", (16,), device_type="cuda", optimizer="adamw", batch_size=2, seq_len=64,
                         activations=True, profile=FIT.PROFILES["h100"])
    assert not search.exact
    names = [f"model.layers.{i}" for i in range(layers)]
    for s in (Setting(), Setting(False, "selective"), Setting(8, "full", param_dtype=torch.bfloat16),
              Setting(True, "none", True, None, True, 2, 2)):
        whole = plan(model, 16, shard_fn=s.shard, batch_size=2, seq_len=64, device_type="cuda",
                     activation_checkpointing=[names[i] for i in s.checkpointed(layers)])
        e = search.estimate(s)
        assert (e.peak_bytes, e.peak_at) == (whole.peak_bytes, whole.peak_at), s


def test_nothing_fits_names_the_smallest_peak() -> None:
    with pytest.raises(ValueError, match=r"nothing fits 1\.00 MiB per rank .* the smallest peak reachable is "
                                         r"[0-9.]+ MiB \(at .*\), of which"):
        fit(build, 2, "1MiB", device_type="cpu")
    with pytest.raises(ValueError, match="a memory budget is a number and a unit"):
        fit(build, 2, "lots", device_type="cpu")


def test_cli_fit(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 160,
                                  "num_hidden_layers": 10, "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "vocab_size": 300}))
    assert cli_main(["--model", str(config), "--mesh", "16", "--fit", "3MiB", "--batch-size", "2", "--seq-len", "64",
                     "--mixed-precision"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"fit {config} on mesh (16,) within 3.00 MiB (h100):", lines
    assert lines[4] == "  using less memory, not chosen:", lines
    assert lines[5].endswith("% slower"), lines  # each one slower by the cost model: why it was not chosen
    assert "[parallelism]" in lines
