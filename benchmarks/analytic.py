"""Closed-form per-rank sizes for FSDP (ZeRO-3) with ``torch.chunk`` dim-0 sharding.

Both fully_shard and torch's FSDP2 shard every parameter on dim 0 with ``torch.chunk``
semantics and pad each rank's slot in the flat communication buffers to
``ceil(rows / W)`` rows. Per group (one ``fully_shard`` call) and step:

* forward all-gather, input bytes per rank = sum over the group of
  ``ceil(rows/W) * row_numel * itemsize(param_dtype)``; output = ``W`` times that;
* backward all-gather: the same again, for the groups resharded after forward;
* reduce-scatter, input bytes per rank = ``W * ceil(rows/W) * row_numel *
  itemsize(reduce_dtype)`` per parameter with a gradient; output = ``1/W`` of that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn


def padded_shard_numel(shape: tuple[int, ...] | torch.Size, world: int) -> int:
    """Elements of one rank's padded slot: ``ceil(rows / W)`` rows."""
    return math.ceil(shape[0] / world) * math.prod(shape[1:])


def local_numel(shape: tuple[int, ...] | torch.Size, world: int, rank: int) -> int:
    """Elements rank ``rank`` really holds (``torch.chunk``: the last ranks may hold fewer)."""
    c = math.ceil(shape[0] / world)
    start = min(rank * c, shape[0])
    return (min(start + c, shape[0]) - start) * math.prod(shape[1:])


@dataclass
class Group:
    """The parameters of one ``fully_shard`` call: (name, global shape, dtype)."""

    name: str
    params: list[tuple[str, tuple[int, ...], torch.dtype]] = field(default_factory=list)
    resharded_after_forward: bool = True

    def numel(self) -> int:
        return sum(math.prod(s) for _, s, _ in self.params)

    def padded_numel(self, world: int) -> int:
        """Unsharded numel including padding (``W * sum ceil(rows/W) * row``)."""
        return world * sum(padded_shard_numel(s, world) for _, s, _ in self.params)


def plan_groups(model: nn.Module, blocks: list[nn.Module], reshard_blocks: bool, reshard_root: bool) -> list[Group]:
    """Groups for "fully_shard each block, then the root": one per block (in order), then
    the root's remaining parameters. Call on the unsharded model (or a meta copy)."""
    groups: list[Group] = []
    owned: set[int] = set()
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    for i, b in enumerate(blocks):
        g = Group(f"block{i}", resharded_after_forward=reshard_blocks)
        for p in b.parameters():
            if id(p) not in owned:
                owned.add(id(p))
                g.params.append((names.get(id(p), "?"), tuple(p.shape), p.dtype))
        groups.append(g)
    root = Group("root", resharded_after_forward=reshard_root)
    for n, p in model.named_parameters():
        if id(p) not in owned:
            owned.add(id(p))
            root.params.append((n, tuple(p.shape), p.dtype))
    if root.params:
        groups.append(root)
    return groups


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def collective_bytes(
    groups: list[Group],
    world: int,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    replicate: int = 1,
) -> dict[str, Any]:
    """Per-rank collectives of one forward+backward (all parameters trainable and used).

    ``world`` is the shard-group size; with ``replicate > 1`` (HSDP) each group's reduced
    shard is also all-reduced across the replicas (input = the padded shard, reduce dtype).
    """
    out: dict[str, Any] = {
        "forward": {"all_gather": {"count": 0, "input_bytes": 0}},
        "backward": {"all_gather": {"count": 0, "input_bytes": 0}, "reduce_scatter": {"count": 0, "input_bytes": 0}},
    }
    if replicate > 1:
        out["backward"]["all_reduce"] = {"count": 0, "input_bytes": 0}
    for g in groups:
        ag = sum(padded_shard_numel(s, world) * itemsize(param_dtype or d) for _, s, d in g.params)
        rs = sum(world * padded_shard_numel(s, world) * itemsize(reduce_dtype or param_dtype or d) for _, s, d in g.params)
        out["forward"]["all_gather"]["count"] += 1
        out["forward"]["all_gather"]["input_bytes"] += ag
        if g.resharded_after_forward:
            out["backward"]["all_gather"]["count"] += 1
            out["backward"]["all_gather"]["input_bytes"] += ag
        out["backward"]["reduce_scatter"]["count"] += 1
        out["backward"]["reduce_scatter"]["input_bytes"] += rs
        if replicate > 1:
            out["backward"]["all_reduce"]["count"] += 1
            out["backward"]["all_reduce"]["input_bytes"] += rs // world
    return out


