"""Whole matrices from row shards: each matrix is gathered on one owner rank, transformed
there once, and its result scattered back as row shards.

Matrix optimizers (Muon, Shampoo, SOAP, Dion) need every weight matrix whole, but
``fully_shard`` leaves each rank with a block of rows. Instead of gathering every matrix
on every rank (and running the same transform ``W`` times), each matrix gets one owner:

1. every rank sends its rows of each matrix to that matrix's owner (one all-to-all per
   bucket; a bucket is the set of matrices sharded over one process group);
2. the owner assembles its matrices, stacked by shape, and the caller transforms them;
3. the owner sends each rank the rows of the result it holds (one all-to-all back).

Owners are chosen to balance the transform's cost (Newton-Schulz FLOPs by default)
over the ranks. Tensors that need no communication (plain tensors, replicated DTensors,
one-rank shard groups, and 3-D expert weights ``(E, M, N)`` sharded over experts, whose
matrices each rank already holds whole) are handed to the caller as they are.

Rows follow ``torch.chunk`` (and ``DTensor``'s ``Shard(0)``): rank ``r`` of ``W`` holds rows
``[r*c, min((r+1)*c, n))`` with ``c = ceil(n / W)``, so the last ranks may hold none.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = ["MatrixLayout", "matrix_layout", "owned_matrices", "assign_owners", "newton_schulz_flops"]


@dataclass(frozen=True)
class MatrixLayout:
    """Where the rows of one parameter's matrices live.

    ``group`` is None when every rank holds its matrices whole (no communication);
    otherwise dim 0 of the (2-D) tensor is split over ``group`` in ``torch.chunk`` rows.
    """

    name: str
    shape: tuple[int, ...]  # global shape: (M, N), or (E, M, N) for a stack of matrices
    group: dist.ProcessGroup | None  # the shard group; None: local
    world: int  # size of ``group`` (1 when local)
    rank: int  # this rank's index in ``group`` (0 when local)

    def rows(self, rank: int) -> tuple[int, int]:
        """The [start, end) rows of the matrix held by ``rank`` of the shard group."""
        n = self.shape[0]
        chunk = math.ceil(n / self.world) if n else 0
        start = min(rank * chunk, n)
        return start, min(start + chunk, n)


def matrix_layout(tensor: torch.Tensor, name: str) -> MatrixLayout:
    """How ``tensor`` (a parameter, plain or a ``DTensor``) is laid out for matrix optimizers.

    Supported: plain tensors; DTensors whose placements are ``Replicate()`` except at most one
    ``Shard(0)`` (FSDP, HSDP). A 2-D tensor sharded on dim 0 is gathered on an owner; a 3-D
    tensor sharded on dim 0 holds whole matrices on each rank. Anything else (tensor
    parallelism's ``Shard(1)``, ``Partial``, strided shards) raises a ``ValueError`` naming it.

    Example::

        layout = matrix_layout(model.layers[0].attention.wq.weight, "layers.0.attention.wq.weight")
        layout.world  # ranks its rows are spread over (1: local)
    """
    shape = tuple(tensor.shape)
    if tensor.dim() not in (2, 3):
        raise ValueError(
            f"matrix optimizers take 2-D matrices (or 3-D stacks of them, one per expert); "
            f"parameter {name!r} has shape {shape}. Give it to AdamW instead (see "
            "fully_shard.optim.muon_param_groups)."
        )
    if not isinstance(tensor, DTensor):
        return MatrixLayout(name, shape, None, 1, 0)
    mesh, placements = tensor.device_mesh, tensor.placements
    shard_dims = []
    for mesh_dim, placement in enumerate(placements):
        if type(placement) is Shard and placement.dim == 0:
            shard_dims.append(mesh_dim)
        elif not isinstance(placement, Replicate):
            raise ValueError(
                f"parameter {name!r} is a DTensor with placements {tuple(placements)}: a matrix "
                "optimizer can only gather matrices sharded on dim 0 over one mesh dim (FSDP/HSDP); "
                f"{placement} (tensor parallelism or a pending reduction) would make it orthogonalize "
                "each shard on its own. Leave this parameter to AdamW, or shard it only with fully_shard."
            )
    if len(shard_dims) > 1:
        raise ValueError(
            f"parameter {name!r} is sharded on dim 0 over {len(shard_dims)} mesh dims "
            f"{tuple(placements)}: a matrix optimizer gathers rows over one mesh dim only. "
            "Shard it over a single (flattened) mesh dim."
        )
    if not shard_dims or tensor.dim() == 3 or mesh.size(shard_dims[0]) == 1:
        return MatrixLayout(name, shape, None, 1, 0)
    mesh_dim = shard_dims[0]
    return MatrixLayout(name, shape, mesh.get_group(mesh_dim), mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim))


def newton_schulz_flops(shape: Sequence[int], steps: int = 5) -> int:
    """FLOPs of ``steps`` quintic Newton-Schulz iterations on one ``(M, N)`` matrix (or ``(E, M, N)``).

    Example::

        newton_schulz_flops((128, 344))  # 5 * (4 * 128**2 * 344 + 2 * 128**3)
    """
    *batch, m, n = shape
    small, large = min(m, n), max(m, n)
    # per step: X X^T (2 s^2 l), A A (2 s^3), B X (2 s^2 l)
    return math.prod(batch) * steps * (4 * small * small * large + 2 * small**3)


def assign_owners(costs: Sequence[float], world: int) -> list[int]:
    """An owner rank per matrix, balancing the summed cost: largest first, each to the
    least-loaded rank (ties to the lowest rank), so every rank computes the same answer.

    Example::

        assign_owners([8, 4, 4, 1], 2)  # [0, 1, 1, 0]
    """
    load = [0.0] * world
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        owner = min(range(world), key=lambda r: (load[r], r))
        owners[i] = owner
        load[owner] += costs[i]
    return owners


@dataclass
class _Bucket:
    """The matrices sharded over one process group, and their owners."""

    group: dist.ProcessGroup
    world: int
    rank: int
    items: list[int]  # indices into the caller's lists, in their order
    owners: list[int]  # owner rank per item


def _bucket(layouts: Sequence[MatrixLayout], cost: Callable[[tuple[int, ...]], float]) -> tuple[list[int], list[_Bucket]]:
    local: list[int] = []
    by_group: dict[dist.ProcessGroup, list[int]] = {}
    for i, layout in enumerate(layouts):
        if layout.group is None:
            local.append(i)
        else:
            by_group.setdefault(layout.group, []).append(i)
    buckets = []
    for group, items in by_group.items():
        first = layouts[items[0]]
        owners = assign_owners([cost(layouts[i].shape) for i in items], first.world)
        buckets.append(_Bucket(group, first.world, first.rank, items, owners))
    return local, buckets


def _stacks(keys: list[tuple[int, ...]]) -> dict[tuple[int, ...], list[int]]:
    """Positions grouped by key, in first-seen order."""
    out: dict[tuple[int, ...], list[int]] = {}
    for pos, key in enumerate(keys):
        out.setdefault(key, []).append(pos)
    return out


def owned_matrices_local(
    layouts: Sequence[MatrixLayout],
    inputs: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    *,
    comm_dtype: torch.dtype | None = None,
    cost: Callable[[tuple[int, ...]], float] | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The engine of :func:`owned_matrices` on local tensors with known layouts.

    ``inputs[i]`` / ``outputs[i]`` are this rank's parts (local tensors) of matrix ``i``.
    Yields ``(matrices, results)``: ``matrices`` is a ``(B, M, N)`` stack of whole matrices
    of one shape that this rank owns, ``results`` an empty tensor of the same shape (dtype of
    the outputs) for the caller to fill. When the loop ends each ``outputs[i]`` holds this
    rank's rows of its result. All ranks of a shard group must run the loop to its end.
    """
    local, buckets = _bucket(layouts, cost or newton_schulz_flops)
    # 1. send every matrix's rows to its owner: all buckets at once (waited one by one below),
    # so the transfers run while the caller works on the local matrices and earlier buckets
    pending = [_send_to_owners(b, layouts, inputs, comm_dtype) for b in buckets]

    # matrices already whole here: stack by shape, no communication: stack by shape, no communication
    if local:
        mats = [inputs[i].reshape(-1, *inputs[i].shape[-2:]) for i in local]
        for pos in _stacks([tuple(m.shape[1:]) for m in mats]).values():
            stack = torch.cat([mats[p] for p in pos]) if len(pos) > 1 else mats[pos[0]]
            if comm_dtype is not None:
                stack = stack.to(comm_dtype)
            result = torch.empty(stack.shape, dtype=outputs[local[pos[0]]].dtype, device=stack.device)
            yield stack, result
            offset = 0
            for p in pos:
                out, count = outputs[local[p]], mats[p].shape[0]
                out.copy_(result[offset : offset + count].view(out.shape))
                offset += count

    returns = []
    for bucket, (work, recv, recv_splits) in zip(buckets, pending):
        if work is not None:
            work.wait()
        # 2. assemble whole matrices, stacked by shape, and hand them to the caller
        mine = [k for k, owner in enumerate(bucket.owners) if owner == bucket.rank]
        pieces = torch.split(recv, recv_splits)  # pieces[s]: rank s's rows of my matrices, in bucket order
        starts = []  # starts[j][s]: where my j-th matrix's rows from rank s begin in pieces[s]
        offsets = [0] * bucket.world
        for k in mine:
            layout = layouts[bucket.items[k]]
            starts.append(list(offsets))
            for s in range(bucket.world):
                start, end = layout.rows(s)
                offsets[s] += (end - start) * layout.shape[1]
        shapes = [layouts[bucket.items[k]].shape for k in mine]
        results: dict[int, torch.Tensor] = {}
        for shape, pos in _stacks(shapes).items():  # pos: indices into mine
            stack = torch.empty((len(pos), *shape), dtype=recv.dtype, device=recv.device)
            for b, j in enumerate(pos):
                layout = layouts[bucket.items[mine[j]]]
                for s in range(bucket.world):
                    start, end = layout.rows(s)
                    piece = pieces[s][starts[j][s] : starts[j][s] + (end - start) * shape[1]]
                    stack[b, start:end].copy_(piece.view(end - start, shape[1]))
            out_dtype = outputs[bucket.items[mine[pos[0]]]].dtype
            result = torch.empty(stack.shape, dtype=out_dtype, device=stack.device)
            yield stack, result
            for b, p in enumerate(pos):
                results[mine[p]] = result[b]
        # 3. send each rank its rows of the results I own
        returns.append(_send_back(bucket, layouts, outputs, mine, results))
    for bucket, (work, recv, recv_splits) in zip(buckets, returns):
        if work is not None:
            work.wait()
        pieces = torch.split(recv, recv_splits)
        offsets = [0] * bucket.world
        for k, owner in enumerate(bucket.owners):
            out = outputs[bucket.items[k]]
            n = out.numel()
            out.copy_(pieces[owner][offsets[owner] : offsets[owner] + n].view(out.shape))
            offsets[owner] += n


def _all_to_all(
    send: list[list[torch.Tensor]], recv_splits: list[int], group: dist.ProcessGroup, like: torch.Tensor, dtype: torch.dtype
) -> tuple[dist.Work | None, torch.Tensor, list[int]]:
    flat = [t.reshape(-1).to(dtype) for per_rank in send for t in per_rank]
    send_buf = torch.cat(flat) if flat else torch.empty(0, dtype=dtype, device=like.device)
    recv_buf = torch.empty(sum(recv_splits), dtype=dtype, device=like.device)
    send_splits = [sum(t.numel() for t in per_rank) for per_rank in send]
    work = dist.all_to_all_single(recv_buf, send_buf, recv_splits, send_splits, group=group, async_op=True)
    return work, recv_buf, recv_splits


def _send_to_owners(
    bucket: _Bucket, layouts: Sequence[MatrixLayout], inputs: Sequence[torch.Tensor], comm_dtype: torch.dtype | None
) -> tuple[dist.Work | None, torch.Tensor, list[int]]:
    send: list[list[torch.Tensor]] = [[] for _ in range(bucket.world)]
    recv_splits = [0] * bucket.world
    for k, i in enumerate(bucket.items):
        owner = bucket.owners[k]
        send[owner].append(inputs[i])
        if owner == bucket.rank:
            for s in range(bucket.world):
                start, end = layouts[i].rows(s)
                recv_splits[s] += (end - start) * layouts[i].shape[1]
    like = inputs[bucket.items[0]]
    return _all_to_all(send, recv_splits, bucket.group, like, comm_dtype or like.dtype)


def _send_back(
    bucket: _Bucket,
    layouts: Sequence[MatrixLayout],
    outputs: Sequence[torch.Tensor],
    mine: list[int],
    results: dict[int, torch.Tensor],
) -> tuple[dist.Work | None, torch.Tensor, list[int]]:
    send: list[list[torch.Tensor]] = [[] for _ in range(bucket.world)]
    for k in mine:
        layout = layouts[bucket.items[k]]
        for s in range(bucket.world):
            start, end = layout.rows(s)
            send[s].append(results[k][start:end])
    recv_splits = [0] * bucket.world
    for k, owner in enumerate(bucket.owners):
        recv_splits[owner] += outputs[bucket.items[k]].numel()
    like = outputs[bucket.items[0]]
    return _all_to_all(send, recv_splits, bucket.group, like, like.dtype)


def owned_matrices(
    inputs: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    *,
    names: Sequence[str] | None = None,
    comm_dtype: torch.dtype | None = None,
    cost: Callable[[tuple[int, ...]], float] | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Transform whole matrices once, on one owner rank each, from row-sharded inputs.

    ``inputs`` are sharded like ``fully_shard``'s parameters (``DTensor``s, or plain tensors);
    ``outputs`` are tensors with the local shapes of the inputs that receive this rank's rows of
    each result. The loop yields ``(matrices, results)`` pairs: ``matrices`` a ``(B, M, N)`` stack
    of the whole matrices of one shape that this rank owns, ``results`` a tensor of that shape
    for the loop body to fill. When the loop ends, the outputs are filled. Every rank must run
    the loop to its end (it holds the collectives); a rank may own nothing. ``comm_dtype``
    casts the matrices before they travel (Muon: ``torch.bfloat16``, its compute dtype).
    ``cost(shape)`` is the per-matrix work that owners balance (default: Newton-Schulz FLOPs).

    Example (a matrix-sign optimizer step on sharded gradients)::

        grads = [p.grad for p in matrices]                 # DTensors, sharded on dim 0
        outs = [torch.empty_like(g.to_local()) for g in grads]
        for stack, result in owned_matrices(grads, outs):
            u, _, vh = torch.linalg.svd(stack, full_matrices=False)   # whole matrices, batched
            result.copy_(u @ vh)
        for p, out in zip(matrices, outs):
            p.to_local().add_(out, alpha=-lr)
    """
    if len(inputs) != len(outputs):
        raise ValueError(f"owned_matrices: {len(inputs)} inputs but {len(outputs)} outputs")
    names = list(names) if names is not None else [f"inputs[{i}]" for i in range(len(inputs))]
    layouts = [matrix_layout(t, n) for t, n in zip(inputs, names)]
    locals_ = [t.to_local() if isinstance(t, DTensor) else t for t in inputs]
    for t, out, name in zip(locals_, outputs, names):
        if out.shape != t.shape:
            raise ValueError(
                f"owned_matrices: output for {name!r} has shape {tuple(out.shape)}, but this rank's "
                f"part of the input has shape {tuple(t.shape)}; pass torch.empty_like(input.to_local())"
            )
    return owned_matrices_local(layouts, locals_, outputs, comm_dtype=comm_dtype, cost=cost)
