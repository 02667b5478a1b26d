"""State dicts, distributed checkpoints (DCP), exact resume and gradient clipping: gloo,
world sizes 2 and 4.

Oracles: the unsharded model built from the same seed (its ``state_dict()``; gradients
averaged over the ranks by hand), and torch's FSDP2 (``torch.distributed.fsdp.fully_shard``)
with the same mesh, which also reads and writes the same checkpoints. Checkpoint
directories come from pytest's ``tmp_path``; the ranks share the file system.
"""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

import fully_shard as fully_shard_lib
from fully_shard import fully_shard
from support.collectives import CollectiveRecorder
from tests.harness import device, device_type, run_distributed
from tests.models import ModelArgs, Transformer, batch, loss_fn
from tests.oracle import average_gradients
from tests.test_tp import TP_PLAN

ARGS = ModelArgs(n_layers=2)
LR = 1e-2

# ---------------------------------------------------------------------------
# Helpers (run on the workers)
# ---------------------------------------------------------------------------


def _mesh(kind: str):
    ws = dist.get_world_size()
    if kind == "fsdp":
        return init_device_mesh(device_type(), (ws,))
    assert kind == "hsdp", kind
    return init_device_mesh(device_type(), (2, ws // 2), mesh_dim_names=("replicate", "shard"))


def _reference(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ARGS)


def _build(impl: str = "ours", mesh_kind: str = "fsdp", seed: int = 0) -> Transformer:
    """The reference model of ``seed``, sharded by ours or torch's fully_shard."""
    model = _reference(seed)
    shard = fully_shard if impl == "ours" else torch_fully_shard
    mesh = _mesh(mesh_kind)
    for block in model.layers:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)
    return model


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR)


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> torch.Tensor:
    x = batch(step, dist.get_rank(), ARGS)
    loss = loss_fn(model(x), x)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _full(obj: Any) -> Any:
    """Nested containers with every DTensor replaced by its full tensor (a collective)."""
    if isinstance(obj, DTensor):
        return obj.full_tensor()
    if isinstance(obj, dict):
        return {k: _full(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_full(v) for v in obj)
    return obj


def _clone(obj: Any) -> Any:
    """A copy of nested containers with every tensor cloned (as if read back from disk:
    ``Optimizer.state_dict()`` returns the live state tensors)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return obj


def _full_model(model: nn.Module) -> dict[str, torch.Tensor]:
    return _full(dict(model.state_dict()))


def _full_optim(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state keyed by parameter name, full tensors (works for either impl)."""
    return _full(get_optimizer_state_dict(model, opt))


def _assert_same(actual: Any, expected: Any, where: str = "") -> None:
    """Bitwise equality of nested dicts/lists of tensors and plain values."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: {type(actual).__name__} is not a tensor"
        assert not isinstance(actual, DTensor) and not isinstance(expected, DTensor), where
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, (
            f"{where}: {actual.dtype}{tuple(actual.shape)} vs {expected.dtype}{tuple(expected.shape)}"
        )
        # bitwise on any CPU: saving and loading copy values, they do no arithmetic
        assert torch.equal(actual, expected), f"{where}: max diff {(actual - expected).abs().max().item()}"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and list(actual) == list(expected), (
            f"{where}: keys {list(actual) if isinstance(actual, dict) else actual} vs {list(expected)}"
        )
        for k in expected:
            _assert_same(actual[k], expected[k], f"{where}.{k}" if where else str(k))
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            _assert_same(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} vs {expected!r}"


# ---------------------------------------------------------------------------
# 1. model.state_dict() / load_state_dict / optimizer.state_dict()
# ---------------------------------------------------------------------------


def _state_dict_layout() -> list[str]:
    ours, theirs, ref = _build("ours"), _build("torch"), _reference()
    with CollectiveRecorder() as rec:
        sd = ours.state_dict()
    assert rec.collectives() == [], rec.table()
    tsd, rsd = theirs.state_dict(), ref.state_dict()
    assert list(sd) == list(rsd) == list(tsd), (list(sd), list(tsd))
    lines = []
    for key in rsd:
        value, theirs_value = sd[key], tsd[key]
        assert isinstance(value, DTensor), f"{key}: {type(value).__name__}"
        assert value.placements == theirs_value.placements, (key, value.placements, theirs_value.placements)
        assert value.to_local().shape == theirs_value.to_local().shape, key
        assert value.shape == rsd[key].shape and value.stride() == rsd[key].stride(), key
        lines.append(f"{key}: {value.placements} {tuple(value.to_local().shape)}")
    _assert_same(_full(sd), rsd)
    return lines


@pytest.mark.parametrize("world_size", [2, 4])
def test_state_dict_is_sharded_like_torch_without_communication(world_size: int) -> None:
    lines = run_distributed(_state_dict_layout, world_size)
    rows = -(-ARGS.vocab_size // world_size)  # ceil: torch.chunk
    assert f"tok_embeddings.weight: (Shard(dim=0),) ({rows}, {ARGS.dim})" in lines[0], lines[0]
    # logit_scale has one row: rank 0 holds it, the others an empty shard
    assert "logit_scale: (Shard(dim=0),) (1,)" in lines[0], lines[0]
    assert "logit_scale: (Shard(dim=0),) (0,)" in lines[-1], lines[-1]


def _load_round_trip() -> None:
    rank = dist.get_rank()
    src = _build(seed=0)
    src_opt = _adamw(src)
    for step in range(2):
        _step(src, src_opt, step)

    # sharded DTensors -> a differently initialised sharded model, and the optimizer state
    dst = _build(seed=1)
    dst_opt = _adamw(dst)
    params_before = list(dst.parameters())
    result = dst.load_state_dict(src.state_dict())
    assert result.missing_keys == [] and result.unexpected_keys == [], result
    assert all(a is b for a, b in zip(dst.parameters(), params_before)), "load_state_dict replaced parameters"
    _assert_same(_full_model(dst), _full_model(src))
    dst_opt.load_state_dict(_clone(src_opt.state_dict()))
    for p, state in zip(dst.parameters(), dst_opt.state.values()):
        assert isinstance(state["exp_avg"], DTensor) and state["exp_avg"].placements == p.placements, state
    _assert_same(_full_optim(dst, dst_opt), _full_optim(src, src_opt))
    for step in range(2, 4):  # training goes on identically
        # bitwise on any CPU: equal state, data and ranks run the same kernels in the same order
        assert torch.equal(_step(dst, dst_opt, step), _step(src, src_opt, step)), step
    _assert_same(_full_model(dst), _full_model(src))

    # full (plain) tensors from the unsharded model's state_dict
    ref = _reference(seed=0)
    full = _build(seed=1)
    result = full.load_state_dict(ref.state_dict())
    assert result.missing_keys == [] and result.unexpected_keys == [], result
    assert all(isinstance(p, DTensor) for p in full.parameters()), "load_state_dict unsharded a parameter"
    _assert_same(_full_model(full), ref.state_dict())
    x = batch(0, rank, ARGS)
    with torch.no_grad():
        # bitwise on any CPU: forward only, the same kernels on the same (copied) full weights
        assert torch.equal(full(x), ref(x)), "forward did not gather the loaded shards"


def test_load_state_dict_round_trip_sharded_and_full_tensors() -> None:
    run_distributed(_load_round_trip, 2)


def _strict_keys(impl: str) -> list[Any]:
    model = _build(impl)
    sd = model.state_dict()
    missing = {k: v for k, v in sd.items() if k != "norm.weight"}
    unexpected = {**sd, "layers.0.bogus": sd["norm.weight"]}
    out: list[Any] = []
    for bad in (missing, unexpected):
        try:
            model.load_state_dict(bad, strict=True)
            out.append("no error")
        except RuntimeError as e:
            out.append(str(e))
        result = model.load_state_dict(bad, strict=False)
        out.append((result.missing_keys, result.unexpected_keys))
    return out


def test_load_state_dict_strict_missing_and_unexpected_keys_like_torch() -> None:
    ours = run_distributed(_strict_keys, 2, "ours")
    theirs = run_distributed(_strict_keys, 2, "torch")
    assert ours == theirs, (ours[0], theirs[0])
    assert 'Missing key(s) in state_dict: "norm.weight"' in ours[0][0], ours[0][0]
    assert ours[0][1] == (["norm.weight"], [])
    assert 'Unexpected key(s) in state_dict: "layers.0.bogus"' in ours[0][2], ours[0][2]
    assert ours[0][3] == ([], ["layers.0.bogus"])


def _assign_then_train() -> None:
    src = _build(seed=0)
    src_opt = _adamw(src)
    _step(src, src_opt, 0)
    sd = _clone(src.state_dict())
    ref = _reference(seed=0)  # full tensors of the initial model

    for source in ("sharded", "full"):
        model = _build(seed=1)
        if source == "sharded":
            loaded, expected = dict(sd), _full(sd)
        else:
            loaded, expected = {k: v.clone() for k, v in ref.state_dict().items()}, ref.state_dict()
        model.load_state_dict(loaded, assign=True)
        for name, p in model.named_parameters():
            assert isinstance(p, nn.Parameter) and isinstance(p, DTensor), name
            if source == "sharded":  # the given DTensors became the parameters
                assert p.to_local().data_ptr() == loaded[name].to_local().data_ptr(), name
        _assert_same(_full_model(model), expected)
        # the optimizer is built after the assigning load; training must use the new tensors
        twin = _build(seed=1)
        twin.load_state_dict(loaded)  # the in-place load, as an oracle
        opts = [_adamw(model), _adamw(twin)]
        for step in range(1, 3):
            # bitwise on any CPU: equal state, data and ranks run the same kernels in the same order
            assert torch.equal(_step(model, opts[0], step), _step(twin, opts[1], step)), (source, step)
        _assert_same(_full_model(model), _full_model(twin))


def test_load_state_dict_assign_then_train() -> None:
    run_distributed(_assign_then_train, 2)


def _kinds(when: str, sd: dict[str, Any]) -> list[str]:
    return [f"{when}: {k}: {type(v).__name__}" for k, v in sd.items()]


def _state_dict_mid_iteration(impl: str) -> list[str]:
    """state_dict()/load_state_dict() when groups hold their full parameters: right after
    an evaluation forward (no_grad), and between a training forward and its backward (the
    root keeps its full parameters for backward). Like torch's FSDP2, state_dict() must
    still give the sharded DTensors, loading must land in the shards that the next
    forward gathers, and the iteration must go on unharmed."""
    model = _build(impl)
    opt = _adamw(model)
    _step(model, opt, 0)
    x = batch(1, dist.get_rank(), ARGS)
    with torch.no_grad():
        model(x)
    seen = _kinds("after eval forward", model.state_dict())
    loss = loss_fn(model(x), x)
    seen += _kinds("between forward and backward", model.state_dict())
    loss.backward()
    opt.step()
    opt.zero_grad()
    seen.append(f"loss of the next step: {_step(model, opt, 2).item()!r}")
    other = _build(impl, seed=1).state_dict()
    with torch.no_grad():
        model(x)
    try:
        model.load_state_dict(other)  # sharded DTensors, right after an eval forward
        with torch.no_grad():
            # bitwise on any CPU: forward only, the same kernels on the same (copied) full weights
            same = torch.equal(model(x), _reference(seed=1)(x))
        seen.append(f"forward after load_state_dict uses the loaded weights: {same}")
    except Exception as e:  # noqa: BLE001 - compared with torch FSDP2
        seen.append(f"load_state_dict after eval forward raised {type(e).__name__}: {str(e)[:200]}")
    return seen


def test_state_dict_and_load_mid_iteration_like_torch() -> None:
    theirs = run_distributed(_state_dict_mid_iteration, 2, "torch")[0]
    ours = run_distributed(_state_dict_mid_iteration, 2, "ours")[0]
    assert theirs[-1].endswith("True"), theirs[-1]
    assert all(line.endswith(": DTensor") for line in theirs[:-2]), theirs
    assert ours == theirs, [line for line in ours if line not in theirs]


# ---------------------------------------------------------------------------
# 2. torch.distributed.checkpoint: round trip, resharding, HSDP, interop with torch FSDP2
# ---------------------------------------------------------------------------


def _dcp_save(model: nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def _dcp_load(model: nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _dcp_round_trip(path: str) -> None:
    src = _build(seed=0)
    src_opt = _adamw(src)
    for step in range(2):
        _step(src, src_opt, step)
    _dcp_save(src, src_opt, path)
    dst = _build(seed=1)
    dst_opt = _adamw(dst)
    _dcp_load(dst, dst_opt, path)
    _assert_same(_full_model(dst), _full_model(src))
    _assert_same(_full_optim(dst, dst_opt), _full_optim(src, src_opt))
    for step in range(2, 4):
        # bitwise on any CPU: equal state, data and ranks run the same kernels in the same order
        assert torch.equal(_step(dst, dst_opt, step), _step(src, src_opt, step)), step
    _assert_same(_full_model(dst), _full_model(src))


def test_dcp_round_trip_model_and_optimizer(tmp_path) -> None:
    run_distributed(_dcp_round_trip, 2, str(tmp_path / "ckpt"))


def _save_trained(path: str, impl: str, mesh_kind: str = "fsdp") -> tuple[dict, dict] | None:
    """Train 2 steps, save with DCP; rank 0 returns the full model and optimizer state."""
    model = _build(impl, mesh_kind, seed=0)
    opt = _adamw(model)
    for step in range(2):
        _step(model, opt, step)
    _dcp_save(model, opt, path)
    full = (_full_model(model), _full_optim(model, opt))
    return full if dist.get_rank() == 0 else None


def _save_both(root: str) -> dict[str, tuple[dict, dict] | None]:
    return {impl: _save_trained(os.path.join(root, impl), impl) for impl in ("ours", "torch")}


def _load_into(path: str, impl: str, mesh_kind: str, expected: tuple[dict, dict]) -> None:
    model = _build(impl, mesh_kind, seed=1)
    opt = _adamw(model)
    _dcp_load(model, opt, path)
    for p in model.parameters():
        assert isinstance(p, DTensor) and p.device_mesh.ndim == (2 if mesh_kind == "hsdp" else 1), p.placements
    _assert_same(_full_model(model), expected[0])
    _assert_same(_full_optim(model, opt), expected[1])
    _step(model, opt, 2)  # and it trains


def _load_cases(root: str, cases: list[tuple[str, str, str]], expected: dict[str, tuple[dict, dict]]) -> None:
    for saved_by, impl, mesh_kind in cases:
        _load_into(os.path.join(root, saved_by), impl, mesh_kind, expected[saved_by])


def test_dcp_reshard_4_to_2_and_interop_with_torch_fsdp2(tmp_path) -> None:
    root = str(tmp_path)
    expected = run_distributed(_save_both, 4, root)[0]
    # our checkpoint and torch FSDP2's hold the same values (same training, same reductions)
    _assert_same(expected["ours"], expected["torch"])
    cases = [("ours", "ours", "fsdp"), ("ours", "torch", "fsdp"), ("torch", "ours", "fsdp")]
    run_distributed(_load_cases, 2, root, cases, expected)


def test_dcp_reshard_2_to_4_fsdp_to_hsdp_and_interop(tmp_path) -> None:
    root = str(tmp_path)
    expected = run_distributed(_save_both, 2, root)[0]
    _assert_same(expected["ours"], expected["torch"])
    cases = [("ours", "ours", "fsdp"), ("ours", "ours", "hsdp"), ("torch", "ours", "hsdp"), ("ours", "torch", "hsdp")]
    run_distributed(_load_cases, 4, root, cases, expected)


# ---------------------------------------------------------------------------
# 3. torch.distributed.checkpoint.state_dict with full state dicts
# ---------------------------------------------------------------------------


def _dsd_full_state_dicts() -> None:
    rank = dist.get_rank()
    model = _build(seed=0)
    opt = _adamw(model)
    full_cpu = StateDictOptions(full_state_dict=True, cpu_offload=True)

    # sharded (default options): the same DTensors as model.state_dict()
    sharded = get_model_state_dict(model)
    own = model.state_dict()
    assert list(sharded) == list(own), (list(sharded), list(own))
    for k in own:
        assert isinstance(sharded[k], DTensor) and sharded[k].placements == own[k].placements, k
        # bitwise on any CPU: both hold copies of the same shard
        assert torch.equal(sharded[k].to_local(), own[k].to_local()), k

    # full, offloaded: rank 0 gets the unsharded model's tensors on the CPU, the others {}
    msd = get_model_state_dict(model, options=full_cpu)
    if rank == 0:
        _assert_same(msd, _reference(seed=0).state_dict())
    else:
        assert msd == {}, list(msd)

    _step(model, opt, 0)
    _step(model, opt, 1)
    expected_model, expected_optim = _full_model(model), _full_optim(model, opt)
    msd = get_model_state_dict(model, options=full_cpu)
    osd = get_optimizer_state_dict(model, opt, options=full_cpu)
    if rank == 0:
        _assert_same(msd, expected_model)
        _assert_same(osd, expected_optim)
        assert all(t.device.type == "cpu" and not isinstance(t, DTensor) for t in msd.values()), "not offloaded"
    else:
        assert msd == {} and osd == {}, (list(msd), list(osd))

    # broadcast_from_rank0: rank 0 holds the full state dicts, the others pass {}
    dst = _build(seed=1)
    dst_opt = _adamw(dst)
    bcast = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    # (cloned: these dicts may share tensors with opt's own state, e.g. 'step', and two
    # optimizers sharing a tensor would each update it)
    set_model_state_dict(dst, _clone(msd), options=bcast)
    set_optimizer_state_dict(dst, dst_opt, _clone(osd), options=bcast)
    assert all(isinstance(p, DTensor) for p in dst.parameters()), "set_model_state_dict unsharded a parameter"
    _assert_same(_full_model(dst), expected_model)
    _assert_same(_full_optim(dst, dst_opt), expected_optim)
    for step in range(2, 4):
        # bitwise on any CPU: equal state, data and ranks run the same kernels in the same order
        assert torch.equal(_step(dst, dst_opt, step), _step(model, opt, step)), step

    # sharded get -> set into a fresh model
    fresh = _build(seed=2)
    fresh_opt = _adamw(fresh)
    set_model_state_dict(fresh, get_model_state_dict(model))
    set_optimizer_state_dict(fresh, fresh_opt, _clone(get_optimizer_state_dict(model, opt)))
    _assert_same(_full_model(fresh), _full_model(model))
    _assert_same(_full_optim(fresh, fresh_opt), _full_optim(model, opt))


def test_state_dict_api_full_offload_and_broadcast_from_rank0() -> None:
    run_distributed(_dsd_full_state_dicts, 2)


# ---------------------------------------------------------------------------
# 4. Exact resume: 6 steps in one go == 3 steps, DCP checkpoint, fresh model, 3 more
# ---------------------------------------------------------------------------


class _DropoutNet(nn.Module):
    """Residual MLP blocks with dropout: training depends on each rank's RNG stream."""

    def __init__(self, dim: int = 17, hidden: int = 33) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Dropout(0.25), nn.Linear(hidden, dim)) for _ in range(2)
        )
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.inp(x))
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def _resume_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return (torch.randn(8, 17, generator=g, device="cpu").to(device()),
            torch.randn(8, 3, generator=g, device="cpu").to(device()))


