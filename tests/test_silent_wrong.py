"""Nothing trains silently wrong (issue 16): unusual but legal backward patterns give the
unsharded model's gradients, and the misuses that used to train wrong raise.

Oracle: the same model unsharded on every rank, driven by the same calls on the same
per-rank data, its gradients summed over the step's backward calls and then all-reduced
with AVG. ``fully_shard`` instead averages each backward call's gradients as it goes, so
the two sum in a different order: gradients and parameters are compared with
``assert_close(rtol=1e-5, atol=1e-6)`` (fp32; measured differences are at most a few ulp).

The property test draws random mixes of the supported calls (several backward passes over
one forward, chunked losses, a second forward before the first backward, accumulation
with ``set_requires_gradient_sync(False)``, explicit ``unshard``/``reshard``, prefetch and
reshard settings, frozen parameters) from a seed; ``FULLY_SHARD_PROPERTY_DRAWS=N`` runs
more draws by hand (past a few hundred, lift the suite's per-test limit: ``--timeout 0``).
"""

from __future__ import annotations

import copy
import os
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.harness import device, run_distributed
from tests.models import ModelArgs, Transformer, batch, loss_fn
from tests.oracle import average_gradients, rows
from tests.torch_features import has_torch_feature

ARGS = ModelArgs(vocab_size=37, dim=24, n_layers=3, n_heads=4, ffn_dim=40, max_seq_len=8)
RTOL, ATOL = 1e-5, 1e-6  # fp32, different summation order (see the module docstring)


class CutTransformer(Transformer):
    """``Transformer`` that can cut the graph after a block (``cut``: backward reaches only
    the blocks after it) and keeps the hidden state after block 0 (``mid``)."""

    def __init__(self) -> None:
        super().__init__(ARGS)
        self.cut: int | None = None
        self.mid: torch.Tensor | None = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) + self.pos[: tokens.shape[1]]  # (B, T, C)
        for i, layer in enumerate(self.layers):
            h = layer(h)
            if i == 0:
                self.mid = h
            if i == self.cut:
                h = h.detach()
        return self.output(self.norm(h)) * self.logit_scale  # (B, T, V)


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    rank = dist.get_rank()
    return batch(2 * step, rank, ARGS, 4).to(device()), batch(2 * step + 1, rank, ARGS, 4).to(device())


# ---------------------------------------------------------------------------
# Backward patterns: each runs the same calls on our model and on the oracle
# ---------------------------------------------------------------------------


