"""One parameter: its sharded DTensor, and the unsharded buffer it is gathered into."""

from __future__ import annotations

import inspect
import math
from typing import Any, cast

import torch
import torch.nn as nn
from torch._prims_common import make_contiguous_strides_for
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from .layout import Layout, MeshLayout, layout_for, mesh_layout_for
from .mesh import MeshInfo
from .policy import MixedPrecisionPolicy

# on an original parameter and its sharded replacement: the fully_shard call owning them (``ShardedParam.owner``)
OWNER_ATTR = "_fully_shard_owner"
STATE_ATTR = "_fully_shard_state"  # on a module: its FSDPState (state.py)


def param_dtypes(dtype: torch.dtype, mp_policy: MixedPrecisionPolicy) -> tuple[torch.dtype, torch.dtype]:
    """``(unsharded dtype, reduce dtype)`` of a parameter stored in ``dtype``: all-gather and compute (``param_dtype``
    casts floating-point parameters only); gradient reduction (``reduce_dtype``, else the unsharded dtype).

    Example::

        >>> param_dtypes(torch.float32, MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        (torch.bfloat16, torch.bfloat16)
    """
    unsharded = (mp_policy.param_dtype if dtype.is_floating_point else None) or dtype
    return unsharded, mp_policy.reduce_dtype or unsharded


