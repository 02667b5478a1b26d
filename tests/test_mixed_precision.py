"""Mixed precision, mixed original dtypes in one group, and CPU offload.

Oracles: torch's FSDP2 with the same policy on the same inputs (bitwise at world size 2:
the same casts, the same AVG or pre/post-divided SUM reductions), and the unsharded model.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from fully_shard import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from support.collectives import CollectiveRecorder
from tests.harness import device, device_type, run_distributed
from tests.models import Transformer, batch, loss_fn
from tests.oracle import ShardwiseOptimizer, average_gradients
from tests.transfers import Transfer, record_transfers

BF16_FP32 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
FP16 = dict(param_dtype=torch.float16)
BF16_OUT_FP32 = dict(param_dtype=torch.bfloat16, output_dtype=torch.float32)


def _shard(model: nn.Module, shard_fn, mesh, mp_policy=None, **kw) -> None:
    if mp_policy is not None:
        # output_dtype on the root only: a block returning fp32 would meet bf16 weights
        block_policy = type(mp_policy)(mp_policy.param_dtype, mp_policy.reduce_dtype, None,
                                       mp_policy.cast_forward_inputs)
        kw_block, kw_root = dict(kw, mp_policy=block_policy), dict(kw, mp_policy=mp_policy)
    else:
        kw_block = kw_root = kw
    for block in model.layers:
        shard_fn(block, mesh=mesh, **kw_block)
    shard_fn(model, mesh=mesh, **kw_root)


def _mp_vs_torch(policy: dict, steps: int) -> None:
    mesh = init_device_mesh(device_type(), (dist.get_world_size(),))
    ours = Transformer()
    theirs = copy.deepcopy(ours)
    _shard(ours, fully_shard, mesh, mp_policy=MixedPrecisionPolicy(**policy))
    _shard(theirs, torch_fully_shard, mesh, mp_policy=TorchMixedPrecisionPolicy(**policy))
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    topt = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    out_dtype = policy.get("output_dtype") or policy["param_dtype"]
    for step in range(steps):
        x = batch(step, dist.get_rank())
        out, tout = ours(x), theirs(x)
        assert out.dtype == out_dtype == tout.dtype, (out.dtype, tout.dtype)
        loss, tloss = loss_fn(out, x), loss_fn(tout, x)
        loss.backward()
        tloss.backward()
        for p in ours.parameters():  # sharded params and grads keep the original dtype
            assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, p.grad.dtype
            assert isinstance(p.grad, DTensor)
        opt.step()
        topt.step()
        opt.zero_grad()
        topt.zero_grad()
        # bitwise on any CPU: the same casts, flat layout and AVG reduce-scatter as torch FSDP2, in one process
        torch.testing.assert_close(loss, tloss, rtol=0, atol=0)
    for (name, p), tp in zip(ours.named_parameters(), theirs.parameters()):
        # bitwise on any CPU: the same casts, flat layout, reductions and AdamW shard shapes as torch FSDP2
        torch.testing.assert_close(p.full_tensor(), tp.full_tensor(), rtol=0, atol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")
        for key in ("exp_avg", "exp_avg_sq"):
            assert opt.state[p][key].dtype == torch.float32


@pytest.mark.parametrize("policy", [BF16_FP32, FP16, BF16_OUT_FP32], ids=["bf16-fp32reduce", "fp16", "bf16-out-fp32"])
def test_mixed_precision_matches_torch_fsdp2(policy: dict) -> None:
    run_distributed(_mp_vs_torch, 2, policy, 4)


class _CastingLinear(nn.Linear):
    """Casts its input to its weight's dtype itself, so it runs whatever dtype arrives."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self.weight.dtype))


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = _CastingLinear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # an fp32 intermediate between a and b: only a cast on b's inputs would make it bf16
        return self.b(torch.relu(self.a(x)).float())


def _no_input_cast(shard_fn, policy_cls) -> list:
    mesh = init_device_mesh(device_type(), (dist.get_world_size(),))
    torch.manual_seed(0)
    model = _Mlp()
    shard_fn(model.b, mesh=mesh, mp_policy=policy_cls(param_dtype=torch.bfloat16, cast_forward_inputs=False))
    shard_fn(model, mesh=mesh, mp_policy=policy_cls(param_dtype=torch.bfloat16))
    seen: dict[str, list[torch.dtype]] = {"a": [], "b": []}
    for name in seen:
        getattr(model, name).register_forward_pre_hook(lambda m, args, name=name: seen[name].append(args[0].dtype))
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(dist.get_rank()), device="cpu").to(device())
    model(x).float().sum().backward()
    return [seen, [p.grad.full_tensor() for p in model.parameters()]]


