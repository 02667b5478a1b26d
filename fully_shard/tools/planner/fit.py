"""``fit()``: the configuration to train a model with, within a memory budget, by the planner's own runtime.

The search space (``Setting``) is what a training script chooses by hand: the blocks' ``reshard_after_forward``
(True, False, or k ranks when the shard spans nodes), activation checkpointing (none, every other block, every block;
searched when activations are counted), CPU offload (on a device with streams), the all-gather dtype (bf16 only when
``mixed_precision=True``), whether the embedding and the output layer (with the final norm) get their own
``fully_shard`` calls, the reduce-scatter inputs in flight (``set_reduce_scatter_max_input_buffers``) and how many
blocks ahead all-gathers are prefetched.

Each setting's time comes from the step-time model (``cost.py``) on the collectives the planner measured; its peak
from the planner itself. The blocks are identical, so a model of L blocks is planned at two depths of a few blocks
and each row of the memory trace (the rows near the first and the last block: a step's peak is at one end, since
what a block holds grows by the same bytes per block) is extrapolated to L blocks: the same peak a full plan gives.
Settings are visited fastest first; one whose end of forward cannot fit (its sharded state, the unsharded block
parameters and the activations it keeps for backward, counted without a plan) is skipped unplanned; the first that
fits wins, ties in time going to the one using less.
(No setting is pruned for holding "more" than one that did not fit: the peak is not monotone in every option.)
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import checkpoint

from ...api import fully_shard
from ...policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ...streams import accelerator_type, has_streams
from .activations import ActivationEstimate, decoder_layers, estimate_activations
from .api import OPTIMIZERS, plan
from .cost import PROFILES, DeviceProfile, GroupCost, step_time
from .models import load_model
from .report import Plan, fmt_bytes

__all__ = ["Setting", "Recipe", "fit", "parse_bytes", "search_space"]

CHECKPOINTING = ("none", "selective", "full")  # selective: every other block, from the first
_DEPTH = 4  # blocks of the smaller of the two plans a deeper model's peak is extrapolated from


@dataclass(frozen=True)
class Setting:
    """One configuration of the search: every ``fully_shard`` option and setting ``fit()`` chooses.

    Example::

        >>> Setting(reshard_after_forward=False, param_dtype=torch.bfloat16).describe()
        'reshard_after_forward=False, bf16, root in one group'
    """

    reshard_after_forward: bool | int = True  # the blocks' (and the embedding's, in its own group)
    checkpointing: str = "none"  # CHECKPOINTING
    offload: bool = False  # CPUOffloadPolicy on every call
    param_dtype: torch.dtype | None = None  # all-gather/compute dtype; reductions in fp32 when set
    root_groups: bool = False  # the embedding, and the final norm with the output layer, in calls of their own
    max_input_buffers: int = 1  # reduce-scatter inputs in flight
    prefetch: int = 1  # blocks ahead whose all-gather is issued

    def describe(self) -> str:
        parts = [f"reshard_after_forward={self.reshard_after_forward}"]
        parts += [f"{self.checkpointing} AC"] if self.checkpointing != "none" else []
        parts += ["CPU offload"] if self.offload else []
        parts += [str(self.param_dtype).replace("torch.bfloat16", "bf16").replace("torch.", "")] \
            if self.param_dtype is not None else []
        parts.append("embedding and output in own groups" if self.root_groups else "root in one group")
        parts += [f"{self.max_input_buffers} reduce-scatter buffers"] if self.max_input_buffers > 1 else []
        parts += [f"prefetch {self.prefetch}"] if self.prefetch > 1 else []
        return ", ".join(parts)

    def checkpointed(self, blocks: int) -> list[int]:
        """The indices of the checkpointed blocks."""
        step = {"none": 0, "selective": 2, "full": 1}[self.checkpointing]
        return list(range(0, blocks, step)) if step else []

    def shard(self, model: nn.Module, mesh: DeviceMesh) -> None:
        """Make this setting's ``fully_shard`` calls (bottom-up), checkpointing and settings on ``model``."""
        blocks = [m for _, m in decoder_layers(model)]
        mp = MixedPrecisionPolicy(param_dtype=self.param_dtype,
                                  reduce_dtype=torch.float32 if self.param_dtype is not None else None)
        options: dict[str, Any] = {"mesh": mesh, "mp_policy": mp,
                                   "offload_policy": CPUOffloadPolicy() if self.offload else OffloadPolicy()}
        for i in self.checkpointed(len(blocks)):
            _checkpoint(blocks[i])
        if self.root_groups:
            embedding, head = root_parts(model)
            fully_shard(embedding, reshard_after_forward=self.reshard_after_forward, **options)
        for block in blocks:
            fully_shard(block, reshard_after_forward=self.reshard_after_forward, **options)
        if self.root_groups:
            fully_shard(head, reshard_after_forward=False, **options)  # its backward comes first: keep it
        fully_shard(model, **options)
        model.set_reduce_scatter_max_input_buffers(self.max_input_buffers)  # type: ignore[operator]
        if self.prefetch > 1:
            for i, block in enumerate(blocks):
                block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + self.prefetch])  # type: ignore[operator]
                block.set_modules_to_backward_prefetch(blocks[max(0, i - self.prefetch):i][::-1])  # type: ignore


