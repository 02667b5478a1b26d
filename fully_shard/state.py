"""The hook driver: the only file that registers module, autograd and state-dict hooks.

One ``FSDPState`` per ``fully_shard`` call. The first forward through an FSDP module makes it the root: it finds every
state below it and links them to one ``RootContext`` that holds per-iteration bookkeeping (execution order, the
reduction in flight, the end of backward). Each state runs its group through the four phases:

    pre_forward   unshard (or take a prefetched all-gather), prefetch the next group,
                  hook the inputs so post_backward runs when their gradients are ready
    post_forward  reshard if asked, hook the outputs so pre_backward runs on their grads
    pre_backward  unshard again if resharded, prefetch the group next in backward
    post_backward reduce-scatter the gradients, reshard

A ``Note [name]`` points to the invariant of that name in docs/design.md's Invariants section.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from enum import Enum, IntEnum, auto
from typing import Any

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import traced
from .comm import Ranks, all_reduce, record_function
from .group import GradState, GroupState, ParamGroup, PendingReduce, transition
from .param import STATE_ATTR, ShardedParam
from .policy import MixedPrecisionPolicy
from .streams import Streams


def _not_traced(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Keep a hook out of ``torch.compile`` graphs: it drives communication and Python state, so a compiled block runs
    its body compiled and these hooks eagerly around it."""
    return functools.wraps(fn)(torch.compiler.disable(fn, recursive=True))


def _eager_as_top_frame(*hooks: Callable[..., Any]) -> None:
    """Run these hooks eagerly when dynamo meets them as a frame of their own, yet trace them when it inlines them.

    ``torch.compile(module)`` runs the module's own hooks as frames of their own (``nn.Module.__call__`` is not traced):
    those stay eager, so a block compiled on its own (torchtitan's per-block compile) keeps its collectives in eager
    hooks around the graph, and the outermost module of a whole-model compile runs its group eagerly. A sharded module
    called inside a traced forward has its hooks inlined into that graph: they take the traced path. The skip is
    per code object (every state's closures share it) and applies only to frames dynamo is handed, not to inlining."""
    from torch._dynamo.eval_frame import skip_code

    for hook in hooks:
        skip_code(hook.__code__)


class TrainingState(Enum):
    """Which phase a state is in; the memory its group holds is the group's ``GroupState``."""

    IDLE = auto()  # entered by post-forward; the end of backward and reset() return every state here
    FORWARD = auto()  # entered by pre-forward; its module's forward runs on the gathered group. With several modules
    #                   the pass is open and ``to_run`` holds the members yet to run; leaving FORWARD empties it
    PRE_BACKWARD = auto()  # entered when its outputs' first gradient arrives: the group is gathered for backward
    POST_BACKWARD = auto()  # entered by post-backward: its gradients went to the reduction; it stays until the end of
    #                         backward unless another call of its module (a module called twice) reaches it again


_IDLE, _FORWARD, _PRE, _POST = TrainingState
# ``FSDPState.move_to``'s table. Besides the phases in order: a registered forward method calling forward nests them
# (IDLE -> IDLE, FORWARD -> FORWARD); a backward may reach a group whose pass is open (a chunked loss), or its inputs
# without its outputs (-> POST_BACKWARD); a module called twice, or recomputed after its post-backward, leaves
# POST_BACKWARD for PRE_BACKWARD, POST_BACKWARD or FORWARD
_TRANSITIONS = {_IDLE: {_IDLE, _FORWARD, _PRE, _POST}, _FORWARD: {_FORWARD, _IDLE, _PRE, _POST}, _PRE: {_POST},
                _POST: {_PRE, _POST, _FORWARD}}


class Callback(Enum):
    """Whether the root's end-of-backward callback is queued on autograd's engine."""

    IDLE = auto()  # no backward under way: entered at the end of finalize_backward and by reset()
    QUEUED = auto()  # entered when the first backward hook of a backward runs; left by finalize_backward


_CALLBACK_TRANSITIONS = {Callback.IDLE: {Callback.QUEUED}, Callback.QUEUED: {Callback.IDLE}}