def _resume_model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = _DropoutNet()
    mesh = _mesh("fsdp")
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _train_steps(model: nn.Module, opt: torch.optim.Optimizer, start: int, stop: int) -> None:
    for step in range(start, stop):
        x, y = _resume_batch(step)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _rng() -> Any:
    """The generator dropout draws from: the CPU's, or this rank's accelerator's under the switch."""
    return torch if device().type == "cpu" else torch.get_device_module(device())


def _training_state(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, opt)
    # each rank has its own RNG stream: one key per rank, each rank loads back its own
    return {"model": model_sd, "optim": optim_sd, "step": step, f"rng_rank{dist.get_rank()}": _rng().get_rng_state()}


def _exact_resume(path: str, n: int, k: int) -> None:
    rank = dist.get_rank()
    # uninterrupted
    model, opt = _resume_model(seed=0)
    torch.manual_seed(100 + rank)  # a different dropout stream per rank
    _train_steps(model, opt, 0, n)
    expected = _full_model(model)

    # stopped after k steps and checkpointed
    model, opt = _resume_model(seed=0)
    torch.manual_seed(100 + rank)
    _train_steps(model, opt, 0, k)
    dcp.save(_training_state(model, opt, k), checkpoint_id=path)
    del model, opt

    # a new job: another seed for the initialisation and RNG, everything restored from disk
    model, opt = _resume_model(seed=7)
    state = _training_state(model, opt, step=-1)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _rng().set_rng_state(state[f"rng_rank{rank}"])
    assert state["step"] == k, state["step"]
    _train_steps(model, opt, state["step"], n)
    _assert_same(_full_model(model), expected)

    # control: resuming without the RNG state diverges, so the test above depends on it
    model, opt = _resume_model(seed=7)
    state = _training_state(model, opt, step=-1)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _train_steps(model, opt, k, n)
    resumed = _full_model(model)
    assert any(not torch.equal(resumed[key], expected[key]) for key in expected), "dropout did not use the RNG"


