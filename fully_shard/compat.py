"""What fully_shard knows of torch pieces that differ between torch versions or that other torch APIs share with
torch's FSDP2, in one place: feature checks, never version-number comparisons.

- torch's composable-API registry (``torch.distributed._composable.contract``): torch's FSDP2 records ``fully_shard``
  in it on each module it shards, and torch's ``replicate`` leaves the parameters of such modules to it (and refuses
  to replicate such a module). fully_shard records itself the same way, so that ``replicate`` around a model with
  fully_shard modules averages only the rest. The registry's key is made when torch loads that module (importing
  fully_shard loads it, through ``torch.distributed.checkpoint``); it is read from ``sys.modules``, never imported.
- ``replicate``'s state: the parameters it averages (its DistributedDataParallel over a ParameterList), for the
  first-forward check of a model whose own parameters nobody shards (``tools/checks.py``).
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from typing import Any

import torch.nn as nn

_CONTRACT = "torch.distributed._composable.contract"


def _contract() -> Any:
    """torch's composable-API contract module where torch has loaded it, else None."""
    return sys.modules.get(_CONTRACT)


def _registry(module: nn.Module) -> dict[str, Any] | None:
    contract = _contract()
    return None if contract is None else module.__dict__.get(contract.REGISTRY_KEY)


def mark_fully_sharded(module: nn.Module) -> None:
    """Record ``module`` as sharded by ``fully_shard`` in torch's composable-API registry, as torch's FSDP2 does:
    torch's ``replicate`` then leaves its parameters (all of them, nested ones too) to fully_shard."""
    contract = _contract()
    if contract is None:  # nothing of torch's composable APIs is loaded: no replicate to tell
        return
    registry = module.__dict__.setdefault(contract.REGISTRY_KEY, OrderedDict())
    registry.setdefault("fully_shard", contract.RegistryItem())


def replicated_params(module: nn.Module) -> list[nn.Parameter]:
    """The parameters torch's ``replicate`` (applied to ``module`` itself) averages across ranks, once its first
    forward has set it up; [] where ``module`` is not replicated."""
    registry, contract = _registry(module), _contract()
    if registry is None or "replicate" not in registry:
        return []
    states = module.__dict__.get(contract.STATE_KEY, {})
    return [p for state in states.values() for p in getattr(state, "_param_list", ())]
