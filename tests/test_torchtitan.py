"""torchtitan 0.3.0 as a real client: its llama3 debug model through its own
``parallelize_llama`` (per-block fully_shard, ``[norm, lm_head]`` grouped, the root, gradient
divide factor 1.0, selective activation checkpointing) and its ``ChunkedLossWrapper`` (the
model's forward skips ``lm_head``; the wrapper drives the head's group by hand and runs one
backward per chunk, then one through the decoder), 3 steps with its ``clip_grad_norm_``.

The run on ours goes through the switch, ``fully_shard.install()`` (docs/frameworks.md): torchtitan's
``from torch.distributed.fsdp import fully_shard, ...`` ran before it and is rebound, and the ``FSDPModule``
that ``ChunkedLossWrapper`` imports when called is ours; nothing of torchtitan's FSDP code is patched. CPU
workarounds, as torchtitan's trainer assumes a GPU: its
triton kernels module is stubbed (the expert-parallel path, unused here), its device type is
set to ``cpu``, and each block's inner attention is torchtitan's ``ScaledDotProductAttention``
(FlexAttention needs compiled kernels). ``spmd_backend="partial_dtensor"``: the default
passes ``dp_mesh_dims`` with parameters that are still plain tensors (data parallel only:
nothing made them DTensors), which torch's FSDP2 refuses (``ValueError: When dp_mesh_dims is
provided, all parameters must be DTensors on the full SPMD mesh``) as fully_shard does.

CPU only by design (skipped under ``FULLY_SHARD_TEST_DEVICE``, saying why). torchtitan 0.3.0
is part of the ``test`` extra (with its declared dependencies, as a user
installs it); without it the test is skipped, naming the install command.

Oracles: the unsharded model (see the test for tolerances), and torch's FSDP2 in the same
program, bitwise on 2 ranks (fp32; the same layout and
reduce-scatters with SUM: torch's divide factor 1.0 needs ``set_force_sum_reduction_for_comms``
on gloo, which has no PREMUL_SUM); losses, grad norms and every parameter after 3 steps.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.harness import run_distributed, skip_on_accelerator
from tests.torch_features import requires_torch_feature

for _name in ("torchtitan", "spmd_types", "tyro", "einops"):
    pytest.importorskip(_name, reason="torchtitan 0.3.0 client test: pip install -e '.[test]' (or torchtitan==0.3.0)")

SEQ_LEN = 64  # divisible by the wrapper's 8 chunks


def _stub_triton_kernels() -> None:
    name = "torchtitan.distributed.minimal_async_ep.kernels"  # imports triton; unused here
    if name not in sys.modules:
        stub = types.ModuleType(name)
        stub.__getattr__ = lambda attr: None  # type: ignore[method-assign]
        sys.modules[name] = stub


@contextlib.contextmanager
def _torchtitan_on_cpu(impl: str) -> Iterator[None]:
    """torchtitan on CPU (its device type, a module global read when it builds meshes), and (``impl == "ours"``)
    on fully_shard through the switch: ``fully_shard.install()``, nothing of torchtitan's patched."""
    import torchtitan.distributed.parallel_dims as tt_dims

    import fully_shard

    saved = tt_dims.device_type
    tt_dims.device_type = "cpu"
    replaced = fully_shard.install() if impl == "ours" else []
    try:
        # torchtitan.distributed.fsdp bound torch's names at its import, before install(): rebound
        assert impl != "ours" or "torchtitan.distributed.fsdp.fully_shard" in replaced, replaced
        yield
    finally:
        tt_dims.device_type = saved
        if replaced:
            fully_shard.uninstall()