class Seen(IntEnum):
    """A column of the skipped-module agreement's table (``_agree_on_skipped``): what a rank's forward did with a group,
    one-hot in the first three; after the MAX all-reduce, 1 where any rank saw it."""

    UNTOUCHED = 0  # its module did not run and it was not gathered
    SKIPPED = 1  # gathered (prefetched, or unshard()) but its module did not run
    RAN = 2  # its module ran forward
    HELD = 3  # not a case: it holds gradients accumulated with gradient sync off


class RootContext:
    """Bookkeeping shared by every state under one root, reset each iteration."""

    def __init__(self, states: list[FSDPState], streams: Streams) -> None:
        self.states = states  # module pre-order, root first
        self.streams = streams  # shared by every group under the root
        self.forward_order: list[FSDPState] = []  # pre-forward order, this iteration
        self.prev_forward_order: list[FSDPState] = []  # ... of the last iteration: forward prefetch
        self.post_forward_order: list[FSDPState] = []  # reversed, the backward order
        self.callback = Callback.IDLE
        # reductions in flight, oldest first. At most max_in_flight stay after a post-backward: by default 1, so
        # the previous group's is finished once the next is issued (set_reduce_scatter_max_input_buffers)
        self.pending: list[PendingReduce] = []
        self.resolve_max_in_flight()
        self.is_last_backward = True
        self.post_optim_event: torch.Event | None = None
        self.foreign_ignored: list[nn.Parameter] = []  # ignored parameters of modules outside the model, until checked

    def finish_reduce(self, keep: int = 0) -> None:
        """Finish the oldest reductions until at most ``keep`` are in flight."""
        while len(self.pending) > keep:
            pending = self.pending.pop(0)
            pending.group.finish_reduce(pending)

    def resolve_max_in_flight(self) -> None:
        groups = [s.group for s in self.states if s.group is not None]
        self.max_in_flight = max((g.options.max_input_buffers for g in groups), default=1)

    def queue_finalize(self) -> None:
        """Once per backward: have autograd call ``finalize_backward`` when it is done."""
        if self.callback is Callback.IDLE:
            self.callback = transition("the root's callback", _CALLBACK_TRANSITIONS, self.callback, Callback.QUEUED)
            Variable._execution_engine.queue_callback(self.finalize_backward)

    def finalize_backward(self) -> None:
        """Settle, at the end of backward, the groups autograd did not reach. Note [one post-backward per backward]:
        every group still DUE or AT_END is reduced here, so none owes a reduction once this returns."""
        with record_function("fully_shard::finalize_backward"):
            for state in self.states:
                group = state.group
                if group is not None and (group.grad_state is not GradState.NONE or group.has_unsharded_grads()):
                    # inputs needed no gradient, or params unused; or gradients that arrived after this group's
                    # post-backward ran: a backward over part of the graph (a chunked loss) settles every group, then a
                    # later one reaches it
                    if group.grad_state is GradState.AT_END:
                        group.move_grads(GradState.DUE)  # the end has come: Note [same collectives everywhere]
                    state.post_backward(self)
            # not the last backward (pipelining's microbatches): reductions may overlap the next forward, but not one
            # whose hooks step an optimizer: torch's FSDP2 runs them within this backward, before that forward
            if self.is_last_backward or any(p.runs_hooks() for p in self.pending):
                with torch.no_grad():
                    self.finish_reduce()
            self.streams.wait_host()  # offloaded gradients in pinned memory: copied before the optimizer reads them
            for state in self.states:
                state.move_to(TrainingState.IDLE, end=True)  # closes passes opened by members called on their own
                group = state.group
                if group is not None and group.state is not GroupState.SHARDED and group.options.reshard_after_backward:
                    group.reshard()  # prefetched but never used, or kept after forward for a backward that never came
            self.post_forward_order = []
            self.callback = transition("the root's callback", _CALLBACK_TRANSITIONS, self.callback, Callback.IDLE)

    def reset(self) -> None:
        """Drop everything an aborted forward or backward left behind."""
        self.pending = []  # their peers may have failed: never wait on them
        for state in self.states:
            state.move_to(TrainingState.IDLE, end=True)
            if state.group is not None:
                state.group.reset()
        self.forward_order = []
        self.post_forward_order = []
        self.callback = Callback.IDLE


