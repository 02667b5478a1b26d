"""Convert a sharded DCP checkpoint into one ``torch.save`` or safetensors file.

The counterpart of DeepSpeed's ``zero_to_fp32.py``: it runs on one process, needs no
process group and no GPU, and reads every shard of every tensor from the checkpoint
directory (``dcp.load`` with ``no_dist=True``), whatever world size saved it. It runs no code from the
checkpoint (:class:`~fully_shard.ckpt.SafeFileSystemReader`): a poisoned one is refused with an error
naming the file.

Command line::

    python -m fully_shard.ckpt.convert ckpt/step_1000 model.safetensors
    python -m fully_shard.ckpt.convert ckpt/step_1000 model.pt --key model --dtype bfloat16
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .safe import UnsafeCheckpointError, load_checkpoint, read_metadata

__all__ = ["consolidate", "load_consolidated"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_consolidated(
    checkpoint: str | os.PathLike[str], *, key: str | None = "model", dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """The full (unsharded) tensors under ``key`` in a DCP checkpoint, as plain CPU tensors.

    Args:
        checkpoint: a DCP checkpoint directory (e.g. ``ckpt/step_1000``).
        key: the top-level entry to take (``"model"`` for ``{"model": ..., "optim": ...}``;
            the prefix ``"<key>."`` is stripped from the names), or None for every tensor
            in the checkpoint under its full dotted name.
        dtype: cast floating-point tensors to this dtype (default: as saved).

    Raises:
        UnsafeCheckpointError: the checkpoint names a global outside DCP's metadata classes
            (:class:`~fully_shard.ckpt.SafeFileSystemReader`); nothing from it was run.

    Example::

        >>> from fully_shard.ckpt import save_checkpoint
        >>> fully_shard(model)
        FSDPTransformer(...)
        >>> path = save_checkpoint({"model": model.state_dict()}, "ckpt", 1000)  # sharded: each rank writes its shards
        >>> sd = load_consolidated(path)  # {"layers.0.attention.wq.weight": ..., ...}: full tensors
        >>> Transformer(args).load_state_dict(sd)  # an unsharded model of the same shapes
        <All keys matched successfully>
    """
    path = os.fspath(checkpoint)
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise FileNotFoundError(
            f"{path!r} is not a complete DCP checkpoint (no .metadata): pass a step directory such as "
            "ckpt/step_1000, e.g. fully_shard.ckpt.latest_checkpoint('ckpt')"
        )
    metadata = read_metadata(os.path.join(path, ".metadata")).state_dict_metadata  # allowlisted: runs no code
    prefix = "" if key is None else key + "."
    state = {
        name: torch.empty(md.size, dtype=md.properties.dtype)
        for name, md in metadata.items()
        if isinstance(md, TensorStorageMetadata) and name.startswith(prefix)
    }
    if not state:
        tops = sorted({name.split(".")[0] for name in metadata})
        raise KeyError(f"{path!r} has no tensors under {key!r}: its top-level keys are {tops}; pass one as key")
    with warnings.catch_warnings():  # one process on purpose: DCP's "assuming ... single process" note
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load_checkpoint(state, path, no_dist=True)
    out = {}
    for name, tensor in state.items():
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        out[name[len(prefix) :]] = tensor
    return out


def consolidate(
    checkpoint: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    key: str | None = "model",
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Write the full tensors under ``key`` of a DCP checkpoint to one file: safetensors
    when ``output`` ends in ``.safetensors`` (needs the ``safetensors`` package), else
    ``torch.save``. Returns the state dict it wrote. See :func:`load_consolidated`.

    Example::

        >>> from fully_shard.ckpt import save_checkpoint
        >>> path = save_checkpoint({"model": model.state_dict()}, "ckpt", 1000)
        >>> sd = consolidate(path, "model.safetensors", dtype=torch.bfloat16)
        >>> sd["output.weight"].dtype, sd["output.weight"].shape
        (torch.bfloat16, torch.Size([32, 16]))
    """
    state = load_consolidated(checkpoint, key=key, dtype=dtype)
    output = os.fspath(output)
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    if output.endswith(".safetensors"):
        try:
            from safetensors.torch import save_file
        except ImportError as e:
            raise ImportError(
                f"writing {output!r} needs the safetensors package (pip install safetensors), "
                "or name a .pt file to write it with torch.save"
            ) from e
        save_file({k: v.contiguous() for k, v in state.items()}, output)
    else:
        torch.save(state, output)
    return state


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fully_shard.ckpt.convert",
        description="Convert a sharded DCP checkpoint to one torch.save (.pt) or .safetensors file.",
    )
    parser.add_argument("checkpoint", help="a DCP checkpoint directory, e.g. ckpt/step_1000")
    parser.add_argument("output", help="the file to write: NAME.safetensors, or NAME.pt for torch.save")
    parser.add_argument("--key", default="model",
                        help="the top-level entry to export (default: model); '' for every tensor")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                        help="cast floating-point tensors (default: as saved)")
    args = parser.parse_args(argv)
    try:
        state = consolidate(args.checkpoint, args.output, key=args.key or None,
                            dtype=None if args.dtype is None else _DTYPES[args.dtype])
    except (FileNotFoundError, KeyError, ImportError, UnsafeCheckpointError) as e:
        parser.error(str(e))
    total = sum(t.numel() * t.element_size() for t in state.values())
    print(f"wrote {args.output}: {len(state)} tensors, {total:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