def _checkpoint(block: nn.Module) -> None:
    """Recompute ``block``'s forward in its backward (names and state-dict keys unchanged)."""
    inner = block.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    block.forward = forward


def root_parts(model: nn.Module) -> tuple[nn.Module, list[nn.Module]]:
    """The embedding and [the final norm..., the output layer] of a model of blocks: the modules outside the blocks
    that own parameters, the first an ``nn.Embedding``."""
    inside = {id(m) for _, b in decoder_layers(model) for m in b.modules()}
    own = [m for m in model.modules() if id(m) not in inside and m is not model
           and any(True for _ in m.parameters(recurse=False))]
    if len(own) < 2 or not isinstance(own[0], nn.Embedding):
        raise ValueError(f"{type(model).__name__}: the root's parameters are not an embedding then an output layer; "
                         "search with root_groups=False")
    return own[0], own[1:]


def search_space(world: int, *, blocks: int, activations: bool, streams: bool, mixed_precision: bool,
                 ranks_per_node: int, root_groups: bool = True) -> list[Setting]:
    """Every setting ``fit()`` considers.

    Example::

        >>> len(search_space(64, blocks=32, activations=True, streams=True, mixed_precision=True, ranks_per_node=8))
        288
    """
    reshard: list[bool | int] = [True, False] + ([ranks_per_node] if world > ranks_per_node else [])
    return [Setting(*values) for values in itertools.product(
        reshard, CHECKPOINTING if activations else ("none",), (False, True) if streams else (False,),
        (None, torch.bfloat16) if mixed_precision else (None,), (False, True) if root_groups else (False,),
        (1, 2), (1, 2) if blocks > 2 else (1,))]


def _at_least(a: Setting, b: Setting) -> bool:
    """Whether ``a`` holds at least what ``b`` does: the same but for options that only add memory."""
    order = {True: 0, False: 2}
    raf = [order.get(s.reshard_after_forward, 1) if isinstance(s.reshard_after_forward, bool) else 1 for s in (a, b)]
    return (raf[0] >= raf[1] and CHECKPOINTING.index(a.checkpointing) <= CHECKPOINTING.index(b.checkpointing)
            and a.offload <= b.offload and a.max_input_buffers >= b.max_input_buffers and a.prefetch >= b.prefetch
            and a.param_dtype == b.param_dtype and a.root_groups == b.root_groups)


_BYTES = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(text: str | int) -> int:
    """``"80GiB"``, ``"24 GB"``, ``"512MiB"`` or a number of bytes.

    Example::

        >>> parse_bytes("80GiB"), parse_bytes("1.5 GB")
        (85899345920, 1500000000)
    """
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
    if m is None or m.group(2).upper() not in _BYTES:
        raise ValueError(f"a memory budget is a number and a unit (80GiB, 24GB, 512MiB), got {text!r}")
    return int(float(m.group(1)) * _BYTES[m.group(2).upper()])


