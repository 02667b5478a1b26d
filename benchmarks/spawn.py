"""Run one benchmark job on ``nprocs`` fresh processes (spawn start method, gloo on CPU).

Each job is one spawn: ``fn(rank, world_size, job)`` runs in every process after the default
process group is initialised (gloo, or the ``fake`` backend for the single-process
simulation), with one intra-op thread per process. Rank 0's return value comes back to the
parent through a pickle file. A job that fails or runs past its deadline is reported as an
error string; the other jobs still run.

The rendezvous store (a ``TCPStore``) lives in the parent, as under ``torchrun``: every
rank is a client and the server outlives them all (and takes a free port itself).

Each rank leaves through ``os._exit`` once its result is written and its process group
destroyed, never through interpreter finalization. A gloo worker thread releases a finished
collective (and the tensors it holds, whose Python objects need the GIL) a moment after
``wait()`` returned; on a loaded machine that moment can fall inside ``Py_FinalizeEx``, where
taking the GIL ends the thread with a forced unwind through a ``noexcept`` frame:
``terminate called without an active exception`` (SIGABRT), after all the work was done.
A core dump of such a rank 0 showed exactly that: main thread in ``Py_FinalizeEx``'s garbage
collection, a ``ProcessGroupGloo::runLoop`` thread in ``~AsyncAllreduceWork`` ->
``decref_pyobject`` -> ``gil_scoped_acquire`` -> ``pthread_exit`` -> ``std::terminate``.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any


def _entry(rank: int, fn: Callable[..., Any], world_size: int, port: int, backend: str, job: Any,
           out_path: str) -> None:
    import gc

    from support.processes import die_with_parent

    gc.disable()  # no automatic collection while importing (each walks everything imported so far): see below
    die_with_parent()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        import fully_shard  # noqa: F401
        from support.storages import freeze_heap

        freeze_heap()  # the imports' objects out of every later gc.collect() (the storage tracker's)
        gc.enable()
        if backend == "fake":
            from torch.testing._internal.distributed.fake_pg import FakeStore

            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
        else:
            from datetime import timedelta

            store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))
            dist.init_process_group(
                backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=300)
            )
        result: Any = fn(rank, world_size, job)
        payload = ("ok", result)
    except BaseException:
        payload = ("error", f"rank {rank}:\n{traceback.format_exc()}")
    if rank == 0 or payload[0] == "error":
        path = out_path if rank == 0 else f"{out_path}.rank{rank}"
        with open(path, "wb") as f:
            pickle.dump(payload, f)
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    exit_now(0)


def exit_now(code: int) -> None:
    """Leave the process without interpreter finalization (see the module docstring)."""
    import sys

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def run_job(
    fn: Callable[[int, int, Any], Any], job: Any, nprocs: int = 2, backend: str = "gloo", timeout_s: float = 300.0
) -> tuple[Any, str | None, float]:
    """Run ``fn`` on ``nprocs`` spawned processes; return (rank 0's result, error, wall seconds)."""
    from datetime import timedelta

    import torch.distributed as dist
    import torch.multiprocessing as mp

    start = time.perf_counter()
    # port 0: the server picks a free port itself (no race with another process for it)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300))
    with tempfile.TemporaryDirectory(prefix="fully_shard_bench_") as tmp:
        out_path = os.path.join(tmp, "result.pkl")
        ctx = mp.start_processes(
            _entry,
            args=(fn, nprocs, store.port, backend, job, out_path),
            nprocs=nprocs,
            join=False,
            start_method="spawn",
        )
        error: str | None = None
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=0.5):
                if time.monotonic() > deadline:
                    error = f"timed out after {timeout_s:.0f} s"
                    break
        except Exception as exc:  # a process exited non-zero
            error = f"{type(exc).__name__}: {exc}"
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        result: Any = None
        errors = []
        for name in sorted(os.listdir(tmp)):
            with open(os.path.join(tmp, name), "rb") as f:
                status, value = pickle.load(f)
            if status == "ok":
                result = value
            else:
                errors.append(value)
        if errors:
            error = "\n".join(errors)
        elif result is None and error is None:
            error = "no result from rank 0"
    del store  # every rank has exited: the server may go
    return result, error, time.perf_counter() - start
