"""What users see after fully_shard: parameters, gradients and module classes, compared
with torch's FSDP2 and with ``torch.chunk`` of the unsharded tensors."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from tests.harness import device_type, run_distributed
from tests.models import Block, ModelArgs, Transformer, batch, loss_fn

IMPLS = ("ours", "torch")

# ---------------------------------------------------------------------------
# Bodies (run on the workers)
# ---------------------------------------------------------------------------


def _fully_shard(impl: str) -> Any:
    if impl == "ours":
        from fully_shard import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard  # type: ignore[no-redef]
    return fully_shard


def _fsdp_module(impl: str) -> type:
    if impl == "ours":
        from fully_shard import FSDPModule
    else:
        from torch.distributed.fsdp import FSDPModule  # type: ignore[no-redef]
    return FSDPModule


def _meta(t: Any) -> dict[str, Any]:
    """The user-visible layout of a sharded parameter or gradient."""
    return {
        "type": type(t).__name__,
        "is_parameter": isinstance(t, nn.Parameter),
        "placements": repr(tuple(t.placements)),
        "shape": tuple(t.shape),
        "local_shape": tuple(t.to_local().shape),
        "requires_grad": t.requires_grad,
        "mesh_shape": tuple(t.device_mesh.shape),
        "dtype": str(t.dtype),
    }


def _expected_local(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    chunks = torch.chunk(full, world, dim=0)
    if rank < len(chunks):
        return chunks[rank]
    return full.new_empty((0, *full.shape[1:]))


def _layout(impl_order: tuple[str, ...] = IMPLS) -> dict[str, Any]:
    """Nested wrapping (each block, then the root) with one frozen parameter; per
    implementation the layout of every parameter before and of every gradient after one
    forward+backward. Local shards are checked against torch.chunk here."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = Transformer(ModelArgs(n_layers=2))
    ref.layers[1].attention_norm.weight.requires_grad_(False)
    ref_names = [n for n, _ in ref.named_parameters()]
    out: dict[str, Any] = {"ref_names": ref_names}
    x = batch(0, rank)
    for impl in impl_order:
        fully_shard, FSDPModule = _fully_shard(impl), _fsdp_module(impl)
        model = copy.deepcopy(ref)
        mesh = init_device_mesh(device_type(), (world,))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        params: dict[str, Any] = {}
        for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
            params[name] = _meta(p)
            expected = _expected_local(p_ref.detach(), rank, world)
            # bitwise on any CPU: sharding copies rows
            torch.testing.assert_close(p.to_local(), expected, rtol=0, atol=0, msg=f"{impl} {name}")
        block0 = model.layers[0]
        classes = {
            "root": type(model).__name__,
            "block": type(block0).__name__,
            "block_is_block": isinstance(block0, Block),
            "block_is_fsdp": isinstance(block0, FSDPModule),
            "root_is_transformer": isinstance(model, Transformer),
            "layers": type(model.layers).__name__,
            "layers_is_fsdp": isinstance(model.layers, FSDPModule),
        }
        loss_fn(model(x), x).backward()
        grads = {n: (None if p.grad is None else _meta(p.grad)) for n, p in model.named_parameters()}
        full_grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
        out[impl] = {"params": params, "classes": classes, "grads": grads, "full_grads": full_grads}
    return out


def _sequential_slicing(impl: str) -> dict[str, Any]:
    """A sharded nn.Sequential of sharded blocks, sliced."""
    fully_shard, FSDPModule = _fully_shard(impl), _fsdp_module(impl)
    args = ModelArgs(dim=16, ffn_dim=24, n_heads=2)
    seq = nn.Sequential(Block(args), Block(args), Block(args))
    mesh = init_device_mesh(device_type(), (dist.get_world_size(),))
    for block in seq:
        fully_shard(block, mesh=mesh)
    fully_shard(seq, mesh=mesh)
    sliced = seq[0:2]
    return {
        "seq_type": type(seq).__name__,
        "seq_is_sequential": isinstance(seq, nn.Sequential),
        "seq_is_fsdp": isinstance(seq, FSDPModule),
        "slice_type_is_sequential": type(sliced) is nn.Sequential,
        "slice_type": type(sliced).__name__,
        "slice_is_fsdp": isinstance(sliced, FSDPModule),
        "slice_members_are_blocks": [m is seq[i] for i, m in enumerate(sliced)],
        "slice_len": len(sliced),
        "member_types": [type(m).__name__ for m in sliced],
        "members_are_fsdp": [isinstance(m, FSDPModule) for m in sliced],
        "item_is_block": seq[1] is list(seq.children())[1],
    }


def _sequential_slicing_both() -> dict[str, Any]:
    return {impl: _sequential_slicing(impl) for impl in IMPLS}


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 4])
def test_parameter_and_gradient_layout_matches_fsdp2(world_size: int) -> None:
    results = run_distributed(_layout, world_size)
    for rank, res in enumerate(results):
        ours, theirs = res["ours"], res["torch"]
        assert list(ours["params"]) == res["ref_names"], f"rank {rank}: names differ from the unsharded model"
        assert list(theirs["params"]) == res["ref_names"]
        for name, meta in theirs["params"].items():
            assert ours["params"][name] == meta, f"rank {rank}: parameter {name}"
        # logit_scale (dim 0 of size 1): only rank 0 holds its row
        assert ours["params"]["logit_scale"]["local_shape"] == ((1,) if rank == 0 else (0,))
        assert ours["params"]["layers.1.attention_norm.weight"]["requires_grad"] is False
        assert ours["classes"] == theirs["classes"], f"rank {rank}"
        assert ours["grads"] == theirs["grads"], f"rank {rank}: gradient layout"
        assert ours["grads"]["layers.1.attention_norm.weight"] is None
        assert sum(g is not None for g in ours["grads"].values()) == len(res["ref_names"]) - 1
        for name, grad in theirs["full_grads"].items():
            torch.testing.assert_close(ours["full_grads"][name], grad, rtol=1e-5, atol=1e-6, msg=name)
    # the expected values, spelled out once (rank 0 of world size 2 or 4)
    p = results[0]["ours"]["params"]["layers.0.feed_forward.w1.weight"]
    assert p["type"] == "DTensor" and p["is_parameter"] and p["requires_grad"]
    assert p["placements"] == "(Shard(dim=0),)"
    assert p["shape"] == (150, 100) and p["mesh_shape"] == (world_size,)
    assert p["local_shape"] == (-(-150 // world_size), 100)
    classes = results[0]["ours"]["classes"]
    assert classes["block"] == "FSDPBlock" and classes["root"] == "FSDPTransformer"
    assert classes["block_is_block"] and classes["block_is_fsdp"] and classes["root_is_transformer"]
    assert classes["layers"] == "ModuleList" and not classes["layers_is_fsdp"]


def test_sequential_slicing_returns_plain_container() -> None:
    res = run_distributed(_sequential_slicing_both, 2)[0]
    ours = res["ours"]
    assert ours == res["torch"]
    assert ours["seq_type"] == "FSDPSequential" and ours["seq_is_fsdp"] and ours["seq_is_sequential"]
    assert ours["slice_type_is_sequential"] and not ours["slice_is_fsdp"]
    assert ours["slice_len"] == 2 and ours["slice_members_are_blocks"] == [True, True]
    assert ours["member_types"] == ["FSDPBlock", "FSDPBlock"] and ours["members_are_fsdp"] == [True, True]
