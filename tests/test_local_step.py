"""fully_shard.optim.local_step: the optimizer step on the DTensors' local tensors.

Oracle: the same optimizer, unwrapped, stepping on the DTensor parameters (what every
optimizer does today), on an identical model fed the same batches, so both see bitwise the
same gradients (same kernels, same inputs, deterministic on one thread). The local step is
compared with ``torch.equal``: for a DTensor laid out ``Shard``/``Replicate`` DTensor's
dispatch runs each elementwise op as the same aten kernel on the local tensors the wrapper
hands the optimizer directly, with the same scalars, so every element goes through the same
arithmetic in both runs.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import parallelize_module

import fully_shard as fs
from fully_shard import fully_shard
from fully_shard.optim import ELEMENTWISE_OPTIMIZERS, local_step
from tests.harness import device, device_type, run_distributed

STEPS = 3

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, foreach=True),
    "adamw_for_loop": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, foreach=False, fused=False),
    "adamw_amsgrad": lambda ps: torch.optim.AdamW(ps, lr=0.01, amsgrad=True),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05, initial_accumulator_value=0.1),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5, centered=True),
}


class Net(nn.Module):
    """Uneven rows (5 and 3 at 2 or 4 ranks: some ranks hold fewer rows, or none) and a plain
    parameter left out of sharding (``ignored_params``)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 6)) for _ in range(2))
        self.head = nn.Linear(6, 3)
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x) * self.scale


def _net(hsdp: bool = False, shard: Callable[..., Any] = fully_shard) -> Net:
    """``shard``: fully_shard, or torch FSDP2's ``fully_shard`` (the checkpoint oracle)."""
    torch.manual_seed(0)
    model = Net().to(device())
    ws = dist.get_world_size()
    mesh = (init_device_mesh(device_type(), (2, ws // 2), mesh_dim_names=("replicate", "shard")) if hsdp
            else init_device_mesh(device_type(), (ws,)))
    for block in model.blocks:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh, ignored_params={model.scale})
    return model


def _groups(model: Net) -> list[dict[str, Any]]:
    # the plain parameter in a group of its own: the DTensor step's foreach ops refuse lists
    # that mix DTensors and plain tensors ("got mixed torch.Tensor and DTensor"); the local
    # step would not mind
    return [{"params": [p for n, p in model.named_parameters() if n != "scale"]}, {"params": [model.scale]}]


def _batch(step: int, same_on_ranks: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + (0 if same_on_ranks else dist.get_rank()))
    return torch.randn(4, 6, generator=gen, device="cpu").to(device())


def _train(
    model: Net, opt: torch.optim.Optimizer, sched: Any, steps: range, same_on_ranks: bool = False,
    step_fn: Callable[[], Any] | None = None, torch_clip: bool = False,
) -> None:
    """``step_fn``: what steps the optimizer (a compiled step), ``opt.step`` by default.
    ``torch_clip``: torch.nn.utils.clip_grad_norm_ over the sharded parameters (a list that
    mixes DTensors and plain tensors fails in its foreach norm), else fully_shard's over all."""
    for step in steps:
        model(_batch(step, same_on_ranks)).square().mean().backward()
        if torch_clip:
            torch.nn.utils.clip_grad_norm_(_groups(model)[0]["params"], max_norm=0.5)  # norms 1.1-1.9: it clips
        else:
            fs.clip_grad_norm_(model.parameters(), max_norm=0.5)  # the norms here are 1.1-2.3: it clips
        (step_fn or opt.step)()
        sched.step()
        opt.zero_grad()


def _local(t: Any) -> Any:
    return t._local_tensor if isinstance(t, DTensor) else t


def _mismatches(a: Net, opt_a: torch.optim.Optimizer, b: Net, opt_b: torch.optim.Optimizer, what: str) -> list[str]:
    """Parameters and every state entry: bitwise equal, same types and layouts."""
    out = []
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        if type(pa) is not type(pb) or not isinstance(pb, nn.Parameter):
            out.append(f"{what} {name}: {type(pa).__name__} vs {type(pb).__name__}")
        if not torch.equal(_local(pa.detach()), _local(pb.detach())):
            out.append(f"{what} {name}: weights differ")
        sa, sb = opt_a.state.get(pa, {}), opt_b.state.get(pb, {})
        if list(sa) != list(sb):
            out.append(f"{what} {name}: state keys {list(sa)} vs {list(sb)}")
        for k in sa:
            va, vb = sa[k], sb[k]
            if type(va) is not type(vb):
                out.append(f"{what} {name}.{k}: {type(va).__name__} vs {type(vb).__name__}")
            elif isinstance(va, DTensor) and (va._spec != vb._spec or vb.requires_grad):
                out.append(f"{what} {name}.{k}: {va._spec} vs {vb._spec}")
            elif isinstance(va, torch.Tensor) and not torch.equal(_local(va), _local(vb)):
                out.append(f"{what} {name}.{k}: differs")
    index_a = {id(p): i for i, p in enumerate(a.parameters())}
    index_b = {id(p): i for i, p in enumerate(b.parameters())}
    if [index_a.get(id(k)) for k in opt_a.state] != [index_b.get(id(k)) for k in opt_b.state]:
        out.append(f"{what}: the state's keys are not the same parameters in the same order")
    return out


def _schedule(opt: torch.optim.Optimizer, cosine: bool) -> Any:
    if cosine:
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS, eta_min=1e-3)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))


