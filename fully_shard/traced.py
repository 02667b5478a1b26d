"""The traced path: a group's collectives as data in a ``torch.compile`` graph.

The eager path runs each group's all-gather and reduce-scatter from module hooks (state.py), which dynamo cannot trace.
When dynamo traces a sharded module's hooks (``torch.compile`` of a model that contains it: ``torch.compile(model)``
runs the outermost module's own hooks outside the graph and traces every module called inside its forward), the hooks
take this path instead. It runs the same schedule, with the same group, layouts, mixed-precision dtypes and divide
factors (SimpleFSDP's idea, arXiv 2411.00284):

    pre_forward   one functional all-gather per group bucket (dtype, mesh) of the local shards, each cast to its
                  unsharded dtype; the modules compute with the gathered tensors
    backward      the all-gather's autograd: one functional reduce-scatter (and, under HSDP, an all-reduce across
                  replicas) of the full gradients, with the eager path's reduce op and pre/post divide factors; the
                  result reaches the sharded DTensor parameters through ``DTensor.to_local``'s autograd
    post_forward  the modules point at the sharded parameters again. ``reshard_after_forward`` says what backward
                  gets: True (and an int: see ``check_traceable``) recomputes the all-gather in backward (a selective
                  activation-checkpoint policy that recomputes only the collective and its copy-out), False saves
                  the gathered parameters

The compiler sees every collective (``_c10d_functional`` ops) and may bucket and reorder them. Nothing here runs when
not tracing; the eager hooks never run while tracing. What the traced path cannot express raises
``TracedUnsupportedError`` at trace time, naming the module and the setting (``check_traceable``).
"""

from __future__ import annotations

import functools
from typing import Any, cast

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .comm import divide_factors
from .group import ParamGroup, _buckets
from .layout import MeshLayout, reduced_parts
from .param import ShardedParam


class TracedUnsupportedError(NotImplementedError):
    """A setting the traced path (``torch.compile`` of a model containing sharded modules) does not support."""


def _op_name(op: Any) -> str:
    return "avg" if op == torch.distributed.ReduceOp.AVG else "sum"


class _Bucket:
    """What the traced all-gather of one bucket of a group (one unsharded dtype, one mesh) needs: constants only, so
    dynamo guards on them and the graph holds no Python objects."""

    def __init__(self, params: list[ShardedParam], group: ParamGroup) -> None:
        info, options = params[0].mesh_info, group.options
        self.params = params
        self.dtype = params[0].unsharded_dtype
        self.reduce_dtype = params[0].reduce_dtype
        self.shard_group = info.shard.group.group_name
        self.world = info.shard.size
        self.replicate_group = None if info.replicate is None else info.replicate.group.group_name
        dp_size = info.shard.size * (info.replicate.size if info.replicate is not None else 1)
        op, self.pre, self.post = divide_factors(self.reduce_dtype, dp_size, options.gradient_divide_factor,
                                                 options.force_sum_reduction)
        self.op = _op_name(op)
        self.slots = [p.layout.slot_numel for p in params]


def _gather(bucket: _Bucket, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The full parameters of ``bucket`` from this rank's 1-D shards: pack (each padded to its slot, cast to the
    unsharded dtype), all-gather, copy out into each parameter's layout."""
    pieces = []
    for shard, slot in zip(shards, bucket.slots):
        flat = shard.reshape(-1).to(bucket.dtype)
        pieces.append(flat if flat.numel() == slot else torch.nn.functional.pad(flat, (0, slot - flat.numel())))
    packed = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    world = bucket.world
    gathered = packed if world == 1 else funcol.wait_tensor(funcol.all_gather_tensor(packed, 0, bucket.shard_group))
    blocks = gathered.view(world, -1).split(bucket.slots, dim=1)  # (world, slot) each, rank-major
    return tuple(_copy_out(p, block) for p, block in zip(bucket.params, blocks))


def _copy_out(p: ShardedParam, block: torch.Tensor) -> torch.Tensor:
    """The full tensor of ``p`` from its ``(world, slot)`` block of the all-gather output, as the eager copy-out lays
    it: a flat padded buffer whose rank-major view receives the block, seen without padding."""
    layout = p.layout
    flat = torch.empty(layout.padded_numel, dtype=block.dtype, device=block.device)
    dest = layout.rank_major(flat, layout.local_shape)
    dest.copy_(block.reshape(dest.shape))
    return layout.unsharded(flat)


def _reduce(bucket: _Bucket, grads: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor | None]:
    """This rank's reduced gradient of each parameter (its local shape, its sharded dtype) from the full ones."""
    if all(g is None for g in grads):
        return [None] * len(grads)
    full = [torch.zeros(p.size, dtype=bucket.reduce_dtype, device=p.device) if g is None else g.to(bucket.reduce_dtype)
            for p, g in zip(bucket.params, grads)]
    world = bucket.world
    inp = torch._chunk_cat([p.layout.grad_for_reduce(g) for p, g in zip(bucket.params, full)], dim=0,
                           num_chunks=world)  # (world, cols): row r is rank r's slots
    if bucket.pre is not None and bucket.pre != 1:
        inp = inp / bucket.pre
    out = inp.view(-1)
    if world > 1:
        out = funcol.wait_tensor(funcol.reduce_scatter_tensor(out, bucket.op, 0, bucket.shard_group))
    if bucket.replicate_group is not None:
        out = funcol.wait_tensor(funcol.all_reduce(out, bucket.op, bucket.replicate_group))
    if bucket.post is not None and bucket.post != 1:
        out = out / bucket.post
    parts = reduced_parts([p.layout for p in bucket.params], out)
    return [part.view(p.layout.local_shape).to(p.dtype) for p, part in zip(bucket.params, parts)]


