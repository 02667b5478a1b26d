"""Parameters tied across fully_shard calls (Note [tied parameters], docs/design.md): each call that reaches the one
sharded parameter gathers it for its own modules; the gradients of its uses are summed and reduced once, by the last
of those groups to reach its post-backward. torch's FSDP2 (2.13) refuses all three layouts below.

Layouts (``tests.models.Transformer``, 3 blocks):

* ``torchtitan``: ``output.weight`` tied to ``tok_embeddings.weight``; ``tok_embeddings`` alone, each block,
  ``[norm, output]`` (reshard_after_forward=False), the root: torchtitan's wrapping before pytorch/torchtitan#2522.
* ``accelerate``: the same tie; each block, ``[norm, tok_embeddings]`` (reshard_after_forward=False), the root,
  which reaches ``output``: accelerate's ``fsdp2_prepare_model`` before huggingface/accelerate#4171.
* ``blocks``: ``layers.2.attention.wq.weight`` tied to ``layers.0``'s; each block, the root.
* ``shared_module``: one ``Linear`` in two blocks (``layers.2.attention.wq is layers.0.attention.wq``:
  pytorch/torchtitan#2817), each block, the root.

Configurations: ``reshard_after_forward`` as the layout has it (None), True and False on every call but the root,
activation checkpointing of every block; on 4 ranks ``reshard_after_forward=2``; bf16 parameters with fp32
reductions.

Oracles:

* fp32: the unsharded tied model, gradients averaged, stepped shard-wise (``tests.oracle``): bitwise at world size 2
  (one gradient per use, summed in the order autograd sums them, then one average of two floats); at 4 ranks
  ``tests.oracle.REF_TOL``.
* bf16: torch's FSDP2 with the tie in one call (the layout torch accepts: torchtitan's and accelerate's fix), bitwise
  at world size 2: the same bf16 gathers, the same bf16 sum of the two uses' gradients (autograd's on torch's one
  unsharded parameter, ours before the one reduction), the same fp32 reductions. The unsharded model computes in fp32,
  so it is no bitwise oracle there.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from fully_shard import MixedPrecisionPolicy, fully_shard
from tests.harness import mesh, run_distributed
from tests.models import ModelArgs, Transformer, batch, loss_fn
from tests.oracle import ShardwiseOptimizer, close, ref_tol, train_step
from tests.torch_features import requires_torch_feature

LAYOUTS = ("torchtitan", "accelerate", "blocks", "shared_module")
STEPS = 2


class TiedTransformer(Transformer):
    """``Transformer`` with a tie across calls (see the module docstring) and, optionally, every block checkpointed."""

    def __init__(self, layout: str, ac: bool = False) -> None:
        super().__init__(ModelArgs())
        self.ac = ac
        if layout == "blocks":
            self.layers[2].attention.wq.weight = self.layers[0].attention.wq.weight
        elif layout == "shared_module":
            self.layers[2].attention.wq = self.layers[0].attention.wq
        else:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) + self.pos[: tokens.shape[1]]  # (B, T, C)
        for layer in self.layers:
            h = checkpoint(layer, h, use_reentrant=False) if self.ac else layer(h)
        return self.output(self.norm(h)) * self.logit_scale  # (B, T, V)


def _shard(model: TiedTransformer, layout: str, fs: Any = fully_shard, reshard: Any = None, mp: Any = None,
           grouped: bool = False) -> None:
    """``layout``'s calls (``grouped``: the tie in one call instead, as torch needs), ``reshard`` on all but the
    root."""
    kw: dict[str, Any] = {"mesh": mesh(dist.get_world_size())}
    if mp is not None:
        kw["mp_policy"] = mp
    inner = dict(kw, reshard_after_forward=reshard)
    tail = dict(kw, reshard_after_forward=False if reshard is None else reshard)
    if layout == "torchtitan" and not grouped:
        fs(model.tok_embeddings, **inner)
    blocks = layout in ("blocks", "shared_module")
    if blocks and grouped:
        fs([model.layers[0], model.layers[2]], **inner)
    for i, block in enumerate(model.layers):
        if not (blocks and grouped and i != 1):
            fs(block, **inner)
    if layout == "torchtitan":
        fs([model.tok_embeddings, model.norm, model.output] if grouped else [model.norm, model.output], **tail)
    if layout == "accelerate":
        fs([model.norm, model.tok_embeddings, model.output] if grouped else [model.norm, model.tok_embeddings], **tail)
    fs(model, **kw)


def _differs(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> list[str]:
    try:
        close(actual.float(), expected.float(), tol, what)
    except AssertionError as e:
        return [str(e).splitlines()[0]]
    return []


def _train(models: dict[str, nn.Module], opts: dict[str, Any], steps: int) -> list[str]:
    """``steps`` steps of every model on this rank's batches; the mismatches against the first model (the unsharded
    ``"ref"``: within ``ref_tol``; else bitwise)."""
    bad = []
    first, *others = models
    tol = (lambda what: ref_tol(what)) if first == "ref" else (lambda what: 0.0)
    for step in range(steps):
        losses = train_step(models, opts, batch(step, dist.get_rank()), loss_fn)
        for name in others:
            bad += _differs(losses[name], losses[first], tol("loss"), f"step {step}: loss of {name} vs {first}")
    expected = dict(models[first].named_parameters())
    for name in others:
        for n, p in models[name].named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            e = expected[n].full_tensor() if isinstance(expected[n], DTensor) else expected[n]
            bad += _differs(full, e, tol("param"), f"{name}: parameter {n} vs {first}")
    return bad


def _check_tie(model: nn.Module, layout: str, what: str) -> list[str]:
    """Between steps the tie holds: both registrations are the one sharded DTensor, listed once."""
    blocks = layout in ("blocks", "shared_module")
    a, b = ((model.layers[0].attention.wq, model.layers[2].attention.wq) if blocks
            else (model.tok_embeddings, model.output))
    ok = a.weight is b.weight and isinstance(a.weight, DTensor)
    return [] if ok else [f"{what}: the tie did not hold ({type(a.weight).__name__}, {type(b.weight).__name__})"]


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


def _layout_fp32(layout: str, configs: list[tuple[Any, bool]]) -> list[str]:
    """Each ``(reshard_after_forward, activation checkpointing)`` against the unsharded tied model."""
    bad = []
    for reshard, ac in configs:
        what = f"{layout}, reshard_after_forward={reshard!r}, ac={ac}"
        torch.manual_seed(0)
        ref = TiedTransformer(layout, ac)
        ours = copy.deepcopy(ref)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the held-twice warning (its own test)
            _shard(ours, layout, reshard=reshard)
        assert len(list(ours.parameters())) == len(list(ref.parameters())), what
        opts = {"ref": ShardwiseOptimizer(ref.parameters(), dist.get_world_size(), _adamw),
                "ours": _adamw(ours.parameters())}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            bad += [f"{what}: {m}" for m in _train({"ref": ref, "ours": ours}, opts, STEPS)]
        bad += _check_tie(ours, layout, what)
    return bad


def _layout_bf16(layout: str) -> list[str]:
    """bf16 parameters, fp32 reductions, against torch's FSDP2 with the tie in one call."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch.manual_seed(0)
    ours = TiedTransformer(layout)
    theirs = copy.deepcopy(ours)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _shard(ours, layout, mp=MixedPrecisionPolicy(torch.bfloat16, torch.float32))
    _shard(theirs, layout, torch_fully_shard, mp=TorchMP(torch.bfloat16, torch.float32), grouped=True)
    opts = {"torch": _adamw(theirs.parameters()), "ours": _adamw(ours.parameters())}
    return ([f"{layout}, bf16: {m}" for m in _train({"torch": theirs, "ours": ours}, opts, STEPS)]
            + _check_tie(ours, layout, "bf16"))


