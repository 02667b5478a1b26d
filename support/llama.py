"""The Llama-style model that the tests and the benchmarks train, and the published Llama 3 shapes.

``Llama`` is a Llama-3 shaped decoder: token embedding, ``n_layers`` blocks of RMSNorm ->
grouped-query attention (``n_kv_heads`` key/value heads) -> RMSNorm -> SwiGLU feed-forward,
a final RMSNorm and an untied output projection. There is no rotary embedding (it has no
parameters, so it changes neither the sharding nor the communication). The parameter
shapes of ``LLAMA3_8B`` / ``LLAMA3_70B`` / ``LLAMA3_405B`` are those of the published
Llama 3 / 3.1 models (405B: 405.9e9 parameters here, the published count).

``tests/models.py`` adds the tests' small, uneven default shapes, a buffer and a one-element
parameter; the benchmarks' configurations are ``benchmarks/models.py``; ``examples/model.py``
is a separate, torchtitan-style model on purpose (rotary embeddings, ``init_weights``), so
that the recipe reads on its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class LlamaArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    max_seq_len: int = 128

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


# Published Llama 3 shapes (https://github.com/meta-llama/llama-models, params.json).
LLAMA32_3B = LlamaArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192, vocab_size=128256)
LLAMA3_8B = LlamaArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256)
LLAMA3_70B = LlamaArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab_size=128256)
LLAMA3_405B = LlamaArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248, vocab_size=128256)

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape  # (B, T, C)
        # heads from the projection's width: under tensor parallelism each rank has some of them
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])  # (B, H, T, D)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def loss_fn(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, in fp32 at least (bf16 logits are upcast, fp64 stay)."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).to(dtype), tokens[:, 1:].flatten())


def tokens(step: int, rank: int, args: LlamaArgs, batch_size: int, seq_len: int) -> torch.Tensor:
    """Different tokens per rank and step, the same in every run and for every library."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    # CPU draws: the same tokens on any device
    return torch.randint(0, args.vocab_size, (batch_size, seq_len), generator=g, device="cpu")


def param_count(args: LlamaArgs) -> int:
    """Exact parameter count of ``Llama(args)`` without building it."""
    d, kv = args.dim, args.n_kv_heads * args.head_dim
    attn = d * (args.n_heads * args.head_dim) * 2 + d * kv * 2
    block = attn + 3 * d * args.ffn_dim + 2 * d
    return args.n_layers * block + 2 * args.vocab_size * d + d


# -- sharding it: with fully_shard or with torch's FSDP2, the reference ----------------------------------------

FSDP_IMPLS = ("fully_shard", "torch_fsdp2")


def fsdp_api(impl: str) -> tuple[Callable[..., Any], type]:
    """``(fully_shard, MixedPrecisionPolicy)`` of ``impl``: ours, or torch's FSDP2."""
    if impl == "fully_shard":
        from fully_shard import MixedPrecisionPolicy, fully_shard
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # type: ignore[assignment]
    return fully_shard, MixedPrecisionPolicy


def shard_model(model: Llama, impl: str, mesh: Any, reshard: bool, mp: str) -> Llama:
    """fully_shard each block (``reshard_after_forward=reshard``), then the root (default)."""
    fully_shard, MP = fsdp_api(impl)
    policy = MP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mp == "bf16" else MP()
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model
