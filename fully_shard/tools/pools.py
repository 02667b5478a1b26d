"""Communication buffers from a pool: the options ``set_allocate_memory_from_process_group_for_comm`` and
``set_symm_mem_for_comm`` (torch 2.13's controls) set, their checks, and the warning for accelerator tensors carried
over gloo. Off the hot path: the core imports this module only where these are used. It imports no module above it
(``api``, ``state``: their objects are typed ``Any`` here), so the core's lazy imports of it close no import cycle."""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from ..comm import PoolComm
from ..group import GroupOptions, ParamGroup
from ..policy import ShardedUsageError
from ..streams import has_streams


def process_group_pool(module: Any, group: ParamGroup, enable: bool) -> GroupOptions:
    """``set_allocate_memory_from_process_group_for_comm``'s options for ``group``."""
    check_own_comms(module, "set_allocate_memory_from_process_group_for_comm", group, False)
    rs_group = group.options.reduce_scatter_groups.get(id(group.mesh_info), group.mesh_info.shard.group)
    all_gather = PoolComm(group.mesh_info.shard.group) if enable else None
    reduce_scatter = PoolComm(rs_group) if enable else None
    return replace(group.options, all_gather_comm=all_gather, reduce_scatter_comm=reduce_scatter)


def symm_mem_pool(module: Any, group: ParamGroup, backend: str) -> GroupOptions:
    """``set_symm_mem_for_comm``'s options for ``group``."""
    pg, device, o = group.mesh_info.shard.group, group.device, group.options
    found = backend_name(pg, device)
    if found.lower() != backend.lower():
        raise NotImplementedError(f"{type(module).__name__}.set_symm_mem_for_comm({backend!r}): symmetric memory "
                                  f"needs a {backend} process group on an accelerator, but this module has "
                                  f"{found} on {device}. It changes where buffers live, not the results: call "
                                  f"it only when running on {backend}.")
    check_own_comms(module, "set_symm_mem_for_comm", group, True)
    check_symm_buffers(module, o.max_input_buffers, o.force_sum_reduction)
    all_gather, reduce_scatter = PoolComm(pg, backend), o.reduce_scatter_comm
    if o.force_sum_reduction:  # symmetric reduce-scatters only sum (NCCL 2.29), as in torch
        reduce_scatter = PoolComm(o.reduce_scatter_groups.get(id(group.mesh_info), pg), backend)
    return replace(o, all_gather_comm=all_gather, reduce_scatter_comm=reduce_scatter)


def backend_name(pg: dist.ProcessGroup, device: torch.device) -> str:
    """The backend ``pg`` runs ``device``'s tensors with (gloo for a gloo group carrying accelerator tensors), or
    "no accelerator" for a device without streams."""
    return pg._get_backend(device).name() if has_streams(device) else "no accelerator"


def warn_gloo_on_accelerator(pg: dist.ProcessGroup, device: torch.device) -> None:
    """Said at the call, because the crash it foretells leaves no traceback: fully_shard's collectives run on gloo with
    accelerator tensors (gloo copies through the host), torch's functional all-gather does not (pytorch/pytorch#152645:
    no accelerator path in gloo's allgather_into_tensor_coalesced; SIGSEGV on every rank in the first GPU run)."""
    try:
        if backend_name(pg, device) != "gloo":
            return
    except RuntimeError:  # no backend registered for this device (a fake group, as the planner's)
        return
    warnings.warn(f"fully_shard: the mesh's process group carries {device} tensors over gloo. fully_shard trains there "
                  "(gloo copies them through the host, slowly), but DTensor.full_tensor(), "
                  "redistribute(...Replicate()) and full state dicts of these parameters kill the process with SIGSEGV "
                  "and no traceback (torch's gloo, pytorch/pytorch#152645). Use NCCL with one rank per device: "
                  "init_process_group('nccl'), and torchrun --nproc-per-node at most the device count.", stacklevel=3)


def check_own_comms(module: Any, method: str, group: ParamGroup, symmetric: bool) -> None:
    """Refuse to replace a user's Comm (``set_custom_*``) or the other kind of pool, as torch does."""
    for comm in (group.all_gather_comm, group.reduce_scatter_comm):
        if comm is not None and getattr(comm, "symmetric", None) is not symmetric:
            raise ShardedUsageError(f"{type(module).__name__}.{method}: this module's Comm {type(comm).__name__} "
                                    "(set_custom_*, or the other of set_symm_mem_for_comm / set_allocate_memory_...) "
                                    "allocates its buffers itself: call only one of these, as in torch.")


def check_symm_buffers(module: Any, max_input_buffers: int, symmetric: bool) -> None:
    if max_input_buffers > 1 and symmetric:  # torch's rule: the symmetric pool would keep one segment per input
        raise ValueError(f"{type(module).__name__}: set_reduce_scatter_max_input_buffers({max_input_buffers}) is not "
                         "supported with a symmetric-memory reduce-scatter (set_symm_mem_for_comm with force-sum "
                         "reduction), as in torch: keep 1.")
