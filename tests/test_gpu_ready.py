"""The GPU-ready pieces that a CPU can check: the package names no device, the test
harness's device switch, and the GPU check's logic (``python -m benchmarks.gpu_check``)
run on the CPU with ``--dry-run``."""

from __future__ import annotations

import gzip
import json
import os
import pathlib
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
import torch

from tests import harness
from tests.harness import run_distributed

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_no_cuda_literal_outside_streams() -> None:
    """Everything device-specific is behind fully_shard/streams.py; nothing calls torch.cuda."""
    offenders = []
    for path in sorted((ROOT / "fully_shard").rglob("*.py")):
        text = path.read_text()
        rel = path.relative_to(ROOT).as_posix()
        if "torch.cuda" in text:
            offenders.append(f"{rel}: torch.cuda (use torch.accelerator or fully_shard/streams.py)")
        if rel != "fully_shard/streams.py":
            offenders += [f"{rel}:{i}: {line.strip()}" for i, line in enumerate(text.splitlines(), 1) if "cuda" in line]
    assert not offenders, "device names outside fully_shard/streams.py:\n" + "\n".join(offenders)


def test_device_switch_defaults_to_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(harness.DEVICE_ENV, raising=False)
    assert harness.device_type() == "cpu" and not harness.on_accelerator()
    monkeypatch.setenv(harness.DEVICE_ENV, " CUDA ")
    assert harness.device_type() == "cuda" and harness.on_accelerator()
    mark = harness.skip_on_accelerator("needs the CPU")
    assert mark.args == (True,) and mark.kwargs["reason"] == f"{harness.DEVICE_ENV}=cuda: needs the CPU"


def test_backend_for_world_and_devices() -> None:
    assert harness.backend_for("cpu", 4, 0) == "gloo"
    assert harness.backend_for("cuda", 1, 1) == "cpu:gloo,cuda:nccl"  # world of one: NCCL
    assert harness.backend_for("cuda", 2, 2) == "cpu:gloo,cuda:nccl"  # a GPU per rank
    assert harness.backend_for("cuda", 2, 1) == "gloo"  # NCCL refuses two ranks on one GPU
    with pytest.raises(RuntimeError, match="no cuda device"):
        harness.backend_for("cuda", 1, 0)


