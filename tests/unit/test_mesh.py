"""mesh.py on a fake process group, in this process: which mesh dims shard and which replicate, the k-rank groups of
``reshard_after_forward=k``, and the errors for meshes fully_shard cannot read."""

from __future__ import annotations

import gc
import weakref
from unittest import mock

import pytest
import torch.distributed as dist

from fully_shard import DataParallelMeshDims
from fully_shard import mesh as mesh_module
from fully_shard.mesh import mesh_info_for, reshard_setting, resolve_reshard_after_forward
from tests.unit.fake_pg import fake_world


def test_one_dim_shards_two_dims_replicate_then_shard() -> None:
    with fake_world((2, 4), 6, ("rep", "shard")) as mesh:  # rank 6: replica 1, shard rank 2
        info = mesh_info_for(mesh["shard"])
        assert (info.shard.size, info.shard.rank, info.replicate) == (4, 2, None)
        info = mesh_info_for(mesh)
        assert (info.shard.size, info.shard.rank) == (4, 2)
        assert info.replicate is not None and (info.replicate.size, info.replicate.rank) == (2, 1)


def test_dp_mesh_dims_flatten_the_shard_dims() -> None:
    with fake_world((2, 2, 2), 5, ("rep", "dp", "cp")) as mesh:  # rank 5 = (1, 0, 1)
        info = mesh_info_for(mesh, DataParallelMeshDims(shard=("dp", "cp"), replicate="rep"))
        assert (info.shard.size, info.shard.rank) == (4, 1) and info.replicate is not None and info.replicate.rank == 1
        assert (info.spmd_mesh, info.spmd_shard_dims, info.spmd_replicate_dims) == (mesh, (1, 2), (0,))
        with pytest.raises(ValueError, match=r"the shard dims \('rep', 'cp'\) must be adjacent dims"):
            mesh_info_for(mesh, DataParallelMeshDims(shard=("rep", "cp")))
        with pytest.raises(ValueError, match="names the mesh dim 'tp', which is not one of this mesh's dims"):
            mesh_info_for(mesh, DataParallelMeshDims(shard="tp"))


def test_meshes_fully_shard_cannot_read_are_refused() -> None:
    with fake_world((2, 2, 2), 0, ("a", "b", "c")) as mesh:
        with pytest.raises(ValueError, match="expects a 1-D mesh .* got a 3-D mesh with shape \\(2, 2, 2\\)"):
            mesh_info_for(mesh)
    with fake_world((2, 2), 0, ("dp", "tp")) as mesh:
        with pytest.raises(ValueError, match="'tp' is not a data-parallel dim. Pass the data-parallel part"):
            mesh_info_for(mesh)


def test_reshard_after_forward_k_keeps_k_consecutive_ranks() -> None:
    assert [reshard_setting(k, 8) for k in (None, True, False, 8, 2)] == [None, True, False, True, 2]
    with pytest.warns(UserWarning, match="reshard_after_forward=1 .* like reshard_after_forward=False"):
        assert reshard_setting(1, 8) is False
    with pytest.raises(ValueError, match="reshard_after_forward=3 must be a divisor of the shard group size 8"):
        reshard_setting(3, 8)
    with fake_world((8,), 5) as mesh:
        info = mesh_info_for(mesh)
        reshard, keep = resolve_reshard_after_forward(2, info, [("w", info)])
        assert reshard is True and (keep[id(info)].size, keep[id(info)].rank) == (2, 1)  # ranks 4 and 5
        assert resolve_reshard_after_forward(8, info, [("w", info)]) == (True, {})  # the whole group: as True


@pytest.mark.parametrize("rank", [0, 5])
def test_k_rank_groups_are_made_once_per_world_and_ranks(rank: int) -> None:
    """Two equal meshes (distinct objects) with the same k share one set of groups; ranks 0 and 5 hold different
    copies of the sub-mesh yet create the same groups in the same order (new_group is collective); a new world makes
    its own, and the old world's groups go with it."""
    for _ in range(2):
        with fake_world((2, 4), rank, ("rep", "shard")) as mesh, mock.patch.object(dist, "new_group",
                                                                                   wraps=dist.new_group) as made:
            a, b = mesh_info_for(mesh["shard"]), mesh_info_for(mesh["shard"])
            keep = [resolve_reshard_after_forward(2, info, [("w", info)])[1][id(info)] for info in (a, b)]
            assert keep[0] is keep[1] and (keep[0].size, keep[0].rank) == (2, rank % 2)
            # every copy's, once: first the complements (the ranks at one index of every k-rank group), then the groups
            assert [c.args[0] for c in made.call_args_list] == [[0, 2], [1, 3], [4, 6], [5, 7],
                                                                 [0, 1], [2, 3], [4, 5], [6, 7]]
            complement = keep[0].complement
            assert complement is not None and (complement.size, complement.rank) == (2, rank // 2 % 2)
            resolve_reshard_after_forward(4, a, [("w", a)])  # k = the shard size: as True, no group
            assert made.call_count == 8
            world = weakref.ref(dist.distributed_c10d._get_default_group())
            assert world() in mesh_module._k_rank_groups
        gc.collect()  # other tests' worlds may still be alive in this process: look at this one's alone
        assert world() is None  # the world is gone, and its groups with it (a weak key)
