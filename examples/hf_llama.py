"""A Hugging Face model with fully_shard: train, checkpoint, export for ``from_pretrained``.

    python3 examples/hf_llama.py                  # 2 local CPU processes, a few seconds of training
    python3 examples/hf_llama.py --steps 30 --out-dir /tmp/hf_llama

What it does, on N processes started through torch's elastic launcher like
``examples/train.py`` (or under ``torchrun``):

0. takes a pretrained checkpoint directory (``--pretrained DIR``: ``config.json`` and
   ``model.safetensors``, as ``save_pretrained`` writes them); without one, rank 0 writes
   a tiny random stand-in to ``OUT/pretrained`` (nothing is downloaded);
1. builds ``transformers.LlamaForCausalLM`` from the config alone on the ``meta`` device
   (no memory, no initialisation);
2. shards it the FSDP2 way: ``fully_shard`` on each decoder layer
   (``model.model.layers[i]``), then on the root, which takes the embeddings, the final
   norm and ``lm_head``; ``to_empty`` gives each rank storage for its shards only, the
   rotary buffers are computed, and rank 0 reads ``model.safetensors`` and
   ``fully_shard.broadcast_full_state_dict`` sends one tensor at a time, each rank
   keeping its shard; then checks the sharded model's logits against the unsharded
   pretrained model's;
3. fine-tunes a few AdamW steps on byte-level tokens (vocabulary 256) of the Python standard
   library's sources, each rank on its own batches, with Hugging Face's own loss
   (``model(input_ids=..., labels=...).loss``);
4. saves a sharded ``torch.distributed.checkpoint`` (DCP) of the model and optimizer with
   the crash-safe helper ``fully_shard.ckpt.save_checkpoint`` (``OUT/checkpoints/step_<k>``);
5. exports the full weights as ONE safetensors file: every rank takes part in
   ``get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
   cpu_offload=True))`` (it all-gathers one tensor at a time), rank 0 receives the full
   CPU tensors and writes ``OUT/hf/config.json`` (``model.config.save_pretrained``) and
   ``OUT/hf/model.safetensors`` (``safetensors.torch.save_file``);
6. checks the export: ``LlamaForCausalLM.from_pretrained(OUT/hf)`` on rank 0 gives the
   same logits as the trained sharded model on a fixed input.

Needs ``transformers`` and ``safetensors`` (in the ``test`` extra: ``pip install -e
".[test]"``). The same recipe works with torch's FSDP2: change the ``fully_shard`` import.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

EXAMPLES = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join("outputs", "hf_llama")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)
from common import leave_worker, positive_float, positive_int  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train a tiny Hugging Face LlamaForCausalLM with fully_shard, checkpoint it with "
                    "DCP and export one safetensors file that from_pretrained loads.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--nproc", type=positive_int, default=2,
                        help="processes to start on this machine (ignored under torchrun)")
    parser.add_argument("--steps", type=positive_int, default=10, help="optimizer steps")
    parser.add_argument("--out-dir", default=DEFAULT_OUT, metavar="DIR",
                        help="DIR/checkpoints: the DCP checkpoint; DIR/hf: config.json and model.safetensors")
    parser.add_argument("--pretrained", default=None, metavar="DIR",
                        help="a save_pretrained directory (config.json, model.safetensors) to fine-tune; "
                             "default: a random stand-in written to OUT/pretrained (the size flags below)")
    parser.add_argument("--hidden-size", type=positive_int, default=64)
    parser.add_argument("--layers", type=positive_int, default=2, help="decoder layers")
    parser.add_argument("--heads", type=positive_int, default=4, help="attention heads")
    parser.add_argument("--kv-heads", type=positive_int, default=2, help="key/value heads (grouped-query attention)")
    parser.add_argument("--seq-len", type=positive_int, default=64)
    parser.add_argument("--batch-size", type=positive_int, default=4, help="sequences per rank per step")
    parser.add_argument("--lr", type=positive_float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.hidden_size % args.heads != 0 or (args.hidden_size // args.heads) % 2 != 0:
        parser.error(f"--hidden-size ({args.hidden_size}) / --heads ({args.heads}) must be an even integer")
    if args.heads % args.kv_heads != 0:
        parser.error(f"--heads ({args.heads}) must be divisible by --kv-heads ({args.kv_heads})")
    if args.pretrained is not None and not os.path.isfile(os.path.join(args.pretrained, "config.json")):
        parser.error(f"--pretrained {args.pretrained!r} has no config.json (a save_pretrained directory)")
    if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        parser.error(f"--out-dir {args.out_dir!r} exists and is not a directory")
    return args


# -- the recipe (every rank runs it, inside an initialised default process group) -----


def recipe(
    out_dir: str,
    *,
    steps: int = 10,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    seq_len: int = 64,
    batch_size: int = 4,
    lr: float = 3e-3,
    seed: int = 0,
    pretrained: str | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Load a pretrained checkpoint into a sharded model, fine-tune, checkpoint, export and
    check; returns what happened (the checks' results on rank 0 only).

    ``pretrained``: a directory with ``config.json`` and ``model.safetensors`` (what
    ``save_pretrained`` writes); None: rank 0 first writes a random stand-in of the given
    size to ``out_dir/pretrained`` (nothing is downloaded)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    from common import load_corpus

    from fully_shard.ckpt import save_checkpoint

    rank = dist.get_rank()

    def say(msg: str) -> None:
        if rank == 0 and log is not None:
            log(msg)

    # 0. the "pretrained" checkpoint; here a random stand-in, written once by rank 0
    if pretrained is None:
        pretrained = os.path.join(out_dir, "pretrained")
        if rank == 0:
            write_stand_in(pretrained, hidden_size, layers, heads, kv_heads, seq_len, seed)
        dist.barrier()

    # 1-2. built on meta, sharded, loaded; checked against the unsharded pretrained model on a fixed input
    corpus = load_corpus(None, max_mb=0.25)
    probe = corpus[:seq_len].unsqueeze(0)
    model, loaded = load_sharded(pretrained, probe, say)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

    # 3. train
    losses, train_s = fine_tune(model, optimizer, corpus, steps=steps, seq_len=seq_len, batch_size=batch_size,
                                seed=seed, say=say)

    # 4. a sharded DCP checkpoint (each rank writes its own shards), crash-safe
    model_sd, optim_sd = get_state_dict(model, optimizer)
    ckpt = save_checkpoint({"model": model_sd, "optim": optim_sd, "step": steps},
                           os.path.join(out_dir, "checkpoints"), steps)
    say(f"checkpoint (DCP, sharded): {ckpt}")

    # 5-6. one safetensors file that from_pretrained loads, and the check that it computes what the sharded model does
    result: dict[str, Any] = {"losses": losses, "checkpoint": ckpt, "train_s": train_s, **loaded}
    result.update(export_and_check(model, os.path.join(out_dir, "hf"), probe, say))
    dist.barrier()  # nobody leaves (and tears the process group down) before rank 0 is done
    return result


def load_sharded(pretrained: str, probe: Any, say: Callable[[str], None]) -> tuple[Any, dict[str, Any]]:
    """Steps 1-2: the model from its config on the meta device, ``fully_shard`` per decoder layer and on the root,
    storage for this rank's shards, the weights broadcast from rank 0's file; then the load check (rank 0: whether
    the sharded model's logits on ``probe`` equal the unsharded pretrained model's). Returns the model and
    ``n_params`` (and, on rank 0, the check's result)."""
    import torch
    import torch.distributed as dist
    import transformers
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaConfig, LlamaForCausalLM

    # torch's FSDP2: fully_shard from torch.distributed.fsdp, and set_model_state_dict with
    # StateDictOptions(full_state_dict=True, broadcast_from_rank0=True) for the loading
    from fully_shard import broadcast_full_state_dict, fully_shard

    rank, world_size = dist.get_rank(), dist.get_world_size()
    # 1. the model from its config alone, on the meta device: no memory, no init
    config = LlamaConfig.from_pretrained(pretrained)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())

    # 2. the FSDP2 recipe: one group per decoder layer, the root takes the rest; then
    # storage for this rank's shards only, and the weights: rank 0 reads the file, every
    # tensor is broadcast in turn and each rank keeps its shard
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    rope = model.model.rotary_emb  # non-persistent buffers are in no checkpoint: compute them
    inv_freq, _ = rope.compute_default_rope_parameters(config)
    rope.inv_freq.copy_(inv_freq)
    rope.original_inv_freq.copy_(inv_freq)
    full = load_file(os.path.join(pretrained, "model.safetensors")) if rank == 0 else None
    broadcast_full_state_dict(model, full)
    del full
    # the load check: the sharded model computes what the unsharded pretrained model does
    model.eval()
    with torch.no_grad():
        loaded_logits = model(input_ids=probe).logits
    model.reshard()  # no backward follows this forward: free the root's gathered parameters
    loaded: dict[str, Any] = {"n_params": n_params}
    if rank == 0:
        transformers.utils.logging.disable_progress_bar()  # no "Loading weights" bar
        original = LlamaForCausalLM.from_pretrained(pretrained, dtype=torch.float32).eval()
        with torch.no_grad():
            original_logits = original(input_ids=probe).logits
        loaded.update(loaded_equal=bool(torch.equal(original_logits, loaded_logits)),
                      loaded_max_abs_diff=float((original_logits - loaded_logits).abs().max()))
        del original
    say(f"LlamaForCausalLM from {pretrained}: {n_params:,} parameters, {config.num_hidden_layers} layers, "
        f"built on meta, fully_shard on {world_size} ranks, weights broadcast from rank 0")
    return model, loaded


