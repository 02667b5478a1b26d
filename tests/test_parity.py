"""Acceptance grid: fully_shard training equals (a) the unsharded model trained with
gradients all-reduced (AVG) across ranks and (b) torch's own FSDP2 applied the same way.

Every case builds one model per rank (same seed on every rank), deep-copies it twice, and
trains the three copies side by side on the same per-rank data (``tests.models.batch``,
different on every rank) with AdamW:

* ``ref``: the plain model; after backward its gradients are all-reduced with AVG;
* ``ours``: ``fully_shard`` from this package;
* ``torch``: ``torch.distributed.fsdp.fully_shard``, wrapped and driven identically.

Each step checks the loss of every microbatch; which parameters are sharded (DTensor) or
gathered right after forward, against torch FSDP2 (reshard_after_forward's effect); how
many all-gathers and reduce-scatters each model issued, against torch FSDP2; which
gradients exist (unused parameters keep ``grad is None``); and every rank's rows of every
gradient. At the end: ``p.full_tensor()`` of every parameter, and the invariants (every
parameter an ``nn.Parameter`` DTensor placed ``(Shard(0),)`` on the mesh, the same objects
the optimizer holds).

Tolerances (fp32, gloo), as reached on torch 2.13:

* world size 2: bitwise (rtol=atol=0) against both the reference and torch FSDP2, on any
  CPU: an average of two numbers does not depend on the order of the reduction, and the
  reference's AdamW steps the same dim-0 chunks the ranks hold (``tests.oracle``), so
  vectorised bodies and scalar tails fall on the same elements.
* world size 4: bitwise against torch FSDP2 (the same flat layout, the same reduce-scatter
  in the same process: the same gloo summation order by construction); 1e-5 against the
  all-reduce reference, whose sums run in another order (measured: at most 1.6e-6 after 2
  AdamW steps).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from support.collectives import CollectiveRecord, CollectiveRecorder
from tests.harness import device_type, run_distributed
from tests.models import Block, Transformer, batch, loss_fn
from tests.oracle import ShardwiseOptimizer, average_gradients, check_gradients, check_parameters, close, ref_tol

# ---------------------------------------------------------------------------
# Models (module level: the workers unpickle the test bodies by reference)
# ---------------------------------------------------------------------------


class TupleBlock(Block):
    """A block whose forward returns a tuple: (hidden, aux loss, None, a detached tensor)."""

    def forward(self, x: torch.Tensor) -> Any:  # type: ignore[override]
        h = super().forward(x)
        return h, h.pow(2).mean(), None, h.detach().sum()


class DictBlock(Block):
    """A block whose forward returns a dict with a tensor, an aux loss and a non-tensor."""

    def forward(self, x: torch.Tensor) -> Any:  # type: ignore[override]
        h = super().forward(x)
        return {"h": h, "aux": h.pow(2).mean(), "name": "block"}


class ParityTransformer(Transformer):
    """``Transformer`` that can skip blocks, return a tuple or a dict, and ``score``."""

    def __init__(self) -> None:
        super().__init__()
        self.skip_layers: tuple[int, ...] = ()
        self.out_kind = "tensor"

    def forward(self, tokens: torch.Tensor) -> Any:  # type: ignore[override]
        h = self.tok_embeddings(tokens) + self.pos[: tokens.shape[1]]
        aux = []
        for i, layer in enumerate(self.layers):
            if i in self.skip_layers:
                continue
            out = layer(h)
            if isinstance(out, tuple):
                h, a, none, detached = out
                assert none is None and not detached.requires_grad, "tuple output leaves changed"
                aux.append(a)
            elif isinstance(out, dict):
                assert out["name"] == "block", "dict output non-tensor leaf changed"
                h = out["h"]
                aux.append(out["aux"])
            else:
                h = out
        logits = self.output(self.norm(h)) * self.logit_scale
        if self.out_kind == "tuple":
            return logits, torch.stack(aux).sum(), "tag"
        if self.out_kind == "dict":
            return {"logits": logits, "aux": torch.stack(aux).sum(), "n": len(aux)}
        return logits

    def score(self, tokens: torch.Tensor) -> torch.Tensor:
        """A method other than forward that uses the root's parameters (and block 0)."""
        h = self.tok_embeddings(tokens) + self.pos[: tokens.shape[1]]
        h = self.layers[0](h)
        return self.output(self.norm(h)) * self.logit_scale


