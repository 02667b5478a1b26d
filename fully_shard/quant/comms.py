"""Quantized all-gather and reduce-scatter as objects of torch's Comm API, and ``quantize_comms`` to set them.

The objects see only flat buffers, as torch's ``AllGather`` / ``ReduceScatter`` protocol gives them (FSDP's packed
per-rank slots, docs/design.md "Buffer layouts"), so the same object works on fully_shard and on torch's FSDP2. Every
collective completes inside the call and returns ``None``: on the CPU (gloo) it blocks; on an accelerator the
collective's wait is a stream wait, and the dequantization is queued after it on the caller's stream.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..compat import premul_sum_factor
from . import blocks

FORMATS = {"int8": 8, "int4": 4}
DEFAULT_BLOCK = 256


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    # looked up at call time: torch 2.13's name, or the older one (and a test's recorder sees either)
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup,
                    op: Any = dist.ReduceOp.SUM) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, op=op, group=group)


def _sum_rows(rows: torch.Tensor) -> torch.Tensor:
    """Sum a ``(ranks, n)`` fp32 tensor over ranks in rank order: the same bits on every device and every run."""
    acc = rows[0].clone()
    for row in rows[1:]:
        acc += row
    return acc


def _finish_op(acc: torch.Tensor, op: Any, world: int) -> torch.Tensor:
    """Apply what a reduce op does beyond summing: AVG divides by the group size, PREMUL_SUM multiplies by its
    factor (torch's FSDP2 passes it for a custom gradient divide factor)."""
    kind = getattr(op, "op", op)  # a ReduceOp object (PREMUL_SUM) or a RedOpType
    if kind == dist.ReduceOp.SUM:
        return acc
    if kind == dist.ReduceOp.AVG:
        return acc.div_(world)
    if kind == dist.ReduceOp.PREMUL_SUM:
        return acc.mul_(premul_sum_factor(op))
    raise ValueError(f"quantized reduce-scatter: reduce op {kind} is not supported (SUM, AVG and PREMUL_SUM are)")


@dataclass(frozen=True)
class Layout:
    """Where one module's parameters lie in its flat buffers, and which of them travel unquantized.

    A buffer of ``n`` elements per rank over ``g`` ranks holds, in order, each parameter's ``padded[i] // g``
    elements (its padded unsharded size split over the ranks): the all-gather input and the reduce-scatter output
    over the shard group, or over the ``k`` ranks of ``reshard_after_forward=k``.
    """

    module: str  # for messages
    names: tuple[str, ...]
    padded: tuple[int, ...]  # each parameter's unsharded numel, padded to a multiple of the shard group size
    exact: tuple[bool, ...]

    def indices(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(positions to quantize, positions sent exactly) within a buffer of ``n`` elements per rank; None if the
        buffer does not split into the parameters (some got no gradient this step, or several dtype buckets)."""
        total = sum(self.padded)
        g = total // n if n else 0
        if not n or total % n or any(u % g for u in self.padded):
            return None
        mask = torch.tensor(self.exact).repeat_interleave(torch.tensor(self.padded) // g)
        return mask.logical_not().nonzero().view(-1).to(device), mask.nonzero().view(-1).to(device)


def _layout(module: str, params: list[tuple[str, DTensor, bool]]) -> Layout | None:
    """The layout of ``params`` (name, parameter, kept exact), or None when none is kept exact."""
    if not any(e for _, _, e in params):
        return None
    return Layout(module, tuple(n for n, _, _ in params), tuple(_padded_numel(n, module, p) for n, p, _ in params),
                  tuple(e for _, _, e in params))


@dataclass(frozen=True)
class ErrorRecord:
    """One quantized collective against the exact one on the same input (``measure=True``), over its quantized
    elements: the error in units of the block scheme's scale (the block's largest magnitude for an all-gather; the
    sum over ranks of the blocks' largest magnitudes, divided as the op divides, for a reduction), next to the
    analytic bound in the same units.

    Example::

        >>> comm = QuantReduceScatter(bits=8, measure=True)  # as quantize_comms(model, measure=True) sets them
        >>> grads = torch.randn(dist.get_world_size() * 1000)  # 1000 values per rank
        >>> comm(torch.empty(1000), grads, dist.group.WORLD, dist.ReduceOp.AVG)
        >>> record = comm.errors[-1]
        >>> record.kind, record.numel, record.max_ratio <= 1  # within the bound
        ('reduce_scatter', 1000, True)
    """

    kind: str  # "all_gather" | "reduce_scatter" | "all_reduce"
    numel: int  # quantized elements compared on this rank
    max_error: float  # max |quantized - exact| / scale
    bound: float  # max analytic bound / scale (about 1 / (2q) plus rounding)
    max_ratio: float  # max |quantized - exact| / analytic bound, elementwise: <= 1
    rel_l2: float  # ||quantized - exact|| / ||exact||


def _record(kind: str, got: torch.Tensor, exact: torch.Tensor, scale: torch.Tensor, bound: torch.Tensor) -> ErrorRecord:
    err = (got.float() - exact.float()).abs()
    pos = scale > 0
    norm = exact.float().norm().item()
    return ErrorRecord(kind, got.numel(), (err[pos] / scale[pos]).max().item() if pos.any() else 0.0,
                       (bound[pos] / scale[pos]).max().item() if pos.any() else 0.0, (err / bound).max().item(),
                       err.norm().item() / norm if norm > 0 else 0.0)


class _Quantized:
    """What both Comm objects share: the format, the optional layout, and torch's ``allocate``."""

    def __init__(self, bits: int, block_size: int, layout: Layout | None, measure: bool) -> None:
        blocks.check_format(bits, block_size)
        self.bits, self.block_size, self.layout = bits, block_size, layout
        self._indices: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor] | None] = {}
        # measure=True: run the exact collective too and keep one record per call (benchmarks, tests; twice the bytes)
        self.errors: list[ErrorRecord] | None = [] if measure else None

    def _quantized_part(self, x: torch.Tensor, split: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        return x if split is None else x.index_select(x.dim() - 1, split[0])

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _split(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.layout is None:
            return None
        key = (n, device)
        if key not in self._indices:
            split = self.layout.indices(n, device)
            if split is None:
                warnings.warn(
                    f"fully_shard.quant: a collective of {self.layout.module!r} has {n} elements per rank, which do "
                    f"not split into its parameters ({', '.join(self.layout.names)}): some got no gradient this step, "
                    "or the group gathers several dtypes. Such collectives quantize every element, the parameters kept "
                    "exact included (within the same bound). Give unused parameters a gradient "
                    "(set_reduce_scatter_unused_params) or keep the whole module exact (skip=) to avoid "
                    "it.", stacklevel=2)
            self._indices[key] = split
        return self._indices[key]

    def _encode(self, x: torch.Tensor, split: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """``x`` (rows, n) -> (rows, bytes): the quantized part, then the exact part's own bytes."""
        if split is None:
            return blocks.quantize(x, self.bits, self.block_size)
        quant, exact = split
        q = blocks.quantize(x.index_select(1, quant), self.bits, self.block_size)
        return torch.cat([q, x.index_select(1, exact).contiguous().view(torch.uint8)], dim=1)

    def _decode(self, wire: torch.Tensor, n: int, dtype: torch.dtype,
                split: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(dequantized part (rows, n or n_quant) fp32, exact part (rows, n_exact) in ``dtype`` or None)."""
        nq = n if split is None else split[0].numel()
        qb = blocks.row_bytes(nq, self.bits, self.block_size)
        values = blocks.dequantize(wire[:, :qb], nq, self.bits, self.block_size)
        return values, None if split is None else blocks.as_dtype(wire[:, qb:], dtype)

    def wire_bytes(self, n: int, dtype: torch.dtype) -> int:
        """Bytes of a row of ``n`` elements of ``dtype`` on the wire: its quantized blocks and its exact elements (an
        all-gather's input; a reduce-scatter's is one such row per rank).

        Example::

            >>> QuantAllGather(bits=8, block_size=256).wire_bytes(1000, torch.bfloat16)  # 4 blocks of 4 + 256 bytes
            1040
        """
        split = self._split(n, torch.device("cpu"))
        nq, ne = (n, 0) if split is None else (split[0].numel(), split[1].numel())
        return blocks.row_bytes(nq, self.bits, self.block_size) + ne * dtype.itemsize


class QuantAllGather(_Quantized):
    """A block-quantized all-gather of parameters: torch's ``AllGather`` Comm (``set_custom_all_gather``).

    Each rank quantizes its packed shards (``block_size`` values per fp32 scale, int8 by default), all ranks gather
    the codes and scales in one all-gather of bytes, and every rank dequantizes all of them (its own shard too, so
    every rank computes with the same weights) into the unsharded buffer, in the parameter dtype. Bytes per rank:
    ``ceil(n / block_size) * (4 + block_size)`` for int8 instead of ``n * itemsize``. Each gathered value is within
    ``blocks.roundtrip_bound`` (about ``amax / 254`` for int8, ``amax`` its block's largest magnitude) of the exact
    one. Buffers that are not floating point (tensor subclasses gathering bytes, e.g. float8) are gathered as they are.

    Example::

        >>> from fully_shard.quant import QuantAllGather
        >>> sharded = [fully_shard(m) for m in (*model.layers, model)]  # each block, then the root
        >>> for block in model.layers:
        ...     block.set_custom_all_gather(QuantAllGather(bits=8, block_size=256))  # also on torch's FSDP2
        >>> model(tokens).sum().backward()  # the blocks' weights travel as int8
    """

    def __init__(self, bits: int = 8, block_size: int = DEFAULT_BLOCK, layout: Layout | None = None,
                 measure: bool = False) -> None:
        super().__init__(bits, block_size, layout, measure)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> None:
        if not input_tensor.is_floating_point():
            _all_gather(output_tensor, input_tensor, group)
            return None
        g, n = group.size(), input_tensor.numel()
        split = self._split(n, input_tensor.device)
        original = input_tensor.clone() if self.errors is not None else None
        wire = self._encode(input_tensor.view(1, n), split)  # read before the output (the input is a view of it)
        gathered = torch.empty(g, wire.shape[1], dtype=torch.uint8, device=wire.device)
        _all_gather(gathered.view(-1), wire.view(-1), group)
        values, exact = self._decode(gathered, n, input_tensor.dtype, split)
        out = output_tensor.view(g, n)
        if split is None:
            out.copy_(values)
        else:
            out.index_copy_(1, split[0], values.to(out.dtype))
            out.index_copy_(1, split[1], exact)  # type: ignore[arg-type]
        if original is not None:
            self._measure(out, original, group, split)
        return None

    def _measure(self, out: torch.Tensor, original: torch.Tensor, group: dist.ProcessGroup,
                 split: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        exact = torch.empty_like(out)
        _all_gather(exact.view(-1), original, group)
        ref = self._quantized_part(exact, split)  # (g, quantized elements): row j as rank j quantized it
        amax = blocks.block_amax(ref, self.block_size)
        bound = blocks.roundtrip_bound(amax, self.bits, out.dtype)
        assert self.errors is not None
        self.errors.append(_record("all_gather", self._quantized_part(out, split), ref, amax, bound))


class QuantReduceScatter(_Quantized):
    """A block-quantized reduce-scatter of gradients with fp32 accumulation: torch's ``ReduceScatter`` Comm
    (``set_custom_reduce_scatter``).

    Each rank quantizes the ``g`` chunks of its input separately (int8 or int4, ``block_size`` values per fp32
    scale) and sends chunk ``r`` to rank ``r`` (one all-to-all of bytes); each rank dequantizes the ``g`` chunks it
    received, sums them in fp32 in rank order and applies the op (``AVG`` divides by ``g``; ``PREMUL_SUM``, torch's
    custom divide factor, multiplies), then writes the result in the reduce dtype. Pre- and post-divide factors are
    the caller's, as for the exact collective, so ``reduce_dtype`` and ``set_gradient_divide_factor`` keep their
    meaning. Error: ``blocks.reduce_bound``, about ``sum_j amax_j / (2 q)`` over the ranks' blocks (q = 127, 7).

    On fully_shard, HSDP's all-reduce across replicas goes through :meth:`all_reduce` too (an extension of torch's
    protocol; torch's FSDP2 keeps its own, unquantized): a quantized all-to-all reduce then a quantized all-gather
    of the summed chunks, so the cross-replica traffic shrinks as well; ``replicate=False`` keeps it exact.

    Example::

        >>> from fully_shard.quant import QuantReduceScatter
        >>> sharded = [fully_shard(m) for m in (*model.layers, model)]  # each block, then the root
        >>> for block in model.layers:
        ...     block.set_custom_reduce_scatter(QuantReduceScatter(bits=4, block_size=128))
        >>> model(tokens).sum().backward()  # the blocks' gradients travel as int4
    """

    def __init__(self, bits: int = 8, block_size: int = DEFAULT_BLOCK, layout: Layout | None = None,
                 replicate: bool = True, measure: bool = False) -> None:
        super().__init__(bits, block_size, layout, measure)
        self.replicate = replicate

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, op: Any,
                 async_op: bool = False) -> None:
        g, n = group.size(), output_tensor.numel()
        split = self._split(n, input_tensor.device)
        wire = self._encode(input_tensor.view(g, n), split)  # row r: the chunk for rank r
        received = torch.empty_like(wire)
        dist.all_to_all_single(received.view(-1), wire.view(-1), group=group)
        values, exact = self._decode(received, n, input_tensor.dtype, split)  # row j: rank j's chunk for this rank
        self._write(output_tensor, _finish_op(_sum_rows(values), op, g), exact, op, g, split)
        if self.errors is not None:
            self._measure(output_tensor, input_tensor.view(g, n), group, op, split)
        return None

    def _measure(self, out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup, op: Any,
                 split: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        g, premul = x.shape[0], getattr(op, "op", op) == dist.ReduceOp.PREMUL_SUM
        exact = torch.empty_like(out)
        _reduce_scatter(exact, x.reshape(-1), group, dist.ReduceOp.SUM if premul else op)
        if premul:
            exact.mul_(float(op.factor))
        xq = self._quantized_part(x, split).float()
        amax_sum, abs_sum = (torch.empty(xq.shape[1], device=x.device) for _ in range(2))
        _reduce_scatter(amax_sum, blocks.block_amax(xq, self.block_size).reshape(-1), group)
        _reduce_scatter(abs_sum, xq.abs().reshape(-1), group)
        divisor = {dist.ReduceOp.AVG: g, dist.ReduceOp.PREMUL_SUM: 1 / float(getattr(op, "factor", 1.0))}.get(
            getattr(op, "op", op), 1
        )
        bound = (blocks.reduce_bound(amax_sum, self.bits, out.dtype, g, divisor)
                 + blocks.exact_error(abs_sum, out.dtype, g, divisor))
        assert self.errors is not None
        self.errors.append(_record("reduce_scatter", self._quantized_part(out, split),
                                   self._quantized_part(exact, split), amax_sum / divisor, bound))

    def _write(self, out: torch.Tensor, acc: torch.Tensor, exact: torch.Tensor | None, op: Any, g: int,
               split: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        if split is None:
            out.copy_(acc)
            return
        assert exact is not None
        flat = out.view(-1)
        flat.index_copy_(0, split[0], acc.to(out.dtype))
        flat.index_copy_(0, split[1], _finish_op(_sum_rows(exact.float()), op, g).to(out.dtype))

    def all_reduce(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: dist.ProcessGroup | None = None,
                   async_op: bool = False) -> None:
        """HSDP on fully_shard: all-reduce a reduce-scatter output across replicas, in place, quantized: each
        replica sends quantized chunks to their owners (all-to-all), each owner sums its chunk in fp32, quantizes the
        sum again and all replicas gather it. Error: ``blocks.all_reduce_bound``; with the reduce-scatter before it,
        ``blocks.two_level_bound``. fully_shard calls it; by hand:

        Example::

            >>> comm = QuantReduceScatter(bits=8)
            >>> shard_group, replicate_group = dist.new_group(), dist.new_group()  # e.g. an HSDP mesh's two dims
            >>> grads = torch.randn(dist.get_world_size(shard_group) * 1000)  # 1000 values per rank of shard_group
            >>> out = torch.empty(1000)
            >>> comm(out, grads, shard_group, dist.ReduceOp.AVG)  # the reduce-scatter within the shard group
            >>> comm.all_reduce(out, op=dist.ReduceOp.AVG, group=replicate_group)
        """
        if not self.replicate:
            dist.all_reduce(tensor, op=op, group=group)
            return None
        r, n = dist.get_world_size(group), tensor.numel()
        split = self._split(n, tensor.device)
        flat = tensor.view(-1)
        original = flat.clone() if self.errors is not None else None
        values = flat if split is None else flat.index_select(0, split[0])
        c = math.ceil(values.numel() / r)  # each replica owns c values of the quantized part
        rows = torch.nn.functional.pad(values.float(), (0, r * c - values.numel())).view(r, c)
        wire = blocks.quantize(rows, self.bits, self.block_size)
        received = torch.empty_like(wire)
        dist.all_to_all_single(received.view(-1), wire.view(-1), group=group)
        mine = _finish_op(_sum_rows(blocks.dequantize(received, c, self.bits, self.block_size)), op, r)
        own = blocks.quantize(mine.view(1, c), self.bits, self.block_size)
        gathered = torch.empty(r, own.shape[1], dtype=torch.uint8, device=own.device)
        _all_gather(gathered.view(-1), own.view(-1), group)
        summed = blocks.dequantize(gathered, c, self.bits, self.block_size).reshape(-1)[: values.numel()]
        if split is None:
            flat.copy_(summed)
        else:
            exact = flat.index_select(0, split[1]).float()
            dist.all_reduce(exact, op=dist.ReduceOp.SUM, group=group)  # the few exact values (norms): fp32, unquantized
            flat.index_copy_(0, split[0], summed.to(flat.dtype))
            flat.index_copy_(0, split[1], _finish_op(exact, op, r).to(flat.dtype))
        if original is not None:
            self._measure_all_reduce(flat, original, group, op, split)
        return None

    def _measure_all_reduce(self, out: torch.Tensor, original: torch.Tensor, group: dist.ProcessGroup | None, op: Any,
                            split: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        r = dist.get_world_size(group)
        xq = self._quantized_part(original, split).float()
        exact, abs_sum = xq.clone(), xq.abs()
        amax_sum = xq.abs().amax().reshape(1)
        for t in (exact, abs_sum, amax_sum):
            dist.all_reduce(t, group=group)
        divisor = r if getattr(op, "op", op) == dist.ReduceOp.AVG else 1
        exact /= divisor
        bound = (blocks.all_reduce_bound(amax_sum, self.bits, out.dtype, r, divisor)
                 + blocks.exact_error(abs_sum, torch.float32, r, divisor))
        assert self.errors is not None
        self.errors.append(_record("all_reduce", self._quantized_part(out, split), exact,
                                   (amax_sum / divisor).expand_as(exact), bound.expand_as(exact)))


# -- policy level ------------------------------------------------------------------------------------------------


def default_skip(name: str, module: nn.Module) -> bool:
    """The parameters that stay in their dtype by default, as in ZeRO++: embeddings' and normalization layers'
    (``nn.Embedding``, ``LayerNorm``, ``RMSNorm``, ``GroupNorm``, batch norms, and any class named ``...Norm``).

    Example::

        >>> default_skip("tok_embeddings", nn.Embedding(10, 4)), default_skip("layers.0.ffn", nn.Linear(4, 4))
        (True, False)
    """
    norms = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.modules.batchnorm._NormBase)
    return isinstance(module, (nn.Embedding, nn.EmbeddingBag, *norms)) or type(module).__name__.endswith("Norm")


def _is_fsdp(module: nn.Module) -> bool:
    # fully_shard's FSDPModule or torch's (never imported here): both have torch's Comm setters
    return (callable(getattr(module, "set_custom_all_gather", None))
            and callable(getattr(module, "set_custom_reduce_scatter", None)))


def _padded_numel(name: str, module: str, p: DTensor) -> int:
    """A parameter's unsharded numel padded as FSDP pads it: dim 0 up to a multiple of the shard group size."""
    shards = [(i, pl.dim) for i, pl in enumerate(p.placements) if isinstance(pl, Shard)]
    if len(shards) != 1 or not all(isinstance(pl, (Shard, Replicate)) for pl in p.placements):
        raise ValueError(f"quantize_comms: {module!r} parameter {name!r} has placements {p.placements}: keeping some "
                         f"of {module!r}'s parameters exact needs plain FSDP/HSDP parameters (one Shard, no tensor "
                         "parallelism). Pass a skip= that keeps the whole module exact or quantizes all of it.")
    (mesh_dim, dim), = shards
    world = p.device_mesh.size(mesh_dim)
    if dim > 0:
        return p.numel()
    return math.ceil(p.shape[0] / world) * world * (p.numel() // max(p.shape[0], 1))


def _managed(fsdp_module: nn.Module) -> list[tuple[str, DTensor, list[tuple[str, nn.Module]]]]:
    """The parameters one fully_shard call manages, in the order its flat buffers hold them: (name relative to the
    module, parameter, the modules from the FSDP module down to the one registering it, with their names). Those
    that are not DTensors are its ``ignored_params``: in no buffer."""
    from ..api import walk_params  # the core's pure walk: the order fully_shard (and torch's FSDP2) lay out buffers

    seen: set[int] = set()
    out: list[tuple[str, DTensor, list[tuple[str, nn.Module]]]] = []
    for fqn, _owner, _name, p in walk_params((fsdp_module,), _is_fsdp):
        if id(p) in seen or not isinstance(p, DTensor):
            continue
        seen.add(id(p))
        parts = fqn.split(".")[:-1]
        chain = [(".".join(parts[:i]), fsdp_module.get_submodule(".".join(parts[:i]))) for i in range(len(parts) + 1)]
        out.append((fqn, p, chain))
    return out


@dataclass(frozen=True)
class ModuleComms:
    """What :func:`quantize_comms` set on one FSDP module; ``str()`` says it in words.

    Example::

        >>> sharded = [fully_shard(m) for m in (*model.layers, model)]  # each block, then the root
        >>> str(quantize_comms(model)["layers.0"])
        'weights int8, grads int8 (exact: attention_norm.weight, ffn_norm.weight)'
    """

    all_gather: QuantAllGather | None  # None: torch's default (exact) all-gather
    reduce_scatter: QuantReduceScatter | None
    exact: list[str]  # the module's parameters sent unquantized (names relative to it)

    def __str__(self) -> str:
        if self.all_gather is None and self.reduce_scatter is None:
            return "exact" + (f" ({', '.join(self.exact)})" if self.exact else "")
        parts = [f"{what} int{c.bits}" for what, c in (("weights", self.all_gather), ("grads", self.reduce_scatter))
                 if c]
        return ", ".join(parts) + (f" (exact: {', '.join(self.exact)})" if self.exact else "")


def quantize_comms(model: nn.Module, *, weights: str | None = "int8", grads: str | None = "int8",
                   block_size: int = DEFAULT_BLOCK, skip: Callable[[str, nn.Module], bool] | None = default_skip,
                   replicate: bool = True, measure: bool = False) -> dict[str, ModuleComms]:
    """Quantize the collectives of every ``fully_shard`` module in ``model`` (fully_shard's or torch's FSDP2): int8
    (or int4) all-gathers of the parameters (``weights``) and int8 or int4 reduce-scatters of the gradients
    (``grads``, with HSDP's all-reduce across replicas on fully_shard unless ``replicate=False``), ``block_size``
    values per fp32 scale. ``None`` leaves that collective exact. Call it once, after ``fully_shard``.

    Per-module opt-out: a parameter stays in its dtype, sent unquantized inside the same collective, when
    ``skip(name, module)`` is true for the module registering it or any module above it up to its FSDP module
    (``name`` relative to ``model``). The default, :func:`default_skip`, keeps embeddings and normalization layers
    exact, as ZeRO++ does; a module whose parameters are all exact keeps its default collectives; ``skip=None``
    quantizes everything. ``measure=True`` makes every collective also run the exact one and record its error
    (``ModuleComms.all_gather.errors``; for benchmarks). Returns what was set, per FSDP module name (``""``: the root).

    Example::

        >>> from fully_shard.quant import quantize_comms
        >>> sharded = [fully_shard(m) for m in (*model.layers, model)]  # each block, then the root
        >>> for name, how in quantize_comms(model, weights="int8", grads="int4").items():
        ...     print(name or "(root)", how)
        (root) weights int8, grads int4 (exact: tok_embeddings.weight, norm.weight)
        layers.0 weights int8, grads int4 (exact: attention_norm.weight, ffn_norm.weight)
        layers.1 weights int8, grads int4 (exact: attention_norm.weight, ffn_norm.weight)
        >>> comms = quantize_comms(model, skip=lambda name, m: name == "layers.0")  # all of layers.0 exact
        >>> str(comms["layers.1"])  # the other norms are not
        'weights int8, grads int8'
    """
    bits = {}
    for what, fmt in (("weights", weights), ("grads", grads)):
        if fmt is not None and fmt not in FORMATS:
            raise ValueError(f"quantize_comms: {what}={fmt!r}: expected one of {sorted(FORMATS)} or None")
        bits[what] = None if fmt is None else FORMATS[fmt]
    blocks.check_format(4 if 4 in bits.values() else 8, block_size)
    modules = [(name, m) for name, m in model.named_modules() if _is_fsdp(m)]
    if not modules:
        raise ValueError(f"quantize_comms: no module of {type(model).__name__} is sharded: call it after fully_shard")
    report = {}
    for prefix, m in modules:
        params = _managed(m)
        if not params:
            continue
        at = f"{prefix}." if prefix else ""
        exact = [skip is not None and any(skip(at + n if n else prefix, sub) for n, sub in chain)
                 for _, _, chain in params]
        kept = [name for (name, _, _), e in zip(params, exact) if e]
        if all(exact):
            report[prefix] = ModuleComms(None, None, kept)
            continue
        label = prefix or type(m).__name__
        if kept and len({p.dtype for _, p, _ in params}) > 1:
            raise ValueError(f"quantize_comms: {label!r} has parameters of several dtypes and some kept exact: pass a "
                             "skip= that keeps the whole module exact or quantizes all of it")
        ag_params = [(n, p, e) for (n, p, _), e in zip(params, exact)]
        rs_params = [(n, p, e) for n, p, e in ag_params if p.requires_grad]  # frozen ones are in no reduce-scatter
        ag = None if bits["weights"] is None else QuantAllGather(bits["weights"], block_size, _layout(label, ag_params),
                                                                 measure)
        rs = None
        if bits["grads"] is not None and not all(e for _, _, e in rs_params):
            rs = QuantReduceScatter(bits["grads"], block_size, _layout(label, rs_params), replicate, measure)
        if ag is not None:
            m.set_custom_all_gather(ag)
        if rs is not None:
            m.set_custom_reduce_scatter(rs)
        report[prefix] = ModuleComms(ag, rs, kept)
    return report
