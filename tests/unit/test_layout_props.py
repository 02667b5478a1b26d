"""Property tests of the pure layout functions, at every shard world size 1..16 and shapes drawn by ``hypothesis``
(dims smaller than the world size, zero-size dims, odd sizes): ``layout.shard_layout``, the ``Layout`` classes,
``layout.reduced_parts``, ``comm.copy_out`` and ``comm.divide_factors``, and ``state._map_tensors``.

What they check, for every rank of the world at once (no process group: the layouts are pure):

- the ranks' parts tile the tensor, in order, each padded to the same slot (``torch.chunk`` rows on dim 0);
- shard then gather is the identity: each rank's part, packed into its slot of a flat all-gather output whose padding
  holds NaN, copied out by ``comm.copy_out`` into the unsharded buffer, reads back as the full tensor, NaN-free;
- a gradient reduce-scattered from ``torch._chunk_cat`` of ``Layout.grad_for_reduce`` lands, through ``reduced_parts``,
  as exactly each rank's part: no padding, nothing of another rank's.
"""

from __future__ import annotations

import dataclasses
import math
from collections import namedtuple
from typing import Any

import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from fully_shard import comm
from fully_shard.layout import EvenLayout, Layout, RowLayout, layout_for, reduced_parts, shard_layout
from fully_shard.state import _map_tensors

# the same examples on every run (as tests/test_quant_comm.py), no example database written
props = settings(max_examples=40, deadline=None, database=None, derandomize=True)

worlds = st.integers(1, 16)
dims = st.integers(0, 9)  # include sizes 0 and below the world size


@st.composite
def row_cases(draw: Any) -> tuple[tuple[int, ...], int]:
    """A shape (1-3 dims, any sizes) and a world size: sharded on dim 0, padded."""
    return (tuple(draw(st.lists(st.integers(0, 40), min_size=1, max_size=1)) + draw(st.lists(dims, max_size=2))),
            draw(worlds))


@st.composite
def even_cases(draw: Any) -> tuple[tuple[int, ...], int, int]:
    """A shape of 2-3 dims, a world size and a dim > 0 that it divides (``shard_placement_fn``'s ``Shard(d)``)."""
    world = draw(worlds)
    shape = draw(st.lists(dims, min_size=2, max_size=3))
    dim = draw(st.integers(1, len(shape) - 1))
    shape[dim] = world * draw(st.integers(0, 3))
    return tuple(shape), world, dim


@st.composite
def layout_cases(draw: Any) -> tuple[tuple[int, ...], int, int]:
    """Either kind: (shape, world, shard dim)."""
    if draw(st.booleans()):
        shape, world = draw(row_cases())
        return shape, world, 0
    return draw(even_cases())


def _layouts(shape: tuple[int, ...], world: int, dim: int) -> list[Layout]:
    """Every rank's layout of one parameter."""
    return [layout_for(shape, dim, world, r, "w") for r in range(world)]


def _full(shape: tuple[int, ...]) -> torch.Tensor:
    """Distinct values (their position + 1): a part in the wrong place, or padding, cannot pass for the right one."""
    return torch.arange(1, math.prod(shape) + 1, dtype=torch.float64).view(shape)


@props
@given(row_cases())
def test_shard_layout_tiles_the_rows_like_torch_chunk(case: tuple[tuple[int, ...], int]) -> None:
    shape, world = case
    rows, row_numel = shape[0], math.prod(shape[1:])
    layouts = [shard_layout(shape, world, r) for r in range(world)]
    assert {lay.chunk_rows for lay in layouts} == {math.ceil(rows / world)}
    start = 0
    chunks = torch.empty(shape).chunk(world) if rows else ()
    for r, lay in enumerate(layouts):
        assert (lay.row_start, lay.world, lay.row_numel) == (start, world, row_numel)
        assert 0 <= lay.local_rows <= lay.chunk_rows
        assert lay.local_numel == lay.local_rows * row_numel and lay.slot_numel == lay.chunk_rows * row_numel
        # torch.chunk gives fewer chunks than ranks when rows run out: the later ranks hold none
        assert lay.local_rows == (chunks[r].shape[0] if r < len(chunks) else 0)
        start += lay.local_rows
    assert start == rows
    assert world * layouts[0].slot_numel >= math.prod(shape)


@props
@given(layout_cases())
def test_parts_tile_the_tensor_in_equal_slots(case: tuple[tuple[int, ...], int, int]) -> None:
    shape, world, dim = case
    full = _full(shape)
    layouts = _layouts(shape, world, dim)
    parts = [lay.local_part(full) for lay in layouts]
    assert [p.shape for p in parts] == [lay.local_shape for lay in layouts]
    assert len({lay.slot_numel for lay in layouts}) == 1
    assert all(p.numel() <= lay.slot_numel for p, lay in zip(parts, layouts))
    assert torch.equal(torch.cat(parts, dim=dim), full)
    if dim:  # even: a slot is exactly a part
        assert all(p.numel() == lay.slot_numel for p, lay in zip(parts, layouts))