def _parity(hsdp: bool, names: list[str], torch_clip: bool = False) -> list[str]:
    """``torch_clip``: torch.nn.utils.clip_grad_norm_ and CosineAnnealingLR in place of
    fully_shard.clip_grad_norm_ and LambdaLR."""
    errors = []
    for name in names:
        plain, fast = _net(hsdp), _net(hsdp)
        opt_plain = OPTIMIZERS[name](_groups(plain))
        opt_fast = local_step(OPTIMIZERS[name](_groups(fast)))
        sched_plain, sched_fast = _schedule(opt_plain, torch_clip), _schedule(opt_fast, torch_clip)
        params = [p for g in opt_fast.param_groups for p in g["params"]]
        _train(plain, opt_plain, sched_plain, range(STEPS), torch_clip=torch_clip)
        _train(fast, opt_fast, sched_fast, range(STEPS), torch_clip=torch_clip)
        if sched_fast.get_last_lr() == sched_fast.base_lrs:
            errors.append(f"{name}: the schedule did not change the learning rate")
        errors += _mismatches(plain, opt_plain, fast, opt_fast, name)
        stepped = [id(p) for g in opt_fast.param_groups for p in g["params"]]
        if {id(p) for p in fast.parameters()} != {id(p) for p in params} or stepped != [id(p) for p in params]:
            errors.append(f"{name}: the parameters or the optimizer's param_groups changed")
        if not all(isinstance(p, DTensor) for n, p in fast.named_parameters() if n != "scale"):
            errors.append(f"{name}: a sharded parameter is no longer a DTensor")
        if any(p._local_tensor.grad is not None for p in params if isinstance(p, DTensor)):
            errors.append(f"{name}: a local tensor kept its .grad")
    return errors


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_bitwise_equal_to_dtensor_step(name: str) -> None:
    # with an LR scheduler, fully_shard.clip_grad_norm_ and a plain (ignored) parameter
    for rank, errors in enumerate(run_distributed(_parity, 2, False, [name])):
        assert not errors, f"rank {rank}:\n" + "\n".join(errors)


@pytest.mark.parametrize("name", ["adamw_foreach", "sgd_momentum"])
def test_bitwise_with_torch_clip_grad_norm_and_cosine_schedule(name: str) -> None:
    # torch.nn.utils.clip_grad_norm_ on the DTensor gradients before the local step
    for rank, errors in enumerate(run_distributed(_parity, 2, False, [name], torch_clip=True)):
        assert not errors, f"rank {rank}:\n" + "\n".join(errors)