# what torch's FSDP2 (2.13) raises on each layout (the shared Linear: an internal TypeError at block 2's call)
TORCH_REFUSES = {"torchtitan": "already managed by another FSDP group",
                 "accelerate": "already managed by another FSDP group",
                 "blocks": "already managed by another FSDP group", "shared_module": "Invariant encountered"}


def _torch_refuses(layout: str) -> str:
    """torch's FSDP2 on the same calls, then a forward: its error."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    model = TiedTransformer(layout)
    try:
        _shard(model, layout, torch_fully_shard)
        model(batch(0, dist.get_rank()))
    except (ValueError, TypeError) as e:
        return str(e)
    return "torch's FSDP2 raised nothing"


def _layout_case(layout: str) -> list[str]:
    bad = _layout_fp32(layout, [(None, False), (True, False), (False, False), (None, True)])
    bad += _layout_bf16(layout)
    refusal = _torch_refuses(layout)
    if TORCH_REFUSES[layout] not in refusal:
        bad.append(f"{layout}: torch's FSDP2 no longer refuses the layout as it did: {refusal}")
    return bad


@pytest.mark.parametrize("layout", LAYOUTS)
@requires_torch_feature("FSDP2 refusing a parameter tied across calls")  # the test checks torch refuses it
def test_tied_layout_trains_like_the_unsharded_model(layout: str) -> None:
    assert run_distributed(_layout_case, 2, layout) == [[], []]


def _reshard_int_case() -> list[str]:
    return [m for layout in LAYOUTS for m in _layout_fp32(layout, [(2, False)])]


def test_tied_layouts_with_reshard_after_forward_int() -> None:
    assert run_distributed(_reshard_int_case, 4) == [[]] * 4


def _warnings(layout: str, reshard: Any = None) -> list[str]:
    """The held-twice warnings of ``layout``'s first forward."""
    model = TiedTransformer(layout)
    _shard(model, layout, reshard=reshard)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(batch(0, dist.get_rank()))
        model(batch(1, dist.get_rank()))  # once: lazy init only
    return [str(w.message) for w in caught if "tied across" in str(w.message)]


