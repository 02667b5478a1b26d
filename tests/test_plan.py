"""The memory planner (fully_shard.plan) against real runs, fully_shard's own groups and
layout, and its command line. Every expected figure is measured (a real or fake-process-group
run of fully_shard) or derived independently (``torch.chunk``, published parameter counts),
never computed with the planner's own formula."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from fully_shard import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from fully_shard.tools.planner import plan
from fully_shard.tools.planner.cli import main as cli_main
from tests.harness import device_type, run_distributed
from tests.models import ModelArgs, Transformer, batch, loss_fn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# params dominate: ~2.2M parameters (8.8 MB fp32) against a (1, 4) batch; the root and 3 blocks
GRID = ModelArgs(vocab_size=67, dim=256, n_layers=3, n_heads=4, ffn_dim=600, max_seq_len=4)

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, None: None}


def _small() -> Transformer:
    return Transformer(ModelArgs())  # uneven: vocab 67, dim 100, ffn 150, logit_scale (1,)


def _policy(param: str | None, reduce: str | None) -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(param_dtype=_DTYPES[param], reduce_dtype=_DTYPES[reduce])


def _shard(model: Transformer, **kwargs: Any) -> None:
    from fully_shard import fully_shard

    mesh = init_device_mesh(device_type(), (dist.get_world_size(),))
    for block in model.layers:
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)


def _chunk_numel(shape: tuple[int, ...] | list[int], world: int, rank: int) -> int:
    """Elements of rank ``rank``'s part under ``torch.chunk`` on dim 0 (the layout fully_shard
    promises), computed by torch on a meta tensor: none when chunk makes fewer pieces."""
    pieces = torch.empty(tuple(shape), device="meta").chunk(world)
    return pieces[rank].numel() if rank < len(pieces) else 0


def _storage_bytes(tensors: list[Any]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local part)."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.to_local().untyped_storage()
        seen[st._cdata] = st.nbytes()
    return sum(seen.values())


# ---------------------------------------------------------------------------
# (1) the planned peak against a measured training step
# ---------------------------------------------------------------------------


class _Cast(nn.Module):
    """A module kept in another dtype than the model around it: it casts its input to it and its output back."""

    def __init__(self, inner: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.inner, self.dtype = inner.to(dtype), dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.to(self.dtype)).to(x.dtype)


def _model(config: str) -> Transformer:
    model = Transformer(GRID)
    if config == "mixed-dtypes":  # every block's group holds fp32 and bf16 parameters: two buckets per collective
        for block in model.layers:
            block.feed_forward = _Cast(block.feed_forward, torch.bfloat16)
    return model


def _prefetch_two(model: Transformer) -> None:
    """Explicit prefetch lists, two blocks ahead (the implicit choice is one)."""
    layers = list(model.layers)
    for i, block in enumerate(layers):
        block.set_modules_to_forward_prefetch([layers[j] for j in (i + 1, i + 2) if j < len(layers)])
        block.set_modules_to_backward_prefetch([layers[j] for j in (i - 1, i - 2) if j >= 0])


class _Config(NamedTuple):
    worlds: tuple[int, ...]  # the world sizes it runs at
    mesh: Callable[[int], tuple[int, ...]] = lambda w: (w,)  # the mesh shape at world size W
    options: dict[str, Any] = {}  # fully_shard's
    settings: Callable[[Any], None] = lambda model: None  # what runs once the model is sharded
    plan: dict[str, Any] = {}  # the planner's own arguments


def _streams(model: nn.Module) -> None:
    """Every group takes a device's path on the CPU: buffers held for other streams (a stream API that does nothing)."""
    from fully_shard import streams
    from tests.test_streams import RecordingBackend

    shared = streams.Streams(torch.device(device_type()), RecordingBackend())
    for m in model.modules():
        if (state := getattr(m, "_fully_shard_state", None)) is not None:
            state.shared_streams = shared


