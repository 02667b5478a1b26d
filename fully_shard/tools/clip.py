"""Gradient clipping across gradients that live on different meshes (FSDP x TP)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for sharded models whose gradients sit on several
    meshes, as with FSDP x tensor parallelism (block weights on the 2-D ``(dp, tp)`` mesh,
    norms and embeddings on the 1-D ``dp`` mesh), where torch's own raises ("All operands
    ... must have the same mesh"). Gradients are grouped by mesh; each group's norm is
    reduced to a full (replicated) value, the values are combined, and every group is
    clipped by the total. Returns the total norm, equal to the unsharded model's. With one
    mesh it gives the same result as torch's function.

    Example::

        >>> total = fully_shard.clip_grad_norm_(model.parameters(), max_norm=1.0)
    """
    groups: dict[object, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p)
    if not groups:
        return torch.tensor(0.0)
    norms = []
    for params in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)  # type: ignore[misc]
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total: torch.Tensor = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), norm_type)
    for params in groups.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
