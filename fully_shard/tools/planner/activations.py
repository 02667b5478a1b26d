"""Activation memory of a Llama-style decoder: the tensors autograd saves for backward.

The memory planner (``api.py``) adds these to its measured step when given a batch size and
a sequence length. The count is per decoder block (one child of the ``layers``
``nn.ModuleList``) and for the rest of the model (embedding, final norm, loss), for the
eager modules of ``transformers``' Llama family (Llama, Mistral, Qwen2, ...) with an SDPA
or flash attention kernel (no ``T x T`` matrix is kept) and no dropout. With ``B`` the
batch size, ``T`` the sequence length, ``h`` the hidden size, ``f`` the MLP's
intermediate size, ``a`` / ``g`` the query / key-value heads of ``d`` elements, ``V`` the
vocabulary and ``s`` the bytes of an element in the compute dtype, one block saves:

* each of its two RMSNorms: the input upcast to fp32 (``4BTh``), the normalised input
  (``sBTh``), its output, which the projections after it save (``sBTh``), and the fp32
  reciprocal RMS (``4BT``);
* attention: the rotated queries (``sBTh``), keys and values (``2sBTgd``), the attention
  output (``sBTh``, which ``o_proj`` saves as a view) and the fp32 log-sum-exp of the
  kernel (``4BaT``);
* the gated MLP: ``gate_proj`` and ``up_proj``'s outputs, ``silu(gate)`` and their
  product (``4sBTf``).

The rest of the model: the token ids (``8BT``, saved by the embedding), the final norm
(as above), the fp32 log-softmax of the logits in the loss (``4BTV``), the shifted labels
(``8BT``) and the rotary ``cos``/``sin`` (``2sTd``, shared by every block). With
activation checkpointing each block keeps only its input (``sBTh``) and rebuilds the rest
during its own backward.

Example::

    >>> from fully_shard.tools import load_model
    >>> model, _ = load_model("llama3-8b")
    >>> estimate_activations(model, 1, 8192, torch.bfloat16).block_bytes / 2**30
    1.53...
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

__all__ = ["ActivationEstimate", "estimate_activations", "decoder_layers"]


@dataclass
class ActivationEstimate:
    """Bytes saved for backward by one decoder block and by the rest of the model."""

    block_bytes: int  # one block, everything it saves (what a recompute rebuilds under AC)
    block_input_bytes: int  # one block's input: all it keeps under activation checkpointing
    rest_bytes: int  # embedding, final norm, loss, rotary cos/sin
    layers: list[str]  # the blocks' module names, in order


def decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The transformer blocks: the children of every ``nn.ModuleList`` named ``layers``.

    Example::

        >>> from fully_shard.tools import load_model
        >>> [n for n, _ in decoder_layers(load_model("llama3-8b")[0])][:2]
        ['model.layers.0', 'model.layers.1']
    """
    out: list[tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and name.rpartition(".")[2] == "layers":
            out.extend((f"{name}.{child_name}", child) for child_name, child in m.named_children())
    return out


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def estimate_activations(model: nn.Module, batch_size: int, seq_len: int,
                         compute_dtype: torch.dtype) -> ActivationEstimate:
    """What autograd saves for backward in one forward of ``model`` (a ``transformers``
    Llama-family causal LM, with its ``config``) on ``batch_size`` sequences of ``seq_len``
    tokens, computing in ``compute_dtype``; see the module docstring for what is counted.

    Example::

        >>> from fully_shard.tools import load_model
        >>> est = estimate_activations(load_model("llama3-8b")[0], 1, 8192, torch.bfloat16)
        >>> est.block_bytes, est.block_input_bytes, est.rest_bytes
        (1645281280, 67108864, 4475486208)
    """
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be positive, got {batch_size} and {seq_len}")
    cfg = getattr(model, "config", None)
    needed = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
    if cfg is None or not all(isinstance(getattr(cfg, k, None), int) for k in needed):
        raise ValueError(
            f"activations are estimated for transformers' Llama-family models (a config with "
            f"{', '.join(needed)}); {type(model).__name__} has none: leave batch_size and seq_len "
            "out and add activations yourself"
        )
    layers = decoder_layers(model)
    mlp = getattr(layers[0][1], "mlp", None) if layers else None
    if mlp is None or not all(hasattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj")):
        raise ValueError(
            f"activations are estimated for Llama-style blocks (a 'layers' ModuleList of blocks "
            f"with a gated MLP: mlp.gate_proj/up_proj/down_proj); {type(model).__name__} has "
            "none: leave batch_size and seq_len out and add activations yourself"
        )
    h, f, a, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.vocab_size
    g = getattr(cfg, "num_key_value_heads", None) or a
    d = getattr(cfg, "head_dim", None) or h // a
    s = _itemsize(compute_dtype)
    bt = batch_size * seq_len
    norm = bt * h * (4 + 2 * s) + 4 * bt
    attention = s * (2 * bt * a * d + 2 * bt * g * d) + 4 * bt * a
    block = 2 * norm + attention + 4 * s * bt * f
    rest = 8 * bt + norm + 4 * bt * V + 8 * bt + 2 * s * seq_len * d
    return ActivationEstimate(block_bytes=block, block_input_bytes=s * bt * h, rest_bytes=rest,
                              layers=[n for n, _ in layers])