def _warning_case() -> dict[str, list[str]]:
    return {"accelerate": _warnings("accelerate"), "torchtitan": _warnings("torchtitan"),
            "torchtitan, never reshard": _warnings("torchtitan", reshard=False), "blocks": _warnings("blocks")}


def test_tied_parameter_held_twice_warns_once_naming_the_grouping() -> None:
    found = run_distributed(_warning_case, 1)[0]
    # accelerate's tail [norm, tok_embeddings] and the root both keep it between forward and backward: the root's
    # use (output) joins the tail's call, as huggingface/accelerate#4171 did
    assert len(found["accelerate"]) == 1, found
    msg = found["accelerate"][0]
    for fragment in ("parameter 'tok_embeddings.weight' is tied across 2 fully_shard calls (as 'output.weight')",
                     "(the call on [norm, tok_embeddings] and the root's, with reshard_after_forward=False",
                     "2 full copies of 26,800 bytes", "fully_shard([norm, tok_embeddings, output])"):
        assert fragment in msg, (fragment, msg)
    # torchtitan's: the embedding is resharded after its forward, one copy at a time: no warning, unless every call
    # keeps its parameters (torchtitan's "never" policy): then [tok_embeddings] and [norm, output] together
    assert found["torchtitan"] == [] and found["blocks"] == [], found
    assert len(found["torchtitan, never reshard"]) == 1, found
    assert "fully_shard([tok_embeddings, norm, output])" in found["torchtitan, never reshard"][0], found


def _tied_pair(model: nn.Module, layout: str) -> tuple[str, str]:
    return (("layers.0.attention.wq.weight", "layers.2.attention.wq.weight") if layout in ("blocks", "shared_module")
            else ("tok_embeddings.weight", "output.weight"))