@dataclass
class Estimate:
    """One setting, planned: its peak (extrapolated to the model's depth), where, what the step holds then by kind
    (``state, param, grad, optim, act``), and the plan at the smaller depth (collectives per block, root groups)."""

    peak_bytes: int
    peak_at: str
    at_peak: list[int]
    state_bytes: int  # the sharded state on the device (parameters, gradients, optimizer state)
    host_bytes: int
    plan: Plan


def _truncated(model: nn.Module, depth: int) -> nn.Module:
    """``model`` with its first ``depth`` blocks (a copy; meta tensors)."""
    out = copy.deepcopy(model)
    for name, m in out.named_modules():
        if isinstance(m, nn.ModuleList) and name.rpartition(".")[2] == "layers":
            for key in list(m._modules)[depth:]:
                del m._modules[key]
    return out


_BLOCK = re.compile(r"layers\.(\d+)")


def _rows(p: Plan, blocks: int) -> dict[tuple[str, int, int], list[int]]:
    """The memory trace's rows by a key that names the same moment at any depth: the last labelled place (a block
    counted from the first or from the last block), its occurrence, and the rows after it."""
    out: dict[tuple[str, int, int], list[int]] = {}
    seen: dict[str, int] = {}
    place, offset = "start", 0

    def canonical(m: re.Match[str]) -> str:
        j = int(m.group(1))
        return f"layers.<first+{j}>" if j < blocks // 2 else f"layers.<last-{blocks - 1 - j}>"

    for row in p.memory_trace:
        where = str(row[0])
        if where not in ("forward", "backward"):  # a labelled row (frees are only told by the phase)
            place = _BLOCK.sub(canonical, where)
            seen[place] = seen.get(place, 0) + 1
            offset = 0
        else:
            offset += 1
        out[(place, seen.get(place, 0), offset)] = [int(v) for v in row[1:]]
    return out


def _extrapolate(small: Plan, large: Plan, depth: int, blocks: int) -> tuple[int, str, list[int], int, int]:
    """The peak of ``blocks`` blocks from plans of ``depth`` and ``depth + 2`` (the same parity, so that every other
    block checkpointed ends the same way): each row both traces have, grown by its growth per two blocks."""
    a, b = _rows(small, depth), _rows(large, depth + 2)
    grow = (blocks - depth - 2) // 2
    best: tuple[int, str, list[int]] | None = None
    for key in b.keys() & a.keys():
        row = [vb + grow * (vb - va) for va, vb in zip(a[key], b[key])]
        if best is None or sum(row) > best[0]:
            best = (sum(row), key[0], row)
    assert best is not None
    where = re.sub(r"layers\.<(first|last)[+-](\d+)>",
                   lambda m: f"layers.{int(m.group(2)) if m.group(1) == 'first' else blocks - 1 - int(m.group(2))}",
                   best[1])
    state = large.device_state_bytes + grow * (large.device_state_bytes - small.device_state_bytes)
    host = large.host_bytes + grow * (large.host_bytes - small.host_bytes)
    return best[0], where, best[2], state, host


