"""Fault-tolerant HSDP on torchft: replica groups that lose a machine and keep training.

Each replica group shards the model over its own ranks (``fully_shard`` on a 1-D mesh of the group); the replicate
reduction across groups goes through a ``torchft.Manager``: an all-reduce over the groups in this step's quorum,
averaged over the participants. A group that dies is dropped from the quorum while the others go on; when it comes
back it receives, rank by rank, the sharded state of its peer rank in a healthy group (this rank's DTensor shards of
the parameters and optimizer state, never a full copy) through torchft's checkpoint transport, without touching disk.
torchft itself is optional (``pip install fully-shard[ft]``): this module imports it only for type checking. See
docs/fault-tolerance.md.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    import torchft

__all__ = ["FaultTolerantHSDP", "sharded_state_dict", "load_sharded_state_dict"]


class FaultTolerantHSDP:
    """One replica group's side of fault-tolerant HSDP: its model and optimizer joined to a ``torchft.Manager``.

    At construction every FSDP module of ``model`` (fully_shard's or torch's) gets an all-reduce hook that runs the
    cross-group reduction through ``manager.allreduce`` (each reduce-scatter output, summed over the groups in the
    quorum and divided by their number), and the manager gets this rank's sharded state to send to, or load from, the
    same rank of another group (key ``"fully_shard"``; register anything else, e.g. the LR scheduler, with
    ``manager.register_state_dict_fn``). Build the manager with ``use_async_quorum=False``: the quorum, and a live
    recovery, then complete in :meth:`start_step`, while nothing else touches the model.

    Each step: :meth:`start_step`, forward and backward, then step the optimizer (and scheduler) only if
    :meth:`should_commit` says so. A step that is not committed is simply run again: same data, same parameters.
    ``group``: this replica group's process group (default: the default one), for the check in :meth:`should_commit`.

    Example::

        >>> sharded = [fully_shard(m) for m in (*model.layers, model)]  # each block, then the root
        >>> optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        >>> import torchft
        >>> replica_id, steps, batch = 0, 2, lambda step: tokens  # this group's index; the data of each step
        >>> manager = torchft.Manager(pg=torchft.ProcessGroupGloo(), min_replica_size=1, load_state_dict=None,
        ...                           state_dict=None, replica_id=f"train_{replica_id}", use_async_quorum=False)
        >>> ft = FaultTolerantHSDP(manager, model, optimizer)
        >>> while manager.current_step() < steps:
        ...     ft.start_step()
        ...     model(batch(manager.current_step())).sum().backward()
        ...     if ft.should_commit():
        ...         optimizer.step()
        ...     optimizer.zero_grad()
        >>> manager.current_step(), manager.num_participants()  # two steps committed, one replica group in the quorum
        (2, 1)
        >>> manager.shutdown(wait=False)
    """

    def __init__(self, manager: torchft.Manager, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 group: dist.ProcessGroup | None = None) -> None:
        self.manager, self.model, self.optimizer, self.group = manager, model, optimizer, group
        fsdp_modules = [m for m in model.modules() if callable(getattr(m, "set_all_reduce_hook", None))]
        if not fsdp_modules:
            raise ValueError(f"FaultTolerantHSDP: {type(model).__name__} has no FSDP module: call fully_shard (on a "
                             "1-D mesh over this replica group's ranks) on its blocks and on the model first")
        for name, p in model.named_parameters():
            if isinstance(p, DTensor) and p.device_mesh.ndim > 1 and p.placements[0].is_replicate():
                raise ValueError(f"FaultTolerantHSDP: parameter '{name}' is on a {p.device_mesh.ndim}-D mesh: the "
                                 "replicate dimension is torchft's, so shard each group over a 1-D mesh of its own "
                                 "ranks")
        hook = _all_reduce_hook(manager)
        for m in fsdp_modules:
            cast(Any, m).set_all_reduce_hook(hook)
        manager.register_state_dict_fn("fully_shard", lambda sd: load_sharded_state_dict(model, optimizer, sd),
                                       lambda: sharded_state_dict(model, optimizer))

    def start_step(self, *, shrink_only: bool = False, timeout: float | None = None) -> None:
        """Join this step's quorum; a group that is behind receives its state here. ``shrink_only``: a quorum without
        groups that were not in the last one (torchft's option; they wait). ``timeout``: seconds the quorum may take
        (default: the manager's quorum timeout). Raises ``RuntimeError`` naming the Lighthouse when no quorum could be
        formed in time."""
        try:
            self.manager.start_quorum(shrink_only=shrink_only,
                                      timeout=None if timeout is None else timedelta(seconds=timeout))
        except Exception as e:
            raise RuntimeError(f"fully_shard.tools.ft: no quorum for step {self.manager.current_step() + 1}: the "
                               "torchft Lighthouse (or this group's manager, on its rank 0) did not answer in time "
                               f"({type(e).__name__}: {e}); is the Lighthouse running, and TORCHFT_LIGHTHOUSE (or "
                               "lighthouse_addr) its address?") from e

    def should_commit(self) -> bool:
        """Whether every rank of this group and the quorum finished the step; step the optimizer only if so.

        When not, the ranks of the group are also checked to agree on the step: torchft recovers rank by rank, so a
        recovery that failed on some ranks only leaves a group with two states, which raises ``RuntimeError`` (restart
        the group: it recovers from a healthy one)."""
        try:
            ok = bool(self.manager.should_commit())
        except RuntimeError as e:  # the group's manager is gone, or max_retries failed steps in a row
            raise RuntimeError(f"fully_shard.tools.ft: the commit of step {self.manager.current_step() + 1} failed: "
                               f"{e} (this group's manager, on its rank 0, is gone, or the manager's max_retries "
                               "steps failed in a row)") from e
        if not ok:
            steps = torch.tensor([self.manager.current_step(), -self.manager.current_step()], dtype=torch.int64)
            dist.all_reduce(steps, op=dist.ReduceOp.MAX, group=self.group)
            if int(steps[0]) != -int(steps[1]):
                error = self.manager.errored()  # torchft's wrapper: the exception and its traceback
                cause = getattr(error, "original_exception", error)
                raise RuntimeError(
                    f"fully_shard.tools.ft: the ranks of this replica group disagree on the step ({-int(steps[1])} to "
                    f"{int(steps[0])}) after a live recovery failed on some of them (here: {cause!r}); restart the "
                    "group: it recovers from a healthy one")
        return ok


def _all_reduce_hook(manager: torchft.Manager) -> Callable[[torch.Tensor], None]:
    def hook(output: torch.Tensor) -> None:
        # sum over the participants, then divide by their number; a failure is reported to the manager (no commit)
        manager.allreduce(output).wait()

    return hook


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _names(model: torch.nn.Module) -> dict[torch.Tensor, str]:
    return {p: n for n, p in model.named_parameters()}


def sharded_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """This rank's part of the training state, as plain tensors: each parameter's local shard, each buffer, and the
    optimizer's state (DTensor entries by their local shard) and hyperparameters, keyed by parameter name. What a
    recovering rank receives from its peer (no copies: the tensors are the live ones; call between steps).

    Example::

        >>> sharded = [fully_shard(m) for m in (*model.layers, model)]  # each block, then the root
        >>> optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        >>> model(tokens).sum().backward(); optimizer.step()
        >>> state = sharded_state_dict(model, optimizer)
        >>> sorted(state), state["model"]["output.weight"].shape  # this rank's shard: all 32 rows on one rank
        (['model', 'optim'], torch.Size([32, 16]))
    """
    with torch.no_grad():
        tensors = {n: _local(t).detach() for n, t in [*model.named_parameters(), *model.named_buffers()]}
        out: dict[str, Any] = {"model": tensors}
        if optimizer is not None:
            names = _names(model)
            state: dict[str, dict[str, Any]] = {}
            dtensors: dict[str, list[str]] = {}
            for group in optimizer.param_groups:
                for p in group["params"]:
                    entry = optimizer.state.get(p)
                    if entry:
                        state[names[p]] = {k: _local(v).detach() if isinstance(v, torch.Tensor) else v
                                           for k, v in entry.items()}
                        dtensors[names[p]] = [k for k, v in entry.items() if isinstance(v, DTensor)]
            groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
            out["optim"] = {"state": state, "dtensors": dtensors, "param_groups": groups}
    return out


def _copy_into(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(f"fully_shard.tools.ft: the state received for {what} is {tuple(src.shape)} {src.dtype}, this "
                         f"rank holds {tuple(dst.shape)} {dst.dtype}: every replica group must build the same model "
                         "and shard it over the same number of ranks")
    dst.copy_(src)


def load_sharded_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                            state: dict[str, Any]) -> None:
    """Copy a :func:`sharded_state_dict` of the same rank of another replica group into ``model`` and ``optimizer``,
    in place (an optimizer state this rank does not have yet is created, DTensors laid out like their parameters).

    Example::

        >>> sharded = [fully_shard(m) for m in (*model.layers, model)]  # each block, then the root
        >>> optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        >>> state_from_peer = sharded_state_dict(model, optimizer)  # in a run: sent by the same rank of a healthy group
        >>> load_sharded_state_dict(model, optimizer, state_from_peer)
    """
    own = dict([*model.named_parameters(), *model.named_buffers()])
    if set(own) != set(state["model"]):
        diff = sorted(set(own) ^ set(state["model"]))
        raise ValueError("fully_shard.tools.ft: the state received names other tensors than this model's "
                         f"({diff[:3]}): every replica group must build the same model")
    with torch.no_grad():
        for name, t in own.items():
            _copy_into(_local(t), state["model"][name].to(_local(t).device), f"'{name}'")
        if optimizer is None:
            return
        saved = state["optim"]
        names = _names(model)
        for group, hyper in zip(optimizer.param_groups, saved["param_groups"]):
            group.update(hyper)
            for p in group["params"]:
                name = names[p]
                entry = optimizer.state[p]
                if name not in saved["state"]:
                    entry.clear()
                    continue
                for k, v in saved["state"][name].items():
                    cur = entry.get(k)
                    if not isinstance(v, torch.Tensor):
                        entry[k] = v
                    elif isinstance(cur, torch.Tensor) and isinstance(cur, DTensor) == (k in saved["dtensors"][name]):
                        _copy_into(_local(cur), v.to(_local(cur).device), f"'{name}' (optimizer state {k!r})")
                    elif k in saved["dtensors"][name]:
                        assert isinstance(p, DTensor)
                        entry[k] = DTensor.from_local(v.to(p.to_local().device, copy=True), p.device_mesh, p.placements,
                                                      run_check=False, shape=p.shape, stride=p.stride())
                    else:
                        entry[k] = v.to(p.device, copy=True)
