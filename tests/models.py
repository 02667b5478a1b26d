"""Small models for tests: a Llama-style transformer with deliberately uneven shapes."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.harness import device


@dataclass
class ModelArgs:
    vocab_size: int = 67
    dim: int = 100
    n_layers: int = 3
    n_heads: int = 4
    ffn_dim: int = 150
    max_seq_len: int = 16


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape  # (B, T, C)
        # heads from the projection's width: under tensor parallelism each rank has some of them
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, C/H)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Llama-style; ``logit_scale`` has dim 0 of size 1, smaller than any world size > 1."""

    def __init__(self, args: ModelArgs | None = None) -> None:
        super().__init__()
        args = args or ModelArgs()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.register_buffer("pos", torch.linspace(0, 1, args.max_seq_len).unsqueeze(-1), persistent=False)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.logit_scale = nn.Parameter(torch.ones(1))

    def reset_parameters(self) -> None:
        """The root's own tensors (children reset themselves)."""
        nn.init.ones_(self.logit_scale)
        self.pos.copy_(torch.linspace(0, 1, self.args.max_seq_len).unsqueeze(-1))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) + self.pos[: tokens.shape[1]]  # (B, T, C)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h)) * self.logit_scale  # (B, T, V)


def loss_fn(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def batch(step: int, rank: int, args: ModelArgs | None = None, batch_size: int = 2) -> torch.Tensor:
    """Different tokens per rank and step, the same on every run."""
    args = args or ModelArgs()
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, args.vocab_size, (batch_size, args.max_seq_len), generator=g, device="cpu").to(device())