def test_bitwise_equal_to_dtensor_step_hsdp() -> None:
    # (2, 2) mesh: parameters Replicate() x Shard(0)
    for rank, errors in enumerate(run_distributed(_parity, 4, True, ["adamw_foreach", "sgd_momentum"])):
        assert not errors, f"rank {rank}:\n" + "\n".join(errors)


def _checkpoint(path: str) -> list[str]:
    """Save the local-step optimizer with DCP after 2 steps; it equals bitwise the state
    saved by the plain path and by torch FSDP2 with the same optimizer (at 2 ranks torch
    FSDP2 trains bitwise like fully_shard: tests/oracle.py); loaded into a plain-DTensor
    optimizer and into a local-step one, over fully_shard's parameters and over torch
    FSDP2's, step 3 equals the uninterrupted plain run. The same batches on every rank: the
    plain (ignored) parameter's gradient is not averaged over ranks, and DCP saves rank 0's copy."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    errors = []
    plain, fast, theirs = _net(), _net(), _net(shard=torch_fully_shard)
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=0.01)
    opt_fast = local_step(torch.optim.AdamW(fast.parameters(), lr=0.01))
    opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=0.01)
    sched_plain = torch.optim.lr_scheduler.LambdaLR(opt_plain, lambda s: 1 / (1 + s))
    sched_fast = torch.optim.lr_scheduler.LambdaLR(opt_fast, lambda s: 1 / (1 + s))
    sched_theirs = torch.optim.lr_scheduler.LambdaLR(opt_theirs, lambda s: 1 / (1 + s))
    _train(plain, opt_plain, sched_plain, range(2), same_on_ranks=True)
    _train(fast, opt_fast, sched_fast, range(2), same_on_ranks=True)
    _train(theirs, opt_theirs, sched_theirs, range(2), same_on_ranks=True)
    sd_fast = get_optimizer_state_dict(fast, opt_fast)
    for who, model, opt in (("plain", plain, opt_plain), ("torch FSDP2", theirs, opt_theirs)):
        sd = get_optimizer_state_dict(model, opt)
        if sd["param_groups"] != sd_fast["param_groups"] or list(sd["state"]) != list(sd_fast["state"]):
            errors.append(f"get_optimizer_state_dict vs {who}: param_groups or keys differ")
        for fqn, sa in sd["state"].items():
            for k, va in sa.items():
                vb = sd_fast["state"][fqn][k]
                if type(va) is not type(vb) or (isinstance(va, DTensor) and va._spec != vb._spec):
                    errors.append(f"saved {fqn}.{k} vs {who}: {type(va).__name__} vs {type(vb).__name__}")
                elif not torch.equal(_local(va), _local(vb)):
                    errors.append(f"saved {fqn}.{k} vs {who}: differs")
                elif fqn != "scale" and k != "step" and not isinstance(vb, DTensor):
                    errors.append(f"saved {fqn}.{k}: not a DTensor")
    dcp.save({"optim": sd_fast}, checkpoint_id=path)
    _train(plain, opt_plain, sched_plain, range(2, 3), same_on_ranks=True)
    for shard in (fully_shard, torch_fully_shard):
        for wrap in (False, True):
            model = _net(shard=shard)
            opt = torch.optim.AdamW(model.parameters(), lr=0.01)
            if wrap:
                opt = local_step(opt)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
            template = get_optimizer_state_dict(model, opt)  # steps once with lr 0 to create the state
            dcp.load({"optim": template}, checkpoint_id=path)
            set_optimizer_state_dict(model, opt, template)
            model.load_state_dict(fast.state_dict())
            sched.load_state_dict(sched_fast.state_dict())
            _train(model, opt, sched, range(2, 3), same_on_ranks=True)
            who = "torch FSDP2" if shard is torch_fully_shard else "fully_shard"
            errors += _mismatches(plain, opt_plain, model, opt, f"resumed ({who}, {'local_step' if wrap else 'plain'})")
    return errors


def test_checkpoint_round_trip_interchangeable(tmp_path: Any) -> None:
    for rank, errors in enumerate(run_distributed(_checkpoint, 2, str(tmp_path / "ckpt"))):
        assert not errors, f"rank {rank}:\n" + "\n".join(errors)


def _tensor_parallel(names: list[str]) -> list[str]:
    """FSDP x TP on a (dp=2, tp=2) mesh (tests/test_tp.py's plan: Colwise/Rowwise on "tp",
    fully_shard on "dp"): parameters on the 2-D mesh, (_StridedShard(0), Shard(0)) or
    (Shard(0), Shard(1)), and on "dp" alone (norms, embeddings); for each, DTensor's
    dispatch runs an elementwise op as the same kernel on the local tensors the local step
    updates. With fully_shard.clip_grad_norm_ (norms over both meshes)."""
    from tests.models import Transformer, batch, loss_fn
    from tests.test_tp import TP_PLAN

    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("dp", "tp"))
    errors = []
    for name in names:
        models = []
        for _ in range(2):
            torch.manual_seed(0)
            model = Transformer().to(device())
            for block in model.layers:
                parallelize_module(block, mesh["tp"], TP_PLAN)
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
            models.append(model)
        plain, fast = models
        opt_plain, opt_fast = OPTIMIZERS[name](plain.parameters()), local_step(OPTIMIZERS[name](fast.parameters()))
        if not any(isinstance(p, DTensor) and p.device_mesh.ndim == 2 for p in fast.parameters()):
            errors.append("no parameter on the 2-D mesh")
        for step in range(STEPS):
            for model, opt in ((plain, opt_plain), (fast, opt_fast)):
                x = batch(step, mesh["dp"].get_local_rank())
                loss_fn(model(x), x).backward()
                fs.clip_grad_norm_(model.parameters(), max_norm=0.5)
                opt.step()
                opt.zero_grad()
        errors += _mismatches(plain, opt_plain, fast, opt_fast, f"tp {name}")  # type: ignore[arg-type]
    return errors


def test_bitwise_with_tensor_parallel() -> None:
    for rank, errors in enumerate(run_distributed(_tensor_parallel, 4, ["adamw_foreach", "adagrad"])):
        assert not errors, f"rank {rank}:\n" + "\n".join(errors)


# torch.compile'd steps. Compiled, AdamW computes its step size and bias corrections in
# float32 tensors (the step count is a tensor inside the graph) where eager uses Python
# floats: a few ulps per step apart from the uncompiled step (measured 2.2e-7 to 4.5e-7
# after 3 steps, weights ~0.5), whichever the backend and with or without local_step.
COMPILED_VS_EAGER = dict(rtol=1e-5, atol=1e-5)
COMPILE_STEPS = 4


def _compiled(backend: str) -> list[str]:
    """AdamW (a tensor lr, as torch's compiled-optimizer recipe does, so LambdaLR changes no
    guarded float) stepped by: the eager step on the DTensors; ``torch.compile(opt.step)``
    on the DTensors; the same after local_step; torch's recipe (a compiled function calling
    ``opt.step()``) after local_step; local_step over an already compiled ``opt.step``.
    The compiled local steps equal the compiled DTensor step bitwise for ``aot_eager`` (its
    graph of aten ops runs eagerly: on the local tensors either way, the same kernels,
    shapes and scalars); for ``inductor`` the two graphs (one desugared from DTensor) may be
    fused differently: COMPILED_VS_EAGER. Each within COMPILED_VS_EAGER of the eager step;
    the same graphs as the compiled DTensor step (on torch 2.13 1 graph, 242 ops; the step's Python
    around it, as for any torch optimizer, runs eagerly), none compiled after step 2."""
    from torch._dynamo.testing import CompileCounterWithBackend

    errors = []
    runs: dict[str, tuple[Net, torch.optim.Optimizer]] = {}
    graphs: dict[str, tuple[int, int]] = {}  # (graphs, ops) compiled in the first 2 steps
    for how in ("eager", "compiled", "local_compiled", "local_recipe", "compiled_then_local"):
        torch._dynamo.reset()
        counter = CompileCounterWithBackend(backend)  # counts the graphs, compiles with `backend`
        model = _net()
        opt = torch.optim.AdamW(_groups(model), lr=torch.tensor(0.01), weight_decay=0.1)
        step_fn: Callable[[], Any] = opt.step
        if how == "compiled_then_local":
            opt.step = torch.compile(opt.step, backend=counter)  # type: ignore[method-assign]
        if how.startswith("local") or how == "compiled_then_local":
            step_fn = local_step(opt).step
        if how in ("compiled", "local_compiled"):
            step_fn = torch.compile(opt.step, backend=counter)
        elif how == "local_recipe":
            @torch.compile(backend=counter)
            def step_fn(opt: torch.optim.Optimizer = opt) -> None:
                opt.step()
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
        _train(model, opt, sched, range(2), step_fn=step_fn)
        graphs[how] = (counter.frame_count, counter.op_count)
        with torch._dynamo.config.patch(error_on_recompile=True):
            _train(model, opt, sched, range(2, COMPILE_STEPS), step_fn=step_fn)
        if graphs[how] != (counter.frame_count, counter.op_count):
            errors.append(f"{how}: compiled again after step 2")
        # the local steps compile the same graph as the DTensor step, nothing of local_step's
        # own (traced, its swaps would add graphs and recompile once per new state tensor)
        if how != "eager" and graphs[how] != graphs["compiled"]:
            errors.append(f"{how}: (graphs, ops) {graphs[how]}, the compiled DTensor step {graphs['compiled']}")
        runs[how] = (model, opt)
    eager = runs.pop("eager")
    compiled = runs.pop("compiled")
    for how, (model, opt) in runs.items():
        if backend == "aot_eager":
            errors += _mismatches(compiled[0], compiled[1], model, opt, how)
        for (name, a), b in zip(eager[0].named_parameters(), model.parameters()):
            for what, x, y in [("weight", a, b), *((k, v, opt.state[b][k]) for k, v in eager[1].state[a].items())]:
                if type(x) is not type(y) or not torch.allclose(_local(x.detach()), _local(y.detach()),
                                                                **COMPILED_VS_EAGER):
                    errors.append(f"{how} vs eager {name} {what}: {type(x).__name__} vs {type(y).__name__} or not "
                                  "close")
    torch._dynamo.reset()  # leave no compiled code (and the tensors its guards hold) in the reused workers
    return errors


@pytest.mark.long
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_step(backend: str) -> None:
    for rank, errors in enumerate(run_distributed(_compiled, 2, backend)):
        assert not errors, f"rank {rank}:\n" + "\n".join(errors)


class FullTensorSGD(torch.optim.Optimizer):
    """Does its own thing: scales the step by the full parameter's norm (DTensor parameters
    only: it calls full_tensor())."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    full = p.full_tensor()
                    p.add_(p.grad, alpha=-group["lr"] / (1 + float(full.norm())))


