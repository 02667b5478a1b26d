"""The benchmarks' model configurations (the model itself: ``support/llama.py``)."""

from __future__ import annotations

from support.llama import LLAMA3_8B, LLAMA3_70B, LLAMA3_405B, LlamaArgs

SIM_MODELS: dict[str, LlamaArgs] = {"llama3-8b": LLAMA3_8B, "llama3-70b": LLAMA3_70B, "llama3-405b": LLAMA3_405B}

# Step-time models, small enough for 2 CPU ranks. Uneven on purpose: the vocabulary and
# ffn_dim are not multiples of 2, so some parameters are padded in the flat buffers.
BENCH_SMALL = LlamaArgs(dim=192, n_layers=4, n_heads=6, n_kv_heads=3, ffn_dim=513, vocab_size=2001, max_seq_len=64)
# Many small blocks, tiny batch: the per-module hook and bookkeeping cost dominates.
BENCH_OVERHEAD = LlamaArgs(dim=32, n_layers=32, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=64, max_seq_len=8)
# --quick: a tiny model.
BENCH_TINY = LlamaArgs(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=48, vocab_size=67, max_seq_len=16)
