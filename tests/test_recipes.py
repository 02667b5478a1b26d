"""The recipes of docs/recipes.md run end to end.

* torchtitan path: examples/torchtitan_style.py's ``parallelize`` (a torchtitan recipe for
  torch's FSDP2) gives the same losses, bitwise, with torch's ``fully_shard`` and with
  ours: the two runs load the same source, only its FSDP import line differs.
* Hugging Face path: examples/hf_llama.py shards a tiny ``LlamaForCausalLM``, trains,
  checkpoints with DCP and exports one safetensors file; ``from_pretrained`` on it gives
  the sharded model's logits exactly.
* The main job: examples/train.py, interrupted after a checkpoint and run again with
  ``--resume``, prints the same losses, bitwise, as the uninterrupted run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from typing import Any

import pytest

from tests.harness import concurrently, run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "examples", "train.py")

# ---------------------------------------------------------------------------
# torchtitan path
# ---------------------------------------------------------------------------


def _torchtitan_losses(steps: int, kwargs: dict[str, Any]) -> dict[str, Any]:
    import torch

    from examples.torchtitan_style import IMPORTS, load_recipe

    out: dict[str, Any] = {}
    for impl in ("torch", "fully_shard"):
        recipe = load_recipe(impl)
        # the one line that differs, and nothing else
        assert recipe.fully_shard.__module__.startswith("torch.distributed.fsdp" if impl == "torch" else "fully_shard")
        out[impl] = recipe.train(steps,
                                 **{k: getattr(torch, v) if k.endswith("dtype") else v for k, v in kwargs.items()})
    out["imports"] = IMPORTS
    return out


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"param_dtype": "bfloat16", "reduce_dtype": "float32"}, id="torchtitan-defaults-bf16"),
        pytest.param(
            {"param_dtype": "float32", "reduce_dtype": "float32", "ac_mode": "full",
             "reshard_after_forward_policy": "always", "dp_replicate": 2},
            id="fp32-ac-always-hsdp",
        ),
    ],
)
def test_torchtitan_parallelize_same_losses_as_torch(kwargs: dict[str, Any]) -> None:
    results = run_distributed(_torchtitan_losses, 2, 4, kwargs, timeout=240)
    for rank, out in enumerate(results):
        assert out["torch"] == out["fully_shard"], (f"rank {rank}: torch {out['torch']} vs fully_shard "
                                                    f"{out['fully_shard']}")
        assert len(out["torch"]) == 4
    assert results[0]["torch"][-1] < results[0]["torch"][0]  # it trains
    # the two import lines name the same three things
    names = {impl: line.split(" import ")[1] for impl, line in results[0]["imports"].items()}
    assert names["torch"] == names["fully_shard"]


# ---------------------------------------------------------------------------
# Hugging Face path
# ---------------------------------------------------------------------------


def _hf_recipe(out_dir: str, steps: int, pretrained: str) -> dict[str, Any]:
    from examples.hf_llama import recipe

    return recipe(out_dir, steps=steps, seq_len=32, pretrained=pretrained)


def test_hf_llama_recipe_loads_finetunes_and_exports(tmp_path: Any) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from examples.hf_llama import write_stand_in

    # the "pretrained" checkpoint, made here: save_pretrained of a random tiny Llama
    pretrained = str(tmp_path / "pretrained")
    write_stand_in(pretrained, hidden_size=64, layers=2, heads=4, kv_heads=2, seq_len=32, seed=7)
    assert sorted(os.listdir(pretrained)) == ["config.json", "generation_config.json", "model.safetensors"]

    results = run_distributed(_hf_recipe, 2, str(tmp_path / "out"), 3, pretrained, timeout=300)
    r0 = results[0]
    # built on meta, sharded, loaded from the file on rank 0 and broadcast: the sharded model
    # gathers the same bytes and runs the same CPU kernels as the unsharded one, so bitwise
    assert r0["loaded_equal"], f"after loading: max |diff| {r0['loaded_max_abs_diff']}"
    assert r0["losses"] == results[1]["losses"]  # the mean over ranks, the same on both
    assert len(r0["losses"]) == 3 and r0["losses"][-1] < r0["losses"][0]
    assert os.path.isfile(os.path.join(r0["checkpoint"], ".metadata"))  # a complete DCP checkpoint
    assert sorted(os.listdir(r0["export_dir"])) == ["config.json", "model.safetensors"]
    assert r0["exported_keys"] == r0["model_keys"]  # every weight, under Hugging Face's names
    assert r0["logits_equal"], ("from_pretrained logits differ from the sharded model's: max |diff| "
                                f"{r0['max_abs_diff']}")


# ---------------------------------------------------------------------------
# The main job: examples/train.py --resume
# ---------------------------------------------------------------------------

TINY = ["--device", "cpu", "--nproc", "2", "--n-layers", "2", "--dim", "32", "--n-heads", "2", "--seq-len", "16",
        "--batch-size", "2", "--log-every", "1", "--exact-loss", "--vocab-size", "300", "--eval-every", "3"]


def _train(args: list[str], timeout: float = 150,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run examples/train.py; on timeout kill its whole process group (workers included)."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    proc = subprocess.Popen([sys.executable, TRAIN, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as timed_out:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"examples/train.py {' '.join(args)} timed out after {timeout} s\n{out}\n"
                             f"{err}") from timed_out
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert result.returncode == 0, f"{' '.join(args)}\nstdout:\n{out}\nstderr:\n{err}"
    return result


def _losses(stdout: str) -> dict[int, str]:
    """step -> the loss exactly as printed (repr of the float, with --exact-loss)."""
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^step\s+(\d+)/\d+ \| loss (\S+) \|", stdout, re.M)}


@pytest.mark.long
def test_train_resume_continues_the_loss_curve_bitwise(tmp_path: Any) -> None:
    # a stand-in for a missing tqdm, to check the fallback to plain log lines on the way
    no_tqdm = tmp_path / "no_tqdm"
    (no_tqdm / "tqdm").mkdir(parents=True)
    (no_tqdm / "tqdm" / "__init__.py").write_text("raise ImportError('tqdm hidden by the test')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(no_tqdm), os.environ.get("PYTHONPATH")])))

    # the uninterrupted run, and (at the same time: independent) the run interrupted after step 3, then resumed: the
    # warmup (10 steps) makes the learning rate of step 4 depend on the restored schedule, the batches on the
    # restored data position
    b = str(tmp_path / "b")
    full, first = concurrently(
        lambda: _train([*TINY, "--steps", "6", "--ckpt-every", "3", "--ckpt-dir", str(tmp_path / "a"), "--no-plot",
                        "--metrics", str(tmp_path / "full.jsonl")], env=env),
        lambda: _train([*TINY, "--steps", "3", "--ckpt-every", "3", "--ckpt-dir", b, "--no-plot",
                        "--metrics", str(tmp_path / "resumed.jsonl")]))
    assert "tqdm is not installed, printing log lines only" in full.stdout, full.stdout
    assert sorted(os.listdir(tmp_path / "a")) == ["step_3", "step_6"]
    png = str(tmp_path / "curve.png")
    resumed = _train([*TINY, "--steps", "6", "--ckpt-every", "3", "--ckpt-dir", b, "--resume", "--plot", png,
                      "--metrics", str(tmp_path / "resumed.jsonl")])
    assert (f"resumed from {os.path.join(b, 'step_3')}: step 3, model, optimizer, schedule, RNG and data "
            "position (epoch 0, batch 3) restored") in resumed.stdout, resumed.stdout

    expected = _losses(full.stdout)
    assert sorted(expected) == [1, 2, 3, 4, 5, 6], full.stdout
    assert all(len(v) > 8 for v in expected.values()), expected  # full precision, not 4 decimals
    assert _losses(first.stdout) == {k: expected[k] for k in (1, 2, 3)}, first.stdout
    # the same arithmetic on the same data in the same order: bitwise equal on any machine
    assert _losses(resumed.stdout) == {k: expected[k] for k in (4, 5, 6)}, resumed.stdout
    assert re.search(rf"^summary: final loss {re.escape(expected[6])} \(first {re.escape(expected[1])}\)",
                     resumed.stdout, re.M), resumed.stdout
    assert "parameters + gradients + optimizer state per rank" in resumed.stdout
    assert sorted(os.listdir(b)) == ["step_3", "step_6"]

    # the JSONL metrics: one line per step, the resumed run appending to the first's
    rows = [json.loads(line) for line in open(tmp_path / "full.jsonl")]
    again = [json.loads(line) for line in open(tmp_path / "resumed.jsonl")]
    assert [r["step"] for r in rows] == [r["step"] for r in again] == [1, 2, 3, 4, 5, 6]
    for r, q in zip(rows, again):
        assert (r["loss"], r["lr"], r.get("eval_loss")) == (q["loss"], q["lr"], q.get("eval_loss")), (r, q)
        assert {"tokens_per_s", "tflops_per_device", "state_bytes"} <= set(r), r
    assert [r["step"] for r in rows if "eval_loss" in r] == [3, 6]
    try:
        import matplotlib  # noqa: F401  (the optional 'plot' extra)
    except ImportError:
        assert "loss curve: skipped, matplotlib is not installed" in resumed.stdout, resumed.stdout
    else:  # the whole curve, the 3 steps before the resume included (from the checkpoint)
        assert f"loss curve: {png} (6 steps)" in resumed.stdout, resumed.stdout
        with open(png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--hsdp", "3", "--nproc", "2"], "--hsdp 3 must divide --nproc (2)"),
        (["--resume"], "--resume needs --ckpt-dir"),
        (["--ckpt-every", "5"], "--ckpt-every needs --ckpt-dir"),
        (["--mixed-precision", "fp16"], "invalid choice: 'fp16'"),
        (["--ckpt-every", "0", "--ckpt-dir", "x"], "must be a positive integer"),
        (["--ckpt-keep", "2"], "--ckpt-keep needs --ckpt-dir"),
        (["--config", "examples/nope.toml"], "--config 'examples/nope.toml': "),
    ],
)
def test_train_rejects_bad_new_flags(args: list[str], message: str) -> None:
    result = subprocess.run([sys.executable, TRAIN, *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result
    assert message in result.stderr, result.stderr
    assert "fully_shard on" not in result.stdout  # no worker was started