def _refusals() -> list[str]:
    errors = []
    model = _net()
    with pytest.raises(ValueError, match="local_step does not know FullTensorSGD to be elementwise"):
        local_step(FullTensorSGD(model.parameters()))
    with pytest.raises(ValueError, match="local_step does not know Muon to be elementwise"):
        local_step(torch.optim.Muon([model.blocks[0][0].weight]))
    with pytest.raises(TypeError, match="local_step expects a torch.optim.Optimizer, got list"):
        local_step([])  # type: ignore[type-var]
    # elementwise=True on an optimizer that is not: its full_tensor() on a local tensor is
    # turned into a clear error, and the optimizer is put back as it was (parameters, grads, state)
    opt = local_step(FullTensorSGD(model.blocks.parameters()), elementwise=True)
    model(_batch(0)).sum().backward()
    params = list(opt.param_groups[0]["params"])
    before = [p.detach().clone() for p in params]
    with pytest.raises(TypeError, match="local_step: FullTensorSGD.step uses 'full_tensor', which only DTensors have"):
        opt.step()
    if ([id(p) for p in opt.param_groups[0]["params"]] != [id(p) for p in params]
            or not all(p.grad is not None for p in params)):
        errors.append("after a failed step: param_groups or grads not restored")
    if not all(isinstance(p, DTensor) for p in params) or opt.state:
        errors.append("after a failed step: a parameter is not a DTensor")
    if not all(torch.equal(_local(p.detach()), _local(b)) for p, b in zip(params, before)):
        errors.append("the failed step changed a weight")
    # a gradient laid out unlike its parameter
    fast = local_step(torch.optim.AdamW(model.parameters()))
    w = model.blocks[0][0].weight
    w.grad = DTensor.from_local(torch.zeros(w.shape), w.device_mesh, [Replicate()], run_check=False)
    where = r"param_groups\[0\]\['params'\]\[1\] \(shape \(5, 6\), placements \(Shard\(dim=0\),\)\)"
    with pytest.raises(RuntimeError,
                       match=rf"local_step: the gradient of {where} is \(Replicate\(\),\), laid out unlike"):
        fast.step()
    if fast.state or fast.param_groups[0]["params"][1] is not w or w._local_tensor.grad is not None:
        errors.append("after the refused step: the optimizer is not as before")
    return errors


