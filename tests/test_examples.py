"""The examples run end to end: examples/train.py launches 2 gloo ranks and learns (also from the
checked-in config, and under a terminal with its progress bar); its
TOML job config, its data sampler's state, its learning-rate schedule and its device choice.

The jobs these tests start run on the CPU on every machine (``--device cpu``), under the suite's
accelerator switch too (docs/gpu.md): their numbers and log lines are the CPU's."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "examples", "train.py")
# Jobs running at once (a job: the launcher and 2 ranks). Most of a job is process start-up and waiting, which the
# others fill; more at once would only queue for the same 2 cores.
_AT_ONCE = 3
# Seconds a job may take: a few at once share the cores, and the suite's other processes too.
_JOB_TIMEOUT = 300


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run examples/train.py; on timeout kill its whole process group (the launcher's
    workers included) so a hang cannot outlive the test."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen(
        [sys.executable, TRAIN, "--device", "cpu", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as timed_out:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"examples/train.py {' '.join(args)} timed out after {timeout} s\n{out}\n"
                             f"{err}") from timed_out
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


_SMALL = ["--nproc", "2", "--steps", "6", "--n-layers", "2", "--dim", "64", "--seq-len", "32", "--batch-size", "4"]
_IN_BACKWARD = ["--nproc", "2", "--steps", "3", "--n-layers", "2", "--dim", "64", "--seq-len", "32", "--batch-size",
                "4", "--warmup", "1", "--grad-accum", "2", "--max-norm", "0", "--tokenizer", "bytes", "--exact-loss",
                "--log-every", "1", "--eval-every", "0", "--no-plot", "--no-progress"]


def _jobs(out: str) -> dict[str, Callable[[], Any]]:
    """The examples/train.py jobs of this module's tests, by name; their files go under ``out``."""
    def at(name: str) -> str:
        return os.path.join(out, name)

    return {
        "learns": lambda: _run([*_SMALL, "--warmup", "2", "--grad-accum", "2", "--gc-freq", "2", "--no-plot",
                                "--metrics", at("m.jsonl"), "--profile", at("prof")], timeout=_JOB_TIMEOUT),
        "muon": lambda: _learns("--optimizer", "muon"),
        "quant": lambda: _learns("--comm-quant", "int4", "--comm-quant-block", "64"),
        "usual": lambda: _run([*_IN_BACKWARD, "--metrics", at("usual.jsonl")], timeout=_JOB_TIMEOUT),
        "in_backward": lambda: _run([*_IN_BACKWARD, "--metrics", at("in_backward.jsonl"), "--optimizer-in-backward"],
                                    timeout=_JOB_TIMEOUT),
        "main_job": lambda: _run(["--config", os.path.join(ROOT, "examples", "llama_small.toml"), "--steps", "2",
                                  "--metrics", at("main.jsonl"), "--no-plot", "--no-progress"], timeout=_JOB_TIMEOUT),
        "terminal": lambda: _in_a_terminal(at("loss.png"), at("terminal.jsonl")),
    }


# the jobs each test reads
_NEEDS = {
    "test_train_example_runs_and_learns": ["learns"],
    "test_train_example_with_muon_learns": ["muon"],
    "test_train_example_with_quantized_collectives_learns": ["quant"],
    "test_optimizer_in_backward_trains_to_the_same_losses": ["usual", "in_backward"],
    "test_checked_in_config_runs_the_main_job": ["main_job"],
    "test_main_job_in_a_terminal_shows_a_tqdm_bar_and_names_its_plot": ["terminal"],
}


