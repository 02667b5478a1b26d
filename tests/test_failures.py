"""Failure behaviour: recovering from an exception on every rank, a clear error in bounded
time when only one rank fails, and checkpoints that survive a failed save. gloo, 2 ranks.

Oracles: the unsharded model trained without the failed steps, and torch's FSDP2 going
through the same failures and the same recovery (``reset_iter_state``).
"""

from __future__ import annotations

import copy
import functools
import os
import re
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from fully_shard import fully_shard
from fully_shard.comm import CollectiveError
from tests.harness import device_type, run_distributed
from tests.models import ModelArgs, Transformer, batch, loss_fn
from tests.oracle import ShardwiseOptimizer, average_gradients
from tests.torch_features import has_torch_feature, skip_without_torch_feature

ARGS = ModelArgs(n_layers=3)


class _Injected(RuntimeError):
    """The failure the tests inject."""


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        raise _Injected("injected failure in backward")


class _Trap:
    """Hooks on a module inside the model: when armed, its forward raises ("forward"), or
    its output's backward raises ("backward")."""

    def __init__(self, module: nn.Module) -> None:
        self.armed: str | None = None
        module.register_forward_pre_hook(self._pre)
        module.register_forward_hook(self._post)

    def _pre(self, module: nn.Module, args: Any) -> None:
        if self.armed == "forward":
            raise _Injected("injected failure in forward")

    def _post(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        return _RaiseInBackward.apply(output) if self.armed == "backward" else None


def _shard(model: Transformer, shard: Any, mesh: DeviceMesh) -> Transformer:
    for block in model.layers:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)
    return model


# ---------------------------------------------------------------------------
# (a) an exception on every rank, reset_iter_state, training goes on
# ---------------------------------------------------------------------------

# step -> where it fails. Forward: in layers[1], after layers[0] ran and with layers[2]'s
# all-gather prefetched. Backward: in layers[0], after layers[2]'s reduce-scatter landed
# in its sharded gradients and with layers[1]'s in flight.
FAILS = {1: ("forward", 1), 3: ("backward", 0)}
STEPS = 6


