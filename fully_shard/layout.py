"""Where the pieces of one sharded parameter lie: in its tensor, in the collective buffers, on the meshes.

fully_shard shards a parameter's tensor (a tensor-parallel parameter's local tensor) on one dim over the shard ranks of
the data-parallel mesh. The cases it serves differ along two independent axes, so each axis is one small interface with
one class per case, and a ``ShardedParam`` holds one object of each instead of branching on flags:

- ``Layout``: where rank ``r``'s part of the tensor lies and where it sits in the flat collective buffers.
  ``RowLayout`` cuts dim 0 into ``torch.chunk`` rows, every rank's slot padded to ``ceil(rows / N)`` rows;
  ``EvenLayout`` cuts another dim (``shard_placement_fn`` returning ``Shard(d)``), which the ranks must divide evenly,
  so nothing is padded. Pure: no process group (tests/unit/test_layout_props.py checks every world size and shape).
- ``MeshLayout``: which DTensors the optimizer and the module see. ``MeshLayout`` itself serves a plain parameter,
  whose sharded DTensor lives on the data-parallel mesh. ``JoinedMesh`` serves a tensor-parallel DTensor: the sharded
  DTensor lives on the data-parallel mesh joined with the TP mesh (``_StridedShard`` where TP already splits the
  same dim), and the module computes with the TP DTensor. ``SpmdMesh`` serves ``dp_mesh_dims``: the sharded DTensor
  lives on the parameter's own mesh, its data-parallel dims flattened into the shard dim.

The cases combine (a TP parameter on ``Shard(1)``, ``dp_mesh_dims`` on either layout), so one class per combination
would multiply where one per case composes. A local tensor that all-gathers itself (torch's ``fsdp_pre_all_gather`` /
``fsdp_post_all_gather`` extension, ``param.SelfGather``) is a third thing, neither axis: it changes how the tensor
travels through the all-gather, not where a rank's part lies nor which DTensors users see. It composes with every
layout (float8 weights under TP on ``Shard(1)`` are tested) and is decided again at every all-gather, because the
hooks may be patched onto the local tensor after ``fully_shard``; the layouts are fixed by the call.

Torch's FSDP2 keeps all of this in one ``FSDPParam``: a spec-building method per mesh case, and the shard dim and the
extension tested again in each buffer method.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple, cast

import torch
import torch.nn as nn
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from .compat import SpmdAnnotation, restore_spmd_annotation, spmd_annotation
from .mesh import MeshInfo


class ShardLayout(NamedTuple):
    """Where one rank's part of a parameter sharded on dim 0 lies (see :func:`shard_layout`)."""

    chunk_rows: int  # rows of every rank's slot in the flat collective buffers: ceil(rows / world)
    row_start: int  # first row this rank holds
    local_rows: int  # rows this rank holds (the last ranks may hold fewer, or none)
    row_numel: int  # elements per row: the product of the other dims
    world: int  # ranks in the shard dim

    @property
    def local_numel(self) -> int:
        """Elements this rank holds (its sharded parameter, gradient and optimizer state)."""
        return self.local_rows * self.row_numel

    @property
    def slot_numel(self) -> int:
        """Elements of every rank's padded slot in the all-gather / reduce-scatter buffers."""
        return self.chunk_rows * self.row_numel


def shard_layout(shape: Sequence[int], world: int, rank: int) -> ShardLayout:
    """fully_shard's dim-0 layout of a parameter of ``shape`` on ``rank`` of ``world``.

    ``torch.chunk`` semantics: ``c = ceil(rows / world)`` rows per rank; rank ``r`` holds rows
    ``[r*c, min((r+1)*c, rows))`` and every rank's slot in the flat collective buffers is ``c``
    rows (padded). Pure: :class:`RowLayout` lays out with it (public as ``fully_shard.tools.shard_layout``).

    Example::

        >>> shard_layout((10, 4), world=4, rank=3)  # rows 9..9 of slots of 3 rows
        ShardLayout(chunk_rows=3, row_start=9, local_rows=1, row_numel=4, world=4)
        >>> shard_layout((10, 4), 4, 3).local_numel, shard_layout((10, 4), 4, 3).slot_numel
        (4, 12)
    """
    if len(shape) == 0:
        raise ValueError("fully_shard cannot shard a scalar parameter: give it shape (1,)")
    rows = shape[0]
    chunk = math.ceil(rows / world)
    start = min(rank * chunk, rows)
    return ShardLayout(chunk, start, min(start + chunk, rows) - start, math.prod(shape[1:]), world)