def per_rank_state_bytes(groups: list[Group], world: int, rank: int) -> dict[str, int]:
    """Sharded parameters, gradients (same dtype) and AdamW state (exp_avg, exp_avg_sq in the
    parameter dtype; the per-parameter ``step`` scalars are left out) held by ``rank``."""
    params = sum(local_numel(s, world, rank) * itemsize(d) for g in groups for _, s, d in g.params)
    return {"params": params, "grads": params, "optimizer": 2 * params}


def unsharded_in_flight_bytes(groups: list[Group], world: int, param_dtype: torch.dtype | None, k: int = 2) -> int:
    """Padded unsharded parameter bytes of the ``k`` largest groups (current + prefetched)."""
    sizes = sorted(
        (world * sum(padded_shard_numel(s, world) * itemsize(param_dtype or d) for _, s, d in g.params) for g in groups),
        reverse=True,
    )
    return sum(sizes[:k])


def quantized_collective_bytes(
    groups: list[Group],
    world: int,
    weight_bits: int | None,
    grad_bits: int | None,
    block: int,
    is_exact: Any,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    replicate: int = 1,
) -> dict[str, Any]:
    """Input bytes per rank of one forward+backward under ``fully_shard.quant``, by phase and collective, as the
    recorder counts them: per group, the quantized elements of a rank's row in blocks of ``block`` (4 scale bytes and
    ``block * bits / 8`` code bytes each, the last block padded) and the elements of the parameters ``is_exact(name)``
    keeps in their dtype. All-gather: one all-gather of that row. Reduce-scatter: one all-to-all of ``world`` rows.
    HSDP (``replicate > 1``): the all-reduce of the shard is an all-to-all of ``replicate`` chunks of its quantized
    part, an all-gather of one chunk and an fp32 all-reduce of its exact elements. ``None`` bits: the exact collective."""

    def row(quant: int, exact: int, bits: int, exact_itemsize: int) -> int:
        return math.ceil(quant / block) * (4 + block * bits // 8) + exact * exact_itemsize

    out: dict[str, Any] = {"forward": {}, "backward": {}}

    def add(phase: str, kind: str, nbytes: int) -> None:
        out[phase][kind] = out[phase].get(kind, 0) + nbytes

    for g in groups:
        quant = sum(padded_shard_numel(s, world) for n, s, _ in g.params if not is_exact(n))
        exact = sum(padded_shard_numel(s, world) for n, s, _ in g.params if is_exact(n))
        pdt, rdt = param_dtype or g.params[0][2], reduce_dtype or param_dtype or g.params[0][2]
        ag = (quant + exact) * itemsize(pdt) if weight_bits is None or not quant else row(quant, exact, weight_bits, itemsize(pdt))
        for phase in ("forward", "backward") if g.resharded_after_forward else ("forward",):
            add(phase, "all_gather", ag)
        if grad_bits is None or not quant:
            add("backward", "reduce_scatter", world * (quant + exact) * itemsize(rdt))
            if replicate > 1:
                add("backward", "all_reduce", (quant + exact) * itemsize(rdt))
            continue
        add("backward", "all_to_all", world * row(quant, exact, grad_bits, itemsize(rdt)))
        if replicate > 1:
            c = math.ceil(quant / replicate)
            add("backward", "all_to_all", replicate * row(c, 0, grad_bits, 0))
            add("backward", "all_gather", row(c, 0, grad_bits, 0))
            if exact:
                add("backward", "all_reduce", exact * 4)
    return out
