"""The core's state machines and its typed options, in process (the setters on a fake process group).

Every state machine moves through ``group.transition`` against its table: ``GroupState`` (where a group's parameters
are), ``GradState`` (what a group owes the backward), ``TrainingState`` (a state's phase) and ``Callback`` (the root's
end-of-backward callback). Each table is checked pair by pair against the transitions written out here, so loosening
or tightening one fails a test; the owners' methods are checked where they add behaviour (leaving FORWARD closes a
multi-module pass, the end of backward returns any phase to IDLE). The setters are checked to change exactly the
``GroupOptions`` fields they name, on the groups they say.
"""

from __future__ import annotations

import dataclasses
import itertools
from enum import Enum
from typing import Any

import pytest

from tests.unit.fake_pg import fake_world

# each table, written out: "FROM -> TO" for every allowed move, all others refused
_ALLOWED = {
    "GroupState": {"SHARDED -> UNSHARDING", "SHARDED -> SHARDED", "POST_FORWARD -> UNSHARDING",
                   "POST_FORWARD -> SHARDED",
                   "UNSHARDING -> UNSHARDED", "UNSHARDED -> SHARDED", "UNSHARDED -> POST_FORWARD"},
    "GradState": {"NONE -> DUE", "NONE -> AT_END", "NONE -> NONE", "DUE -> NONE", "DUE -> AT_END", "AT_END -> DUE"},
    "TrainingState": {"IDLE -> FORWARD", "IDLE -> IDLE", "IDLE -> PRE_BACKWARD", "IDLE -> POST_BACKWARD",
                      "FORWARD -> IDLE", "FORWARD -> FORWARD", "FORWARD -> PRE_BACKWARD", "FORWARD -> POST_BACKWARD",
                      "PRE_BACKWARD -> POST_BACKWARD",
                      "POST_BACKWARD -> PRE_BACKWARD", "POST_BACKWARD -> POST_BACKWARD", "POST_BACKWARD -> FORWARD"},
    "Callback": {"IDLE -> QUEUED", "QUEUED -> IDLE"},
}


def _tables() -> dict[str, dict[Any, Any]]:
    from fully_shard import group, state

    return {"GroupState": group._TRANSITIONS, "GradState": group._GRAD_TRANSITIONS,
            "TrainingState": state._TRANSITIONS, "Callback": state._CALLBACK_TRANSITIONS}


@pytest.mark.parametrize("name", sorted(_ALLOWED))
def test_each_allowed_transition_moves_and_each_other_raises(name: str) -> None:
    from fully_shard.group import transition

    table = _tables()[name]
    members: list[Enum] = list(type(next(iter(table))))
    assert set(table) == set(members), f"{name}: the table has no row for some member"
    for current, new in itertools.product(members, members):
        if f"{current.name} -> {new.name}" in _ALLOWED[name]:
            assert transition("it", table, current, new) is new
        else:
            with pytest.raises(AssertionError,
                               match=f"fully_shard internal error: it cannot go from {current.name} to {new.name}$"):
                transition("it", table, current, new)


def test_group_owes_one_post_backward() -> None:
    import torch

    from fully_shard.group import GradState, ParamGroup

    group = ParamGroup([], None, torch.device("cpu"), "blk")  # type: ignore[arg-type]  # no parameters: no mesh read
    group.owe_post_backward()
    group.owe_post_backward()  # a second forward before the backward owes nothing more
    assert group.grad_state is GradState.DUE
    group.move_grads(GradState.AT_END)
    group.owe_post_backward()  # a backward reaching it keeps it for the end
    assert group.grad_state is GradState.AT_END
    with pytest.raises(AssertionError, match="group blk's gradients cannot go from AT_END to NONE"):
        group.reduce_grads()  # only the end of backward, having made it DUE, may reduce it
    group.move_grads(GradState.DUE)
    assert group.reduce_grads() is None and group.grad_state is GradState.NONE
    group.move_grads(GradState.DUE)
    group.reset()
    assert group.grad_state is GradState.NONE


def _state(n_modules: int = 1) -> Any:
    import torch
    import torch.nn as nn

    from fully_shard.policy import MixedPrecisionPolicy
    from fully_shard.state import FSDPState

    modules = tuple(nn.Linear(2, 2) for _ in range(n_modules))
    return FSDPState(modules, None, torch.device("cpu"), None, {}, MixedPrecisionPolicy(), set())