def fine_tune(model: Any, optimizer: Any, corpus: Any, *, steps: int, seq_len: int, batch_size: int, seed: int,
              say: Callable[[str], None]) -> tuple[list[float], float]:
    """Step 3: ``steps`` AdamW steps, each rank on its own random windows of ``corpus``, with Hugging Face's own loss;
    the losses (mean over ranks) and the seconds it took."""
    import torch
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    losses: list[float] = []
    model.train()
    start = time.perf_counter()
    for step in range(1, steps + 1):
        g = torch.Generator().manual_seed(seed * 1_000_003 + step * 65_537 + rank)
        starts = torch.randint(0, len(corpus) - seq_len, (batch_size,), generator=g).tolist()
        input_ids = torch.stack([corpus[s : s + seq_len] for s in starts])
        loss = model(input_ids=input_ids, labels=input_ids).loss  # HF shifts the labels itself
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world_size)
        if step == 1 or step == steps or step % 5 == 0:
            say(f"step {step:>3}/{steps} | loss {losses[-1]:.4f}")
    return losses, time.perf_counter() - start


def export_and_check(model: Any, export_dir: str, probe: Any, say: Callable[[str], None]) -> dict[str, Any]:
    """Steps 5-6: the full weights as one safetensors file (every rank takes part, rank 0 writes), then
    ``from_pretrained`` of the export on rank 0 against the sharded model's logits on ``probe``."""
    import torch
    import torch.distributed as dist
    import transformers
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import LlamaForCausalLM

    # the logits of the trained sharded model on a fixed input: every rank runs the forward
    # (the all-gathers need them all) and gets the same logits
    model.eval()
    with torch.no_grad():
        sharded_logits = model(input_ids=probe).logits

    # 5. full weights on rank 0: a collective, so every rank calls it; with cpu_offload the
    # full tensors exist on rank 0 only (one at a time on the device), the others get {}
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    result: dict[str, Any] = {"export_dir": export_dir}
    if dist.get_rank() != 0:
        return result
    os.makedirs(export_dir, exist_ok=True)
    model.config.save_pretrained(export_dir)
    weights = os.path.join(export_dir, "model.safetensors")
    save_file({k: v.contiguous() for k, v in full.items()}, weights, metadata={"format": "pt"})
    say(f"export: {weights} ({len(full)} tensors, {os.path.getsize(weights):,} bytes) + config.json")

    # 6. the check: a plain (unsharded) model loaded by transformers from the export
    transformers.utils.logging.disable_progress_bar()  # no "Loading weights" bar
    reloaded = LlamaForCausalLM.from_pretrained(export_dir, dtype=torch.float32)
    reloaded.eval()
    with torch.no_grad():
        reloaded_logits = reloaded(input_ids=probe).logits
    result["logits_equal"] = bool(torch.equal(reloaded_logits, sharded_logits))
    result["max_abs_diff"] = float((reloaded_logits - sharded_logits).abs().max())
    result["exported_keys"] = sorted(full)
    result["model_keys"] = sorted(reloaded.state_dict())
    verdict = "identical (bitwise)" if result["logits_equal"] else f"max |diff| {result['max_abs_diff']:.3g}"
    say(f"check: LlamaForCausalLM.from_pretrained({export_dir!r}) logits vs the sharded model's "
        f"on a fixed input of {probe.shape[1]} tokens: {verdict}")
    return result