def test_refuses_what_cannot_run_locally() -> None:
    for rank, errors in enumerate(run_distributed(_refusals, 2)):
        assert not errors, f"rank {rank}:\n" + "\n".join(errors)


def _composition() -> list[str]:
    """A scheduler created before local_step, a closure, wrapping twice."""
    errors = []
    plain, fast = _net(), _net()
    opt_plain = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    opt_fast = torch.optim.SGD(fast.parameters(), lr=0.1, momentum=0.9)
    sched_plain = torch.optim.lr_scheduler.StepLR(opt_plain, 1, gamma=0.5)
    sched_fast = torch.optim.lr_scheduler.StepLR(opt_fast, 1, gamma=0.5)
    opt_fast = local_step(local_step(opt_fast))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "optimizer.step() has been overridden" warning
        for step in range(STEPS):
            losses = []
            for model, opt, sched in ((plain, opt_plain, sched_plain), (fast, opt_fast, sched_fast)):
                def closure(model: Net = model, opt: torch.optim.Optimizer = opt, step: int = step) -> torch.Tensor:
                    opt.zero_grad()
                    loss = model(_batch(step)).square().mean()
                    loss.backward()
                    return loss
                losses.append(opt.step(closure))
                sched.step()
            if not torch.equal(losses[0], losses[1]):
                errors.append(f"step {step}: the closure's loss differs")
    return errors + _mismatches(plain, opt_plain, fast, opt_fast, "closure")


