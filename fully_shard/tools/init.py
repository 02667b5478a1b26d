"""Materialising sharded models: world-size-invariant initialisation and rank-0 loading.

Both work one module (or one tensor) at a time, so no rank ever holds more than that much
of the model unsharded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm
from ..param import ShardedParam
from ..state import STATE_ATTR, FSDPState

__all__ = ["materialize", "broadcast_full_state_dict"]


def _sharded_params(model: nn.Module) -> dict[int, ShardedParam]:
    """id(sharded parameter) -> its ShardedParam, for every group under ``model``."""
    states: list[FSDPState | None] = [getattr(m, STATE_ATTR, None) for m in model.modules()]
    return {id(p.sharded_param): p for s in states if s is not None and s.group is not None for p in s.group.params}


def materialize(
    model: nn.Module,
    *,
    device: torch.device | str | None = None,
    seed: int | None = None,
    init_fn: Callable[[nn.Module], None] | None = None,
) -> None:
    """Allocate a meta-device model sharded by ``fully_shard`` and initialise it so that the
    result does not depend on the world size or mesh.

    ``model.to_empty(device)`` gives every tensor storage; then, with the global RNG seeded
    identically on every rank (``seed``), each module in ``model.modules()`` order is
    initialised on full-size temporaries of its own parameters (``init_fn(module)``, by
    default ``module.reset_parameters()`` where defined), and each rank keeps its shard.
    Every rank draws the same numbers in the same order as an unsharded copy of the model
    initialised the same way, so the full tensors equal that copy's for any world size: for
    models whose parameters are all drawn by their own module's ``reset_parameters`` in
    construction order (``nn.Linear``, ``nn.Embedding``, ...), they equal ``Model()`` built
    under ``torch.manual_seed(seed)``. Peak extra memory: one module's direct parameters.

    Modules initialise only their own (direct) parameters and buffers, as
    ``reset_parameters`` does; a module without one (and no ``init_fn``) is left as
    ``to_empty`` left it. Tensor-parallel (DTensor) parameters are not supported here.

    Example::

        >>> with torch.device("meta"):
        ...     model = Transformer(args)
        >>> for block in model.layers:
        ...     fully_shard(block)
        FSDPTransformerBlock(...)
        FSDPTransformerBlock(...)
        >>> fully_shard(model)
        FSDPTransformer(...)
        >>> materialize(model, device=torch.accelerator.current_accelerator() or "cpu", seed=0)
        >>> model.output.weight.is_meta, model(tokens).shape
        (False, torch.Size([2, 8, 32]))
    """
    sharded = _sharded_params(model)
    if device is None:
        device = next(iter(sharded.values())).device if sharded else torch.device("cpu")
    model.to_empty(device=device)
    if seed is not None:
        torch.manual_seed(seed)
    for module in model.modules():
        reset: Any = getattr(module, "reset_parameters", None)
        if init_fn is not None or callable(reset):
            with torch.no_grad():
                _init_on_full(module, init_fn or (lambda m: reset()), sharded)


def _init_on_full(module: nn.Module, fn: Callable[[nn.Module], None], sharded: dict[int, ShardedParam]) -> None:
    """Run ``fn(module)`` with full-size temporaries in place of its sharded parameters."""
    swapped: list[tuple[str, ShardedParam]] = []
    for name, p in module._parameters.items():
        sp = sharded.get(id(p))
        if sp is None or sp.sharded_param is not p:
            continue
        if sp.mesh_layout.tp_spec is not None:
            raise NotImplementedError(
                f"materialize() cannot initialise the tensor-parallel parameter {sp.fqn!r}; "
                "initialise it with DTensor operations after model.to_empty()"
            )
        full = torch.empty(sp.size, dtype=sp.dtype, device=sp.device)
        module._parameters[name] = nn.Parameter(full, requires_grad=p.requires_grad)
        swapped.append((name, sp))
    try:
        fn(module)
        for name, sp in swapped:
            sp.local_shard.copy_(sp.layout.local_part(module._parameters[name]))  # type: ignore[arg-type]
    finally:
        for name, sp in swapped:
            module._parameters[name] = sp.sharded_param


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's state-dict entries as the registered objects, each tensor once."""
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            yield name, tensor


def broadcast_full_state_dict(
    model: nn.Module,
    full_state_dict: Mapping[str, torch.Tensor] | None,
    *,
    src: int = 0,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Load full (unsharded) weights held by rank ``src`` alone into a sharded model.

    Rank ``src`` passes the state dict of the unsharded model (e.g. ``torch.load`` of a
    pretrained checkpoint, on the CPU); the other ranks pass ``None``. Each tensor is
    broadcast in turn and every rank keeps its shard, so no rank holds more than one full
    tensor beyond its shards (accelerate's ``cpu_ram_efficient_loading``). Works on a
    meta-device model after ``model.to_empty(...)``.

    Example::

        >>> torch.save(Transformer(args).state_dict(), "llama.pt")  # a full checkpoint, on rank 0's disk
        >>> sharded = [fully_shard(m) for m in (*model.layers, model)]  # each block, then the root
        >>> sd = torch.load("llama.pt") if dist.get_rank() == 0 else None
        >>> broadcast_full_state_dict(model, sd)
        >>> torch.equal(model.output.weight.full_tensor(), torch.load("llama.pt")["output.weight"])
        True
    """
    rank = dist.get_rank()
    if rank == src and full_state_dict is None:
        raise ValueError(f"broadcast_full_state_dict: rank {src} (src) must pass the full state dict")
    sharded = _sharded_params(model)
    if rank == src:
        missing = [n for n, _ in _named_tensors(model) if n not in full_state_dict]  # type: ignore[operator]
        if missing:
            raise KeyError(f"broadcast_full_state_dict: the state dict has no entry for {missing[:5]}")
    with torch.no_grad():
        for name, tensor in _named_tensors(model):
            sp = sharded.get(id(tensor))
            # a sharded parameter goes through a full temporary, anything else in place
            target = tensor.data if sp is None else torch.empty(sp.size, dtype=sp.dtype, device=sp.device)
            if rank == src:
                target.copy_(full_state_dict[name])  # type: ignore[index]
            comm.broadcast(target, src, group)
            if sp is not None:
                sp.local_shard.copy_(sp.layout.local_part(target))
            del target  # the full temporary, before the next one is allocated
