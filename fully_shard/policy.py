"""User-facing policies (how parameters are cast and where sharded state lives) and the errors for misuse."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy", "DataParallelMeshDims"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for communication and compute, while sharded parameters keep their own.

    Args:
        param_dtype: dtype of the all-gathered (unsharded) parameters used in forward and
            backward. ``None`` keeps each parameter's original dtype.
        reduce_dtype: dtype in which gradients are reduce-scattered. ``None`` means ``param_dtype``.
        output_dtype: dtype to which floating-point forward outputs are cast. ``None`` leaves outputs alone.
        cast_forward_inputs: cast floating-point forward inputs to ``param_dtype``.

    Every field is checked here: a dtype field that is not a ``torch.dtype`` (e.g. the string ``"bfloat16"``) raises
    ``TypeError``, a non-floating dtype ``ValueError``, naming the field.

    Example::

        >>> policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        >>> fully_shard(block, mp_policy=policy)
        FSDPTransformerBlock(...)
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, torch.dtype):
                hint = (f" (torch.{value})" if isinstance(value, str)
                        and isinstance(getattr(torch, value, None), torch.dtype) else "")
                raise TypeError(f"MixedPrecisionPolicy: {name} must be a torch.dtype or None, got "
                                f"{type(value).__name__} {value!r}; pass e.g. torch.bfloat16{hint}")
            if not value.is_floating_point:
                raise ValueError(f"MixedPrecisionPolicy: {name} must be a floating-point dtype, got {value}; "
                                 "e.g. torch.bfloat16, torch.float16 or torch.float32")
        _check_bool(self, "cast_forward_inputs")


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: sharded parameters, gradients and optimizer state stay on the mesh device.

    Example::

        >>> fully_shard(block, offload_policy=OffloadPolicy())  # the default
        FSDPTransformerBlock(...)
    """


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters, their gradients and optimizer state in host memory.

    Args:
        pin_memory: pin the host copies so device transfers are asynchronous (ignored without an accelerator).

    Example::

        >>> fully_shard(block, offload_policy=CPUOffloadPolicy(pin_memory=True))
        FSDPTransformerBlock(...)
    """

    pin_memory: bool = True

    def __post_init__(self) -> None:
        _check_bool(self, "pin_memory")


@dataclass
class DataParallelMeshDims:
    """Which named dims of a full SPMD mesh are data-parallel, for ``fully_shard(..., dp_mesh_dims=)``: parameters are
    then DTensors on that whole mesh, ``Replicate()`` on these dims, and fully_shard shards them over ``shard`` (and
    replicates over ``replicate``, HSDP). A tuple of names is flattened into one dim.

    Example::

        >>> from torch.distributed.tensor import distribute_module
        >>> mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("dp", "tp"))  # e.g. (2, 2)
        >>> block = distribute_module(block, mesh)  # parameters: DTensors on the whole mesh, replicated
        >>> fully_shard(block, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
        FSDPTransformerBlock(...)
        >>> block.attention.wq.weight.placements
        (Shard(dim=0), Replicate())
    """

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError("DataParallelMeshDims needs shard, replicate or both to name a mesh dim")

    @property
    def shard_names(self) -> tuple[str, ...]:
        return _names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        return _names(self.replicate)


def _names(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    return () if value is None else (value,) if isinstance(value, str) else tuple(value)


def _check_bool(policy: object, name: str) -> None:
    value = getattr(policy, name)
    if not isinstance(value, bool):
        raise TypeError(f"{type(policy).__name__}: {name} must be a bool, got {type(value).__name__} {value!r}")


class ShardedUsageError(ValueError, AssertionError):
    """A misuse of ``fully_shard`` (e.g. applying it twice to one module) that torch's FSDP2 reports with
    ``AssertionError``. It is an instance of both, so either ``except`` catches it."""


class ShardedDeepcopyError(RuntimeError, AssertionError):
    """``copy.deepcopy`` of a sharded module, where torch's FSDP2 raises ``AssertionError``. Deep-copy the model
    before ``fully_shard`` instead."""