@dataclass
class Recipe:
    """What ``fit()`` chose, and why: the setting, its planned peak and when, the collective bytes a rank sends per
    step, the FLOPs recomputed, the predicted step time on ``profile``, and the settings using less memory that were
    not chosen (``rejected``: setting, peak, seconds, why). ``apply(model, mesh)`` shards a model so;
    ``to_toml()`` writes examples/train.py's keys.

    Example::

        >>> recipe = fit(lambda: Transformer(args), 2, "100KiB", device_type="cpu", mixed_precision=True)
        >>> recipe.setting.describe()
        'reshard_after_forward=False, bf16, embedding and output in own groups'
        >>> recipe.peak_bytes <= 100 * 2**10, recipe.peak_at
        (True, 'backward: reduce-scatter of layers.0')
    """

    setting: Setting
    model: str
    mesh_shape: tuple[int, ...]
    budget_bytes: int
    peak_bytes: int
    peak_at: str
    state_bytes: int
    host_bytes: int
    send_bytes: int
    recompute_flops: float
    step_seconds: float
    profile: DeviceProfile
    planned: int  # settings planned in the search
    rejected: list[tuple[Setting, int, float, str]] = field(default_factory=list)

    def apply(self, model: nn.Module, mesh: DeviceMesh) -> nn.Module:
        """Shard ``model`` (built, not yet sharded) on ``mesh`` as this recipe says: its ``fully_shard`` calls,
        activation checkpointing, CPU offload and settings. Returns the model.

        Example::

            >>> from fully_shard.tools.planner.run import fake_world
            >>> recipe = fit(lambda: Transformer(args), 2, "1MiB", device_type="cpu")
            >>> with fake_world((2,), rank=0) as mesh:  # in a training script: the job's mesh
            ...     recipe.apply(model, mesh) is model, type(model.layers[0]).__name__
            (True, 'FSDPTransformerBlock')
        """
        if tuple(mesh.shape) != tuple(self.mesh_shape):
            raise ValueError(f"Recipe.apply: the recipe was fitted for a mesh of shape {self.mesh_shape}, this mesh is "
                             f"{tuple(mesh.shape)}: fit again for it")
        self.setting.shard(model, mesh)
        return model

    def to_toml(self) -> str:
        """The ``[parallelism]`` keys of examples/train.py for this recipe; what it has no key for, as comments."""
        s = self.setting
        raf = str(s.reshard_after_forward).lower() if isinstance(s.reshard_after_forward, bool) else "true"
        lines = ["[parallelism]", f'reshard_after_forward = "{raf}"',
                 f'mixed_precision = "{"bf16" if s.param_dtype is not None else "none"}"',
                 f"activation_checkpointing = {'true' if s.checkpointing == 'full' else 'false'}"]
        extra = [f"reshard_after_forward = {s.reshard_after_forward}"] if not isinstance(
            s.reshard_after_forward, bool) else []
        extra += [f"activation checkpointing: {s.checkpointing}"] if s.checkpointing == "selective" else []
        extra += ["CPU offload"] * s.offload + ["embedding and output in own groups"] * s.root_groups
        extra += [f"set_reduce_scatter_max_input_buffers({s.max_input_buffers})"] * (s.max_input_buffers > 1)
        extra += [f"prefetch {s.prefetch} blocks"] * (s.prefetch > 1)
        return "\n".join(lines + [f"# also (no key; Recipe.apply does it): {e}" for e in extra]) + "\n"

    def __str__(self) -> str:
        lines = [f"fit {self.model} on mesh {self.mesh_shape} within {fmt_bytes(self.budget_bytes)} "
                 f"({self.profile.name}):",
                 f"  {self.setting.describe()}",
                 f"  peak {fmt_bytes(self.peak_bytes)} at {self.peak_at}; sharded state {fmt_bytes(self.state_bytes)}"
                 + (f" (+ {fmt_bytes(self.host_bytes)} on the host)" if self.host_bytes else ""),
                 f"  step {self.step_seconds * 1e3:.4g} ms predicted; sends {fmt_bytes(self.send_bytes)} per step; "
                 f"recomputes {self.recompute_flops:.3g} FLOP; {self.planned} settings planned"]
        if self.rejected:
            lines.append("  using less memory, not chosen:")
            lines += [f"    {fmt_bytes(peak):>10}  {sec * 1e3:8.4g} ms  {s.describe()}: {why}"
                      for s, peak, sec, why in self.rejected]
        return "\n".join(lines)