def _build(kind: str) -> ParityTransformer:
    model = ParityTransformer()
    if kind == "unused":
        # one Linear in block 1 and one root parameter that forward never uses
        model.layers[1].unused = nn.Linear(model.args.dim, 7)
        model.unused_scale = nn.Parameter(torch.ones(3))
    elif kind in ("tuple", "dict"):
        cls = TupleBlock if kind == "tuple" else DictBlock
        for block in model.layers:
            block.__class__ = cls
        model.out_kind = kind
    else:
        assert kind in ("base", "score"), f"unknown model kind {kind!r}"
    return model


def _loss(out: Any, tokens: torch.Tensor) -> torch.Tensor:
    if isinstance(out, tuple):
        assert out[2] == "tag", "root tuple output: non-tensor leaf changed"
        return loss_fn(out[0], tokens) + 0.1 * out[1]
    if isinstance(out, dict):
        assert out["n"] >= 1, "root dict output: non-tensor leaf changed"
        return loss_fn(out["logits"], tokens) + 0.1 * out["aux"]
    return loss_fn(out, tokens)


# ---------------------------------------------------------------------------
# The grid
# ---------------------------------------------------------------------------

# wrap: nested (blocks, root) | flat (root) | submodule (attention, feed_forward, block, root)
#       | list ([tok_embeddings, norm, output], blocks, root) | list_root (the list, root)
# raf: reshard_after_forward, passed to every call when present
# micro: microbatches per step, gradient sync off for all but the last
# prefetch: explicit torchtitan-style prefetch (next block in forward, previous in backward)
# skip: step -> indices of blocks the forward skips in that step (on every rank)
# unshard: manual unshard()/reshard()/unshard(async_op=True) before steps 0 and 2
# score: every other step trains through model.score (register_fsdp_forward_method)
CASES: dict[str, dict[str, Any]] = {
    "nested_raf_true": dict(wrap="nested", raf=True),
    "nested_raf_false": dict(wrap="nested", raf=False),
    "nested_raf_none": dict(wrap="nested", raf=None),
    "flat": dict(wrap="flat"),
    "flat_raf_true": dict(wrap="flat", raf=True),
    "submodule": dict(wrap="submodule"),
    "submodule_raf_false": dict(wrap="submodule", raf=False),
    "list_group": dict(wrap="list"),
    "list_group_root_only": dict(wrap="list_root"),
    "grad_accum": dict(wrap="nested", micro=3),
    "grad_accum_flat_raf_false": dict(wrap="flat", raf=False, micro=2),
    "explicit_prefetch": dict(wrap="nested", prefetch=True),
    "unused_params_skip_block": dict(model="unused", wrap="nested", skip={1: (1,), 3: (2,)}),
    "unused_params_skip_block_prefetch": dict(model="unused", wrap="nested", prefetch=True, skip={2: (1,)}),
    "unused_params_flat": dict(model="unused", wrap="flat", skip={2: (1,)}),
    "unshard_reshard": dict(wrap="nested", unshard=True),
    "unshard_reshard_flat": dict(wrap="flat", unshard=True),
    "tuple_output": dict(model="tuple", wrap="nested"),
    "dict_output": dict(model="dict", wrap="nested"),
    "forward_method": dict(model="score", wrap="nested", score=True),
}