def _full(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _train(impl: str, steps: int, tied: str = "") -> dict[str, Any]:
    """``tied="config"``: ``enable_weight_tying`` (torchtitan puts the embedding, the norm and the head in one call);
    ``tied="calls"``: the same tie made on the built model, which torchtitan does not see, so it shards
    ``tok_embeddings`` and ``[norm, lm_head]`` in two calls (its layout before pytorch/torchtitan#2522)."""
    _stub_triton_kernels()
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torchtitan.components.loss import ChunkedLossWrapper
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import utils as tt_utils
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry, parallelize_llama

    world, rank = dist.get_world_size(), dist.get_rank()
    spec = model_registry("debugmodel")
    spec.model.enable_weight_tying = tied == "config"
    for layer in spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    torch.manual_seed(0)
    full_model = spec.model.build()
    if tied == "calls":
        full_model.tok_embeddings.weight = full_model.lm_head.weight
    with torch.no_grad():
        full_model.init_weights(buffer_device=None)
    full = {name: p.detach() for name, p in full_model.named_parameters(remove_duplicate=False)}
    with _torchtitan_on_cpu(impl):
        if impl == "ref":  # the unsharded model, gradients summed across ranks below
            model = full_model
        else:
            with torch.device("meta"):
                model = spec.model.build()
            if tied == "calls":
                model.tok_embeddings.weight = model.lm_head.weight
            dims = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=1, world_size=world,
                                spmd_backend="partial_dtensor")
            model = parallelize_llama(
                model,
                parallel_dims=dims,
                training=TrainingConfig(mixed_precision_param="float32", seq_len=SEQ_LEN),
                parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
                compile_config=CompileConfig(),
                ac_config=SelectiveAC.Config(),
                dump_folder="/tmp",
            )
            if impl == "torch":  # gloo has no PREMUL_SUM, which torch uses for divide factor 1.0
                from torch.distributed.fsdp import FSDPModule

                for m in model.modules():
                    if isinstance(m, FSDPModule):
                        m.set_force_sum_reduction_for_comms(True)
            model.to_empty(device="cpu")
            assert impl != "ours" or not tied or model.tok_embeddings.weight is model.lm_head.weight  # kept by to_empty
            with torch.no_grad():
                model.init_weights(buffer_device=None)  # the buffers (RoPE cache); parameters below
                # the same values in both runs (parameters, not state_dict(): its hooks split
                # the fused wqkv into computed wq/wk/wv tensors that copies would not reach)
                for name, p in model.named_parameters():
                    assert isinstance(p, DTensor), name
                    local = distribute_tensor(full[name.replace("_checkpoint_wrapped_module.", "")], p.device_mesh,
                                              p.placements)
                    p.to_local().copy_(local.to_local())
        model.train()
        loss_fn = ChunkedLossWrapper(ChunkedLossWrapper.Config(num_chunks=8))
        loss_fn.set_lm_head(model.lm_head)
        model._skip_lm_head = True
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        out: dict[str, Any] = {"loss": [], "grad_norm": []}
        for step in range(steps):
            g = torch.Generator().manual_seed(100 * step + rank)
            tokens = torch.randint(0, spec.model.vocab_size, (2, SEQ_LEN + 1), generator=g)
            inputs, labels = tokens[:, :-1], tokens[:, 1:]
            global_valid_tokens = torch.tensor(float(labels.numel()))
            dist.all_reduce(global_valid_tokens)
            try:
                hidden = model(inputs)
            except ValueError as e:  # torch's FSDP2 refuses a tie across calls at its lazy init
                if tied != "calls":
                    raise
                return {"refused": str(e)}
            loss, _ = loss_fn(hidden, labels, global_valid_tokens)
            loss.backward()
            if impl == "ref":
                for p in model.parameters():
                    dist.all_reduce(p.grad)  # torchtitan's divide factor 1.0: a sum
            grad_norm = tt_utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
            opt.step()
            opt.zero_grad()
            loss = loss.detach()
            dist.all_reduce(loss)
            out["loss"].append(loss.item())
            out["grad_norm"].append(float(grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm))
        out["params"] = {
            name.replace("_checkpoint_wrapped_module.", ""): _full(p).detach().clone()
            for name, p in model.named_parameters()
        }
        out["is_fsdp_module"] = impl == "ref" or isinstance(
            model.lm_head, sys.modules["torch.distributed._composable.fsdp"].FSDPModule
        )
        out["sharded_by"] = {c.__module__ for m in model.modules() for c in type(m).__mro__
                             if c.__name__ == "FSDPModule"}
    return out


