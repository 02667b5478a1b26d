"""Programs that rely on how torch's FSDP2 behaves, run on ours, torch's and the unsharded model.

* A grouped ``fully_shard([norm, head])`` whose members do not all run in the model's forward:
  the chunked-loss pattern (the model's forward skips ``head``, which is then called on its
  own once per chunk). Three programs: one forward and chunked head then one backward; two
  such forwards before one backward; gradient accumulation over two microbatches with
  ``set_requires_gradient_sync`` / ``set_is_last_backward``; and torchtitan's loop (detached
  chunks, one backward per chunk with the head's group driven by hand, then one backward
  through the decoder). Swept over weight tying, reshard_after_forward True/False/1, mixed
  precision (none, bf16 everywhere, bf16 in the blocks only) and activation checkpointing.
* ``MixedPrecisionPolicy(cast_forward_inputs=True)`` on a grouped call casts every member's inputs.
* A parameter replaced before the first forward is picked up and sharded.
* ``reshard_after_forward=<int>`` as torch reads it: the shard group size means True, 1 False.

Each on 2 and 4 gloo ranks, every rank's result checked; the device switch
(``FULLY_SHARD_TEST_DEVICE``) picks the mesh's device, inputs drawn on the CPU and moved there.

Tolerances. Against torch's FSDP2, bitwise (2 and 4 ranks): the same program issues the same
ops in the same order in both (the same casts, the same flat layout reduce-scattered with AVG
by the same gloo collective, so the same sums in the same order), so any difference is a
behaviour difference. Against the unsharded model (gradients all-reduced with AVG): fp32 to 1e-6 (sums
of chunks and microbatches grouped differently; measured at most 3e-8 over the full sweep of
all four programs); bf16 to 2e-2, the rounding of bf16 compute against the fp32 reference
(measured at most 7.5e-3 over the same sweep, two steps).
"""

from __future__ import annotations

import copy
import itertools
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from tests.harness import device, run_distributed
from tests.harness import mesh as suite_mesh
from tests.models import Block, ModelArgs, RMSNorm
from tests.oracle import average_gradients
from tests.torch_features import requires_torch_feature

ARGS = ModelArgs(vocab_size=32, dim=16, n_layers=2, n_heads=2, ffn_dim=24, max_seq_len=8)
CHUNKS = 2


class ChunkLM(nn.Module):
    """An LM whose forward stops before the head (``forward`` returns the normed hidden states)."""

    def __init__(self, tie: bool, ac: bool) -> None:
        super().__init__()
        self.ac = ac
        self.tok_embeddings = nn.Embedding(ARGS.vocab_size, ARGS.dim)
        self.layers = nn.ModuleList(Block(ARGS) for _ in range(ARGS.n_layers))
        self.norm = RMSNorm(ARGS.dim)
        self.head = nn.Linear(ARGS.dim, ARGS.vocab_size, bias=False)
        if tie:
            self.head.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)  # (B, T, C)
        for layer in self.layers:
            h = checkpoint(layer, h, use_reentrant=False) if self.ac else layer(h)
        return self.norm(h)


