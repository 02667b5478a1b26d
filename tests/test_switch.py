"""The switch (fully_shard.install / uninstall, python -m fully_shard.switch): torch's public FSDP2 names resolve to
fully_shard's for code we did not write, and back.

* The mechanism, in this process: every name in torch's FSDP2 namespaces is ours after install() and torch's own
  object again after uninstall() (``is``); a module that imported the names before install() is rebound (an alias
  too) and restored; one that imported them from torch while the switch was on gets torch's back, one that imported
  them from fully_shard keeps ours; torch's pipelining keeps torch's; install() logs what it replaced; the launcher
  runs a script and a module as ``__main__``, and in a fresh process (where install() first imports torch's old
  ``_composable.fsdp`` path) uninstall() still restores torch's names there.
* accelerate 1.15 (``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2,
  auto_wrap_policy="transformer_based_wrap"), cpu=True)``, ``prepare``, 3 steps) on a tiny untied
  ``LlamaForCausalLM``, 2 gloo ranks: the modules accelerate shards are fully_shard's, losses and parameters are
  bitwise those of the same program on torch's FSDP2, and a checkpoint ``save_state`` wrote on either library
  ``load_state`` reads into the other. On CPU accelerate ignores the FSDP plugin (its ``AcceleratorState`` turns
  FSDP on only for accelerator device types; CPU ranks get ``MULTI_CPU``, i.e. DDP, silently), so the test sets the
  state a GPU run has (``distributed_type = FSDP`` in AcceleratorState and PartialState, ``fsdp_plugin``); all after is
  accelerate's own FSDP2 path (``fsdp2_prepare_model``, its optimizer rewiring, ``save_state``/``load_state``).
* The tied case (``tie_word_embeddings=True``) today: accelerate 1.15 shards the embedding, the final norm and
  ``lm_head`` in one call, so the tie stays within one group and trains, bitwise equal to torch.
* The Hugging Face Trainer with ``fsdp=True, fsdp_config={"version": 2}``: on CPU it trains with DDP (the same
  accelerate rule; asserted, so a change shows); a Trainer subclass that sets the same state trains
  through accelerate's FSDP2 path on fully_shard, bitwise equal to torch.
* torchtitan 0.3.0's ``parallelize_llama`` runs through the switch in tests/test_torchtitan.py (3 steps, bitwise
  equal to torch's FSDP2).

Bitwise throughout: the same modules in the same groups, fp32, the same collectives (SUM/AVG on gloo) in the same
order, so the arithmetic is the same by construction.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import re
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.harness import run_distributed, skip_on_accelerator
from tests.torch_features import requires_torch_feature

ROOT = Path(__file__).resolve().parent.parent


def _torch_objects() -> dict[str, Any]:
    """``"namespace.name"`` -> the object torch has there, for every switched name."""
    from fully_shard import switch

    out = {}
    for namespace in switch.NAMESPACES:
        module = importlib.import_module(namespace)
        out.update({f"{namespace}.{n}": vars(module)[n] for n in switch.NAMES if n in vars(module)})
    return out


def _lookup(dotted: str) -> Any:
    namespace, _, name = dotted.rpartition(".")
    return vars(sys.modules[namespace])[name]


# --------------------------------------------------------------------------------------------------------------------
# The mechanism
# --------------------------------------------------------------------------------------------------------------------


def test_install_switches_torch_names_and_uninstall_restores_the_same_objects(tmp_path: Path, caplog: Any) -> None:
    import torch.distributed.pipelining.stage as pp_stage

    import fully_shard

    torch_objects = _torch_objects()
    assert ("torch.distributed.fsdp.fully_shard" in torch_objects
            and "torch.distributed._composable.fsdp.FSDPModule" in torch_objects)
    (tmp_path / "client_before.py").write_text("from torch.distributed.fsdp import fully_shard, FSDPModule as "
                                               "TheirModule\n")
    (tmp_path / "client_after.py").write_text("from torch.distributed._composable.fsdp import fully_shard, "
                                              "FSDPModule\n")
    (tmp_path / "client_ours.py").write_text("from fully_shard import fully_shard, FSDPModule\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import client_before  # type: ignore[import-not-found]

        with caplog.at_level(logging.INFO, logger="fully_shard.switch"):
            replaced = fully_shard.install()
        try:
            assert fully_shard.install() == replaced  # a second call changes nothing
            assert set(torch_objects) | {"client_before.fully_shard", "client_before.TheirModule"} <= set(replaced)
            for dotted in torch_objects:
                assert _lookup(dotted) is getattr(fully_shard, dotted.rpartition(".")[2]), dotted
            assert (client_before.fully_shard is fully_shard.fully_shard
                    and client_before.TheirModule is fully_shard.FSDPModule)
            import client_after  # type: ignore[import-not-found]
            import client_ours  # type: ignore[import-not-found]

            assert (client_after.fully_shard is fully_shard.fully_shard
                    and client_after.FSDPModule is fully_shard.FSDPModule)
            # torch's pipelining drives torch's internals through the names: it keeps torch's
            assert pp_stage.FSDPModule is torch_objects["torch.distributed.fsdp.FSDPModule"]
            assert ("torch.distributed.fsdp.{fully_shard, FSDPModule," in caplog.text
                    and "client_before.{" in caplog.text)
        finally:
            restored = fully_shard.uninstall()
        # what install() replaced, and what the module imported while it was on took from torch's namespace
        assert sorted(restored) == sorted([*replaced, "client_after.fully_shard", "client_after.FSDPModule"])
        assert fully_shard.uninstall() == []
        for dotted, original in torch_objects.items():
            assert _lookup(dotted) is original, dotted
        assert client_before.TheirModule is torch_objects["torch.distributed.fsdp.FSDPModule"]
        assert client_after.FSDPModule is torch_objects["torch.distributed.fsdp.FSDPModule"]
        assert client_ours.fully_shard is fully_shard.fully_shard  # imported from fully_shard: stays
    finally:
        sys.path.remove(str(tmp_path))
        for name in ("client_before", "client_after", "client_ours"):
            sys.modules.pop(name, None)


def test_only_the_switch_imports_torchs_fsdp() -> None:
    """The ground rule: nothing under fully_shard/ imports torch's FSDP2 (or _composable, _tools) but
    fully_shard/switch/."""
    pattern = re.compile(r"^\s*(from|import)\s+torch\.distributed\.(fsdp|_composable|_tools)\b", re.MULTILINE)
    offenders = {p.relative_to(ROOT).as_posix() for p in (ROOT / "fully_shard").rglob("*.py")
                 if pattern.search(p.read_text())}
    # fully_shard/switch/ reaches them through importlib, by the names in NAMESPACES
    assert offenders == set(), offenders


def test_launcher_runs_a_script_and_a_module_as_main(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    # in a fresh process install() is the first to import torch.distributed._composable.fsdp, which re-exports from
    # torch.distributed.fsdp: it must still get torch's names back from uninstall()
    script.write_text(
        "import sys, fully_shard, torch.distributed.fsdp as f, torch.distributed._composable.fsdp as c\n"
        "print('ran', __name__, sys.argv[1:], f.fully_shard.__module__, c.FSDPModule.__module__, sys.path[0] == "
        + repr(str(tmp_path)) + ")\n"
        "fully_shard.uninstall()\n"
        "print('after', f.fully_shard.__module__, c.fully_shard.__module__, c.FSDPModule.__module__)\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "RANK": "0"}
    run = subprocess.run([sys.executable, "-m", "fully_shard.switch", str(script), "--lr", "3"], capture_output=True,
                         text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "ran __main__ ['--lr', '3'] fully_shard.api fully_shard.api True" in run.stdout, run.stdout
    assert "after torch.distributed.fsdp torch.distributed.fsdp torch.distributed.fsdp" in run.stdout, run.stdout
    assert ("fully_shard.switch: torch's FSDP2 names now resolve to fully_shard's: torch.distributed.fsdp.{"
            in run.stderr)


def test_launcher_module_form(tmp_path: Path, capsys: Any) -> None:
    import fully_shard
    from fully_shard import switch

    (tmp_path / "switch_target.py").write_text(
        "import sys, torch.distributed.fsdp as f\nprint('module', __name__, sys.argv[1:], f.fully_shard.__module__)\n"
    )
    argv, path = sys.argv[:], sys.path[:]
    sys.path.insert(0, str(tmp_path))
    try:
        switch.main(["-m", "switch_target", "a", "b"])
        assert "module __main__ ['a', 'b'] fully_shard.api" in capsys.readouterr().out
        with pytest.raises(SystemExit, match=r"usage: python -m fully_shard.switch SCRIPT \[ARGS...\]  \|  python -m"):
            switch.main([])
    finally:
        fully_shard.uninstall()
        sys.argv[:], sys.path[:] = argv, path
        sys.modules.pop("switch_target", None)


def _torch_sharded_then_install() -> dict[str, Any]:
    import torch.distributed.fsdp as torch_fsdp
    import torch.nn as nn

    import fully_shard

    torch_cls = torch_fsdp.FSDPModule
    model = torch_fsdp.fully_shard(nn.Linear(4, 4))
    policy = torch_fsdp.MixedPrecisionPolicy(param_dtype=torch.float64, cast_forward_inputs=False)
    offload = torch_fsdp.CPUOffloadPolicy(pin_memory=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fully_shard.install()
    try:
        still_torch = isinstance(model, torch_cls) and not isinstance(model, torch_fsdp.FSDPModule)
        model(torch.ones(2, 4)).sum().backward()  # still runs on torch's code
        # policies a framework built from torch's classes before install(): taken as ours
        ours = torch_fsdp.fully_shard(nn.Linear(4, 4), mp_policy=policy, offload_policy=offload)
        state = fully_shard.api.state_of(ours)
        return {
            "warnings": [str(w.message) for w in caught],
            "still_torch": still_torch,
            "policy": (type(state.mp_policy).__module__, state.mp_policy.param_dtype,
                       state.mp_policy.cast_forward_inputs),
            "out_dtype": ours(torch.ones(2, 4, dtype=torch.float64)).dtype,
        }
    finally:
        fully_shard.uninstall()


def test_modules_torch_sharded_before_install_warn_and_keep_running() -> None:
    out = run_distributed(_torch_sharded_then_install, 2)[0]
    # this test's Linear, and whatever torch-sharded modules earlier tests left alive in the worker
    found = [re.match(r"fully_shard.install\(\): (\d+) module\(s\) are already sharded by torch's FSDP2 \(e.g. "
                      r"FSDP\w+\); they keep running on torch's code .* Call fully_shard.install\(\) before the "
                      r"framework shards the model", w)
             for w in out["warnings"]]
    assert any(m and int(m.group(1)) >= 1 for m in found), out["warnings"]
    assert out["still_torch"]
    assert out["policy"] == ("fully_shard.policy", torch.float64, False)
    assert out["out_dtype"] == torch.float64


# --------------------------------------------------------------------------------------------------------------------
# accelerate and the Trainer
# --------------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _accelerate_worker(impl: str) -> Iterator[None]:
    """This harness worker as accelerate expects a launched rank (its env vars; the process group exists already,
    so accelerate does not make one), on fully_shard through the switch for ``impl == "ours"``; accelerate's
    process-wide state and the environment are reset after."""
    import torch.distributed as dist
    from accelerate.state import AcceleratorState, GradientState

    import fully_shard

    saved = dict(os.environ)
    rank, world = str(dist.get_rank()), str(dist.get_world_size())
    os.environ.update(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=world, LOCAL_WORLD_SIZE=world, MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29500")
    if impl == "ours":
        fully_shard.install()
    try:
        yield
    finally:
        if impl == "ours":
            fully_shard.uninstall()
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        os.environ.clear()
        os.environ.update(saved)


def _fsdp_on_cpu(state: Any, plugin: Any) -> None:
    """What accelerate's AcceleratorState sets for an FSDP plugin on an accelerator and leaves out on CPU: the FSDP
    distributed type (in its own state and, as it does, in PartialState's, which later AcceleratorState() calls copy
    from) and the plugin."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    assert state.distributed_type == DistributedType.MULTI_CPU and getattr(state, "fsdp_plugin", None) is None
    state.distributed_type = PartialState().distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin


def _llama(tied: bool, seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def _sharding(model: Any) -> dict[str, str]:
    """name -> "fully_shard" / "torch" for every module some FSDP2 sharded."""
    import torch.distributed.fsdp as torch_fsdp

    import fully_shard

    # torch's class found through a torch-sharded module's MRO: the switch may have replaced the name
    kinds = {}
    for name, m in model.named_modules():
        if isinstance(m, fully_shard.FSDPModule):
            kinds[name] = "fully_shard"
        elif any(c.__name__ == "FSDPModule" and c.__module__ == torch_fsdp.__name__ for c in type(m).__mro__):
            kinds[name] = "torch"
    return kinds


def _full(model: Any, opt: Any = None) -> dict[str, torch.Tensor]:
    """The full parameters (and, given ``opt``, the full AdamW state: ``name.exp_avg``, ...)."""
    if opt is None:
        return {name: p.full_tensor().clone() for name, p in model.named_parameters()}
    state = opt.optimizer.state
    return {f"{name}.{k}": (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
            for name, p in model.named_parameters() for k, v in sorted(state[p].items())}


def _accelerate(impl: str, tied: bool | str, save_dir: str | None = None,
                load_dir: str | None = None) -> dict[str, Any]:
    """``tied="unseen"``: the tie, with ``get_output_embeddings`` saying None (a head accelerate does not know), so
    accelerate shards ``embed_tokens`` alone and leaves ``lm_head`` to the root: the tie across two calls."""
    import torch.distributed as dist

    with _accelerate_worker(impl):
        from accelerate import Accelerator
        from accelerate.utils import FullyShardedDataParallelPlugin

        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
        accelerator = Accelerator(fsdp_plugin=plugin, cpu=True)
        _fsdp_on_cpu(accelerator.state, plugin)
        model = _llama(bool(tied), seed=0)
        if tied == "unseen":
            model.get_output_embeddings = lambda: None
        model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        losses = []
        for step in range(3):
            ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
            try:
                loss = model(input_ids=ids, labels=ids).loss
            except ValueError as e:  # torch's FSDP2 refuses a tie across calls at its lazy init
                if tied != "unseen":
                    raise
                return {"refused": str(e)}
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out: dict[str, Any] = {"losses": losses, "params": _full(model), "adam": _full(model, opt),
                               "sharding": _sharding(model)}
        if save_dir is not None:
            accelerator.save_state(save_dir)
        if load_dir is not None:  # parameters and optimizer state zeroed first, so the load must write them all
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
                    for v in opt.optimizer.state[p].values():
                        v.zero_()
            accelerator.load_state(load_dir)
            out["loaded"] = {**_full(model), **_full(model, opt)}
        return out


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


accelerate_installed = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None or importlib.util.find_spec("transformers") is None,
    reason="accelerate/transformers client test: pip install -e '.[test]' (accelerate==1.15.*, transformers)",
)


@accelerate_installed
@skip_on_accelerator("accelerate's FSDP on CPU ranks, set up by hand (see the module docstring); a GPU run needs none "
                     "of it")
def test_accelerate_untied_llama_matches_torch_and_checkpoints_load_across(tmp_path: Path) -> None:
    theirs = run_distributed(_accelerate, 2, "torch", False, str(tmp_path / "torch"))
    ours = run_distributed(_accelerate, 2, "ours", False, str(tmp_path / "ours"), str(tmp_path / "torch"))
    back = run_distributed(_accelerate, 2, "torch", False, None, str(tmp_path / "ours"))
    for rank in range(2):
        a, b = ours[rank], theirs[rank]
        # embed_tokens, both decoder layers, norm and lm_head (one call), the root: all sharded by fully_shard
        assert a["sharding"] == dict.fromkeys(b["sharding"], "fully_shard"), a["sharding"]
        assert set(b["sharding"].values()) == {"torch"} and {"", "model.layers.0", "model.embed_tokens",
                                                             "lm_head"} <= set(b["sharding"])
        assert a["losses"] == b["losses"], (a["losses"], b["losses"])
        _assert_bitwise(a["params"], b["params"])
        _assert_bitwise(a["adam"], b["adam"])
        # save_state / load_state (DCP, sharded: model and optimizer): fully_shard loaded torch's, torch loaded ours
        _assert_bitwise(a["loaded"], {**b["params"], **b["adam"]})
        _assert_bitwise(back[rank]["loaded"], {**a["params"], **a["adam"]})


@accelerate_installed
@skip_on_accelerator("accelerate's FSDP on CPU ranks, set up by hand (see the module docstring); a GPU run needs none "
                     "of it")
def test_accelerate_tied_llama_trains_today_as_accelerate_groups_the_tie() -> None:
    ours = run_distributed(_accelerate, 2, "ours", True)[0]
    theirs = run_distributed(_accelerate, 2, "torch", True)[0]
    # accelerate 1.15 puts norm, embed_tokens and lm_head (tied) in one call: the tie stays within one group
    assert ours["sharding"] == dict.fromkeys(theirs["sharding"], "fully_shard")
    assert "lm_head" in ours["sharding"] and "model.embed_tokens" in ours["sharding"]
    assert "lm_head.weight" not in ours["params"]  # one parameter, reached from both modules
    assert ours["losses"] == theirs["losses"]
    _assert_bitwise(ours["params"], theirs["params"])


@accelerate_installed
@skip_on_accelerator("accelerate's FSDP on CPU ranks, set up by hand (see the module docstring); a GPU run needs none "
                     "of it")
@requires_torch_feature("FSDP2 refusing a parameter tied across calls")  # the test checks torch refuses it
def test_accelerate_tie_across_calls_trains_where_torch_refuses() -> None:
    # embed_tokens in its own call, lm_head (tied to it) left to the root: torch's FSDP2 refuses the root's call
    refused = run_distributed(_accelerate, 2, "torch", "unseen")[0]
    assert "already managed by another FSDP group" in refused["refused"], refused
    ours = run_distributed(_accelerate, 2, "ours", "unseen")[0]
    theirs = run_distributed(_accelerate, 2, "torch", True)[0]  # accelerate 1.15's layout: the tie in one call
    assert {"model.embed_tokens", "model.norm", ""} <= set(ours["sharding"]) and "lm_head" not in ours["sharding"], ours
    assert "lm_head.weight" not in ours["params"]  # one parameter, reached from both calls
    # the same sum of the two uses' gradients, reduced once: bitwise
    assert ours["losses"] == theirs["losses"], (ours["losses"], theirs["losses"])
    _assert_bitwise(ours["params"], theirs["params"])
    _assert_bitwise(ours["adam"], theirs["adam"])


def _trainer(impl: str, fsdp_on_cpu: bool, output_dir: str) -> dict[str, Any]:
    import torch.distributed as dist

    with _accelerate_worker(impl):
        from accelerate.utils import FullyShardedDataParallelPlugin
        from transformers import Trainer, TrainingArguments

        class CPUFSDPTrainer(Trainer):  # type: ignore[misc]
            def create_accelerator_and_postprocess(self) -> None:
                super().create_accelerator_and_postprocess()
                _fsdp_on_cpu(self.accelerator.state, FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args))
                self.is_fsdp_enabled = True

        ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
        data = [{"input_ids": x, "labels": x} for x in ids]
        args = TrainingArguments(output_dir=output_dir, use_cpu=True, fsdp=True, fsdp_config={"version": 2},
                                 max_steps=3,
                                 per_device_train_batch_size=2, learning_rate=1e-2, logging_steps=1, report_to=[],
                                 save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
        trainer = (CPUFSDPTrainer if fsdp_on_cpu else Trainer)(model=_llama(False, seed=0), args=args,
                                                               train_dataset=data)
        if not fsdp_on_cpu:
            return {"distributed_type": str(trainer.accelerator.distributed_type), "fsdp": trainer.is_fsdp_enabled}
        trainer.train()
        assert dist.get_world_size() == trainer.args.world_size
        import transformers.distributed.fsdp as hf_fsdp  # its own sharding path binds fully_shard at import

        return {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h], "params": _full(trainer.model),
                "sharding": _sharding(trainer.model_wrapped), "hf_binding": hf_fsdp.fully_shard.__module__}


@accelerate_installed
@skip_on_accelerator("accelerate's FSDP on CPU ranks, set up by hand (see the module docstring); a GPU run needs none "
                     "of it")
def test_trainer_fsdp2_config_trains_on_fully_shard_like_torch(tmp_path: Path) -> None:
    # what the Trainer does with an FSDP2 config on CPU ranks: DDP, without a word
    plain = run_distributed(_trainer, 2, "ours", False, str(tmp_path))[0]
    assert plain == {"distributed_type": "DistributedType.MULTI_CPU", "fsdp": False}
    ours = run_distributed(_trainer, 2, "ours", True, str(tmp_path))[0]
    theirs = run_distributed(_trainer, 2, "torch", True, str(tmp_path))[0]
    assert ours["sharding"] == dict.fromkeys(theirs["sharding"], "fully_shard") and "model.layers.1" in ours["sharding"]
    # transformers' own sharding module binds fully_shard at import: rebound by install(), or given back by uninstall()
    assert (ours["hf_binding"], theirs["hf_binding"]) == ("fully_shard.api", "torch.distributed.fsdp")
    assert len(ours["losses"]) == 3 and ours["losses"] == theirs["losses"]
    _assert_bitwise(ours["params"], theirs["params"])