@pytest.fixture(scope="module")
def jobs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Every job the selected tests of this module read, started at once (``_AT_ONCE`` at a time) when the first of
    them asks: name -> its ``Future``, and ``"out"`` -> the folder of their files. Each test then checks its own."""
    out = str(tmp_path_factory.mktemp("jobs"))
    selected = {item.originalname for item in request.session.items if item.module is request.module}
    wanted = [name for test, names in _NEEDS.items() if test in selected for name in names]
    made = _jobs(out)
    with ThreadPoolExecutor(_AT_ONCE) as pool:
        futures: dict[str, Any] = {name: pool.submit(made[name]) for name in wanted}
        yield {**futures, "out": out}
        for future in futures.values():
            future.cancel()  # the tests of the jobs not yet started failed or were interrupted


def _result(jobs: dict[str, Any], name: str) -> Any:
    future: Future[Any] = jobs[name]
    return future.result()


def test_train_example_runs_and_learns(jobs: dict[str, Any]) -> None:
    result, tmp_path = _result(jobs, "learns"), jobs["out"]
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
    assert "parameters + gradients + optimizer state per rank" in summary.string[summary.start() :], log
    # --profile: a Chrome trace per rank with fully_shard's phase labels in it
    for rank in range(2):
        with open(os.path.join(str(tmp_path), "prof", f"rank{rank}.json")) as f:
            trace = f.read()
        for phase in ("pre_forward", "post_forward", "pre_backward", "post_backward"):
            assert f'"fully_shard::{phase}"' in trace, (rank, phase)
        # each collective's range names its group, as torch's do
        for name in ("all_gather layers.0", "all_gather layers.1", "reduce_scatter layers.1",
                     "reduce_scatter layers.0"):
            assert f'"fully_shard::{name}"' in trace, (rank, name)


def _learns(*flags: str) -> str:
    """A 6-step run of a small job with ``flags``: it exits 0 and its loss goes down; its stdout (and log)."""
    result = _run([*_SMALL, *flags, "--no-plot", "--no-progress"], timeout=_JOB_TIMEOUT)
    log = f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 0, log
    losses = [float(m) for m in re.findall(r"^step\s+\d+/6 \| loss (\d+\.\d+)", result.stdout, re.M)]
    assert len(losses) >= 2 and losses[-1] < losses[0], log
    return log


def test_train_example_with_muon_learns(jobs: dict[str, Any]) -> None:
    log = _result(jobs, "muon")
    assert "MuonAdamW" in log, log


def test_train_example_with_quantized_collectives_learns(jobs: dict[str, Any]) -> None:
    log = _result(jobs, "quant")
    assert ("quantized collectives: (root): weights int8, grads int4 (exact: tok_embeddings.weight, norm.weight)"
            in log), log


def test_train_example_rejects_bad_flags() -> None:
    result = _run(["--dim", "30", "--n-heads", "4"], timeout=60)
    assert result.returncode == 2, result
    assert "--dim (30) must be divisible by --n-heads (4)" in result.stderr, result.stderr
    assert "fully_shard on" not in result.stdout  # no worker was started
    result = _run(["--optimizer-in-backward"], timeout=60)  # --max-norm is 1.0 by default
    assert (result.returncode == 2
            and "pass --max-norm 0 (clipping needs the norm of every gradient)" in result.stderr), result


def test_optimizer_in_backward_trains_to_the_same_losses(jobs: dict[str, Any]) -> None:
    """--optimizer-in-backward (an AdamW per parameter, stepped from its post-accumulate-grad hook) against the usual
    step, with gradient accumulation: the same losses to the last digit (AdamW is elementwise: the same arithmetic on
    every element), and less held per rank (no step keeps every gradient)."""
    runs = []
    for result in (_result(jobs, "usual"), _result(jobs, "in_backward")):
        log = f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
        assert result.returncode == 0, log
        losses = re.findall(r"^step\s+\d+/3 \| loss (\S+) ", result.stdout, re.M)
        state = re.search(r"^summary: .* \| eval loss (\S+) .* per rank ([\d.,]+) (KiB|MiB)$", result.stdout, re.M)
        assert len(losses) == 3 and state is not None, log
        runs.append((losses, state.group(1),
                     float(state.group(2).replace(",", "")) * {"KiB": 1, "MiB": 1024}[state.group(3)]))
    assert "optimizer AdamW in backward, 2 blocks" in result.stdout, result.stdout
    (losses, eval_loss, state), (losses_ib, eval_loss_ib, state_ib) = runs
    assert losses_ib == losses and eval_loss_ib == eval_loss, runs
    assert state_ib < state, runs  # parameters + optimizer state, without the gradients


def test_device_choice_needs_a_device_per_process() -> None:
    _examples()
    from common import choose_device

    assert choose_device("auto", None, 0, 2) == ("cpu", None)
    assert choose_device("auto", "cuda", 2, 2) == ("cuda", None)
    device, note = choose_device("auto", "cuda", 1, 2)  # NCCL refuses two processes on one GPU
    assert (device == "cpu" and note is not None and "2 processes here but 1 cuda device(s)" in note
            and "--nproc 1" in note)
    assert choose_device("cpu", "cuda", 8, 2) == ("cpu", None)
    assert choose_device("cuda", "cuda", 8, 8) == ("cuda", None)
    for requested, accelerator, count, message in [("cuda", "cuda", 1, "2 processes here but 1 cuda device(s)"),
                                                   ("cuda", None, 0, "this machine's accelerator is none")]:
        try:
            choose_device(requested, accelerator, count, 2)
            raise AssertionError("no error")
        except ValueError as e:
            assert message in str(e) and "--device cpu" in str(e), e


def test_train_example_refuses_too_few_devices_before_starting_workers() -> None:
    # more processes than any machine here has GPUs: refused with or without an accelerator
    result = subprocess.run([sys.executable, TRAIN, "--device", "cuda", "--nproc", "64"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60, env=dict(os.environ, PYTHONPATH=ROOT))
    assert result.returncode == 2, result
    assert "examples/train.py: error: --device cuda:" in result.stderr, result.stderr
    assert "fully_shard on" not in result.stdout  # no worker was started


def _examples() -> None:
    if os.path.join(ROOT, "examples") not in sys.path:
        sys.path.insert(0, os.path.join(ROOT, "examples"))


def test_toml_config_sets_flags_and_flags_override_it(tmp_path: object) -> None:
    _examples()
    import train

    checked_in = train.parse_args(["--config", os.path.join(ROOT, "examples", "llama_small.toml")])
    assert (checked_in.steps, checked_in.dim, checked_in.vocab_size) == (120, 128, 1024)
    config = os.path.join(str(tmp_path), "job.toml")
    with open(config, "w") as f:
        f.write('[model]\ndim = 64\nn-heads = 2\n[training]\nsteps = 7\nlr = 1e-3\nactivation_checkpointing = true\n')
    args = train.parse_args(["--config", config, "--steps", "9"])
    assert (args.dim, args.n_heads, args.lr, args.activation_checkpointing) == (64, 2, 1e-3, True)
    assert args.steps == 9  # the flag wins over the file
    assert "--steps=9" in train.worker_argv(args) and "--activation-checkpointing" in train.worker_argv(args)

    with open(config, "w") as f:
        f.write("[training]\nstepz = 7\n")
    result = subprocess.run([sys.executable, TRAIN, "--config", config], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "unknown key 'stepz'" in result.stderr, result.stderr
    with open(config, "w") as f:
        f.write('mixed_precision = "fp8"\n')
    result = subprocess.run([sys.executable, TRAIN, "--config", config], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "mixed_precision = 'fp8' is not one of" in result.stderr, result.stderr


def test_sampler_state_resumes_the_exact_batches() -> None:
    _examples()
    from common import StatefulBatchSampler

    def take(sampler: StatefulBatchSampler, n: int) -> list[list[int]]:
        it = iter(sampler)
        return [next(it) for _ in range(n)]

    whole = [take(StatefulBatchSampler(50, 3, r, 2, seed=1), 20) for r in range(2)]  # 8 per epoch: crosses 2
    for rank in range(2):
        first = StatefulBatchSampler(50, 3, rank, 2, seed=1)
        head = take(first, 11)
        state = first.state_dict()
        assert state == {"epoch": 1, "batch": 3}
        second = StatefulBatchSampler(50, 3, rank, 2, seed=1)
        second.load_state_dict(state)
        assert head + take(second, 9) == whole[rank]
    epoch0 = [i for r in range(2) for b in whole[r][:8] for i in b]
    assert len(set(epoch0)) == 48  # within an epoch no window is read twice, by any rank


def test_lr_schedule_warms_up_then_decays() -> None:
    _examples()
    from common import lr_lambda

    f = lr_lambda(warmup=4, total=20, min_ratio=0.1)
    warm = [f(s) for s in range(5)]
    assert warm == sorted(warm) and warm[0] > 0 and f(4) == 1.0
    decay = [f(s) for s in range(4, 21)]
    assert decay == sorted(decay, reverse=True) and abs(f(20) - 0.1) < 1e-12 and f(100) == f(20)


def test_checked_in_config_runs_the_main_job(jobs: dict[str, Any]) -> None:
    """examples/train.py --config examples/llama_small.toml, cut to 2 steps by flags (flags win)
    and with its outputs in a temporary folder: the config's ranks, model, tokenizer and schedule are used."""
    _examples()
    from common import lr_lambda

    metrics = os.path.join(jobs["out"], "main.jsonl")
    result = _result(jobs, "main_job")
    log = f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 0, log
    # [job] nproc = 2; [model] n_layers = 4, dim = 128, tokenizer = "bpe", vocab_size = 1024
    assert re.search(r"^fully_shard on 2 ranks \(gloo, cpu\) \| [\d,]+ parameters, optimizer AdamW, 4 blocks, dim 128 "
                     r"\| mesh \(2,\) \| data: [\d,]+ tokens \(bpe, vocabulary 1024\)", result.stdout, re.M), log
    assert re.findall(r"^step\s+(\d+)/2 \|", result.stdout, re.M) == ["1", "2"], log  # --steps 2 over steps = 120
    with open(metrics) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [1, 2], rows
    # [training] lr = 3e-3, warmup = 10: LambdaLR multiplies the base lr by the schedule's factor
    assert [r["lr"] for r in rows] == [3e-3 * lr_lambda(10, 2)(s) for s in (0, 1)], rows
    assert "eval_loss" in rows[-1] and "eval_loss" not in rows[0], rows  # eval_every = 40: only the last step


