"""fully_shard on torch's threaded process group: every rank a thread of one process.

The ranks share the module-level state of ``fully_shard`` (one import for all threads), so
this is where process-global state keyed only by the mesh would hand one rank another's
groups and hang. Runs on torch's multi-thread test case (``torch.testing._internal``), the
one test here that depends on it: our own harness spawns processes.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.testing._internal.common_distributed import MultiThreadedTestCase
from torch.testing._internal.common_utils import run_tests

from fully_shard import FSDPModule, fully_shard
from tests.harness import skip_on_accelerator
from tests.oracle import average_gradients

WORLD = 4


def _mlp() -> nn.Sequential:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    g = torch.Generator().manual_seed(0)  # the global RNG is shared by the rank threads
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return model


@skip_on_accelerator("torch's threaded process group is CPU-only (its ranks are threads of one process)")
class ThreadedFullyShardTest(MultiThreadedTestCase):
    @property
    def world_size(self) -> int:
        return WORLD

    def setUp(self) -> None:
        super().setUp()
        self._spawn_threads()

    def _check(self, nested: bool, reshard_between: bool) -> None:
        mesh = init_device_mesh("cpu", (WORLD,))
        for reshard in (True, False, 2, None):
            what = f"reshard_after_forward={reshard}, reshard() between: {reshard_between}"
            ref = _mlp()
            model = copy.deepcopy(ref)
            if nested:
                for layer in (model[0], model[2]):
                    fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
            fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
            x = torch.randn(2, 8, generator=torch.Generator().manual_seed(self.rank))
            out = model(x)
            ref_out = ref(x)
            # same parameters and input on this rank: the same arithmetic by construction
            self.assertTrue(torch.equal(out, ref_out), what)
            if reshard_between:
                for m in model.modules():
                    if isinstance(m, FSDPModule):
                        m.reshard()
                for p in model.parameters():
                    self.assertIsInstance(p, DTensor, what)
            out.sum().backward()
            ref_out.sum().backward()
            average_gradients(ref)
            for p, q in zip(model.parameters(), ref.parameters()):
                # an average over 4 ranks, reduced in another order than the reference's
                torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-6, atol=1e-6, msg=what)

    def test_root_only(self) -> None:
        self._check(nested=False, reshard_between=True)

    def test_nested(self) -> None:
        self._check(nested=True, reshard_between=True)

    def test_nested_backward_after_forward(self) -> None:
        self._check(nested=True, reshard_between=False)

    # torch's TestFullyShardUnshardMultiThread, on this process group as there

    def test_unshard_no_param_group(self) -> None:
        """unshard() of a module whose call manages no parameters (each Linear's call took them): nothing to gather."""
        mesh = init_device_mesh("cpu", (WORLD,))
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        for lin in model:
            fully_shard(lin, mesh=mesh)
        fully_shard(model, mesh=mesh)
        handle = model.unshard(async_op=True)
        self.assertIsNotNone(handle)
        handle.wait()
        for p in model.parameters():
            self.assertIsInstance(p, DTensor)  # the Linears' groups were not asked

    def test_unshard_without_lazy_init(self) -> None:
        """unshard() before any forward (no root known yet) gathers the parameters as they were."""
        mesh = init_device_mesh("cpu", (WORLD,))
        model = _mlp()
        ref = copy.deepcopy(model)
        fully_shard(model, mesh=mesh)
        model.unshard()
        for p, q in zip(model.parameters(), ref.parameters()):
            self.assertNotIsInstance(p, DTensor)
            self.assertTrue(torch.equal(p, q))
    def test_hooks_patched_onto_local_tensors_on_hsdp(self) -> None:
        """torch's test_all_gather_extension_hsdp_mesh (a threaded test there too), then backward: TwoTensor weights
        on a (2, 2) mesh, hooks patched onto each local tensor after fully_shard; they get the shard mesh only."""
        from torch.testing._internal.two_tensor import TwoTensor

        from tests.test_subclass_params import _MLP, _SEEN, _self_post, _self_pre

        mesh = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("replicate", "shard"))
        g = torch.Generator().manual_seed(0)
        ref = nn.Sequential(*[_MLP() for _ in range(2)])
        with torch.no_grad():
            for p in ref.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        model = copy.deepcopy(ref)
        for lin in (m for mlp in model for m in (mlp.in_proj, mlp.out_proj)):
            lin.weight = nn.Parameter(TwoTensor(lin.weight.detach(), lin.weight.detach().clone()))
        for mlp in model:
            fully_shard(mlp, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for p in model.parameters():
            local = p._local_tensor
            local.fsdp_pre_all_gather, local.fsdp_post_all_gather = _self_pre.__get__(local), _self_post.__get__(local)
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(self.rank))
        out, ref_out = model(x), ref(x)
        self.assertTrue(torch.equal(out, ref_out))  # the same weights, gathered exactly
        self.assertIn(tuple(mesh["shard"].mesh.tolist()), _SEEN["meshes"])  # 1-D: this rank's shard group
        out.sum().backward()
        ref_out.sum().backward()
        average_gradients(ref)
        for p, q in zip(model.parameters(), ref.parameters()):
            self.assertIs(type(p._local_tensor), TwoTensor)
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-6, atol=1e-6)

    def test_post_accumulate_grad_hooks_run(self) -> None:
        # torch's own test of these hooks runs on this process group: each sharded parameter's hook once per backward,
        # in torch FSDP2's order, seeing the gradient torch's sees
        mesh = init_device_mesh("cpu", (WORLD,))
        seen: dict[str, list[tuple[str, torch.Tensor]]] = {}
        for name, shard_fn in (("ours", fully_shard), ("torch", torch_fully_shard)):
            model = _mlp()
            for module in (model[0], model[2], model):
                shard_fn(module, mesh=mesh)
            log = seen[name] = []
            for pname, p in model.named_parameters():
                p.register_post_accumulate_grad_hook(
                    lambda p, pname=pname, log=log: log.append((pname, p.grad.to_local().clone()))
                )
            model(torch.randn(2, 8, generator=torch.Generator().manual_seed(self.rank))).sum().backward()
        # the input needs no gradient: model[0]'s group and the root's are reduced at the end of backward, root first
        self.assertEqual([n for n, _ in seen["ours"]],
                         ["2.weight", "2.bias", "4.weight", "4.bias", "0.weight", "0.bias"])
        self.assertEqual([n for n, _ in seen["ours"]], [n for n, _ in seen["torch"]])
        for (name, g), (_, tg) in zip(seen["ours"], seen["torch"]):
            self.assertTrue(torch.equal(g, tg), name)  # the same reduce-scatter of the same gradients


if __name__ == "__main__":
    run_tests()
