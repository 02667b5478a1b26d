"""Which ranks shard and which replicate: validating a DeviceMesh for fully_shard."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass
class MeshInfo:
    """The data-parallel view of a mesh: 1-D (shard only) or 2-D (replicate, shard)."""

    mesh: DeviceMesh
    shard_mesh_dim: int  # mesh dim that parameters are sharded over
    replicate_mesh_dim: int | None  # HSDP: mesh dim that parameters are replicated over

    def __post_init__(self) -> None:
        self.shard_group: dist.ProcessGroup = self.mesh.get_group(self.shard_mesh_dim)
        self.shard_size: int = self.mesh.size(self.shard_mesh_dim)
        self.shard_rank: int = self.mesh.get_local_rank(self.shard_mesh_dim)
        self.replicate_group: dist.ProcessGroup | None = None
        self.replicate_size = 1
        if self.replicate_mesh_dim is not None:
            self.replicate_group = self.mesh.get_group(self.replicate_mesh_dim)
            self.replicate_size = self.mesh.size(self.replicate_mesh_dim)

    @property
    def device(self) -> torch.device:
        return mesh_device(self.mesh.device_type)


def mesh_device(device_type: str) -> torch.device:
    """The current device of ``device_type`` (``cpu``, or the current accelerator index)."""
    if device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, device_type)
    return torch.device(device_type, module.current_device())


def default_mesh() -> DeviceMesh:
    """A 1-D mesh over the default process group on the default device type."""
    if not dist.is_initialized():
        raise RuntimeError(
            "fully_shard needs torch.distributed to be initialised: call "
            "torch.distributed.init_process_group() first, or pass mesh=init_device_mesh(...)"
        )
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    device_type = accelerator.type if accelerator is not None else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def mesh_info_for(mesh: DeviceMesh | None) -> MeshInfo:
    """Validate ``mesh`` for fully_shard and return its data-parallel view."""
    if mesh is None:
        mesh = default_mesh()
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"fully_shard expects mesh to be a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim == 1:
        return MeshInfo(mesh, shard_mesh_dim=0, replicate_mesh_dim=None)
    if mesh.ndim == 2:
        raise NotImplementedError(
            "fully_shard: HSDP (a 2-D (replicate, shard) mesh) is not supported yet; "
            "pass a 1-D mesh"
        )
    raise ValueError(
        f"fully_shard expects a 1-D mesh (FSDP) or a 2-D mesh (HSDP: replicate, shard), got a "
        f"{mesh.ndim}-D mesh with shape {tuple(mesh.shape)} and dim names {mesh.mesh_dim_names}; "
        "pass the data-parallel sub-mesh, e.g. mesh['dp']"
    )