def _head_loss(model: ChunkLM, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    logits = model.head(h).float()  # (B, T/CHUNKS, V)
    return F.cross_entropy(logits.flatten(0, 1), tokens.flatten(), reduction="sum") / tokens.numel()


def _shard(model: ChunkLM, fs: Any, mp_cls: Any, mesh: Any, tie: bool, reshard: Any, mp: str) -> Any:
    """Blocks, then the head group (with the embedding when tied), then the root."""
    bf16 = mp_cls(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    inner = bf16 if mp != "none" else mp_cls()
    outer = bf16 if mp == "bf16" else mp_cls()
    for layer in model.layers:
        fs(layer, mesh=mesh, reshard_after_forward=reshard, mp_policy=inner)
    members = [model.tok_embeddings, model.norm, model.head] if tie else [model.norm, model.head]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # reshard_after_forward=1 warns (in both)
        fs(members, mesh=mesh, reshard_after_forward=reshard, mp_policy=outer)
    fs(model, mesh=mesh, mp_policy=outer)
    return model.head


def _step(program: str, model: ChunkLM, head_group: Any, tokens: torch.Tensor) -> float:
    """One optimizer step's forward and backward; returns the summed loss."""
    total = 0.0
    if program == "one":  # forward, chunked head, one backward
        h = model(tokens)
        loss = sum(_head_loss(model, hc, tc) for hc, tc in zip(h.chunk(CHUNKS, 1), tokens.chunk(CHUNKS, 1)))
        loss.backward()
        return loss.item()
    if program == "two_forwards":  # two partial forwards, then one backward
        loss = torch.zeros(())
        for mb in tokens.chunk(2):
            h = model(mb)
            loss = loss + sum(_head_loss(model, hc, tc) for hc, tc in zip(h.chunk(CHUNKS, 1), mb.chunk(CHUNKS, 1)))
        loss.backward()
        return loss.item()
    if program == "accumulate":  # a backward per microbatch, reduced at the last
        for i, mb in enumerate(tokens.chunk(2)):
            last = i == 1
            if head_group is not None:
                model.set_requires_gradient_sync(last)
                model.set_is_last_backward(last)
            h = model(mb)
            loss = sum(_head_loss(model, hc, tc) for hc, tc in zip(h.chunk(CHUNKS, 1), mb.chunk(CHUNKS, 1)))
            loss.backward()
            total += loss.item()
        return total
    assert program == "torchtitan"  # torchtitan's ChunkedLossWrapper, abridged
    h = model(tokens)
    chunks = [c.detach().requires_grad_() for c in h.chunk(CHUNKS, 1)]
    if head_group is not None:
        head_group.set_reshard_after_forward(False)
        head_group.set_reshard_after_backward(False)
        head_group.set_requires_gradient_sync(False, recurse=False)
        head_group.unshard()
    grads = []
    for i, (hc, tc) in enumerate(zip(chunks, tokens.chunk(CHUNKS, 1))):
        if head_group is not None and i == CHUNKS - 1:
            head_group.set_requires_gradient_sync(True, recurse=False)
        loss = _head_loss(model, hc, tc)
        loss.backward()
        grads.append(hc.grad)
        total += loss.item()
    if head_group is not None:
        head_group.set_reshard_after_forward(True)
        head_group.set_reshard_after_backward(True)
        head_group.set_requires_gradient_sync(True, recurse=False)
        head_group.reshard()
    h.backward(torch.cat(grads, 1))
    return total


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _chunked_sweep(programs: list[str], combos: list[tuple[bool, Any, str, bool]], steps: int) -> list[str]:
    """Every program and combination on ours, torch's FSDP2 and the unsharded model; returns
    the mismatches (empty when all agree)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fully_shard import MixedPrecisionPolicy, fully_shard

    mesh = suite_mesh(dist.get_world_size())  # the suite's device switch (FULLY_SHARD_TEST_DEVICE)
    rank = dist.get_rank()
    problems: list[str] = []
    for program, (tie, reshard, mp, ac) in itertools.product(programs, combos):
        what = f"{program}, tie={tie}, reshard_after_forward={reshard!r}, mp={mp}, ac={ac}"
        torch.manual_seed(0)
        ref = ChunkLM(tie, ac)
        ours, theirs = copy.deepcopy(ref), copy.deepcopy(ref)
        groups = {
            "ours": _shard(ours, fully_shard, MixedPrecisionPolicy, mesh, tie, reshard, mp),
            "torch": _shard(theirs, torch_fully_shard, TorchMP, mesh, tie, reshard, mp),
            "ref": None,
        }
        models = {"ours": ours, "torch": theirs, "ref": ref}
        opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-2) for k, m in models.items()}
        for step in range(steps):
            g = torch.Generator().manual_seed(100 * step + rank)
            tokens = torch.randint(0, ARGS.vocab_size, (4, ARGS.max_seq_len), generator=g, device="cpu").to(device())
            for name, model in models.items():
                try:
                    _step(program, model, groups[name], tokens)
                except Exception as e:  # a mismatch to report, with the others
                    problems.append(f"{what}: {name} raised {type(e).__name__}: {e}")
                    return problems
            average_gradients(ref)
            named = {k: dict(m.named_parameters()) for k, m in models.items()}
            tol = 1e-6 if mp == "none" else 2e-2
            for fqn, p in named["ours"].items():
                a, b, r = _full(p.grad), _full(named["torch"][fqn].grad), named["ref"][fqn].grad
                if not torch.equal(a, b):  # same ops in the same order as torch FSDP2 (docstring)
                    problems.append(f"{what}, step {step}: grad of {fqn} differs from torch FSDP2 by "
                                    f"{(a - b).abs().max():.3g}")
                if not torch.allclose(a, r, rtol=tol, atol=tol):
                    problems.append(f"{what}, step {step}: grad of {fqn} differs from the unsharded model by "
                                    f"{(a - r).abs().max():.3g}")
            for opt in opts.values():
                opt.step()
                opt.zero_grad()
        for fqn, p in ours.named_parameters():
            if not torch.equal(_full(p), _full(dict(theirs.named_parameters())[fqn])):  # as the grads
                problems.append(f"{what}: parameter {fqn} differs from torch FSDP2 after {steps} steps")
    return problems


_SWEEP = [
    (tie, reshard, mp, ac)
    for tie in (False, True)
    for reshard in (True, False, 1)
    for mp in ("none", "bf16", "bf16_inner")
    for ac in (False, True)
]


# every value of every dimension at least once, ties and AC with each reshard mode
_SPOT = [
    (False, True, "none", False),
    (True, False, "bf16", True),
    (True, 1, "bf16_inner", False),
    (False, 1, "none", True),
    (False, False, "bf16_inner", True),
    (True, True, "bf16", False),
]


@pytest.mark.parametrize(
    "world_size, program, combos",
    [
        pytest.param(2, "torchtitan", _SWEEP, marks=pytest.mark.long),
        (2, "accumulate", _SPOT),
        (2, "one", _SPOT),
        (2, "two_forwards", _SPOT),
        (4, "one", _SPOT),
        (4, "two_forwards", _SPOT),
    ],
    ids=["2-torchtitan-full-sweep", "2-accumulate-spot", "2-one-spot", "2-two_forwards-spot", "4-one-spot",
         "4-two_forwards-spot"],
)
@requires_torch_feature("FSDP2 casting every grouped module's inputs")  # the comparison's torch side, on 2.11
def test_chunked_head_matches_torch_and_unsharded(world_size: int, program: str, combos: list[Any]) -> None:
    """Ours, torch FSDP2 and the unsharded model, 2 steps each combination, every rank's
    result. The full sweep (36 combinations) for torchtitan's program on 2 ranks, which
    drives the head's group by hand and settles it in several backward passes per step; the
    others on six combinations that cover every value of every dimension (the full sweep of
    all four programs passes too, in about a minute: too long for every run of the suite).
    ``accumulate`` and ``torchtitan`` on 4 ranks: test_chunked_head_four_ranks."""
    problems = run_distributed(_chunked_sweep, world_size, [program], combos, 2, timeout=300)
    for rank, rank_problems in enumerate(problems):
        assert rank_problems == [], f"rank {rank}:\n" + "\n".join(rank_problems[:20])


@requires_torch_feature("FSDP2 casting every grouped module's inputs")  # the comparison's torch side, on 2.11
def test_chunked_head_four_ranks() -> None:
    combos = [(True, 1, "bf16", True)]
    problems = run_distributed(_chunked_sweep, 4, ["accumulate", "torchtitan"], combos, 2, timeout=300)
    for rank_problems in problems:
        assert rank_problems == [], "\n".join(rank_problems[:20])


# -- MixedPrecisionPolicy(cast_forward_inputs=True) on a grouped call ----------------------


class TwoStage(nn.Module):
    """``b`` gets an fp32 intermediate: its inputs must be cast too, not only ``a``'s."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)
        self.scale = nn.Parameter(torch.full((8,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).float() * self.scale  # fp32 between the members
        return self.b(h).float()


def _grouped_cast_inputs() -> list[str]:
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fully_shard import MixedPrecisionPolicy, fully_shard

    mesh = suite_mesh(dist.get_world_size())
    ours = TwoStage()
    theirs = copy.deepcopy(ours)
    for model, fs, mp in ((ours, fully_shard, MixedPrecisionPolicy), (theirs, torch_fully_shard, TorchMP)):
        fs([model.a, model.b], mesh=mesh, mp_policy=mp(param_dtype=torch.bfloat16, cast_forward_inputs=True))
        fs(model, mesh=mesh)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(dist.get_rank()), device="cpu").to(device())
    out, tout = ours(x), theirs(x)
    out.sum().backward()
    tout.sum().backward()
    problems = []
    if not torch.equal(out, tout):  # the same casts and bf16 ops in both
        problems.append(f"outputs differ by {(out - tout).abs().max()}")
    for (fqn, p), q in zip(ours.named_parameters(), theirs.parameters()):
        if not torch.equal(p.grad.full_tensor(), q.grad.full_tensor()):
            problems.append(f"grad of {fqn} differs")
    return problems


@pytest.mark.parametrize("world_size", [2, 4])
@requires_torch_feature("FSDP2 casting every grouped module's inputs")  # the comparison's torch side, on 2.11
def test_grouped_cast_forward_inputs_casts_every_member(world_size: int) -> None:
    assert run_distributed(_grouped_cast_inputs, world_size) == [[]] * world_size


# -- a parameter replaced before the first forward ------------------------------------------


class Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer1 = nn.Linear(8, 8)
        self.layer2 = nn.Linear(8, 8)
        self.mix = nn.Parameter(torch.empty(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer2(self.layer1(x) @ self.mix)


def _init_children(model: Mixer) -> None:
    """The same full values whether the children are sharded or not (DTensor random init on
    a CPU mesh draws differently from a plain tensor's)."""
    from torch.distributed.tensor import distribute_tensor

    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in list(model.layer1.parameters()) + list(model.layer2.parameters()):
            full = torch.randn(p.shape, generator=g, device="cpu").to(p.device)
            if isinstance(p, DTensor):
                p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements).to_local())
            else:
                p.copy_(full)


def _replaced_before_lazy_init(full: bool) -> list[str]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fully_shard import fully_shard

    mesh = suite_mesh(dist.get_world_size())
    ref = Mixer()
    _init_children(ref)
    ref.mix = nn.Parameter(ref.layer1.weight.detach() + ref.layer2.weight.detach())
    models = {"ref": ref}
    for name, fs in (("ours", fully_shard), ("torch", torch_fully_shard)):
        if name == "torch" and full:
            continue  # torch takes only a DTensor replacement
        with torch.device("meta"):
            model = Mixer()
        fs(model.layer1, mesh=mesh)
        fs(model.layer2, mesh=mesh)
        fs(model, mesh=mesh)
        model.layer1.to_empty(device=device())
        model.layer2.to_empty(device=device())
        _init_children(model)
        w1, w2 = model.layer1.weight.detach(), model.layer2.weight.detach()
        # the root's own parameter, still on meta, replaced by one built from the children
        model.mix = nn.Parameter(w1.full_tensor() + w2.full_tensor() if full else w1 + w2)
        models[name] = model
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(dist.get_rank()), device="cpu").to(device())
    problems = []
    for name, model in models.items():
        model(x).sum().backward()
        if name == "ref":
            average_gradients(model)
            continue
        if not (isinstance(model.mix, DTensor) and model.mix in set(model.parameters())):
            problems.append(f"{name}: mix is not the sharded parameter")
        for fqn, p in model.named_parameters():
            # one step of an N-rank average: the same values by construction, within rounding
            # of the reference's matmul blocking (fp32)
            torch.testing.assert_close(p.grad.full_tensor(), dict(ref.named_parameters())[fqn].grad, rtol=1e-5,
                                       atol=1e-6)
    return problems


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("full", [False, True], ids=["dtensor", "full_tensor"])
def test_parameter_replaced_before_first_forward(full: bool, world_size: int) -> None:
    assert run_distributed(_replaced_before_lazy_init, world_size, full) == [[]] * world_size


# -- reshard_after_forward=<int>, as torch reads it -----------------------------------------


def _post_forward_numel(module: nn.Module, ours: bool) -> int:
    """Elements of ``module``'s parameters this rank keeps between forward and backward
    (the post-forward shards of reshard_after_forward=k), read from each library's state."""
    if ours:
        from fully_shard.state import state_of

        params = state_of(module).group.params  # type: ignore[union-attr]
        return sum(p.post_forward_slice.numel() for p in params if p.post_forward_slice is not None)
    group = module._get_fsdp_state()._fsdp_param_group  # type: ignore[operator]
    # set at a post-forward reshard
    kept = [getattr(fp, "_sharded_post_forward_param_data", None) for fp in group.fsdp_params]
    return sum(t.numel() for t in kept if t is not None)


def _int_reshard(k: int) -> list[Any]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fully_shard import fully_shard

    mesh = suite_mesh(dist.get_world_size())
    seen = []
    for fs in (fully_shard, torch_fully_shard):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fs(model[0], mesh=mesh, reshard_after_forward=k)
        fs(model, mesh=mesh)
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(dist.get_rank()), device="cpu").to(device())
        out = model(x)
        sharded_after_forward = isinstance(model[0].weight, DTensor)
        kept = _post_forward_numel(model[0], fs is fully_shard)
        out.sum().backward()
        grads = [p.grad.full_tensor() for p in model.parameters()]
        warned = any("reshard_after_forward=1" in str(w.message) for w in caught)
        seen.append({"sharded": sharded_after_forward, "warns": warned, "kept": kept, "out": out.detach(),
                     "grads": grads})
    return seen


@pytest.mark.parametrize(
    "world_size, k, sharded, warns, kept",
    [
        (2, 2, True, False, 0),
        (2, 1, False, True, 0),
        (4, 2, True, False, 10),  # a real partial reshard: 2 of Linear(4, 4)'s 4 rows (8 + 2 elements) kept
        (4, 4, True, False, 0),
        (4, 1, False, True, 0),
    ],
)
def test_int_reshard_after_forward_like_torch(world_size: int, k: int, sharded: bool, warns: bool, kept: int) -> None:
    """As torch reads it: k == the shard group size is True, 1 is False (with a warning), a
    divisor in between keeps each rank's 1/k of the parameters after forward."""
    for rank, (ours, theirs) in enumerate(run_distributed(_int_reshard, world_size, k)):
        assert (ours["sharded"], ours["warns"], ours["kept"]) == (sharded, warns, kept), f"rank {rank}: {ours}"
        assert (theirs["sharded"], theirs["kept"]) == (sharded, kept), f"rank {rank}: torch {theirs}"
        # the same ops in the same order as torch FSDP2 (the same flat all-gathers and
        # reduce-scatters, whichever group the backward all-gather ran in): bitwise
        assert torch.equal(ours["out"], theirs["out"]), f"rank {rank}"
        for i, (a, b) in enumerate(zip(ours["grads"], theirs["grads"])):
            assert torch.equal(a, b), f"rank {rank}: grad {i} differs from torch FSDP2 by {(a - b).abs().max()}"


# -- non-contiguous parameters: torch refuses them, ours shards them ----------------------


def _non_contiguous() -> float:
    from fully_shard import fully_shard

    mesh = suite_mesh(dist.get_world_size())
    torch.manual_seed(0)
    ref = nn.Linear(6, 4, bias=False)
    ref.weight = nn.Parameter(torch.randn(6, 4).t())  # (4, 6), strides (1, 4)
    model = copy.deepcopy(ref)
    assert not model.weight.is_contiguous()
    fully_shard(model, mesh=mesh)
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(dist.get_rank()), device="cpu").to(device())
    model(x).sum().backward()
    ref(x).sum().backward()
    dist.all_reduce(ref.weight.grad, op=dist.ReduceOp.AVG)
    assert torch.equal(model.weight.full_tensor(), ref.weight)  # a copy of the values
    # an average of N numbers, one matmul per rank: within fp32 rounding of the reference
    torch.testing.assert_close(model.weight.grad.full_tensor(), ref.weight.grad, rtol=1e-6, atol=1e-6)
    return float(model.weight.grad.full_tensor().norm())


@pytest.mark.parametrize("world_size", [2, 4])
def test_non_contiguous_parameter_is_sharded(world_size: int) -> None:
    norms = run_distributed(_non_contiguous, world_size)
    assert norms == [norms[0]] * world_size and norms[0] > 0