class Layout:
    """How a tensor of ``size`` is cut on dim ``dim`` among the ``world`` ranks of the shard dim, seen from ``rank``.

    The flat collective buffers hold ``world`` slots of ``slot_numel`` elements, rank-major; slot ``r`` holds rank
    ``r``'s part (then padding, in a ``RowLayout``). The all-gather fills the flat unsharded buffer with them, the
    reduce-scatter gives each rank its slot of the summed gradients.
    """

    local_shape: torch.Size  # this rank's part
    slot_numel: int  # elements of every rank's slot in the flat buffers (its part, padded)

    def __init__(self, size: Sequence[int], dim: int, world: int, rank: int) -> None:
        self.size, self.dim, self.world, self.rank = torch.Size(size), dim, world, rank

    @property
    def padded_numel(self) -> int:
        """Elements of the flat unsharded buffer: every rank's slot."""
        return self.world * self.slot_numel

    def local_part(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a tensor shaped like the parameter (a view)."""
        return full.chunk(self.world, dim=self.dim)[self.rank]

    def slot_shape(self, shape: torch.Size) -> torch.Size:
        """The slot of a tensor of ``shape`` cut like this rank's part (a self-gathering tensor's all-gather input)."""
        return shape

    def rank_major(self, flat: torch.Tensor, slot: torch.Size) -> torch.Tensor:
        """``flat`` (``world`` slots of shape ``slot``) viewed as ``(world, ...)``, entry ``r`` rank ``r``'s slot in its
        place in the tensor the slots make together (``joined``): where the all-gather's copy-out writes it."""
        d = self.dim
        return flat.view(*slot[:d], self.world, *slot[d:]).movedim(d, 0)

    def joined(self, flat: torch.Tensor, slot: torch.Size) -> torch.Tensor:
        """``flat`` (``world`` slots of shape ``slot``) viewed as the tensor they make side by side on the shard dim."""
        d = self.dim
        n = slot[d] if len(slot) > d else 1  # a 0-dim slot (a self-gathering tensor's scalar input): one per rank
        return flat.view(*slot[:d], self.world * n, *slot[d + 1 :])

    def unsharded(self, flat: torch.Tensor) -> torch.Tensor:
        """The full tensor in a flat unsharded buffer of ``padded_numel`` elements (a view: no padding)."""
        return self.joined(flat, self.slot_shape(self.local_shape))[: self.size[0]]

    def grad_for_reduce(self, grad: torch.Tensor) -> torch.Tensor:
        """A full gradient arranged so that chunk ``r`` of its dim 0 (``torch._chunk_cat``, which zero-pads each chunk
        to the slot) is rank ``r``'s part."""
        return self.rank_major(grad, self.local_shape)


class RowLayout(Layout):
    """Dim 0, ``torch.chunk`` rows (:func:`shard_layout`): rank ``r`` holds rows ``[r*c, min((r+1)*c, rows))`` of the
    ``c = ceil(rows / world)`` of its slot, the last ranks fewer or none; the slots are padded to ``c`` rows."""

    def __init__(self, size: Sequence[int], world: int, rank: int) -> None:
        super().__init__(size, 0, world, rank)
        self.rows = shard_layout(self.size, world, rank)
        self.local_shape = torch.Size((self.rows.local_rows, *self.size[1:]))
        self.slot_numel = self.rows.slot_numel

    def local_part(self, full: torch.Tensor) -> torch.Tensor:
        return full[self.rows.row_start : self.rows.row_start + self.rows.local_rows]

    def slot_shape(self, shape: torch.Size) -> torch.Size:
        """Dim 0 padded to the slot's rows, where it has this rank's rows (a scale per row, say, but not a scalar)."""
        if len(shape) and shape[0] == self.rows.local_rows:
            return torch.Size((self.rows.chunk_rows, *shape[1:]))
        return shape

    def rank_major(self, flat: torch.Tensor, slot: torch.Size) -> torch.Tensor:
        return flat.view(self.world, -1)  # 2-D: the copy-out fills such views in one split_with_sizes_copy

    def grad_for_reduce(self, grad: torch.Tensor) -> torch.Tensor:
        return grad  # its chunks already are the ranks' rows