_GRID = {
    **{f"max-inputs-{k}": _Config((2, 4), settings=lambda m, k=k: m.set_reduce_scatter_max_input_buffers(k))
       for k in (1, 2, 3)},
    "bf16-fp32": _Config((2, 4), options={"mp_policy": MixedPrecisionPolicy(torch.bfloat16, torch.float32)}),
    "no-reshard": _Config((2, 4), options={"reshard_after_forward": False}),
    "reshard-int": _Config((2, 4), options={"reshard_after_forward": 2}),  # at 2 ranks: the whole shard dim, as True
    "prefetch-lists": _Config((2, 4), settings=_prefetch_two),
    "keep-after-backward": _Config((2, 4), settings=lambda m: m.set_reshard_after_backward(False)),
    "hsdp": _Config((2, 4), mesh=lambda w: (2, w // 2)),
    "offload": _Config((2, 4), options={"offload_policy": CPUOffloadPolicy()}),
    "mixed-dtypes": _Config((2, 4)),
    "unused-params": _Config((2, 4), settings=lambda m: m.set_reduce_scatter_unused_params(True)),
    "streams": _Config((2, 4), settings=_streams, plan={"device_type": "cuda", "foreach": False}),
}


def _shard_config(config: str, model: nn.Module, mesh: Any) -> None:
    """How the test's training script shards the model for ``config``: the planner's ``shard_fn``."""
    from fully_shard import fully_shard

    for block in model.layers:
        fully_shard(block, mesh=mesh, **_GRID[config].options)
    fully_shard(model, mesh=mesh, **_GRID[config].options)
    _GRID[config].settings(model)


def _measure_grid_body(configs: list[str]) -> dict[str, Any]:
    """Each config's peak without activations, measured (``_measure``)."""
    import gc

    out = {}
    for config in configs:
        out[config] = _measure(config)
        gc.collect()
    return out


def _measure(config: str) -> dict[str, Any]:
    """A training step of ``config`` (the second and the third) under the storage tracker: the report of the lower."""
    from support.storages import StorageTracker as LiveStorages
    from support.storages import live_storages

    leftovers = live_storages()  # what earlier calls in this worker left alive is not this step's memory
    world, rank = dist.get_world_size(), dist.get_rank()
    model = _model(config)
    _shard_config(config, model, init_device_mesh(device_type(), _GRID[config].mesh(world)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = batch(0, rank, GRID, batch_size=1)

    def step(mem: LiveStorages | None = None) -> None:
        if mem is not None:
            mem.phase("forward")
        loss = loss_fn(model(tokens), tokens)
        if mem is not None:
            mem.phase("backward")
        loss.backward()
        if mem is not None:
            mem.phase("optimizer")
        opt.step()
        opt.zero_grad()

    step()  # optimizer state, unsharded buffers and the prefetch order exist from now on
    reports = []
    for _ in range(2):  # gloo's worker thread may drop a finished collective's buffers a moment late: the lower
        with LiveStorages(leftovers) as mem:
            step(mem)
        reports.append(mem.report())
    return min(reports, key=lambda r: r["model_state"])


@pytest.mark.long
@pytest.mark.parametrize("world", [2, 4])
def test_planned_peak_matches_measured_step(world: int) -> None:
    """The planned peak against the peak a real step holds of parameters, gradients, optimizer state and in-flight
    buffers (everything but activations and gloo's private copies), on every rank, for every option that changes
    the schedule or the buffers: within 1%."""
    configs = [c for c, config in _GRID.items() if world in config.worlds]
    results = run_distributed(_measure_grid_body, world, configs, timeout=400)
    errors = []
    for config in configs:
        shape = _GRID[config].mesh(world)
        for rank in range(shape[-1]):  # every shard rank (under HSDP the replicas of rank r hold what r holds)
            measured = results[rank][config]
            planned = plan(functools.partial(_model, config), shape, shard_fn=functools.partial(_shard_config, config),
                           rank=rank, **{"device_type": device_type(), **_GRID[config].plan})
            error = planned.peak_bytes / measured["model_state"] - 1
            print(f"[{config}, {world} ranks] rank {rank}: planned {planned.peak_bytes:,} B at {planned.peak_at}; "
                  f"measured {measured['model_state']:,} B ({error:+.3%}) at "
                  f"{measured['at_model_state_peak']['phase']}; activations then "
                  f"{measured['at_model_state_peak']['activations']:,} B")
            errors.append((abs(error), config, rank))
            assert measured["activations"] < 0.05 * measured["total"], measured  # parameters dominate here
    assert max(errors)[0] <= 0.01, max(errors)


# ---------------------------------------------------------------------------
# (2) sharded bytes per rank: the plan against the real sharded model
# ---------------------------------------------------------------------------


def _sharded_state_body(param: str | None, reduce: str | None) -> dict[str, int]:
    rank = dist.get_rank()
    model = _small()
    _shard(model, mp_policy=_policy(param, reduce))
    params = list(model.parameters())
    out = {"params": _storage_bytes(params)}
    opt = torch.optim.AdamW(params, lr=1e-3)
    loss_fn(model(batch(0, rank)), batch(0, rank)).backward()
    out["grads"] = _storage_bytes([p.grad for p in params])  # views of reduce-scatter outputs
    opt.step()
    out["optimizer"] = _storage_bytes([s[k] for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")])
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_sharded_bytes_equal_fully_shard(world_size: int) -> None:
    results = run_distributed(_sharded_state_body, world_size, None, None)
    for rank, real in enumerate(results):
        p = plan(_small, world_size, rank=rank, device_type=device_type())
        assert (p.sharded_param_bytes, p.grad_bytes, p.optimizer_bytes) == (
            real["params"], real["grads"], real["optimizer"]), (rank, real)
    assert results[0]["params"] > results[-1]["params"]  # uneven rows: the last rank holds less


def test_sharded_bytes_equal_fully_shard_mixed_precision() -> None:
    # bf16 reduce: the fp32 sharded gradients are copies of this rank's rows, not views
    results = run_distributed(_sharded_state_body, 2, "bf16", "bf16")
    for rank, real in enumerate(results):
        p = plan(_small, 2, mp_policy=_policy("bf16", "bf16"), rank=rank, device_type=device_type())
        assert (p.sharded_param_bytes, p.grad_bytes, p.optimizer_bytes) == (
            real["params"], real["grads"], real["optimizer"]), (rank, real)


def test_plan_lays_out_torch_chunks_at_64_ranks() -> None:
    """The planner runs fully_shard itself, at sizes no CPU test could: rank 0 and rank 63 of 64 hold ``torch.chunk``'s
    first and last pieces of every parameter (rank 63 of the small model holds no row of its one-row parameter), in
    the groups of the root and of each block."""
    for rank in (0, 63):
        p = plan("llama3-8b", 64, rank=rank)
        assert p.sharded_param_bytes == 4 * sum(_chunk_numel(s, 64, rank) * c
                                                for s, c in _llama_shapes(4096, 14336, 1024, 32))
    assert [(g.name, g.tensors) for g in p.groups] == [("(root)", 3)] + [(f"model.layers.{i}", 9) for i in range(32)]
    assert plan(_small, 64, rank=63).sharded_param_bytes == 4 * sum(_chunk_numel(p.shape, 64, 63)
                                                                    for p in _small().parameters())


# ---------------------------------------------------------------------------
# (3) the command line
# ---------------------------------------------------------------------------


@pytest.mark.long
def test_cli_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "fully_shard.plan", "--model", "llama3-8b", "--mesh", "64"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "layers.0-31" in proc.stdout and "peak on device" in proc.stdout, proc.stdout

    assert cli_main(["--model", "llama3-8b", "--mesh", "64", "--param-dtype", "bf16",
                     "--reduce-dtype", "fp32", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["mesh_shape"] == [64] and data["num_params"] == 8_030_261_248
    assert data["param_dtype"] == "bfloat16" and data["reduce_dtype"] == "float32"
    assert len(data["groups"]) == 33 and data["peak_bytes"] > data["device_state_bytes"]

    assert cli_main(["--model", "llama3-8b", "--mesh", "8,64", "--json"]) == 0  # HSDP
    data = json.loads(capsys.readouterr().out)
    assert data["replicate_size"] == 8 and data["all_reduces"] == 33


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "llama3-8b", "--mesh", "64", "--bogus"], "unrecognized arguments"),
        (["--model", "llama3-8b", "--mesh", "8,x"], "--mesh"),
        (["--model", "llama3-8b", "--mesh", "64", "--optimizer", "lion"], "invalid choice"),
        (["--model", "llama3-8b", "--mesh", "64", "--param-dtype", "fp12"], "unknown dtype"),
        (["--model", "llama3-9b", "--mesh", "64"], "unknown model"),
        (["--model", "llama3-8b", "--mesh", "64", "--reshard-after-forward", "5"], "divisor"),
        (["--model", "llama3-8b", "--mesh", "64", "--wrap", "Bogus"], "--wrap"),
        (["--model", "llama3-8b", "--mesh", "64", "--batch-size", "1"], "go together"),
        (["--model", "llama3-8b", "--mesh", "64", "--ac"], "--ac needs"),
        (["--model", "llama3-8b", "--mesh", "64", "--batch-size", "0", "--seq-len", "8"], "positive"),
        (["--model", "tests.test_plan:_small", "--mesh", "2", "--batch-size", "1", "--seq-len", "8"],
         "Llama-family"),
    ],
)
def test_cli_bad_arguments_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_import_fully_shard_loads_no_planner() -> None:
    """The tools are loaded when used: ``import fully_shard`` loads no planner module (nor any other tool), and
    ``fully_shard.plan`` is then the planner function itself. Importing ``fully_shard.plan`` as a module (it only runs
    the command line) is refused, since it would hide the function."""
    code = ("import sys, fully_shard; print(sorted(m for m in sys.modules if m.startswith('fully_shard.tools'))); plan "
            "= fully_shard.plan; print(type(plan).__name__, plan.__module__, 'fully_shard.tools.planner' in "
            "sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ROOT, "FULLY_SHARD_DEBUG": "0"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["[]", "function fully_shard.tools.planner.api True"], proc.stdout
    proc = subprocess.run([sys.executable, "-c", "import fully_shard.plan"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 1 and "fully_shard.plan is the memory planner function" in proc.stderr, proc.stderr


def test_cli_bad_flag_exits_2_as_a_process() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "fully_shard.plan", "--model", "llama3-8b", "--mesh", "64", "--bogus"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2 and "unrecognized arguments: --bogus" in proc.stderr


# ---------------------------------------------------------------------------
# (4) large models, arguments, configs, the memory trace
# ---------------------------------------------------------------------------


def test_plan_405b_at_1024_ranks() -> None:
    p = plan("llama3-405b", 1024,
             mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    assert p.num_params == 405_853_388_800 and len(p.groups) == 127  # the published count; 126 blocks + root
    # rank 0 of 1024 holds torch.chunk's first piece of every parameter (fp32)
    assert p.sharded_param_bytes == 4 * sum(
        _chunk_numel(s, 1024, 0) * c for s, c in _llama_shapes(16384, 53248, 1024, 126)
    )


def _llama_shapes(dim: int, ffn: int, kv: int, layers: int) -> list[tuple[tuple[int, ...], int]]:
    vocab = 128256
    block = [((dim,), 2), ((dim, dim), 2), ((kv, dim), 2), ((ffn, dim), 2), ((dim, ffn), 1)]
    return [((vocab, dim), 2), ((dim,), 1)] + [(s, c * layers) for s, c in block]


def test_plan_accepts_models_and_checks_arguments() -> None:
    with torch.device("meta"):
        model = _small()
    by_model, by_ctor = plan(model, 4), plan(_small, (4,))
    assert by_model.to_dict() | {"model": ""} == by_ctor.to_dict() | {"model": ""}
    hsdp = plan(_small, (2, 4))
    assert hsdp.sharded_param_bytes == by_ctor.sharded_param_bytes and hsdp.all_reduces == 4
    with pytest.raises(ValueError, match="meta"):
        plan(_small(), 2)
    with pytest.raises(ValueError, match="mesh_shape"):
        plan(_small, (2, 2, 2))
    with pytest.raises(ValueError, match="optimizer"):
        plan(_small, 2, optimizer="lion")
    # wrap: classes or a callable; the root always gets the rest
    from tests.models import Block, FeedForward

    assert [g.name for g in plan(_small, 2, wrap={FeedForward}).groups] == [
        "(root)", "layers.0.feed_forward", "layers.1.feed_forward", "layers.2.feed_forward"]
    assert len(plan(_small, 2, wrap=lambda m: isinstance(m, Block)).groups) == 4
    # the caller's model is planned on a copy: left unsharded, and wrap may name its modules
    assert ([g.name for g in plan(model, 2, wrap=lambda m: m is model.tok_embeddings).groups]
            == ["(root)", "tok_embeddings"])
    assert type(model) is Transformer and all(type(p) is nn.Parameter and p.is_meta for p in model.parameters())
    with pytest.raises(ValueError, match="shard_fn shards the model itself"):
        plan(_small, 2, shard_fn=lambda m, mesh: None, wrap={FeedForward})
    with pytest.raises(ValueError, match="must call fully_shard on the model"):
        plan(_small, 2, shard_fn=lambda m, mesh: None)

    def compiled_whole(model: nn.Module, mesh: Any) -> None:  # the whole-step compile (docs/compile.md)
        fully_shard(model, mesh=mesh)
        model.compile(fullgraph=True)

    with pytest.raises(ValueError, match=r"shard_fn compiles the whole model \(model.compile\(\) after fully_shard\)"):
        plan(_small, 2, shard_fn=compiled_whole)
    # reshard_after_forward=k: one set of k-rank groups for all 4 calls (3 blocks and the root), as fully_shard makes
    assert "one set of 2-rank process groups (4 in all, this rank in 1), shared by the 4 calls" in " ".join(
        plan(_small, (2, 4), reshard_after_forward=2).notes)
    offload = plan(_small, 2, offload_policy=__import__("fully_shard").CPUOffloadPolicy())
    # derived from the model and torch.chunk, not from the planner: rank 0 of 2 holds the first
    # piece of each fp32 parameter, and AdamW keeps a gradient plus two states like it
    shard_bytes = sum(4 * p.detach().chunk(2)[0].numel() for p in _small().parameters())
    assert offload.sharded_param_bytes == shard_bytes
    assert offload.host_bytes == 4 * shard_bytes  # params + grads + 2 AdamW states, all on the host
    assert offload.device_state_bytes == offload.buffer_bytes  # only buffers stay on the device


def test_plan_refuses_an_initialised_process_group() -> None:
    """The planner's fake process group is the process's default one: not while a real one exists."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="plan before init_process_group"):
            plan(_small, 2)
    finally:
        dist.destroy_process_group()


def test_cli_takes_a_hugging_face_config_json(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    # Llama 3.1 8B's published shapes, as its config.json spells them
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
           "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
           "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
           "torch_dtype": "bfloat16"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    argv = ["--mesh", "64", "--param-dtype", "bf16", "--json"]
    assert cli_main(["--model", str(path), *argv]) == 0
    from_config = json.loads(capsys.readouterr().out)
    assert cli_main(["--model", "llama3-8b", *argv]) == 0
    from_preset = json.loads(capsys.readouterr().out)
    for key in ("model", "label", "name"):  # the label names the source, nothing else may differ
        from_config.pop(key, None)
        from_preset.pop(key, None)
    assert from_config == from_preset
    assert from_config["storage_dtypes"] == ["float32"]  # fp32 master weights, whatever the config says

    # tied embeddings (Llama 3.2 style): one parameter, in the root's group once
    cfg["tie_word_embeddings"] = True
    path.write_text(json.dumps(cfg))
    assert cli_main(["--model", str(path), *argv]) == 0
    tied = json.loads(capsys.readouterr().out)
    assert tied["num_params"] == from_preset["num_params"] - 128256 * 4096
    assert tied["groups"][0]["tensors"] == from_preset["groups"][0]["tensors"] - 1

    path.write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["--model", str(path), "--mesh", "8"])
    assert exit_info.value.code == 2
    assert "names no model_type" in capsys.readouterr().err


def test_memory_over_the_step_peaks_at_the_plans_peak(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    p = plan("llama3-8b", 64, mp_policy=mp)
    totals = [sum(row[1:]) for row in p.memory_trace]
    # the trace is the step's own bookkeeping: its largest total is the reported peak
    assert max(totals) == p.peak_bytes
    assert p.memory_trace[totals.index(max(totals))][0] == p.peak_at
    assert all(b >= 0 for row in p.memory_trace for b in row[1:])

    from fully_shard.tools import memory_figure

    fig = memory_figure(p)
    fig.canvas.draw()
    ax = fig.axes[0]
    assert ax.get_legend().get_window_extent().x0 > ax.get_window_extent().x1  # beside the axis, over no area
    png = tmp_path / "mem.png"
    assert cli_main(["--model", "llama3-8b", "--mesh", "64", "--plot", str(png)]) == 0
    assert f"memory over the step: {png}" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------
# (5) activations: the planned figures against what autograd really keeps
# ---------------------------------------------------------------------------

# a Llama-family model small enough to run: GQA (4 query, 2 key-value heads), uneven MLP width
_TINY_LLAMA = {"model_type": "llama", "vocab_size": 128, "hidden_size": 128, "intermediate_size": 344,
               "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
               "max_position_embeddings": 256}


def _tiny_llama() -> torch.nn.Module:
    from fully_shard.tools import hf_model

    return hf_model(_TINY_LLAMA)


def _measure_activations(dtype: torch.dtype, checkpointing: bool, batch_size: int, seq_len: int) -> dict[str, Any]:
    """One forward and backward of the tiny Llama on the CPU (no fully_shard), measuring
    (1) the bytes each decoder block saves for backward, with ``saved_tensors_hooks``
    (distinct storages, parameters excluded, each storage counted for the first block that
    saves it), (2) the bytes of the storages the forward allocated that are still alive
    when it ends (what is kept for backward, whoever keeps it: autograd, or checkpoint's
    inputs), and (3) the peak of live storages allocated in forward or backward, the
    parameters' gradients excepted (activations, rebuilt ones and activation gradients)."""
    import weakref

    from torch.autograd.graph import saved_tensors_hooks
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = _tiny_llama().to(dtype)
    model.train()
    if checkpointing:  # non-reentrant torch.utils.checkpoint around every decoder block
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    tokens = torch.randint(0, _TINY_LLAMA["vocab_size"], (batch_size, seq_len))

    class Live(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.refs: dict[int, tuple[int, Any]] = {}
            self.size: dict[int, int] = {}
            self.events: list[tuple[int, int]] = []

        def register(self, st: torch.UntypedStorage) -> None:
            if st._cdata in self.refs:
                return
            uid, key = len(self.size), st._cdata
            self.size[uid] = st.nbytes()
            self.refs[key] = (uid, weakref.ref(st, lambda _r, key=key, uid=uid: self.freed(key, uid)))
            self.events.append((uid, self.size[uid]))

        def freed(self, key: int, uid: int) -> None:
            if self.refs.get(key, (None,))[0] == uid:
                del self.refs[key]
            n, self.size[uid] = self.size[uid], 0
            if n:
                self.events.append((uid, -n))

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.register(t.untyped_storage())
            return out

    weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    where = ["outside"]
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda _m, _a, i=i: where.__setitem__(0, f"block {i}"))
        layer.register_forward_hook(lambda _m, _a, _o: where.__setitem__(0, "outside"))
    saved: dict[int, tuple[str, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in weights and st.data_ptr() not in saved:
            saved[st.data_ptr()] = (where[0], st.nbytes())
        return t

    live = Live()
    for t in [*model.parameters(), *model.buffers()]:
        live.register(t.untyped_storage())
    existing = set(live.size)
    with live:
        with saved_tensors_hooks(pack, lambda t: t):
            loss = model(input_ids=tokens, labels=tokens).loss  # the logits are dropped, as in training
        end_of_forward = len(live.events)
        loss.backward()
    grads = {live.refs[p.grad.untyped_storage()._cdata][0] for p in model.parameters()}
    now = peak = kept = 0
    for i, (uid, delta) in enumerate(live.events):
        if i == end_of_forward:
            kept = now
        if uid in existing or uid in grads:
            continue
        now += delta
        peak = max(peak, now)
    per_block: dict[str, int] = {}
    for who, nbytes in saved.values():
        per_block[who] = per_block.get(who, 0) + nbytes
    return {"kept": kept, "peak": peak, "blocks": [per_block.get(f"block {i}", 0) for i in range(4)]}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-ac", "ac"])
def test_planned_activations_match_measured(dtype: str, checkpointing: bool) -> None:
    """Planned activations against a real forward and backward of a 4-block Llama (batch 2
    x 64 tokens, CPU, no fully_shard: activations do not depend on sharding).

    Tolerances, and why: what is *saved for backward* per block and what is *kept* at the
    end of forward are what the planner counts, so they must agree within 1% (the
    remainder: the loss scalar, int64 position ids). The *peak* in backward also holds
    what the planner does not count: the gradients flowing through the block being
    differentiated (of its output and of the MLP's wide intermediates) and op temporaries.
    Those belong to one block at a time, so the measured peak may exceed the plan by at
    most half of one block's saved bytes, never by a multiple of the block count."""
    pytest.importorskip("transformers")
    batch_size, seq_len = 2, 64
    torch_dtype = _DTYPES[dtype]
    assert torch_dtype is not None
    measured = _measure_activations(torch_dtype, checkpointing, batch_size, seq_len)
    planned = plan(_tiny_llama, 2, mp_policy=MixedPrecisionPolicy(param_dtype=torch_dtype), batch_size=batch_size,
                   seq_len=seq_len, activation_checkpointing=checkpointing, device_type="cpu")
    block = planned.block_activation_bytes
    print(f"[{dtype}, {'AC' if checkpointing else 'no AC'}] per block planned {block} B, measured "
          f"{measured['blocks']}; kept at end of forward planned {planned.activation_bytes} B, measured "
          f"{measured['kept']} B; peak planned {planned.peak_activation_bytes} B, measured {measured['peak']} B "
          f"({measured['peak'] / planned.peak_activation_bytes - 1:+.1%})")
    # what each block saves: everything, or under AC what the checkpoint saves, the block's input
    # (block 0 also saves the rotary cos/sin, shared by all: the planner counts them once, with the rest)
    from fully_shard.tools.planner.activations import estimate_activations
    from fully_shard.tools.planner.models import load_model

    est = estimate_activations(load_model(_tiny_llama)[0], batch_size, seq_len, torch_dtype)
    assert est.block_bytes == block
    for nbytes in measured["blocks"][1:]:
        want = est.block_input_bytes if checkpointing else block
        assert abs(nbytes / want - 1) <= 0.01, (nbytes, want)
    assert abs(measured["kept"] / planned.activation_bytes - 1) <= 0.01, (measured, planned.activation_bytes)
    excess = measured["peak"] - planned.peak_activation_bytes
    assert -0.01 * planned.peak_activation_bytes <= excess <= 0.5 * block, (measured, planned.peak_activation_bytes)
    # with AC the blocks keep only their inputs: the kept bytes shrink by far more than one block
    if checkpointing:
        assert planned.activation_bytes < 0.5 * 4 * block
    # and the activations are in the step's trace and peak
    assert max(row[5] for row in planned.memory_trace) == planned.peak_activation_bytes
    assert planned.peak_bytes >= planned.peak_activation_bytes + planned.device_state_bytes - planned.grad_bytes


def _printed_lines(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[str]:
    assert cli_main(argv) == 0
    return capsys.readouterr().out.splitlines()


@pytest.mark.long
def test_cli_table_fits_100_columns(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """Every printed line, table, header and footer, is at most 100 characters: for each
    preset, HSDP with offload (more lines, a note), activations with AC, and a config.json
    behind a path long enough to be elided."""
    from fully_shard.tools import PRESETS

    runs = [["--model", "llama3-8b", "--mesh", "64", "--param-dtype", "bf16", "--reduce-dtype", "fp32"],
            ["--model", "llama3-70b", "--mesh", "8,64", "--offload", "--device", "cpu"],
            ["--model", "llama3-405b", "--mesh", "1024", "--batch-size", "4", "--seq-len", "131072", "--ac",
             "--reshard-after-forward", "8", "--rank", "1023"]]
    assert {run[1] for run in runs} == set(PRESETS)
    deep = tmp_path / ("a-directory-name-long-enough-to-matter" * 2) / "Meta-Llama-3.1-8B-Instruct"
    deep.mkdir(parents=True)
    cfg = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
           "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 128256}
    (deep / "config.json").write_text(json.dumps(cfg))
    runs.append(["--model", str(deep / "config.json"), "--mesh", "64", "--batch-size", "2", "--seq-len", "4096"])
    for argv in runs:
        lines = _printed_lines(argv, capsys)
        assert max(len(line) for line in lines) <= 100, (argv, max(lines, key=len))
        assert any(line.startswith("total ") for line in lines) and any("peak on device" in line for line in lines)
    assert lines[0].startswith("fully_shard memory plan: ...") and lines[0].endswith("Instruct/config.json")


def test_plan_activation_arguments() -> None:
    pytest.importorskip("transformers")
    with pytest.raises(ValueError, match="go together"):
        plan("llama3-8b", 64, batch_size=1)
    with pytest.raises(ValueError, match="activation_checkpointing needs"):
        plan("llama3-8b", 64, activation_checkpointing=True)
    with pytest.raises(ValueError, match="Llama-family"):
        plan(_small, 2, batch_size=1, seq_len=8)
    without = plan("llama3-8b", 64)
    assert without.activation_bytes == without.peak_activation_bytes == 0
    assert all(row[5] == 0 for row in without.memory_trace)
    # activations are per rank and per sequence: they scale with batch x tokens, not with the mesh
    one, two = plan("llama3-8b", 64, batch_size=1, seq_len=4096), plan("llama3-8b", 8, batch_size=2, seq_len=4096)
    assert two.block_activation_bytes == 2 * one.block_activation_bytes
    assert abs(two.activation_bytes / (2 * one.activation_bytes) - 1) < 1e-4  # but the shared rotary tables
    # the step's peak counts them: the plan without activations plus at least the kept ones at the end of forward
    assert one.peak_bytes > without.peak_bytes


def test_presets_without_transformers_name_the_plan_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    with pytest.raises(ValueError, match=r'pip install "fully-shard\[plan\]"'):
        plan("llama3-8b", 64)
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        assert 'plan = ["transformers>=4.56,<6"]' in f.read()