@pytest.mark.parametrize("world_size", [2, 4])
def test_exact_resume_with_dropout_is_bitwise(tmp_path, world_size: int) -> None:
    run_distributed(_exact_resume, world_size, str(tmp_path / "ckpt"), 6, 3)


# ---------------------------------------------------------------------------
# 5. clip_grad_norm_ over DTensor gradients
# ---------------------------------------------------------------------------


def clip_grad_norm_per_mesh_(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """fully_shard's clip_grad_norm_ for gradients on several meshes (FSDP x TP)."""
    return fully_shard_lib.clip_grad_norm_(params, max_norm)


def _clip(kind: str, impl: str, per_mesh: bool = False, max_norm: float = 0.5) -> tuple[str, str] | None:
    """One backward on ours/torch FSDP2 and the unsharded reference (averaged gradients),
    then torch.nn.utils.clip_grad_norm_ (or clip_grad_norm_per_mesh_) on both, compared.
    Returns (exception type, first line) if clip_grad_norm_ raised on the sharded model."""
    tol = 1e-5 if dist.get_world_size() == 2 else 1e-4
    ref = _reference(seed=0)
    model = _reference(seed=0)
    shard = fully_shard if impl == "ours" else torch_fully_shard
    data_rank = dist.get_rank()
    if kind == "tp":
        mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("dp", "tp"))
        dp_mesh, data_rank = mesh["dp"], mesh["dp"].get_local_rank()
        for block in model.layers:
            parallelize_module(block, mesh["tp"], TP_PLAN)
    else:
        dp_mesh = _mesh(kind)
    for block in model.layers:
        shard(block, mesh=dp_mesh)
    shard(model, mesh=dp_mesh)
    x = batch(0, data_rank, ARGS)
    loss_fn(ref(x), x).backward()
    average_gradients(ref)
    loss_fn(model(x), x).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    assert ref_norm > 2 * max_norm, ref_norm  # the test clips for real
    try:
        if per_mesh:
            norm = clip_grad_norm_per_mesh_(list(model.parameters()), max_norm)
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    except Exception as e:  # noqa: BLE001 - compared with torch FSDP2's behaviour
        return type(e).__name__, str(e).splitlines()[0]
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    torch.testing.assert_close(norm, ref_norm, rtol=tol, atol=0)
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), p_ref.grad, rtol=tol, atol=tol * 1e-2,
                                   msg=lambda m: f"{name}: {m}")
    return None