class EvenLayout(Layout):
    """Dim ``dim`` > 0 (``shard_placement_fn``), which the ranks divide evenly: rank ``r`` holds the ``r``-th of
    ``world`` equal pieces; a slot is exactly a part, so nothing is padded."""

    def __init__(self, size: Sequence[int], dim: int, world: int, rank: int, fqn: str) -> None:
        super().__init__(size, dim, world, rank)
        if self.size[dim] % world:
            raise ValueError(
                f"fully_shard: shard_placement_fn put parameter {fqn!r} of shape {tuple(self.size)} on Shard({dim}), "
                f"which {world} ranks do not divide evenly; only dim 0 may be uneven. Return Shard(0) (or None) for it."
            )
        self.local_shape = torch.Size((*self.size[:dim], self.size[dim] // world, *self.size[dim + 1 :]))
        self.slot_numel = self.local_shape.numel()


def reduced_parts(layouts: Sequence[Layout], flat: torch.Tensor) -> list[torch.Tensor]:
    """Each parameter's part of a reduced ``flat`` (1-D: the slots of ``layouts`` in order, each its part then
    padding), padding dropped."""
    sizes = [n for lay in layouts for n in (lay.local_shape.numel(), lay.slot_numel - lay.local_shape.numel())]
    return list(flat.split_with_sizes(sizes)[::2])


def layout_for(size: Sequence[int], dim: int, world: int, rank: int, fqn: str) -> Layout:
    """The layout of a tensor of ``size`` sharded on ``dim`` (0: rows, padded; else even)."""
    return RowLayout(size, world, rank) if dim == 0 else EvenLayout(size, dim, world, rank, fqn)


class MeshLayout:
    """A plain parameter: its sharded DTensor lives on the data-parallel mesh (``Shard(d)``; HSDP: ``(Replicate(),
    Shard(d))``), and the module computes with a plain tensor."""

    tp_spec: DTensorSpec | None = None  # the parameter's own DTensor layout, where it is one

    def __init__(self, info: MeshInfo) -> None:
        self.info = info

    def sharded_spec(self, dim: int, size: torch.Size, dtype: torch.dtype) -> DTensorSpec:
        """The spec of the sharded DTensor of a parameter of ``size`` (whole) and ``dtype``, sharded on ``dim``."""
        meta = TensorMeta(size, tuple(make_contiguous_strides_for(size)), dtype)
        return DTensorSpec(self.info.mesh, self._dp_placements(Shard(dim)), meta)

    def _dp_placements(self, shard: Placement) -> tuple[Placement, ...]:
        return (shard,) if self.info.replicate is None else (Replicate(), shard)

    def unsharded(self, full: torch.Tensor) -> torch.Tensor:
        """What the module computes with, given the full (TP-local) tensor."""
        return full

    def local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The gradient of what the module computed with, as the plain (TP-local) tensor the reduction takes."""
        return grad

    def annotate(self, unsharded: torch.Tensor) -> None:
        """Mark the tensor the module is about to compute with (only spmd_types parameters carry marks)."""


class JoinedMesh(MeshLayout):
    """A tensor-parallel DTensor parameter, fully_shard on another mesh: its TP-local tensor is sharded; the sharded
    DTensor lives on the data-parallel mesh joined with the TP mesh, and the module computes with the TP DTensor."""

    reduced_dims: tuple[int, ...] = ()  # mesh dims of the parameter's own mesh that fully_shard reduces over

    def __init__(self, info: MeshInfo, tp_spec: DTensorSpec) -> None:
        super().__init__(info)
        self.tp_spec: DTensorSpec = tp_spec

    def sharded_spec(self, dim: int, size: torch.Size, dtype: torch.dtype) -> DTensorSpec:
        ts = self.tp_spec
        split = ts.num_shards_map[dim]  # TP cut this dim into `split` pieces already: FSDP cuts within each piece
        placement = _StridedShard(dim, split_factor=split) if split > 1 else Shard(dim)
        placements = self._dp_placements(placement) + tuple(ts.placements)
        return DTensorSpec(DeviceMesh._concatenate([self.info.mesh, ts.mesh]), placements, ts.tensor_meta)

    def unsharded(self, full: torch.Tensor) -> torch.Tensor:
        return DTensor(full, self.tp_spec, requires_grad=False)

    def local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        if not isinstance(grad, DTensor):
            return grad
        target = list(self.tp_spec.placements)
        for i in self.reduced_dims:  # the data-parallel dims, reduced by fully_shard itself: left as they are
            target[i] = grad.placements[i]
        if tuple(grad.placements) != tuple(target):  # e.g. Partial from sequence parallelism
            grad = grad.redistribute(placements=target)
        return grad._local_tensor


class SpmdMesh(JoinedMesh):
    """``dp_mesh_dims``: the parameter is a DTensor on the whole mesh, replicated on the data-parallel dims; the sharded
    DTensor lives on that mesh with ``Shard`` (``_StridedShard`` where later dims cut the same tensor dim) on the dp
    shard dims; several shard dims are flattened into the data-parallel mesh's one."""

    def __init__(self, info: MeshInfo, param: nn.Parameter, fqn: str) -> None:
        if not isinstance(param, DTensor) or param.device_mesh != info.spmd_mesh:
            raise ValueError(
                f"fully_shard(dp_mesh_dims=...): parameter {fqn!r} must be a DTensor on the mesh passed "
                f"to fully_shard (e.g. from distribute_module / parallelize_module), got "
                f"{'a DTensor on another mesh' if isinstance(param, DTensor) else 'a plain tensor'}"
            )
        for i in info.spmd_shard_dims + info.spmd_replicate_dims:
            if not isinstance(param.placements[i], Replicate):
                names = param.device_mesh.mesh_dim_names or ()
                raise ValueError(
                    f"fully_shard(dp_mesh_dims=...): parameter {fqn!r} has placement {param.placements[i]} on the "
                    f"data-parallel mesh dim {names[i]!r}; it must be Replicate() there"
                )
        super().__init__(info, param._spec)
        self.reduced_dims = info.spmd_shard_dims + info.spmd_replicate_dims

    def sharded_spec(self, dim: int, size: torch.Size, dtype: torch.dtype) -> DTensorSpec:
        info, placement = self.info, Shard(dim)
        assert info.spmd_mesh is not None
        spmd, tp = info.spmd_mesh, self.tp_spec.placements
        placements: list[Placement] = list(tp)
        # the later mesh dims that shard the same tensor dim split it before the dp dim does
        splits = [spmd.size(j) if isinstance(p, (Shard, _StridedShard)) and p.dim == dim else 1
                  for j, p in enumerate(tp)]
        for i in info.spmd_shard_dims:
            split = math.prod(splits[i + 1 :])
            placements[i] = _StridedShard(dim, split_factor=split) if split > 1 else placement
        if len(info.spmd_shard_dims) < 2:
            return DTensorSpec(spmd, tuple(placements), self.tp_spec.tensor_meta)
        # several shard dims: the dp mesh (HSDP: with its replicate dim) stands in for them, at the first
        first, hsdp = info.spmd_shard_dims[0], info.replicate_mesh_dim is not None
        names = cast(tuple[str, ...], spmd.mesh_dim_names)
        dropped = info.spmd_shard_dims[1:] + (info.spmd_replicate_dims if hsdp else ())
        keep = [i for i in range(spmd.ndim) if i not in dropped]
        meshes = [info.mesh if i == first else spmd[names[i]] for i in keep]
        spec = [q for i in keep for q in ((Replicate(), placements[i]) if hsdp and i == first else (placements[i],))]
        return DTensorSpec(DeviceMesh._concatenate(meshes), tuple(spec), self.tp_spec.tensor_meta)


class SpmdTypesMesh(SpmdMesh):
    """``dp_mesh_dims`` with a plain parameter annotated with spmd_types (torch 2.14 and later, ``compat``): it is
    sharded as the DTensor its annotation describes on the whole mesh would be (``SpmdMesh``), but the module computes
    with a plain tensor again, annotated as the parameter was; its plain gradient is read with the placements of the
    backward types (``R`` -> ``Partial``, ``I`` -> ``Replicate``, ``S(d)`` -> ``Shard(d)``) before the reduction."""

    def __init__(self, info: MeshInfo, param: nn.Parameter, annotation: SpmdAnnotation) -> None:
        assert info.spmd_mesh is not None
        self.annotation = annotation
        spec = DTensor.from_local(param.detach(), info.spmd_mesh, annotation.placements, run_check=False)._spec
        JoinedMesh.__init__(self, info, spec)
        self.reduced_dims = info.spmd_shard_dims + info.spmd_replicate_dims
        self._grad_spec = DTensorSpec(info.spmd_mesh, annotation.grad_placements, spec.tensor_meta)

    def unsharded(self, full: torch.Tensor) -> torch.Tensor:
        return full

    def local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        return super().local_grad(DTensor(grad, self._grad_spec, requires_grad=False))

    def annotate(self, unsharded: torch.Tensor) -> None:
        restore_spmd_annotation(unsharded, self.annotation)


def mesh_layout_for(param: nn.Parameter, info: MeshInfo, fqn: str) -> MeshLayout:
    """The mesh layout of ``param`` sharded over ``info``: by ``dp_mesh_dims`` (and spmd_types annotations), by
    whether it is a DTensor."""
    if info.spmd_mesh is not None:
        dp_dims = info.spmd_shard_dims + info.spmd_replicate_dims
        annotation = spmd_annotation(param, info.spmd_mesh, dp_dims, fqn)
        return SpmdMesh(info, param, fqn) if annotation is None else SpmdTypesMesh(info, param, annotation)
    return JoinedMesh(info, param._spec) if isinstance(param, DTensor) else MeshLayout(info)
