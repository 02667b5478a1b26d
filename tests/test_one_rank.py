"""One rank: fully_shard over a 1-rank mesh trains exactly as the unsharded model.

Over one rank the all-gather of a shard is the shard and the reduce-scatter of a gradient
is the gradient, so fully_shard skips both copies (the unsharded gradient becomes the
sharded one, the shard is copied straight into the unsharded buffer). Everything here is
bitwise: the same arithmetic on the same numbers as the unsharded model (or torch's FSDP2
over one rank, for mixed precision). Each case also checks that a gradient is a DTensor
with the parameter's placement, so a shortcut that left a plain tensor would fail.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.harness import run_distributed


def _model() -> Any:
    import torch.nn as nn

    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 16), nn.Tanh()), nn.Linear(16, 3))


def _one_rank(case: str) -> list[str]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from fully_shard import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (1,))
    ref = _model()
    model = copy.deepcopy(ref)
    kwargs: dict[str, Any] = {"mesh": mesh}
    if case == "shard_dim_1":
        kwargs["shard_placement_fn"] = lambda p: Shard(1) if p.dim() == 2 else None
    if case == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        torch_fully_shard(ref[2], mesh=mesh, mp_policy=TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        torch_fully_shard(ref, mesh=mesh, mp_policy=TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    fully_shard(model[2], **kwargs)
    fully_shard(model, **kwargs)
    if case == "divide_factor":
        for m in (model, model[2]):  # not recursive, as in torch
            m.set_gradient_divide_factor(2.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t

    problems = []
    for step in range(3):
        xs = [torch.randn(4, 8) for _ in range(2)]
        for i, x in enumerate(xs):  # two microbatches: accumulation in the sharded grads
            if case == "no_sync":
                model.set_requires_gradient_sync(i == len(xs) - 1)
            model(x).sum().backward()
            ref(x).sum().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            if not isinstance(p.grad, DTensor) or p.grad.placements != p.placements:
                problems.append(f"step {step}: {name}.grad is {type(p.grad).__name__}, not a DTensor like its parameter")
                continue
            expected = local(q.grad) * 0.5 if case == "divide_factor" else local(q.grad)  # halving is exact
            if not torch.equal(p.grad.full_tensor(), expected):
                problems.append(f"step {step}: {name}.grad differs")
        if case == "divide_factor":
            for q in ref.parameters():
                q.grad.mul_(0.5)  # the same update from here on
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)  # and zeroed in place: the next backward adds
        ref_opt.zero_grad(set_to_none=step % 2 == 0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if not torch.equal(p.full_tensor(), local(q)):
            problems.append(f"{name} differs after 3 steps")
    return problems


@pytest.mark.parametrize("case", ["fp32", "no_sync", "divide_factor", "shard_dim_1", "bf16"])
def test_one_rank_trains_bitwise_like_the_unsharded_model(case: str) -> None:
    # bf16: the oracle is torch's FSDP2 over one rank (the same casts), else the plain model
    assert run_distributed(_one_rank, 1, case)[0] == []