class ShardedParam:
    """A parameter sharded over the shard dim of the mesh: its sharded DTensor, and the unsharded tensor the module
    computes with, gathered into a padded flat buffer (or by the local tensor itself: ``SelfGather``).

    Where its pieces lie is told by two objects (layout.py): ``layout`` cuts the (TP-local) tensor among the ranks and
    maps it to the flat buffers (``RowLayout``: dim 0, padded; ``EvenLayout``: another dim, even), ``mesh_layout`` says
    which DTensors users see (plain, tensor-parallel, ``dp_mesh_dims``).
    """

    # set by __init__ for a parameter it shards, or taken from an earlier call's ShardedParam (Note [tied parameters])
    tie: Tie  # every call's ShardedParam of this parameter
    owner: Any  # the fully_shard call that sharded it (api's ``_Owner``)
    size: torch.Size  # of the (TP-local) tensor that is gathered
    mesh_layout: MeshLayout
    layout: Layout
    _spec: DTensorSpec
    sharded_param: nn.Parameter  # DTensor: this rank's part
    # set while the local tensor gathers itself (torch's fsdp_pre/post_all_gather contract): decided at the call, then
    # again at every all-gather (refresh_extension), since hooks may be patched onto the local tensor later
    self_gather: SelfGather | None

    def __init__(
        self, param: nn.Parameter, fqn: str, uses: list[tuple[nn.Module, str]], mesh_info: MeshInfo,
        device: torch.device, mp_policy: MixedPrecisionPolicy, offload: bool, pin_memory: bool, shard_dim: int = 0,
        tied_to: ShardedParam | None = None,
    ) -> None:
        if param.dim() == 0:
            raise ValueError(f"fully_shard cannot shard the scalar parameter {fqn!r}: give it shape (1,) "
                             "or pass it in ignored_params")
        self.local_fqn = fqn  # relative to the module(s) given to fully_shard
        self.fqn = fqn  # relative to the root, once lazy init knows it
        self.uses = uses  # every (module, attribute name) that registers this parameter
        self.mesh_info = mesh_info
        self.device = device
        self.mp_policy = mp_policy
        self.group: Any = None  # the ParamGroup that gathers it (which sets it)
        # offloading keeps the sharded parameter (and so its grad and optimizer state) on the CPU
        self.shard_device = torch.device("cpu") if offload else device
        self.offload = offload
        self.pin_memory = offload and pin_memory  # as asked: shards kept pinned, gradients come back without blocking
        self._padded_unsharded: torch.Tensor | None = None  # 1-D, N slots; storage freed when sharded
        self._gather_out: torch.Tensor | None = None  # (N, ...) view of it that the all-gather's copy-out fills
        self._flat: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)  # (local shard, its 1-D view)
        self.unsharded_param: nn.Parameter | None = None  # the parameter the module computes with
        self.post_forward_slice: torch.Tensor | None = None  # 1-D, this rank's 1/k of the padded param
        self._unsharded_version = 0  # the unsharded parameter's version counter after its copy-out
        self.traced_local: torch.Tensor | None = None  # traced: the local shard taken outside a checkpointed region
        if tied_to is not None:  # Note [tied parameters]: another call sharded it (alike: fully_shard checks)
            self.tie = tied_to.tie
            self.tie.params.append(self)
            self.owner, self._spec, self.mesh_layout, self.layout = (tied_to.owner, tied_to._spec, tied_to.mesh_layout,
                                                                     tied_to.layout)
            self.size, self.sharded_param = tied_to.size, tied_to.sharded_param
            self.self_gather = SelfGather(self) if tied_to.self_gather is not None else None
            self._set_dtypes(tied_to.dtype)
            return
        self.tie = Tie(self)
        self._set_dtypes(param.dtype)
        self.mesh_layout = mesh_layout_for(param, mesh_info, fqn)
        data = param._local_tensor if isinstance(param, DTensor) else param
        self.size = data.shape
        dim = shard_dim + data.dim() if shard_dim < 0 else shard_dim
        self.layout = layout_for(self.size, dim, mesh_info.shard.size, mesh_info.shard.rank, fqn)
        src = self.layout.local_part(data.detach())

        target = torch.device("meta") if param.is_meta else self.shard_device
        pin = target.type == "cpu" and self._pins()
        if _is_subclass(data):  # keeps its type in the shard: its own ops (slice, clone) make it
            local = src.to(target).clone()
            if type(local) is not type(data):
                raise NotImplementedError(f"fully_shard: parameter {fqn!r} is a {type(data).__name__}, but slicing and "
                                          f"cloning it gives a {type(local).__name__}: the subclass must keep its type "
                                          "under aten.slice and aten.clone to be sharded. "
                                          "Keep it out with ignored_params.")
        else:
            local = torch.empty(src.shape, dtype=self.dtype, device=target, pin_memory=pin)  # this rank's part
            if not param.is_meta:
                local.copy_(src)
        self._spec = self.mesh_layout.sharded_spec(dim, self.size, self.dtype)
        self.sharded_param = nn.Parameter(self.to_sharded_dtensor(local), requires_grad=param.requires_grad)
        self.self_gather = SelfGather(self) if _has_hooks(local, fqn) else None
        self.owner = None  # set by fully_shard

    # a full gradient not reduced yet: in the reduce dtype while gradient sync is off, or a tied parameter's until the
    # last group gathering it reduces; shared by the ShardedParams of one parameter (``Tie``)
    accumulated_grad = property(lambda self: self.tie.grad, lambda self, grad: setattr(self.tie, "grad", grad))

    @property
    def extension(self) -> bool:
        """Whether the local tensor all-gathers itself (as of the last all-gather, or the call)."""
        return self.self_gather is not None

    def set_owner(self, owner: object) -> None:
        """Record the owner on the sharded parameter too (again in ``refresh_after_apply``, which may swap it)."""
        self.owner = owner
        self.sharded_param.__dict__[OWNER_ATTR] = owner

    def _pins(self) -> bool:
        """Whether offloaded shards are kept in pinned host memory: if asked, and an accelerator can pin."""
        return self.pin_memory and torch.accelerator.is_available()

    def _set_dtypes(self, dtype: torch.dtype) -> None:
        self.dtype = dtype  # of the sharded parameter, its gradient and optimizer state
        # all-gather and compute; reduce-scatter
        self.unsharded_dtype, self.reduce_dtype = param_dtypes(dtype, self.mp_policy)

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

    # -- sharded side ------------------------------------------------------------

    @property
    def local_shard(self) -> torch.Tensor:
        """This rank's part (read afresh: ``to_empty``/``load_state_dict`` may swap it)."""
        return self.sharded_param._local_tensor  # type: ignore[attr-defined, no-any-return]

    def flat_shard(self) -> torch.Tensor:
        """This rank's part, 1-D: the all-gather input. The view is cached while the local tensor is the same object."""
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

    def full_to_sharded(self, full: torch.Tensor, key: str) -> DTensor:
        """A full tensor loaded into this parameter, as this rank's shard (a DTensor)."""
        if self.mesh_layout.tp_spec is not None:
            raise ValueError(f"load_state_dict: {key!r} is a tensor-parallel parameter; load it as a DTensor "
                             "(e.g. through torch.distributed.checkpoint), not as a full tensor")
        if full.shape != self.size:
            raise ValueError(f"load_state_dict: {key!r} has shape {tuple(full.shape)}, the parameter "
                             f"{tuple(self.size)}")
        local = self.layout.local_part(full).to(device=self.local_shard.device, dtype=self.dtype)
        return self.to_sharded_dtensor(local.contiguous())

    def adopt(self, param: DTensor, what: str = "load_state_dict(assign=True)") -> None:
        """``what`` (``load_state_dict(assign=True)``) registered ``param``: make it the sharded one."""
        if param.placements != self._spec.placements or param.shape != self.sharded_param.shape:
            raise ValueError(f"{what}: {self.fqn!r} got a DTensor with placements {param.placements} and shape "
                             f"{tuple(param.shape)}; fully_shard laid it out as {self._spec.placements} with shape "
                             f"{tuple(self.sharded_param.shape)}")
        new = (param if isinstance(param, nn.Parameter)
               else nn.Parameter(param, requires_grad=self.sharded_param.requires_grad))
        for p in self.tie.params:  # the calls a tied parameter is shared by keep sharing it
            p.sharded_param = new
            p.register(unsharded=False)
            p.refresh_after_apply()

    def pick_up_replacement(self, managed: set[int]) -> None:
        """Shard a parameter registered in place of the sharded one before the first forward (e.g. ``model.w =
        nn.Parameter(f(a.weight, b.weight))`` once ``a`` and ``b`` are materialised), as torch's FSDP2 does at lazy
        init. A DTensor with the parameter's layout is kept; a full tensor of its shape is cut to this rank's part."""
        module, name = self.uses[0]
        current = module._parameters.get(name)
        if (current is None or current is self.sharded_param or current is self.unsharded_param
                or self.tie.params[0] is not self):
            # not replaced (unsharded: an explicit unshard() before the first forward); tied: the first call's decides
            return
        if id(current) in managed:
            return  # another sharded parameter (a tie made after sharding): refused later
        plain = self.mesh_layout.tp_spec is None
        fits = current.shape == self.size and (
            current.placements == self._spec.placements if isinstance(current, DTensor) else plain
        )
        if not fits:
            return  # refused, naming it, by the root's check of the registered parameters
        if not isinstance(current, DTensor):
            local = self.layout.local_part(current.detach()).to(device=self.shard_device, dtype=self.dtype)
            current = nn.Parameter(self.to_sharded_dtensor(local.contiguous()), requires_grad=current.requires_grad)
        self.adopt(current, "replacing a sharded parameter before the first forward")  # type: ignore[arg-type]

    def to_sharded_dtensor(self, local: torch.Tensor) -> DTensor:
        """Wrap a tensor shaped like this rank's part as a DTensor laid out like the parameter
        (``__new__`` makes it whole; ``__init__`` adds an export wrapper costing as much again)."""
        return DTensor.__new__(DTensor, local, self._spec, requires_grad=False)

    def check_materialized(self) -> None:
        if self.local_shard.is_meta:
            raise RuntimeError(f"parameter {self.fqn!r} is still on the meta device at the first forward: call "
                               "model.to_empty(device=...) and initialise the parameters (e.g. "
                               "model.reset_parameters()) after fully_shard and before running forward")

    # -- unsharded side ------------------------------------------------------------

    def alloc_unsharded(self) -> None:
        """Give the unsharded buffer its storage back (allocated on first use)."""
        if self._padded_unsharded is not None:
            assert self.unsharded_param is not None
            _alloc_storage(self._padded_unsharded)
            self.unsharded_param.requires_grad_(self.sharded_param.requires_grad)
        else:
            self._padded_unsharded = torch.empty(self.layout.padded_numel, dtype=self.unsharded_dtype,
                                                 device=self.device)
            self._gather_out = None
            data = self.mesh_layout.unsharded(self.layout.unsharded(self._padded_unsharded))
            self.unsharded_param = nn.Parameter(data, requires_grad=self.sharded_param.requires_grad)
        self.mesh_layout.annotate(self.unsharded_param)

    def gather_dest(self, world: int) -> torch.Tensor:
        """Where a gathered ``(world, slot)`` block lands: a ``(world, ...)`` view of the flat buffer whose entry ``r``
        is rank ``r``'s part in place (``Layout.rank_major``). Made once: a view follows resizes."""
        assert self._padded_unsharded is not None
        if world != self.layout.world:  # a k-rank post-forward gather of the flat buffer
            return self._padded_unsharded.view(world, -1)
        if self._gather_out is None:
            self._gather_out = self.layout.rank_major(self._padded_unsharded, self.layout.local_shape)
        return self._gather_out

    def keep_post_forward_slice(self, k: int, index: int) -> None:
        """Keep this rank's 1/k of the padded full parameter before it is freed."""
        if self.extension:  # hooks patched on after the call, which refuses the int for those it sees (as torch)
            raise NotImplementedError(f"fully_shard: parameter {self.fqn!r} all-gathers itself (fsdp_pre_all_gather on "
                                      "its local tensor), which reshard_after_forward=<int> does not support; pass "
                                      "True or False to its fully_shard call")
        assert self._padded_unsharded is not None
        self.post_forward_slice = self._padded_unsharded.view(k, -1)[index].clone()

    def note_unsharded_version(self) -> None:
        assert self.unsharded_param is not None
        self._unsharded_version = self.unsharded_param._version

    def check_unsharded_version(self) -> None:
        """Catch in-place changes to the full parameter, which would be lost on reshard."""
        if self.unsharded_param is not None and self.unsharded_param._version != self._unsharded_version:
            self.note_unsharded_version()
            raise RuntimeError(f"fully_shard: parameter {self.fqn!r} was modified in place while it was unsharded "
                               "(between its all-gather and its reshard, e.g. between forward and backward). The "
                               "change is not written back to the shard and would be lost. Modify parameters outside "
                               "forward/backward, where they are the sharded DTensors, e.g. `with torch.no_grad(): "
                               "p.mul_(0.5)` before the next forward.")

    def free_unsharded(self) -> None:
        """Release the unsharded storage; the tensor objects stay, so autograd's saved
        references see the data again after the next all-gather."""
        if self._padded_unsharded is not None:
            self._padded_unsharded.untyped_storage().resize_(0)
        if self.self_gather is not None:
            self.self_gather.free()

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
                "tensor (param._local_tensor, after to_empty()) before the first forward; "
                "or keep it out with ignored_params."
            )
        if ext == self.extension:
            return False
        self.self_gather = SelfGather(self) if ext else None
        self._padded_unsharded = self._gather_out = self.unsharded_param = None
        return True

    # -- which tensor the modules see --------------------------------------------

    def register(self, unsharded: bool) -> None:
        param = self.unsharded_param if unsharded else self.sharded_param
        for module, name in self.uses:
            module._parameters[name] = param

    @property
    def unsharded_grad(self) -> torch.Tensor | None:
        """The gradient of the unsharded parameter as a plain (TP-local) tensor."""
        grad = None if self.unsharded_param is None else self.unsharded_param.grad
        return None if grad is None else self.mesh_layout.local_grad(grad)

    def clear_unsharded_grad(self) -> None:
        if self.unsharded_param is not None:
            self.unsharded_param.grad = None