@requires_torch_feature("DataParallelMeshDims")  # torchtitan 0.3.0's parallelize imports it (torch 2.13)
@skip_on_accelerator(
    "runs torchtitan with its CPU workarounds (device type 'cpu', SDPA for FlexAttention, triton "
    "stubbed); on a GPU, torchtitan's own trainer runs it"
)
def test_torchtitan_llama3_chunked_loss_matches_torch_fsdp2() -> None:
    ours = run_distributed(_train, 2, "ours", 3)
    theirs = run_distributed(_train, 2, "torch", 3)
    for rank in range(2):
        a, b = ours[rank], theirs[rank]
        assert a["is_fsdp_module"] and b["is_fsdp_module"]  # the wrapper drove the head's group
        assert a["sharded_by"] == {"fully_shard.api"}, a["sharded_by"]  # parallelize_llama called ours
        assert b["sharded_by"] == {"torch.distributed.fsdp"}, b["sharded_by"]
        # same program, same ops in the same order (see the module docstring): bitwise
        assert a["loss"] == b["loss"], (a["loss"], b["loss"])
        assert a["grad_norm"] == b["grad_norm"], (a["grad_norm"], b["grad_norm"])
        assert a["params"].keys() == b["params"].keys()
        for name in a["params"]:
            assert torch.equal(a["params"][name], b["params"][name]), name
    # the unsharded model, gradients summed across ranks: sums over chunks and ranks in
    # another order, and a norm over whole gradients rather than shards; measured after 3
    # steps: losses equal, grad norms within 4e-5 (relative), parameters within 1e-6
    ref = run_distributed(_train, 2, "ref", 3)[0]
    torch.testing.assert_close(ours[0]["loss"], ref["loss"], rtol=1e-5, atol=0)
    torch.testing.assert_close(ours[0]["grad_norm"], ref["grad_norm"], rtol=2e-4, atol=0)
    for name, value in ref["params"].items():
        torch.testing.assert_close(ours[0]["params"][name], value, rtol=0, atol=1e-5, msg=name)


@requires_torch_feature("DataParallelMeshDims")  # torchtitan 0.3.0's parallelize imports it (torch 2.13)
@skip_on_accelerator("runs torchtitan with its CPU workarounds (see the module docstring)")
def test_torchtitan_tie_across_its_calls_trains_where_torch_refuses() -> None:
    refused = run_distributed(_train, 2, "torch", 1, "calls")[0]
    assert "already managed by another FSDP group" in refused["refused"], refused
    ours = run_distributed(_train, 2, "ours", 3, "calls")
    theirs = run_distributed(_train, 2, "torch", 3, "config")  # torchtitan's own layout for the tie: one call
    for rank in range(2):
        a, b = ours[rank], theirs[rank]
        assert a["sharded_by"] == {"fully_shard.api"}, a["sharded_by"]
        assert "lm_head.weight" not in a["params"] and a["params"].keys() == b["params"].keys()
        # not bitwise: the wrapper runs the head's backward (8 chunks) in passes of its own before the decoder's.
        # Ours sums the tied gradient's parts and reduces them once, in the embedding's group (the head's group, at
        # its last chunk, finds the embedding's group still owing its post-backward and keeps its part); torch's one
        # group reduces the head's part at the last chunk and the embedding's in the decoder's pass, adding the
        # sharded gradients: other roundings. Measured after 3 steps: losses and the first two grad norms equal, the
        # third within 1e-7 (relative), parameters within 4e-7
        torch.testing.assert_close(a["loss"], b["loss"], rtol=1e-6, atol=0)
        torch.testing.assert_close(a["grad_norm"], b["grad_norm"], rtol=1e-6, atol=0)
        for name in a["params"]:
            torch.testing.assert_close(a["params"][name], b["params"][name], rtol=0, atol=2e-6, msg=name)