def _recover_and_train() -> dict[str, Any]:
    """Train ours, torch's FSDP2 and the unsharded reference for STEPS steps; at the FAILS
    steps the sharded models raise (on every rank), recover with reset_iter_state() and
    optimizer.zero_grad(), and go on; the reference skips those steps."""
    rank = dist.get_rank()
    mesh = init_device_mesh(device_type(), (dist.get_world_size(),))
    torch.manual_seed(0)
    ref = Transformer(ARGS)
    models = {"ours": _shard(copy.deepcopy(ref), fully_shard, mesh)}
    if has_torch_feature("FSDPModule.reset_iter_state"):  # torch 2.11 lacks it: ours and the reference only
        models["torch"] = _shard(copy.deepcopy(ref), torch_fully_shard, mesh)
    traps = {name: [_Trap(block.feed_forward) for block in m.layers] for name, m in models.items()}
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-2) for name, m in models.items()}
    ref_opt = ShardwiseOptimizer(ref.parameters(), dist.get_world_size(), lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    grads_left: dict[str, dict[str, list[str]]] = {name: {} for name in models}
    losses: dict[str, list[float]] = {name: [] for name in (*models, "ref")}
    for step in range(STEPS):
        x = batch(step, rank, ARGS)
        fail = FAILS.get(step)
        if fail is None:  # the reference skips the failed steps
            loss = loss_fn(ref(x), x)
            loss.backward()
            average_gradients(ref)
            ref_opt.step()
            ref_opt.zero_grad()
            losses["ref"].append(loss.item())
        for name, model in models.items():
            opt = opts[name]
            if fail is not None:
                traps[name][fail[1]].armed = fail[0]
            try:
                loss = loss_fn(model(x), x)
                loss.backward()
            except _Injected as e:
                assert fail is not None and fail[0] in str(e), (step, str(e))
                model.reset_iter_state()  # type: ignore[operator]
                grads_left[name][fail[0]] = [n for n, p in model.named_parameters() if p.grad is not None]
                opt.zero_grad()  # whatever gradients of the failed step had landed
                continue
            finally:
                for trap in traps[name]:
                    trap.armed = None
            assert fail is None, f"{name}: step {step} did not fail"
            opt.step()
            opt.zero_grad()
            losses[name].append(loss.item())
    for (pname, p_ref), p in zip(ref.named_parameters(), models["ours"].parameters()):
        # world size 2, bitwise on any CPU: a 2-rank average is exact in any order, and the
        # reference steps the same chunks the ranks hold (tests.oracle)
        torch.testing.assert_close(p.full_tensor(), p_ref, rtol=0, atol=0, msg=lambda m: f"{pname}: {m}")
    return {"losses": losses, "grads_left": grads_left}


@functools.lru_cache(maxsize=1)
def _recovery() -> dict[str, Any]:
    return run_distributed(_recover_and_train, 2)[0]


def test_exception_on_all_ranks_then_reset_iter_state_and_continue() -> None:
    losses = _recovery()["losses"]
    assert len(losses["ref"]) == STEPS - len(FAILS), losses
    # bitwise the reference that skipped the failed steps (parameters compared on the ranks)
    # on any CPU: the same forward on weights bitwise equal for the reason in _recover_and_train
    assert losses["ours"] == losses["ref"], losses
    skip_without_torch_feature("FSDPModule.reset_iter_state")
    # torch's FSDP2 agrees through the forward failure and up to the step after the backward
    # failure. Later it drifts: torch 2.13's reset_iter_state keeps the .grad of the root
    # group's unsharded parameters (norm, output, logit_scale) computed by the aborted
    # backward, and the next backward adds to them (zero_grad() cannot reach them).
    # bitwise on any CPU: the same flat layout and AVG of two gradients, AdamW on the same shards
    assert losses["torch"][:3] == losses["ours"][:3], losses


def test_reset_iter_state_drops_gradients_of_the_failed_iteration() -> None:
    """reset_iter_state's docstring: "The failed iteration's gradients ... are dropped",
    so the next iteration can run as usual. After a failure in forward nothing had landed;
    after one in backward, layers[2]'s reduce-scatter had already landed in its sharded
    .grad before layers[0] raised."""
    ours = _recovery()["grads_left"]["ours"]
    assert ours == {"forward": [], "backward": []}, ours


# ---------------------------------------------------------------------------
# (b) an exception on one rank: the other gets a CollectiveError in bounded time
# ---------------------------------------------------------------------------

TIMEOUT_S = 5.0


def _one_rank_fails(where: str) -> dict[str, Any]:
    """Rank 1 fails (before its forward, or inside layers[1]'s forward); rank 0 goes on and
    must get a CollectiveError once the process group's timeout expires."""
    rank = dist.get_rank()
    pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=TIMEOUT_S))
    # Own dim names: DeviceMesh equality ignores the process group, so an unnamed mesh on
    # this group would equal init_device_mesh(device_type(), (2,)) of later tests, and DTensor's
    # caches could then send their collectives to this (timed-out) group.
    mesh = DeviceMesh.from_group(pg, device_type(), mesh_dim_names=("dp_fail_fast",))
    torch.manual_seed(0)
    model = _shard(Transformer(ARGS), fully_shard, mesh)
    trap = _Trap(model.layers[1].feed_forward)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = batch(0, rank, ARGS)
    loss_fn(model(x), x).backward()  # one good step: the forward order (prefetching) is known
    opt.step()
    opt.zero_grad()
    dist.barrier()
    x = batch(1, rank, ARGS)
    try:
        if rank == 1:
            if where == "before forward":
                raise _Injected("rank 1: the data loader failed")
            trap.armed = "forward"
        loss_fn(model(x), x).backward()
        opt.step()
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {
            "type": type(e).__name__,
            "is_collective_error": isinstance(e, CollectiveError),
            "message": str(e),
            "pg_name": pg.group_name,
        }
    return {"type": None}


