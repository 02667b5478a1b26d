"""torch 2.13's buffer and stream controls, doing what torch's do.

- ``set_allocate_memory_from_process_group_for_comm``: buffers from the process group's
  allocator (gloo has none, so a patched gloo backend that claims one proves the path is taken),
  training bitwise equal to torch's FSDP2 with the same setting and to ours without it;
- ``set_symm_mem_for_comm``: refused at the call where the process group cannot (gloo, CPU), decided
  by the group's backend for the module's device (gloo carrying accelerator tensors is refused too);
  which buffers it would take where it can (the NCCL path itself needs GPUs: untested here);
- ``set_all_reduce_hook(hook, stream=s)``: the hook runs on ``s``, after the reduction, and
  the consumer waits for ``s`` (a recording stream double, as in test_streams.py);
- ``set_reduce_scatter_max_input_buffers(k)``: reduce-scatter inputs alive after each
  post-backward, counted, equal to torch's retained inputs for k = 1, 2, 3.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.distributed_c10d import ProcessGroupGloo

import fully_shard.comm as comm
from fully_shard import fully_shard
from fully_shard import streams as fs_streams
from tests.harness import device_type, on_accelerator, run_distributed
from tests.models import ModelArgs, Transformer, batch, loss_fn
from tests.test_streams import _recording
from tests.torch_features import skip_without_torch_feature

ARGS = ModelArgs(n_layers=2, dim=32, ffn_dim=48, vocab_size=37)


def _shard(shard: Callable[..., Any], model: nn.Module) -> list[nn.Module]:
    """Blocks, then the root; returns every sharded module."""
    mesh = init_device_mesh(device_type(), (dist.get_world_size(),))
    for block in model.layers:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)
    return [*model.layers, model]


def _train(model: nn.Module, steps: int = 2) -> tuple[list[float], list[torch.Tensor]]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        tokens = batch(step, dist.get_rank(), ARGS)
        loss = loss_fn(model(tokens), tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.full_tensor() for p in model.parameters()]


# ---------------------------------------------------------------------------
# set_allocate_memory_from_process_group_for_comm
# ---------------------------------------------------------------------------


def _allocate_from_process_group() -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    calls: list[int] = []  # the sizes the process group allocated
    original = (ProcessGroupGloo.supports_tensor_alloc, ProcessGroupGloo.allocate_tensor)

    def allocate_tensor(self: Any, size: int, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        calls.append(size)
        return torch.full((size,), float("nan"), dtype=dtype, device=device)  # garbage, as fresh memory may be

    base = Transformer(ARGS)
    runs: dict[str, Any] = {}
    try:
        for name, shard, enable in (("ours", fully_shard, True), ("torch", torch_fully_shard, True),
                                    ("ours_off", fully_shard, False)):
            ProcessGroupGloo.supports_tensor_alloc = lambda self, device: True  # type: ignore[method-assign]
            ProcessGroupGloo.allocate_tensor = allocate_tensor  # type: ignore[method-assign]
            model = copy.deepcopy(base)
            for m in _shard(shard, model):  # per module, as in torch
                m.set_allocate_memory_from_process_group_for_comm(enable)
            calls.clear()
            losses, params = _train(model)
            runs[name] = {"losses": losses, "params": params, "calls": len(calls)}
        # False goes back to the default buffers
        for m in _shard(fully_shard, model := copy.deepcopy(base)):
            m.set_allocate_memory_from_process_group_for_comm(True)
            m.set_allocate_memory_from_process_group_for_comm(False)
        calls.clear()
        _train(model, steps=1)
        runs["after_false"] = len(calls)
        # the real gloo backend has no allocator of its own: torch.empty, same results
        ProcessGroupGloo.supports_tensor_alloc, ProcessGroupGloo.allocate_tensor = original  # type: ignore[method-assign]
        for m in _shard(fully_shard, model := copy.deepcopy(base)):
            m.set_allocate_memory_from_process_group_for_comm(True)
        runs["plain_gloo"] = _train(model)
    finally:
        ProcessGroupGloo.supports_tensor_alloc, ProcessGroupGloo.allocate_tensor = original  # type: ignore[method-assign]
    return runs


@pytest.mark.skipif(on_accelerator(), reason="patches the gloo backend's allocator on CPU tensors")
def test_allocate_memory_from_process_group_matches_torch() -> None:
    for runs in run_distributed(_allocate_from_process_group, 2):
        ours, theirs, off = runs["ours"], runs["torch"], runs["ours_off"]
        # per step: 2 blocks x (forward + backward all-gather) + 1 root all-gather = 5 outputs,
        # 3 reduce-scatters x (input + output) = 6: the process group allocated every buffer
        assert ours["calls"] == 2 * (5 + 6), ours["calls"]
        assert theirs["calls"] == ours["calls"], (theirs["calls"], ours["calls"])
        assert off["calls"] == 0 and runs["after_false"] == 0, (off["calls"], runs["after_false"])
        # bitwise: the same buffers' contents, the same collectives, on 2 ranks (an average of two is exact)
        for other in (theirs, off, dict(zip(("losses", "params"), runs["plain_gloo"]))):
            assert ours["losses"] == other["losses"], (ours["losses"], other["losses"])
            for p, q in zip(ours["params"], other["params"]):
                torch.testing.assert_close(p, q, rtol=0, atol=0)


def _custom_comm_then_allocate() -> str:
    from tests.test_drop_in import CountingAllGather

    model = fully_shard(nn.Linear(4, 4))
    model.set_custom_all_gather(CountingAllGather())
    try:
        model.set_allocate_memory_from_process_group_for_comm(True)
    except AssertionError as e:  # torch raises AssertionError; ours is also a ValueError
        assert isinstance(e, ValueError), type(e)
        return str(e)
    return "no error"


def test_allocate_memory_refuses_a_custom_comm() -> None:
    message = run_distributed(_custom_comm_then_allocate, 1)[0]
    assert "FSDPLinear.set_allocate_memory_from_process_group_for_comm" in message, message
    assert "Comm CountingAllGather (set_custom_*" in message, message


# ---------------------------------------------------------------------------
# set_symm_mem_for_comm
# ---------------------------------------------------------------------------


def _symm_mem_on_gloo() -> str:
    model = fully_shard(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    try:
        model.set_symm_mem_for_comm()
    except NotImplementedError as e:  # a RuntimeError, as torch's own failure on a CPU build
        return str(e)
    return "no error"


def test_symm_mem_refused_at_the_call_on_gloo() -> None:
    message = run_distributed(_symm_mem_on_gloo, 2)[0]
    assert message.startswith("FSDPLinear.set_symm_mem_for_comm('NCCL'): symmetric memory needs a NCCL process "
                              "group"), message
    assert "this module has no accelerator on cpu" in message and "not the results" in message, message


def _as_an_accelerator_with_backend(name: str | None) -> dict[str, Any]:
    """fully_shard, then set_symm_mem_for_comm, on a device taken for an accelerator (patched), the group's backend for
    it named ``name`` (None: the group's own, gloo): the warnings fully_shard gave, and the call's error or "no
    error"."""
    import warnings

    import fully_shard.api as api
    import fully_shard.tools.pools as pools

    backend_type = type(dist.group.WORLD._get_backend(torch.device("cpu")))
    saved = (api.has_streams, pools.has_streams, comm.symm_mem.set_backend, backend_type.name)
    api.has_streams = pools.has_streams = lambda device: True  # type: ignore[assignment]
    comm.symm_mem.set_backend = lambda name: None  # type: ignore[assignment]
    if name is not None:
        backend_type.name = lambda self: name  # type: ignore[method-assign]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = fully_shard(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
        out = {"warned": [str(w.message) for w in caught if "fully_shard:" in str(w.message)], "symm": "no error"}
        try:
            model.set_symm_mem_for_comm()
        except NotImplementedError as e:
            out["symm"] = str(e)
        return out
    finally:
        api.has_streams, pools.has_streams, comm.symm_mem.set_backend, backend_type.name = saved  # type: ignore[assignment, method-assign]


def test_gloo_carrying_accelerator_tensors_is_named_at_the_call() -> None:
    """Decided by the group's backend for the module's device: gloo carrying an accelerator's tensors gets a warning
    at fully_shard (DTensor's all-gather would kill it: pytorch/pytorch#152645) and set_symm_mem_for_comm refused,
    naming gloo; a group whose backend for the device is NCCL neither (the first GPU run's world of one was NCCL, and
    rightly accepted where the test expected gloo's refusal)."""
    gloo = run_distributed(_as_an_accelerator_with_backend, 1, None)[0]
    assert ("symmetric memory needs a NCCL process group on an accelerator, but this module has gloo on cpu"
            in gloo["symm"]), gloo
    (warning,) = gloo["warned"]
    assert ("carries cpu tensors over gloo" in warning and "SIGSEGV" in warning
            and "pytorch/pytorch#152645" in warning), warning
    assert "one rank per device" in warning, warning
    assert run_distributed(_as_an_accelerator_with_backend, 1, "nccl")[0] == {"warned": [], "symm": "no error"}
    mpi = run_distributed(_as_an_accelerator_with_backend, 1, "mpi")[0]
    assert mpi["warned"] == [] and "this module has mpi on cpu" in mpi["symm"], mpi


def _symm_mem_without_the_pool() -> str:
    """set_symm_mem_for_comm where the group qualifies but torch lacks symmetric memory's pool (patched away)."""
    import fully_shard.api as api
    import fully_shard.tools.pools as pools

    saved = (api.has_streams, pools.has_streams, comm.symm_mem.get_mem_pool)
    api.has_streams = pools.has_streams = lambda device: True  # type: ignore[assignment]
    del comm.symm_mem.get_mem_pool
    try:
        model = fully_shard(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
        model.set_symm_mem_for_comm("gloo")  # type: ignore[arg-type]  # the group's own backend: past that check
        return "no error"
    except NotImplementedError as e:
        return str(e)
    finally:
        api.has_streams, pools.has_streams, comm.symm_mem.get_mem_pool = saved  # type: ignore[assignment]


def test_symm_mem_without_torchs_pool_is_refused_at_the_call() -> None:
    message = run_distributed(_symm_mem_without_the_pool, 1)[0]
    assert ("need torch.distributed._symmetric_memory.get_mem_pool, which torch" in message
            and "upgrade torch" in message), message


def _symm_mem_choices(force_sum: bool) -> dict[str, Any]:
    """Which buffers set_symm_mem_for_comm gives a module, past the capability check (patched:
    any device has streams, the group's own backend is named, ``set_backend`` records)."""
    import fully_shard.api as api
    import fully_shard.tools.pools as pools

    backends: list[str] = []
    saved = (api.has_streams, pools.has_streams, comm.symm_mem.set_backend)
    api.has_streams = pools.has_streams = lambda device: True  # type: ignore[assignment]
    comm.symm_mem.set_backend = backends.append  # type: ignore[assignment]
    try:
        model = fully_shard(nn.Linear(4, 4))
        model.set_force_sum_reduction_for_comms(force_sum)
        group = fully_shard.state(model).group  # type: ignore[attr-defined]
        name = group.mesh_info.shard.group._get_backend(group.device).name()  # gloo (NCCL on a GPU run)
        model.set_symm_mem_for_comm(name)
        try:
            model.set_reduce_scatter_max_input_buffers(2)
            refusal = "no error"
        except ValueError as e:
            refusal = str(e)
        return {
            "comms": [getattr(c, "symmetric", None) for c in (group.all_gather_comm, group.reduce_scatter_comm)],
            "backends": [b == name for b in backends],
            "refusal": refusal,
        }
    finally:
        api.has_streams, pools.has_streams, comm.symm_mem.set_backend = saved  # type: ignore[assignment]


def test_symm_mem_takes_the_all_gather_and_only_a_sum_reduce_scatter() -> None:
    plain, summed = (run_distributed(_symm_mem_choices, 1, f)[0] for f in (False, True))
    # symmetric all-gather buffers; the reduce-scatter's only when it is forced to sum
    assert plain == {"comms": [True, None], "backends": [True], "refusal": "no error"}, plain
    assert summed["comms"] == [True, True] and summed["backends"] == [True, True], summed
    assert "symmetric-memory reduce-scatter" in summed["refusal"] and "keep 1" in summed["refusal"], summed


# ---------------------------------------------------------------------------
# set_all_reduce_hook(hook, stream=...)
# ---------------------------------------------------------------------------


def _hook_stream_log() -> list[tuple[Any, ...]]:
    with _recording() as backend:
        model = Transformer(ARGS)
        _shard(fully_shard, model)
        root = fully_shard.state(model)  # type: ignore[attr-defined]
        root.shared_streams = fs_streams.Streams(root.device, backend)

        def hook(t: torch.Tensor) -> None:
            backend.log.append(("hook", backend.stack[-1]))
            t.mul_(0.5)

        for block in model.layers:
            block.set_all_reduce_hook(hook, stream="user")  # type: ignore[arg-type]  # the double's streams are names
        model.layers[0].set_all_reduce_hook(hook)  # no stream: keeps the one given before, as torch does
        tokens = batch(0, dist.get_rank(), ARGS)
        loss_fn(model(tokens), tokens).backward()
        return backend.log


def test_all_reduce_hook_runs_on_its_stream_between_reduction_and_consumer() -> None:
    log = run_distributed(_hook_stream_log, 2)[0]
    hooks = [i for i, e in enumerate(log) if e[0] == "hook"]
    assert len(hooks) == 2, log  # the two blocks; the root has no hook
    for i in hooks:
        assert log[i] == ("hook", "user"), log[i]
        # the hook's stream waits for the reduction's (the reduce-scatter stream), and the
        # reduce-scatter stream, which then divides and accumulates, waits for the hook's
        assert log[i - 1] == ("wait_stream", "user", "reduce_scatter"), log[i - 1]
        assert log[i + 1] == ("wait_stream", "reduce_scatter", "user"), log[i + 1]
        # ... after which the compute stream (the optimizer) waits for the reduce-scatter stream
        record = next(j for j in range(i, len(log)) if log[j][:2] == ("record", "reduce_scatter"))
        assert log[record + 1] == ("wait_event", "current", log[record][2]), log[record : record + 2]
        # the reduction the hook reads was issued on the reduce-scatter stream before
        assert any(e == ("reduce_scatter", "reduce_scatter") for e in log[:i]), log[:i]


# ---------------------------------------------------------------------------
# set_reduce_scatter_max_input_buffers(k)
# ---------------------------------------------------------------------------


def _inputs_in_flight(k: int, use_torch: bool) -> list[int]:
    """After each group's post-backward: how many reduce-scatter inputs are alive (ours,
    counted by weak references) or retained (torch's ``reduce_scatter_states``)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from fully_shard.state import FSDPState

    counts: list[int] = []
    inputs: list[weakref.ref[torch.Tensor]] = []
    original_rs, owner, name = comm.reduce_scatter, (FSDPParamGroup if use_torch else FSDPState), "post_backward"
    original_pb = getattr(owner, name)

    def reduce_scatter(*args: Any, **kwargs: Any) -> Any:
        work = original_rs(*args, **kwargs)
        inputs.append(weakref.ref(work.input))
        return work

    def post_backward(self: Any, *args: Any) -> Any:
        out = original_pb(self, *args)
        counts.append(len(self.comm_ctx.reduce_scatter_states) if use_torch else sum(r() is not None for r in inputs))
        return out

    comm.reduce_scatter = reduce_scatter  # type: ignore[assignment]
    setattr(owner, name, post_backward)
    try:
        model = Transformer(ModelArgs(n_layers=3, dim=32, ffn_dim=48, vocab_size=37))
        _shard(torch_fully_shard if use_torch else fully_shard, model)
        model.set_reduce_scatter_max_input_buffers(k)
        tokens = batch(0, dist.get_rank(), ARGS)
        loss_fn(model(tokens), tokens).backward()
        counts.append(-1)  # end of backward
        if not use_torch:
            counts.append(sum(r() is not None for r in inputs))
    finally:
        comm.reduce_scatter = original_rs  # type: ignore[assignment]
        setattr(owner, name, original_pb)
    return counts


@pytest.mark.parametrize("k", [1, 2, 3])
def test_max_input_buffers_keeps_k_reduce_scatter_inputs_alive(k: int) -> None:
    ours = run_distributed(_inputs_in_flight, 2, k, False)[0]
    # 3 blocks, then the root (in the end-of-backward callback): min(k, reductions so far) each
    expected = [min(k, n) for n in range(1, 5)]
    assert ours[:-1] == [*expected, -1], ours
    assert ours[-1] == 0, ours  # the end of backward finished them all
    skip_without_torch_feature("FSDPModule.set_reduce_scatter_max_input_buffers")
    theirs = run_distributed(_inputs_in_flight, 2, k, True)[0]
    assert theirs == [*expected, -1], theirs
