"""What fully_shard knows of torch pieces that differ between torch versions or that other torch APIs share with
torch's FSDP2, in one place: feature checks, and a version number only for a fix no attribute shows.

- The tensor collectives' names (``dist.all_gather_single`` / ``reduce_scatter_single`` from torch 2.13, the
  ``*_tensor`` names before), which ``comm.py`` calls; a PREMUL_SUM op's factor (shown from torch 2.13).
- torch's composable-API registry (``torch.distributed._composable.contract``): torch's FSDP2 records ``fully_shard``
  in it on each module it shards, and torch's ``replicate`` leaves the parameters of such modules to it (and refuses
  to replicate such a module). fully_shard records itself the same way, so that ``replicate`` around a model with
  fully_shard modules averages only the rest. The registry's key is made when torch loads that module (importing
  fully_shard loads it, through ``torch.distributed.checkpoint``); it is read from ``sys.modules``, never imported.
- ``replicate``'s state: the parameters it averages (its DistributedDataParallel over a ParameterList), for the
  first-forward check of a model whose own parameters nobody shards (``tools/checks.py``).
- Random ops recomputed in a checkpointed region: where a DeviceMesh is an input of the traced graph (torch 2.13 and
  later: the partitioner's ``is_opaque_node`` shows it; ``random_state_after_mesh``), AOT autograd saves such an op's
  random state after the DeviceMesh of the DTensor parameters, which its runtime takes for a tensor ("expected all
  tensors_saved_with_vc_check to be Tensors"; torch 2.13 and 2.14.1); ``traced.random_recompute_checked`` (under
  ``compile_whole``) saves it before. torch 2.11 passes no DeviceMesh into the graph. torch 2.14 counts attention
  without dropout as not random (its partitioner's ``is_rng_op``), torch 2.13 (and 2.11) count it random (``random_op``:
  what ``traced.random_recompute_checked`` tells the partitioner).
- spmd_types (torch 2.14): a plain parameter annotated with local SPMD types, under ``dp_mesh_dims``, is sharded as
  the DTensor its annotation describes (``layout.SpmdTypesMesh``), where the installed torch's FSDP2 does so too.
"""

from __future__ import annotations

import importlib
import sys
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

_CONTRACT = "torch.distributed._composable.contract"

# torch 2.13 renamed the tensor collectives; older releases only have the old names (comm.py calls them by these)
ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
REDUCE_SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"

# torch 2.13's partitioner counts attention without dropout as random (2.14's does not: a private function shows it)
ZERO_DROPOUT_IS_RANDOM = torch.torch_version.TorchVersion(torch.__version__) < "2.14"


def _random_state_after_mesh() -> bool:
    """Whether AOT autograd passes a DeviceMesh into the graphs it partitions (torch 2.13 and later), after which it
    saves a recomputed random op's state where its runtime fails on it. Imports the partitioner (0.3 s, which
    compiling imports anyway)."""
    return hasattr(importlib.import_module("torch._functorch.partitioners"), "is_opaque_node")


# called while dynamo traces: dynamo runs it, and takes its result for a constant
random_state_after_mesh: Callable[[], bool] = torch.compiler.assume_constant_result(_random_state_after_mesh)


def random_op(node: torch.fx.Node) -> bool:
    """Whether a traced op draws random numbers, as torch 2.14's partitioner decides: a ``nondeterministic_seeded`` op,
    except one with a ``dropout_p`` argument that is 0 (``scaled_dot_product_attention`` without dropout)."""
    target = node.target
    if torch.Tag.nondeterministic_seeded not in getattr(target, "tags", ()):
        return False
    arguments = target._schema.arguments if isinstance(target, torch._ops.OpOverload) else []
    index = next((i for i, a in enumerate(arguments) if a.name == "dropout_p"), None)
    if index is None:
        return True
    dropout_p = (node.args[index] if len(node.args) > index
                 else node.kwargs.get("dropout_p", arguments[index].default_value))
    return not (isinstance(dropout_p, (int, float)) and dropout_p == 0.0)


