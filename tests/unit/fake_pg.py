"""A fake process group in this process: every collective returns at once and moves no data."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore


@contextlib.contextmanager
def fake_world(shape: tuple[int, ...], rank: int = 0, names: tuple[str, ...] | None = None) -> Iterator[DeviceMesh]:
    """This process as ``rank`` of ``prod(shape)`` ranks on a fake process group, and a CPU mesh of ``shape`` over
    them."""
    assert not dist.is_initialized(), "a process group is already initialised in this process"
    world = 1
    for n in shape:
        world *= n
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield init_device_mesh("cpu", shape, mesh_dim_names=names)
    finally:
        dist.destroy_process_group()