def test_main_job_in_a_terminal_shows_a_tqdm_bar_and_names_its_plot(jobs: dict[str, Any]) -> None:
    """The first command as a user sees it: under a pseudo-terminal, rank 0 draws a tqdm bar with
    loss and tokens/s, the run ends naming the loss plot it wrote, and torch prints no NumPy warning."""
    plot, output = _result(jobs, "terminal")
    # the bar's last state (written on close), e.g. "train: 100%|████| 3/3 [00:02<00:00, 1.2step/s, loss 5.4321, 1,234
    # tokens/s]"
    assert re.search(r"train: 100%\|[^\r\n]*\| 3/3 \[[^\]\r\n]*, loss \d+\.\d{4}, [\d,]+ tokens/s\]", output), output
    assert f"loss curve: {plot} (3 steps)" in output and os.path.getsize(plot) > 0, output
    assert "NumPy" not in output, output  # torch: "Failed to initialize NumPy" when numpy is missing


def _in_a_terminal(plot: str, metrics: str) -> tuple[str, str]:
    """A small job under a pseudo-terminal of 200 columns: the loss plot's path and everything the terminal showed."""
    import fcntl
    import pty
    import select
    import struct
    import termios
    import time

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))  # 200 columns: room for the postfix
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen(
        [sys.executable, TRAIN, "--device", "cpu", "--nproc", "2", "--steps", "3", "--n-layers", "1", "--dim", "32",
         "--seq-len", "16",
         "--batch-size", "2", "--tokenizer", "bytes", "--eval-batches", "1", "--plot", plot,
         "--metrics", metrics],
        cwd=ROOT, env=env, stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
    )
    os.close(slave)
    chunks, deadline = [], time.monotonic() + _JOB_TIMEOUT
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: every process holding the terminal has exited
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        else:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError("examples/train.py under a terminal timed out:\n"
                                 + b"".join(chunks).decode(errors="replace"))
        assert proc.wait(timeout=30) == 0, b"".join(chunks).decode(errors="replace")
    finally:
        os.close(master)
    return plot, b"".join(chunks).decode(errors="replace")