def premul_sum_factor(op: Any) -> float:
    """The factor of a PREMUL_SUM reduce op (torch's FSDP2 passes one for a custom gradient divide factor). torch 2.13
    and later show it (``op.factor``); earlier torch builds the op with ``dist._make_nccl_premul_sum``, whose factor
    Python cannot read: a collective of our own that must apply it is refused there."""
    factor = getattr(op, "factor", None)
    if factor is None:
        raise NotImplementedError(
            f"a PREMUL_SUM reduce op from torch {torch.__version__} does not show its factor (torch 2.13's does), so a "
            "fully_shard reduce-scatter Comm (e.g. fully_shard.quant's) cannot apply it: with torch's FSDP2 on this "
            "torch, leave set_gradient_divide_factor out, or shard with fully_shard's own fully_shard")
    return float(factor)


def _contract() -> Any:
    """torch's composable-API contract module where torch has loaded it, else None."""
    return sys.modules.get(_CONTRACT)


def _registry(module: nn.Module) -> dict[str, Any] | None:
    contract = _contract()
    return None if contract is None else module.__dict__.get(contract.REGISTRY_KEY)


def mark_fully_sharded(module: nn.Module) -> None:
    """Record ``module`` as sharded by ``fully_shard`` in torch's composable-API registry, as torch's FSDP2 does:
    torch's ``replicate`` then leaves its parameters (all of them, nested ones too) to fully_shard."""
    contract = _contract()
    if contract is None:  # nothing of torch's composable APIs is loaded: no replicate to tell
        return
    registry = module.__dict__.setdefault(contract.REGISTRY_KEY, OrderedDict())
    registry.setdefault("fully_shard", contract.RegistryItem())


def replicated_params(module: nn.Module) -> list[nn.Parameter]:
    """The parameters torch's ``replicate`` (applied to ``module`` itself) averages across ranks, once its first
    forward has set it up; [] where ``module`` is not replicated."""
    registry, contract = _registry(module), _contract()
    if registry is None or "replicate" not in registry:
        return []
    states = module.__dict__.get(contract.STATE_KEY, {})
    return [p for state in states.values() for p in getattr(state, "_param_list", ())]


# -- spmd_types: plain parameters annotated with local SPMD types, under dp_mesh_dims ----------------------------------


def spmd_types() -> Any:
    """The ``spmd_types`` package, where it is installed and the installed torch's FSDP2 shards parameters annotated
    with it under ``dp_mesh_dims`` (torch 2.14 and later: ``torch.distributed._spmd_no_typecheck`` marks it); else
    None, and such a parameter is refused as any plain tensor under ``dp_mesh_dims`` is."""
    if not (hasattr(dist, "_spmd_no_typecheck") and dist._is_spmd_types_available()):
        return None
    return importlib.import_module("spmd_types")


class SpmdAnnotation(NamedTuple):
    """What a parameter's spmd_types annotation says about it on the full mesh (one entry per mesh dim)."""

    placements: tuple[Placement, ...]  # of the parameter: Replicate on the data-parallel dims
    grad_placements: tuple[Placement, ...]  # of its gradient: the backward types (R -> Partial, I -> Replicate, ...)
    restore: dict[Any, Any]  # the per-axis types the module's compute tensor gets back (type checking on)
    partition_spec: Any