class Tie:
    """The ShardedParams of one parameter, one per fully_shard call that reaches it (the first call's first; one unless
    it is tied across calls): each gathers the one sharded parameter for its own modules, and they share the gradient
    not reduced yet. Note [tied parameters]."""

    def __init__(self, first: ShardedParam) -> None:
        self.params = [first]
        self.grad: torch.Tensor | None = None  # ShardedParam.accumulated_grad
        self.sink: torch.Tensor | None = None  # while gradient sync is off, the traced path's leaf (traced.make_sinks)


class SelfGather:
    """How a local tensor that gathers itself is all-gathered (torch's FSDP2 extension contract): its
    ``fsdp_pre_all_gather`` gives the inputs, one all-gather of bytes per group and mesh gathers them into outputs kept
    here (their storage freed while sharded: the subclass's unsharded tensor may alias them), and its
    ``fsdp_post_all_gather`` builds the unsharded tensor from them. A strategy of the parameter's, not a layout: see
    layout.py. ``ShardedParam.refresh_extension`` makes or drops it at every all-gather."""

    def __init__(self, param: ShardedParam) -> None:
        self.param = param
        self.meta: Any = None  # fsdp_pre_all_gather's metadata, until fsdp_post_all_gather
        self.slots: list[torch.Size] = []  # each input's per-rank slot (dim 0 padded like the parameter's rows)
        self.dtypes: list[torch.dtype] = []
        self.outputs: list[torch.Tensor] | None = None  # 1-D, N slots each; storage freed when sharded
        self.inner: list[torch.Tensor] = []  # the subclass's tensors that hold the gathered data

    def all_gather_inputs(self) -> tuple[list[torch.Tensor], list[int]]:
        """Call the local tensor's ``fsdp_pre_all_gather``: its inputs (1-D, as bytes) and each
        one's per-rank slot in bytes."""
        p = self.param
        local = p.local_shard
        if local.device != p.device:
            local = local.to(p.device, non_blocking=True)  # see ShardedParam.all_gather_input
        pre = local.fsdp_pre_all_gather  # type: ignore[attr-defined]
        info, names = p.mesh_info, p.mesh_info.mesh.mesh_dim_names
        mesh = info.mesh if info.mesh.ndim == 1 else info.mesh[names[info.shard_mesh_dim]]  # type: ignore[index]
        if len(inspect.signature(pre).parameters) == 1:
            inputs, self.meta = pre(mesh)
        else:
            inputs, self.meta = pre(mesh, p.size, tuple(make_contiguous_strides_for(p.size)), p.uses[0][0], p.mp_policy)
        self.slots = [p.layout.slot_shape(t.shape) for t in inputs]
        self.dtypes = [t.dtype for t in inputs]
        nbytes = [math.prod(slot) * t.element_size() for slot, t in zip(self.slots, inputs)]
        return [t.reshape(-1).view(torch.uint8) for t in inputs], nbytes

    def gather_dests(self) -> list[torch.Tensor]:
        """The persistent all-gather outputs (storage given back after a reshard) as ``(world, ...)`` byte views like
        ``ShardedParam.gather_dest``'s."""
        layout = self.param.layout
        if self.outputs is None:
            self.outputs = [torch.empty(layout.world * math.prod(s), dtype=dt, device=self.param.device)
                            for s, dt in zip(self.slots, self.dtypes)]
        for t in self.outputs + self.inner:
            _alloc_storage(t)
        return [layout.rank_major(t, s).view(torch.uint8) for t, s in zip(self.outputs, self.slots)]

    def post_all_gather(self) -> None:
        """Call the local tensor's ``fsdp_post_all_gather``: it builds the unsharded (TP-local)
        parameter the first time, and refills it in place (``out=``) afterwards."""
        p = self.param
        assert self.outputs is not None
        outputs = tuple(p.layout.joined(t, s) for t, s in zip(self.outputs, self.slots))
        post = p.local_shard.fsdp_post_all_gather  # type: ignore[attr-defined]
        if p.unsharded_param is None:
            full, inner = post(outputs, self.meta, p.unsharded_dtype)
            self.inner = list(inner)
            if full.shape[0] != p.size[0]:  # padded rows of an uneven shard
                full = full[: p.size[0]]
            full = p.mesh_layout.unsharded(full)
            p.unsharded_param = nn.Parameter(full, requires_grad=p.sharded_param.requires_grad)
        else:
            post(outputs, self.meta, p.unsharded_dtype, out=p.unsharded_param)
        self.meta = None

    def free(self) -> None:
        for t in (self.outputs or []) + self.inner:
            t.untyped_storage().resize_(0)