def _shard(model: ParityTransformer, shard: Any, mesh: Any, spec: dict[str, Any]) -> None:
    kw: dict[str, Any] = {"mesh": mesh}
    if "raf" in spec:
        kw["reshard_after_forward"] = spec["raf"]
    wrap = spec["wrap"]
    if wrap in ("list", "list_root"):
        group = shard([model.tok_embeddings, model.norm, model.output], **kw)
        assert isinstance(group, list) and len(group) == 3, "fully_shard(list) returns the list"
    if wrap in ("nested", "submodule", "list"):
        for block in model.layers:
            if wrap == "submodule":
                shard(block.attention, **kw)
                shard(block.feed_forward, **kw)
            shard(block, **kw)
    shard(model, **kw)
    if spec.get("prefetch"):
        # torchtitan style: the root prefetches block 0 in forward and the last block in
        # backward; each block the next one in forward and the previous one in backward
        blocks = list(model.layers)
        model.set_modules_to_forward_prefetch([blocks[0]])
        model.set_modules_to_backward_prefetch([blocks[-1]])
        for i, block in enumerate(blocks):
            if i + 1 < len(blocks):
                block.set_modules_to_forward_prefetch([blocks[i + 1]])
            if i > 0:
                block.set_modules_to_backward_prefetch([blocks[i - 1]])


def _manual_unshard(model: Any, ref: ParityTransformer, impl: str) -> None:
    """unshard()/reshard()/unshard(async_op=True) on the module that owns block 0's
    attention (block 0 when nested, else the root), then an async unshard of the root."""
    owner = model.layers[0] if hasattr(model.layers[0], "unshard") else model
    ref_w = ref.layers[0].attention.wq.weight
    assert owner.unshard() is None, f"{impl}: unshard() returns None"
    w = model.layers[0].attention.wq.weight
    assert not isinstance(w, DTensor) and isinstance(w, nn.Parameter), f"{impl}: unsharded weight is {type(w)}"
    assert w.shape == ref_w.shape, f"{impl}: unsharded shape {tuple(w.shape)}"
    close(w, ref_w, 0.0, f"{impl}: unsharded wq.weight")
    owner.reshard()
    w = model.layers[0].attention.wq.weight
    assert isinstance(w, DTensor) and w.placements == (Shard(0),), f"{impl}: after reshard wq.weight is {type(w)}"
    handle = owner.unshard(async_op=True)
    assert handle is not None and hasattr(handle, "wait"), f"{impl}: unshard(async_op=True) gave {handle!r}"
    handle.wait()
    w = model.layers[0].attention.wq.weight
    assert not isinstance(w, DTensor) and w.shape == ref_w.shape, f"{impl}: after wait() wq.weight is {type(w)}"
    close(w, ref_w, 0.0, f"{impl}: wq.weight after wait()")
    # the root's all-gather is left in flight (a no-op when already gathered): the next
    # forward must wait for it itself
    root_handle = model.unshard(async_op=True)
    assert root_handle is not None, f"{impl}: root unshard(async_op=True) returned None"


def _check_layout_like_torch(ours: nn.Module, theirs: nn.Module, what: str) -> None:
    """Which parameters are sharded (DTensor) and which gathered (full tensor) right now:
    the memory behaviour of reshard_after_forward, which the numbers cannot show."""
    mine = {n: isinstance(p, DTensor) for n, p in ours.named_parameters()}
    torchs = {n: isinstance(p, DTensor) for n, p in theirs.named_parameters()}
    word = {True: "sharded", False: "full"}
    diff = {n: (word[mine[n]], word[torchs[n]]) for n in mine if mine[n] != torchs[n]}
    shown = dict(list(diff.items())[:6])
    assert not diff, (
        f"{what}: {len(diff)} parameter(s) differ in being sharded, (ours, torch FSDP2): {shown}"
        + (" ..." if len(diff) > len(shown) else "")
    )


