"""Quantized collectives: fewer bytes on the wire for the parameter all-gather and the gradient reduce-scatter.

Not core: objects of torch's own Comm API (``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``), so
they work on fully_shard and on torch's FSDP2 alike, and one function that sets them on a whole model::

    >>> from fully_shard.quant import quantize_comms
    >>> sharded = [fully_shard(m) for m in (*model.layers, model)]  # each block, then the root
    >>> comms = quantize_comms(model, weights="int8", grads="int8")  # embeddings and norms stay exact

Block-quantized (an fp32 scale per ``block_size`` values, round half to even: a rerun gives the same bits), with
fp32 accumulation of the gradients and no state kept between steps. The arithmetic and its error bounds are in
``fully_shard.quant.blocks``. See docs/quantized_comms.md.
"""

from .blocks import reduce_bound, roundtrip_bound
from .comms import ErrorRecord, ModuleComms, QuantAllGather, QuantReduceScatter, default_skip, quantize_comms

__all__ = [
    "quantize_comms", "default_skip", "ModuleComms", "QuantAllGather", "QuantReduceScatter", "ErrorRecord",
    "roundtrip_bound", "reduce_bound",
]
