"""fully_shard.optim: Muon over sharded parameters, MuonAdamW, owned_matrices.

Oracles, run in the same worker on the same full gradients (the sharded model gets this
rank's rows of them, so the optimizer alone is compared; one test takes the gradients from
a real fully_shard backward):

* ``torch.optim.Muon`` itself on the unsharded model. With ``batched=False`` the step is
  compared bitwise: the owner runs torch's own per-matrix sequence (``bfloat16()``, ``norm``,
  ``mm``, ``addmm``) on the same whole bf16 matrix, into freshly allocated tensors as torch
  does, and everything else (momentum ``lerp_``, Nesterov ``lerp``, ``mul_``, ``add_``) is
  elementwise: each element gets the same bits whether it sits in a CPU kernel's vector body
  or its scalar tail, which ``test_elementwise_kernels_ignore_position`` checks on the CPU
  that runs the suite (tests/oracle.py explains why the position could matter).
* ``ShardwiseMuon``: torch's step with its elementwise parts on the ranks' dim-0 chunks and
  torch's own ``_zeropower_via_newtonschulz`` on the whole matrix: bitwise by construction,
  with no condition on the CPU (every element goes through the same kernels at the same
  position in both runs).

The default ``batched=True`` runs one ``bmm`` chain per shape instead of torch's ``mm`` /
``addmm``: another kernel, which may sum each fp32 dot product in another order and so round
some bf16 entries of the orthogonalized update the other way. The momentum buffers are still
compared bitwise; the weights within one bf16 rounding step of each step's largest update
entry, times the learning rate (``_add_one_flip``; the difference measured here is 0).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from fully_shard import fully_shard
from fully_shard.optim import (
    Muon,
    MuonAdamW,
    assign_owners,
    muon_param_groups,
    newton_schulz,
    newton_schulz_flops,
    owned_matrices,
)
from support.collectives import CollectiveRecorder
from tests.harness import device, device_type, run_distributed
from tests.oracle import ShardwiseOptimizer

LR = 0.02
STEPS = 3


class ShardwiseMuon:
    """``torch.optim.Muon``'s step, elementwise on the dim-0 chunks of ``world`` ranks (3-D
    expert stacks: per expert), Newton-Schulz by torch on each whole matrix."""

    def __init__(self, params: list[nn.Parameter], world: int, lr: float = LR, weight_decay: float = 0.1,
                 momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 adjust_lr_fn: str | None = None) -> None:
        self.params, self.world, self.lr, self.wd = params, world, lr, weight_decay
        self.momentum, self.nesterov, self.ns_steps, self.adjust_lr_fn = momentum, nesterov, ns_steps, adjust_lr_fn
        self.bufs: dict[nn.Parameter, list[torch.Tensor]] = {}

    def _chunks(self, t: torch.Tensor) -> list[torch.Tensor]:
        return [c.clone() for c in torch.chunk(t.detach(), self.world)]

    def reshard(self, world: int) -> None:
        self.bufs = {p: [c.clone() for c in torch.chunk(torch.cat(b), world)] for p, b in self.bufs.items()}
        self.world = world

    def momentum_buffer(self, p: nn.Parameter) -> torch.Tensor:
        return torch.cat(self.bufs[p])

    @torch.no_grad()
    def step(self) -> None:
        from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

        coefficients = (3.4445, -4.7750, 2.0315)
        for p in self.params:
            grads = self._chunks(p.grad)
            bufs = self.bufs.setdefault(p, [torch.zeros_like(g) for g in grads])
            for b, g in zip(bufs, grads):
                b.lerp_(g, 1 - self.momentum)
            update = torch.cat([g.lerp(b, self.momentum) if self.nesterov else b for g, b in zip(grads, bufs)])
            matrices = update if update.dim() == 3 else update.unsqueeze(0)
            ortho = torch.stack([_zeropower_via_newtonschulz(m, coefficients, self.ns_steps, 1e-7) for m in matrices])
            ortho = ortho.view(update.shape)
            lr = _adjust_lr(self.lr, self.adjust_lr_fn, p.shape[-2:])
            chunks = self._chunks(p)
            for c, o in zip(chunks, torch.chunk(ortho, self.world)):
                c.mul_(1 - self.lr * self.wd)
                c.add_(o.contiguous(), alpha=-lr)
            p.copy_(torch.cat(chunks))


class Net(nn.Module):
    """Uneven matrices: at 4 ranks ``squeeze.weight`` (3 rows) leaves rank 3 without rows and
    ``output.weight`` (11 rows, chunks of 3) gives rank 3 two; ``output`` is tall, the blocks wide."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 24)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(24, 40, bias=False), nn.Tanh(), nn.Linear(40, 24, bias=False)) for _ in range(2)
        )
        self.squeeze = nn.Linear(24, 3)
        self.output = nn.Linear(3, 11, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)  # (B, T, C)
        for block in self.blocks:
            h = h + block(h)
        return self.output(self.squeeze(h))  # (B, T, V)


