"""Muon over sharded parameters: each matrix orthogonalized once, on its owner rank."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .owned import MatrixLayout, _Plan, _stacks, matrix_layout, newton_schulz_flops

__all__ = ["Muon", "newton_schulz"]

# Keller Jordan's quintic coefficients, the same defaults as torch.optim.Muon
_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
_NS_STEPS = 5
_EPS = 1e-7


def newton_schulz(
    stack: torch.Tensor,
    coefficients: tuple[float, float, float] = _NS_COEFFICIENTS,
    steps: int = _NS_STEPS,
    eps: float = _EPS,
    *,
    batched: bool = True,
) -> torch.Tensor:
    """Orthogonalize each matrix of a ``(B, M, N)`` stack with ``steps`` quintic Newton-Schulz
    iterations in bfloat16, as ``torch.optim.Muon`` does to one matrix; returns bfloat16.

    ``batched=True`` runs one ``bmm`` chain over the stack; ``batched=False`` loops over the
    matrices with the very operations ``torch.optim.Muon`` applies to one matrix (``addmm``),
    so its result equals torch's bit for bit by construction. On the CPUs we measured both
    agree bit for bit (see tests/test_muon.py).

    Example::

        >>> ortho = newton_schulz(torch.randn(4, 64, 32))
        >>> ortho.shape, ortho.dtype
        (torch.Size([4, 64, 32]), torch.bfloat16)
    """
    a, b, c = coefficients
    tall = stack.size(-2) > stack.size(-1)
    if not batched:
        return (torch.stack([_newton_schulz_one(m, a, b, c, steps, eps) for m in stack]) if len(stack)
                else stack.bfloat16())
    x = stack.to(torch.bfloat16, copy=True)  # (B, M, N), contiguous like torch's grad.bfloat16()
    if tall:
        x = x.mT  # iterate on the wide orientation: the Gram matrix is the smaller one
    x.div_(torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps))  # spectral norm <= 1
    for _ in range(steps):
        gram = torch.bmm(x, x.mT)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b*A + c*A@A
        x = torch.baddbmm(x, poly, x, beta=a)  # a*X + (b*A + c*A@A) @ X
    return x.mT if tall else x


def _newton_schulz_one(m: torch.Tensor, a: float, b: float, c: float, steps: int, eps: float) -> torch.Tensor:
    x = m.to(torch.bfloat16, copy=True)
    tall = m.size(0) > m.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def _adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: tuple[int, ...]) -> float:
    rows, cols = shape[-2:]  # per matrix: an expert stack (E, M, N) scales like one (M, N)
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * (0.2 * math.sqrt(max(rows, cols)))
    return lr


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class Muon(torch.optim.Optimizer):
    """``torch.optim.Muon`` for the sharded parameters of ``fully_shard``: same constructor,
    same update, each matrix orthogonalized once, on one rank.

    The momentum update, weight decay and parameter update are elementwise, so every rank
    does them on its own rows. Newton-Schulz needs whole matrices: each 2-D parameter
    sharded on dim 0 gets an owner rank (balancing Newton-Schulz FLOPs); one all-to-all
    per bucket sends the rows of every momentum update to the owners (in bfloat16, the dtype
    Newton-Schulz starts with), each owner orthogonalizes its matrices batched by shape, and
    one all-to-all sends each rank its rows of the result. A bucket is all parameters of a
    param group sharded over the same process group (so HSDP, expert and FSDP meshes each
    get theirs). Since the owner runs the same operations on the same whole matrix, the
    result equals ``torch.optim.Muon`` on the unsharded model, given the same gradients
    (bit for bit on the CPUs we measured; by construction, with ``batched=False``, it equals
    torch's step done on each rank's rows: see docs/optimizers.md, "Exactness").

    No communication: plain tensors, replicated DTensors, one-rank meshes, and 3-D expert
    weights ``(E, M, N)`` sharded on dim 0 (each rank holds whole experts), which are
    orthogonalized per expert over the last two dims (``torch.optim.Muon`` rejects 3-D).

    The momentum buffer is created like the gradient: a DTensor sharded like its parameter,
    so ``get_optimizer_state_dict`` and DCP save, load and reshard it.

    Every rank of a shard group must call ``step()`` with gradients on the same parameters
    (as ``fully_shard`` guarantees). Parameters may be passed with names
    (``model.named_parameters()``), which error messages then use.

    Args:
        params: parameters or named parameters or param groups: 2-D matrices, or 3-D stacks of
            expert matrices. Everything else belongs to AdamW (see :class:`MuonAdamW`).
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn:
            as ``torch.optim.Muon`` (same defaults).
        batched: run Newton-Schulz as one ``bmm`` chain per shape (default) or with
            torch's per-matrix ``addmm`` operations (see :func:`newton_schulz`).

    Example::

        >>> sharded = [fully_shard(m) for m in (*model.layers, model)]  # each block, then the root
        >>> matrices = [(n, p) for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n]
        >>> opt = Muon(matrices, lr=0.02, momentum=0.95)
        >>> x, y = batches[0]
        >>> loss_fn(model(x), y).backward()
        >>> opt.step()
        >>> opt.zero_grad()
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = _NS_COEFFICIENTS,
        eps: float = _EPS,
        ns_steps: int = _NS_STEPS,
        adjust_lr_fn: str | None = None,
        *,
        batched: bool = True,
    ) -> None:
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not 0.0 <= lr:
            raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
        if not 0.0 <= momentum:
            raise ValueError(f"momentum should be >= 0 but is: {momentum}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"weight decay should be >= 0 but is: {weight_decay}")
        self.batched = batched
        self._layouts: dict[torch.Tensor, MatrixLayout] = {}
        # per set of parameters with gradients: the exchange plan, and positions by shape
        self._plans: dict[tuple[int, ...], tuple[_Plan, dict[tuple[int, ...], list[int]]]] = {}
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=ns_coefficients,
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
        )
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (see ``torch.optim.Optimizer``); its matrices are checked here."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if self._is_muon_group(group):
            _check_group_options(group)
            for i, p in enumerate(group["params"]):
                self._layout(p, self._name(group, i, p))

    def _is_muon_group(self, group: dict[str, Any]) -> bool:
        return True

    def _name(self, group: dict[str, Any], i: int, p: torch.Tensor) -> str:
        if "param_names" in group:
            return str(group["param_names"][i])
        index = next(g for g, other in enumerate(self.param_groups) if other is group)
        return f"param_groups[{index}]['params'][{i}] of shape {tuple(p.shape)}"

    def _layout(self, p: torch.Tensor, name: str) -> MatrixLayout:
        layout = self._layouts.get(p)
        if layout is None:
            if p.dim() not in (2, 3):
                raise ValueError(
                    f"Muon only supports 2D parameters (and 3-D expert stacks) whereas parameter {name!r} "
                    f"has size {tuple(p.shape)}; optimize it with AdamW (fully_shard.optim.MuonAdamW and "
                    "muon_param_groups(model) split a model that way)"
                )
            if torch.is_complex(p):
                raise RuntimeError(f"Muon does not support complex parameters: {name!r} is {p.dtype}")
            layout = self._layouts[p] = matrix_layout(p, name)
        return layout

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Perform one optimization step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if self._is_muon_group(group):
                self._muon_group(group)
        return loss

    def _muon_group(self, group: dict[str, Any]) -> None:
        _check_group_options(group)
        lr = group["lr"].item() if isinstance(group["lr"], torch.Tensor) else group["lr"]
        momentum, steps = group["momentum"], group["ns_steps"]
        params, locals_, grads, bufs = [], [], [], []
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"Muon does not support sparse gradients: parameter {self._name(group, i, p)!r} has "
                                   "one")
            if p not in self._layouts:
                self._layout(p, self._name(group, i, p))
            grad, local = _local(p.grad), _local(p)
            if grad.shape != local.shape:
                raise ValueError(
                    f"Muon: the gradient of {self._name(group, i, p)!r} is laid out as {tuple(grad.shape)} on this "
                    f"rank but the parameter as {tuple(local.shape)}; give gradients the parameter's placements"
                )
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            params.append(p)
            locals_.append(local)
            grads.append(grad)
            bufs.append(_local(state["momentum_buffer"]))
        if not params:
            return
        # where every matrix travels depends only on which parameters have gradients: planned once
        key = tuple(map(id, params))
        if key not in self._plans:
            layouts = [self._layouts[p] for p in params]
            cost = partial(newton_schulz_flops, steps=steps)
            self._plans[key] = (_Plan(layouts, [g.shape for g in grads], cost), _stacks([lay.shape for lay in layouts]))
        plan, by_shape = self._plans[key]
        # 1. on the rows, as torch.optim.Muon's per-tensor calls (on CPU a foreach op runs the
        # same per-tensor kernel on each tensor in turn: the same bits, fewer Python calls)
        torch._foreach_lerp_(bufs, grads, 1 - momentum)
        updates = torch._foreach_lerp(grads, bufs, momentum) if group["nesterov"] else bufs
        # 2-4. Newton-Schulz starts by casting to bfloat16: cast while packing the send buffers
        exchange = plan.start([torch.bfloat16] * len(params), [torch.bfloat16] * len(params), grads[0].device)
        torch._foreach_copy_(exchange.inputs, updates)
        for stack, result in exchange.run():
            result.copy_(newton_schulz(stack, group["ns_coefficients"], steps, group["eps"], batched=self.batched))
        # 5. weight decay and the update, from the receive buffers straight into the rows
        torch._foreach_mul_(locals_, 1 - lr * group["weight_decay"])
        for shape, pos in by_shape.items():  # the adjusted learning rate depends on the shape
            alpha = -_adjusted_lr(lr, group["adjust_lr_fn"], shape)
            torch._foreach_add_([locals_[j] for j in pos], [exchange.outputs[j] for j in pos], alpha=alpha)


def _check_group_options(group: dict[str, Any]) -> None:
    if group["ns_steps"] >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if len(group["ns_coefficients"]) != 3:
        raise ValueError("Coefficients must be a tuple of exactly 3 values")
    if group["adjust_lr_fn"] not in (None, "original", "match_rms_adamw"):
        raise ValueError(f"Adjust learning rate function {group['adjust_lr_fn']} is not supported")