def _gathered(parts: list[torch.Tensor], slot: int) -> torch.Tensor:
    """The flat output of an all-gather of ``parts`` (one per rank), each at its slot's start, padding NaN."""
    out = torch.full((len(parts), slot), float("nan"), dtype=torch.float64)
    for row, part in zip(out, parts):
        row[: part.numel()] = part.reshape(-1)
    return out.view(-1)


@props
@given(st.lists(layout_cases(), min_size=1, max_size=3).filter(lambda cs: len({w for _, w, _ in cs}) == 1))
def test_shard_then_gather_is_the_identity(cases: list[tuple[tuple[int, ...], int, int]]) -> None:
    """A group of parameters (one world): each rank packs its parts into its slots of one all-gather output; every
    rank's copy-out (``comm.copy_out``) then gives each full tensor back, padding never in sight."""
    world = cases[0][1]
    fulls = [_full(shape) for shape, _, _ in cases]
    per_param = [_layouts(shape, world, dim) for shape, _, dim in cases]
    slots = [lays[0].slot_numel for lays in per_param]
    # rank-major: rank r's block holds every parameter's slot in group order
    blocks = [torch.cat([_gathered([lays[r].local_part(f)], slot) for f, lays, slot in zip(fulls, per_param, slots)])
              for r in range(world)]
    output = torch.cat(blocks) if blocks[0].numel() else torch.empty(0, dtype=torch.float64)
    for rank in range(world):
        buffers = [torch.empty(lays[rank].padded_numel, dtype=torch.float64) for lays in per_param]
        dests = [lays[rank].rank_major(b, lays[rank].local_shape) for b, lays in zip(buffers, per_param)]
        comm.copy_out(comm.CollectiveWork(None, None, output, world, "test"), slots, dests)
        for full, buffer, lays in zip(fulls, buffers, per_param):
            unsharded = lays[rank].unsharded(buffer)
            assert unsharded.shape == full.shape
            assert torch.equal(unsharded, full)  # no NaN: padding stays out of the user's view
            assert unsharded.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()  # a view, no copy


@props
@given(layout_cases())
def test_one_rank_gather_copies_the_shard(case: tuple[tuple[int, ...], int, int]) -> None:
    """Over one rank ``comm.all_gather`` issues nothing and hands the shards to ``copy_out`` unpadded."""
    shape, _, dim = case
    lay = layout_for(shape, dim, 1, 0, "w")
    full, buffer = _full(shape), torch.empty(lay.padded_numel, dtype=torch.float64)
    work = comm.CollectiveWork(None, None, None, 1, "test", shards=(lay.local_part(full).reshape(-1),))
    comm.copy_out(work, [lay.slot_numel], [lay.rank_major(buffer, lay.local_shape)])
    assert torch.equal(lay.unsharded(buffer), full)


# torch._chunk_cat refuses an empty tensor: a zero-element parameter cannot be reduce-scattered over several ranks
nonempty = layout_cases().filter(lambda c: math.prod(c[0]) > 0)


@props
@given(st.lists(nonempty, min_size=1, max_size=3).filter(lambda cs: len({w for _, w, _ in cs}) == 1))
def test_reduce_scatter_rows_are_each_ranks_parts(cases: list[tuple[tuple[int, ...], int, int]]) -> None:
    """The reduce-scatter input (``torch._chunk_cat`` of ``grad_for_reduce``, as ``comm.reduce_scatter`` builds it): row
    ``r`` split by ``reduced_parts`` is rank ``r``'s part of every gradient, and its padding is zero."""
    world = cases[0][1]
    grads = [_full(shape) for shape, _, _ in cases]
    per_param = [_layouts(shape, world, dim) for shape, _, dim in cases]
    cols = sum(lays[0].slot_numel for lays in per_param)
    inp = torch.full((world, cols), float("nan"), dtype=torch.float64)
    torch._chunk_cat([lays[0].grad_for_reduce(g) for g, lays in zip(grads, per_param)], dim=0, num_chunks=world,
                     out=inp)
    for rank in range(world):
        layouts = [lays[rank] for lays in per_param]
        parts = reduced_parts(layouts, inp[rank])
        for part, grad, lay in zip(parts, grads, layouts):
            assert torch.equal(part.view(lay.local_shape), lay.local_part(grad))
        assert not inp[rank].isnan().any()
        assert inp[rank].sum() == sum(p.sum() for p in parts)  # the rest, padding, is zeros