class _PostBackward(torch.autograd.Function):
    """Identity on a module's inputs whose backward runs once their gradients are computed, which is when the module's
    own backward has finished."""

    @staticmethod
    def forward(ctx: Any, state: FSDPState, root: RootContext, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.state, ctx.root = state, root
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.state.post_backward(ctx.root)
        return (None, None, *grads)


class FSDPState:
    """Hooks and phases for the group of one ``fully_shard`` call over ``modules``."""

    def __init__(
        self, modules: tuple[nn.Module, ...], group: ParamGroup | None, device: torch.device,
        reshard_after_forward: bool | None, post_forward_ranks: dict[int, Ranks], mp_policy: MixedPrecisionPolicy,
        ignored_params: set[nn.Parameter],
    ) -> None:
        self.modules = modules
        self.mp_policy = mp_policy
        self.group = group
        self.device = device
        self.reshard_after_forward = reshard_after_forward  # None: decided at lazy init (False for the root)
        # reshard_after_forward=k: this rank's k-rank group, by id(MeshInfo)
        self.post_forward_ranks = post_forward_ranks
        self.is_root = False  # decided at lazy init
        self.enclosed = False  # a later fully_shard call's module contains this one's (set by that call)
        self.ctx: RootContext | None = None  # set at lazy init: ``lazy_init()`` returns it
        self.training_state = TrainingState.IDLE
        self.forward_prefetch: list[FSDPState] | None = None  # explicit, overrides implicit
        self.backward_prefetch: list[FSDPState] | None = None
        self._post_forward_index = -1
        self.shared_streams: Streams | None = None  # share_comm_ctx
        self.fqn: str | None = None  # of its module in the root, once lazy init knows it ("": the root)
        self.ignored_params = ignored_params
        self.to_run: set[nn.Module] = set()  # members yet to run in the open forward pass
        self.gather_inside = False  # traced, in a checkpoint_wrapper: gathered inside its checkpointed region
        self._register_hooks()
        if group is not None:
            _register_state_dict_hooks(group)

    def move_to(self, state: TrainingState, end: bool = False) -> None:
        """Checked against the table, but at the end of backward (or a reset), which returns any state to IDLE."""
        self.training_state = state if end else transition(self._name(), _TRANSITIONS, self.training_state, state)
        if state is not TrainingState.FORWARD:
            self.to_run.clear()

    def _name(self) -> str:
        """Its module(s) for messages: by fully-qualified name once the root is known."""
        cls = ", ".join(type(m).__name__.removeprefix("FSDP") for m in self.modules)
        return (cls if self.fqn is None else f"the root module ({cls})" if self.fqn == ""
                else f"module {self.fqn!r} ({cls})")

    # -- hooks -----------------------------------------------------------------------

    def _register_hooks(self) -> None:
        """Forward hooks on the module(s). A multi-module group opens a *pass* when its first member starts forward
        (``pre_forward``) and closes it when every member has run (``post_forward``); a member running inside the open
        pass (a chunked loss calls ``head`` once per chunk) only gets the group gathered and its inputs and output cast.
        The root's post-forward closes a pass some member never joined; the end of backward, one opened outside the
        root's forward."""
        if len(self.modules) == 1:
            eager_pre = _not_traced(lambda module, args, kwargs: self.pre_forward(args, kwargs))
            eager_post = _not_traced(lambda module, args, output: self.post_forward(output))
        else:
            eager_pre, eager_post = self._member_pre_forward, self._member_post_forward

        # Note [two ways to run one schedule]: while dynamo traces, the hooks take the traced path (traced.py), which
        # puts the collectives in the graph; the eager path is kept out of graphs (``_not_traced``)
        def pre_hook(module: nn.Module, args: Any, kwargs: Any) -> Any:
            if torch.compiler.is_compiling():
                return self.traced_pre_forward(args, kwargs)
            return eager_pre(module, args, kwargs)

        def post_hook(module: nn.Module, args: Any, output: Any) -> Any:
            if torch.compiler.is_compiling():
                return self.traced_post_forward(output)
            return eager_post(module, args, output)

        _eager_as_top_frame(pre_hook, post_hook)
        for module in self.modules:
            module.register_forward_pre_hook(pre_hook, prepend=True, with_kwargs=True)
            module.register_forward_hook(post_hook, prepend=False)
        inner = traced.checkpointed(self)
        if inner is not None:  # the traced gather inside the checkpointed region (traced.py: activation checkpointing)
            def inner_pre(module: nn.Module, args: Any) -> None:
                if torch.compiler.is_compiling() and self.group is not None and self.gather_inside:
                    traced.register(traced.gathered_params(self.group, False, inside=True))

            def inner_post(module: nn.Module, args: Any, output: Any) -> None:
                if torch.compiler.is_compiling() and self.group is not None and self.gather_inside:
                    traced.register(traced.sharded(self.group))

            inner.register_forward_pre_hook(inner_pre, prepend=True)
            inner.register_forward_hook(inner_post)

    @_not_traced
    def _member_pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        if self.training_state is TrainingState.FORWARD:
            # another member of the open pass: the group is gathered (again, after a reshard
            # in between, e.g. an explicit reshard()) and the member's inputs cast
            with record_function("fully_shard::pre_forward"):
                if self.group is not None:
                    self.group.unshard()
                return self._cast_inputs(args, kwargs)
        if self.training_state is not TrainingState.PRE_BACKWARD:  # not a recomputation
            self.to_run = set(self.modules)
        return self.pre_forward(args, kwargs)

    @_not_traced
    def _member_post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if module in self.to_run:
            self.to_run.discard(module)
            if not self.to_run:
                return self.post_forward(output)
        elif self.training_state is TrainingState.PRE_BACKWARD:
            return self.post_forward(output)
        if torch.is_grad_enabled() and self.group is not None:
            # the pass stays open, so these outputs get no pre-backward hook; should the group be resharded before their
            # backward (an explicit reshard()), gather it again rather than let backward read freed storage
            _on_grad(output, functools.partial(self._regather, self.lazy_init()))
        return self._cast_output(output)

    def _cast_inputs(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        mp = self.mp_policy
        if mp.cast_forward_inputs and mp.param_dtype is not None:
            args, kwargs = _map_tensors(_floating_cast(mp.param_dtype), (args, kwargs))
        return args, kwargs

    # -- lazy root initialisation -------------------------------------------------------

    def lazy_init(self) -> RootContext:
        """The root context, made at the first call: this state becomes the root of every state below its module(s)."""
        if self.ctx is not None:
            return self.ctx
        names: dict[FSDPState, str] = {}  # every state below, in module pre-order, root first
        paths: dict[int, str] = {}  # id(module) -> its name: the parameters' (a group's modules may be anywhere)
        for root_module in self.modules:
            for name, sub in root_module.named_modules():
                paths.setdefault(id(sub), name)
                state = getattr(sub, STATE_ATTR, None)
                if state is None or state in names:
                    continue
                if state.ctx is not None:
                    raise RuntimeError(f"fully_shard: the module {name!r} inside {type(root_module).__name__} already "
                                       "ran forward on its own, which made it a root. Run forward through the "
                                       "outermost fully_shard module first (call fully_shard on the model last).")
                names[state] = name
        ctx = RootContext(list(names), self.shared_streams or Streams(self.device))
        for state, prefix in names.items():
            state.ctx = ctx
            state.is_root = state is self
            state.fqn = prefix
            if state.reshard_after_forward is None:
                state.reshard_after_forward = not state.is_root
            if state.group is not None:
                state.group.streams = ctx.streams
                state.group.label = prefix or f"{type(self.modules[0]).__name__.removeprefix('FSDP')} (root)"
                for p in state.group.params:
                    where = paths.get(id(p.uses[0][0]))
                    p.fqn = p.local_fqn if where is None else f"{where}.{p.uses[0][1]}".lstrip(".")
        # a parameter another group manages is not a replacement to pick up but a tie made
        # after sharding, refused by _check_registered_params
        params = [p for state in names if state.group is not None for p in state.group.params]
        managed = {id(p.sharded_param) for p in params}
        for p in params:
            p.pick_up_replacement(managed)
            p.check_materialized()
        if any(len(p.tie.params) > 1 for p in params):
            from .tools.tied import warn_held_twice  # Note [tied parameters]

            warn_held_twice(self, list(names))
        from .tools.checks import check_enclosing_model, check_ignored  # refusals of the whole model, once

        check_enclosing_model(self)
        ctx.foreign_ignored = check_ignored(self, list(names))  # warned about at the second forward, if still loose
        return ctx

    # -- forward, traced (traced.py) ------------------------------------------------------

    def traced_pre_forward(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """While dynamo traces: gather the group in the graph and point its modules at the full parameters."""
        traced.check_traceable(self)
        mp = self.mp_policy
        if mp.cast_forward_inputs and mp.param_dtype is not None:
            args, kwargs = traced.cast_floating(mp.param_dtype, (args, kwargs))
        root = self.is_root if self.ctx is not None else not self.enclosed  # before lazy init: by the module tree
        if root and self.device.type != "cpu":  # the root traced too (compile_whole): the eager root's input move
            args, kwargs = _map_tensors(lambda t: t.to(self.device), (args, kwargs))
        if self.group is not None:
            # None (no lazy init yet: the root traced too): the root's default, False, else True. An int: its k-rank
            # groups (post_forward_ranks), a two-level gather (traced.gathered_params)
            reshard = self.enclosed if self.reshard_after_forward is None else self.reshard_after_forward
            reshard = bool(reshard) and torch.is_grad_enabled()
            # in a checkpoint_wrapper, resharded: gathered inside its checkpointed region (its inner module's hooks),
            # which the backward recomputes; False: here, and the region keeps the gathered parameters as its inputs
            self.gather_inside = reshard and traced.checkpointed(self) is not None
            if self.gather_inside:
                traced.take_locals(self.group)
            else:
                traced.register(traced.gathered_params(self.group, reshard, keep=self.post_forward_ranks))
        return args, kwargs

    def traced_post_forward(self, output: Any) -> Any:
        """While dynamo traces: point the modules back at the sharded parameters."""
        if self.group is not None:
            traced.register(traced.sharded(self.group))
            for p in self.group.params if self.gather_inside else ():
                p.traced_local = None
        dtype = self.mp_policy.output_dtype
        return output if dtype is None else traced.cast_floating(dtype, output)

    # -- forward -----------------------------------------------------------------------

    @_not_traced
    def pre_forward(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        ctx = self.lazy_init()
        with record_function("fully_shard::pre_forward"):
            args, kwargs = self._cast_inputs(args, kwargs)
            if self.training_state is TrainingState.PRE_BACKWARD:
                # activation checkpointing recomputes forward inside backward: the group is
                # (or gets) unsharded, and no forward bookkeeping or hooks apply
                if self.group is not None:
                    self.group.unshard()
                return args, kwargs
            if self.is_root:
                args, kwargs = self._root_pre_forward(ctx, args, kwargs)
            self.move_to(TrainingState.FORWARD)
            if self.group is not None:
                # gather this group, then issue the next one's all-gather: it overlaps with this
                # group's compute, and at most two groups' buffers are alive
                self.group.unshard()
                self._prefetch(self._forward_prefetch_targets(ctx))
            ctx.forward_order.append(self)
            if torch.is_grad_enabled() and self.group is not None:
                self.group.owe_post_backward()
                args, kwargs = self._hook_inputs(ctx, args, kwargs)
        return args, kwargs

    @_not_traced
    def post_forward(self, output: Any) -> Any:
        ctx = self.lazy_init()  # made by pre_forward
        with record_function("fully_shard::post_forward"):
            if self.training_state is TrainingState.PRE_BACKWARD:  # recomputation, see pre_forward
                return self._cast_output(output)
            if self.group is not None and self.reshard_after_forward:
                self.group.reshard(keep=self.post_forward_ranks)
            self.move_to(TrainingState.IDLE)
            if torch.is_grad_enabled():
                self._post_forward_index = len(ctx.post_forward_order)
                ctx.post_forward_order.append(self)
                _on_grad(output, functools.partial(self.pre_backward, ctx))
            if self.is_root:
                output = self._root_post_forward(ctx, output)
        return self._cast_output(output)

    def _cast_output(self, output: Any) -> Any:
        dtype = self.mp_policy.output_dtype
        return output if dtype is None else _map_tensors(_floating_cast(dtype), output)

    def _root_pre_forward(self, ctx: RootContext, args: Any, kwargs: Any) -> tuple[Any, Any]:
        self._check_registered_params(ctx)
        ctx.streams.wait_for_optimizer(ctx.post_optim_event)
        ctx.post_optim_event = None
        if ctx.foreign_ignored and ctx.forward_order:  # the second forward: every root sharing the set is sharded
            from .tools.checks import warn_foreign_ignored

            warn_foreign_ignored(self, ctx.states, ctx.foreign_ignored)
            ctx.foreign_ignored = []
        if ctx.forward_order:
            ctx.prev_forward_order = ctx.forward_order
        ctx.forward_order = []
        if not any(s.group is not None and s.group.grad_state is not GradState.NONE for s in ctx.states):
            ctx.post_forward_order = []  # no backward is owed: any older order is stale
        if self.device.type != "cpu":
            args, kwargs = _map_tensors(lambda t: t.to(self.device, non_blocking=True), (args, kwargs))
        return args, kwargs

    def _check_registered_params(self, ctx: RootContext) -> None:
        """Refuse a parameter replaced after fully_shard (e.g. weights tied afterwards), since fully_shard reduces the
        one it registered."""
        for state in ctx.states:
            for p in state.group.params if state.group is not None else ():
                for module, name in p.uses:
                    now = module._parameters.get(name)
                    # a module in 2 calls
                    if now is not p.sharded_param and all(now is not q.unsharded_param for q in p.tie.params):
                        from .tools.checks import raise_replaced

                        raise_replaced(self, p.fqn, module, name, now)

    def _root_post_forward(self, ctx: RootContext, output: Any) -> Any:
        """Close the passes still open (a member the model's forward skipped: they end with the root's, innermost
        first, so their backward starts with the root output's gradient), then reshard groups gathered for a module
        that did not run (prefetched, or unshard())."""
        for state in reversed(ctx.states):
            if state is not self and state.to_run and state.training_state is TrainingState.FORWARD:
                output = state.post_forward(output)
        ran = {id(s) for s in ctx.forward_order}
        flagged: dict[int, list[tuple[FSDPState, ParamGroup, Seen]]] = {}  # by mesh
        for state in ctx.states:
            if gathered := (group := state.group) is not None and group.is_unsharded and id(state) not in ran:
                group.reshard()
            if (group is not None and (o := group.options).reduce_scatter_unused_params and o.requires_gradient_sync
                    and torch.is_grad_enabled()):
                case = Seen.RAN if id(state) in ran else Seen.SKIPPED if gathered else Seen.UNTOUCHED
                flagged.setdefault(id(group.mesh_info), []).append((state, group, case))
        for pairs in flagged.values():
            self._agree_on_skipped(pairs)
        return output

    def _agree_on_skipped(self, pairs: list[tuple[FSDPState, ParamGroup, Seen]]) -> None:
        """For reduce_scatter_unused_params. A group gathered but skipped on some ranks would reduce zeros there at
        the end of backward, and elsewhere when its backward ends, so the reduce-scatters would pair up wrongly. One
        small all-reduce per mesh finds such groups (and those run nowhere that hold gradients accumulated with sync
        off), and every rank reduces them at the end.

        Note [same collectives everywhere]: whether a group reduces, and when, must be decided alike on every rank, so
        the decision reads only the all-reduced table."""
        holds = [any(p.accumulated_grad is not None for p in g.params) for _, g, _ in pairs]
        rows = [[c is case or (c is Seen.HELD and h) for c in Seen] for (_, _, case), h in zip(pairs, holds)]
        seen = torch.tensor(rows, dtype=torch.float, device=self.device)  # a row per group, columns Seen
        # shard_placement_fn's too
        infos = {id(i): i for _, g, _ in pairs for i in (g.mesh_info, *(p.mesh_info for p in g.params))}
        for ranks in (r for i in infos.values() for r in (i.shard, i.replicate) if r is not None and r.size > 1):
            all_reduce(seen, ranks.group, torch.distributed.ReduceOp.MAX, "exchange of the modules skipped per rank")
        for (state, group, _), row in zip(pairs, seen.tolist()):
            untouched, skipped, ran, held = (bool(row[c]) for c in Seen)  # on some rank
            if (untouched and (skipped or ran)) or (skipped and ran and state.reshard_after_forward
                                                    and group.options.unshard_in_backward):
                how = ("was not all-gathered on the others" if untouched
                       else "resharded after it: its backward all-gathers there only")
                raise RuntimeError(f"fully_shard: {state._name()} ran forward on some ranks only and {how}. A module "
                                   "that may skip forward on a rank (mixture-of-experts routing) must be gathered on "
                                   "every rank: list it in set_modules_to_forward_prefetch of a module that runs "
                                   "everywhere (or call its unshard()), and give it reshard_after_forward=False.")
            at_end = (skipped or untouched) and (ran or held)  # run nowhere, none held: no gradient
            if at_end != (group.grad_state is GradState.AT_END):  # this forward's agreement differs from the last one's
                group.move_grads(GradState.AT_END if at_end else GradState.DUE)

    def _forward_prefetch_targets(self, ctx: RootContext) -> list[FSDPState]:
        if self.forward_prefetch is not None:
            return self.forward_prefetch
        order, position = ctx.prev_forward_order, len(ctx.forward_order)
        # the state that ran right after this one last iteration, if the order so far repeats
        if position + 1 < len(order) and order[position] is self:
            return [order[position + 1]]
        return []

    def _prefetch(self, targets: list[FSDPState]) -> None:
        for target in targets:
            if target.group is not None and not target.group.is_unsharded:
                with record_function("fully_shard::prefetch"):
                    target.group.unshard(async_op=True)

    # -- backward ----------------------------------------------------------------------

    def pre_backward(self, ctx: RootContext) -> None:
        if self.training_state is TrainingState.PRE_BACKWARD:
            return
        if torch.is_grad_enabled():  # only a backward with create_graph=True records a graph
            raise RuntimeError(f"fully_shard: a backward with create_graph=True reached {self._name()} (double "
                               "backward, e.g. a gradient penalty via torch.autograd.grad(..., create_graph=True)). "
                               "fully_shard frees the full parameters after each group's backward, and the "
                               "second-order graph would read them later: it is not supported. Compute the "
                               "higher-order term outside the sharded modules, or without create_graph.")
        with record_function("fully_shard::pre_backward"):
            ctx.queue_finalize()
            self.move_to(TrainingState.PRE_BACKWARD)
            if self.group is not None:
                # a backward reached this group: it owes a post-backward, even when several
                # forwards ran before their backwards (pipelining: F0 F1 B0 B1)
                self.group.owe_post_backward()
                if self.group.options.unshard_in_backward:
                    self.group.unshard()
                    self._prefetch(self._backward_prefetch_targets(ctx))

    def _backward_prefetch_targets(self, ctx: RootContext) -> list[FSDPState]:
        if self.backward_prefetch is not None:
            return self.backward_prefetch
        i = self._post_forward_index
        if 0 < i < len(ctx.post_forward_order) and ctx.post_forward_order[i] is self:
            target = ctx.post_forward_order[i - 1]
            if target.group is not None and target.group.grad_state is not GradState.NONE:
                return [target]
        return []

    def post_backward(self, ctx: RootContext) -> None:
        with record_function("fully_shard::post_backward"):
            ctx.queue_finalize()
            group = self.group
            if group is not None:
                if group.options.reshard_after_backward:
                    group.reshard()  # first: the full parameters are freed before the reduce-scatter buffers exist
                # Note [same collectives everywhere]: reduce-scatters go out in autograd's order, the same everywhere;
                # a group skipped on some rank waits for the end of backward, which reduces it on every rank in order
                with torch.no_grad():
                    pending = None if group.grad_state is GradState.AT_END else group.reduce_grads()
                if pending is not None:
                    ctx.finish_reduce(keep=ctx.max_in_flight - 1)  # the oldest, issued groups ago
                    ctx.pending.append(pending)
            self.move_to(TrainingState.POST_BACKWARD)

    def reset_iter_state(self) -> None:
        """Drop everything an aborted forward or backward left behind."""
        if self.ctx is None:
            return  # no forward has run: nothing to reset
        if not self.is_root:
            raise RuntimeError("reset_iter_state() must be called on the root module (the one fully_shard was applied "
                               "to last, whose forward ran first)")
        self.ctx.reset()

    # -- tensor hooks ----------------------------------------------------------------------

    def _hook_inputs(self, ctx: RootContext, args: Any, kwargs: Any) -> tuple[Any, Any]:
        plain = not kwargs and all(isinstance(a, torch.Tensor) for a in args)  # the usual case: no pytree
        leaves, spec = (list(args), None) if plain else tree_flatten((args, kwargs))
        positions = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not positions:
            return args, kwargs
        hooked = _PostBackward.apply(self, ctx, *(leaves[i] for i in positions))  # type: ignore[no-untyped-call]
        for i, t in zip(positions, hooked):
            leaves[i] = t
        if spec is None:
            return tuple(leaves), kwargs
        result: tuple[Any, Any] = tree_unflatten(leaves, spec)
        return result

    def _regather(self, ctx: RootContext) -> None:
        ctx.queue_finalize()
        if self.group is not None:
            self.group.unshard()


def _on_grad(output: Any, fn: Callable[[], None]) -> None:
    """Call ``fn`` whenever a gradient reaches a tensor of ``output`` that requires grad."""

    def hook(t: torch.Tensor) -> torch.Tensor:
        if t.requires_grad:
            t.register_hook(lambda grad: fn())
        return t

    _map_tensors(hook, output)


def _register_state_dict_hooks(group: ParamGroup) -> None:
    """``state_dict()`` and ``load_state_dict()`` hooks on every module that registers one of the group's parameters.
    Saving always saves the shards. Loading reshards first, cuts a full tensor to this rank's shard, and adopts a
    DTensor an ``assign=True`` load registered."""
    by_module: dict[nn.Module, dict[str, ShardedParam]] = {}
    for sp in group.params:
        for m, name in sp.uses:
            by_module.setdefault(m, {})[name] = sp

    def save_hook(unsharded: bool) -> Callable[..., None]:
        def hook(*args: Any) -> None:  # pre-hook: register the shards, post-hook: back again
            if group.is_unsharded:
                for sp in group.params:
                    sp.register(unsharded=unsharded)

        return hook

    for module, params in by_module.items():

        def load_pre_hook(m: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any,
                          params: dict[str, ShardedParam] = params) -> None:
            if group.state is not GroupState.SHARDED:
                group.reshard()
            for name, sp in params.items():
                value = state_dict.get(prefix + name)
                if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
                    state_dict[prefix + name] = sp.full_to_sharded(value, prefix + name)

        def load_post_hook(m: nn.Module, incompatible: Any, params: dict[str, ShardedParam] = params) -> None:
            for name, sp in params.items():
                current = m._parameters.get(name)
                if current is not None and current is not sp.sharded_param and isinstance(current, DTensor):
                    sp.adopt(current)

        module.register_state_dict_pre_hook(save_hook(unsharded=False))
        module.register_state_dict_post_hook(save_hook(unsharded=True))
        module.register_load_state_dict_pre_hook(load_pre_hook)
        module.register_load_state_dict_post_hook(load_post_hook)


def _map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    """Apply ``fn`` to every tensor in nested tuples, lists, dicts (``ModelOutput`` too), namedtuples and dataclasses,
    rebuilding containers only where a tensor changed."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: f for f in dataclasses.fields(obj)}
        changes = {k: new for k in fields if (new := _map_tensors(fn, getattr(obj, k))) is not getattr(obj, k)}
        if changes and all(fields[k].init for k in changes):
            return dataclasses.replace(obj, **changes)
        for name, value in changes.items():  # fields outside __init__: set in place
            object.__setattr__(obj, name, value)
        return obj
    if isinstance(obj, dict):
        mapped = {k: _map_tensors(fn, v) for k, v in obj.items()}
        if all(mapped[k] is v for k, v in obj.items()):
            return obj
        try:
            return type(obj)(mapped)
        except TypeError:  # a dict subclass that cannot be rebuilt: update in place
            obj.update(mapped)
            return obj
    if isinstance(obj, (list, tuple)):
        items = [_map_tensors(fn, v) for v in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*items)
        return type(obj)(items)
    return obj


def _floating_cast(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t.to(dtype) if t.is_floating_point() else t


def state_of(module: nn.Module) -> FSDPState:
    state: FSDPState | None = getattr(module, STATE_ATTR, None)
    if state is None:
        raise RuntimeError(f"{type(module).__name__} is not managed by fully_shard")
    return state

