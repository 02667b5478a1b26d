"""One parameter: its sharded DTensor, and the unsharded buffer it is gathered into."""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from typing import Any, NamedTuple, cast

import torch
import torch.nn as nn
from torch._prims_common import make_contiguous_strides_for
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from .mesh import MeshInfo
from .policy import MixedPrecisionPolicy

# on an original parameter and its sharded replacement: the fully_shard call owning them (``ShardedParam.owner``)
OWNER_ATTR = "_fully_shard_owner"


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
    rows (padded). Pure: :class:`ShardedParam` and the memory planner both lay out with it.

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


def param_dtypes(dtype: torch.dtype, mp_policy: MixedPrecisionPolicy) -> tuple[torch.dtype, torch.dtype]:
    """``(unsharded dtype, reduce dtype)`` of a parameter stored in ``dtype``: all-gather and compute (``param_dtype``
    casts floating-point parameters only); gradient reduction (``reduce_dtype``, else the unsharded dtype).

    Example::

        >>> param_dtypes(torch.float32, MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        (torch.bfloat16, torch.bfloat16)
    """
    unsharded = (mp_policy.param_dtype if dtype.is_floating_point else None) or dtype
    return unsharded, mp_policy.reduce_dtype or unsharded


def _contiguous_stride(size: torch.Size) -> tuple[int, ...]:
    return tuple(make_contiguous_strides_for(size))