def test_scheduler_before_wrap_closure_and_double_wrap() -> None:
    for rank, errors in enumerate(run_distributed(_composition, 2)):
        assert not errors, f"rank {rank}:\n" + "\n".join(errors)


def test_allow_list_is_exact_types() -> None:
    assert torch.optim.AdamW in ELEMENTWISE_OPTIMIZERS and torch.optim.Adafactor not in ELEMENTWISE_OPTIMIZERS

    class MyAdamW(torch.optim.AdamW):
        pass

    with pytest.raises(ValueError, match="local_step does not know .*MyAdamW to be elementwise"):
        local_step(MyAdamW([nn.Parameter(torch.ones(2))]))
    opt = local_step(MyAdamW([nn.Parameter(torch.ones(2))]), elementwise=True)
    assert opt.step._fully_shard_local_step is True  # type: ignore[attr-defined]


def test_a_deep_copy_is_not_wrapped() -> None:
    # Optimizer.__getstate__ keeps defaults, state and param_groups only: the copy steps
    # unwrapped, on its own parameters, until wrapped again
    p = nn.Parameter(torch.ones(2))
    opt = local_step(torch.optim.SGD([p], lr=1.0))
    copy_ = copy.deepcopy(opt)
    assert "step" in vars(opt) and "step" not in vars(copy_)
    q = copy_.param_groups[0]["params"][0]
    assert q is not p
    q.grad = torch.ones(2)
    local_step(copy_).step()
    assert torch.equal(q.detach(), torch.zeros(2)) and torch.equal(p.detach(), torch.ones(2))