def test_cast_forward_inputs_off_matches_torch() -> None:
    ours = run_distributed(_no_input_cast_ours, 2)
    theirs = run_distributed(_no_input_cast_torch, 2)
    # the root cast x for a; b (cast off) received the fp32 intermediate as it was
    assert ours[0][0] == {"a": [torch.bfloat16], "b": [torch.float32]} == theirs[0][0], (ours[0][0], theirs[0][0])
    for a, b in zip(ours[0][1], theirs[0][1]):
        # bitwise: the same casts, matmuls and AVG reduce-scatters on the same inputs
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _no_input_cast_ours() -> list:
    return _no_input_cast(fully_shard, MixedPrecisionPolicy)


def _no_input_cast_torch() -> list:
    return _no_input_cast(torch_fully_shard, TorchMixedPrecisionPolicy)


def _fp32_input_reaches_uncast_module() -> tuple[torch.dtype, str]:
    mesh = init_device_mesh(device_type(), (dist.get_world_size(),))
    model = nn.Sequential(nn.Linear(8, 16))
    # bf16 compute with cast_forward_inputs=False: the fp32 input must reach the module as it is
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=False))
    seen = []
    model.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    try:
        model(torch.randn(3, 8))
    except RuntimeError as e:  # fp32 input against bf16 weights: the proof that it was not cast
        return seen[0], str(e)
    return seen[0], "no error: the input was cast"


def test_cast_forward_inputs_off_leaves_inputs() -> None:
    for dtype, message in run_distributed(_fp32_input_reaches_uncast_module, 2):
        assert dtype == torch.float32
        assert "dtype" in message and "BFloat16" in message, message


def _accumulate_in_reduce_dtype() -> None:
    mesh = init_device_mesh(device_type(), (dist.get_world_size(),))
    ours = Transformer()
    theirs = copy.deepcopy(ours)
    _shard(ours, fully_shard, mesh, mp_policy=MixedPrecisionPolicy(**BF16_FP32))
    _shard(theirs, torch_fully_shard, mesh, mp_policy=TorchMixedPrecisionPolicy(**BF16_FP32))
    for model in (ours, theirs):
        for micro in range(3):
            model.set_requires_gradient_sync(micro == 2)
            x = batch(micro, dist.get_rank())
            loss_fn(model(x), x).backward()
            if micro == 0 and model is ours:
                group = ours.layers[0]._fully_shard_state.group
                kept = [p.accumulated_grad for p in group.params]
                assert all(g is not None and g.dtype == torch.float32 for g in kept), [g.dtype for g in kept]
    for (name, p), tp in zip(ours.named_parameters(), theirs.parameters()):
        # bitwise on any CPU: the same casts, flat layout and reduce-scatters as torch FSDP2, in one process
        torch.testing.assert_close(p.grad.full_tensor(), tp.grad.full_tensor(), rtol=0, atol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_gradient_accumulation_keeps_reduce_dtype() -> None:
    run_distributed(_accumulate_in_reduce_dtype, 2)


class _LoraLinear(nn.Module):
    """A bf16 base weight beside fp32 adapters: torch's FSDP2 rejects this as one group."""

    def __init__(self, dim: int, rank: int) -> None:
        super().__init__()
        self.base = nn.Linear(dim, dim, bias=False).to(torch.bfloat16)
        self.lora_a = nn.Parameter(torch.randn(rank, dim) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(dim, rank) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x.to(torch.bfloat16)).float() + x @ self.lora_a.t() @ self.lora_b.t()


class _LoraModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_LoraLinear(12, 3) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _mixed_dtype_group(steps: int) -> dict:
    ws, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh(device_type(), (ws,))
    torch.manual_seed(0)
    ref = _LoraModel()
    model = copy.deepcopy(ref)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    counts = {}
    for step in range(steps):
        x = torch.randn(4, 12, generator=torch.Generator().manual_seed(10 * step + rank), device="cpu").to(device())
        ref(x).square().sum().backward()
        average_gradients(ref)
        ref_opt.step()
        ref_opt.zero_grad()
        with CollectiveRecorder() as rec:
            loss = model(x).square().sum()
            loss.backward()
        counts = rec.counts()
        opt.step()
        opt.zero_grad()
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters()):
        assert p.dtype == p_ref.dtype, name
        # gloo rounds a bf16 reduce-scatter and a bf16 all-reduce differently (one bf16 ulp);
        # the fp32 adapters then differ by what that ulp does to their gradients
        bf16 = p.dtype == torch.bfloat16
        tol = dict(rtol=1.6e-2, atol=4e-3) if bf16 else dict(rtol=1e-3, atol=2e-4)
        torch.testing.assert_close(p.full_tensor(), p_ref, **tol, msg=lambda m, name=name: f"{name}: {m}")
    return counts


def test_mixed_original_dtypes_in_one_group() -> None:
    counts = run_distributed(_mixed_dtype_group, 2, 3)[0]
    # 2 groups x (forward + backward all-gather) x 2 dtypes; 2 groups x 2 dtypes reduce-scatters
    assert counts == {"all_gather": 8, "reduce_scatter": 4}, counts


