"""A Llama-style decoder and the Llama 3 shape presets the memory planner knows by name.

The model is an ordinary ``nn.Module`` (it trains as written); the planner only ever builds
it under ``torch.device("meta")``, so even the 405B preset costs no memory::

    >>> with torch.device("meta"):
    ...     model = Llama(PRESETS["llama3-8b"])
    >>> sum(p.numel() for p in model.parameters())
    8030261248
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["LlamaArgs", "Llama", "PRESETS", "preset"]


@dataclass(frozen=True)
class LlamaArgs:
    """Shapes of a Llama-style decoder (grouped-query attention, SwiGLU, untied output)."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_dim: int
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0


# Llama 3 / 3.1 shapes (the published configs; ffn_dim from ffn_dim_multiplier and multiple_of)
PRESETS: dict[str, LlamaArgs] = {
    "llama3-8b": LlamaArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=14336),
    "llama3-70b": LlamaArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256, ffn_dim=28672),
    "llama3-405b": LlamaArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256, ffn_dim=53248),
}


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding of ``x`` (B, T, H, D), computed on the fly (no buffer)."""
    t, d = x.shape[1], x.shape[-1]
    freqs = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angles = torch.outer(torch.arange(t, device=x.device, dtype=torch.float32), freqs)  # (T, D/2)
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = args.n_heads, args.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.rope_theta = args.rope_theta
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = _rope(self.wq(x).view(b, t, -1, self.head_dim), self.rope_theta)
        k = _rope(self.wk(x).view(b, t, -1, self.head_dim), self.rope_theta)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        q, k, v = (y.transpose(1, 2) for y in (q, k, v))  # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        out: torch.Tensor = self.wo(y.transpose(1, 2).reshape(b, t, -1))
        return out


class FeedForward(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return out


class TransformerBlock(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        out: torch.Tensor = x + self.feed_forward(self.ffn_norm(x))
        return out


class Llama(nn.Module):
    """Embedding, ``layers`` (an ``nn.ModuleList`` of blocks), final norm, untied output."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)  # (B, T, C)
        for layer in self.layers:
            h = layer(h)
        logits: torch.Tensor = self.output(self.norm(h))  # (B, T, V)
        return logits


def preset(name: str) -> Llama:
    """A Llama of the named preset shape (``"llama3-8b"``, ``"llama3-70b"``, ``"llama3-405b"``),
    on the current default device: build it under ``torch.device("meta")``."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    return Llama(PRESETS[name])


def args_from_hf_config(path: str) -> LlamaArgs:
    """The shapes of a Hugging Face Llama-family ``config.json`` (``hidden_size``,
    ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``,
    ``intermediate_size``, ``vocab_size``), read with ``json``: no ``transformers`` needed.

    Example::

        >>> with torch.device("meta"):
        ...     model = Llama(args_from_hf_config("Llama-3.1-8B/config.json"))
    """
    import json

    with open(path) as f:
        cfg = json.load(f)
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [k for k in keys if k not in cfg]
    if missing:
        raise ValueError(f"{path}: not a Llama-style Hugging Face config.json (no {', '.join(missing)})")
    if cfg.get("tie_word_embeddings"):
        raise ValueError(f"{path}: tie_word_embeddings is true; the planner's Llama has an untied output "
                         "(pass your own constructor as MODULE:CONSTRUCTOR instead)")
    return LlamaArgs(dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"], n_heads=cfg["num_attention_heads"],
                     n_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
                     vocab_size=cfg["vocab_size"], ffn_dim=cfg["intermediate_size"],
                     norm_eps=cfg.get("rms_norm_eps", 1e-5), rope_theta=cfg.get("rope_theta", 500000.0))


def llama3_8b() -> Llama:
    return preset("llama3-8b")


def llama3_70b() -> Llama:
    return preset("llama3-70b")


def llama3_405b() -> Llama:
    return preset("llama3-405b")