def _full_tensor_with_gloo_refusing() -> list[float]:
    """What a rank sharing a device over gloo does (the CPU's kernel stands in for the accelerator's; CPU tensors on a
    CPU mesh, over gloo under the switch too)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sharded = distribute_tensor(torch.arange(4.0, device="cpu"), mesh, [Shard(0)])
    out = torch.empty(4, device="cpu")
    dist.all_gather_into_tensor(out, torch.full((2,), float(dist.get_rank()), device="cpu"))  # c10d: untouched
    assert out.tolist() == [0.0, 0.0, 1.0, 1.0], out
    harness._REFUSALS.append(harness.refuse_gloo_functional_all_gather("cpu"))  # the pool is discarded after the call
    return sharded.full_tensor().tolist()  # DTensor's all-gather: refused, instead of gloo's SIGSEGV on a GPU


def test_ranks_sharing_a_device_over_gloo_skip_instead_of_dying() -> None:
    with pytest.raises(pytest.skip.Exception) as skipped:
        run_distributed(_full_tensor_with_gloo_refusing, 2)
    reason = str(skipped.value)
    assert "_full_tensor_with_gloo_refusing, world_size=2)" in reason and "world size 2 needs 2" in reason, reason
    assert "pytorch/pytorch#152645" in reason, reason
    assert run_distributed(harness.device_type, 2) == [harness.device_type()] * 2  # a fresh pool, no refusal left


def test_only_the_refused_all_gather_on_every_failed_rank_is_a_skip() -> None:
    refused = f"Traceback ...\nRuntimeError: {harness.GLOO_ALL_GATHER_REFUSED} (cuda tensors ...)"
    reason = harness.gloo_skip_reason({0: refused, 1: refused}, 4)
    assert reason is not None and "world size 4 needs 4" in reason and "SIGSEGV" in reason, reason
    # a real failure stays one
    assert harness.gloo_skip_reason({0: refused, 1: "AssertionError: loss differs"}, 2) is None
    assert harness.gloo_skip_reason({0: "worker process died (killed by signal SIGSEGV (exit code -11))"}, 2) is None
    assert harness.gloo_skip_reason({}, 2) is None


def test_a_missing_torch_feature_skips_naming_it_and_the_torch_that_has_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from tests import torch_features

    monkeypatch.setattr(dist, "all_gather_single", lambda *a, **k: None, raising=False)
    assert torch_features.missing_torch_features("dist.all_gather_single") is None
    assert torch_features.requires_torch_feature("dist.all_gather_single").args == (False,)
    monkeypatch.delattr(dist, "all_gather_single")  # as in torch 2.11
    reason = torch_features.missing_torch_features("dist.all_gather_single")
    assert reason == (f"torch {torch.__version__} lacks dist.all_gather_single (torch 2.13 has it): this test compares "
                      "against it")
    assert torch_features.requires_torch_feature("dist.all_gather_single").kwargs["reason"] == reason
    with pytest.raises(pytest.skip.Exception, match="lacks dist.all_gather_single"):
        torch_features.skip_without_torch_feature("dist.all_gather_single")


def _gpu_check(*argv: str) -> subprocess.CompletedProcess[str]:
    """``python -m benchmarks.gpu_check ARGV`` in a process of its own (the tests never import the benchmarks)."""
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_trace_analysis_finds_streams_and_overlap(tmp_path: pathlib.Path) -> None:
    """The device-kernel path of the analysis, on a synthetic trace (times in us)."""

    def kernel(name: str, stream: int, ts: float, dur: float) -> dict[str, object]:
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "tid": stream,
                "args": {"stream": stream}}

    events = [kernel("ampere_bf16_gemm", 7, 0, 100), kernel("CatArrayBatchedCopy", 20, 40, 10),
              kernel("ncclDevKernel_AllGather_RING_LL", 20, 50, 30),
              kernel("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 24, 90, 30)]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    proc = _gpu_check("--analyse", str(path))
    assert proc.returncode == 0, proc.stderr
    first, *table = proc.stdout.splitlines()
    got = json.loads(first)
    assert got["compute_stream"] == "7"
    assert got["collectives"] == {"all-gather": ["20"], "reduce-scatter": ["24"]}
    side, rs = got["streams"]["20"], got["streams"]["24"]
    assert side["kinds"] == ["all-gather", "compute"] and side["kernels"] == 2  # copy-in + all-gather
    assert side["overlap"] == 1.0  # 40..80 inside the gemm's 0..100
    assert abs(rs["overlap"] - 10 / 30) < 1e-12  # 90..100 of 90..120
    assert "| 20 | 2 | 0.04 | all-gather, compute | 100% |" in table, table
    assert "| 24 | 1 | 0.03 | reduce-scatter | 33% |" in table, table


def test_gpu_check_dry_run(tmp_path: pathlib.Path) -> None:
    proc = _gpu_check("--dry-run", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    (md,) = tmp_path.glob("*.md")
    stem = md.with_suffix("")
    text = md.read_text()
    for impl in ("fully_shard", "torch_fsdp2"):
        assert f"| {impl} | no |" in text and f"| {impl} | CPU |" in text, text
    assert "Dry run on the CPU" in text
    for impl in ("fully_shard", "torch_fsdp2"):  # the offload rows, timed by phase
        assert re.search(rf"\| {impl} \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \|", text), text
    svg = ET.parse(f"{stem}-streams.svg").getroot()
    assert any(el.tag.endswith("rect") for el in svg.iter())  # fully_shard's phases drawn
    with gzip.open(f"{stem}-trace.json.gz", "rt") as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert "fully_shard::pre_forward" in names and "fully_shard::post_backward" in names
    losses = {(r["impl"], r["offload"]): r["losses"] for r in json.loads(stem.with_suffix(".json").read_text())["runs"]}
    for offload in (False, True):
        # same initial weights and tokens; bf16 compute, so a bf16-sized tolerance between libraries
        torch.testing.assert_close(losses[("fully_shard", offload)], losses[("torch_fsdp2", offload)],
                                   rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(torch.accelerator.is_available(), reason="this machine has an accelerator")
def test_gpu_check_without_gpu_exits_with_a_message() -> None:
    proc = _gpu_check()
    assert proc.returncode == 2, proc.stderr
    assert "no GPU here" in proc.stderr and "--dry-run" in proc.stderr