def accumulate_sharded_grads(params: list[ShardedParam], parts: list[torch.Tensor]) -> bool:
    """Add each reduced part (a parameter's local rows, any layout of the right size) to its sharded gradient, or set
    it, then run the sharded parameter's post-accumulate-grad hooks (``register_post_accumulate_grad_hook``: autograd
    never reaches the sharded parameter, so this is where its gradient is accumulated). As in torch's FSDP2, each
    parameter's hooks run once its own gradient is in ``.grad``, before the next parameter's is.

    Offloaded gradients are cast where the part is (the device), then moved to the host: without blocking, into pinned
    memory, where the policy pins and nothing on the host reads them before the end of backward (no gradient to add to,
    no post-accumulate-grad hook). Returns whether such a copy was issued: the host must wait for it (``Streams``)."""
    adds: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    pending_copy = False
    for p, part in zip(params, parts):
        local = part.view(p.layout.local_shape).to(p.dtype)
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


def _alloc_storage(t: torch.Tensor) -> None:
    storage = t.untyped_storage()
    nbytes = (t.storage_offset() + t.numel()) * t.element_size()
    if storage.size() < nbytes:
        storage.resize_(int(nbytes))


def _is_subclass(t: torch.Tensor) -> bool:
    """Whether ``t`` is a tensor subclass with its own ``__torch_dispatch__`` (nn.Parameter and the like are plain, and
    so is a FakeTensor, which stands for a plain one: the memory planner runs fully_shard on them)."""
    return (getattr(type(t), "__torch_dispatch__", None) is not torch.Tensor.__torch_dispatch__
            and not isinstance(t, FakeTensor))


def _has_hooks(t: torch.Tensor, fqn: str) -> bool:
    """Whether ``t`` (a local shard) all-gathers itself: both hooks, on its class or on the instance."""
    pre, post = hasattr(t, "fsdp_pre_all_gather"), hasattr(t, "fsdp_post_all_gather")
    if pre != post:
        has, lacks = ("fsdp_pre_all_gather", "fsdp_post_all_gather")[:: 1 if pre else -1]
        raise NotImplementedError(f"fully_shard: the local tensor of parameter {fqn!r} (a {type(t).__name__}) has "
                                  f"{has} but not {lacks}: define both (torch's FSDP2 all-gather extension "
                                  "contract), or neither")
    return pre
