"""One parameter: its sharded DTensor, and the unsharded buffer it is gathered into."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from .mesh import MeshInfo
from .policy import MixedPrecisionPolicy


def _contiguous_stride(size: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(size):
        stride.append(acc)
        acc *= d
    return tuple(reversed(stride))


class ShardedParam:
    """A parameter sharded on dim 0 with ``torch.chunk`` semantics.

    Rank ``r`` of ``N`` holds rows ``[r*c, min((r+1)*c, n))`` of an ``n``-row parameter,
    where ``c = ceil(n / N)``: the last ranks may hold fewer rows, or none. In the flat
    collective buffers every rank's slot is ``c`` rows (padded), so the unsharded buffer has
    ``N*c`` rows of which the first ``n`` are the parameter.
    """

    def __init__(
        self,
        param: nn.Parameter,
        fqn: str,
        uses: list[tuple[nn.Module, str]],
        mesh_info: MeshInfo,
        device: torch.device,
        mp_policy: MixedPrecisionPolicy,
        offload: bool,
        pin_memory: bool,
    ) -> None:
        if param.dim() == 0:
            raise ValueError(
                f"fully_shard cannot shard the scalar parameter {fqn!r} on dim 0: give it "
                "shape (1,) or pass it in ignored_params"
            )
        self.local_fqn = fqn  # relative to the module(s) given to fully_shard
        self.fqn = fqn  # relative to the root, once lazy init knows it
        self.uses = uses  # every (module, attribute name) that registers this parameter
        self.mesh_info = mesh_info
        self.device = device
        self.size = param.shape
        self.dtype = param.dtype  # of the sharded parameter, its gradient and optimizer state
        cast = mp_policy.param_dtype if self.dtype.is_floating_point else None
        self.unsharded_dtype = cast or self.dtype  # all-gather and compute
        self.reduce_dtype = mp_policy.reduce_dtype or self.unsharded_dtype  # reduce-scatter
        # offloading keeps the sharded parameter (and so its grad and optimizer state) on the CPU
        self.shard_device = torch.device("cpu") if offload else device
        world, rank = mesh_info.shard_size, mesh_info.shard_rank
        rows = self.size[0]
        self.chunk_rows = math.ceil(rows / world)
        row_numel = math.prod(self.size[1:])
        self.shard_numel = self.chunk_rows * row_numel  # padded per-rank slot, in elements
        start = min(rank * self.chunk_rows, rows)
        self.local_rows = min(start + self.chunk_rows, rows) - start
        self.padded_shape = (world * self.chunk_rows, *self.size[1:])

        src = param.detach()[start : start + self.local_rows]
        target = torch.device("meta") if param.is_meta else self.shard_device
        pin = pin_memory and offload and target.type == "cpu" and torch.accelerator.is_available()
        local = torch.empty(src.shape, dtype=self.dtype, device=target, pin_memory=pin)  # this rank's rows
        if not param.is_meta:
            local.copy_(src)
        self._spec = DTensorSpec(
            mesh_info.mesh,
            (Shard(0),) if mesh_info.replicate_mesh_dim is None else (Replicate(), Shard(0)),
            TensorMeta(self.size, _contiguous_stride(self.size), self.dtype),
        )
        self.sharded_param = nn.Parameter(
            DTensor(local, self._spec, requires_grad=param.requires_grad),
            requires_grad=param.requires_grad,
        )
        self._padded_unsharded: torch.Tensor | None = None  # 1-D, N*c rows; storage freed when sharded
        self.unsharded_param: nn.Parameter | None = None  # view of the first n rows
        self.accumulated_grad: torch.Tensor | None = None  # unsharded, while gradient sync is off
        self.post_forward_slice: torch.Tensor | None = None  # 1-D, this rank's 1/k of the padded param

    # -- sharded side ------------------------------------------------------------

    @property
    def local_shard(self) -> torch.Tensor:
        """This rank's rows (read afresh: ``to_empty``/``load_state_dict`` may swap them)."""
        return self.sharded_param._local_tensor

    def to_sharded_dtensor(self, local: torch.Tensor) -> DTensor:
        """Wrap a tensor shaped like this rank's rows as a DTensor laid out like the parameter."""
        return DTensor(local, self._spec, requires_grad=False)

    def check_materialized(self) -> None:
        if self.local_shard.is_meta:
            raise RuntimeError(
                f"parameter {self.fqn!r} is still on the meta device at the first forward: call "
                "model.to_empty(device=...) and initialise the parameters (e.g. "
                "model.reset_parameters()) after fully_shard and before running forward"
            )

    # -- unsharded side ------------------------------------------------------------

    def alloc_unsharded(self) -> torch.Tensor:
        """Give the unsharded buffer its storage back; returns the flat padded buffer."""
        if self._padded_unsharded is None:
            self._padded_unsharded = torch.empty(self.unsharded_numel, dtype=self.unsharded_dtype, device=self.device)
            self.unsharded_param = nn.Parameter(
                self._padded_unsharded.view(self.padded_shape)[: self.size[0]],
                requires_grad=self.sharded_param.requires_grad,
            )
            return self._padded_unsharded
        storage = self._padded_unsharded.untyped_storage()
        nbytes = self._padded_unsharded.numel() * self._padded_unsharded.element_size()
        if storage.size() != nbytes:
            storage.resize_(nbytes)
        assert self.unsharded_param is not None
        self.unsharded_param.requires_grad_(self.sharded_param.requires_grad)
        return self._padded_unsharded

    @property
    def unsharded_numel(self) -> int:
        """Elements of the padded unsharded buffer: world size x padded per-rank slot."""
        return self.shard_numel * self.mesh_info.shard_size

    def post_forward_numel(self, k: int) -> int:
        return self.unsharded_numel // k

    def keep_post_forward_slice(self, k: int, index: int) -> None:
        """Keep this rank's 1/k of the padded full parameter before it is freed."""
        assert self._padded_unsharded is not None
        self.post_forward_slice = self._padded_unsharded.view(k, -1)[index].clone()

    def free_unsharded(self) -> None:
        """Release the unsharded storage; the tensor objects stay, so autograd's saved
        references see the data again after the next all-gather."""
        if self._padded_unsharded is not None:
            self._padded_unsharded.untyped_storage().resize_(0)

    # -- which tensor the modules see --------------------------------------------

    def register(self, unsharded: bool) -> None:
        param = self.unsharded_param if unsharded else self.sharded_param
        for module, name in self.uses:
            module._parameters[name] = param

    @property
    def unsharded_grad(self) -> torch.Tensor | None:
        return None if self.unsharded_param is None else self.unsharded_param.grad

    def accumulate_sharded_grad(self, local: torch.Tensor) -> None:
        """Add this rank's reduced rows to the sharded gradient (or set it)."""
        local = local.to(device=self.shard_device, dtype=self.dtype)
        grad = self.sharded_param.grad
        if grad is None:
            self.sharded_param.grad = self.to_sharded_dtensor(local)
        else:
            grad._local_tensor.add_(local)
