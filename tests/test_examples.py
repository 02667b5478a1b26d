"""The examples run end to end: examples/train.py launches 2 gloo ranks and learns."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "examples", "train.py")


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run examples/train.py; on timeout kill its whole process group (the launcher's
    workers included) so a hang cannot outlive the test."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen(
        [sys.executable, TRAIN, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"examples/train.py {' '.join(args)} timed out after {timeout} s\n{out}\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_train_example_runs_and_learns() -> None:
    result = _run(
        ["--nproc", "2", "--steps", "6", "--n-layers", "2", "--dim", "64", "--seq-len", "32", "--batch-size", "4"],
        timeout=150,
    )
    log = f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 0, log
    assert "fully_shard on 2 ranks" in result.stdout, log
    losses = [float(m) for m in re.findall(r"^step\s+\d+/6 \| loss (\d+\.\d+)", result.stdout, re.M)]
    assert len(losses) >= 2, log  # step 1 and the last step are always logged
    summary = re.search(r"^summary: final loss (\d+\.\d+)", result.stdout, re.M)
    assert summary is not None, log
    final = float(summary.group(1))
    assert final == losses[-1], log
    assert final < losses[0], log
    assert "parameter bytes per rank" in summary.string[summary.start() :], log


def test_train_example_with_muon_learns() -> None:
    result = _run(
        ["--nproc", "2", "--steps", "6", "--n-layers", "2", "--dim", "64", "--seq-len", "32", "--batch-size", "4",
         "--optimizer", "muon", "--no-plot", "--no-progress"],
        timeout=150,
    )
    log = f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 0, log
    assert "MuonAdamW" in result.stdout, log
    losses = [float(m) for m in re.findall(r"^step\s+\d+/6 \| loss (\d+\.\d+)", result.stdout, re.M)]
    assert len(losses) >= 2 and losses[-1] < losses[0], log


def test_train_example_rejects_bad_flags() -> None:
    result = _run(["--dim", "30", "--n-heads", "4"], timeout=60)
    assert result.returncode == 2, result
    assert "--dim (30) must be divisible by --n-heads (4)" in result.stderr, result.stderr
    assert "fully_shard on" not in result.stdout  # no worker was started
