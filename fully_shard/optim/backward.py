"""``in_backward``: step an optimizer inside backward, one parameter at a time.

A parameter's optimizer steps from its post-accumulate-grad hook, which fully_shard (as torch's FSDP2) runs once the
parameter's reduced, sharded gradient is in ``.grad``; the hook then frees that gradient. So no step holds every
gradient at once: gradient memory is one group's reduction instead of the whole model's. See docs/recipes.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

__all__ = ["InBackward", "in_backward"]

OptimizerT = TypeVar("OptimizerT", bound=torch.optim.Optimizer)


class InBackward(dict[nn.Parameter, OptimizerT]):
    """The optimizers ``in_backward`` made, by parameter, and the hooks that step them.

    A parameter's hook holds its optimizer, which holds the parameter: Python's garbage collector cannot free that
    cycle (a tensor's hooks are not traversed; plain torch's post-accumulate-grad hooks leak the same way), so the
    model lives as long as the hooks do. ``remove()`` takes the hooks off: backward then leaves the gradients in
    ``.grad`` and the model and its optimizers can be freed.
    """

    def __init__(self) -> None:
        super().__init__()
        self._handles: list[RemovableHandle] = []

    def remove(self) -> None:
        """Take every hook off (idempotent); the optimizers keep their state."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def in_backward(
    params: nn.Module | Iterable[nn.Parameter], optimizer: Callable[..., OptimizerT], /, **kwargs: Any
) -> InBackward[OptimizerT]:
    """Give every parameter that requires grad an optimizer of its own, ``optimizer([param], **kwargs)``, stepped from
    the parameter's post-accumulate-grad hook, which then frees the gradient (``zero_grad(set_to_none=True)``). Returns
    the optimizers, by parameter: for LR schedulers (one per optimizer) and checkpoints (``get_state_dict(model,
    list(optimizers.values()))``).

    With fully_shard (or torch's FSDP2) the hook runs once the parameter's gradient has been reduced (reduce-scatter,
    and all-reduce under HSDP): with ``set_requires_gradient_sync(False)`` on all but the last micro-batch, once per
    step. For an elementwise optimizer (AdamW, SGD, ...: each element's update reads only the same element of the
    parameter, gradient and states) the parameters are then bitwise those of ``optimizer.step()`` after backward.
    What needs every gradient before any step cannot run this way: ``clip_grad_norm_`` (the global norm), gradient
    scaling with an inf check over all gradients, an optimizer that reads other parameters. Do not call
    ``step()`` / ``zero_grad()`` yourself; the hooks stay registered until ``remove()`` (and keep the model alive
    until then: see :class:`InBackward`).

    Args:
        params: a module (its ``parameters()``) or parameters.
        optimizer: an optimizer class, or any callable taking a one-parameter list and ``kwargs`` (e.g.
            ``lambda ps, **kw: local_step(torch.optim.AdamW(ps, **kw))``).
        kwargs: passed to ``optimizer``.

    Example::

        >>> fully_shard(model)
        FSDPTransformer(...)
        >>> optimizers = in_backward(model, torch.optim.AdamW, lr=3e-4, weight_decay=0.1)
        >>> schedulers = [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in optimizers.values()]
        >>> for x, y in batches:
        ...     loss_fn(model(x), y).backward()  # each parameter steps as its gradient lands
        ...     for s in schedulers:
        ...         s.step()
        >>> optimizers.remove()  # done: gradients stay in .grad again, and the model can be freed
    """
    module = params if isinstance(params, nn.Module) else None
    found = list(params.parameters() if isinstance(params, nn.Module) else params)
    optimizers: InBackward[OptimizerT] = InBackward()
    for p in found:
        if p.requires_grad and p not in optimizers:
            opt = optimizer([p], **kwargs)
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError("in_backward: optimizer([param]) must return a torch.optim.Optimizer, got "
                                f"{type(opt).__name__}")
            optimizers[p] = opt
            optimizers._handles.append(p.register_post_accumulate_grad_hook(functools.partial(_step, opt)))
    if not optimizers:
        what = f"the module {type(module).__name__} has" if module is not None else "the parameters given have"
        raise ValueError(f"in_backward: {what} no parameter that requires grad ({len(found)} parameters, all frozen "
                         "or none): there is nothing to step")
    return optimizers


def _step(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> None:
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)  # the gradient's memory goes now, not at the end of the step
