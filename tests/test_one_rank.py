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
                problems.append(f"step {step}: {name}.grad is {type(p.grad).__name__}, not a DTensor like its "
                                "parameter")
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


def _divide_like_torch() -> tuple[bool, dict[str, int], dict[str, int]]:
    """A divide factor that is not a power of two, over one rank: our gradients against torch's FSDP2's, and the
    division ops each dispatched in the backward (docs/migration.md: torch divides out of place, ours in place)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.utils._python_dispatch import TorchDispatchMode

    from fully_shard import fully_shard

    class CountDivisions(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: dict[str, int] = {}

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if "div" in str(func):
                self.ops[str(func)] = self.ops.get(str(func), 0) + 1
            return func(*args, **(kwargs or {}))

    mesh = init_device_mesh("cpu", (1,))
    ref = _model()
    x = torch.randn(4, 8)
    grads, ops = {}, {}
    for impl, shard in (("ours", fully_shard), ("torch", torch_fully_shard)):
        model = copy.deepcopy(ref)
        shard(model, mesh=mesh)
        model.set_gradient_divide_factor(3.0)
        with CountDivisions() as count:
            model(x).sum().backward()
        grads[impl], ops[impl] = [p.grad.to_local() for p in model.parameters()], count.ops
    return all(torch.equal(a, b) for a, b in zip(grads["ours"], grads["torch"])), ops["ours"], ops["torch"]


def test_one_rank_divide_factor_in_place_same_gradient_as_torch() -> None:
    same, ours, torchs = run_distributed(_divide_like_torch, 1)[0]
    assert same, "gradients divided by 3 differ from torch's FSDP2"
    assert ours == {"aten.div_.Tensor": 1} and torchs == {"aten.div.Tensor": 1}, (ours, torchs)