class _Search:
    """The planned settings of one ``fit()`` call (each planned once, at two depths) and their step times."""

    def __init__(self, model: nn.Module, label: str, shape: tuple[int, ...], *, device_type: str, optimizer: str,
                 batch_size: int | None, seq_len: int | None, activations: bool, profile: DeviceProfile) -> None:
        self.model, self.label, self.shape, self.profile = model, label, shape, profile
        self.block_modules = [m for _, m in decoder_layers(model)]
        self.blocks = len(self.block_modules)
        self.depth = _DEPTH + self.blocks % 2  # the smaller depth planned, of the model's parity
        self.exact = self.blocks <= self.depth + 2
        depths = [self.blocks] if self.exact else [self.depth, self.depth + 2]
        self.models = {d: model if d == self.blocks else _truncated(model, d) for d in depths}
        self.options: dict[str, Any] = {"device_type": device_type, "optimizer": optimizer,
                                        "batch_size": batch_size if activations else None,
                                        "seq_len": seq_len if activations else None}
        self.tokens, self.seq_len = (batch_size or 1) * (seq_len or 1), seq_len or 1
        self.cache: dict[Setting, Estimate] = {}
        self.acts: dict[torch.dtype, ActivationEstimate] = {}
        self.memo: dict[Any, Any] = {}  # FLOPs and bytes by module or parameters
        self.plans: dict[tuple[Setting, int], Plan] = {}

    def plan(self, s: Setting, depth: int) -> Plan:
        if (s, depth) not in self.plans:
            names = [n for n, _ in decoder_layers(self.models[depth])]
            ac = [names[i] for i in s.checkpointed(depth)] if self.options["batch_size"] is not None else False
            self.plans[(s, depth)] = plan(self.models[depth], self.shape, shard_fn=s.shard,
                                          activation_checkpointing=ac, **self.options)
        return self.plans[(s, depth)]

    def estimate(self, s: Setting) -> Estimate:
        if s not in self.cache:
            if self.exact:
                p = self.plan(s, self.blocks)
                top = max(p.memory_trace, key=lambda r: sum(r[1:]))
                self.cache[s] = Estimate(p.peak_bytes, p.peak_at, [int(v) for v in top[1:]], p.device_state_bytes,
                                         p.host_bytes, p)
            else:
                small, large = self.plan(s, self.depth), self.plan(s, self.depth + 2)
                self.cache[s] = Estimate(*_extrapolate(small, large, self.depth, self.blocks), small)
        return self.cache[s]

    def group_params(self, s: Setting) -> list[tuple[str, list[nn.Parameter], bool | int, nn.Module | None]]:
        """The step's ``fully_shard`` calls in forward order: name, parameters, reshard_after_forward, and the block
        (None: the root's parts)."""
        key = ("calls", s.root_groups, s.reshard_after_forward)
        if key not in self.memo:
            self.memo[key] = self._calls(s)
        return self.memo[key]  # type: ignore[no-any-return]

    def _calls(self, s: Setting) -> list[tuple[str, list[nn.Parameter], bool | int, nn.Module | None]]:
        blocks = self.block_modules
        inside = {id(p) for b in blocks for p in b.parameters()}
        rest = [p for p in self.model.parameters() if id(p) not in inside]
        calls: list[tuple[str, list[nn.Parameter], bool | int, nn.Module | None]] = []
        if s.root_groups:
            embedding, head = root_parts(self.model)
            calls.append(("embedding", list(embedding.parameters()), s.reshard_after_forward, None))
        else:
            calls.append(("(root)", rest, False, None))
        calls += [(f"block {i}", list(b.parameters()), s.reshard_after_forward, b) for i, b in enumerate(blocks)]
        if s.root_groups:
            calls.append(("output", [p for m in head for p in m.parameters()], False, None))
        return calls

    def _bytes(self, params: list[nn.Parameter], s: Setting) -> tuple[int, int, int]:
        """A call's padded unsharded bytes in the all-gather dtype, its reduce-scatter input bytes and this rank's
        sharded bytes: each parameter's dim 0 padded to a multiple of the shard size (the layout of ``layout.py``)."""
        key = (tuple(id(p) for p in params), s.param_dtype)
        if key in self.memo:
            return self.memo[key]  # type: ignore[no-any-return]
        shard = self.shape[-1]
        gather = scatter = sharded = 0
        for p in params:
            rows = -(-p.shape[0] // shard) * shard if p.dim() else shard
            numel = rows * (p.numel() // max(p.shape[0], 1) if p.dim() else 1)
            own = p.element_size()
            gather += numel * (torch.empty((), dtype=s.param_dtype).element_size() if s.param_dtype else own)
            scatter += numel * (4 if s.param_dtype else own)
            sharded += numel // shard * own
        self.memo[key] = (gather, scatter, sharded)
        return gather, scatter, sharded

    def state_bytes(self, s: Setting) -> int:
        """The sharded parameters and optimizer state ``s`` keeps on the device all step."""
        if s.offload:
            return 0
        states = OPTIMIZERS[self.options["optimizer"]]
        return sum(self._bytes(p, s)[2] for _, p, _, _ in self.group_params(s)) * (1 + states)

    def kept_params(self, s: Setting) -> int:
        """The unsharded block parameters ``s`` keeps from its forward to its backward, at least: every block's whole
        parameters (unpadded, in the all-gather dtype) with ``reshard_after_forward=False``, a 1/k part with k."""
        raf = s.reshard_after_forward
        if raf is True:
            return 0
        key = ("kept", s.param_dtype)
        if key not in self.memo:
            size = torch.empty((), dtype=s.param_dtype).element_size() if s.param_dtype is not None else None
            self.memo[key] = sum(p.numel() * (size if size and p.is_floating_point() else p.element_size())
                                 for b in self.block_modules for p in b.parameters())
        return int(self.memo[key]) // (1 if raf is False else int(raf))

    def lower_bound(self, s: Setting) -> int:
        """What the end of ``s``'s forward holds at least: the sharded state, the unsharded block parameters kept for
        backward (``kept_params``) and the activations kept (a block's, or its input when checkpointed, and the rest
        of the model's): a setting above the budget needs no plan."""
        if self.options["batch_size"] is None:
            return self.state_bytes(s) + self.kept_params(s)
        compute = s.param_dtype or torch.float32
        if compute not in self.acts:
            self.acts[compute] = estimate_activations(self.model, self.options["batch_size"], self.options["seq_len"],
                                                      compute)
        est = self.acts[compute]
        ckpt = len(s.checkpointed(self.blocks))
        kept = ckpt * est.block_input_bytes + (self.blocks - ckpt) * est.block_bytes + est.rest_bytes
        return self.state_bytes(s) + self.kept_params(s) + kept

    def flops(self, module: nn.Module) -> float:
        """Forward FLOPs of ``module`` per step: two per weight element and token (an embedding's: none)."""
        if id(module) not in self.memo:
            weights = sum(p.numel() for m in module.modules() if not isinstance(m, nn.Embedding)
                          for p in m.parameters(recurse=False))
            self.memo[id(module)] = 2.0 * weights * self.tokens
        return float(self.memo[id(module)])

    def time(self, s: Setting) -> tuple[float, float, int]:
        """Predicted seconds, recomputed FLOPs and bytes a rank sends per step of ``s``: its groups in forward order
        at the model's depth (the shape plan's, its block repeated), on ``cost.step_time``."""
        shard = self.shape[-1]
        replicate = self.shape[0] if len(self.shape) == 2 else 1
        bw = self.profile.bandwidth
        rate = self.profile.flops if s.param_dtype is not None else self.profile.fp32_flops
        hidden = getattr(getattr(self.model, "config", None), "hidden_size", 0)
        attention = 2.0 * self.tokens * self.seq_len * hidden  # causal: QK^T and AV, half the matrix
        blocks = self.block_modules
        checkpointed = {id(blocks[i]) for i in s.checkpointed(self.blocks)}
        root_flops = self.flops(self.model) - sum(self.flops(b) for b in blocks)
        groups: list[GroupCost] = []
        send = host = 0.0
        for name, params, reshard, block in self.group_params(s):
            out, rs_in, sharded = self._bytes(params, s)
            k = shard if reshard is True else int(reshard)
            gather = out * (k - 1) / k if k else 0.0  # backward
            rs = rs_in * (shard - 1) / shard
            ar = 2 * rs_in / shard * (replicate - 1) / replicate  # HSDP: the reduce-scatter output, across replicas
            send += out * (shard - 1) / shard + gather + rs + ar
            host += sharded * (2 if k else 1) + rs_in / shard  # CPU offload: parameters up per all-gather, grads down
            flops = (self.flops(block) + attention if block is not None
                     else root_flops * (name != "embedding"))
            groups.append(GroupCost(name, flops / rate, flops / rate if id(block) in checkpointed else 0.0,
                                    out * (shard - 1) / shard / bw(shard), gather / bw(k) if k else 0.0,
                                    rs / bw(shard) + (ar / bw(shard * replicate) if replicate > 1 else 0.0)))
        offload = host / self.profile.host_bandwidth if s.offload else 0.0
        recompute = sum(g.recompute for g in groups) * rate
        seconds = step_time(groups, prefetch=s.prefetch, buffers=s.max_input_buffers, offload=offload)
        return seconds, recompute, int(send)


def _dominant(e: Estimate) -> str:
    """What holds the most at a setting's peak, and what would remove it."""
    kinds = dict(zip(("state", "param", "grad", "optim", "act"), e.at_peak))
    kind, nbytes = max(kinds.items(), key=lambda kv: kv[1])
    root = "(root)" in e.peak_at or "For" in e.peak_at.rpartition(" of ")[2]
    advice = {
        "state": "the sharded parameters, gradients and optimizer state: shard over more ranks or offload to the host",
        "param": "unsharded parameters" + (": give the output layer its own group" if root else
                                           ": reshard after forward, or more, smaller groups"),
        "grad": "unsharded gradients" + (" of the root: give the output layer its own group" if root else ""),
        "optim": "the optimizer step's temporaries: a per-tensor (foreach=False) optimizer step",
        "act": "activations: checkpoint more blocks, or a smaller batch or sequence",
    }[kind]
    return f"{fmt_bytes(nbytes)} of {advice}"


def fit(
    model_or_constructor: nn.Module | Callable[[], nn.Module] | str,
    mesh_shape: int | Sequence[int],
    budget: int | str,
    *,
    profile: DeviceProfile | str = "h100",
    batch_size: int | None = None,
    seq_len: int | None = None,
    mixed_precision: bool = False,
    optimizer: str = "adamw",
    device_type: str = accelerator_type(),
    root_groups: bool = True,
    explain: bool = False,
) -> Recipe:
    """The configuration with the least predicted step time whose planned peak fits ``budget`` (ties: the least
    memory), from the search space of the module docstring, planned by the planner's own runtime.

    Args:
        model_or_constructor: as ``plan()`` takes it: a meta-device model, a constructor, a preset name, a
            ``config.json``; its blocks are the children of an ``nn.ModuleList`` named ``layers``.
        mesh_shape: ``N`` ranks, or ``(R, N)`` for HSDP.
        budget: device bytes per rank, or ``"80GiB"``.
        profile: the device model for the step time (``"h100"``, ``"h200"``, or a ``DeviceProfile``, e.g.
            ``measure_profile()`` on this machine).
        batch_size, seq_len: sequences per rank and tokens per sequence: the compute of a step, and, for a
            ``transformers`` Llama-family model, its activations (then activation checkpointing is searched).
        mixed_precision: allow bf16 all-gathers and compute (reductions stay fp32).
        optimizer, device_type: as ``plan()`` takes them; CPU offload is searched on a device with streams.
        root_groups: also search the embedding and the output layer in their own groups.
        explain: also plan the settings one option away from the chosen one that hold less (``Recipe.rejected``:
            why not them).

    Raises ``ValueError`` when nothing fits, naming the smallest peak reachable and what dominates it.

    Example::

        >>> print(fit(lambda: Transformer(args), 2, "100KiB", device_type="cpu", mixed_precision=True))
        fit ... on mesh (2,) within 100.00 KiB (h100):
          reshard_after_forward=False, bf16, embedding and output in own groups
          peak ... at backward: reduce-scatter of layers.0; sharded state ...
          step ... ms predicted; sends ... per step; recomputes 0 FLOP; ... settings planned
    """
    import torch.distributed as dist

    if dist.is_initialized():  # a training script: the planner's fake world needs a process of its own
        import multiprocessing

        if isinstance(model_or_constructor, nn.Module):
            raise ValueError("fit() in a process with torch.distributed initialised plans in a process of its own: "
                             "pass the model's constructor (a picklable callable) or name, not the model")
        options = {"profile": profile, "batch_size": batch_size, "seq_len": seq_len, "explain": explain,
                   "mixed_precision": mixed_precision, "optimizer": optimizer, "device_type": device_type,
                   "root_groups": root_groups}
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            recipe: Recipe = pool.apply(fit, (model_or_constructor, mesh_shape, budget), options)
        return recipe
    shape = (mesh_shape,) if isinstance(mesh_shape, int) else tuple(mesh_shape)
    budget_bytes = parse_bytes(budget)
    dev = PROFILES[profile] if isinstance(profile, str) and profile in PROFILES else profile
    if not isinstance(dev, DeviceProfile):
        raise ValueError(f"unknown device profile {profile!r}; known: {', '.join(PROFILES)}, or a DeviceProfile")
    model, label = load_model(model_or_constructor)
    if not decoder_layers(model):
        raise ValueError(f"fit(): {label} has no blocks (children of an nn.ModuleList named 'layers') to shard one "
                         "by one; plan() a sharding of your own instead")
    activations = batch_size is not None and seq_len is not None and getattr(model, "config", None) is not None
    if root_groups:
        try:
            root_parts(model)
        except ValueError:
            root_groups = False
    search = _Search(model, label, shape, device_type=device_type, optimizer=optimizer, batch_size=batch_size,
                     seq_len=seq_len, activations=activations, profile=dev)
    space = search_space(shape[-1], blocks=search.blocks, activations=activations,
                         streams=has_streams(torch.device(device_type)), mixed_precision=mixed_precision,
                         ranks_per_node=dev.ranks_per_node, root_groups=root_groups)
    timed = sorted(((*search.time(s), s) for s in space), key=lambda t: t[0])
    best: tuple[float, float, int, Setting, Estimate] | None = None
    for seconds, flops, send, s in timed:  # fastest first
        if best is not None and seconds > best[0] * (1 + 1e-9):
            break  # every later one is slower than one that fits
        if search.lower_bound(s) > budget_bytes:
            continue  # the end of its forward alone does not fit
        e = search.estimate(s)
        if e.peak_bytes <= budget_bytes and (best is None or e.peak_bytes < best[4].peak_bytes):
            best = (seconds, flops, send, s, e)
    if best is None:
        bound = min(search.lower_bound(s) for s in space)
        least = min(search.cache.values(), key=lambda e: e.peak_bytes, default=None) or search.estimate(
            min(space, key=search.lower_bound))
        floor = (f" (every setting holds at least {fmt_bytes(bound)} at the end of its forward)"
                 if bound > budget_bytes else "")
        raise ValueError(f"fit(): nothing fits {fmt_bytes(budget_bytes)} per rank for {label} on mesh {shape}: the "
                         f"smallest peak reachable is {fmt_bytes(least.peak_bytes)} (at {least.peak_at}), of which "
                         f"{_dominant(least)}{floor}")
    seconds, flops, send, s, e = best
    times = {other: (sec, fl, sn) for sec, fl, sn, other in timed}
    rejected = []
    planned = len(search.cache)
    for other in _less_memory(s, space) if explain else []:  # one option at a time towards less memory: why not that
        o = search.estimate(other)
        if o.peak_bytes < e.peak_bytes:
            sec = times[other][0]
            why = (f"{(sec / seconds - 1) * 100:.1f}% slower" if sec > seconds * (1 + 1e-9) else "as fast")
            rejected.append((other, o.peak_bytes, sec, why))
    rejected.sort(key=lambda r: r[1])
    return Recipe(s, label, shape, budget_bytes, e.peak_bytes, e.peak_at, e.state_bytes, e.host_bytes, send,
                  flops, seconds, dev, planned, rejected)


def _less_memory(s: Setting, space: list[Setting]) -> list[Setting]:
    """The settings of ``space`` one option away from ``s`` that hold less (or may: dtype and grouping)."""
    out = []
    for other in space:
        changed = [f.name for f in dataclasses.fields(Setting) if getattr(other, f.name) != getattr(s, f.name)]
        if len(changed) == 1 and (changed[0] in ("param_dtype", "root_groups") or _at_least(s, other)):
            out.append(other)
    return out