def _two_backward(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    logits = m(x)
    l1 = loss_fn(logits, x)
    l2 = logits.pow(2).mean()
    l1.backward(retain_graph=True)
    l2.backward()


def _chunked(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    logits = m(x)
    for lg, t in zip(logits.chunk(2), x.chunk(2)):  # one backward per chunk of the batch
        loss_fn(lg, t).backward(retain_graph=True)


def _second_forward_first(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    l1 = loss_fn(m(x), x)
    l2 = loss_fn(m(y), y)
    l1.backward()
    l2.backward()


def _second_forward_summed(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    (loss_fn(m(x), x) + loss_fn(m(y), y)).backward()


def _partial_graph(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    m.cut = 1  # backward reaches only block 2 and the root's norm/output/logit_scale
    try:
        loss_fn(m(x), x).backward()
    finally:
        m.cut = None
    loss_fn(m(y), y).backward()  # then a full one in the same step


def _autograd_grad(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = loss_fn(m(x), x)
    (g,) = torch.autograd.grad(loss, m.mid, retain_graph=True)  # no parameter gradients
    loss.backward()
    return g


def _gradient_penalty(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    loss = loss_fn(m(x), x)
    (g,) = torch.autograd.grad(loss, m.mid, create_graph=True)
    (loss + g.pow(2).sum()).backward()


PATTERNS: dict[str, Callable[..., Any]] = {
    "two_backward": _two_backward,
    "chunked": _chunked,
    "second_forward_first": _second_forward_first,
    "second_forward_summed": _second_forward_summed,
    "partial_graph": _partial_graph,
    "autograd_grad": _autograd_grad,
}


# ---------------------------------------------------------------------------
# Comparing with the oracle
# ---------------------------------------------------------------------------


def _build(frozen: tuple[str, ...] = ()) -> tuple[CutTransformer, CutTransformer]:
    torch.manual_seed(0)
    ref = CutTransformer().to(device())  # the suite's device switch (FULLY_SHARD_TEST_DEVICE)
    for name, p in ref.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    return ref, copy.deepcopy(ref)


def _shard(model: CutTransformer, reshard: list[bool | None] | None = None) -> CutTransformer:
    from fully_shard import fully_shard

    for i, block in enumerate(model.layers):
        fully_shard(block, reshard_after_forward=True if reshard is None else reshard[i])
    fully_shard(model, reshard_after_forward=None if reshard is None else reshard[-1])
    return model


def _mismatches(ours: nn.Module, ref: nn.Module, what: str) -> list[str]:
    """Every parameter and gradient of ``ours`` (this rank's shard) against the oracle's
    rows: no communication, and every rank checks its own rows."""
    out = []
    for (name, p), p_ref in zip(ours.named_parameters(), ref.parameters()):
        for kind, a, b in (("param", p, p_ref), ("grad", p.grad, p_ref.grad)):
            if (a is None) != (b is None):
                out.append(f"{what}: {kind} of {name}: ours {'None' if a is None else 'set'}, oracle "
                           f"{'None' if b is None else 'set'}")
                continue
            if a is None:
                continue
            try:
                torch.testing.assert_close(a.to_local(), rows(b), rtol=RTOL, atol=ATOL)
            except AssertionError as exc:
                out.append(f"{what}: {kind} of {name}: {str(exc).splitlines()[-2:]}")
    return out


def _run_pattern(name: str, steps: int = 2) -> list[str]:
    ref, ours = _build()
    _shard(ours)
    opt = torch.optim.SGD(ours.parameters(), lr=0.5)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    errors = []
    for step in range(steps):
        x, y = _data(step)
        out, out_ref = PATTERNS[name](ours, x, y), PATTERNS[name](ref, x, y)
        if out is not None:
            try:
                torch.testing.assert_close(out, out_ref, rtol=RTOL, atol=ATOL)
            except AssertionError as exc:
                errors.append(f"step {step}: the pattern's result differs: {exc}")
        average_gradients(ref)
        errors += _mismatches(ours, ref, f"step {step} after backward")
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
    errors += _mismatches(ours, ref, "after training")
    return errors


@pytest.mark.parametrize("name", list(PATTERNS))
def test_backward_pattern_matches_unsharded(name: str) -> None:
    results = run_distributed(_run_pattern, 2, name)
    for rank, errors in enumerate(results):
        assert not errors, f"rank {rank}:\n" + "\n".join(errors)


# ---------------------------------------------------------------------------
# Property test: random mixes of the supported calls against the oracle
# ---------------------------------------------------------------------------

FREEZABLE = ("tok_embeddings.weight", "layers.0.attention.wq.weight", "layers.2.feed_forward.w2.weight", "norm.weight",
             "logit_scale")
CI_DRAWS = 200  # FULLY_SHARD_PROPERTY_DRAWS=N runs N instead
REGRESSION_SEEDS: list[int] = []  # seeds that once failed: always run


def _draw(seed: int) -> list[str]:
    """One random program, run on our model and on the oracle; its mismatches."""
    from fully_shard import FSDPModule

    rng = random.Random(seed)  # the same draws on every rank
    frozen = tuple(n for n in FREEZABLE if rng.random() < 0.2)
    reshard = [rng.choice([True, False]) for _ in range(3)] + [rng.choice([None, True, False])]
    ref, ours = _build(frozen)
    _shard(ours, reshard)
    layers = ours.layers
    prefetch = rng.choice(["implicit", "explicit", "off"])
    for i, block in enumerate(layers):
        if prefetch == "explicit":
            block.set_modules_to_forward_prefetch(list(layers[i + 1 : i + 2]))
            block.set_modules_to_backward_prefetch(list(layers[i - 1 : i]) if i else [])
        elif prefetch == "off":
            block.set_modules_to_forward_prefetch([])
            block.set_modules_to_backward_prefetch([])
    fsdp_modules = [m for m in ours.modules() if isinstance(m, FSDPModule)]
    opt = torch.optim.SGD([p for p in ours.parameters() if p.requires_grad], lr=0.5)
    opt_ref = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.5)
    program = [f"frozen={frozen} reshard={reshard} prefetch={prefetch}"]
    errors: list[str] = []
    for step in range(2):
        micro = rng.choice([1, 2])
        for j in range(micro):
            last = j == micro - 1
            sync = last or rng.random() < 0.5
            keep = not last and rng.random() < 0.3  # reshard_after_backward=False between microbatches
            name = rng.choice(list(PATTERNS))
            unshard = rng.choice([None, None, *range(len(fsdp_modules))])
            program.append(f"step {step}.{j}: {name} sync={sync} keep_unsharded={keep} unshard={unshard}")
            ours.set_requires_gradient_sync(sync)
            ours.set_reshard_after_backward(not keep)
            if unshard is not None:
                handle = fsdp_modules[unshard].unshard(async_op=rng.random() < 0.5)
                if handle is not None:
                    handle.wait()
            x, y = _data(2 * step + j)
            out, out_ref = PATTERNS[name](ours, x, y), PATTERNS[name](ref, x, y)
            if out is not None:
                torch.testing.assert_close(out, out_ref, rtol=RTOL, atol=ATOL)
        for m in fsdp_modules:
            m.reshard()  # kept unsharded by reshard_after_backward=False: back to the shards
        average_gradients(ref)
        errors += _mismatches(ours, ref, f"step {step}")
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
        if errors:
            break
    errors += _mismatches(ours, ref, "after training")
    return [f"seed {seed}: {e}\n  program: {program}" for e in errors]


def _draws(seeds: list[int]) -> list[str]:
    errors: list[str] = []
    for seed in seeds:
        errors += _draw(seed)
    return errors


@pytest.mark.long
def test_property_random_call_mixes_match_unsharded() -> None:
    n = int(os.environ.get("FULLY_SHARD_PROPERTY_DRAWS", CI_DRAWS))
    results = run_distributed(_draws, 2, REGRESSION_SEEDS + list(range(n)), timeout=max(300.0, 3.0 * n))
    for rank, errors in enumerate(results):
        assert not errors, f"rank {rank}: {len(errors)} mismatches, first:\n" + "\n".join(errors[:5])


# ---------------------------------------------------------------------------
# Misuses that used to train silently wrong (or crash) now raise, naming the culprit
# ---------------------------------------------------------------------------


def _catching(case: Callable[..., Any], *args: Any) -> tuple[str, str] | None:
    try:
        case(*args)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return type(exc).__name__, str(exc)
    return None


def _expect_error(case: Callable[..., Any], exc_type: type[BaseException], *fragments: str,
                  world_size: int = 2) -> None:
    for rank, res in enumerate(run_distributed(_catching, world_size, case)):
        assert res is not None, f"rank {rank}: {case.__name__} raised nothing; expected {exc_type.__name__}"
        name, msg = res
        assert name == exc_type.__name__, f"rank {rank}: expected {exc_type.__name__}, got {name}: {msg}"
        for fragment in fragments:
            assert fragment in msg, f"rank {rank}: {fragment!r} not in the message: {msg}"


def _case_gradient_penalty() -> None:
    ref, ours = _build()
    _shard(ours)
    x, y = _data(0)
    _gradient_penalty(ours, x, y)


def _case_forgotten_root() -> None:
    from fully_shard import fully_shard

    _, model = _build()
    for block in model.layers:
        fully_shard(block)
    x, _ = _data(0)
    model(x)


def _case_forgotten_root_ignored_remedy() -> None:
    """The remedy the message names: the model's own parameters in the root call's
    ignored_params (here: all of them) make the model a root, and nothing raises."""
    from fully_shard import fully_shard

    _, model = _build()
    for block in model.layers:
        fully_shard(block)
    own = {p for name, p in model.named_parameters() if not name.startswith("layers.")}
    fully_shard(model, ignored_params=own)
    x, _ = _data(0)
    loss_fn(model(x), x).backward()


def _case_tied_after_sharding() -> None:
    _, model = _build()
    _shard(model)
    x, _ = _data(0)
    loss_fn(model(x), x).backward()
    model.output.weight = model.tok_embeddings.weight  # shapes differ: only identity matters here
    model(x)


def _case_block_param_replaced() -> None:
    _, model = _build()
    _shard(model)
    model.layers[1].feed_forward.w2.weight = nn.Parameter(torch.zeros(3))
    x, _ = _data(0)
    model(x)


def _case_autograd_grad_wrt_parameters() -> None:
    _, model = _build()
    _shard(model)
    x, _ = _data(0)
    torch.autograd.grad(loss_fn(model(x), x), list(model.parameters()))


def _autograd_grad_wrt_parameters_then_remedy() -> list[str]:
    """The remedy docs/troubleshooting.md names after the failed call: reset_iter_state, then
    loss.backward() and the sharded p.grad, equal to the unsharded model's."""
    ref, ours = _build()
    _shard(ours)
    x, _ = _data(0)
    try:
        torch.autograd.grad(loss_fn(ours(x), x), list(ours.parameters()))
    except RuntimeError:
        pass
    else:
        return ["torch.autograd.grad w.r.t. the sharded parameters raised nothing"]
    ours.reset_iter_state()
    loss_fn(ours(x), x).backward()
    loss_fn(ref(x), x).backward()
    average_gradients(ref)
    return _mismatches(ours, ref, "after the remedy")


def test_double_backward_raises_instead_of_crashing() -> None:
    # it used to read freed parameter storage: SIGSEGV
    _expect_error(_case_gradient_penalty, RuntimeError, "create_graph=True", "the root module (CutTransformer)")


def test_forgotten_root_fully_shard_raises_naming_parameters() -> None:
    _expect_error(
        _case_forgotten_root, RuntimeError, "'layers.0'", "'tok_embeddings.weight'", "'output.weight'",
        "'logit_scale'", "fully_shard(model)",
    )


def test_forgotten_root_remedy_ignored_params() -> None:
    assert run_distributed(_catching, 2, _case_forgotten_root_ignored_remedy) == [None, None]


def test_parameter_tied_after_sharding_raises_naming_both() -> None:
    _expect_error(_case_tied_after_sharding, RuntimeError, "'output.weight'", "'tok_embeddings.weight'",
                  "before calling fully_shard")


def test_parameter_replaced_after_sharding_raises_naming_it() -> None:
    _expect_error(_case_block_param_replaced, RuntimeError, "'layers.1.feed_forward.w2.weight'",
                  "not a parameter of the model")


def test_autograd_grad_wrt_sharded_parameters_raises() -> None:
    # torch's own error (docs/troubleshooting.md): a block's registered parameters are the
    # sharded DTensors after its forward, which computed with the gathered ones. Index 2 is
    # layers.0.attention_norm.weight, the first of them; 0 and 1 (logit_scale,
    # tok_embeddings.weight) are the root's, still the gathered ones after the root's forward.
    named = has_torch_feature("autograd.grad naming the unused input")  # torch 2.11's message names no index
    _expect_error(
        _case_autograd_grad_wrt_parameters, RuntimeError,
        "The differentiated Tensor at index 2 appears to not have been used in the graph" if named
        else "One of the differentiated Tensors appears to not have been used in the graph",
    )


def test_autograd_grad_wrt_sharded_parameters_remedy() -> None:
    for rank, errors in enumerate(run_distributed(_autograd_grad_wrt_parameters_then_remedy, 2)):
        assert not errors, f"rank {rank}:\n" + "\n".join(errors)


@pytest.mark.parametrize(
    "kwargs, exc_type, fragment",
    [
        ({"param_dtype": "bfloat16"}, TypeError,
         "param_dtype must be a torch.dtype or None, got str 'bfloat16'; pass e.g. torch.bfloat16 (torch.bfloat16)"),
        ({"reduce_dtype": torch.int32}, ValueError, "reduce_dtype must be a floating-point dtype, got torch.int32"),
        ({"output_dtype": 16}, TypeError, "output_dtype must be a torch.dtype or None, got int 16"),
        ({"cast_forward_inputs": "no"}, TypeError, "cast_forward_inputs must be a bool, got str 'no'"),
    ],
)
def test_mixed_precision_policy_fields_validated(kwargs: dict[str, Any], exc_type: type[Exception],
                                                 fragment: str) -> None:
    from fully_shard import MixedPrecisionPolicy

    with pytest.raises(exc_type) as info:
        MixedPrecisionPolicy(**kwargs)
    assert fragment in str(info.value)


def test_cpu_offload_policy_pin_memory_validated() -> None:
    from fully_shard import CPUOffloadPolicy

    with pytest.raises(TypeError, match="CPUOffloadPolicy: pin_memory must be a bool, got int 1"):
        CPUOffloadPolicy(pin_memory=1)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# Collective failures: FULLY_SHARD_DEBUG=1 and the hint that names it
# ---------------------------------------------------------------------------


def test_env_var_switches_on_debug_mode() -> None:
    import subprocess
    import sys

    code = "from fully_shard.tools import is_debug; print(is_debug())"
    env = {**os.environ, "FULLY_SHARD_DEBUG": "1"}
    on = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    env.pop("FULLY_SHARD_DEBUG")
    off = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert (on.stdout.strip(), off.stdout.strip()) == ("True", "False")


class _FailedWork:
    def wait(self) -> None:
        raise RuntimeError("Connection closed by peer")


def test_failed_collective_prints_the_debug_hint_once(capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from fully_shard import comm

    monkeypatch.setattr(comm.monitor, "hint_printed", False)
    monkeypatch.setattr(comm.monitor, "checks", [])
    for _ in range(2):
        with pytest.raises(comm.CollectiveError, match="rerun with FULLY_SHARD_DEBUG=1") as info:
            comm._wait(_FailedWork(), "all-gather of layers.1's parameters")  # type: ignore[arg-type]
        assert "all-gather of layers.1's parameters did not complete" in str(info.value)
    assert capsys.readouterr().err.count("FULLY_SHARD_DEBUG=1") == 1


# ---------------------------------------------------------------------------
# docs/troubleshooting.md lists every error the library raises
# ---------------------------------------------------------------------------


def test_troubleshooting_lists_every_error() -> None:
    """Each ``raise X("...")`` under fully_shard/ has one of its literal fragments (its
    first three words, a leading ``name:`` dropped) in docs/troubleshooting.md."""
    import ast
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1]
    doc = " ".join((root / "docs" / "troubleshooting.md").read_text().split())
    missing = []
    for path in sorted((root / "fully_shard").rglob("*.py")):
        tree = ast.parse(path.read_text())
        # a message built by a helper of the same file (raise E(_message(...)), raise _error(...)): its strings
        helpers = {f.name: f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name.startswith("_")}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args):
                continue
            arg = node.exc.args[0]
            helper = next((c.func.id for c in (node.exc, arg)
                           if isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id in helpers), None)
            if helper is not None:
                parts = [s for n in ast.walk(helpers[helper]) if isinstance(n, ast.JoinedStr) for s in n.values]
            else:
                parts = [arg] if isinstance(arg, ast.Constant) else getattr(arg, "values", [])
            frags = [re.sub(r"^\w+: ", "", p.value.strip()) for p in parts if isinstance(p, ast.Constant)
                     and isinstance(p.value, str)]
            keys = [" ".join(f.split()[:3]).rstrip(":,.") for f in frags if f]
            if not any(k and k in doc for k in keys):
                missing.append(f"{path.relative_to(root)}:{node.lineno} {keys[:2]}")
    assert not missing, "errors missing from docs/troubleshooting.md:\n" + "\n".join(missing)