def _net(impl: str | None = None, mesh_kind: str = "fsdp") -> Net:
    torch.manual_seed(0)
    model = Net()
    if impl is not None:
        shard = fully_shard if impl == "ours" else torch_fully_shard
        ws = dist.get_world_size()
        mesh = (
            init_device_mesh(device_type(), (ws,))
            if mesh_kind == "fsdp"
            else init_device_mesh(device_type(), (2, ws // 2), mesh_dim_names=("replicate", "shard"))
        )
        for block in model.blocks:
            shard(block, mesh=mesh)
        shard(model, mesh=mesh)
    return model


def _rows_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full`` laid out like the parameter ``like``: this rank's rows (torch.chunk) as a DTensor."""
    if not isinstance(like, DTensor):
        return full.clone()
    mesh = like.device_mesh
    local = full
    for mesh_dim, placement in enumerate(like.placements):
        if isinstance(placement, Shard):
            n, world = full.shape[0], mesh.size(mesh_dim)
            chunk = math.ceil(n / world)
            start = min(mesh.get_local_rank(mesh_dim) * chunk, n)
            local = full[start : min(start + chunk, n)]
    return DTensor.from_local(local.clone(), mesh, like.placements, run_check=False, shape=full.shape,
                              stride=full.stride())


def _set_grads(model: nn.Module, ref: nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    for (_name, p), rp in zip(model.named_parameters(), ref.parameters()):
        rp.grad = torch.randn(rp.shape, generator=gen, device="cpu").to(device())
        p.grad = _rows_like(rp.grad, p)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _diffs(model: nn.Module, ref: nn.Module, opt: torch.optim.Optimizer, ref_opt: Any) -> dict[str, float]:
    """Max |difference| per parameter and momentum buffer (full tensors)."""
    out = {}
    for (name, p), rp in zip(model.named_parameters(), ref.parameters()):
        out[name] = (_full(p.detach()) - rp.detach()).abs().max().item()
        if "momentum_buffer" in opt.state.get(p, {}):
            buf = opt.state[p]["momentum_buffer"]
            assert isinstance(buf, DTensor) == isinstance(p, DTensor), name
            if isinstance(p, DTensor):
                assert buf.placements == p.placements, f"{name}: {buf.placements} vs {p.placements}"
            ref_buf = (ref_opt.momentum_buffer(rp) if isinstance(ref_opt, ShardwiseMuon)
                       else ref_opt.state[rp]["momentum_buffer"])
            out[name + ".momentum_buffer"] = (_full(buf) - ref_buf).abs().max().item()
    return out


def _matrices(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, p) for n, p in model.named_parameters() if p.ndim == 2]


def _parity(impl: str, mesh_kind: str, batched: bool, options: dict[str, Any], steps: int = STEPS) -> dict[str, Any]:
    ref, torch_ref, model = _net(), _net(), _net(impl, mesh_kind)
    world = dist.get_world_size() // (2 if mesh_kind == "hsdp" else 1)  # ranks a matrix's rows spread over
    opt = Muon(_matrices(model), lr=LR, batched=batched, **options)
    ref_opt = ShardwiseMuon([p for _, p in _matrices(ref)], world, **options)
    torch_opt = torch.optim.Muon([p for _, p in _matrices(torch_ref)], lr=LR, **options)
    flips: dict[str, float] = {}
    with CollectiveRecorder() as rec:
        for step in range(steps):
            _set_grads(model, ref, step)
            for p, rp in zip(torch_ref.parameters(), ref.parameters()):
                p.grad = rp.grad.clone()
            rec.mark(f"step {step}")
            opt.step()
            ref_opt.step()
            before = {n: p.detach().clone() for n, p in _matrices(torch_ref)}
            torch_opt.step()
            _add_one_flip(flips, before, torch_ref, options)
    per_step = [[(r.kind, r.numel) for r in recs] for label, recs in rec.phases().items() if label]
    return {
        "diffs": _diffs(model, ref, opt, ref_opt),
        "torch_diffs": _diffs(model, torch_ref, opt, torch_opt),
        "collectives": per_step,
        "one_flip_per_step": flips,
    }


def _add_one_flip(flips: dict[str, float], before: dict[str, torch.Tensor], torch_ref: nn.Module,
                  options: dict[str, Any]) -> None:
    """Add to ``flips[name]`` how far one bf16 rounding step of this step's orthogonalized update
    moves the weight: the update's largest entry (recovered from torch's step: the weight after
    weight decay minus the new weight, over the adjusted learning rate) has a bf16 spacing of
    2**(e - 8) for an entry in [2**(e-1), 2**e); the weight moves by that times the learning rate."""
    from torch.optim._muon import _adjust_lr

    for name, p in _matrices(torch_ref):
        lr = _adjust_lr(LR, options.get("adjust_lr_fn"), p.shape)
        largest = (before[name] * (1 - LR * options.get("weight_decay", 0.1)) - p.detach()).abs().max().item() / lr
        _, e = math.frexp(largest * 1.01)  # 1%: fp32 rounding of the recovery must not halve the spacing
        flips[name] = flips.get(name, 0.0) + lr * 2.0 ** (e - 8)


@pytest.mark.parametrize(
    "world_size, impl, mesh_kind, options",
    [
        (2, "ours", "fsdp", {}),
        (4, "ours", "fsdp", {"nesterov": False, "adjust_lr_fn": "match_rms_adamw", "ns_steps": 3, "weight_decay": 0.0}),
        (4, "ours", "hsdp", {"momentum": 0.9}),
        (2, "torch", "fsdp", {}),
    ],
)
def test_muon_bitwise_equal_to_torch_muon_on_unsharded_model(world_size: int, impl: str, mesh_kind: str,
                                                             options: dict) -> None:
    results = run_distributed(_parity, world_size, impl, mesh_kind, False, options)
    for rank, res in enumerate(results):
        # bitwise: torch's own addmm sequence on the same whole bf16 matrix on its owner, and
        # elementwise kernels that ignore an element's position (test_elementwise_kernels_ignore_position)
        assert res["torch_diffs"] and all(v == 0.0 for v in res["torch_diffs"].values()), (f"rank {rank}: "
                                                                                           f"{res['torch_diffs']}")
        # bitwise on any CPU: the same kernels at the same positions (module docstring)
        assert res["diffs"] and all(v == 0.0 for v in res["diffs"].values()), f"rank {rank}: {res['diffs']}"
        # one bucket (all matrices are sharded over one group): one all-to-all each way per step
        for step in res["collectives"]:
            assert [kind for kind, _ in step] == ["all_to_all", "all_to_all"], step


def test_elementwise_kernels_ignore_position() -> None:
    """Muon's elementwise ops, as torch.optim.Muon calls them, on every stretch of a tensor
    (lengths 1 to 70, every start) against the same elements of the op on the whole tensor:
    a rank's rows are such a stretch, so this is the condition for the bitwise test above."""
    gen = torch.Generator().manual_seed(0)
    n = 160  # more than twice the widest vector loop (AVX-512: 2 x 16 floats per iteration)
    a, b = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    update = torch.randn(n, generator=gen).bfloat16()
    ops = {
        "buf.lerp_(grad, 1 - 0.95)": lambda x, y, u: x.clone().lerp_(y, 1 - 0.95),
        "buf.lerp_(grad, 1 - 0.9)": lambda x, y, u: x.clone().lerp_(y, 1 - 0.9),
        "grad.lerp(buf, 0.95)": lambda x, y, u: y.lerp(x, 0.95),
        "param.mul_(1 - lr * wd)": lambda x, y, u: x.clone().mul_(1 - LR * 0.1),
        "param.add_(bf16 update, alpha=-lr)": lambda x, y, u: x.clone().add_(u, alpha=-LR * math.sqrt(11 / 3)),
        "update.bfloat16()": lambda x, y, u: x.bfloat16(),
    }
    for name, op in ops.items():
        whole = op(a, b, update)
        for length in range(1, 71):
            for start in range(0, n - length + 1, 1 if length < 40 else 7):
                end = start + length
                part = op(a[start:end], b[start:end], update[start:end])
                assert torch.equal(part, whole[start:end]), f"{name}: elements [{start}, {end}) differ"


def test_muon_batched_newton_schulz_close_to_torch_and_moves_analytic_bytes() -> None:
    results = run_distributed(_parity, 4, "ours", "fsdp", True, {})
    torch.manual_seed(0)
    names_shapes = [(n, tuple(p.shape)) for n, p in _matrices(Net())]
    for rank, res in enumerate(results):
        for name, _shape in names_shapes:
            # momentum is elementwise, untouched by bmm vs addmm: bitwise (module docstring)
            assert res["torch_diffs"][name + ".momentum_buffer"] == 0.0, (rank, name, res["torch_diffs"])
            # bmm vs addmm, another kernel for the same bf16 products: at most one bf16 rounding
            # step of the largest update entry per step (module docstring; measured here: 0)
            tolerance = res["one_flip_per_step"][name]
            assert res["torch_diffs"][name] <= tolerance, (rank, name, res["torch_diffs"], tolerance)
            assert res["diffs"][name] <= tolerance, (rank, name, res["diffs"], tolerance)
        # there: this rank's rows of every matrix, in bf16 (the dtype Newton-Schulz starts with)
        chunks = [(s[0], math.ceil(s[0] / 4), s[1]) for _, s in names_shapes]
        mine = sum(min(c, max(n - rank * c, 0)) * cols for n, c, cols in chunks)
        assert all(step[0] == ("all_to_all", mine) for step in res["collectives"]), res["collectives"]
    # back: each owner sends the rows of the matrices it owns, so all ranks together send
    # every matrix once each way (the (W-1)/W of it that leaves its rank crosses the wire)
    total = sum(math.prod(s) for _, s in names_shapes)
    for step in range(STEPS):
        assert sum(res["collectives"][step][1][1] for res in results) == total


def test_newton_schulz_batched_close_to_per_matrix() -> None:
    gen = torch.Generator().manual_seed(0)
    for shape in [(3, 24, 40), (2, 40, 24), (1, 5, 5)]:
        stack = torch.randn(shape, generator=gen, device="cpu").to(device())
        loop = newton_schulz(stack, batched=False)
        # tolerance: bf16 matmuls through another kernel, 5 iterations; entries are O(1)
        torch.testing.assert_close(newton_schulz(stack), loop, rtol=0, atol=0.05)
        assert loop.dtype == torch.bfloat16 and loop.shape == stack.shape


def _one_rank_and_experts() -> dict[str, Any]:
    """World 1 (or experts sharded on dim 0): no communication; per expert, as torch's Muon."""
    torch.manual_seed(0)
    experts = nn.Parameter(torch.randn(4, 6, 10))  # (E, M, N)
    holder = nn.Module()
    holder.experts = experts
    ref = nn.Parameter(experts.detach().clone())
    per_expert = [nn.Parameter(e.detach().clone()) for e in experts.detach()]
    fully_shard(holder, mesh=init_device_mesh(device_type(), (dist.get_world_size(),)))
    opt = Muon([("experts", holder.experts)], lr=LR, batched=False)
    ref_opt = ShardwiseMuon([ref], dist.get_world_size())
    torch_opt = torch.optim.Muon(per_expert, lr=LR)
    with CollectiveRecorder() as rec:
        for step in range(2):
            gen = torch.Generator().manual_seed(step)
            full = torch.randn(4, 6, 10, generator=gen, device="cpu").to(device())
            holder.experts.grad = _rows_like(full, holder.experts)
            ref.grad = full.clone()
            for e, p in enumerate(per_expert):
                p.grad = full[e].clone()
            opt.step()
            ref_opt.step()
            torch_opt.step()
    got = _full(holder.experts.detach())
    return {
        # bitwise on any CPU: the same kernels at the same positions (module docstring)
        "equal": torch.equal(got, ref.detach()),
        "torch_diff": max((got[e] - p.detach()).abs().max().item() for e, p in enumerate(per_expert)),
        "collectives": len(rec.collectives()),
    }


@pytest.mark.parametrize("world_size", [1, 2])
def test_expert_stacks_and_one_rank_need_no_communication(world_size: int) -> None:
    for rank, res in enumerate(run_distributed(_one_rank_and_experts, world_size)):
        assert res["equal"] and res["collectives"] == 0, f"rank {rank}: {res}"
        # bitwise: torch's per-matrix sequence on each whole expert, elementwise kernels that
        # ignore an element's position (test_elementwise_kernels_ignore_position)
        assert res["torch_diff"] == 0.0, f"rank {rank}: {res}"


def _meshes_and_plain() -> dict[str, Any]:
    """One optimizer over an FSDP mesh of 4, an HSDP (2 replicas x 2 shards) mesh, and a plain tensor."""
    torch.manual_seed(0)
    full = [torch.randn(9, 6), torch.randn(7, 10), torch.randn(5, 4)]
    fsdp_w, hsdp_w, plain_w = (nn.Linear(1, 1) for _ in range(3))
    for module, w in zip((fsdp_w, hsdp_w, plain_w), full):
        module.weight = nn.Parameter(w.clone())
        del module.bias
    fully_shard(fsdp_w, mesh=init_device_mesh(device_type(), (4,)))
    fully_shard(hsdp_w, mesh=init_device_mesh(device_type(), (2, 2), mesh_dim_names=("replicate", "shard")))
    params = [fsdp_w.weight, hsdp_w.weight, plain_w.weight]
    refs = [nn.Parameter(w.clone()) for w in full]
    opt = Muon([("fsdp", params[0]), ("hsdp", params[1]), ("plain", params[2])], lr=LR, batched=False)
    ref_opts = [ShardwiseMuon([r], world) for r, world in zip(refs, (4, 2, 1))]  # rows over 4, 2, 1 ranks
    with CollectiveRecorder() as rec:
        gen = torch.Generator().manual_seed(0)
        for p, r in zip(params, refs):
            r.grad = torch.randn(r.shape, generator=gen, device="cpu").to(device())
            p.grad = _rows_like(r.grad, p)
        opt.step()
    for ref_opt in ref_opts:
        ref_opt.step()
    return {
        # bitwise on any CPU: the same kernels at the same positions (module docstring)
        "equal": [torch.equal(_full(p.detach()), r.detach()) for p, r in zip(params, refs)],
        "all_to_all_group_sizes": [r.group_size for r in rec.collectives()],
    }


def test_one_bucket_per_mesh_and_plain_tensors_local() -> None:
    for rank, res in enumerate(run_distributed(_meshes_and_plain, 4)):
        assert res["equal"] == [True, True, True], f"rank {rank}: {res}"
        # the FSDP bucket over 4 ranks, the HSDP shard group over 2: both sends, then both returns
        assert res["all_to_all_group_sizes"] == [4, 2, 4, 2], f"rank {rank}: {res}"


def _resume(path: str, phase: str) -> dict[str, Any] | None:
    """Save after 2 steps at one world size; load at another, take step 3; compare with 3
    steps of the oracle (resharded like the run: 2 steps in 2 chunks, the third in 4)."""
    ref, model = _net(), _net("ours")
    opt = Muon(_matrices(model), lr=LR, batched=False)
    ref_opt = ShardwiseMuon([p for _, p in _matrices(ref)], 2)
    if phase == "save":
        for step in range(2):
            _set_grads(model, ref, step)
            opt.step()
        osd = get_optimizer_state_dict(model, opt)
        buf = osd["state"]["blocks.0.0.weight"]["momentum_buffer"]
        assert isinstance(buf, DTensor) and buf.placements == (Shard(0),), buf
        dcp.save({"model": model.state_dict(), "optim": osd}, checkpoint_id=path)
        return None
    state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    for step in range(3):
        _set_grads(model, ref, step)
        if step == 2:
            ref_opt.reshard(dist.get_world_size())
            opt.step()
        ref_opt.step()
    return _diffs(model, ref, opt, ref_opt)


def test_dcp_resume_at_another_world_size_is_exact(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    run_distributed(_resume, 2, path, "save")
    for rank, diffs in enumerate(run_distributed(_resume, 4, path, "load")):
        # bitwise on any CPU: checkpoints copy values; the oracle steps in the run's layout
        assert diffs and all(v == 0.0 for v in diffs.values()), f"rank {rank}: {diffs}"


def _muon_adamw_from_backward(impl: str) -> dict[str, Any]:
    """Real fully_shard gradients; the oracle gets their full tensors."""
    ref, model = _net(), _net(impl)
    groups = muon_param_groups(model)
    split = {g["use_muon"]: [n for n, _ in g["params"]] for g in groups}
    opt = MuonAdamW(groups, lr=LR, adamw_lr=1e-3, batched=False)
    ref_params = dict(ref.named_parameters())
    world = dist.get_world_size()
    ref_muon = ShardwiseMuon([ref_params[n] for n in split[True]], world)
    ref_adamw = ShardwiseOptimizer(
        [ref_params[n] for n in split[False]], world,
        lambda ps: torch.optim.AdamW(ps, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01),
    )
    for step in range(2):
        gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
        tokens = torch.randint(0, 11, (2, 5), generator=gen, device="cpu").to(device())
        model(tokens).square().mean().backward()
        for name, p in model.named_parameters():
            ref_params[name].grad = _full(p.grad)  # the reduce-scattered gradient, gathered
        opt.step()
        opt.zero_grad()
        ref_muon.step()
        ref_adamw.step()
    diffs = {n: (_full(p.detach()) - ref_params[n].detach()).abs().max().item() for n, p in model.named_parameters()}
    return {"split": split, "diffs": diffs}


@pytest.mark.parametrize("impl", ["ours", "torch"])
def test_muon_adamw_after_real_backward_bitwise(impl: str) -> None:
    for rank, res in enumerate(run_distributed(_muon_adamw_from_backward, 2, impl)):
        assert res["split"] == {
            True: ["blocks.0.0.weight", "blocks.0.2.weight", "blocks.1.0.weight", "blocks.1.2.weight",
                   "squeeze.weight"],
            False: ["embed.weight", "squeeze.bias", "output.weight"],
        }, res["split"]
        # bitwise on any CPU: both oracles step in the ranks' layout (module docstring)
        assert all(v == 0.0 for v in res["diffs"].values()), f"rank {rank}: {res['diffs']}"


def _owned(world_shapes: list[tuple[int, int]]) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    fulls = [torch.randn(s, generator=gen, dtype=torch.float64, device="cpu").to(device()) for s in world_shapes]
    mesh = init_device_mesh(device_type(), (dist.get_world_size(),))
    inputs = [distribute_tensor(f, mesh, [Shard(0)]) for f in fulls]
    outs = [torch.empty_like(t.to_local()) for t in inputs]
    seen = 0
    for stack, result in owned_matrices(inputs, outs):
        seen += stack.shape[0]
        for matrix, out in zip(stack, result):  # needs whole matrices; one at a time, as the oracle
            out.copy_(matrix / torch.linalg.matrix_norm(matrix))
    expected = [_rows_like(f / torch.linalg.matrix_norm(f), t).to_local() for f, t in zip(fulls, inputs)]
    # bitwise on any CPU: the owner runs the oracle's kernels on the same whole (M, N) matrix
    return {"seen": seen, "equal": all(torch.equal(o, e) for o, e in zip(outs, expected))}


@pytest.mark.parametrize("world_size", [2, 4])
def test_owned_matrices_each_matrix_once_on_one_rank(world_size: int) -> None:
    # at 2 ranks (16, 16) goes to rank 0 and rank 1 owns the rest, shapes interleaved
    shapes = [(8, 5), (3, 7), (8, 5), (16, 16), (13, 4), (1, 9), (8, 5)]
    results = run_distributed(_owned, world_size, shapes)
    assert all(r["equal"] for r in results), results
    assert sum(r["seen"] for r in results) == len(shapes), results
    assert assign_owners([8, 4, 4, 1], 2) == [0, 1, 1, 0]


def test_next_bucket_all_to_all_issued_before_this_bucket_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    """A recording double for ``dist.all_to_all_single`` (no process group): every bucket's
    all-to-all to the owners is issued (``async_op=True``) before any Newton-Schulz runs, and
    each bucket's is waited for only right before its own compute; the returns are waited for
    at the end. So a later bucket's transfer runs during an earlier bucket's compute, on any
    backend that runs collectives beside the caller (gloo: its own threads; NCCL: its stream)."""
    from fully_shard.optim.owned import MatrixLayout, owned_matrices_local

    events: list[tuple[str, str]] = []
    issued: dict[str, int] = {}

    class Work:
        def __init__(self, label: str) -> None:
            self.label = label

        def wait(self) -> bool:
            events.append(("wait", self.label))
            return True

    def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int], group: Any = None, async_op: bool = False) -> Work:
        assert async_op, "owned_matrices must not block on its all-to-alls"
        issued[group] = issued.get(group, 0) + 1
        label = f"{group} {'to owners' if issued[group] == 1 else 'back'}"
        events.append(("issue", label))
        output.zero_()
        return Work(label)

    monkeypatch.setattr(dist, "all_to_all_single", all_to_all_single)
    # rank 0 of 2 in buckets "A" (owns a0; a1 goes to rank 1) and "B" (owns b0), and a local matrix
    layouts = [MatrixLayout("a0", (8, 6), "A", 2, 0), MatrixLayout("local", (4, 4), None, 1, 0),  # type: ignore[arg-type]
               MatrixLayout("b0", (6, 5), "B", 2, 0), MatrixLayout("a1", (8, 6), "A", 2, 0)]  # type: ignore[arg-type]
    inputs = [torch.randn(4, 6), torch.randn(4, 4), torch.randn(3, 5), torch.randn(4, 6)]
    outputs = [torch.empty_like(t) for t in inputs]
    for stack, result in owned_matrices_local(layouts, inputs, outputs):
        events.append(("compute", "x".join(map(str, stack.shape))))
        result.copy_(stack)
    assert events == [
        ("issue", "A to owners"), ("issue", "B to owners"),
        ("compute", "1x4x4"),  # the local matrix, while both buckets travel
        ("wait", "A to owners"), ("compute", "1x8x6"), ("issue", "A back"),
        ("wait", "B to owners"), ("compute", "1x6x5"), ("issue", "B back"),  # B arrived during A's compute
        ("wait", "A back"), ("wait", "B back"),
    ], events


def test_bytes_of_all_ranks_sum_to_analytic_when_rows_divide() -> None:
    """``sent_bytes`` (which the benchmark's simulation, benchmarks/muon.py, predicts with) gives every rank's bytes
    from the layout; over Llama 3.2 3B's block matrices, whose rows divide by 64 and 1024, they sum to the analytic
    ``2 x (W-1)/W x matrix bytes`` exactly (integers: each owner holds 1/W of its matrix, the rest
    crosses the wire once each way). Uneven rows (the test model at 4 ranks) do not: owners hold
    ceil(M/W) rows, or none."""
    from fully_shard.optim.owned import sent_bytes
    from support.llama import LLAMA32_3B, Llama

    with torch.device("meta"):
        shapes = [tuple(p.shape) for n, p in Llama(LLAMA32_3B).named_parameters() if n.startswith("layers.")
                  and p.ndim == 2]
    matrix_bytes = sum(m * n for m, n in shapes) * 2  # bf16
    for world in (64, 1024):
        assert all(m % world == 0 for m, _ in shapes), world
        assert sum(sent_bytes(shapes, world)) * world == 2 * (world - 1) * matrix_bytes, world
    torch.manual_seed(0)
    uneven = [tuple(p.shape) for _, p in _matrices(Net())]
    owners = assign_owners([newton_schulz_flops(s) for s in uneven], 4)
    held = [min(math.ceil(m / 4), max(m - o * math.ceil(m / 4), 0)) for (m, _), o in zip(uneven, owners)]
    assert sum(sent_bytes(uneven, 4)) == sum(2 * (m - h) * n * 2 for (m, n), h in zip(uneven, held))


def _errors() -> list[tuple[str, str]]:
    caught = []

    def expect(exc: type[Exception], make: Any) -> None:
        try:
            make()
        except exc as e:  # noqa: PERF203
            caught.append((type(e).__name__, str(e)))
        else:
            caught.append(("nothing", ""))

    model = _net("ours")
    expect(ValueError, lambda: Muon(model.named_parameters()))  # squeeze.bias is 1-D
    expect(RuntimeError, lambda: Muon([("z", nn.Parameter(torch.zeros(2, 2, dtype=torch.complex64)))]))
    tp_like = nn.Parameter(distribute_tensor(torch.zeros(4, 6), init_device_mesh(device_type(), (2,)), [Shard(1)]))
    expect(ValueError, lambda: Muon([("wq_tp", tp_like)]))
    expect(ValueError, lambda: MuonAdamW(list(model.parameters())))

    def sparse_step() -> None:
        p = nn.Parameter(torch.zeros(3, 4))
        opt = Muon([("sparse_w", p)])
        p.grad = torch.zeros(3, 4).to_sparse()
        opt.step()

    expect(RuntimeError, sparse_step)
    return caught


def test_bad_input_errors_name_the_parameter() -> None:
    caught = run_distributed(_errors, 2)[0]
    expected = [
        ("ValueError", "squeeze.bias"),
        ("RuntimeError", "'z'"),
        ("ValueError", "'wq_tp'"),
        ("ValueError", "muon_param_groups"),
        ("RuntimeError", "'sparse_w'"),
    ]
    for (typ, msg), (want_typ, fragment) in zip(caught, expected):
        assert typ == want_typ and fragment in msg, (typ, msg, want_typ, fragment)
