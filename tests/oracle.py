"""The unsharded oracle's optimizer, stepped in the sharded layout.

A sharded run steps each rank's dim-0 chunk of a parameter as a tensor of its own; the
unsharded reference steps the whole parameter. Optimizers are elementwise, so the values are
the same, but not always the bits: CPU kernels run a vectorised body and a scalar tail
(``lerp_``, ``addcmul_`` may fuse differently in each), and an element that starts rank 1's
shard sits at another position of the vector loop in the whole tensor. Which elements differ
depends on the CPU's vector width and the build.

:class:`ShardwiseOptimizer` removes that difference by construction: it keeps the reference's
parameters as the same chunks (``torch.chunk`` over the world size, the layout fully_shard
uses) and steps those, so every element goes through the same code in both runs on any
machine. Together with a gradient average that is exact (a sum of two floats does not depend
on the order, and dividing by 2 is exact), a world-size-2 run is then bitwise equal to the
reference.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

__all__ = ["ShardwiseOptimizer"]


class ShardwiseOptimizer:
    """``make_optimizer`` over the dim-0 chunks of ``params`` as ``world_size`` ranks hold
    them (``keep_whole``: parameters every rank keeps whole); ``step()`` copies the
    gradients in and the updated chunks back.

    Example::

        >>> ref_opt = ShardwiseOptimizer(ref.parameters(), 2, lambda ps: torch.optim.AdamW(ps, lr=1e-2))
        >>> loss.backward(); ref_opt.step(); ref_opt.zero_grad()
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        world_size: int,
        make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
        keep_whole: Iterable[torch.nn.Parameter] = (),
    ) -> None:
        whole = set(keep_whole)  # e.g. ignored_params: every rank steps them whole
        self.splits: dict[torch.nn.Parameter, int] = {}
        self.chunks: dict[torch.nn.Parameter, list[torch.Tensor]] = {}
        for p in params:
            self.splits[p] = 1 if p in whole else world_size
            self.chunks[p] = [
                c.detach().clone().requires_grad_(p.requires_grad) for c in torch.chunk(p.detach(), self.splits[p])
            ]
        self.optimizer = make_optimizer([c for cs in self.chunks.values() for c in cs])

    def step(self) -> None:
        for p, chunks in self.chunks.items():
            grads = [None] * len(chunks) if p.grad is None else torch.chunk(p.grad, self.splits[p])
            for c, g in zip(chunks, grads):
                c.grad = None if g is None else g.clone()
        self.optimizer.step()
        with torch.no_grad():
            for p, chunks in self.chunks.items():
                p.copy_(torch.cat(chunks))

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()
        for p in self.chunks:
            p.grad = None

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups
