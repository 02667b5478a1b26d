"""Which ranks shard and which replicate: validating a DeviceMesh for fully_shard."""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .comm import Ranks
from .policy import DataParallelMeshDims


@dataclass
class MeshInfo:
    """The data-parallel view of a mesh: 1-D (shard only) or 2-D (replicate, shard)."""

    mesh: DeviceMesh
    shard_mesh_dim: int | None  # mesh dim that parameters are sharded over; None: DDP (nothing sharded)
    replicate_mesh_dim: int | None  # HSDP (and DDP): mesh dim that parameters are replicated over
    # dp_mesh_dims: the full SPMD mesh the parameters live on, and where its dp dims are in it
    spmd_mesh: DeviceMesh | None = None
    spmd_shard_dims: tuple[int, ...] = ()  # flattened into this mesh's shard dim
    spmd_replicate_dims: tuple[int, ...] = ()  # flattened into its replicate dim

    def __post_init__(self) -> None:
        # DDP: each rank's shard is the whole parameter, so no collective uses this group
        ddp, dim = self.shard_mesh_dim is None, self.shard_mesh_dim
        self.shard = Ranks(self.mesh.get_group(self.replicate_mesh_dim), 1, 0) if ddp else _ranks(self.mesh, dim)
        self.replicate = None if self.replicate_mesh_dim is None else _ranks(self.mesh, self.replicate_mesh_dim)

    @property
    def device(self) -> torch.device:
        """The current device of the mesh's type (``cpu``, or the current accelerator index)."""
        device_type = self.mesh.device_type
        if device_type == "cpu":
            return torch.device("cpu")
        return torch.device(device_type, getattr(torch, device_type).current_device())


def _ranks(mesh: DeviceMesh, dim: Any) -> Ranks:
    return Ranks(mesh.get_group(dim), mesh.size(dim), mesh.get_local_rank(dim))


def default_mesh() -> DeviceMesh:
    """A 1-D mesh over the default process group on the default device type."""
    if not dist.is_initialized():
        raise RuntimeError("fully_shard needs torch.distributed to be initialised: call "
                           "torch.distributed.init_process_group() first, or pass mesh=init_device_mesh(...)")
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    device_type = accelerator.type if accelerator is not None else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


# dim names that mean model parallelism: passing such a mesh as the data-parallel one is a mistake
_MODEL_PARALLEL_DIM_NAMES = ("tp", "cp", "ep", "pp", "tensor", "context", "expert", "pipeline")


def reshard_setting(value: bool | int | None, n: int, where: str = "") -> bool | int | None:
    """``reshard_after_forward`` as torch reads it, for a shard group of ``n`` ranks. ``None`` and a bool stay as
    given. An int ``k`` must divide ``n``. ``n`` means True (reshard to the whole group); 1 means False (keep the full
    parameters, with a warning, as 1 reads like True); any other ``k`` stays ``k``. Pure: the planner reads it too.

    Example::

        >>> reshard_setting(8, 8), reshard_setting(2, 8)
        (True, 2)
    """
    if value is None or isinstance(value, bool):
        return value
    if not (1 <= value <= n and n % value == 0):
        raise ValueError(f"reshard_after_forward={value} must be a divisor of the shard group size {n}{where} "
                         f"(e.g. the number of ranks per node; {n} means True, 1 means False); or pass True or False")
    if value == 1:
        warnings.warn("reshard_after_forward=1 (int) reshards to groups of 1 rank, which keeps the full parameters "
                      "after forward like reshard_after_forward=False; pass True to free them", stacklevel=4)
        return False
    return True if value == n else value


def resolve_reshard_after_forward(
    value: bool | int | None, info: MeshInfo, params: list[tuple[str, MeshInfo]]
) -> tuple[bool | None, dict[int, Ranks]]:
    """Resolve ``reshard_after_forward`` once. Returns whether to reshard after forward (``None`` is decided at lazy
    init) and, for an int ``k`` (see :func:`reshard_setting`), the ``k``-rank groups by mesh: for each mesh of the
    call's ``(fqn, mesh)`` ``params``, keyed by ``id``, the k consecutive ranks of its shard dim that hold the
    parameters between forward and backward, this rank among them. A mesh where ``k`` is the whole shard dim has none
    (resharded as with True). ``k`` must divide every mesh's shard dim."""
    if info.shard_mesh_dim is None:
        return False, {}  # DDP: nothing to reshard to; the full parameters stay, as in torch
    setting = reshard_setting(value, info.shard.size)
    if setting is None or isinstance(setting, bool) and (setting is False or type(value) is bool):
        return setting, {}
    keep: dict[int, Ranks] = {}
    for fqn, other in params:
        k = setting if other is info else reshard_setting(value, other.shard.size,
                                                          f" of the mesh shard_placement_fn gave {fqn!r}")
        if type(k) is int and id(other) not in keep:
            if other.spmd_mesh is not None:
                raise NotImplementedError("reshard_after_forward=<int> is not supported with dp_mesh_dims; pass True "
                                          "or False")
            keep[id(other)] = _post_forward_info(other, k)
    return True, keep


# reshard_after_forward=k's groups per world, by (ranks of every copy of the shard dim, k): weakly keyed by the default
# process group, so that destroy_process_group() drops them and a new world makes its own (docs/design.md)
_k_rank_groups: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple[Any, ...], Ranks]] = weakref.WeakKeyDictionary()


def _post_forward_info(info: MeshInfo, k: int) -> Ranks:
    """This rank's k-rank group. Once per world and key (torch makes a set per call, an NCCL communicator each:
    pytorch/pytorch#147179), every rank creates every group, in the same order, as ``new_group`` requires; the key is
    the same on every rank, whichever copy of a sub-mesh it holds, so all make or reuse the groups together."""
    n = info.shard.size
    # a row per shard group, of every copy of a sub-mesh (``.mesh`` holds this rank's copy only)
    rows = info.mesh._layout.remap_to_tensor(info.mesh._rank_map).reshape(-1, n).tolist()
    made, key = _k_rank_groups.setdefault(dist.distributed_c10d._get_default_group(), {}), (str(rows), k)
    if key not in made:
        me, complement = dist.get_rank(), None
        for row in rows:  # the ranks at one index of every k-rank group: the traced path's first gather
            for index in range(k):
                members = row[index::k]
                group = dist.new_group(members)
                if me in members:
                    complement = Ranks(group, len(members), members.index(me))
        for row in rows:
            for start in range(0, n, k):
                members = row[start : start + k]
                group = dist.new_group(members)
                if me in members:
                    made[key] = Ranks(group, k, members.index(me), complement)
        assert key in made, f"rank {me} is not in the mesh {rows}"
    return made[key]


def separate_group(info: MeshInfo, made: dict[tuple[int, ...], dist.ProcessGroup],
                   current: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """A process group of the shard ranks for reduce-scatters alone: one per set of ranks in
    ``made`` (one ``set_separate_reduce_scatter_group`` call), reusing the group's ``current`` one."""
    ranks = tuple(dist.get_process_group_ranks(info.shard.group))
    if ranks not in made:
        made[ranks] = current if current is not None else dist.new_group(list(ranks), use_local_synchronization=True)
    return made[ranks]


def mesh_info_for(mesh: DeviceMesh | None, dp_mesh_dims: DataParallelMeshDims | None = None) -> MeshInfo:
    """Validate ``mesh`` for fully_shard and return its data-parallel view."""
    if mesh is None:
        mesh = default_mesh()
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"fully_shard expects mesh to be a DeviceMesh, got {type(mesh).__name__}")
    if dp_mesh_dims is not None:
        return _spmd_mesh_info(mesh, dp_mesh_dims)
    if mesh.ndim == 1:
        return MeshInfo(mesh, shard_mesh_dim=0, replicate_mesh_dim=None)
    if mesh.ndim == 2:
        names = mesh.mesh_dim_names or ()
        model_parallel = [n for n in names if n in _MODEL_PARALLEL_DIM_NAMES]
        if model_parallel:
            raise ValueError("fully_shard reads a 2-D mesh as HSDP (replicate, shard), but this mesh's dims are named "
                             f"{names} and {model_parallel[0]!r} is not a data-parallel dim. Pass the data-parallel "
                             "part, e.g. mesh['dp'] (FSDP) or mesh['dp_replicate', 'dp_shard'] (HSDP)")
        return MeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
    raise ValueError("fully_shard expects a 1-D mesh (FSDP) or a 2-D mesh (HSDP: replicate, shard), got a "
                     f"{mesh.ndim}-D mesh with shape {tuple(mesh.shape)} and dim names {mesh.mesh_dim_names}; pass the "
                     "data-parallel sub-mesh, e.g. mesh['dp']")