def write_stand_in(path: str, hidden_size: int, layers: int, heads: int, kv_heads: int, seq_len: int,
                   seed: int) -> None:
    """A tiny random ``LlamaForCausalLM`` saved with ``save_pretrained`` (config.json and
    model.safetensors): the stand-in for a downloaded checkpoint."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,  # bytes
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 8 // 3 // 8 * 8,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=seq_len,
        tie_word_embeddings=False,
    )
    config.architectures = ["LlamaForCausalLM"]  # so that AutoModelForCausalLM finds the class too
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)


# -- launching ------------------------------------------------------------------------


def worker_argv(args: argparse.Namespace) -> list[str]:
    """Every flag but --nproc, spelled out (the launcher's own parser would otherwise take
    ``--nproc`` for its ``--nproc-per-node``)."""
    return [
        f"--steps={args.steps}", f"--out-dir={os.path.abspath(args.out_dir)}",
        f"--hidden-size={args.hidden_size}", f"--layers={args.layers}", f"--heads={args.heads}",
        f"--kv-heads={args.kv_heads}", f"--seq-len={args.seq_len}", f"--batch-size={args.batch_size}",
        f"--lr={args.lr!r}", f"--seed={args.seed}",
        *([f"--pretrained={os.path.abspath(args.pretrained)}"] if args.pretrained else []),
    ]


def launch(args: argparse.Namespace) -> int:
    """Start ``args.nproc`` copies of this script through torch's elastic launcher
    (``torchrun --standalone``), as examples/train.py does."""
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    from common import launch_script

    return launch_script(os.path.abspath(__file__), args.nproc, worker_argv(args))


def worker(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo")  # CPU; a GPU version would use nccl and a "cuda" mesh
    try:
        result = recipe(
            args.out_dir, steps=args.steps, hidden_size=args.hidden_size, layers=args.layers,
            heads=args.heads, kv_heads=args.kv_heads, seq_len=args.seq_len, batch_size=args.batch_size,
            lr=args.lr, seed=args.seed, pretrained=args.pretrained, log=lambda msg: print(msg, flush=True),
        )
    finally:
        dist.destroy_process_group()
    code = 0
    if result.get("logits_equal") is False and result["max_abs_diff"] > 1e-5:
        print("error: the exported model's logits differ from the sharded model's", file=sys.stderr)
        code = 1
    leave_worker(code)  # gloo: no interpreter shutdown after collectives (see common.py)
    return code


def main() -> int:
    args = parse_args()
    if "LOCAL_RANK" not in os.environ:
        try:
            import safetensors  # noqa: F401
            import transformers  # noqa: F401
        except ImportError as e:
            print(f"hf_llama.py: needs transformers and safetensors ({e}); "
                  "pip install -e '.[test]' installs both", file=sys.stderr)
            return 2
        return launch(args)
    return worker(args)


if __name__ == "__main__":
    sys.exit(main())
