"""One optimizer object for the usual Muon recipe: hidden matrices to Muon, the rest to AdamW."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn

from .muon import _EPS, _NS_COEFFICIENTS, _NS_STEPS, Muon

__all__ = ["MuonAdamW", "muon_param_groups"]

# last name components of output layers that stay with AdamW
_HEAD_NAMES = ("output", "lm_head", "head", "classifier", "score")


def muon_param_groups(
    model: nn.Module, *, exclude: Callable[[str, torch.Tensor], bool] | None = None
) -> list[dict[str, Any]]:
    """Split ``model``'s trainable parameters the usual way for :class:`MuonAdamW`.

    Muon gets the hidden matrices: 2-D parameters and 3-D expert stacks ``(E, M, N)``. AdamW
    gets everything else: 1-D parameters (norms, biases), embeddings (parameters of
    ``nn.Embedding``), the output layer (a module named ``output``, ``lm_head``, ``head``,
    ``classifier`` or ``score``), other shapes, and whatever ``exclude(name, param)`` picks.
    Returns two named param groups, ``{"params": [...], "use_muon": True}`` and the AdamW one
    (``"use_muon": False``); an empty group is left out.

    Example::

        >>> groups = muon_param_groups(model)
        >>> [len(g["params"]) for g in groups]  # matrices (7 per block), then the rest
        [14, 7]
        >>> opt = MuonAdamW(groups, lr=0.02, adamw_lr=3e-4)
    """
    adamw_ids: set[int] = set()
    for module_name, module in model.named_modules():
        if isinstance(module, nn.Embedding) or module_name.rsplit(".", 1)[-1] in _HEAD_NAMES:
            adamw_ids.update(id(p) for p in module.parameters())
    muon: list[tuple[str, nn.Parameter]] = []
    adamw: list[tuple[str, nn.Parameter]] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        to_muon = p.dim() in (2, 3) and id(p) not in adamw_ids and not (exclude is not None and exclude(name, p))
        (muon if to_muon else adamw).append((name, p))
    groups = [{"params": muon, "use_muon": True}, {"params": adamw, "use_muon": False}]
    return [g for g in groups if g["params"]]


class MuonAdamW(Muon):
    """:class:`Muon` for the groups marked ``use_muon=True``, ``torch.optim.AdamW`` for the
    others, in one optimizer object (one ``step()``, one ``state_dict()``, one checkpoint).

    Build the groups with :func:`muon_param_groups`, or by hand: every group needs
    ``"use_muon"``. Muon options are the keyword arguments shared with :class:`Muon`; AdamW
    groups get ``adamw_lr``, ``adamw_betas``, ``adamw_eps`` and ``adamw_weight_decay`` unless the
    group sets ``lr``/``betas``/``eps``/``weight_decay`` itself. The AdamW groups run
    ``torch.optim.AdamW``'s own step on the shared groups and state, so they match it exactly.

    Example::

        >>> sharded = [fully_shard(m) for m in (*model.layers, model)]  # each block, then the root
        >>> opt = MuonAdamW(muon_param_groups(model), lr=0.02, adamw_lr=3e-4)
        >>> x, y = batches[0]
        >>> loss_fn(model(x), y).backward()
        >>> opt.step()
        >>> opt.zero_grad()
    """

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        lr: float = 0.02,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = _NS_COEFFICIENTS,
        eps: float = _EPS,
        ns_steps: int = _NS_STEPS,
        adjust_lr_fn: str | None = None,
        *,
        adamw_lr: float = 3e-4,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.01,
        batched: bool = True,
    ) -> None:
        groups = list(params)
        if not all(isinstance(g, dict) for g in groups):
            raise ValueError(
                "MuonAdamW takes param groups (dicts with a 'use_muon' key), not bare parameters; "
                "build them with fully_shard.optim.muon_param_groups(model)"
            )
        # every AdamW option (amsgrad, foreach, ...) at AdamW's own defaults, ours for these four
        probe = torch.zeros(1, requires_grad=True)
        self._adamw_defaults = torch.optim.AdamW(
            [probe], lr=adamw_lr, betas=adamw_betas, eps=adamw_eps, weight_decay=adamw_weight_decay
        ).defaults
        self._adamw: torch.optim.AdamW | None = None  # made at the first step, on our groups
        super().__init__(
            groups,
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=ns_coefficients,
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
            batched=batched,
        )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; it needs ``"use_muon"`` (AdamW groups get the AdamW defaults)."""
        if "use_muon" not in param_group:
            raise ValueError(
                "MuonAdamW takes param groups with a 'use_muon' key; build them with "
                "fully_shard.optim.muon_param_groups(model)"
            )
        if not param_group["use_muon"]:
            for key, value in self._adamw_defaults.items():
                param_group.setdefault(key, value)
        super().add_param_group(param_group)

    def _is_muon_group(self, group: dict[str, Any]) -> bool:
        return bool(group["use_muon"])

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Perform one optimization step: Muon groups, then AdamW groups."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        super().step()
        adamw_groups = [g for g in self.param_groups if not g["use_muon"]]
        if adamw_groups:
            if self._adamw is None:
                self._adamw = torch.optim.AdamW(adamw_groups)
            # load_state_dict() replaces our groups and state: point AdamW at the current ones
            self._adamw.param_groups = adamw_groups
            self._adamw.state = self.state
            self._adamw.step()
        return loss