@props
@given(even_cases(), st.data())
def test_self_gather_views_put_each_ranks_slot_in_place(case: tuple[tuple[int, ...], int, int], data: Any) -> None:
    """A self-gathering tensor's inputs may have any shape: ``rank_major`` writes rank ``r``'s slot where ``joined``
    reads it, side by side on the shard dim (``torch.cat``)."""
    _, world, dim = case
    slot = torch.Size(data.draw(st.lists(st.integers(0, 4), min_size=dim + 1, max_size=dim + 2)))
    lay = EvenLayout(case[0], dim, world, 0, "w")
    parts = [torch.randn(slot, dtype=torch.float64) for _ in range(world)]
    flat = torch.empty(world * slot.numel(), dtype=torch.float64)
    dest = lay.rank_major(flat, slot)
    for r, part in enumerate(parts):
        dest[r].copy_(part)
    assert torch.equal(lay.joined(flat, slot), torch.cat(parts, dim=dim))


@props
@given(row_cases())
def test_row_slot_shape_pads_what_has_this_ranks_rows(case: tuple[tuple[int, ...], int]) -> None:
    shape, world = case
    for rank in range(world):
        lay = RowLayout(shape, world, rank)
        rows, chunk = lay.rows.local_rows, lay.rows.chunk_rows
        assert lay.slot_shape(torch.Size((rows, 3))) == (chunk, 3)  # e.g. a scale per row
        assert lay.slot_shape(torch.Size(())) == ()  # a scalar stays as it is
        if rows != chunk + 1:
            assert lay.slot_shape(torch.Size((chunk + 1,))) == (chunk + 1,)


@props
@given(st.integers(1, 16), st.integers(1, 16))
def test_even_layout_refuses_an_uneven_dim(world: int, size: int) -> None:
    if size % world == 0:
        assert EvenLayout((2, size), 1, world, 0, "w").local_shape == (2, size // world)
        return
    try:
        EvenLayout((2, size), 1, world, 0, "layers.0.w")
    except ValueError as e:
        assert f"'layers.0.w' of shape (2, {size}) on Shard(1), which {world} ranks do not divide evenly" in str(e)
    else:
        raise AssertionError("no error")


# -- how to average ------------------------------------------------------------

@props
@given(st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]), st.integers(1, 4096),
       st.one_of(st.none(), st.floats(0.5, 1e4)), st.booleans())
def test_divide_factors_average_once(dtype: torch.dtype, n: int, factor: float | None, force_sum: bool) -> None:
    """Whatever the split, the sum is divided exactly once by the factor (default: the data-parallel size): by the op
    (AVG), or by pre * post; fp16 divides by a power of two near sqrt first, so neither summands nor sum overflow."""
    op, pre, post = comm.divide_factors(dtype, n, factor, force_sum)
    total = float(n if factor is None else factor)
    if op == dist.ReduceOp.AVG:
        assert (pre, post, factor, force_sum, n > 1) == (None, None, None, False, True)
        return
    assert op == dist.ReduceOp.SUM
    divided = (pre or 1.0) * (post or 1.0)
    assert math.isclose(divided, 1.0 if factor is None and n == 1 and not force_sum else total, rel_tol=1e-12)
    if force_sum and dtype is not torch.float16:
        assert pre is None  # summed first, divided after (fp16 still divides first, as torch does: overflow)
    if dtype is torch.float16 and pre is not None and total > 1:
        assert math.log2(pre).is_integer() and math.sqrt(total) <= pre < 2 * math.sqrt(total)


# -- state._map_tensors ----------------------------------------------------------

Pair = namedtuple("Pair", "a b")


@dataclasses.dataclass
class Out:
    x: Any
    y: Any = None


def _containers(leaves: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.lists(leaves, max_size=3), st.lists(leaves, max_size=3).map(tuple),
                     st.dictionaries(st.text(max_size=2), leaves, max_size=3),
                     st.builds(Pair, leaves, leaves), st.builds(Out, leaves, leaves))


structures = st.recursive(st.one_of(st.integers(), st.none(), st.just("s"),
                                    st.builds(lambda n: torch.full((2,), n), st.integers(0, 9))),
                          _containers, max_leaves=12)


def _leaves(obj: Any) -> list[Any]:
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in _leaves(v)]
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in _leaves(v)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [x for f in dataclasses.fields(obj) for x in _leaves(getattr(obj, f.name))]
    return [obj]


@settings(props, max_examples=25)
@given(structures)
def test_map_tensors_maps_every_tensor_and_keeps_the_structure(obj: Any) -> None:
    assert _map_tensors(lambda t: t, obj) is obj  # nothing changed: nothing rebuilt
    mapped = _map_tensors(lambda t: t + 100, obj)
    before, after = _leaves(obj), _leaves(mapped)
    assert len(before) == len(after)
    for a, b in zip(before, after):
        if isinstance(a, torch.Tensor):
            assert torch.equal(b, a + 100)
        else:
            assert b is a
    assert type(mapped) is type(obj)
