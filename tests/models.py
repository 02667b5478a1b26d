"""The tests' model: the shared Llama (``support/llama.py``) at small, uneven shapes.

``ModelArgs`` holds the test shapes: dim 100 over 4 heads, ffn 150, vocab 67, so that dim-0
chunks are padded at world sizes 2 and 4. ``Transformer`` adds two things the tests need to
the shared ``Llama``: a non-persistent buffer (``pos``) and a parameter whose dim 0
(size 1) is smaller than any world size > 1 (``logit_scale``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from support.llama import Attention, Block, FeedForward, Llama, LlamaArgs, RMSNorm, loss_fn, tokens
from tests.harness import device

__all__ = ["Attention", "Block", "FeedForward", "ModelArgs", "RMSNorm", "Transformer", "batch", "loss_fn"]


@dataclass(frozen=True)
class ModelArgs(LlamaArgs):
    """``LlamaArgs`` with the test defaults; ``n_kv_heads`` follows ``n_heads`` unless given."""

    dim: int = 100
    n_layers: int = 3
    n_heads: int = 4
    n_kv_heads: int = None  # type: ignore[assignment]  # None: n_heads (no grouped-query attention)
    ffn_dim: int = 150
    vocab_size: int = 67
    max_seq_len: int = 16

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)


class Transformer(Llama):
    """Llama-style; ``logit_scale`` has dim 0 of size 1, smaller than any world size > 1."""

    def __init__(self, args: ModelArgs | None = None) -> None:
        # drawn by the CPU generator, then moved to the default device (the harness's accelerator, under the switch):
        # the same initial parameters on every device, so a test's CPU-tuned magnitudes hold there too (meta: as is)
        target = torch.get_default_device()
        with torch.device("cpu" if target.type != "meta" else target):
            super().__init__(args or ModelArgs())
            self.register_buffer("pos", self._positions(), persistent=False)
            self.logit_scale = nn.Parameter(torch.ones(1))
        self.to(target)

    def _positions(self) -> torch.Tensor:
        return torch.linspace(0, 1, self.args.max_seq_len).unsqueeze(-1)  # (T, 1)

    def reset_parameters(self) -> None:
        """The root's own tensors (children reset themselves)."""
        nn.init.ones_(self.logit_scale)
        self.pos.copy_(self._positions())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) + self.pos[: tokens.shape[1]]  # (B, T, C)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h)) * self.logit_scale  # (B, T, V)


def batch(step: int, rank: int, args: LlamaArgs | None = None, batch_size: int = 2) -> torch.Tensor:
    """Different tokens per rank and step, the same on every run (``support.llama.tokens``)."""
    args = args or ModelArgs()
    return tokens(step, rank, args, batch_size, args.max_seq_len).to(device())
