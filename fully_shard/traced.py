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
                  result reaches the sharded DTensor parameters through ``DTensor.to_local``'s autograd. With
                  gradient sync off (gradient accumulation), no collective: the full gradients leave the graph
                  through a leaf per parameter (``make_sinks``) into ``accumulated_grad``, which the next backward
                  with sync on adds to its own before its reduce-scatter, as the eager path does
    post_forward  the modules point at the sharded parameters again. ``reshard_after_forward`` says what backward
                  gets: True recomputes the all-gather in backward (a selective activation-checkpoint policy that
                  recomputes only the collective and its copy-out), False saves the gathered parameters, an int k
                  gathers in two levels and keeps the first, 1/k of the parameters (``_first_level``)

The compiler sees every collective (``_c10d_functional`` ops) and may bucket and reorder them. Nothing here runs when
not tracing; the eager hooks never run while tracing. What the traced path cannot express raises
``TracedUnsupportedError`` at trace time, naming the module and the setting (``check_traceable``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import operator
import weakref
from collections.abc import Iterator
from typing import Any, cast

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from . import compat
from .comm import Ranks, divide_factors
from .group import ParamGroup, _buckets
from .layout import MeshLayout, reduced_parts
from .param import ShardedParam, Tie


class TracedUnsupportedError(NotImplementedError):
    """A setting the traced path (``torch.compile`` of a model containing sharded modules) does not support."""


def _op_name(op: Any) -> str:
    # identity, not ==: dynamo on torch 2.11 cannot trace the comparison of two ReduceOps (divide_factors returns
    # ReduceOp.AVG itself)
    return "avg" if op is torch.distributed.ReduceOp.AVG else "sum"


class _Bucket:
    """What the traced all-gather of one bucket of a group (one unsharded dtype, one mesh) needs: constants only, so
    dynamo guards on them and the graph holds no Python objects."""

    def __init__(self, params: list[ShardedParam], group: ParamGroup, keep: Ranks | None = None) -> None:
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
        # reshard_after_forward=k: the k-rank group and its complement (the two-level gather, ``_first_level``)
        self.k = 0 if keep is None else keep.size
        self.k_group = None if keep is None else keep.group.group_name
        self.m = 0 if keep is None or keep.complement is None else keep.complement.size
        self.c_group = None if keep is None or keep.complement is None else keep.complement.group.group_name


def _pack(bucket: _Bucket, shards: Any) -> torch.Tensor:
    """This rank's 1-D shards, each padded to its slot and cast to the unsharded dtype, in one buffer."""
    pieces = []
    for shard, slot in zip(shards, bucket.slots):
        flat = shard.reshape(-1).to(bucket.dtype)
        pieces.append(flat if flat.numel() == slot else torch.nn.functional.pad(flat, (0, slot - flat.numel())))
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def _gather(bucket: _Bucket, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The full parameters of ``bucket`` from this rank's 1-D shards: pack, all-gather, copy out into each parameter's
    layout."""
    packed, world = _pack(bucket, shards), bucket.world
    gathered = packed if world == 1 else funcol.wait_tensor(funcol.all_gather_tensor(packed, 0, bucket.shard_group))
    return _copy_outs(bucket, gathered)


def _first_level(bucket: _Bucket, shards: Any) -> torch.Tensor:
    """reshard_after_forward=k, the first of two gathers: the packed shards of the ranks at this rank's index in every
    k-rank group (its complement group, in group order). It is what backward keeps: 1/k of the full parameters, as the
    eager path's post-forward slice."""
    packed, group = _pack(bucket, shards), cast(Any, bucket.c_group)
    return packed if bucket.m == 1 else funcol.wait_tensor(funcol.all_gather_tensor(packed, 0, group))


def _second_level(bucket: _Bucket, first: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The full parameters from ``_first_level``'s result, gathered within the k-rank group: index i's result holds the
    packed shards of ranks i, k + i, 2k + i, ... of the shard group, so the (k, m) blocks are transposed to rank-major
    order before the copy-out."""
    gathered = funcol.wait_tensor(funcol.all_gather_tensor(first, 0, cast(Any, bucket.k_group)))
    return _copy_outs(bucket, gathered.view(bucket.k, bucket.m, -1).transpose(0, 1).reshape(-1))


def _copy_outs(bucket: _Bucket, gathered: torch.Tensor) -> tuple[torch.Tensor, ...]:
    blocks = gathered.view(bucket.world, -1).split(bucket.slots, dim=1)  # (world, slot) each, rank-major
    return tuple(_copy_out(p, block) for p, block in zip(bucket.params, blocks))


def _copy_out(p: ShardedParam, block: torch.Tensor) -> torch.Tensor:
    """The full tensor of ``p`` from its ``(world, slot)`` block of the all-gather output, as the eager copy-out lays
    it: a flat padded buffer whose rank-major view receives the block, seen without padding."""
    layout = p.layout
    flat = torch.empty(layout.padded_numel, dtype=block.dtype, device=block.device)
    dest = layout.rank_major(flat, layout.local_shape)
    dest.copy_(block.reshape(dest.shape))
    return layout.unsharded(flat)


def _reduce(bucket: _Bucket, grads: tuple[torch.Tensor | None, ...],
            held: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """This rank's reduced gradient of each parameter (its local shape, its sharded dtype) from the full ones, each
    added to the full gradient accumulated while gradient sync was off (``held``: reduce dtype, or None) as the eager
    path adds it (``ParamGroup.reduce_grads``)."""
    full: list[torch.Tensor | None] = []
    for g, acc in zip(grads, held):
        g = None if g is None else g.to(bucket.reduce_dtype)
        full.append(g if acc is None else acc if g is None else acc + g)
    if all(g is None for g in full):
        return [None] * len(grads)
    full = [torch.zeros(p.size, dtype=bucket.reduce_dtype, device=p.device) if g is None else g
            for p, g in zip(bucket.params, full)]
    world = bucket.world
    inp = torch._chunk_cat([p.layout.grad_for_reduce(cast(torch.Tensor, g)) for p, g in zip(bucket.params, full)],
                           dim=0, num_chunks=world)  # (world, cols): row r is rank r's slots
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
    """All-gather forward, for one bucket; ``tensors`` are its shards, then, in backward:

    - gradient sync on: one reduce-scatter of the full gradients, each added to the one accumulated while sync was off
      where ``held`` (a flag per parameter) says so; the held gradients follow the shards in ``tensors``;
    - gradient sync off: no collective; the sinks (``make_sinks``) follow the shards in ``tensors``, and each full
      gradient, in the reduce dtype, goes to its parameter's sink, whose hook accumulates it as the eager path does.
    """

    @staticmethod
    def forward(ctx: Any, bucket: _Bucket, sync: bool, held: tuple[bool, ...], first: torch.Tensor | None,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = len(bucket.params)
        ctx.bucket, ctx.sync, ctx.held, ctx.extra = bucket, sync, held, len(tensors) - n
        if sync:
            ctx.save_for_backward(*tensors[n:])
        # ``first``: reshard_after_forward=k's first-level result (then the shards only route the gradients)
        return _gather(bucket, *tensors[:n]) if first is None else _second_level(bucket, first)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        bucket, none = ctx.bucket, (None,) * ctx.extra
        if not ctx.sync:
            to_sinks = [None if g is None else g.to(bucket.reduce_dtype) for g in grads]
            return (None, None, None, None, *(None,) * len(grads), *to_sinks)
        saved = iter(ctx.saved_tensors)
        held = [next(saved) if h else None for h in ctx.held]
        return (None, None, None, None, *_reduce(bucket, grads, held), *none)


def _gather_bucket(bucket: _Bucket, sync: bool, flags: tuple[bool, ...], inside: bool, first: torch.Tensor | None,
                   *held: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # differentiable: grads reach the DTensor parameters (taken before the checkpointed region, ``take_locals``)
    shards = [cast(torch.Tensor, p.traced_local) if inside else cast(DTensor, p.sharded_param).to_local()
              for p in bucket.params]
    if not sync:
        sinks = [cast(torch.Tensor, p.tie.sink) for p in bucket.params]
        return _GatherFunction.apply(bucket, False, (), first, *shards, *sinks)  # type: ignore[no-untyped-call, no-any-return]
    return _GatherFunction.apply(bucket, True, flags, first, *shards, *held)  # type: ignore[no-untyped-call, no-any-return]


def _recompute_collectives(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """reshard_after_forward: recompute everything of the gather in backward (the collective, its wait and the
    copy-out), so nothing it produced is kept for backward but what the modules save themselves."""
    return CheckpointPolicy.MUST_RECOMPUTE


def gathered_params(group: ParamGroup, reshard: bool, inside: bool = False,
                    keep: dict[int, Ranks] | None = None) -> list[tuple[ShardedParam, torch.Tensor]]:
    """Each parameter of ``group`` with its full tensor, gathered in the graph being traced. Under grad mode with
    gradient sync on, the gradients accumulated with it off are this backward's to reduce: taken here (cleared now, as
    the eager ``reduce_grads`` clears them), outside the checkpoint, which allows no side effects. ``inside``: in a
    ``checkpoint_wrapper``'s checkpointed region, from the local shards ``take_locals`` took before it. ``keep``
    (reshard_after_forward=k: per mesh, the k-rank group): gathered in two levels, the first kept for backward, the
    second recomputed from it (the eager path's post-forward slice and its k-rank gather)."""
    grad = torch.is_grad_enabled()
    sync = group.options.requires_gradient_sync or not grad
    out = []
    for params in _buckets(group.params, lambda p: p.unsharded_dtype):
        k_ranks = (keep or {}).get(id(params[0].mesh_info)) if reshard and not inside else None
        bucket = _Bucket(params, group, k_ranks)
        held = [p.tie.grad if sync and grad else None for p in params]
        for p in params if sync and grad else ():
            p.tie.grad = None
        flags, tensors = tuple(h is not None for h in held), [h for h in held if h is not None]
        if reshard or inside:  # in a checkpointed region too: the region's own policy alone, torch 2.11 saves it
            first = None if k_ranks is None else _first_level(
                bucket, [cast(DTensor, p.sharded_param).to_local().detach() for p in params])  # kept for backward
            context = functools.partial(create_selective_checkpoint_contexts, _recompute_collectives)
            fulls = checkpoint(_gather_bucket, bucket, sync, flags, inside, first, *tensors, use_reentrant=False,
                               context_fn=context)
        else:
            fulls = _gather_bucket(bucket, sync, flags, False, None, *tensors)
        out += list(zip(params, fulls))
    return out


def checkpointed(state: Any) -> torch.nn.Module | None:
    """The module a ``checkpoint_wrapper`` checkpoints, where ``state``'s one module is that wrapper (torchtitan applies
    activation checkpointing to each block, then ``fully_shard``), else None.

    Traced, such a group with ``reshard_after_forward`` is gathered inside the checkpointed region (the inner module's
    hooks, under the policy that recomputes it, whatever the region's policy saves), so the backward gathers again
    rather than keep the full parameters: the region's side effects (pointing the modules at the gathered parameters
    and back) are then not replayed by the recomputation, which dynamo allows under
    ``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint`` (``compile_whole`` sets it)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    module = state.modules[0]
    wrapped = len(state.modules) == 1 and isinstance(module, CheckpointWrapper)
    return cast(torch.nn.Module, module._checkpoint_wrapped_module) if wrapped else None


def take_locals(group: ParamGroup) -> None:
    """Each parameter's local shard (``DTensor.to_local``, differentiable), taken outside the checkpointed region that
    gathers it, so the region computes on plain tensors."""
    for p in group.params:
        p.traced_local = cast(DTensor, p.sharded_param).to_local()


def cast_floating(dtype: torch.dtype, tree: Any) -> Any:
    """Every floating-point tensor in ``tree`` cast to ``dtype`` (the eager path's input and output casts, written
    with pytree, which dynamo traces).

    Example::

        >>> x, ids = cast_floating(torch.bfloat16, (torch.ones(2), torch.arange(2)))
        >>> x.dtype, ids.dtype
        (torch.bfloat16, torch.int64)
    """
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


def compile_options(bucket: bool = False, overlap: bool = True) -> dict[str, Any]:
    """Inductor's ``options`` for ``torch.compile`` of a whole model sharded with ``fully_shard``, whose collectives the
    graph holds (docs/compile.md). ``overlap``: its scheduler's overlap passes, which issue each all-gather early and
    wait for it and for each reduce-scatter late, so the collectives run under compute (for more memory: gathered
    blocks are held sooner); inductor skips them under ``torch.use_deterministic_algorithms(True)``. ``bucket``: its
    FX passes that make a graph's all-gathers one collective, and its reduce-scatters one (fewer collectives, every
    block's parameters unsharded at once).

    Example::

        >>> options = compile_options()  # model.compile(fullgraph=True, options=options)
        >>> options["reorder_for_compute_comm_overlap_passes"][1]
        'sink_waits_iterative'
        >>> sorted(compile_options(bucket=True, overlap=False))
        ['bucket_all_gathers_fx', 'bucket_reduce_scatters_fx']
    """
    options: dict[str, Any] = {}
    if bucket:
        options.update(bucket_all_gathers_fx="all", bucket_reduce_scatters_fx="all")
    if overlap:  # the passes inductor's config.py recommends; with the flag alone (no passes) it reorders nothing
        early = "reorder_communication_preserving_peak_memory"
        options.update(reorder_for_compute_comm_overlap=True,
                       reorder_for_compute_comm_overlap_passes=[early, "sink_waits_iterative", early])
    return options


# True while ``random_recompute_checked`` holds (compile_whole's calls of a model with checkpointed blocks)
_random_checked = False


@contextlib.contextmanager
def random_recompute_checked() -> Iterator[None]:
    """While it holds, AOT autograd's partitioner decides which recomputed ops are random as torch 2.14 does
    (``compat.random_op``: attention without dropout is not; torch 2.13 counts it random, then fails on what it saves),
    and saves a recomputed random op's state where its runtime reads it (``_states_before_meshes``). ``compile_whole``
    runs the calls of a model with checkpointed blocks under it; dynamo compiles in the first call (and in a
    recompiling one)."""
    global _random_checked
    partitioners: Any = importlib.import_module("torch._functorch.partitioners")
    originals = partitioners.has_recomputable_rng_ops, partitioners.functionalize_rng_ops
    opaque = getattr(partitioners, "is_opaque_node", lambda node: False)  # torch 2.11: a DeviceMesh is no graph input

    def has_recomputable_rng_ops(graph: torch.fx.GraphModule) -> bool:
        return any(partitioners.must_recompute(n) and compat.random_op(n) for n in graph.graph.nodes)

    def functionalize_rng_ops(*args: Any) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        forward, backward = originals[1](*args)
        _states_before_meshes(forward, backward, opaque)
        return forward, backward

    partitioners.has_recomputable_rng_ops, partitioners.functionalize_rng_ops = (has_recomputable_rng_ops,
                                                                                 functionalize_rng_ops)
    _random_checked = True
    try:
        yield
    finally:
        (partitioners.has_recomputable_rng_ops, partitioners.functionalize_rng_ops), _random_checked = originals, False


def _states_before_meshes(forward: torch.fx.GraphModule, backward: torch.fx.GraphModule, opaque: Any) -> None:
    """AOT autograd's ``functionalize_rng_ops`` (torch 2.13, 2.14.1) saves each recomputed random op's state (a tensor)
    at the end of the saved values, after the saved opaque objects (the DeviceMesh of DTensor parameters), where its
    runtime takes only opaque objects ("expected all tensors_saved_with_vc_check to be Tensors"). Moved before them,
    in the forward's outputs and the backward's inputs alike, the states are saved tensors like the others."""
    from torch._prims.rng_prims import run_and_save_rng_state

    output = next(iter(forward.graph.find_nodes(op="output")))
    outs = list(output.args[0])
    states = [n for n in outs if isinstance(n, torch.fx.Node) and n.target is operator.getitem
              and getattr(n.args[0], "target", None) is run_and_save_rng_state]
    first = next((i for i, n in enumerate(outs) if isinstance(n, torch.fx.Node) and opaque(n)), None)
    if not states or first is None or outs.index(states[0]) < first:
        return
    rest = [n for n in outs if not any(n is s for s in states)]
    output.args = (tuple(rest[:first] + states + rest[first:]),)
    placeholders = list(backward.graph.find_nodes(op="placeholder"))
    meshes = [n for n in placeholders if opaque(n)]
    inputs = [n for n in placeholders if n.name.startswith("rng_state_output_")]  # torch's names for them
    if len(inputs) != len(states) or not meshes:  # never a forward and a backward that disagree
        raise TracedUnsupportedError(
            f"fully_shard under torch.compile: torch {torch.__version__}'s AOT autograd saved {len(states)} random "
            f"states for backward, which takes {len(inputs)} (by their names) beside {len(meshes)} DeviceMesh inputs; "
            "fully_shard cannot place them where its runtime reads them. Set dropout to 0 in the checkpointed blocks, "
            "or compile per block.")
    for state in inputs:
        meshes[0].prepend(state)
    forward.recompile()
    backward.recompile()


def compile_whole(model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
    """Compile ``model`` in place (``model.compile``, so its ``state_dict`` keys stay) with its own hooks traced too:
    the root's group (embeddings, final norm, output) is gathered and reduced in the graph with the blocks', where
    ``torch.compile(model)`` runs the compiled module's own hooks eagerly, outside the graph (docs/compile.md).
    ``kwargs`` are ``torch.compile``'s, ``fullgraph=True`` unless given. Returns ``model``; the first call traces.
    Where blocks are in a ``checkpoint_wrapper`` (activation checkpointing), the calls run with
    ``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint`` set (see ``checkpointed``) and under
    ``random_recompute_checked``.

    Example::

        >>> for layer in model.layers:
        ...     _ = fully_shard(layer, mesh=mesh)
        >>> model = compile_whole(fully_shard(model, mesh=mesh), options=compile_options())
        >>> model._compiled_call_impl is not None  # traced, root hooks included, at the first call
        True
    """
    import torch._dynamo
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    kwargs.setdefault("fullgraph", True)
    # dynamo then traces the module call itself (hooks included) instead of running the hooks and tracing forward
    with torch._dynamo.config.patch(wrap_top_frame=True):
        model.compile(**kwargs)
    if any(isinstance(m, CheckpointWrapper) for m in model.modules()):
        # a block in a checkpoint_wrapper gathers inside its checkpointed region (``checkpointed``): dynamo must allow
        # the region's side effects while it traces, which happens in the calls
        compiled = cast(Any, model._compiled_call_impl)

        @functools.wraps(compiled)
        def call(*args: Any, **kw: Any) -> Any:
            with (torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True),
                  random_recompute_checked()):
                return compiled(*args, **kw)

        model._compiled_call_impl = call
    return model


def register(pairs: list[tuple[ShardedParam, torch.Tensor]]) -> None:
    """Point every module that uses a parameter at its tensor in ``pairs`` (gathered, or the sharded one back)."""
    for p, tensor in pairs:
        for module, name in p.uses:
            module._parameters[name] = tensor  # type: ignore[assignment]


def sharded(group: ParamGroup) -> list[tuple[ShardedParam, torch.Tensor]]:
    return [(p, p.sharded_param) for p in group.params]


def make_sinks(group: ParamGroup) -> None:
    """Give each parameter of ``group`` a sink for its full gradient while gradient sync is off: a leaf of the full
    shape and the reduce dtype that holds no memory (a 0-d tensor expanded), which the traced backward's
    ``_GatherFunction`` gives the gradient and autograd's ``AccumulateGrad`` (eager, after the compiled backward)
    stores; its hook then moves it into ``accumulated_grad`` as ``ParamGroup.reduce_grads`` does (the first one kept,
    later ones added in place), so both paths accumulate into the one state. Runs eagerly, from
    ``set_requires_gradient_sync(False)``: a leaf cannot be made while tracing."""
    for p in group.params:
        if _sink_fits(p):
            continue
        sink = torch.empty((), dtype=p.reduce_dtype, device=p.device).expand(p.size).detach().requires_grad_()
        # the hook refers to the tie weakly: the tie holds the sink, whose hooks autograd keeps where the collector
        # cannot see them, so a strong reference would keep the whole model alive after its last use
        sink.register_post_accumulate_grad_hook(functools.partial(_accumulate, weakref.ref(p.tie)))
        p.tie.sink = sink


def _check_checkpointed(state: Any, refuse: Any, per_block: str) -> None:
    """Activation checkpointing the traced path supports: ``fully_shard`` on a (non-reentrant) ``checkpoint_wrapper``,
    on torch 2.13 or later (2.13: under ``compile_whole``), with dynamo allowing the region's side effects
    (``checkpointed``)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper, CheckpointImpl

    from .param import STATE_ATTR

    def wrappers(module: torch.nn.Module, prefix: str) -> list[str]:  # below it, down to other calls' modules
        found = []
        for name, child in module.named_children():
            if STATE_ATTR not in child.__dict__:
                found += [prefix + name] * isinstance(child, ActivationWrapper) + wrappers(child, f"{prefix}{name}.")
        return found

    inner = checkpointed(state)
    nested = [w for m in state.modules for w in wrappers(m, "")]
    if nested:
        refuse(f"has an activation-checkpoint wrapper inside it ({nested[0]!r}), whose region would keep the gathered "
               "parameters", "Apply fully_shard to the checkpoint_wrapper itself (torchtitan's order: "
               "checkpoint_wrapper each block, then fully_shard it). " + per_block)
    if inner is None:
        if any(isinstance(m, ActivationWrapper) for m in state.modules):
            refuse("is in an activation wrapper other than checkpoint_wrapper (offload_wrapper)", per_block)
        return
    import torch._dynamo

    if state.modules[0].checkpoint_impl is CheckpointImpl.REENTRANT:
        refuse("is in a reentrant checkpoint_wrapper", "Use checkpoint_impl=CheckpointImpl.NO_REENTRANT (the default).")
    # plain torch.compile on 2.13 and later: refused before torch fails at run time, where compile_whole saves the
    # random state where torch reads it (random_recompute_checked); F.dropout shows no module: torch's error then
    random_fails = compat.random_state_after_mesh() and not _random_checked
    dropout = next(((name, m.p) for name, m in inner.named_modules()
                    if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 and m.training), None)
    if dropout is not None and random_fails:
        refuse(f"has dropout in its checkpointed region ({dropout[0]!r}, p={dropout[1]:g}) under plain torch.compile "
               f"on torch {torch.__version__}, whose AOT autograd saves its random state where its runtime fails on it "
               "(torch's error: expected all tensors_saved_with_vc_check to be Tensors)",
               "Compile with fully_shard.compile_whole (it saves that state where torch reads it), or set its p to 0 "
               "(or eval()). " + per_block)
    if random_fails and compat.ZERO_DROPOUT_IS_RANDOM:
        refuse(f"is in a checkpoint_wrapper (activation checkpointing) under plain torch.compile on torch "
               f"{torch.__version__}, whose AOT autograd counts attention without dropout as random and then fails on "
               "the random state it saves", "Compile with fully_shard.compile_whole (it tells AOT autograd otherwise, "
               "as torch 2.14 decides). " + per_block)
    if not torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint:
        refuse("is in a checkpoint_wrapper whose checkpointed region gathers it, with "
               "torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint off (dynamo then refuses the "
               "region's side effects: pointing the modules at the gathered parameters and back)",
               "Compile with fully_shard.compile_whole (it sets that flag while the model runs), or set it to True.")


def _sink_fits(p: ShardedParam) -> bool:
    sink = p.tie.sink
    return sink is not None and sink.dtype == p.reduce_dtype and sink.device == p.device and sink.shape == p.size


def _accumulate(tie_ref: weakref.ref[Tie], sink: torch.Tensor) -> None:
    grad, sink.grad, tie = sink.grad, None, tie_ref()
    if grad is not None and tie is not None:
        tie.grad = grad if tie.grad is None else tie.grad.add_(grad)


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
    _check_checkpointed(state, refuse, per_block)
    group = state.group
    if group is None:
        return
    if state.ctx is None:  # no eager forward yet (the root traced too): what the eager root's lazy init checks
        for p in group.params:
            p.check_materialized()
            if any(module._parameters.get(attr) is not p.sharded_param for module, attr in p.uses):
                refuse(f"has parameter {p.fqn!r} replaced after fully_shard",
                       "Run one forward eagerly first (it shards the replacement, or refuses it), then compile.")
    if group.is_unsharded:
        refuse("is unsharded when the traced forward starts (an explicit unshard(), or a forward not finished)",
               "Leave the gathering to the compiled forward.")
    o = group.options
    if not o.requires_gradient_sync and any(not _sink_fits(p) for p in group.params):
        # the sinks are made by set_requires_gradient_sync(False) (eagerly: a leaf cannot be made while tracing)
        refuse("has gradient sync off but its parameters changed dtype or device since "
               "set_requires_gradient_sync(False)",
               "Call set_requires_gradient_sync(False) again after moving or casting the model.")
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
