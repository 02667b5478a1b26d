"""torch.distributed.pipelining with fully_shard'ed stages: 4 gloo ranks, 2 pipeline stages
x 2 data-parallel ranks, a GPipe schedule of 2 microbatches.

torch's stages recognise torch's own ``FSDPModule`` by class, so they run our stage module
as a plain module: each microbatch's backward reduce-scatters (correct, one reduction per
microbatch). ``OneReducePerStep`` is the recipe in docs/recipes.md: turn gradient sync on
only for the last microbatch's backward, which the schedule flags, for one reduce-scatter
per step. Oracle: the unsharded two-layer model on the global batch (fp32, sums in another
order: 1e-6).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from tests.harness import device, device_type, run_distributed


def _recipe_stage_class() -> Any:
    from torch.distributed.pipelining import PipelineStage

    class OneReducePerStep(PipelineStage):
        """A PipelineStage whose fully_shard'ed module reduces gradients once per step."""

        def backward_maybe_with_nosync(self, backward_type: Any, bwd_kwargs: dict, last_backward: bool = False) -> Any:
            self.submod.set_requires_gradient_sync(last_backward)
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)

    return OneReducePerStep


def _pipeline(one_reduce: bool) -> dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    from fully_shard import fully_shard
    from fully_shard.comm import add_observer, remove_observer

    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    torch.manual_seed(0)
    full = nn.Sequential(nn.Sequential(nn.Linear(8, 16), nn.Tanh()), nn.Linear(16, 4))
    ref = copy.deepcopy(full)
    stage_module = full[pp]
    fully_shard(stage_module, mesh=mesh["dp"])
    stage_cls = _recipe_stage_class() if one_reduce else PipelineStage
    stage = stage_cls(stage_module, pp, 2, device(), group=mesh.get_group("pp"))
    loss_fn = nn.MSELoss()
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=loss_fn)
    opt = torch.optim.SGD(stage_module.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    events: list[Any] = []
    add_observer(events.append)
    try:
        for step in range(2):
            g = [torch.Generator().manual_seed(100 * step + d) for d in range(2)]
            xs = [torch.randn(4, 8, generator=gen, device="cpu").to(device()) for gen in g]
            ys = [torch.randn(4, 4, generator=gen, device="cpu").to(device()) for gen in g]
            if pp == 0:
                schedule.step(xs[dp])
            else:
                schedule.step(target=ys[dp])
            opt.step()
            opt.zero_grad()
            # oracle: mean over the dp ranks of the mean over the microbatches of the loss
            ref_loss = sum(loss_fn(ref(x[i : i + 2]), y[i : i + 2]) for x, y in zip(xs, ys) for i in (0, 2)) / 4
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
    finally:
        remove_observer(events.append)
    for (name, p), q in zip(stage_module.named_parameters(), ref[pp].parameters()):
        torch.testing.assert_close(p.full_tensor(), q, rtol=1e-6, atol=1e-6, msg=name)
    return {"reduce_scatters": sum(e.kind == "reduce_scatter" for e in events)}


@pytest.mark.parametrize("one_reduce", [False, True], ids=["plain_stage", "one_reduce_per_step"])
def test_two_stage_pipeline_of_fully_shard_stages_trains(one_reduce: bool) -> None:
    results = run_distributed(_pipeline, 4, one_reduce)
    counts = [r["reduce_scatters"] for r in results]
    # 2 steps x 2 microbatches; with the recipe, 2 steps x 1
    assert counts == ([2] * 4 if one_reduce else [4] * 4), counts


def _two_forwards_then_two_backwards() -> None:
    from fully_shard import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    fully_shard(model)
    rank, world = dist.get_rank(), dist.get_world_size()
    xs = [
        [torch.randn(2, 8, generator=torch.Generator().manual_seed(10 * r + i), device="cpu").to(device())
         for i in range(2)]
        for r in range(world)
    ]
    # the pipelining order F0 F1 B0 B1, on inputs that need no gradient: the group's
    # post-backward runs from the end-of-backward callback, once per backward
    outs = [model(x) for x in xs[rank]]
    for out in outs:
        out.pow(2).sum().backward()
    sum(ref(x).pow(2).sum() for r in range(world) for x in xs[r]).div(world).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        # sums in another order
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-6, atol=1e-6, msg=name)


def test_several_forwards_before_their_backwards_reduce_every_gradient() -> None:
    run_distributed(_two_forwards_then_two_backwards, 2)
