"""torch's composable ``replicate`` around a model with fully_shard modules (issue 40), the composition of torch's FSDP2
test ``test_unshard_async``: ``fully_shard`` on three MLPs (``reshard_after_forward=False``, unsharded ahead of their
forwards with ``unshard(async_op=True)``) and on their parent, ``replicate`` around the whole model, whose other
parameters it averages. fully_shard records its modules in torch's composable-API registry as torch's FSDP2 does, so
``replicate`` leaves their parameters alone, and the first-forward check counts the parameters ``replicate`` averages
as managed.

Compared with torch's FSDP2 in the same composition, bitwise (the same program: the same layouts, collectives and
kernels), and with the model under ``replicate`` alone (torch's own oracle there), also bitwise at world size 2 (DDP's
all-reduce and the reduce-scatter both average two floats, exact in any order; 1e-5 on more ranks).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from tests.harness import device, device_type, run_distributed
from tests.oracle import close, local

DIM = 8


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.in_proj, self.out_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(F.relu(self.in_proj(x)))


class ReduceModule(nn.Module):
    """A parameter of the replicated part, and an all-reduce (not differentiated) left in flight to overlap with."""

    def __init__(self, dim: int, mesh: DeviceMesh) -> None:
        super().__init__()
        self.mesh = mesh
        self.weight = nn.Parameter(torch.randn(dim, dim))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        y = F.relu(x @ self.weight)
        return y, dist.all_reduce(y, group=self.mesh.get_group(), async_op=True)


class MLPs(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.mlp1, self.mlp2, self.mlp3 = MLP(dim), MLP(dim), MLP(dim)

    def forward(self, ys: list[torch.Tensor], works: list[Any]) -> torch.Tensor:
        out = []
        for mlp, y, work in zip((self.mlp1, self.mlp2, self.mlp3), ys, works):
            work.wait()
            out.append(mlp(y))
        return out[0] + out[1] + out[2]


class ReduceModel(nn.Module):
    def __init__(self, dim: int, mesh: DeviceMesh) -> None:
        super().__init__()
        self.reduce_module1, self.reduce_module2 = ReduceModule(dim, mesh), ReduceModule(dim, mesh)
        self.reduce_module3 = ReduceModule(dim, mesh)
        self.mlps = MLPs(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ys, works = [], []
        for reduce, mlp in zip((self.reduce_module1, self.reduce_module2, self.reduce_module3),
                               (self.mlps.mlp1, self.mlps.mlp2, self.mlps.mlp3)):
            y, work = reduce(x)
            ys.append(y)
            works.append(work)
            if hasattr(mlp, "unshard"):  # sharded: its all-gather overlaps the next all-reduce
                mlp.unshard(async_op=True)
        return self.mlps(ys, works)


def _impls() -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fully_shard import fully_shard

    return {"ours": fully_shard, "torch": torch_fully_shard}


def _composed(base: ReduceModel, shard: Any, ignored_modules: tuple[str, ...] = ()) -> ReduceModel:
    from torch.distributed._composable import replicate

    model = copy.deepcopy(base)
    if shard is not None:
        for mlp in (model.mlps.mlp1, model.mlps.mlp2, model.mlps.mlp3):
            shard(mlp, reshard_after_forward=False)
        shard(model.mlps)
    replicate(model, ignored_modules=[model.get_submodule(n) for n in ignored_modules])
    return model


def case_train(steps: int = 4) -> dict[str, float]:
    """Train ``replicate`` around sharded MLPs with both libraries, and the model under ``replicate`` alone. Returns the
    largest differences of ours from torch's FSDP2 and from the replicated model."""
    from torch.distributed.tensor.experimental import implicit_replication

    mesh = init_device_mesh(device_type(), (dist.get_world_size(),))
    torch.manual_seed(42)
    base = ReduceModel(DIM, mesh).to(device())
    models = {"ref": _composed(base, None), **{k: _composed(base, shard) for k, shard in _impls().items()}}
    opts = {k: torch.optim.Adam(m.parameters(), lr=1e-2) for k, m in models.items()}
    x = torch.randn(2, DIM, generator=torch.Generator().manual_seed(dist.get_rank() + 1)).to(device())
    worst = {"ref": 0.0, "torch": 0.0}
    tol = 0.0 if dist.get_world_size() == 2 else 1e-5  # an average of two floats is exact in any order
    for step in range(steps):
        losses = {}
        for k, m in models.items():
            losses[k] = m(x).sum()
            losses[k].backward()
            with implicit_replication():  # the optimizer steps plain and DTensor parameters together
                opts[k].step()
            opts[k].zero_grad()
        # the same program as torch's FSDP2: bitwise
        worst["torch"] = max(worst["torch"], close(losses["ours"], losses["torch"], 0.0, f"step {step}: loss vs torch"))
        worst["ref"] = max(worst["ref"], close(losses["ours"], losses["ref"], tol, f"step {step}: loss vs replicate"))
    params = {k: dict(m.named_parameters()) for k, m in models.items()}
    for name, p in params["ours"].items():
        assert isinstance(p, DTensor) == name.startswith("mlps."), f"{name}: {type(p).__name__}"
        worst["torch"] = max(worst["torch"], close(local(p), local(params["torch"][name]), 0.0, f"{name} vs torch"))
        full = p.full_tensor() if isinstance(p, DTensor) else p
        worst["ref"] = max(worst["ref"], close(full, params["ref"][name], tol, f"{name} vs replicate"))
    return worst


def case_loose() -> str:
    """``replicate`` told to ignore ``reduce_module2``: its weight is neither averaged nor sharded, so the first forward
    refuses it. Returns the error's text."""
    from fully_shard import fully_shard

    mesh = init_device_mesh(device_type(), (dist.get_world_size(),))
    torch.manual_seed(42)
    model = _composed(ReduceModel(DIM, mesh).to(device()), fully_shard, ignored_modules=("reduce_module2",))
    with pytest.raises(RuntimeError) as info:
        model(torch.randn(2, DIM).to(device()))
    return str(info.value)


def test_replicate_around_sharded_modules_trains_like_torch() -> None:
    for rank, worst in enumerate(run_distributed(case_train, 2)):  # torch's test runs on 2 ranks
        assert worst == {"torch": 0.0, "ref": 0.0}, f"rank {rank}: largest differences {worst}"


def test_replicate_ignoring_a_module_is_refused_naming_its_parameter() -> None:
    for message in run_distributed(case_loose, 2):
        assert "runs inside DDPReduceModel, which is not sharded but has trainable parameters" in message, message
        assert "'reduce_module2.weight'" in message and "'reduce_module1.weight'" not in message, message
        assert "'mlps." not in message, message  # the sharded parameters are managed
