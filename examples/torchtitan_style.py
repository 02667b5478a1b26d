"""The torchtitan path: a torchtitan-style ``parallelize`` for torch's FSDP2, run on fully_shard.

torchtitan (PyTorch's reference LLM trainer) applies data parallelism in its
``parallelize_llama(model, ...)`` with torch's FSDP2: activation checkpointing first
(``checkpoint_wrapper`` around each block), then ``fully_shard`` on the token embeddings,
on each transformer block, on ``[norm, output]`` together, and last on the root, with a
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` and, optionally,
``CPUOffloadPolicy()``, on the ``dp_shard`` (FSDP) or ``(dp_replicate, dp_shard)``
(HSDP) dimensions of its world mesh. ``parallelize`` below is written that way, with the
model layout torchtitan's llama3 uses (blocks in an ``nn.ModuleDict`` keyed ``"0"``,
``"1"``, ...). The only change from a recipe for torch's FSDP2 is the import line marked
``FSDP_IMPORT``: swap it back and the same file runs torch's FSDP2.

    python3 examples/torchtitan_style.py                 # fully_shard, 2 CPU processes
    python3 examples/torchtitan_style.py --fsdp torch    # the same file with torch's import

``--fsdp torch`` loads this file again with the import line replaced (see ``load_recipe``),
which is how ``tests/test_recipes.py`` checks that both give the same losses, step by step.

Why an imitation: the examples depend on torch alone, and torchtitan is a large, fast-moving
dependency (with CPU workarounds of its own). torchtitan's own llama3 model,
``parallelize_llama`` and ``ChunkedLossWrapper`` run on fully_shard too: docs/recipes.md,
"torchtitan's own model and parallelize_llama on fully_shard", shows that flow, and
``tests/test_torchtitan.py`` runs it against torch's FSDP2.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import types

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# FSDP_IMPORT: the one line that differs from a recipe for torch's FSDP2, whose line is
#   from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from fully_shard import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

EXAMPLES = os.path.dirname(os.path.abspath(__file__))
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)
from model import ModelArgs, RMSNorm, TransformerBlock, precompute_freqs_cis  # noqa: E402

IMPORTS = {
    "fully_shard": "from fully_shard import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard",
    "torch": "from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard",
}


# -- the model: torchtitan's llama3 layout ---------------------------------------------


class Transformer(nn.Module):
    """A Llama-style decoder laid out as torchtitan's: ``tok_embeddings``, ``layers`` (an
    ``nn.ModuleDict`` keyed by the layer index, so that pipeline stages can drop blocks and
    keep the names), ``norm`` and ``output``, each of which may be None on a pipeline stage.
    The blocks are examples/model.py's."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.model_args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.register_buffer("freqs_cis", self._precompute_freqs_cis(), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)

    def _precompute_freqs_cis(self) -> torch.Tensor:
        args = self.model_args
        return precompute_freqs_cis(args.dim // args.n_heads, args.max_seq_len, args.rope_theta)

    def init_weights(self) -> None:
        with torch.device(self.freqs_cis.device):
            self.freqs_cis = self._precompute_freqs_cis()
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            std = self.model_args.dim**-0.5
            nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        freqs_cis = self.freqs_cis[: h.shape[1]]
        for layer in self.layers.values():
            h = layer(h, freqs_cis)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


# -- parallelize: as a torchtitan recipe for torch's FSDP2 writes it -------------------


def parallelize(
    model: Transformer,
    world_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype = torch.bfloat16,
    reduce_dtype: torch.dtype = torch.float32,
    ac_mode: str = "none",
    reshard_after_forward_policy: str = "default",
    cpu_offload: bool = False,
    pp_enabled: bool = False,
) -> Transformer:
    """Activation checkpointing, then FSDP (or HSDP when ``world_mesh`` has a
    ``dp_replicate`` dimension) on ``world_mesh``'s data-parallel dimensions."""
    if ac_mode != "none":
        apply_ac(model, ac_mode)
    names = ("dp_replicate", "dp_shard") if "dp_replicate" in (world_mesh.mesh_dim_names or ()) else ("dp_shard",)
    dp_mesh = world_mesh[names]
    apply_fsdp(
        model,
        dp_mesh,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        pp_enabled=pp_enabled,
        cpu_offload=cpu_offload,
        reshard_after_forward_policy=reshard_after_forward_policy,
    )
    return model


def apply_ac(model: Transformer, ac_mode: str) -> None:
    """Full activation checkpointing: each block recomputes its forward in backward."""
    if ac_mode != "full":
        raise ValueError(f"unsupported activation checkpointing mode {ac_mode!r} (none, full)")
    for layer_id, block in model.layers.named_children():
        model.layers.register_module(layer_id, checkpoint_wrapper(block, preserve_rng_state=False))


def apply_fsdp(
    model: Transformer,
    dp_mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    pp_enabled: bool,
    cpu_offload: bool = False,
    reshard_after_forward_policy: str = "default",
) -> None:
    """FSDP2 on ``dp_mesh``: one group for the embeddings, one per block, one for the final
    norm and output projection together, and the root (which then owns no parameters).

    ``reshard_after_forward_policy``: "always", "never", or "default" (reshard unless
    pipelining, where each microbatch would gather again); the last group ([norm, output])
    only reshards with "always": backward needs it first."""
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    fsdp_config = {"mesh": dp_mesh, "mp_policy": mp_policy}
    if cpu_offload:
        fsdp_config["offload_policy"] = CPUOffloadPolicy()

    if reshard_after_forward_policy == "always":
        reshard_after_forward = True
    elif reshard_after_forward_policy == "never":
        reshard_after_forward = False
    elif reshard_after_forward_policy == "default":
        reshard_after_forward = not pp_enabled
    else:
        raise ValueError(f"invalid reshard_after_forward_policy: {reshard_after_forward_policy!r}")

    if model.tok_embeddings is not None:
        fully_shard(model.tok_embeddings, **fsdp_config, reshard_after_forward=reshard_after_forward)
    for block in model.layers.values():
        fully_shard(block, **fsdp_config, reshard_after_forward=reshard_after_forward)
    if model.norm is not None and model.output is not None:
        fully_shard([model.norm, model.output], **fsdp_config,
                    reshard_after_forward=reshard_after_forward_policy == "always")
    fully_shard(model, **fsdp_config)


# -- a training run ----------------------------------------------------------------------


def build_world_mesh(dp_replicate: int = 1) -> DeviceMesh:
    """The world mesh on CPU: ``("dp_shard",)``, or ``("dp_replicate", "dp_shard")`` for HSDP."""
    import torch.distributed as dist

    world_size = dist.get_world_size()
    if dp_replicate == 1:
        return init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    return init_device_mesh("cpu", (dp_replicate, world_size // dp_replicate),
                            mesh_dim_names=("dp_replicate", "dp_shard"))


def train(
    steps: int = 5,
    *,
    dp_replicate: int = 1,
    dim: int = 64,
    n_layers: int = 2,
    n_heads: int = 4,
    seq_len: int = 32,
    batch_size: int = 4,
    lr: float = 3e-3,
    warmup_steps: int = 2,
    seed: int = 0,
    **parallelize_kwargs: object,
) -> list[float]:
    """Build, parallelize and train on byte-level tokens of the Python standard library's
    sources (examples/train.py's data); returns the loss of each step (this rank's, before
    the optimizer step). Needs an initialised default process group."""
    import torch.distributed as dist
    from common import load_corpus

    rank = dist.get_rank()
    corpus = load_corpus(None, max_mb=0.25)
    world_mesh = build_world_mesh(dp_replicate)
    torch.manual_seed(seed)
    model = Transformer(ModelArgs(dim=dim, n_layers=n_layers, n_heads=n_heads, vocab_size=256, max_seq_len=seq_len))
    model.init_weights()
    parallelize(model, world_mesh, **parallelize_kwargs)  # type: ignore[arg-type]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (warmup_steps + 1)))

    losses = []
    for step in range(1, steps + 1):
        g = torch.Generator().manual_seed(seed * 1_000_003 + step * 65_537 + rank)  # each rank its own data
        starts = torch.randint(0, len(corpus) - seq_len - 1, (batch_size,), generator=g).tolist()
        tokens = torch.stack([corpus[s : s + seq_len + 1] for s in starts])
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        pred = model(inputs)
        loss = F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


# -- swapping the import --------------------------------------------------------------


def load_recipe(fsdp: str) -> types.ModuleType:
    """This file as a new module whose ``FSDP_IMPORT`` line imports ``fsdp``'s FSDP2:
    "fully_shard" (this file as it is) or "torch" (torch.distributed.fsdp). Nothing else
    changes: the model, ``parallelize`` and ``train`` are the same source."""
    if fsdp not in IMPORTS:
        raise ValueError(f"fsdp must be one of {sorted(IMPORTS)}, got {fsdp!r}")
    path = os.path.abspath(__file__)
    with open(path, encoding="utf-8") as f:
        source = f.read()
    lines = source.splitlines(keepends=True)
    (index,) = [i for i, line in enumerate(lines) if line.rstrip("\n") == IMPORTS["fully_shard"]]
    lines[index] = IMPORTS[fsdp] + "\n"
    name = f"torchtitan_style_{fsdp}"
    spec = importlib.util.spec_from_loader(name, loader=None, origin=path)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    module.__file__ = path
    sys.modules[name] = module  # so that pickling, dataclasses and the like find it
    exec(compile("".join(lines), path, "exec"), module.__dict__)
    return module


# -- command line ---------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--fsdp", choices=sorted(IMPORTS), default="fully_shard",
                        help="whose fully_shard the FSDP_IMPORT line imports")
    parser.add_argument("--nproc", type=int, default=2, help="processes (ignored under torchrun)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dp-replicate", type=int, default=1, help="HSDP replicas (must divide the world size)")
    parser.add_argument("--mixed-precision-param", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--ac", choices=("none", "full"), default="none", help="activation checkpointing")
    parser.add_argument("--reshard-after-forward", choices=("default", "always", "never"), default="default")
    args = parser.parse_args()
    if args.nproc < 1 or args.steps < 1 or args.dp_replicate < 1:
        parser.error("--nproc, --steps and --dp-replicate must be positive")
    world = int(os.environ.get("WORLD_SIZE", args.nproc))
    if world % args.dp_replicate != 0:
        parser.error(f"--dp-replicate {args.dp_replicate} must divide the world size ({world})")

    if "LOCAL_RANK" not in os.environ:
        from common import launch_script

        argv = [f"--fsdp={args.fsdp}", f"--steps={args.steps}", f"--dp-replicate={args.dp_replicate}",
                f"--mixed-precision-param={args.mixed_precision_param}", f"--ac={args.ac}",
                f"--reshard-after-forward={args.reshard_after_forward}"]
        return launch_script(os.path.abspath(__file__), args.nproc, argv)

    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        recipe = load_recipe(args.fsdp)
        losses = recipe.train(
            args.steps, dp_replicate=args.dp_replicate,
            param_dtype=getattr(torch, args.mixed_precision_param), reduce_dtype=torch.float32,
            ac_mode=args.ac, reshard_after_forward_policy=args.reshard_after_forward,
        )
        if dist.get_rank() == 0:
            print(f"{args.fsdp}'s fully_shard via {recipe.fully_shard.__module__}: losses (rank 0) "
                  + " ".join(f"{x:.4f}" for x in losses), flush=True)
    finally:
        dist.destroy_process_group()
    from common import leave_worker

    leave_worker(0)  # gloo: no interpreter shutdown after collectives (see common.py)
    return 0


if __name__ == "__main__":
    sys.exit(main())
