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
matrices each rank already holds whole) are stacked by shape and handed to the caller.

The buffers are laid out once per list of layouts (:class:`_Plan`): each rank's rows of a
stack's matrices travel as one ``(B, rows, N)`` block, so assembling a stack costs one copy
per rank, and the inputs and outputs are views of the send and receive buffers (``Muon``
packs its momentum straight into them and updates its parameters straight from them).

Rows follow ``torch.chunk`` (and ``DTensor``'s ``Shard(0)``): rank ``r`` of ``W`` holds rows
``[r*c, min((r+1)*c, n))`` with ``c = ceil(n / W)``, so the last ranks may hold none.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = ["MatrixLayout", "matrix_layout", "owned_matrices", "assign_owners", "newton_schulz_flops", "sent_bytes"]


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

        >>> sharded = [fully_shard(m) for m in (*model.layers, model)]  # each block, then the root
        >>> layout = matrix_layout(model.layers[0].attention.wq.weight, "layers.0.attention.wq.weight")
        >>> layout.world  # ranks its rows are spread over (1: local)
        1
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

        >>> newton_schulz_flops((128, 344))  # 5 * (4 * 128**2 * 344 + 2 * 128**3)
        133693440
    """
    *batch, m, n = shape
    small, large = min(m, n), max(m, n)
    # per step: X X^T (2 s^2 l), A A (2 s^3), B X (2 s^2 l)
    return math.prod(batch) * steps * (4 * small * small * large + 2 * small**3)


def assign_owners(costs: Sequence[float], world: int) -> list[int]:
    """An owner rank per matrix, balancing the summed cost: largest first, each to the
    least-loaded rank (ties to the lowest rank), so every rank computes the same answer.

    Example::

        >>> assign_owners([8, 4, 4, 1], 2)
        [0, 1, 1, 0]
    """
    load = [0.0] * world
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        owner = min(range(world), key=lambda r: (load[r], r))
        owners[i] = owner
        load[owner] += costs[i]
    return owners


def sent_bytes(shapes: Sequence[tuple[int, int]], world: int, element_size: int = 2) -> list[int]:
    """Bytes each rank of ``world`` sends in one owner round trip over matrices of ``shapes`` sharded on dim 0 (one
    bucket, owners as :func:`assign_owners` places them by :func:`newton_schulz_flops`): rank ``r`` sends its rows of
    every matrix it does not own to the owner, and, for every matrix it owns, the other ranks' rows of the result
    back. Pure arithmetic on the layout (the benchmarks' prediction of ``owned_matrices``' traffic).

    Example::

        sent_bytes([(8, 4), (6, 4)], world=2)  # [56, 56]: rank 0 owns the 8x4, rank 1 the 6x4
    """
    owners = assign_owners([newton_schulz_flops(s) for s in shapes], world)
    sent = [0] * world
    for (rows, cols), owner in zip(shapes, owners):
        layout = MatrixLayout("", (rows, cols), None, world, 0)
        for r in range(world):
            start, end = layout.rows(r)
            sent[r] += ((end - start) if r != owner else rows - (end - start)) * cols * element_size
    return sent


def _stacks(keys: Sequence[tuple[int, ...]]) -> dict[tuple[int, ...], list[int]]:
    """Positions grouped by key, in first-seen order."""
    out: dict[tuple[int, ...], list[int]] = {}
    for pos, key in enumerate(keys):
        out.setdefault(key, []).append(pos)
    return out


def _rows_numel(layout: MatrixLayout, rank: int) -> int:
    start, end = layout.rows(rank)
    return (end - start) * layout.shape[1]


_Cost = Callable[[tuple[int, ...]], float]


@dataclass
class _Stack:
    """Matrices of one ``(M, N)`` shape transformed together as one ``(B, M, N)`` stack."""

    shape: tuple[int, ...]  # (M, N) of each matrix
    items: list[int]  # the caller's indices, in stack order


@dataclass
class _Bucket:
    """The matrices sharded over one process group, their owners, and where every rank's rows
    of them sit in the two exchange buffers (one layout each way, see :class:`_Plan`)."""

    group: dist.ProcessGroup
    world: int
    rank: int
    order: list[int]  # the caller's indices in buffer order: by owner rank, then the owner's stacks
    numels: list[int]  # elements of this rank's rows of each, in that order
    splits: list[int]  # per owner rank: elements of this rank's rows of its matrices
    peer_splits: list[int]  # per rank: elements of its rows of the matrices this rank owns
    mine: list[_Stack]  # the stacks this rank owns
    pieces: list[list[tuple[int, int, int]]]  # per stack of mine, per rank: (offset in my buffer, start row, end row)


def _plan_bucket(group: dist.ProcessGroup, layouts: Sequence[MatrixLayout], items: list[int], cost: _Cost) -> _Bucket:
    world, rank = layouts[items[0]].world, layouts[items[0]].rank
    owned: list[list[int]] = [[] for _ in range(world)]
    for i, owner in zip(items, assign_owners([cost(layouts[i].shape) for i in items], world)):
        owned[owner].append(i)
    stacks = [[_Stack(shape, [mine[p] for p in pos])
               for shape, pos in _stacks([layouts[i].shape for i in mine]).items()]
              for mine in owned]
    order = [i for per_owner in stacks for stack in per_owner for i in stack.items]
    numels = [_rows_numel(layouts[i], rank) for i in order]
    splits, at = [], 0
    for per_owner in stacks:
        count = sum(len(stack.items) for stack in per_owner)
        splits.append(sum(numels[at : at + count]))
        at += count
    # what this rank receives, rank by rank: that rank's rows of my stacks, in stack order
    # (the same rows of a stack's matrices from one rank form one (B, rows, N) block)
    mine = stacks[rank]
    pieces: list[list[tuple[int, int, int]]] = [[] for _ in mine]
    peer_splits, offset = [], 0
    for peer in range(world):
        begin = offset
        for stack, where in zip(mine, pieces):
            start, end = layouts[stack.items[0]].rows(peer)  # the same for every matrix of the stack
            where.append((offset, start, end))
            offset += len(stack.items) * (end - start) * stack.shape[1]
        peer_splits.append(offset - begin)
    return _Bucket(group, world, rank, order, numels, splits, peer_splits, mine, pieces)


class _Plan:
    """Where every matrix goes, computed once for a list of layouts (``Muon`` keeps it across
    steps): the stacks of matrices held whole here, the buckets, their owners and split sizes.

    Each bucket uses two flat buffers, each in one layout for both directions: this rank's rows
    of every matrix, grouped by owner (what it sends, and where the results come back), and every
    rank's rows of the matrices it owns (what it receives, and what it sends back)."""

    def __init__(self, layouts: Sequence[MatrixLayout], local_shapes: Sequence[Sequence[int]], cost: _Cost) -> None:
        self.shapes = [tuple(s) for s in local_shapes]  # this rank's part of each matrix
        local: list[int] = []
        by_group: dict[dist.ProcessGroup, list[int]] = {}
        for i, layout in enumerate(layouts):
            if layout.group is None:
                local.append(i)
            else:
                by_group.setdefault(layout.group, []).append(i)
        self.local = [_Stack(shape, [local[p] for p in pos])
                      for shape, pos in _stacks([layouts[i].shape[-2:] for i in local]).items()]
        self.buckets = [_plan_bucket(group, layouts, items, cost) for group, items in by_group.items()]

    def start(self, dtypes: Sequence[torch.dtype], out_dtypes: Sequence[torch.dtype],
              device: torch.device) -> _Exchange:
        """Buffers for one step: matrix ``i`` travels in ``dtypes[i]`` and its result in ``out_dtypes[i]``
        (per bucket and stack: those of its first matrix)."""
        return _Exchange(self, dtypes, out_dtypes, device)


class _Exchange:
    """One step's buffers. Write this rank's part of matrix ``i`` into ``inputs[i]``, run the
    :meth:`run` loop to its end, and ``outputs[i]`` holds this rank's rows of its result."""

    def __init__(self, plan: _Plan, dtypes: Sequence[torch.dtype], out_dtypes: Sequence[torch.dtype],
                 device: torch.device) -> None:
        self.plan = plan
        self.inputs: list[torch.Tensor] = [torch.empty(0)] * len(plan.shapes)
        self.outputs: list[torch.Tensor] = [torch.empty(0)] * len(plan.shapes)
        self._local: list[tuple[torch.Tensor, torch.Tensor]] = []
        for stack in plan.local:  # (B, M, N): every matrix of this shape, whole
            counts = [math.prod(plan.shapes[i][:-2]) for i in stack.items]
            whole = torch.empty((sum(counts), *stack.shape), dtype=dtypes[stack.items[0]], device=device)
            result = torch.empty(whole.shape, dtype=out_dtypes[stack.items[0]], device=device)
            for i, part, out in zip(stack.items, whole.split(counts), result.split(counts)):
                self.inputs[i], self.outputs[i] = part.view(plan.shapes[i]), out.view(plan.shapes[i])
            self._local.append((whole, result))
        self._buffers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for bucket in plan.buckets:
            dtype, out_dtype = dtypes[bucket.order[0]], out_dtypes[bucket.order[0]]
            send = torch.empty(sum(bucket.splits), dtype=dtype, device=device)  # 1-D, this rank's rows by owner
            recv = torch.empty(sum(bucket.peer_splits), dtype=dtype, device=device)  # 1-D, every rank's rows of mine
            # the results reuse the buffers of the same layout when the dtype allows
            back = send if out_dtype == dtype else torch.empty(send.shape, dtype=out_dtype, device=device)
            sent = recv if out_dtype == dtype else torch.empty(recv.shape, dtype=out_dtype, device=device)
            ins = [part.view(plan.shapes[i]) for i, part in zip(bucket.order, send.split(bucket.numels))]
            outs = ins if back is send else [out.view(plan.shapes[i])
                                             for i, out in zip(bucket.order, back.split(bucket.numels))]
            for i, part, out in zip(bucket.order, ins, outs):
                self.inputs[i], self.outputs[i] = part, out
            self._buffers.append((send, recv, sent, back))

    def run(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield ``(matrices, results)``: a ``(B, M, N)`` stack of whole matrices and a tensor of
        its shape for the caller to fill; every rank of a shard group must run it to its end."""
        # 1. send every matrix's rows to its owner: all buckets at once (waited one by one below),
        # so the transfers run while the caller works on the local matrices and earlier buckets
        pending = [_all_to_all(recv, send, b.peer_splits, b.splits, b.group)
                   for b, (send, recv, _, _) in zip(self.plan.buckets, self._buffers)]
        yield from self._local  # matrices already whole here: no communication
        returns = []
        for bucket, (_, recv, sent, back), work in zip(self.plan.buckets, self._buffers, pending):
            work.wait()
            # 2. assemble whole matrices from each rank's (B, rows, N) block, hand them to the caller
            for stack, pieces in zip(bucket.mine, bucket.pieces):
                count, cols = len(stack.items), stack.shape[1]
                whole = torch.empty((count, *stack.shape), dtype=recv.dtype, device=recv.device)
                for offset, start, end in pieces:
                    whole[:, start:end].copy_(
                        recv[offset : offset + count * (end - start) * cols].view(count, end - start, cols)
                    )
                result = torch.empty(whole.shape, dtype=sent.dtype, device=sent.device)
                yield whole, result
                for offset, start, end in pieces:  # this stack's blocks only: the next ones are still to read
                    sent[offset : offset + count * (end - start) * cols].view(count, end - start, cols).copy_(
                        result[:, start:end]
                    )
            # 3. send each rank its rows of the results I own (into the layout it sent from)
            returns.append(_all_to_all(back, sent, bucket.splits, bucket.peer_splits, bucket.group))
        for work in returns:
            work.wait()


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
    if not inputs:
        return
    plan = _Plan(layouts, [t.shape for t in inputs], cost or newton_schulz_flops)
    exchange = plan.start([comm_dtype or t.dtype for t in inputs], [t.dtype for t in outputs], inputs[0].device)
    torch._foreach_copy_(exchange.inputs, list(inputs))  # into the send buffers (cast to comm_dtype)
    yield from exchange.run()
    torch._foreach_copy_(list(outputs), exchange.outputs)


def _all_to_all(recv: torch.Tensor, send: torch.Tensor, recv_splits: list[int], send_splits: list[int],
                group: Any) -> dist.Work:
    work: dist.Work | None = dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group, async_op=True)
    assert work is not None  # async_op=True
    return work


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

        >>> sharded = [fully_shard(m) for m in (*model.layers, model)]  # each block, then the root
        >>> model(tokens).sum().backward()
        >>> matrices, lr = [p for p in model.layers.parameters() if p.ndim == 2], 0.02
        >>> grads = [p.grad for p in matrices]  # DTensors, sharded on dim 0
        >>> outs = [torch.empty_like(g.to_local()) for g in grads]
        >>> for stack, result in owned_matrices(grads, outs):
        ...     u, _, vh = torch.linalg.svd(stack, full_matrices=False)  # whole matrices, batched
        ...     result[:] = u @ vh
        >>> with torch.no_grad():
        ...     for p, out in zip(matrices, outs):
        ...         local = p.to_local()  # this rank's rows of the parameter
        ...         local -= lr * out
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