def mesh_info_of(obj: Any, fqn: str, made: list[MeshInfo]) -> MeshInfo:
    """The mesh a ``ShardPlacementResult`` gives parameter ``fqn``: torch's ``FSDPMeshInfo`` /
    ``HSDPMeshInfo`` (built with or without ``dp_mesh_dims``), a ``DeviceMesh``, or anything with
    a ``mesh``. Meshes with the same process groups (as torch groups them) share one of ``made``."""
    dims = getattr(obj, "dp_mesh_dims", None)
    mesh = obj if isinstance(obj, DeviceMesh) else getattr(obj, "mesh" if dims is None else "spmd_mesh", None)
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"shard_placement_fn gave parameter {fqn!r} a ShardPlacementResult whose mesh_info "
                         f"({type(obj).__name__}) holds no DeviceMesh: pass torch's FSDPMeshInfo or a DeviceMesh")
    info = mesh_info_for(mesh, dims)
    keys = [(i.shard_mesh_dim, i.shard.group, i.replicate and i.replicate.group, i.spmd_mesh) for i in (*made, info)]
    same = [m for m, k in zip(made, keys) if k == keys[-1]]
    made += [] if same else [info]
    return same[0] if same else info


def _spmd_mesh_info(mesh: DeviceMesh, dims: Any) -> MeshInfo:
    """``dp_mesh_dims``: the data-parallel sub-mesh of a full SPMD mesh, remembering where its
    dims sit in the full mesh (the sharded DTensors live on the full mesh)."""
    if not isinstance(dims, DataParallelMeshDims):
        if not (hasattr(dims, "shard") and hasattr(dims, "replicate")):
            raise ValueError(f"dp_mesh_dims must be a DataParallelMeshDims, got {type(dims).__name__}")
        # torch's own DataParallelMeshDims (the same two fields), as torchtitan passes it
        dims = DataParallelMeshDims(shard=dims.shard, replicate=dims.replicate)
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError("dp_mesh_dims names mesh dims, but this mesh has no mesh_dim_names: build it with "
                         "init_device_mesh(..., mesh_dim_names=...)")
    for name in dims.shard_names + dims.replicate_names:
        if name not in names:
            raise ValueError(f"dp_mesh_dims names the mesh dim {name!r}, which is not one of this mesh's dims {names}")
    shard, rep = (tuple(names.index(n) for n in role) for role in (dims.shard_names, dims.replicate_names))
    if shard and shard != tuple(range(shard[0], shard[0] + len(shard))):
        raise ValueError(f"dp_mesh_dims: the shard dims {dims.shard_names} must be adjacent dims of the mesh {names}, "
                         "in its order, to be flattened into one (as torch's FSDP2 requires too)")

    def flat(role: tuple[str, ...]) -> DeviceMesh:  # several dims are flattened into one, as torch does
        return mesh[role[0]] if len(role) == 1 else mesh[role]._flatten("_".join(role))

    dp = [flat(role) for role in (dims.replicate_names, dims.shard_names) if role]
    dp_mesh = dp[0] if len(dp) == 1 else DeviceMesh._concatenate(dp)
    return MeshInfo(dp_mesh, len(dp) - 1 if shard else None, 0 if rep else None, mesh, shard, rep)