def _check_one_rank_failure(where: str) -> None:
    # a hang (no error on rank 0) fails here, in the harness, after 120 s
    results = run_distributed(_one_rank_fails, 2, where, timeout=120)
    assert results[1]["type"] == "_Injected", results[1]
    r0 = results[0]
    assert r0["type"] is not None, f"rank 0 finished the step although rank 1 failed: {r0}"
    assert r0["is_collective_error"], f"rank 0 got {r0['type']}, not CollectiveError: {r0['message']}"
    message = r0["message"]
    # bounded by the group's timeout: the collective that failed is the one gloo gave up on
    # after TIMEOUT_S (not a clock reading, which a loaded machine stretches)
    assert f"Timed out waiting {int(TIMEOUT_S * 1000)}ms" in message, message
    # which collective of which fully_shard group, and what to do about it
    assert re.search(r"(all-gather|reduce-scatter|all-reduce) of (layers\.\d|\w*Transformer \(root\))'s",
                     message), message
    assert "reset_iter_state" in message and "timeout" in message, message


def test_one_rank_fails_before_forward_other_gets_collective_error() -> None:
    _check_one_rank_failure("before forward")


def test_one_rank_fails_mid_forward_other_gets_collective_error() -> None:
    _check_one_rank_failure("mid forward")


# ---------------------------------------------------------------------------
# (c) a save that fails midway leaves the previous checkpoint as the latest
# ---------------------------------------------------------------------------


class _FailingWriter(FileSystemWriter):
    """Rank 1's write fails (a full disk, a lost node): DCP raises on every rank."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        if dist.get_rank() == 1:
            raise OSError("injected: no space left on device")
        return super().write_data(plan, planner)


def _state(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd, "step": step}


def _full_params(model: nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor() for p in model.parameters()]


def _interrupted_save(root: str) -> str:
    import torch.distributed.checkpoint as dcp

    from fully_shard.ckpt import latest_checkpoint, save_checkpoint

    rank = dist.get_rank()
    mesh = init_device_mesh(device_type(), (dist.get_world_size(),))
    torch.manual_seed(0)
    model = _shard(Transformer(ARGS), fully_shard, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert latest_checkpoint(root) is None, os.listdir(root) if os.path.isdir(root) else root

    def train(step: int) -> None:
        x = batch(step, rank, ARGS)
        loss_fn(model(x), x).backward()
        opt.step()
        opt.zero_grad()

    train(0)
    saved = save_checkpoint(_state(model, opt, 1), root, 1)
    assert saved == os.path.join(root, "step_1") and latest_checkpoint(root) == saved
    at_step_1 = _full_params(model)
    train(1)
    try:
        save_checkpoint(_state(model, opt, 2), root, 2, storage_writer=_FailingWriter)
        error = "no error"
    except CheckpointException as e:  # a BaseException: `except Exception` misses it
        error = type(e).__name__
        assert "injected: no space left on device" in str(e), str(e)  # rank 1's error, on every rank
    assert os.path.isdir(os.path.join(root, "step_2.tmp")) and not os.path.exists(os.path.join(root, "step_2"))
    if rank == 0:  # a copy in progress, without DCP's metadata: not a checkpoint either
        os.makedirs(os.path.join(root, "step_9"))
    dist.barrier()
    assert latest_checkpoint(root) == os.path.join(root, "step_1"), os.listdir(root)

    # a new job resumes from the newest complete checkpoint
    torch.manual_seed(1)
    fresh = _shard(Transformer(ARGS), fully_shard, mesh)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    state = _state(fresh, fresh_opt, -1)
    dcp.load(state, checkpoint_id=latest_checkpoint(root))
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert state["step"] == 1, state["step"]
    for a, b in zip(_full_params(fresh), at_step_1):
        # bitwise on any CPU: the load copies the saved values
        assert torch.equal(a, b)

    # saving step 2 again works, clears the leftover, and becomes the latest
    save_checkpoint(_state(model, opt, 2), root, 2)
    assert latest_checkpoint(root) == os.path.join(root, "step_2")
    assert not os.path.exists(os.path.join(root, "step_2.tmp"))
    return error


def test_failed_save_leaves_previous_checkpoint_latest(tmp_path) -> None:
    errors = run_distributed(_interrupted_save, 2, str(tmp_path / "ckpts"))
    assert errors == ["CheckpointException", "CheckpointException"], errors
