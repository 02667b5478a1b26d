"""Gradient clipping over sharded gradients, on one mesh or several (FSDP x TP)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm_"]


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for sharded models, computed on the local shards.

    Gradients are grouped by mesh and by the mesh dims they are sharded over. For each group
    one foreach norm gives each gradient's norm over this rank's shard; that vector is reduced
    across the sharded mesh dims, one all-reduce per dim (``x ** p``, sum, ``** (1 / p)``:
    DTensor's own reduction of a partial norm; max / min for the infinity norms), and its norm
    is the group's. The group norms are combined and every local gradient is scaled in place by
    ``min(1, max_norm / (total + 1e-6))`` with one foreach multiply per device. On one mesh
    (FSDP, HSDP) this is the arithmetic of torch's function over DTensor gradients, without
    DTensor's per-op dispatch; unlike torch's it also accepts gradients on several meshes, as
    with FSDP x tensor parallelism (block weights on the 2-D ``(dp, tp)`` mesh, norms and
    embeddings on the 1-D ``dp`` mesh), where torch's raises ("All operands ... must have the
    same mesh"). Returns the total norm as a plain tensor, equal on every rank to the
    unsharded model's.

    Example::

        >>> from fully_shard import clip_grad_norm_
        >>> sharded = [fully_shard(m) for m in (*model.layers, model)]  # each block, then the root
        >>> model(tokens).sum().backward()
        >>> total = clip_grad_norm_(model.parameters(), max_norm=1.0)  # the norm before clipping
        >>> after = clip_grad_norm_(model.parameters(), max_norm=float("inf"))
        >>> bool(total > 1.0), round(after.item(), 4)
        (True, 1.0)
    """
    norm_type = float(norm_type)
    # (mesh, its dims the gradients are sharded over) or None (plain) -> gradients
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in parameters:
        g = p.grad
        if isinstance(g, DTensor):  # partial values (rare for gradients): no dims, DTensor reduces them
            dims = tuple(i for i, pl in enumerate(g.placements) if not pl.is_replicate())
            groups.setdefault((g.device_mesh, None if any(pl.is_partial() for pl in g.placements) else dims),
                              []).append(g)
        elif g is not None:
            groups.setdefault(None, []).append(g)
    if not groups:
        return torch.tensor(0.0)
    norms = [_group_norm(key, grads, norm_type) for key, grads in groups.items()]
    total = (norms[0] if len(norms) == 1
             else torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), norm_type))
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in (g for grads in groups.values() for g in grads):
        local = g._local_tensor if isinstance(g, DTensor) else g
        by_device.setdefault(local.device, []).append(local)
    for device, tensors in by_device.items():
        torch._foreach_mul_(tensors, coef.to(device))
    return total


def _group_norm(key: Any, grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm of one group's gradients, replicated on every rank."""
    if key is None:  # plain tensors: the same on every rank
        return torch.nn.utils.get_total_norm(grads, norm_type)
    mesh, dims = key
    if dims is None:
        norm = torch.nn.utils.get_total_norm(grads, norm_type)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    inf = math.isinf(norm_type)
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:  # this rank's shards; an empty one has no infinity norm: the identity of the max (min) instead
        local = cast(DTensor, g)._local_tensor
        if inf and not local.numel():
            local = local.new_full((1,), 0.0 if norm_type > 0 else math.inf)
        by_kind.setdefault((local.device, local.dtype), []).append(local)
    # each tensor's norm over its local shard, on the mesh's device (CPU-offloaded gradients) ...
    norms = [n.to(mesh.device_type) for ts in by_kind.values() for n in torch._foreach_norm(ts, norm_type)]
    stacked: torch.Tensor = torch.stack(norms)
    # ... reduced over the sharded mesh dims as DTensor reduces a partial norm, then combined
    op = (dist.ReduceOp.MAX if norm_type > 0 else dist.ReduceOp.MIN) if inf else dist.ReduceOp.SUM
    power = norm_type != 0 and not inf  # a p-norm: reduce the p-th powers
    for d in dims:
        if power:
            stacked = stacked**norm_type
        dist.all_reduce(stacked, op=op, group=mesh.get_group(d))
        if power:
            stacked = stacked ** (1.0 / norm_type)
    total: torch.Tensor = torch.linalg.vector_norm(stacked, norm_type)
    return total