class ShardedParam:
    """A parameter sharded over the shard dim of the mesh, on tensor dim ``shard_dim``.

    Dim 0 is laid out by :func:`shard_layout` (the unsharded buffer: ``N`` padded slots of ``c`` rows, the first ``n``
    rows the parameter); other dims (``shard_placement_fn``) must divide evenly. A DTensor (TP) parameter is sharded on
    its local tensor; its sharded DTensor lives on the joined dp and TP mesh, its unsharded one is the TP DTensor.
    """

    def __init__(
        self, param: nn.Parameter, fqn: str, uses: list[tuple[nn.Module, str]], mesh_info: MeshInfo, device: torch.device,
        mp_policy: MixedPrecisionPolicy, offload: bool, pin_memory: bool, shard_dim: int = 0,
    ) -> None:
        if param.dim() == 0:
            raise ValueError(f"fully_shard cannot shard the scalar parameter {fqn!r}: give it shape (1,) or pass it in ignored_params")
        self.local_fqn = fqn  # relative to the module(s) given to fully_shard
        self.fqn = fqn  # relative to the root, once lazy init knows it
        self.uses = uses  # every (module, attribute name) that registers this parameter
        self.mesh_info = mesh_info
        self.device = device
        self.mp_policy = mp_policy
        self._set_dtypes(param.dtype)
        # offloading keeps the sharded parameter (and so its grad and optimizer state) on the CPU
        self.shard_device = torch.device("cpu") if offload else device
        self.offload = offload
        self.pin_memory = offload and pin_memory  # as asked: shards kept pinned, gradients come back without blocking

        self.tp_spec: DTensorSpec | None = param._spec if isinstance(param, DTensor) else None
        if mesh_info.spmd_mesh is not None:
            _check_spmd_param(param, fqn, mesh_info)
        data = param._local_tensor if isinstance(param, DTensor) else param
        self.size = data.shape  # of the (TP-local) tensor that is gathered
        if shard_dim < 0:
            shard_dim += data.dim()
        self._ext_meta: Any = None  # fsdp_pre_all_gather's metadata, until post-all-gather
        self._ext_sizes: list[torch.Size] = []  # all-gather inputs' shapes, dim 0 padded
        self._ext_dtypes: list[torch.dtype] = []
        self._ext_outputs: list[torch.Tensor] | None = None  # 1-D, N slots each; freed when sharded
        self._ext_inner: list[torch.Tensor] = []  # the subclass's tensors that hold the gathered data
        world, rank = mesh_info.shard.size, mesh_info.shard.rank
        self.shard_dim = shard_dim
        if shard_dim > 0 and self.size[shard_dim] % world:
            raise ValueError(
                f"fully_shard: shard_placement_fn put parameter {fqn!r} of shape {tuple(self.size)} on Shard({shard_dim}), "
                f"which {world} ranks do not divide evenly; only dim 0 may be uneven. Return Shard(0) (or None) for it."
            )
        self.padded_shape = tuple(self.size)
        if shard_dim == 0:
            layout = shard_layout(self.size, world, rank)
            self.chunk_rows, self.row_start, self.local_rows = layout.chunk_rows, layout.row_start, layout.local_rows
            self.padded_shape = (world * self.chunk_rows, *self.size[1:])
        src = self.local_part(data.detach())
        self.local_shape = src.shape
        self.shard_numel = layout.slot_numel if shard_dim == 0 else src.numel()  # every rank's slot, dim 0 padded

        target = torch.device("meta") if param.is_meta else self.shard_device
        pin = target.type == "cpu" and self._pins()
        if _is_subclass(data):  # keeps its type in the shard: its own ops (slice, clone) make it
            local = src.to(target).clone()
            if type(local) is not type(data):
                raise NotImplementedError(
                    f"fully_shard: parameter {fqn!r} is a {type(data).__name__}, but slicing and "
                    f"cloning it gives a {type(local).__name__}: the subclass must keep its type "
                    "under aten.slice and aten.clone to be sharded. Keep it out with ignored_params."
                )
        else:
            local = torch.empty(src.shape, dtype=self.dtype, device=target, pin_memory=pin)  # this rank's part
            if not param.is_meta:
                local.copy_(src)
        self._spec = self._sharded_spec(param)
        self.sharded_param = nn.Parameter(self.to_sharded_dtensor(local), requires_grad=param.requires_grad)
        # whether the local tensor gathers itself (torch's fsdp_pre/post_all_gather contract): decided at the call, then
        # again at every all-gather (refresh_extension), since hooks may be patched onto the local tensor later
        self.extension = _has_hooks(local, fqn)
        self._padded_unsharded: torch.Tensor | None = None  # 1-D, N slots; storage freed when sharded
        self._gather_out: torch.Tensor | None = None  # (N, ...) view of it that the all-gather's copy-out fills
        self._flat: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)  # (local shard, its 1-D view)
        self.unsharded_param: nn.Parameter | None = None  # the parameter the module computes with
        self.accumulated_grad: torch.Tensor | None = None  # unsharded, while gradient sync is off
        self.post_forward_slice: torch.Tensor | None = None  # 1-D, this rank's 1/k of the padded param
        self._unsharded_version = 0  # the unsharded parameter's version counter after its copy-out
        self.owner: object = None  # the fully_shard call that owns it (api's ``_Owner``)

    def set_owner(self, owner: object) -> None:
        """Record the owner on the sharded parameter too (again when that is replaced or swapped: ``refresh_after_apply``)."""
        self.owner = owner
        self.sharded_param.__dict__[OWNER_ATTR] = owner

    def _pins(self) -> bool:
        """Whether offloaded shards are kept in pinned host memory: if asked, and an accelerator can pin."""
        return self.pin_memory and torch.accelerator.is_available()

    def _set_dtypes(self, dtype: torch.dtype) -> None:
        self.dtype = dtype  # of the sharded parameter, its gradient and optimizer state
        self.unsharded_dtype, self.reduce_dtype = param_dtypes(dtype, self.mp_policy)  # all-gather and compute; reduce-scatter

    def refresh_after_apply(self) -> None:
        """After ``to_empty()`` / ``to()`` / ``.double()``: keep offloaded shards on the CPU, and follow a new dtype."""
        local = self.local_shard
        kept = local if local.is_meta else local.to(self.shard_device)
        # a new host tensor (to_empty(device="cpu")) is pinned again; a subclass's shard is never pinned
        if not kept.is_meta and self._pins() and not _is_subclass(kept) and not kept.is_pinned():
            kept = kept.pin_memory()
        if kept is not local:
            moved = nn.Parameter(self.to_sharded_dtensor(kept), requires_grad=self.sharded_param.requires_grad)
            torch.utils.swap_tensors(self.sharded_param, moved)
        self.set_owner(self.owner)  # Module._apply swaps DTensor parameters, attributes too
        dtype = self.local_shard.dtype
        if dtype == self.dtype:
            return
        self._set_dtypes(dtype)
        meta = self._spec.tensor_meta
        assert meta is not None
        self._spec = DTensorSpec(self._spec.mesh, self._spec.placements, TensorMeta(meta.shape, meta.stride, dtype))
        self._padded_unsharded = self._gather_out = None  # reallocated in the new dtype at the next all-gather
        self.unsharded_param = None

    def _sharded_spec(self, param: nn.Parameter) -> DTensorSpec:
        info = self.mesh_info
        placement: Placement = Shard(self.shard_dim)
        if info.spmd_mesh is not None:  # dp_mesh_dims: Shard the dp dims of the parameter's own mesh
            assert self.tp_spec is not None
            spmd, tp = info.spmd_mesh, self.tp_spec.placements
            placements = list(tp)
            # the later mesh dims that shard the same tensor dim split it before the dp dim does
            splits = [spmd.size(j) if isinstance(p, (Shard, _StridedShard)) and p.dim == self.shard_dim else 1 for j, p in enumerate(tp)]
            for i in info.spmd_shard_dims:
                split = math.prod(splits[i + 1 :])
                placements[i] = _StridedShard(self.shard_dim, split_factor=split) if split > 1 else placement
            if len(info.spmd_shard_dims) < 2:
                return DTensorSpec(spmd, tuple(placements), self.tp_spec.tensor_meta)
            # several shard dims: the dp mesh (HSDP: with its replicate dim) stands in for them, at the first
            first, hsdp, names = info.spmd_shard_dims[0], info.replicate_mesh_dim is not None, cast(tuple[str, ...], spmd.mesh_dim_names)
            keep = [i for i in range(spmd.ndim) if i not in info.spmd_shard_dims[1:] + (info.spmd_replicate_dims if hsdp else ())]
            meshes = [info.mesh if i == first else spmd[names[i]] for i in keep]
            spec = [q for i in keep for q in ((Replicate(), placements[i]) if hsdp and i == first else (placements[i],))]
            return DTensorSpec(DeviceMesh._concatenate(meshes), tuple(spec), self.tp_spec.tensor_meta)
        ts = self.tp_spec
        split = 1 if ts is None else ts.num_shards_map[self.shard_dim]
        if split > 1:  # TP shards this dim into `split` pieces already: FSDP shards within each piece
            placement = _StridedShard(self.shard_dim, split_factor=split)
        dp = (placement,) if info.replicate is None else (Replicate(), placement)
        if ts is None:
            return DTensorSpec(info.mesh, dp, TensorMeta(param.shape, _contiguous_stride(param.shape), self.dtype))
        return DTensorSpec(DeviceMesh._concatenate([info.mesh, ts.mesh]), dp + tuple(ts.placements), ts.tensor_meta)

    # -- sharded side ------------------------------------------------------------

    @property
    def local_shard(self) -> torch.Tensor:
        """This rank's part (read afresh: ``to_empty``/``load_state_dict`` may swap it)."""
        return self.sharded_param._local_tensor  # type: ignore[attr-defined, no-any-return]

    def flat_shard(self) -> torch.Tensor:
        """This rank's part, 1-D: the all-gather input (the view is cached while the local tensor is the same object)."""
        local = self.local_shard
        if self._flat[0] is not local:
            self._flat = (local, local.view(-1) if local.is_contiguous() else None)
        return self._flat[1] if self._flat[1] is not None else local.reshape(-1)

    def all_gather_input(self) -> torch.Tensor:
        """This rank's part, 1-D, on the compute device. An offloaded shard is moved there in its own dtype without
        blocking (from pinned memory: an asynchronous copy on the current stream), so that the cast to the all-gather
        dtype runs on the device: a blocking copy that casts would cast on the host into a new pageable tensor, then
        copy that and wait for the device, once per parameter."""
        flat = self.flat_shard()
        return flat.to(self.device, non_blocking=True) if self.offload else flat

    def local_part(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full (TP-local) tensor shaped like the parameter."""
        if self.shard_dim == 0:
            return full[self.row_start : self.row_start + self.local_rows]
        return full.chunk(self.mesh_info.shard.size, dim=self.shard_dim)[self.mesh_info.shard.rank]

    def full_to_sharded(self, full: torch.Tensor, key: str) -> DTensor:
        """A full tensor loaded into this parameter, as this rank's shard (a DTensor)."""
        if self.tp_spec is not None:
            raise ValueError(
                f"load_state_dict: {key!r} is a tensor-parallel parameter; load it as a DTensor "
                "(e.g. through torch.distributed.checkpoint), not as a full tensor"
            )
        if full.shape != self.size:
            raise ValueError(f"load_state_dict: {key!r} has shape {tuple(full.shape)}, the parameter {tuple(self.size)}")
        local = self.local_part(full).to(device=self.local_shard.device, dtype=self.dtype)
        return self.to_sharded_dtensor(local.contiguous())

    def adopt(self, param: DTensor, what: str = "load_state_dict(assign=True)") -> None:
        """``what`` (``load_state_dict(assign=True)``) registered ``param``: make it the sharded one."""
        if param.placements != self._spec.placements or param.shape != self.sharded_param.shape:
            raise ValueError(
                f"{what}: {self.fqn!r} got a DTensor with placements {param.placements} and shape {tuple(param.shape)}; "
                f"fully_shard laid it out as {self._spec.placements} with shape {tuple(self.sharded_param.shape)}"
            )
        new = param if isinstance(param, nn.Parameter) else nn.Parameter(param, requires_grad=self.sharded_param.requires_grad)
        self.sharded_param = new
        self.register(unsharded=False)
        self.refresh_after_apply()

    def pick_up_replacement(self, managed: set[int]) -> None:
        """Shard a parameter registered in place of the sharded one before the first forward (e.g. ``model.w =
        nn.Parameter(f(a.weight, b.weight))`` once ``a`` and ``b`` are materialised), as torch's FSDP2 does at lazy
        init: a DTensor with the parameter's layout is taken as is, a full tensor of its shape is cut to this rank's part."""
        module, name = self.uses[0]
        current = module._parameters.get(name)
        if current is None or current is self.sharded_param or current is self.unsharded_param:
            return  # not replaced (unsharded: an explicit unshard() before the first forward)
        if id(current) in managed:
            return  # another sharded parameter (a tie made after sharding): refused later
        fits = current.shape == self.size and (
            current.placements == self._spec.placements if isinstance(current, DTensor) else self.tp_spec is None
        )
        if not fits:
            return  # refused, naming it, by the root's check of the registered parameters
        if not isinstance(current, DTensor):
            local = self.local_part(current.detach()).to(device=self.shard_device, dtype=self.dtype)
            current = nn.Parameter(self.to_sharded_dtensor(local.contiguous()), requires_grad=current.requires_grad)
        self.adopt(current, "replacing a sharded parameter before the first forward")  # type: ignore[arg-type]

    def to_sharded_dtensor(self, local: torch.Tensor) -> DTensor:
        """Wrap a tensor shaped like this rank's part as a DTensor laid out like the parameter
        (``__new__`` makes it whole; ``__init__`` adds an export wrapper costing as much again)."""
        return DTensor.__new__(DTensor, local, self._spec, requires_grad=False)

    def check_materialized(self) -> None:
        if self.local_shard.is_meta:
            raise RuntimeError(
                f"parameter {self.fqn!r} is still on the meta device at the first forward: call model.to_empty(device=...) "
                "and initialise the parameters (e.g. model.reset_parameters()) after fully_shard and before running forward"
            )

    # -- unsharded side ------------------------------------------------------------

    @property
    def unsharded_numel(self) -> int:
        """Elements of the padded unsharded buffer: world size x padded per-rank slot."""
        return self.shard_numel * self.mesh_info.shard.size

    def alloc_unsharded(self) -> None:
        """Give the unsharded buffer its storage back (allocated on first use)."""
        if self._padded_unsharded is not None:
            assert self.unsharded_param is not None
            _alloc_storage(self._padded_unsharded)
            self.unsharded_param.requires_grad_(self.sharded_param.requires_grad)
            return
        self._padded_unsharded = torch.empty(self.unsharded_numel, dtype=self.unsharded_dtype, device=self.device)
        self._gather_out = None
        data = self._padded_unsharded.view(self.padded_shape)[: self.size[0]]
        if self.tp_spec is not None:
            data = DTensor(data, self.tp_spec, requires_grad=False)
        self.unsharded_param = nn.Parameter(data, requires_grad=self.sharded_param.requires_grad)

    def gather_dest(self, world: int) -> torch.Tensor:
        """Where a gathered ``(world, slot)`` block lands: the flat buffer as ``(world, slot)``, or for a shard dim d > 0
        a ``(world, *local_shape)`` strided view putting each rank's part in place. Made once: a view follows resizes."""
        assert self._padded_unsharded is not None
        if world != self.mesh_info.shard.size:  # a k-rank post-forward gather of the flat buffer
            return self._padded_unsharded.view(world, -1)
        if self._gather_out is None:
            flat = self._padded_unsharded
            self._gather_out = self._rank_major(flat) if self.shard_dim else flat.view(world, -1)
        return self._gather_out

    def keep_post_forward_slice(self, k: int, index: int) -> None:
        """Keep this rank's 1/k of the padded full parameter before it is freed."""
        if self.extension:  # hooks patched on after the call, which refuses the int for those it sees (as torch)
            raise NotImplementedError(
                f"fully_shard: parameter {self.fqn!r} all-gathers itself (fsdp_pre_all_gather on its local tensor), "
                "which reshard_after_forward=<int> does not support; pass True or False to its fully_shard call"
            )
        assert self._padded_unsharded is not None
        self.post_forward_slice = self._padded_unsharded.view(k, -1)[index].clone()

    def note_unsharded_version(self) -> None:
        assert self.unsharded_param is not None
        self._unsharded_version = self.unsharded_param._version

    def check_unsharded_version(self) -> None:
        """Catch in-place changes to the full parameter, which would be lost on reshard."""
        if self.unsharded_param is not None and self.unsharded_param._version != self._unsharded_version:
            self.note_unsharded_version()
            raise RuntimeError(
                f"fully_shard: parameter {self.fqn!r} was modified in place while it was unsharded (between its "
                "all-gather and its reshard, e.g. between forward and backward). The change is not written back to the "
                "shard and would be lost. Modify parameters outside forward/backward, where they are the sharded "
                "DTensors, e.g. `with torch.no_grad(): p.mul_(0.5)` before the next forward."
            )

    def free_unsharded(self) -> None:
        """Release the unsharded storage; the tensor objects stay, so autograd's saved
        references see the data again after the next all-gather."""
        if self._padded_unsharded is not None:
            self._padded_unsharded.untyped_storage().resize_(0)
        for t in (self._ext_outputs or []) + self._ext_inner:
            t.untyped_storage().resize_(0)

    # -- local tensors that all-gather themselves ------------------------------------

    def refresh_extension(self) -> bool:
        """Look the all-gather hooks up on the local tensor again, as torch's FSDP2 does at every all-gather (they may
        have been patched onto it after ``fully_shard`` or ``to_empty()``, or the tensor swapped); whether that changed
        the decision, in which case the unsharded tensors the other way built are dropped. Only while sharded."""
        local = self.sharded_param._local_tensor  # type: ignore[attr-defined]
        if type(local) is torch.Tensor and not hasattr(local, "fsdp_pre_all_gather"):
            ext = False  # the common case, in one lookup (fsdp_post_all_gather alone goes unnoticed, as in torch)
        elif not (ext := _has_hooks(local, self.fqn)) and _is_subclass(local):
            raise NotImplementedError(
                f"fully_shard: parameter {self.fqn!r} is a {type(local).__name__}, a tensor subclass without "
                "fsdp_pre_all_gather / fsdp_post_all_gather at its all-gather: gathering it would silently give a "
                "plain tensor. Define both (torch's FSDP2 all-gather extension contract) on its class, or on its local "
                "tensor (param._local_tensor, after to_empty()) before the first forward; or keep it out with ignored_params."
            )
        if ext == self.extension:
            return False
        self.extension = ext
        self._padded_unsharded = self._gather_out = self.unsharded_param = self._ext_outputs = None
        self._ext_inner = []
        return True

    def ext_all_gather_inputs(self) -> tuple[list[torch.Tensor], list[int]]:
        """Call the local tensor's ``fsdp_pre_all_gather``: its inputs (1-D, as bytes) and each
        one's per-rank slot in bytes (dim 0 padded like the parameter's rows)."""
        local = self.local_shard
        if local.device != self.device:
            local = local.to(self.device, non_blocking=True)  # see all_gather_input
        pre = local.fsdp_pre_all_gather  # type: ignore[attr-defined]
        info = self.mesh_info
        mesh = info.mesh if info.mesh.ndim == 1 else info.mesh[info.mesh.mesh_dim_names[info.shard_mesh_dim]]  # type: ignore[index]
        if len(inspect.signature(pre).parameters) == 1:
            inputs, self._ext_meta = pre(mesh)
        else:
            inputs, self._ext_meta = pre(mesh, self.size, _contiguous_stride(self.size), self.uses[0][0], self.mp_policy)
        self._ext_sizes = [
            torch.Size((self.chunk_rows, *t.shape[1:])) if not self.shard_dim and t.dim() and t.shape[0] == self.local_rows else t.shape
            for t in inputs
        ]
        self._ext_dtypes = [t.dtype for t in inputs]
        slots = [math.prod(size) * t.element_size() for size, t in zip(self._ext_sizes, inputs)]
        return [t.reshape(-1).view(torch.uint8) for t in inputs], slots

    def ext_gather_dests(self) -> list[torch.Tensor]:
        """The persistent all-gather outputs (storage given back after a reshard) as ``(world, ...)`` byte views like
        :meth:`gather_dest`'s: the subclass's unsharded tensors may alias them from the first all-gather on."""
        world, d = self.mesh_info.shard.size, self.shard_dim
        if self._ext_outputs is None:
            self._ext_outputs = [
                torch.empty(world * math.prod(s), dtype=dt, device=self.device) for s, dt in zip(self._ext_sizes, self._ext_dtypes)
            ]
        for t in self._ext_outputs + self._ext_inner:
            _alloc_storage(t)
        return [(t.view(*s[:d], world, *s[d:]).movedim(d, 0) if d else t.view(world, -1)).view(torch.uint8)
                for t, s in zip(self._ext_outputs, self._ext_sizes)]

    def ext_post_all_gather(self) -> None:
        """Call the local tensor's ``fsdp_post_all_gather``: it builds the unsharded (TP-local)
        parameter the first time, and refills it in place (``out=``) afterwards."""
        assert self._ext_outputs is not None
        d = self.shard_dim  # the ranks' parts lie side by side on it
        outputs = tuple(t.view(*s[:d], -1, *s[d + 1 :]) for t, s in zip(self._ext_outputs, self._ext_sizes))
        post = self.local_shard.fsdp_post_all_gather  # type: ignore[attr-defined]
        if self.unsharded_param is None:
            full, inner = post(outputs, self._ext_meta, self.unsharded_dtype)
            self._ext_inner = list(inner)
            if full.shape[0] != self.size[0]:  # padded rows of an uneven shard
                full = full[: self.size[0]]
            if self.tp_spec is not None:
                full = DTensor(full, self.tp_spec, requires_grad=False)
            self.unsharded_param = nn.Parameter(full, requires_grad=self.sharded_param.requires_grad)
        else:
            post(outputs, self._ext_meta, self.unsharded_dtype, out=self.unsharded_param)
        self._ext_meta = None

    # -- which tensor the modules see --------------------------------------------

    def register(self, unsharded: bool) -> None:
        param = self.unsharded_param if unsharded else self.sharded_param
        for module, name in self.uses:
            module._parameters[name] = param

    @property
    def unsharded_grad(self) -> torch.Tensor | None:
        """The gradient of the unsharded parameter as a plain (TP-local) tensor."""
        grad = None if self.unsharded_param is None else self.unsharded_param.grad
        if isinstance(grad, DTensor):
            assert self.tp_spec is not None
            target = list(self.tp_spec.placements)
            info = self.mesh_info
            for i in info.spmd_shard_dims + info.spmd_replicate_dims:  # dp_mesh_dims: reduced below
                target[i] = grad.placements[i]
            if tuple(grad.placements) != tuple(target):  # e.g. Partial from sequence parallelism
                grad = grad.redistribute(placements=target)
            grad = grad._local_tensor
        return grad

    def clear_unsharded_grad(self) -> None:
        if self.unsharded_param is not None:
            self.unsharded_param.grad = None

    def grad_for_reduce(self, grad: torch.Tensor) -> torch.Tensor:
        """Arrange a full gradient so its dim 0 splits into the ranks' parts (``_chunk_cat``)."""
        return self._rank_major(grad) if self.shard_dim else grad

    def _rank_major(self, full: torch.Tensor) -> torch.Tensor:
        """``full`` (shard dim d > 0) viewed as ``(world, ...)``: entry r is rank r's part."""
        d, size, world = self.shard_dim, self.size, self.mesh_info.shard.size
        return full.view(*size[:d], world, size[d] // world, *size[d + 1 :]).movedim(d, 0)


def accumulate_sharded_grads(params: list[ShardedParam], parts: list[torch.Tensor]) -> bool:
    """Add each reduced part (a parameter's local rows, any layout of the right size) to its sharded gradient, or set it,
    then run the sharded parameter's post-accumulate-grad hooks (``register_post_accumulate_grad_hook``: autograd never
    reaches the sharded parameter, so this is where its gradient is accumulated). As in torch's FSDP2, each parameter's
    hooks run once its own gradient is in ``.grad``, before the next parameter's is.

    Offloaded gradients are cast where the part is (the device), then moved to the host: without blocking, into pinned
    memory, where the policy pins and nothing on the host reads them before the end of backward (no gradient to add to,
    no post-accumulate-grad hook). Returns whether such a copy was issued: the host must wait for it (``Streams``)."""
    adds: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    pending_copy = False
    for p, part in zip(params, parts):
        local = part.view(p.local_shape).to(p.dtype)
        param = p.sharded_param
        grad, hooks = param.grad, param._post_accumulate_grad_hooks
        if p.offload:
            non_blocking = p.pin_memory and grad is None and not hooks
            local = local.to(p.shard_device, non_blocking=non_blocking)
            pending_copy |= non_blocking
        if grad is None:
            param.grad = p.to_sharded_dtensor(local)
        else:
            adds[0].append(cast(DTensor, grad)._local_tensor)
            adds[1].append(local)
        if hooks:
            _add(adds)  # this gradient and the earlier ones in place first
            for hook in hooks.values():
                hook(param)
    _add(adds)
    return pending_copy


def _add(adds: tuple[list[torch.Tensor], list[torch.Tensor]]) -> None:
    if adds[0]:
        torch._foreach_add_(*adds)
        adds[0].clear()
        adds[1].clear()


def reduced_parts(params: list[ShardedParam], flat: torch.Tensor) -> list[torch.Tensor]:
    """Each parameter's rows of a reduced ``flat`` (1-D: the padded slots in order, rows first), padding dropped."""
    sizes = [n for p in params for n in (p.local_shape.numel(), p.shard_numel - p.local_shape.numel())]
    return list(flat.split_with_sizes(sizes)[::2])


def _check_spmd_param(param: nn.Parameter, fqn: str, info: MeshInfo) -> None:
    """dp_mesh_dims: the parameter is a DTensor on the full mesh, replicated on the dp dims."""
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


def _alloc_storage(t: torch.Tensor) -> None:
    storage = t.untyped_storage()
    nbytes = (t.storage_offset() + t.numel()) * t.element_size()
    if storage.size() < nbytes:
        storage.resize_(int(nbytes))


def _is_subclass(t: torch.Tensor) -> bool:
    """Whether ``t`` is a tensor subclass with its own ``__torch_dispatch__`` (nn.Parameter and the like are plain, and
    so is a FakeTensor, which stands for a plain one: the memory planner runs fully_shard on them)."""
    return getattr(type(t), "__torch_dispatch__", None) is not torch.Tensor.__torch_dispatch__ and not isinstance(t, FakeTensor)


def _has_hooks(t: torch.Tensor, fqn: str) -> bool:
    """Whether ``t`` (a local shard) all-gathers itself: both hooks, on its class or on the instance."""
    pre, post = hasattr(t, "fsdp_pre_all_gather"), hasattr(t, "fsdp_post_all_gather")
    if pre != post:
        has, lacks = ("fsdp_pre_all_gather", "fsdp_post_all_gather")[:: 1 if pre else -1]
        raise NotImplementedError(
            f"fully_shard: the local tensor of parameter {fqn!r} (a {type(t).__name__}) has {has} but not {lacks}: "
            "define both (torch's FSDP2 all-gather extension contract), or neither"
        )
    return pre