class _GatherFunction(torch.autograd.Function):
    """All-gather forward, reduce-scatter backward, for one bucket."""

    @staticmethod
    def forward(ctx: Any, bucket: _Bucket, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.bucket = bucket
        return _gather(bucket, *shards)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        return (None, *_reduce(ctx.bucket, grads))


def _gather_bucket(bucket: _Bucket) -> tuple[torch.Tensor, ...]:
    shards = [cast(DTensor, p.sharded_param).to_local() for p in bucket.params]  # differentiable: grads reach it
    return _GatherFunction.apply(bucket, *shards)  # type: ignore[no-untyped-call, no-any-return]


def _recompute_collectives(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """reshard_after_forward: recompute everything of the gather in backward (the collective, its wait and the
    copy-out), so nothing it produced is kept for backward but what the modules save themselves."""
    return CheckpointPolicy.MUST_RECOMPUTE


def gathered_params(group: ParamGroup, reshard: bool) -> list[tuple[ShardedParam, torch.Tensor]]:
    """Each parameter of ``group`` with its full tensor, gathered in the graph being traced."""
    out = []
    for params in _buckets(group.params, lambda p: p.unsharded_dtype):
        bucket = _Bucket(params, group)
        if reshard:
            context = functools.partial(create_selective_checkpoint_contexts, _recompute_collectives)
            fulls = checkpoint(_gather_bucket, bucket, use_reentrant=False, context_fn=context)
        else:
            fulls = _gather_bucket(bucket)
        out += list(zip(params, fulls))
    return out


def cast_floating(dtype: torch.dtype, tree: Any) -> Any:
    """Every floating-point tensor in ``tree`` cast to ``dtype`` (the eager path's input and output casts, written
    with pytree, which dynamo traces).

    Example::

        >>> x, ids = cast_floating(torch.bfloat16, (torch.ones(2), torch.arange(2)))
        >>> x.dtype, ids.dtype
        (torch.bfloat16, torch.int64)
    """
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


def register(pairs: list[tuple[ShardedParam, torch.Tensor]]) -> None:
    """Point every module that uses a parameter at its tensor in ``pairs`` (gathered, or the sharded one back)."""
    for p, tensor in pairs:
        for module, name in p.uses:
            module._parameters[name] = tensor  # type: ignore[assignment]


def sharded(group: ParamGroup) -> list[tuple[ShardedParam, torch.Tensor]]:
    return [(p, p.sharded_param) for p in group.params]


def check_traceable(state: Any) -> None:
    """Raise ``TracedUnsupportedError``, naming the module and the setting, for what the traced path cannot run as the
    eager path does. Runs at trace time (dynamo guards on what it reads, so a setting changed later retraces)."""
    name = state._name()

    def refuse(what: str, fix: str) -> None:
        raise TracedUnsupportedError(f"fully_shard under torch.compile: {name} {what}, which the traced path (the "
                                     f"collectives in the compiled graph) does not support. {fix}")

    per_block = ("Or compile block by block (torch.compile each sharded block, not the model: its collectives then "
                 "run from eager hooks), see docs/compile.md.")
    if len(state.modules) > 1:
        refuse("is one fully_shard call over several modules", "Shard each module on its own. " + per_block)
    if any(hasattr(m, "_checkpoint_wrapped_module") for m in state.modules):
        # under aot_eager, AOT autograd then saves a DeviceMesh among the tensors for backward and fails at run time
        refuse("is in a checkpoint_wrapper (activation checkpointing)", per_block)
    group = state.group
    if group is None:
        return
    if group.is_unsharded:
        refuse("is unsharded when the traced forward starts (an explicit unshard(), or a forward not finished)",
               "Leave the gathering to the compiled forward.")
    o = group.options
    if not o.requires_gradient_sync or any(p.accumulated_grad is not None for p in group.params):
        refuse("has gradient sync off (set_requires_gradient_sync(False): gradient accumulation without reduction)",
               "Keep gradient sync on under a whole-model compile (each microbatch then reduce-scatters). " + per_block)
    if not o.requires_all_reduce:
        refuse("has set_requires_all_reduce(False)", per_block)
    if o.all_gather_comm is not None or o.reduce_scatter_comm is not None or o.all_reduce_hook is not None:
        refuse("has a custom collective (set_custom_all_gather / set_custom_reduce_scatter / an all-reduce hook)",
               per_block)
    if o.reduce_scatter_unused_params:
        refuse("has reduce_scatter_unused_params", per_block)
    for p in group.params:
        what = ("is offloaded to the CPU" if p.offload else "all-gathers itself (fsdp_pre_all_gather)" if p.extension
                else "is tied to a parameter of another fully_shard call" if len(p.tie.params) > 1
                else "is tensor parallel or on dp_mesh_dims" if type(p.mesh_layout) is not MeshLayout else None)
        if what is not None:
            refuse(f"has parameter {p.fqn!r}, which {what},", per_block)
