"""Wrap policies: apply fully_shard bottom-up from a rule, then to the root."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch.nn as nn

from ..api import fully_shard

__all__ = ["apply_fully_shard"]

# warn when the root's own group holds more than this share of the parameters
ROOT_SHARE_WARNING = 0.5


def apply_fully_shard(
    model: nn.Module,
    *,
    module_classes: Iterable[type[nn.Module]] | None = None,
    min_num_params: int | None = None,
    policy: Callable[[nn.Module], bool] | None = None,
    **fully_shard_kwargs: Any,
) -> nn.Module:
    """Call ``fully_shard`` bottom-up on the modules a policy picks, then on ``model``.

    A module is picked if it is an instance of one of ``module_classes`` (accelerate's
    ``TRANSFORMER_BASED_WRAP``: e.g. ``{LlamaDecoderLayer}``), or if the parameters no
    picked descendant already owns number at least ``min_num_params`` (``SIZE_BASED_WRAP``),
    or if ``policy(module)`` is true. Containers without ``forward`` (``nn.ModuleList``,
    ``nn.ModuleDict``) are never picked. Warns when the root's own group ends up with more
    than half of the parameters (all-gathered for the whole step, never freed).

    Example::

        >>> apply_fully_shard(model, module_classes={TransformerBlock}, mesh=mesh)
        FSDPTransformer(...)
        >>> isinstance(model.layers[0], FSDPModule)
        True
    """
    if module_classes is None and min_num_params is None and policy is None:
        raise ValueError("apply_fully_shard needs module_classes, min_num_params or policy")
    classes = tuple(module_classes or ())

    def picked(module: nn.Module, unowned: int) -> bool:
        if module is model or isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            return False
        return (
            (bool(classes) and isinstance(module, classes))
            or (min_num_params is not None and unowned >= min_num_params)
            or (policy is not None and policy(module))
        )

    seen: set[int] = set()

    def visit(module: nn.Module) -> int:
        """Shard picked modules below ``module`` (post-order); return its unowned numel."""
        unowned = 0
        for child in module.children():
            if id(child) not in seen:
                seen.add(id(child))
                unowned += visit(child)
        unowned += sum(p.numel() for p in module.parameters(recurse=False))
        if picked(module, unowned):
            fully_shard(module, **fully_shard_kwargs)
            return 0
        return unowned

    root_share = visit(model)
    total = sum(p.numel() for p in model.parameters())
    fully_shard(model, **fully_shard_kwargs)
    if total and root_share / total > ROOT_SHARE_WARNING:
        warnings.warn(
            f"apply_fully_shard: the root's own group holds {root_share:,} of {total:,} parameters "
            f"({root_share / total:.0%}); they stay all-gathered from the root's forward to the end "
            "of backward. Pick smaller modules (module_classes or a lower min_num_params).",
            stacklevel=2,
        )
    return model
