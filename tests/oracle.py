"""The unsharded oracle: how the tests train a plain model beside the sharded ones, and the
tolerances they compare it with.

The reference (``"ref"``) is the model before ``fully_shard``, trained on each rank's own
batch; :func:`average_gradients` stands in for the reduce-scatter and
:class:`ShardwiseOptimizer` steps it in the sharded layout. :func:`train_step` steps a dict of
models side by side; :func:`close`, :func:`rows`, :func:`check_gradients`,
:func:`check_parameters` and :func:`placements_like_torch` compare.

Tolerances (fp32, gloo):

* world size 2: bitwise (0.0) against the reference and against torch's FSDP2 (see below);
* beyond 2 ranks: bitwise against torch's FSDP2 (the same flat layout and the same
  reduce-scatter in the same process: gloo's summation order by construction);
  :data:`REF_TOL` against the reference, whose all-reduce sums in another order.

A sharded run steps each rank's dim-0 chunk of a parameter as a tensor of its own; the
unsharded reference steps the whole parameter. Optimizers are elementwise, so the values are
the same, but not always the bits: CPU kernels run a vectorised body and a scalar tail
(``lerp_``, ``addcmul_`` may fuse differently in each), and an element that starts rank 1's
shard sits at another position of the vector loop in the whole tensor. Which elements differ
depends on the CPU's vector width and the build.

:class:`ShardwiseOptimizer` removes that difference by construction: it keeps the reference's
parameters as the same chunks (``torch.chunk`` over the world size, the layout fully_shard
uses) and steps those, so every element goes through the same code in both runs on any
machine. Together with a gradient average that is exact (a sum of two floats does not depend
on the order, and dividing by 2 is exact), a world-size-2 run is then bitwise equal to the
reference.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

__all__ = [
    "REF_TOL",
    "ShardwiseOptimizer",
    "average_gradients",
    "check_gradients",
    "check_parameters",
    "close",
    "local",
    "placements_like_torch",
    "ref_tol",
    "rows",
    "train_step",
]

# Against the reference beyond 2 ranks. Losses and gradients: gloo's all-reduce sums in
# another order than the reduce-scatter (fp32 rounding). Parameters after AdamW: it divides
# by sqrt(v), so a near-zero gradient's last-bit difference moves a weight by ~1e-5.
REF_TOL = {"loss": 1e-5, "grad": 1e-5, "param": 1e-4}


def ref_tol(what: str, world_size: int | None = None) -> float:
    """The tolerance against the reference for ``what`` ("loss", "grad", "param"): 0.0 at
    world size 2 or less (an average of two floats is exact in any order), else REF_TOL."""
    world_size = dist.get_world_size() if world_size is None else world_size
    return 0.0 if world_size <= 2 else REF_TOL[what]


def close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> float:
    """``assert_close`` with ``rtol = atol = tol`` (0.0: bitwise); returns the largest
    difference, for tests that report how close they came."""
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")
    return (actual.detach() - expected.detach()).abs().max().item() if actual.numel() else 0.0


def rows(full: torch.Tensor, world_size: int | None = None, rank: int | None = None) -> torch.Tensor:
    """Rank ``rank``'s dim-0 shard of ``full`` (``torch.chunk``; empty past the end), this
    rank's by default."""
    world_size = dist.get_world_size() if world_size is None else world_size
    rank = dist.get_rank() if rank is None else rank
    chunks = torch.chunk(full, world_size)
    return chunks[rank] if rank < len(chunks) else full[:0]


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor; any other tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def average_gradients(model: nn.Module, keep_local: Iterable[str] = ()) -> None:
    """The reference's stand-in for the reduce-scatter: average its gradients over all ranks
    (``keep_local``: names of parameters whose gradients nobody reduces, left as they are).

    World size 2: one flat all-reduce (bitwise either way: a sum of two floats does not
    depend on the order; one collective is much cheaper on gloo). Beyond: one all-reduce per
    gradient, as a DDP-less training loop would: gloo's ring then sums in an order closer to
    the reduce-scatter's (a flat all-reduce measured up to 1.4e-5 after AdamW)."""
    skip = set(keep_local)
    grads = [p.grad for n, p in model.named_parameters() if p.grad is not None and n not in skip]
    if dist.get_world_size() != 2:
        for g in grads:
            dist.all_reduce(g, op=dist.ReduceOp.AVG)
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:  # one flat buffer per dtype: averaged in the gradients' own dtype
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat, op=dist.ReduceOp.AVG)
        for g, avg in zip(same, torch.split(flat, [g.numel() for g in same])):
            g.copy_(avg.view_as(g))


def train_step(
    models: dict[str, nn.Module],
    opts: dict[str, Any],
    x: torch.Tensor,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
) -> dict[str, torch.Tensor]:
    """One training step of every model on the same batch ``x``, one model after the other;
    ``models["ref"]``, the reference, has its gradients averaged before its step. Returns
    the (detached) losses by name."""
    losses = {}
    for name, model in models.items():
        loss = loss_fn(model(x), x)
        loss.backward()
        if name == "ref":
            average_gradients(model)
        opts[name].step()
        opts[name].zero_grad()
        losses[name] = loss.detach()
    return losses