@pytest.mark.parametrize(
    "kind, world_size", [("fsdp", 2), ("fsdp", 4), ("hsdp", 4)], ids=["fsdp-2", "fsdp-4", "hsdp-2x2"]
)
def test_clip_grad_norm_matches_unsharded(kind: str, world_size: int) -> None:
    assert run_distributed(_clip, world_size, kind, "ours") == [None] * world_size


def _clip_equals_torch(kind: str, norm_type: float) -> None:
    """fully_shard.clip_grad_norm_ against torch's over the same DTensor gradients (torch
    FSDP2's): the total norm and every clipped gradient bitwise equal. Equal by construction:
    the same foreach norm over the same local shards, the same reduction of the stacked partial
    norms (p-th power, all-reduce sum, 1/p-th power), the same vector norm of them and the same
    multiply by the same coefficient; only DTensor's dispatch is skipped. The infinity norm
    against torch's over the full gradients as plain tensors (torch's own over DTensors fails
    on a rank whose shard of a parameter is empty): a max is exact in any order."""
    model = _build("torch", kind)
    x = batch(0, dist.get_rank(), ARGS)
    loss_fn(model(x), x).backward()
    twins = []  # the same gradients on parameters of their own, for torch's function
    for p in model.parameters():
        twin = nn.Parameter(p.detach().clone())
        twin.grad = p.grad.full_tensor() if math.isinf(norm_type) else p.grad.clone()
        twins.append(twin)
    ref = torch.nn.utils.clip_grad_norm_(twins, 0.1, norm_type)
    ref = ref.full_tensor() if isinstance(ref, DTensor) else ref
    assert ref > 0.2, ref  # the test clips for real
    norm = fully_shard_lib.clip_grad_norm_(model.parameters(), 0.1, norm_type)
    assert not isinstance(norm, DTensor) and torch.equal(norm, ref), (norm, ref)
    for p, twin in zip(model.parameters(), twins):
        want = twin.grad.to_local() if isinstance(twin.grad, DTensor) else twin.grad
        assert torch.equal(p.grad.full_tensor() if math.isinf(norm_type) else p.grad.to_local(), want), p.shape


@pytest.mark.parametrize(
    "kind, world_size, norm_type",
    [("fsdp", 2, 2.0), ("fsdp", 4, 2.0), ("hsdp", 4, 2.0), ("fsdp", 2, float("inf")), ("fsdp", 2, 1.0)],
    ids=["fsdp-2", "fsdp-4", "hsdp-2x2", "fsdp-2-inf", "fsdp-2-l1"],
)
def test_clip_grad_norm_equals_torchs_on_torch_fsdp2_gradients(kind: str, world_size: int, norm_type: float) -> None:
    run_distributed(_clip_equals_torch, world_size, kind, norm_type)


def test_clip_grad_norm_fsdp_x_tp_behaves_like_torch_fsdp2() -> None:
    """FSDP x TP: the blocks' parameters live on the 2-D (dp, tp) mesh, the root's and the
    norms' on the 1-D dp mesh. torch's clip_grad_norm_ cannot combine DTensors of different
    meshes: it raises, with torch's FSDP2 as with ours, the same error. Clipping per mesh
    and combining the norms matches the unsharded model."""
    theirs = run_distributed(_clip, 4, "tp", "torch")
    ours = run_distributed(_clip, 4, "tp", "ours")
    assert ours == theirs, (ours[0], theirs[0])
    assert ours[0] is not None and "must have the same mesh" in ours[0][1], ours[0]
    assert run_distributed(_clip, 4, "tp", "ours", True) == [None] * 4
