"""Block quantization: the arithmetic of the quantized collectives, and its error bounds.

A row of ``n`` values is cut into blocks of ``block`` values (the last one zero-padded). Each block travels as one
fp32 scale, ``amax / q`` with ``amax`` the block's largest magnitude and ``q`` the largest code (127 for int8, 7 for
int4), then its codes ``round(x / scale)`` (half to even: fixed, so a rerun gives the same bits), one byte each for
int8, two to a byte for int4. Wire layout of a row: ``nb`` records of ``4 + block * bits / 8`` bytes,
``[scale | codes]``; a non-finite value makes its block's scale non-finite, so it arrives as inf or NaN and an
overflow check (a loss scaler) still sees it.
"""

from __future__ import annotations

import math

import torch

FP32_EPS = 2.0**-23  # torch.finfo(torch.float32).eps: scales, codes and sums are computed in fp32
FP32_TINY_ULP = 2.0**-149  # the smallest fp32 subnormal: absolute error once a scale underflows


def levels(bits: int) -> int:
    """The largest code: a symmetric range ``[-q, q]`` (127 for int8, 7 for int4)."""
    return (1 << (bits - 1)) - 1


def check_format(bits: int, block: int) -> None:
    """Raise ``ValueError`` for a format this module cannot encode."""
    if bits not in (4, 8):
        raise ValueError(f"quantized collectives: bits must be 8 (int8) or 4 (int4), got {bits!r}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1 or (bits == 4 and block % 2):
        raise ValueError("quantized collectives: block_size must be a positive "
                         f"int{' and even for int4' if bits == 4 else ''} (two int4 codes share a byte), got {block!r}")


def record_bytes(bits: int, block: int) -> int:
    """Bytes of one block on the wire: its fp32 scale and its codes."""
    return 4 + block * bits // 8


def row_bytes(n: int, bits: int, block: int) -> int:
    """Bytes of a row of ``n`` values on the wire."""
    return math.ceil(n / block) * record_bytes(bits, block)


def quantize(x: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """Encode each row of ``x`` (2-D, ``(rows, n)``, floating) as ``(rows, row_bytes(n))`` bytes.

    Example::

        >>> x = torch.randn(2, 1000)
        >>> wire = quantize(x, bits=8, block=256)
        >>> wire.shape, wire.dtype  # per row, 4 blocks of a 4-byte scale and 256 codes
        (torch.Size([2, 1040]), torch.uint8)
        >>> error = (dequantize(wire, 1000, bits=8, block=256) - x).abs().max()
        >>> bool(error <= roundtrip_bound(x.abs().max(), 8, torch.float32))  # about amax / 254
        True
    """
    rows, n = x.shape
    nb, q = math.ceil(n / block), levels(bits)
    xf = x.float()
    if nb * block != n:
        xf = torch.nn.functional.pad(xf, (0, nb * block - n))
    xb = xf.view(rows, nb, block)
    scale = xb.abs().amax(dim=2, keepdim=True) / q  # (rows, nb, 1): inf or NaN if the block holds one
    codes = torch.round(xb / torch.where(scale > 0, scale, 1.0)).clamp_(-q, q).nan_to_num_(0.0).to(torch.int8)
    if bits == 4:  # two codes a byte, offset to [1, 15]: low nibble the even element, high the odd one
        u = (codes + 8).to(torch.uint8)
        payload = u[..., 0::2] | (u[..., 1::2] << 4)
    else:
        payload = codes.view(torch.uint8)
    return torch.cat([scale.view(torch.uint8), payload], dim=2).view(rows, -1)


def dequantize(wire: torch.Tensor, n: int, bits: int, block: int) -> torch.Tensor:
    """Decode ``(rows, row_bytes(n))`` bytes back to ``(rows, n)`` fp32 values (scale times code, in fp32).

    Example::

        >>> dequantize(quantize(torch.tensor([[1.0, -0.5, 0.25]]), 8, 4), 3, 8, 4)
        tensor([[ 1.0000, -0.5039,  0.2520]])
    """
    rows, nb = wire.shape[0], math.ceil(n / block)
    rec = wire.view(rows, nb, record_bytes(bits, block))
    scale = as_dtype(rec[..., :4], torch.float32)  # (rows, nb, 1)
    payload = rec[..., 4:]
    if bits == 4:
        codes = torch.stack([payload & 15, payload >> 4], dim=3).view(rows, nb, block).to(torch.float32) - 8
    else:
        codes = payload.contiguous().view(torch.int8).to(torch.float32)
    # clamped: a code times its scale may round past the fp32 range when amax is within an ulp of it (NaN stays NaN)
    fmax = torch.finfo(torch.float32).max
    return (codes * scale).clamp_(-fmax, fmax).view(rows, nb * block)[:, :n]


def as_dtype(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bytes (..., k * itemsize) as ``dtype`` (..., k): copied into fresh storage first, so that the view is aligned
    whatever the strides and offset of ``raw`` (a slice of a received buffer)."""
    return torch.empty(raw.shape, dtype=torch.uint8, device=raw.device).copy_(raw).view(dtype)


def block_amax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Each element's block magnitude ``amax`` (the same shape as ``x``, fp32; ``x`` is ``(rows, n)``)."""
    rows, n = x.shape
    nb = math.ceil(n / block)
    xf = torch.nn.functional.pad(x.float().abs(), (0, nb * block - n)).view(rows, nb, block)
    return xf.amax(dim=2, keepdim=True).expand(rows, nb, block).reshape(rows, nb * block)[:, :n]


def _rounding(dtype: torch.dtype) -> tuple[float, float]:
    """(unit roundoff, absolute error at the bottom of the range) of rounding an fp32 value to ``dtype``."""
    info = torch.finfo(dtype)
    return info.eps / 2, info.tiny * info.eps


def roundtrip_bound(amax: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """Largest ``|dequantize(quantize(x)) - x|`` for an element whose block has magnitude ``amax``, the result
    rounded to ``dtype`` (the parameter dtype of an all-gather).

    Half a quantization step, ``amax / (2q)``, plus fp32 rounding of the scale, code and product (``2 eps32 amax``),
    plus rounding the result to ``dtype`` (``u (1 + 1/(2q)) amax``), plus absolute terms for scales and results that
    underflow. int8: ``amax / 254 + ...``; int4: ``amax / 14 + ...``.

    Example::

        >>> roundtrip_bound(torch.tensor(1.0), 8, torch.bfloat16)  # ~ 1/254 + 2^-8 (1 + 1/254): bf16's u is 2^-8
        tensor(0.0079)
    """
    q = levels(bits)
    u, tiny = _rounding(dtype)
    return amax * (1 / (2 * q) + 2 * FP32_EPS + u * (1 + 1 / (2 * q))) + (q + 2) * FP32_TINY_ULP + tiny


def reduce_bound(amax_sum: torch.Tensor, bits: int, dtype: torch.dtype, world: int,
                 divisor: float = 1.0) -> torch.Tensor:
    """Largest error of a quantized reduction against the exact sum (divided by ``divisor``), for an element whose
    blocks on the ``world`` ranks have magnitudes summing to ``amax_sum``, the result rounded to ``dtype``.

    Each rank's dequantized value is off by half a step of its own block (``amax_j / (2q)``), the fp32 sum of
    ``world`` terms adds ``world eps32`` of their magnitudes, the division one rounding, the cast to ``dtype``
    ``u (1 + 1/(2q))`` of the result. The error of an *unquantized* collective in ``dtype`` is of the order of
    the last term, so comparing against one adds it once more (``exact_error``).

    Example::

        >>> reduce_bound(torch.tensor(2.0), 8, torch.float32, world=2, divisor=2)  # two ranks' amax summing to 2, AVG
        tensor(0.0039)
    """
    q = levels(bits)
    u, tiny = _rounding(dtype)
    rel = 1 / (2 * q) + (world + 3) * FP32_EPS + u * (1 + 1 / (2 * q))
    return amax_sum / divisor * rel + world * (q + 2) * FP32_TINY_ULP / divisor + tiny


def exact_error(abs_sum: torch.Tensor, dtype: torch.dtype, world: int, divisor: float = 1.0) -> torch.Tensor:
    """A bound on the rounding error of an unquantized sum of ``world`` values in ``dtype`` whose magnitudes sum to
    ``abs_sum``, divided by ``divisor`` (``world`` roundings to ``dtype``, whatever order the backend adds in)."""
    u, tiny = _rounding(dtype)
    return abs_sum / divisor * (world + 1) * u + world * tiny


def two_level_bound(amax_sum: torch.Tensor, bits: int, dtype: torch.dtype, world: int,
                    divisor: float = 1.0) -> torch.Tensor:
    """Largest error of HSDP's quantized reduction (a quantized reduce-scatter over the shard group, then the
    quantized all-reduce across replicas) against the exact result, where ``amax_sum`` sums over all ``world``
    data-parallel ranks each rank's largest magnitude in the reduced buffer.

    Three quantizations add up: the ranks' inputs (``A / (2q)``, with ``A = amax_sum / divisor``), the replicas'
    partial sums, each at most ``A (1 + 1/(2q))`` in magnitude, and the owner's sum, at most ``A (1 + 1/(2q))^2``."""
    grow = 1 + 1 / (2 * levels(bits))
    return reduce_bound(amax_sum, bits, dtype, world, divisor) * (1 + grow + grow * grow)


def all_reduce_bound(amax_sum: torch.Tensor, bits: int, dtype: torch.dtype, world: int,
                     divisor: float = 1.0) -> torch.Tensor:
    """Largest error of the quantized all-reduce alone (``QuantReduceScatter.all_reduce``) against the exact sum, where
    ``amax_sum`` sums each replica's largest magnitude: the replicas' inputs (``A / (2q)``, ``A = amax_sum /
    divisor``) and the owner's sum, requantized for the all-gather (at most ``A (1 + 1/(2q))`` in magnitude)."""
    return reduce_bound(amax_sum, bits, dtype, world, divisor) * (2 + 1 / (2 * levels(bits)))
