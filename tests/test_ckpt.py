"""fully_shard.ckpt: CheckpointManager (interval, keep-latest-k, async) and conversion to one file."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest
import torch

from tests.harness import mesh as harness_mesh
from tests.harness import run_distributed
from tests.models import ModelArgs, Transformer, batch, loss_fn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ModelArgs(n_layers=2, dim=48, ffn_dim=72, vocab_size=37, max_seq_len=8)


def _case_manager(root: str, async_save: bool) -> dict[str, object]:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from fully_shard import fully_shard
    from fully_shard.ckpt import CheckpointManager, list_checkpoints

    rank = dist.get_rank()
    mesh = harness_mesh(dist.get_world_size())

    def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = Transformer(ARGS)
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, opt = build(0)

    def state(step: int) -> dict[str, object]:
        model_sd, optim_sd = get_state_dict(model, opt)
        return {"model": model_sd, "optim": optim_sd, "step": step}

    manager = CheckpointManager(root, interval=2, keep_latest_k=2, async_save=async_save)
    saved_at: dict[int, list[torch.Tensor]] = {}
    returned = []
    for step in range(1, 8):
        x = batch(step, rank, ARGS)
        loss_fn(model(x), x).backward()
        opt.step()
        opt.zero_grad()
        path = manager.maybe_save(step, lambda s=step: state(s), force=step == 7)
        if path is not None:
            returned.append(os.path.basename(path))
            saved_at[step] = [p.full_tensor().clone() for p in model.parameters()]
    manager.close()
    kept = [step for step, _ in list_checkpoints(root)]
    assert manager.latest() == os.path.join(root, "step_7"), os.listdir(root)
    assert not any(name.endswith(".tmp") for name in os.listdir(root)), os.listdir(root)

    # a fresh model resumes from the newest checkpoint: the same parameters, bitwise (a copy)
    fresh, fresh_opt = build(1)
    model, opt = fresh, fresh_opt  # state() reads these
    loaded = manager.load_latest(state(-1))
    assert loaded is not None and loaded["step"] == 7, loaded
    set_state_dict(fresh, fresh_opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    same = [torch.equal(a, b) for a, b in zip((p.full_tensor() for p in fresh.parameters()), saved_at[7])]
    full = {name: p.full_tensor() for name, p in fresh.named_parameters()}
    return {"returned": returned, "kept": kept, "same": all(same), "full": full if rank == 0 else None}


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_manager_interval_keep_latest_and_resume(async_save: bool) -> None:
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(_case_manager, 2, root, async_save)
        for r in results:
            assert r["returned"] == ["step_2", "step_4", "step_6", "step_7"], r["returned"]
            assert r["kept"] == [6, 7], r["kept"]  # keep_latest_k=2
            assert r["same"]

        # conversion: one process, no process group; the full tensors are copies of the
        # saved bytes, so they equal the sharded parameters' full_tensor() bitwise
        from fully_shard.ckpt import consolidate, load_consolidated

        full = results[0]["full"]
        ckpt = os.path.join(root, "step_7")
        sd = load_consolidated(ckpt)
        assert sorted(sd) == sorted(full)
        for name, tensor in full.items():
            # bitwise on any CPU: consolidation copies the saved shards, it does no arithmetic
            assert torch.equal(sd[name], tensor), name
        written = consolidate(ckpt, os.path.join(root, "model.pt"), dtype=torch.bfloat16)
        reread = torch.load(os.path.join(root, "model.pt"))
        # bitwise on any CPU: torch.save/torch.load copy the bf16 values written
        assert all(reread[k].dtype == torch.bfloat16 and torch.equal(reread[k], written[k]) for k in full)
        model = Transformer(ARGS)
        model.load_state_dict(sd)  # the unsharded model takes it as it is

        # the command line writes safetensors
        out = os.path.join(root, "model.safetensors")
        env = dict(os.environ, PYTHONPATH=ROOT)
        done = subprocess.run([sys.executable, "-m", "fully_shard.ckpt.convert", ckpt, out],
                              env=env, capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr
        assert f"{len(full)} tensors" in done.stdout, done.stdout
        from safetensors.torch import load_file

        st = load_file(out)
        for name, tensor in full.items():
            # bitwise on any CPU: the converter copies the saved fp32 values into the file
            assert torch.equal(st[name], tensor), name


def test_convert_errors_name_the_fix() -> None:
    from fully_shard.ckpt import load_consolidated

    with tempfile.TemporaryDirectory() as root, pytest.raises(FileNotFoundError, match="not a complete DCP.*latest"):
        load_consolidated(root)


def test_manager_rejects_bad_arguments() -> None:
    from fully_shard.ckpt import CheckpointManager

    with pytest.raises(ValueError, match="interval must be a positive int, got 0"):
        CheckpointManager("x", interval=0)
    with pytest.raises(ValueError, match="keep_latest_k must be a positive int or None"):
        CheckpointManager("x", keep_latest_k=0)