def test_leaving_forward_closes_the_pass_and_the_end_returns_any_phase_to_idle() -> None:
    from fully_shard.state import TrainingState

    state = _state(2)
    state.to_run = set(state.modules)
    state.move_to(TrainingState.FORWARD)
    assert state.to_run == set(state.modules)  # the pass stays open while FORWARD
    state.move_to(TrainingState.FORWARD)  # nested
    assert state.to_run == set(state.modules)
    state.move_to(TrainingState.PRE_BACKWARD)  # a chunked loss: a backward reaches the open pass
    assert state.to_run == set()
    with pytest.raises(AssertionError, match=r"Linear, Linear cannot go from PRE_BACKWARD to IDLE"):
        state.move_to(TrainingState.IDLE)
    for phase in TrainingState:
        state.training_state = phase
        state.move_to(TrainingState.IDLE, end=True)
        assert state.training_state is TrainingState.IDLE


def test_the_end_of_backward_needs_a_queued_callback() -> None:
    import torch

    from fully_shard.state import Callback, RootContext
    from fully_shard.streams import Streams

    ctx = RootContext([], Streams(torch.device("cpu")))
    with pytest.raises(AssertionError, match="the root's callback cannot go from IDLE to IDLE"):
        ctx.finalize_backward()  # run without being queued
    ctx.callback = Callback.QUEUED
    ctx.finalize_backward()
    assert ctx.callback is Callback.IDLE


def test_agreement_columns_are_named() -> None:
    from fully_shard.state import Seen

    # the one-hot cases first, then the flag: _agree_on_skipped unpacks a row in this order
    assert [(c.name, int(c)) for c in Seen] == [("UNTOUCHED", 0), ("SKIPPED", 1), ("RAN", 2), ("HELD", 3)]


def test_options_are_frozen() -> None:
    from fully_shard.group import GroupOptions

    with pytest.raises(dataclasses.FrozenInstanceError):
        GroupOptions().requires_gradient_sync = False  # type: ignore[misc]


# -- each setter changes the fields it names, on the groups it says --------------------------------------------------


class _Comm:
    def allocate(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


def _hook(t: Any) -> None:
    pass


_SETTERS: list[tuple[str, tuple[Any, ...], dict[str, Any], dict[str, Any], bool]] = [
    # (method, args, kwargs, the fields it sets and their new values (None: any other than before), recursive)
    ("set_requires_gradient_sync", (False,), {}, {"requires_gradient_sync": False}, True),
    ("set_requires_gradient_sync", (False,), {"recurse": False}, {"requires_gradient_sync": False}, False),
    ("set_requires_all_reduce", (False,), {}, {"requires_all_reduce": False}, True),
    ("set_reshard_after_backward", (False,), {}, {"reshard_after_backward": False}, True),
    ("set_reduce_scatter_unused_params", (True,), {}, {"reduce_scatter_unused_params": True}, True),
    ("set_reduce_scatter_max_input_buffers", (3,), {}, {"max_input_buffers": 3}, True),
    ("set_reduce_scatter_max_input_buffers", (3,), {"recurse": False}, {"max_input_buffers": 3}, False),
    ("set_separate_reduce_scatter_group", (), {}, {"reduce_scatter_groups": None}, True),
    ("set_gradient_divide_factor", (4,), {}, {"gradient_divide_factor": 4.0}, False),
    ("set_reduce_scatter_divide_factor", (4,), {}, {"gradient_divide_factor": 4.0}, False),
    ("set_unshard_in_backward", (False,), {}, {"unshard_in_backward": False}, False),
    ("set_force_sum_reduction_for_comms", (True,), {}, {"force_sum_reduction": True}, False),
    ("set_custom_all_gather", (_Comm(),), {}, {"all_gather_comm": None}, False),
    ("set_custom_reduce_scatter", (_Comm(),), {}, {"reduce_scatter_comm": None}, False),
    ("set_all_reduce_hook", (_hook,), {}, {"all_reduce_hook": _hook}, False),
    ("set_allocate_memory_from_process_group_for_comm", (True,), {},
     {"all_gather_comm": None, "reduce_scatter_comm": None}, False),
]


@pytest.mark.parametrize("method, args, kwargs, fields, recursive", _SETTERS)
def test_each_setter_changes_exactly_its_fields(method: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                                                fields: dict[str, Any], recursive: bool) -> None:
    import warnings

    import torch.nn as nn

    from fully_shard import fully_shard

    with fake_world((2,)) as mesh:
        model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        groups = {"root": fully_shard.state(model).group, "inner": fully_shard.state(model[0]).group}  # type: ignore[attr-defined]
        before = {k: g.options for k, g in groups.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # set_reduce_scatter_divide_factor's deprecation
            getattr(model, method)(*args, **kwargs)
        changed = {k: sorted(f.name for f in dataclasses.fields(g.options)
                             if getattr(g.options, f.name) != getattr(before[k], f.name)) for k, g in groups.items()}
        assert changed == {"root": sorted(fields), "inner": sorted(fields) if recursive else []}, changed
        for name, value in fields.items():
            if value is not None:
                assert getattr(groups["root"].options, name) == value, (name, getattr(groups["root"].options, name))