def _check_invariants(model: nn.Module, opt: torch.optim.Optimizer, mesh: Any, what: str) -> None:
    params = list(model.parameters())
    held = [p for group in opt.param_groups for p in group["params"]]
    assert len(params) == len(held) and all(a is b for a, b in zip(params, held)), (
        f"{what}: model.parameters() are not the objects the optimizer holds"
    )
    for name, p in model.named_parameters():
        assert isinstance(p, nn.Parameter) and isinstance(p, DTensor), f"{what}: {name} is {type(p).__name__}"
        assert p.placements == (Shard(0),) and p.device_mesh == mesh, (
            f"{what}: {name} placements {p.placements} on {p.device_mesh}"
        )


def _run_case(name: str, steps: int) -> dict[str, float]:
    """Train ref / ours / torch FSDP2 side by side for ``steps`` steps; returns the largest
    differences seen (``ref``: ours vs the reference, ``torch``: ours vs torch FSDP2)."""
    with CollectiveRecorder() as comms:
        return _train_case(name, steps, comms)


def _gathers_and_scatters(records: list[CollectiveRecord]) -> dict[str, int]:
    return {kind: sum(r.kind == kind for r in records) for kind in ("all_gather", "reduce_scatter")}


def _train_case(name: str, steps: int, comms: CollectiveRecorder) -> dict[str, float]:
    """``comms`` is marked with the name of the model whose collectives follow ("none":
    the reference's all-reduce)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.fsdp import register_fsdp_forward_method as torch_register

    from fully_shard import FSDPModule, fully_shard, register_fsdp_forward_method

    spec = CASES[name]
    ws, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    ref = _build(spec.get("model", "base"))
    ours = copy.deepcopy(ref)
    theirs = copy.deepcopy(ref)
    mesh = init_device_mesh(device_type(), (ws,))
    _shard(ours, fully_shard, mesh, spec)
    _shard(theirs, torch_fully_shard, mesh, spec)
    assert isinstance(ours, FSDPModule) and isinstance(ours, ParityTransformer), f"{name}: class {type(ours)}"
    if spec.get("score"):
        register_fsdp_forward_method(ours, "score")
        torch_register(theirs, "score")
    models = {"ref": ref, "ours": ours, "torch": theirs}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True) for k, m in models.items() if k != "ref"}
    opts["ref"] = ShardwiseOptimizer(ref.parameters(), ws, lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True))
    # bitwise against torch FSDP2; against the reference bitwise at world size 2, else
    # REF_TOL["loss"] for losses, gradients and parameters alike (measured: at most 1.6e-6)
    tol_ref, tol_torch = ref_tol("loss", ws), 0.0
    worst = {"ref": 0.0, "torch": 0.0}
    micro = spec.get("micro", 1)

    for step in range(steps):
        skip = spec.get("skip", {}).get(step, ())
        for m in models.values():
            m.skip_layers = skip
        use_score = spec.get("score") and step % 2 == 1
        if spec.get("unshard") and step in (0, 2):  # before the first forward, and later
            comms.mark("ours")
            _manual_unshard(ours, ref, "ours")
            comms.mark("torch")
            _manual_unshard(theirs, ref, "torch")
        if spec.get("score") and step == 2:
            with torch.no_grad():  # evaluation through the registered method
                x = batch(100, rank)
                s_ref = ref.score(x)
                worst["ref"] = max(worst["ref"], close(ours.score(x), s_ref, tol_ref, f"{name}: no_grad score"))
                close(theirs.score(x), s_ref, tol_ref, f"{name}: torch no_grad score")
                _check_layout_like_torch(ours, theirs, f"{name}: after a no_grad score")
        losses: dict[str, list[torch.Tensor]] = {k: [] for k in models}
        for mb in range(micro):
            x = batch(step * micro + mb, rank)
            outs = {}
            for k, m in models.items():
                if k != "ref" and micro > 1:
                    m.set_requires_gradient_sync(mb == micro - 1)
                comms.mark(k)
                outs[k] = m.score(x) if use_score else m(x)
            _check_layout_like_torch(ours, theirs, f"{name}: step {step} microbatch {mb} after forward")
            for k in models:
                comms.mark(k)
                loss = _loss(outs[k], x)
                loss.backward()
                losses[k].append(loss.detach())
        comms.mark("none")
        average_gradients(ref)
        # as many all-gathers and reduce-scatters as torch FSDP2 (one all-gather per
        # group, a list group included; none in backward without reshard_after_forward).
        # Not in steps that skip blocks: fully_shard's implicit forward prefetch (the
        # group that ran next last step; torch FSDP2 has none) then gathers a skipped one.
        phases = comms.phases(first="none")
        counts = {k: _gathers_and_scatters(phases.get(k, [])) for k in ("ours", "torch")}
        comms.records.clear()  # the next step counts from here (its marks say whose)
        if not skip and not use_score:
            assert counts["ours"] == counts["torch"], f"{name}: step {step}: collectives (ours, torch FSDP2): {counts}"
        for mb in range(micro):
            what = f"{name}: step {step} microbatch {mb} loss"
            worst["ref"] = max(worst["ref"], close(losses["ours"][mb], losses["ref"][mb], tol_ref, what))
            close(losses["torch"][mb], losses["ref"][mb], tol_ref, "torch FSDP2 vs reference: " + what)
            worst["torch"] = max(worst["torch"], close(losses["ours"][mb], losses["torch"][mb], tol_torch, what))

        # this rank's rows of every gradient, compared locally (every rank checks its own rows)
        diffs = check_gradients(ref, ours, theirs, tol_ref, f"{name}: step {step} (rank {rank}'s rows)")
        worst["ref"], worst["torch"] = max(worst["ref"], diffs[0]), max(worst["torch"], diffs[1])
        if spec.get("model") == "unused":
            assert ours.layers[1].unused.weight.grad is None and ours.unused_scale.grad is None, (
                f"{name}: unused parameters got a gradient"
            )
        for opt in opts.values():
            opt.step()
            opt.zero_grad()

    # same torch.chunk layout as torch FSDP2: equal local shards on every rank
    diffs = check_parameters(ref, ours, theirs, tol_ref, f"{name}: after {steps} steps")
    worst["ref"], worst["torch"] = max(worst["ref"], diffs[0]), max(worst["torch"], diffs[1])
    if spec.get("model") == "unused":
        torch.manual_seed(0)
        init = _build("unused")  # same seed: the initial values
        for pname in ("layers.1.unused.weight", "layers.1.unused.bias", "unused_scale"):
            unused = dict(ours.named_parameters())[pname].full_tensor()
            close(unused, dict(init.named_parameters())[pname], 0.0, f"{name}: unused {pname} moved")
    _check_invariants(ours, opts["ours"], mesh, name)
    return worst


def _run_cases(names: list[str], steps: int) -> dict[str, dict[str, float]]:
    return {name: _run_case(name, steps) for name in names}


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------

WS2_STEPS = 5
WS4_STEPS = 2
# the world-size-4 subset (uneven shards: 67 -> 17,17,17,16 rows, 150 -> 38,38,38,36, the
# 1-row logit_scale on rank 0 only), run in one body call to keep pool time down
WS4_CASES = [
    "nested_raf_true",
    "list_group",
    "grad_accum",
    "unused_params_skip_block",
]


@pytest.mark.parametrize("name", list(CASES))
def test_parity_ws2(name: str) -> None:
    [worst, _] = run_distributed(_run_case, 2, name, WS2_STEPS)
    # bitwise on any CPU: exact 2-rank average, the same chunks stepped (tests.oracle), torch: same layout
    assert worst == {"ref": 0.0, "torch": 0.0}, f"{name}: world size 2 must be bitwise, got {worst}"


def test_parity_ws4() -> None:
    results = run_distributed(_run_cases, 4, WS4_CASES, WS4_STEPS)
    for rank, worst in enumerate(results):
        for name in WS4_CASES:
            assert worst[name]["torch"] == 0.0, f"{name}: rank {rank}: world size 4 vs torch FSDP2: {worst[name]}"