def check_gradients(ref: nn.Module, ours: nn.Module, theirs: nn.Module, tol: float, what: str) -> tuple[float, float]:
    """After backward (the reference's gradients averaged): the same gradients exist in all
    three, and this rank's rows of each are within ``tol`` of the reference's and bitwise
    torch FSDP2's (every rank checks its own rows). A sharded parameter's gradient is a
    DTensor with its placements. Returns the largest differences (reference, torch FSDP2)."""
    worst_ref = worst_torch = 0.0
    ref_params, torch_params = dict(ref.named_parameters()), dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        g, g_ref, g_torch = p.grad, ref_params[name].grad, torch_params[name].grad
        assert (g is None) == (g_ref is None) == (g_torch is None), (
            f"{what}: {name}.grad is None: ours {g is None}, reference {g_ref is None}, torch FSDP2 {g_torch is None}"
        )
        if g is None:
            continue
        sharded = isinstance(p, DTensor)
        assert isinstance(g, DTensor) == sharded and (not sharded or g.placements == p.placements), (
            f"{what}: {name}.grad is {type(g).__name__} {getattr(g, 'placements', '')}"
        )
        expected = rows(g_ref) if sharded else g_ref
        worst_ref = max(worst_ref, close(local(g), expected, tol, f"{what} grad of {name} vs reference"))
        worst_torch = max(worst_torch, close(local(g), local(g_torch), 0.0, f"{what} grad of {name} vs torch FSDP2"))
    return worst_ref, worst_torch


def check_parameters(ref: nn.Module, ours: nn.Module, theirs: nn.Module, tol: float,
                     what: str = "") -> tuple[float, float]:
    """After training: the same parameter names in all three; each of ours with torch
    FSDP2's placements and local shape and bitwise its values (bitwise gradients, the same
    layout and AdamW over the same shard shapes), and within ``tol`` of the reference.
    Returns the largest differences (reference, torch FSDP2)."""
    ref_params, ours_params, torch_params = (dict(m.named_parameters()) for m in (ref, ours, theirs))
    assert ours_params.keys() == ref_params.keys() == torch_params.keys(), f"{what}: parameter names differ"
    worst_ref = worst_torch = 0.0
    for name, p in ours_params.items():
        tp = torch_params[name]
        if isinstance(p, DTensor):
            assert p.placements == tp.placements, (what, name, p.placements, tp.placements)
        assert local(p).shape == local(tp).shape, (what, name)
        full = p.full_tensor() if isinstance(p, DTensor) else p
        worst_ref = max(worst_ref, close(full, ref_params[name], tol, f"{what}: parameter {name} vs reference"))
        worst_torch = max(worst_torch, close(local(p), local(tp), 0.0, f"{what}: parameter {name} vs torch FSDP2"))
    return worst_ref, worst_torch


def placements_like_torch(ours: nn.Module, theirs: nn.Module) -> list[str]:
    """The state dicts of ours and torch FSDP2: the same keys, with the same placements.
    Returns ``"name: placements"`` of each of our parameters."""
    sd, tsd = ours.state_dict(), theirs.state_dict()
    assert list(sd) == list(tsd)
    for key in sd:
        assert sd[key].placements == tsd[key].placements, key
    return [f"{name}: {p.placements}" for name, p in ours.named_parameters()]


class ShardwiseOptimizer:
    """``make_optimizer`` over the dim-0 chunks of ``params`` as ``world_size`` ranks hold
    them (``keep_whole``: parameters every rank keeps whole); ``step()`` copies the
    gradients in and the updated chunks back.

    Example::

        >>> ref_opt = ShardwiseOptimizer(ref.parameters(), 2, lambda ps: torch.optim.AdamW(ps, lr=1e-2))
        >>> loss.backward(); ref_opt.step(); ref_opt.zero_grad()
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        world_size: int,
        make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
        keep_whole: Iterable[torch.nn.Parameter] = (),
    ) -> None:
        whole = set(keep_whole)  # e.g. ignored_params: every rank steps them whole
        self.splits: dict[torch.nn.Parameter, int] = {}
        self.chunks: dict[torch.nn.Parameter, list[torch.Tensor]] = {}
        for p in params:
            self.splits[p] = 1 if p in whole else world_size
            self.chunks[p] = [
                c.detach().clone().requires_grad_(p.requires_grad) for c in torch.chunk(p.detach(), self.splits[p])
            ]
        self.optimizer = make_optimizer([c for cs in self.chunks.values() for c in cs])

    def step(self) -> None:
        for p, chunks in self.chunks.items():
            grads = [None] * len(chunks) if p.grad is None else torch.chunk(p.grad, self.splits[p])
            for c, g in zip(chunks, grads):
                c.grad = None if g is None else g.clone()
        self.optimizer.step()
        with torch.no_grad():
            for p, chunks in self.chunks.items():
                p.copy_(torch.cat(chunks))

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()
        for p in self.chunks:
            p.grad = None

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups
