"""Explicit ``unshard()`` inside forward, backward and a registered forward method, with grad enabled (issue 28).

A model unshards its blocks by hand: the next block ahead of the one running in forward (``async_op=True``: the handle
waited on explicitly for some blocks, left to the block's pre-forward for others; or synchronously), and in backward,
from a hook on each block's output, the block that comes next in backward. The same program runs on fully_shard, on
torch's FSDP2 and on the unsharded model (no ``unshard``; gradients averaged over the ranks, ``tests.oracle``).

``grad_locals``: the sharded parameters' local tensors require grad, as torch's DTensor localisation for DDP makes them
(``torch.distributed.tensor.parallel.ddp``, used by ``replicate()``, which is how torch's ``test_unshard_async`` met
it). The all-gather then has to pack and copy out without grad, as torch's does; it used to fail at the copy-in with "A
view was created in no_grad mode and is being modified inplace with grad mode enabled".

Tolerances (fp32, gloo): bitwise against torch's FSDP2 at every world size (the same layout and collectives); against
the reference bitwise at world size 2, ``tests.oracle.REF_TOL`` beyond (another summation order).
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from support.collectives import CollectiveRecorder
from tests.harness import device_type, run_distributed
from tests.models import ModelArgs, Transformer, batch, loss_fn
from tests.oracle import ShardwiseOptimizer, average_gradients, check_gradients, check_parameters, close, ref_tol

ARGS = ModelArgs(dim=48, n_layers=3, ffn_dim=72, vocab_size=37, max_seq_len=8)


class UnshardingTransformer(Transformer):
    """Unshards its blocks by hand in forward and backward (``how``: "async" or "sync"); ``score``, a method other than
    forward (registered with ``register_fsdp_forward_method``), runs block 0 the same way."""

    def __init__(self, how: str) -> None:
        super().__init__(ARGS)
        self.how = how

    def _unshard(self, block: nn.Module, wait: bool) -> Any:
        """Unshard ``block`` (a no-op on the unsharded reference); returns the handle of an async unshard not waited
        on."""
        if not hasattr(block, "unshard"):
            return None
        handle = block.unshard(async_op=self.how == "async")
        if handle is None or wait:
            if handle is not None:
                handle.wait()
            weight = block.attention.wq.weight
            assert not isinstance(weight, DTensor) and weight.shape == (ARGS.dim, ARGS.dim), ("not gathered: "
                                                                                              f"{type(weight)}")
            return None
        return handle

    def _blocks(self, h: torch.Tensor, n: int) -> torch.Tensor:
        handle = self._unshard(self.layers[0], wait=False)
        for i in range(n):
            if handle is not None and i % 2 == 0:
                handle.wait()  # block 1's is left to its pre-forward
            handle = self._unshard(self.layers[i + 1], wait=False) if i + 1 < n else None  # ahead of block i
            h = self.layers[i](h)
            if i > 0 and h.requires_grad:
                # runs when the gradient of block i's output arrives: unshard the block next in backward
                h.register_hook(lambda grad, prev=self.layers[i - 1]: self._unshard(prev, wait=False) and None)
        return h

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) + self.pos[: tokens.shape[1]]  # (B, T, C)
        h = self._blocks(h, len(self.layers))
        return self.output(self.norm(h)) * self.logit_scale  # (B, T, V)

    def score(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) + self.pos[: tokens.shape[1]]
        return self.output(self.norm(self._blocks(h, 2))) * self.logit_scale


def case(how: str, entry: str, grad_locals: bool, steps: int) -> dict[str, float]:
    """Train the reference, fully_shard and torch's FSDP2 side by side; returns the largest differences of ours from the
    reference and from torch's."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.fsdp import register_fsdp_forward_method as torch_register

    from fully_shard import fully_shard, register_fsdp_forward_method

    ws, rank = dist.get_world_size(), dist.get_rank()
    what = f"{how} unshard in {entry}, local tensors requiring grad: {grad_locals}"
    mesh = init_device_mesh(device_type(), (ws,))
    torch.manual_seed(0)
    ref = UnshardingTransformer(how)
    models: dict[str, nn.Module] = {"ref": ref}
    for impl, shard, register in (("ours", fully_shard, register_fsdp_forward_method),
                                  ("torch", torch_fully_shard, torch_register)):
        m = models[impl] = copy.deepcopy(ref)
        for block in m.layers:
            shard(block, mesh=mesh)
        shard(m, mesh=mesh)
        register(m, "score")
        for p in m.parameters() if grad_locals else ():
            p._local_tensor.requires_grad_()  # as DTensor localisation for DDP does

    def adamw(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-2, foreach=True)

    opts: dict[str, Any] = {k: adamw(m.parameters()) for k, m in models.items() if k != "ref"}
    opts["ref"] = ShardwiseOptimizer(ref.parameters(), ws, adamw)
    worst = {"ref": 0.0, "torch": 0.0}
    for step in range(steps):
        x = batch(step, rank, ARGS)
        losses, counts = {}, {}
        for k, m in models.items():
            with CollectiveRecorder() as rec:
                losses[k] = loss_fn(m.score(x) if entry == "method" else m(x), x)
                losses[k].backward()
            counts[k] = rec.counts()
        average_gradients(ref)
        at = f"{what}: step {step}"
        assert counts["ours"] == counts["torch"], (f"{at}: collectives (ours, torch FSDP2): {counts['ours']}, "
                                                   f"{counts['torch']}")
        worst["ref"] = max(worst["ref"],
                           close(losses["ours"], losses["ref"], ref_tol("loss"), f"{at} loss vs reference"))
        worst["torch"] = max(worst["torch"], close(losses["ours"], losses["torch"], 0.0, f"{at} loss vs torch FSDP2"))
        diffs = check_gradients(ref, models["ours"], models["torch"], ref_tol("grad"), at)
        worst = {"ref": max(worst["ref"], diffs[0]), "torch": max(worst["torch"], diffs[1])}
        for opt in opts.values():
            opt.step()
            opt.zero_grad()
    diffs = check_parameters(ref, models["ours"], models["torch"], ref_tol("param"), f"{what}: after training")
    return {"ref": max(worst["ref"], diffs[0]), "torch": max(worst["torch"], diffs[1])}


CASES = list(itertools.product(("async", "sync"), ("forward", "method"), (False, True)))


def _cases(steps: int) -> dict[str, dict[str, float]]:
    return {f"{how} {entry} {grad_locals}": case(how, entry, grad_locals, steps) for how, entry, grad_locals in CASES}


@pytest.mark.parametrize("how, entry, grad_locals", CASES)
def test_explicit_unshard_ws2(how: str, entry: str, grad_locals: bool) -> None:
    for rank, worst in enumerate(run_distributed(case, 2, how, entry, grad_locals, 3)):
        # bitwise on any CPU: exact 2-rank average, the same chunks stepped (tests.oracle); torch: the same layout
        assert worst == {"ref": 0.0, "torch": 0.0}, f"rank {rank}: world size 2 must be bitwise, got {worst}"


@pytest.mark.parametrize("world_size", [1, 4])
def test_explicit_unshard_other_world_sizes(world_size: int) -> None:
    """One rank (nothing gathered: the shards are copied out) and four (uneven shards), every case in one call."""
    for rank, results in enumerate(run_distributed(_cases, world_size, 2)):
        for name, worst in results.items():
            assert worst["torch"] == 0.0, f"{name}: rank {rank} of {world_size} vs torch FSDP2: {worst}"
