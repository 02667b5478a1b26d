"""The namespace the docstring examples of fully_shard/ run in (``python3 -m pytest -q --doctest-modules fully_shard``).

Every ``Example::`` block is a doctest. It runs on a one-rank gloo world on CPU, in a fresh temporary directory, and
finds these names already defined, the ones an example would have in a training script:

- ``torch``, ``nn``, ``dist``, ``init_device_mesh``, and the package's public names (``fully_shard``, the function,
  ``FSDPModule``, ``MixedPrecisionPolicy``, ...);
- ``mesh``: a 1-D CPU mesh over the world (one rank);
- ``ModelArgs``, ``Transformer``, ``TransformerBlock``: the Llama-style model of examples/model.py; ``args``: its
  tiny shapes; ``model``: a fresh ``Transformer(args)`` (not sharded: the example shards it); ``block``:
  ``model.layers[0]``; ``tokens``/``x``: a batch of token ids for ``model``; ``moe``: a small mixture-of-experts layer
  (``moe.router``, ``moe.experts``) whose input is ``(N, 16)``; ``Shard``: the DTensor placement;
- ``batches``: two ``(inputs, targets)`` pairs of token ids (targets: the next tokens); ``loss_fn(logits, targets)``:
  cross-entropy; ``schedule``: a learning-rate multiplier for ``LambdaLR``.

No optimizer: it must be built after ``fully_shard`` (which replaces the parameters), so each example builds its own.
An example that builds a ``torchft.Manager`` also finds what a fault-tolerant launch gives it: a Lighthouse named by
``TORCHFT_LIGHTHOUSE`` and torchrun's store and rank variables.

Objects are built anew for every example, so one example's sharding or training never leaks into the next.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

import fully_shard
from examples.model import ModelArgs, Transformer, TransformerBlock
from fully_shard.tools import set_debug

collect_ignore = ["fully_shard/plan.py"]  # python -m fully_shard.plan's script: importing it is refused, by design


class MoE(nn.Module):
    """A mixture-of-experts layer, top-1 routed: an expert that no token picks gets no gradient."""

    def __init__(self, dim: int = 16, n_experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, dim)
        gate, choice = self.router(x).softmax(-1).max(-1)  # (N,), (N,)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            picked = choice == i
            if picked.any():
                out[picked] = gate[picked, None] * expert(x[picked])
        return out


@pytest.fixture(autouse=True)
def _doctest_world(request: pytest.FixtureRequest, doctest_namespace: dict[str, Any]) -> Iterator[None]:
    """For doctest items only: a one-rank world, a temporary working directory and fresh objects to show."""
    if not isinstance(request.node, pytest.DoctestItem):  # the test suite's own tests build what they need
        yield
        return
    monkeypatch: pytest.MonkeyPatch = request.getfixturevalue("monkeypatch")
    monkeypatch.chdir(request.getfixturevalue("tmp_path"))  # examples that save checkpoints or figures write them here
    torchft_run = _torchft_launch(monkeypatch) if "torchft.Manager(" in (request.node.dtest.docstring or "") else None
    planner = "/tools/planner/" in request.node.path.as_posix()  # plans on a fake process group of its own: no world
    started = not planner and not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    args = ModelArgs(dim=16, n_layers=2, n_heads=2, vocab_size=32, multiple_of=16, max_seq_len=16)
    model = Transformer(args)
    tokens = torch.randint(0, args.vocab_size, (2, 8))  # (B, T)
    doctest_namespace.clear()
    doctest_namespace.update({name: getattr(fully_shard, name) for name in fully_shard.__all__})
    doctest_namespace.update(
        torch=torch, nn=nn, dist=dist, init_device_mesh=init_device_mesh, Shard=Shard,
        mesh=None if planner else init_device_mesh("cpu", (dist.get_world_size(),)),
        ModelArgs=ModelArgs, Transformer=Transformer, TransformerBlock=TransformerBlock, args=args,
        model=model, block=model.layers[0], moe=MoE(), tokens=tokens, x=tokens,
        batches=[(t[:, :-1], t[:, 1:]) for t in torch.randint(0, args.vocab_size, (2, 2, 9))],  # (inputs, targets)
        loss_fn=lambda logits, targets: F.cross_entropy(logits.flatten(0, 1), targets.flatten()),
        schedule=lambda step: min(1.0, (step + 1) / 100),  # linear warm-up over 100 steps
    )
    yield
    doctest_namespace.clear()
    set_debug(False)  # an example that failed half-way must leave neither the debug mode nor the switch on
    if "fully_shard.switch" in sys.modules:  # imported only when asked for (fully_shard.install)
        sys.modules["fully_shard.switch"].uninstall()
    if started:
        dist.destroy_process_group()
    if torchft_run is not None:
        torchft_run[0].shutdown()


def _torchft_launch(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, dist.TCPStore]:
    """What an example that builds a ``torchft.Manager`` finds in a fault-tolerant run: a Lighthouse
    (``torchft_lighthouse``) named by ``TORCHFT_LIGHTHOUSE``, and a replica group's store and rank as torchrun
    sets them. Returns the Lighthouse, to shut down, and the store, to keep alive until then."""
    coordination = pytest.importorskip("torchft.coordination", reason="needs torchft: pip install fully-shard[ft]")
    lighthouse = coordination.LighthouseServer(bind="[::]:0", min_replicas=1)
    store = dist.TCPStore("localhost", 0, 1, is_master=True, wait_for_workers=False)
    for name, value in dict(TORCHFT_LIGHTHOUSE=lighthouse.address(), MASTER_ADDR="localhost",
                            MASTER_PORT=str(store.port), RANK="0", WORLD_SIZE="1").items():
        monkeypatch.setenv(name, value)
    return lighthouse, store