def _same_ranks(spmd: Any, a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Whether two sets of mesh axes cover the same ranks (each set flattened into one axis)."""
    flatten_axes = importlib.import_module("spmd_types._mesh_axis").flatten_axes
    na, nb = spmd.normalize_mesh(frozenset(a)), spmd.normalize_mesh(frozenset(b))
    if not na or not nb:
        return bool(na) == bool(nb)
    return bool(flatten_axes(tuple(na)) == flatten_axes(tuple(nb)))


def spmd_annotation(param: torch.Tensor, mesh: DeviceMesh, dp_dims: Sequence[int], fqn: str) -> SpmdAnnotation | None:
    """The placements a plain parameter's spmd_types annotation gives it on ``mesh`` (the full mesh of
    ``dp_mesh_dims``, whose dims ``dp_dims`` are data-parallel), or None where it has none (or spmd_types does not
    apply: see :func:`spmd_types`). The data-parallel dims are fully_shard's: the parameter is ``R`` there (annotated
    so or not), since fully_shard reduces its gradient over them; every other dim must be annotated."""
    spmd = spmd_types()
    if spmd is None or isinstance(param, DTensor):
        return None
    declared = dict(spmd.get_local_type(param))
    if not declared:
        return None
    flatten_axes = importlib.import_module("spmd_types._mesh_axis").flatten_axes
    partition_spec_to_shard_types = importlib.import_module("spmd_types.types").partition_spec_to_shard_types
    names = cast(tuple[str, ...], mesh.mesh_dim_names)
    axes = [spmd.MeshAxis.of(mesh.get_group(name)) for name in names]
    spec = spmd.get_partition_spec(param)
    per_axis = dict(declared)
    if spec is not None:
        per_axis.update(partition_spec_to_shard_types(spec))
    where = f"fully_shard(dp_mesh_dims=...): parameter {fqn!r} is annotated with spmd_types"
    # the mesh the module computes on: the annotated axes where they cover the mesh's ranks, else the current mesh
    if _same_ranks(spmd, list(per_axis), axes):
        compute = tuple(per_axis)
    elif (current := spmd.current_mesh()) is not None:
        compute = tuple(current)
    else:
        raise ValueError(f"{where} on axes {tuple(per_axis)} that do not cover the ranks of the mesh passed to "
                         f"fully_shard ({names}); annotate every dim of that mesh, or call fully_shard inside "
                         "spmd.set_current_mesh(...) naming the mesh the module computes on")
    if stray := [a for a in declared if a not in compute]:
        raise ValueError(f"{where} on axes {tuple(stray)} outside the mesh it computes on {compute}; "
                         "annotate only axes of that mesh")
    if not _same_ranks(spmd, compute, axes):
        raise ValueError(f"{where}: the mesh it computes on {compute} does not span the ranks of the mesh passed "
                         f"to fully_shard ({names}); use one mesh over the same ranks")
    dp_axis = flatten_axes(tuple(axes[i] for i in dp_dims))
    types: dict[int, Any] = {i: spmd.R for i in dp_dims}
    for axis, kind in per_axis.items():
        if axis <= dp_axis:  # a data-parallel axis (or a part of them): fully_shard reduces over it
            if kind is not spmd.R:
                raise ValueError(f"{where} {kind} on the data-parallel axis {axis}; it must be spmd.R there "
                                 "(fully_shard averages its gradient over the data-parallel dims)")
        elif axis in axes:
            types[axes.index(axis)] = kind
        else:
            raise ValueError(f"{where} on axis {axis}, which is no dim of the mesh passed to fully_shard ({names}) "
                             "nor part of its data-parallel dims")
    if missing := [names[i] for i in range(len(axes)) if i not in types]:
        raise ValueError(f"{where} but not on the mesh dims {missing}, which are not data-parallel: annotate them "
                         "too (e.g. spmd.I for a parameter replicated there, spmd.S(d) for one split on dim d)")
    placements = tuple(spmd.spmd_type_to_dtensor_placement(types[i]) for i in range(len(axes)))
    grads = tuple(spmd.spmd_type_to_dtensor_placement(types[i].backward_type()) for i in range(len(axes)))
    return SpmdAnnotation(placements, grads, {a: declared.get(a, spmd.R) for a in compute}, spec)


def restore_spmd_annotation(tensor: torch.Tensor, annotation: SpmdAnnotation) -> None:
    """Annotate the tensor a module computes with as its parameter was, where spmd_types type checking is on."""
    spmd = spmd_types()
    if spmd is not None and annotation.restore and spmd.is_type_checking():
        spmd.assert_type(tensor, annotation.restore, partition_spec=annotation.partition_spec)