def _offload(pin_memory: bool, meta_init: bool = False) -> None:
    with torch.device("cpu"):  # a CPU mesh on any machine: the model, the batches and the optimizer state there
        _offload_on_cpu(pin_memory, meta_init)


def _offload_on_cpu(pin_memory: bool, meta_init: bool) -> None:
    ws, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (ws,))
    ref = Transformer()
    if meta_init:  # torch's recipe for offload: shard on meta, materialise on the CPU, then load
        with torch.device("meta"):
            offloaded = Transformer()
    else:
        offloaded = copy.deepcopy(ref)
    _shard(offloaded, fully_shard, mesh, offload_policy=CPUOffloadPolicy(pin_memory=pin_memory))
    if meta_init:
        offloaded.to_empty(device="cpu")  # new host tensors: pinned again where the policy pins
        offloaded.load_state_dict(ref.state_dict())
        offloaded.pos = ref.pos.clone()  # non-persistent: not in the state dict
    opt = torch.optim.AdamW(offloaded.parameters(), lr=1e-2)
    ref_opt = ShardwiseOptimizer(ref.parameters(), ws, lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    compute_devices = []
    offloaded.layers[0].register_forward_pre_hook(
        lambda m, args: compute_devices.append(m.attention.wq.weight.device.type)
    )
    for step in range(3):
        x = batch(step, rank).cpu()
        loss_fn(offloaded(x), x).backward()
        opt.step()
        for q in offloaded.parameters():  # sharded params, grads and optimizer state on the host
            for what, t in (("param", q.to_local()), ("grad", q.grad.to_local()), *opt.state[q].items()):
                assert t.device.type == "cpu", (what, t.device)
        opt.zero_grad()
        loss_fn(ref(x), x).backward()
        average_gradients(ref)
        ref_opt.step()
        ref_opt.zero_grad()
    # computed on the mesh's device, kept on the host (the same device only on a CPU mesh)
    assert compute_devices == [mesh.device_type] * 3, compute_devices
    pinned = pin_memory and torch.accelerator.is_available()  # never pinned without an accelerator
    for (name, p_ref), q in zip(ref.named_parameters(), offloaded.parameters()):
        assert q.to_local().is_pinned() == pinned, name
        # bitwise on any CPU: a 2-rank average is exact, and the reference steps the same
        # chunks the ranks hold (tests.oracle)
        torch.testing.assert_close(q.full_tensor(), p_ref, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("pin_memory", [True, False])
def test_cpu_offload_on_cpu_mesh(pin_memory: bool) -> None:
    # torch 2.13's FSDP2 crashes here with pin_memory=True and no accelerator
    run_distributed(_offload, 2, pin_memory)


def test_cpu_offload_after_meta_init_and_to_empty() -> None:
    # pinning is checked under the accelerator switch only (a CPU cannot pin): to_empty(device="cpu") makes new host
    # tensors, which are pinned again, as torch's FSDP2 does at lazy init
    run_distributed(_offload, 2, True, True)


def _offload_transfers(impl: str, pin_memory: bool) -> list[list[Transfer]]:
    mesh = init_device_mesh(device_type(), (dist.get_world_size(),))
    model = Transformer()
    shard_fn, policy_cls = ((fully_shard, MixedPrecisionPolicy) if impl == "ours"
                            else (torch_fully_shard, TorchMixedPrecisionPolicy))
    offload = CPUOffloadPolicy(pin_memory) if impl == "ours" else TorchCPUOffloadPolicy(pin_memory)
    _shard(model, shard_fn, mesh, mp_policy=policy_cls(**BF16_FP32), offload_policy=offload)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    logs = []
    for step in range(2):
        x = batch(step, dist.get_rank())
        with record_transfers({p.to_local().untyped_storage().data_ptr() for p in model.parameters()}) as log:
            loss_fn(model(x), x).backward()
        logs.append(log)
        opt.step()
        opt.zero_grad()
    return logs


@pytest.mark.parametrize("world_size", [1, 2])
def test_offload_moves_shards_like_torch(world_size: int) -> None:
    ours = run_distributed(_offload_transfers, world_size, "ours", False)
    theirs = run_distributed(_offload_transfers, world_size, "torch", False)
    for rank, (log, torch_log) in enumerate(zip(ours, theirs)):
        for step, (a, b) in enumerate(zip(log, torch_log)):
            # every all-gather reads an offloaded shard through one explicit, non-blocking move to the device that
            # keeps its dtype (the cast to bf16 then runs on the device copy, not on the host); each gradient
            # comes back by one explicit (blocking when not pinned) move: the same transfers as torch's FSDP2
            shards = [t for t in a if t.source == "shard"]
            assert shards and set(shards) == {Transfer("shard", True, False, None)}, (rank, step, a)
            assert sorted(a) == sorted(b), (rank, step, a, b)