def _checkpoint_layout(layout: str, root: str) -> list[str]:
    """Meta init (``to_empty``), 2 steps, the state dicts, a DCP checkpoint through ``fully_shard.ckpt`` loaded into
    a fresh model, and its consolidation, for ``layout``."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import distribute_tensor

    from fully_shard.ckpt import load_consolidated, save_checkpoint

    torch.manual_seed(0)
    ref = TiedTransformer(layout)
    with torch.device("meta"):
        ours = TiedTransformer(layout)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _shard(ours, layout)
    ours.to_empty(device="cpu")
    bad = _check_tie(ours, layout, f"{layout}, after to_empty")
    with torch.no_grad():  # the reference's values, each rank its part
        full = ref.state_dict()
        for name, p in ours.named_parameters():
            p.to_local().copy_(distribute_tensor(full[name], p.device_mesh, p.placements).to_local())
        buffers = dict(ref.named_buffers())  # (non-persistent ones too)
        for name, b in ours.named_buffers():
            b.copy_(buffers[name])
    opts = {"ref": ShardwiseOptimizer(ref.parameters(), dist.get_world_size(), _adamw),
            "ours": _adamw(ours.parameters())}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bad += [f"{layout}, meta init: {m}" for m in _train({"ref": ref, "ours": ours}, opts, STEPS)]
    a, b = _tied_pair(ours, layout)
    # torch's convention (nn.Module.state_dict of the tied model): both names, one tensor (state_dict() detaches
    # each entry: one storage)
    for what, sd in (("state_dict()", ours.state_dict()), ("get_model_state_dict", get_model_state_dict(ours))):
        one = isinstance(sd[a], DTensor) and sd[a].to_local().data_ptr() == sd[b].to_local().data_ptr()
        if list(sd) != list(ref.state_dict()) or not one:
            bad.append(f"{layout}, {what}: keys {list(sd)[:3]}..., {a} and {b} one tensor: {one}")
    path = save_checkpoint({"model": ours.state_dict()}, root, 1)
    # a fresh model (other values) loads the checkpoint in place: the tie holds, every parameter is the saved one
    torch.manual_seed(1)
    fresh = TiedTransformer(layout)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _shard(fresh, layout)
    load({"model": fresh.state_dict()}, checkpoint_id=path)
    bad += _check_tie(fresh, layout, f"{layout}, after the DCP load")
    for (n, p), q in zip(ours.named_parameters(), fresh.parameters()):
        if not torch.equal(p.full_tensor(), q.full_tensor()):
            bad.append(f"{layout}: {n} differs after the DCP load")
    consolidated = load_consolidated(path)
    if list(consolidated) != list(ref.state_dict()) or not torch.equal(consolidated[a], consolidated[b]) \
            or not torch.equal(consolidated[a], ours.get_parameter(a).full_tensor()):
        bad.append(f"{layout}: the consolidated checkpoint lost the tie: {sorted(consolidated)[:4]}...")
    return bad


def _checkpoint_case(root: str) -> list[str]:
    root = f"{root}/{{}}"
    return [m for layout in LAYOUTS for m in _checkpoint_layout(layout, root.format(layout))]


def test_tie_kept_through_meta_init_state_dicts_dcp_and_ckpt(tmp_path: Any) -> None:
    assert run_distributed(_checkpoint_case, 2, str(tmp_path)) == [[], []]


def test_planner_plans_a_tie_across_calls_once_and_notes_it() -> None:
    from fully_shard import plan
    from tests.models import Block

    with torch.device("meta"):
        model = Transformer(ModelArgs())
        untied = plan(model, 2, wrap=lambda m: isinstance(m, Block) or m is model.tok_embeddings)
        model.output.weight = model.tok_embeddings.weight
    tied = plan(model, 2, wrap=lambda m: isinstance(m, Block) or m is model.tok_embeddings)
    # torchtitan's layout: the embedding's group shards it, the root's gathers it too (what fully_shard does)
    weight = model.output.weight.numel()
    assert tied.num_params == untied.num_params - weight
    root, untied_root = tied.groups[0], untied.groups[0]
    assert root.name == "(root)" and root.all_gather_output_bytes == untied_root.all_gather_output_bytes
    embedding = tied.groups[1]  # the tok_embeddings group: the weight alone, as laid out in the root's
    assert embedding.name == "tok_embeddings" and embedding.tensors == 1
    assert root.sharded_bytes == untied_root.sharded_bytes - embedding.sharded_bytes  # its state: once
    assert root.optimizer_bytes == untied_root.optimizer_bytes - embedding.optimizer_bytes
    assert (root.reduce_scatter_input_bytes
            == untied_root.reduce_scatter_input_bytes - embedding.reduce_scatter_input_bytes)
    assert [n for n in tied.notes if "tied" in n] == [
        "parameter 'output.weight' is tied to 'tok_embeddings.weight' (the group of tok_embeddings): the group of "
        "(root) gathers it too, one more all-gather of 26,800 bytes (unsharded) per forward, and one reduce-scatter "
        "sums both groups' gradients, held until the later post-backward; one fully_shard call over the modules that "
        "use it gathers it once (docs/design.md, tied parameters across calls)"]


def _tied_divergence() -> str:
    """torchtitan's layout; rank 1 runs the embedding without grad, so its ``[norm, output]`` group, owing the tie's
    last post-backward there, reduces the tied gradient where rank 0's waits for the embedding's group."""
    from fully_shard.tools import CollectiveMismatchError, debug_collectives

    model = TiedTransformer("torchtitan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _shard(model, "torchtitan")
    x = batch(0, dist.get_rank())

    def forward(tokens: torch.Tensor) -> torch.Tensor:
        with torch.set_grad_enabled(dist.get_rank() == 0):
            h = model.tok_embeddings(tokens)
        h = h + model.pos[: tokens.shape[1]]
        for layer in model.layers:
            h = layer(h)
        return model.output(model.norm(h))

    model.forward = forward  # the root's hooks still run around it
    try:
        with debug_collectives():
            loss_fn(model(x), x).backward()
    except CollectiveMismatchError as e:
        return str(e)
    return "no error"


def test_debug_mode_names_the_tie_when_its_reduction_diverges() -> None:
    for message in run_distributed(_tied_divergence, 2, timeout=60):
        assert "differs across ranks" in message and "(with tied 'output.weight'" in message, message
        assert "reduced once per backward, by the last of the groups gathering it" in message, message
