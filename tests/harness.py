"""Multi-process test harness: run a function on N gloo ranks, get per-rank results.

Usage from a test module::

    from tests.harness import run_distributed

    def _body(n):                      # module level, so it pickles by reference
        import torch.distributed as dist
        t = torch.full((n,), float(dist.get_rank()))
        dist.all_reduce(t)
        return t.tolist()

    def test_all_reduce():
        results = run_distributed(_body, 2, 3)     # list indexed by rank
        assert results == [[1.0] * 3, [1.0] * 3]

Design:

* One pool of worker processes per world size, kept alive (module-level cache) and forked from a fork server
  (``multiprocessing``'s ``forkserver`` start method; ``spawn`` where the platform has none, and under the device
  switch below) that imported torch and fully_shard once (:func:`preload`, through ``tests._forkserver_preload``):
  a pool starts in a fraction of a second instead of each rank paying ~2.4 CPU-s of imports, which matters because a
  failed call, or a worker left holding threads, replaces its pool (the suite starts a few dozen). A worker takes the
  parent's environment as it is when the pool starts, as a spawned one would.
* Each worker initialises the default process group once (gloo, through a TCPStore
  that the parent hosts on 127.0.0.1, as torchrun does) and then serves calls over a
  ``multiprocessing`` Pipe.  Before every call the worker runs
  ``torch.manual_seed(0)`` and resets ``torch.distributed`` state left by a
  previous test (a destroyed default group
  is re-created, DeviceMesh context stack is cleared).
* After every call the worker destroys every process group the call made (subgroups,
  DeviceMesh dimension groups, fully_shard's k-rank groups): each gloo group holds three
  threads until its last reference goes, and a worker that served a few hundred tests
  used to hold 862 of them. A worker counts its threads while it serves a call and after
  the clean-up; a call whose worker went over :data:`THREAD_LIMIT` fails, naming the count
  (:func:`thread_peaks` has the highest counts seen, per world size). A pool whose worker
  still holds more than half the limit after the clean-up (groups some cache of torch's
  keeps) is replaced before the next call, so nothing adds up over calls. So is a pool whose worker's heap grew by
  more than :data:`RECYCLE_BLOCKS` memory blocks (``sys.getallocatedblocks()``) since it started: what compiled
  models, their graphs and caches leave makes every later ``gc.collect()`` walk it (after the compile tests, 800,000
  objects: the planner's measured grid took 65 s in the long suite, 19 s with this), and a new pool starts in a
  fraction of a second.
* The one exception: meshes made by ``init_device_mesh`` are shared by the calls of a pool, as in one
  training job: a call that asks for a mesh another call made (the same device type, shape and dimension names)
  gets the same ``DeviceMesh``, whose groups stay, and so do DTensor's sharding caches, which are keyed by equal
  meshes (recomputing them after every call was a fifth of the workers' time). At most
  :data:`MESH_GROUPS_KEPT` groups stay; a call that made any other group (``new_group``, a flattened or sliced
  mesh's group, k-rank groups) or more meshes than that is cleaned up as above, its shared meshes with it.
* The preload freezes what it imported (torch's DTensor, dynamo and sympy with fully_shard, and inductor, which the
  compile tests use: about 370,000 objects that live as long as the worker; ``gc.freeze()``,
  ``support.storages.freeze_heap``): every later ``gc.collect()`` (the storage tracker's on each entry, the
  clean-up's) walks only what the calls made, which took the planner's measured grid from 10 s to 4 s per rank.
* Workers run with one intra-op thread and deterministic algorithms, and die with the
  parent (``PR_SET_PDEATHSIG`` on Linux): nothing outlives a killed test run.
* A rank that crashes (SIGSEGV, SIGABRT: heap corruption, a C++ abort) or hangs says where: each worker has
  ``faulthandler`` write every thread's Python stack to a file of the pool's, on a fatal signal and on ``SIGUSR1``,
  which the parent sends to the ranks still in a call before it kills the pool; the failure quotes the stacks.
* The device switch: ``FULLY_SHARD_TEST_DEVICE=cuda`` (any accelerator type torch knows)
  runs every worker on ``cuda:(rank % device_count)`` with that device as torch's default
  device, so a test's models and inputs are made there without edits. The backend is NCCL
  (``cpu:gloo,cuda:nccl``) where every rank has its own GPU; NCCL cannot run two ranks on
  one GPU, so with fewer GPUs than ranks it is gloo (with CUDA tensors). Tests ask
  :func:`device_type` / :func:`mesh` instead of writing ``"cpu"``, and mark what cannot
  run there with :func:`skip_on_accelerator`. Unset (the default), everything is CPU/gloo
  exactly as before.
* Ranks sharing a device over gloo (under the switch, fewer devices than ranks): torch's
  functional all-gather (``DTensor.full_tensor()``, ``redistribute`` to ``Replicate``) reaches
  gloo's ``allgather_into_tensor_coalesced``, which has no accelerator path and kills every
  rank with SIGSEGV, no traceback (pytorch/pytorch#152645). The workers refuse that op with a
  Python error instead (fully_shard's own collectives do run there), and a call that fails only
  with it is skipped, saying the world size needs a device per rank.
* If any rank raises, dies, or the deadline passes, the call fails with a
  :class:`DistributedTestFailure` (an ``AssertionError``) naming every failed
  or hung rank with its full traceback, and the pool is discarded: the next
  call on that world size starts a fresh one.  This keeps a failing test from
  poisoning later tests with mismatched collectives.

This module only imports the standard library at import time; torch is
imported by the fork server (or a spawned worker) after thread-count environment variables are set.
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

from support.processes import die_with_parent

__all__ = [
    "DEVICE_ENV",
    "DistributedTestFailure",
    "GLOO_ALL_GATHER_REFUSED",
    "THREAD_LIMIT",
    "backend_for",
    "concurrently",
    "device",
    "device_type",
    "gloo_skip_reason",
    "mesh",
    "pool_starts",
    "refuse_gloo_functional_all_gather",
    "run_distributed",
    "shutdown_pools",
    "skip_on_accelerator",
    "thread_peaks",
]

# Seconds given to the other ranks to report after the first rank failed.
_ERROR_GRACE_S = 2.0
# Seconds allowed for a pool to start (spawn + import torch + init_process_group): 4 ranks took over 120 s on 2
# cores under a load average of 110 (the suite of other checkouts running beside this one).
_STARTUP_TIMEOUT_S = 300.0
# Collective / store timeout inside the workers.
_PG_TIMEOUT = timedelta(seconds=60)
# Attempts to start a pool (a start-up that failed on a busy port is retried).
_STARTUP_ATTEMPTS = 3
# The most threads a worker may hold at any point of a call (its default group, torch's pools, a call's own groups).
THREAD_LIMIT = 64
# The most process groups of shared meshes (init_device_mesh's, reused by later calls) a worker keeps between calls.
MESH_GROUPS_KEPT = 6
# A worker whose heap grew by more than this many memory blocks since it started (seen after a call) is replaced before
# the next call (module docstring): about 400,000 objects, a full collection of 0.2-0.4 s
RECYCLE_BLOCKS = 1_000_000
# (device type, shape, dimension names, other arguments) -> the DeviceMesh the worker's calls share
_MESHES: dict[Any, Any] = {}
# Seconds a rank whose call returned waits for the other ranks' calls before it destroys the call's groups.
_RETURNED_WAIT_S = 60.0
# Seconds a hung rank is given to write its Python stacks (SIGUSR1, faulthandler) before its pool is killed.
_STACKS_WAIT_S = 1.0
# The most characters of a rank's stacks quoted in a failure (its first ones: the thread that crashed comes first).
_STACKS_QUOTED = 12_000
# Seconds between two counts of a worker's threads while it serves a call.
_THREAD_WATCH_PERIOD_S = 0.02


# --------------------------------------------------------------------------
# The device switch
# --------------------------------------------------------------------------

# Environment variable naming the device type the suite runs on (default: cpu).
DEVICE_ENV = "FULLY_SHARD_TEST_DEVICE"


def device_type() -> str:
    """The device type tests run on: ``"cpu"`` unless ``FULLY_SHARD_TEST_DEVICE`` names an
    accelerator (``cuda``, ...). Use it where a test would write ``"cpu"``::

        mesh = init_device_mesh(device_type(), (dist.get_world_size(),))
    """
    return os.environ.get(DEVICE_ENV, "").strip().lower() or "cpu"


def on_accelerator() -> bool:
    """Whether the suite runs under the accelerator switch."""
    return device_type() != "cpu"


def device() -> Any:
    """Inside a worker: this rank's ``torch.device`` (``cpu``, or ``cuda:<rank % count>``)."""
    import torch

    if not on_accelerator():
        return torch.device("cpu")
    return torch.device(device_type(), torch.accelerator.current_device_index())


def mesh(shape: tuple[int, ...] | int, names: tuple[str, ...] | None = None) -> Any:
    """Inside a worker: ``init_device_mesh`` on the suite's device type."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return init_device_mesh(device_type(), shape, mesh_dim_names=names)


def backend_for(dev_type: str, world_size: int, device_count: int) -> str:
    """The process-group backend for ``world_size`` ranks on ``device_count`` devices.

    CPU: gloo. An accelerator: its own backend (NCCL for CUDA) for its tensors, gloo for CPU
    tensors, when every rank has a device of its own; NCCL refuses two ranks on one GPU, so
    with fewer devices than ranks it is gloo for both (gloo takes CUDA tensors).
    """
    if dev_type == "cpu":
        return "gloo"
    if device_count < 1:
        raise RuntimeError(f"{DEVICE_ENV}={dev_type}: no {dev_type} device is visible to this process")
    if world_size > device_count:
        return "gloo"
    import torch.distributed as dist

    return f"cpu:gloo,{dev_type}:{dist.get_default_backend_for_device(dev_type)}"


# The text of the error a rank raises instead of gloo's SIGSEGV (see the module docstring).
GLOO_ALL_GATHER_REFUSED = "gloo has no accelerator path for the functional all-gather"
_REFUSALS: list[Any] = []  # a worker's registrations, alive as long as it serves


def refuse_gloo_functional_all_gather(dev_type: str) -> Any:
    """In a rank whose process group carries ``dev_type`` tensors over gloo: make torch's functional all-gather
    (``_c10d_functional.all_gather_into_tensor[_coalesced]``, as ``DTensor.full_tensor()`` calls it) raise a Python
    error for ``dev_type`` tensors, where gloo would copy device pointers on the host and die of SIGSEGV. Returns the
    registration (keep it alive). The c10d collectives (``all_gather_into_tensor``, ...) are untouched: gloo has an
    accelerator path for those."""
    import torch

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{GLOO_ALL_GATHER_REFUSED} ({dev_type} tensors: DTensor.full_tensor(), redistribute to Replicate): it "
            "would die of SIGSEGV (pytorch/pytorch#152645); refused by tests/harness.py. Give each rank a device of "
            "its own (NCCL)"
        )

    lib = torch.library.Library("_c10d_functional", "IMPL")
    for op in ("all_gather_into_tensor", "all_gather_into_tensor_coalesced"):  # a kernel for this device's key only
        lib.impl(op, refuse, dev_type.upper())
    return lib


def gloo_skip_reason(failures: dict[int, str], world_size: int) -> str | None:
    """Why a call that failed on ``failures`` (rank -> traceback) is a skip rather than a failure: every failed rank
    hit the refused all-gather (a world of ranks sharing a device over gloo). None: a real failure."""
    if not failures or not all(GLOO_ALL_GATHER_REFUSED in text for text in failures.values()):
        return None
    return (
        f"{DEVICE_ENV}={device_type()}: world size {world_size} needs {world_size} {device_type()} devices (one per "
        "rank, NCCL); with fewer the ranks share one over gloo, whose functional all-gather (DTensor.full_tensor, "
        f"redistribute) has no {device_type()} path and dies of SIGSEGV (pytorch/pytorch#152645)"
    )


def skip_on_accelerator(reason: str) -> Any:
    """A pytest mark: skip this test under the accelerator switch, saying why."""
    import pytest

    return pytest.mark.skipif(on_accelerator(), reason=f"{DEVICE_ENV}={device_type()}: {reason}")


class DistributedTestFailure(AssertionError):
    """A ``run_distributed`` call failed on one or more ranks.

    Attributes:
        failures: rank -> formatted traceback (or death description) for the
            ranks that raised or died.
        unfinished: ranks that never reported (hung or killed after a failure).
        results: rank -> result for the ranks that completed normally.
    """

    def __init__(
        self,
        message: str,
        failures: dict[int, str],
        unfinished: list[int],
        results: dict[int, Any],
    ) -> None:
        super().__init__(message)
        self.failures = failures
        self.unfinished = unfinished
        self.results = results


# --------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------

_MSG_CALL = "call"
_MSG_STOP = "stop"
_MSG_READY = "ready"
_MSG_OK = "ok"
_MSG_ERR = "err"


def _init_default_group(store: Any, generation: int, rank: int, world_size: int) -> None:
    import torch
    import torch.distributed as dist

    count = torch.accelerator.device_count() if on_accelerator() else 0
    dist.init_process_group(
        backend_for(device_type(), world_size, count),
        store=dist.PrefixStore(f"harness_pg{generation}/", store),
        rank=rank,
        world_size=world_size,
        timeout=_PG_TIMEOUT,
    )


def _reset_distributed_state(store: Any, state: dict[str, int], rank: int, world_size: int) -> None:
    """Undo ``torch.distributed`` state that a previous test may have left behind."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    comm = sys.modules.get("fully_shard.comm")
    if comm is not None:
        comm.monitor.reset()  # observers and debug mode a previous test may have left on
        if os.environ.get(comm.DEBUG_ENV, "") == "1":
            sys.modules["fully_shard.tools.debug"].set_debug(True)  # the run's own FULLY_SHARD_DEBUG=1 stays on
    if not dist.is_initialized():
        # The previous test destroyed the default group; every rank sees the
        # same thing (a test that fails on some ranks discards the pool), so
        # all ranks re-create it with the same store prefix.
        state["generation"] += 1
        _init_default_group(store, state["generation"], rank, world_size)
        return
    c10d._world.pg_coalesce_state.clear()
    _drop_mesh_stack()


def _drop_mesh_stack() -> None:
    """Empty DeviceMesh's context stack (``with mesh:``), which a test may leave holding meshes."""
    try:
        from torch.distributed.device_mesh import _mesh_resources

        _mesh_resources.mesh_stack.clear()
    except Exception:  # pragma: no cover - private API moved
        pass


def _thread_count() -> int:
    """This process's threads, the native ones too (gloo's): Linux lists them under /proc."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # pragma: no cover - not Linux: the Python threads alone
        return threading.active_count()


class _ThreadWatch:
    """Counts the worker's threads every few milliseconds while a call runs; ``take`` gives the most it saw."""

    def __init__(self) -> None:
        self.peak = 0
        self.serving = threading.Event()
        threading.Thread(target=self._watch, name="harness-thread-watch", daemon=True).start()

    def _watch(self) -> None:
        while True:
            self.serving.wait()
            self.peak = max(self.peak, _thread_count())
            time.sleep(_THREAD_WATCH_PERIOD_S)

    def start(self) -> None:
        self.peak = _thread_count()
        self.serving.set()

    def take(self) -> int:
        self.serving.clear()
        return max(self.peak, _thread_count())


def _every_rank_returned(store: Any, state: dict[str, int], world_size: int) -> bool:
    """Say that this rank's call returned, and wait until every rank's has. A group the call made may still carry
    another rank's collective (a test where one rank returns and the other waits for the group's timeout):
    destroying it on one rank first would close the connection under the other. False if the other ranks have not
    returned within the wait: the groups are then left, and the pool is replaced once its threads show it."""
    from datetime import timedelta

    state["calls"] = state.get("calls", 0) + 1
    key = f"harness_returned/{state['calls']}"
    if store.add(key, 1) == world_size:
        store.set(key + "/all", "1")
    try:
        store.wait([key + "/all"], timedelta(seconds=_RETURNED_WAIT_S))
    except Exception:  # noqa: BLE001 - a rank still in the call (a hang is the parent's to report)
        return False
    return True


def _release_groups() -> None:
    """Destroy every process group but the default one (what the call made: subgroups, a DeviceMesh's dimension
    groups, fully_shard's k-rank groups) and drop the caches that hold them; a gloo group's threads end with its last
    reference, so whatever else still holds one (a model of the call in a reference cycle) is collected. Unless the
    call made no group but the shared meshes' (module docstring): then they, and DTensor's caches, stay."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():  # the call destroyed the world, its shared meshes' groups with it
        _MESHES.clear()
        _clear_dtensor_caches()
        return
    default = c10d._get_default_group()
    _drop_mesh_stack()  # a mesh entered with ``with mesh:`` and never left holds its groups
    made = [pg for pg in c10d._world.pg_names if pg is not default]
    mesh_module = sys.modules.get("fully_shard.mesh")
    if mesh_module is not None:
        mesh_module._k_rank_groups.clear()  # reshard_after_forward=k's groups, made once per world
    kept = {id(pg) for mesh in _MESHES.values() for pg in mesh.get_all_groups() if pg is not default}
    alive = {id(pg) for pg in made}
    if alive == kept and len(kept) <= MESH_GROUPS_KEPT:
        return  # the call made no group but its shared meshes': they and DTensor's caches stay for the next calls
    _MESHES.clear()
    while made:
        dist.destroy_process_group(made.pop())
    _clear_dtensor_caches()
    gc.collect()


def _share_meshes() -> None:
    """Make ``init_device_mesh`` return the mesh an earlier call made with the same arguments (module docstring)."""
    import functools

    import torch.distributed as dist
    import torch.distributed.device_mesh as device_mesh

    make = device_mesh.init_device_mesh
    if getattr(make, "_shared_by_harness", False):
        return

    @functools.wraps(make)
    def init_device_mesh(device_type: str, mesh_shape: tuple[int, ...], *, mesh_dim_names: Any = None,
                         **kwargs: Any) -> Any:
        key = (device_type, tuple(mesh_shape), None if mesh_dim_names is None else tuple(mesh_dim_names),
               tuple(sorted(kwargs.items())))
        mesh = _MESHES.get(key)
        if mesh is None:
            mesh = _MESHES[key] = make(device_type, mesh_shape, mesh_dim_names=mesh_dim_names, **kwargs)
        return mesh

    init_device_mesh._shared_by_harness = True  # type: ignore[attr-defined]
    device_mesh.init_device_mesh = init_device_mesh  # before any test module (or fully_shard) imports it
    if getattr(dist, "init_device_mesh", None) is make:
        dist.init_device_mesh = init_device_mesh


def _clear_dtensor_caches() -> None:
    """DTensor's caches (sharding propagation: Python and C++; redistribute plans) keep every mesh they saw, and a
    mesh keeps its groups: without this, a destroyed group's threads live on, and an equal mesh of a later call would
    get output specs that name the old mesh's destroyed groups."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor import _redistribute, _sharding_prop
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _sharding_prop.ShardingPropagator._propagate_tensor_meta_cached.cache_clear()
    for cached in vars(_redistribute).values():
        if callable(getattr(cached, "cache_clear", None)):
            cached.cache_clear()


def _flush_std_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # pragma: no cover
            pass


def _use_accelerator(rank: int) -> None:
    """Under the switch: this rank's device (rank % device_count) becomes current and torch's
    default device, so the models and inputs a test makes land there."""
    import torch

    dev_type = device_type()
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is None or accelerator.type != dev_type:
        found = accelerator.type if accelerator is not None else "none"
        raise RuntimeError(
            f"{DEVICE_ENV}={dev_type} but this machine's accelerator is {found}; unset "
            f"{DEVICE_ENV} to run the suite on the CPU"
        )
    index = rank % torch.accelerator.device_count()
    torch.accelerator.set_device_index(index)
    torch.set_default_device(torch.device(dev_type, index))


class _ToCpuPickler(pickle.Pickler):
    """Results cross to the parent as CPU tensors: the parent never touches the accelerator."""

    def reducer_override(self, obj: Any) -> Any:
        import torch

        if isinstance(obj, torch.Tensor) and obj.device.type not in ("cpu", "meta"):
            return obj.detach().cpu().__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        return NotImplemented


def _dumps_result(result: Any) -> bytes:
    if not on_accelerator():
        return pickle.dumps(result)
    import io

    buf = io.BytesIO()
    _ToCpuPickler(buf, pickle.HIGHEST_PROTOCOL).dump(result)
    return buf.getvalue()


def preload() -> None:
    """What every worker imports before its first call, done once: in the fork server (``tests._forkserver_preload``),
    whose children inherit it, or in a spawned worker itself. ``init_device_mesh`` shared first (fully_shard binds the
    name at import), then torch and fully_shard, whose objects are frozen out of every later ``gc.collect()``."""
    global _PRELOADED
    if _PRELOADED:
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
    _share_meshes()
    import torch._inductor.compile_fx  # noqa: F401 - the compile tests' (0.7 CPU-s a worker otherwise)

    import fully_shard  # noqa: F401
    from support.storages import freeze_heap

    freeze_heap()
    gc.enable()  # off while the fork server imported (tests._forkserver_preload)
    _PRELOADED = True


_PRELOADED = False


def _worker_main(rank: int, world_size: int, port: int, conn: multiprocessing.connection.Connection,
                 env: dict[str, str], stacks_path: str) -> None:
    die_with_parent()
    # where a crash or a hang shows (module docstring): the file object must live as long as the process
    stacks = open(stacks_path, "w")  # noqa: SIM115
    faulthandler.enable(stacks, all_threads=True)
    if hasattr(signal, "SIGUSR1"):  # not on Windows
        faulthandler.register(signal.SIGUSR1, stacks, all_threads=True)
    os.environ.clear()  # the parent's environment now, not the fork server's when it started
    os.environ.update(env)
    os.environ["FULLY_SHARD_TEST_WORKER"] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
    if on_accelerator():
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    # Ctrl-C goes to the whole process group; let the parent decide what to do.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    try:
        preload()
        import torch
        import torch.distributed as dist

        # the same arithmetic on every machine: one intra-op thread (no thread-count-dependent
        # reduction splits), deterministic kernels where an op has a nondeterministic variant
        torch.set_num_threads(1)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:  # pragma: no cover - already set
            pass
        if on_accelerator():
            _use_accelerator(rank)
        torch.use_deterministic_algorithms(True, warn_only=True)
        # the parent hosts the store (as torchrun does): no rank has to outlive the others
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=_PG_TIMEOUT)
        state = {"generation": 0}
        _init_default_group(store, state["generation"], rank, world_size)
        if on_accelerator() and dist.get_backend() == "gloo":  # ranks share a device: an error, not gloo's SIGSEGV
            _REFUSALS.append(refuse_gloo_functional_all_gather(device_type()))
    except BaseException:
        conn.send((_MSG_ERR, "worker start-up failed:\n" + traceback.format_exc()))
        _flush_std_streams()
        os._exit(1)  # as below: no finalization while a half-made process group may hold threads
    watch = _ThreadWatch()
    left = _thread_count()  # the threads a worker holds between calls (after the previous call's clean-up)
    blocks = sys.getallocatedblocks()
    conn.send((_MSG_READY, os.getpid()))

    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break  # parent went away
        if msg[0] == _MSG_STOP:
            break
        watch.start()
        try:
            _reset_distributed_state(store, state, rank, world_size)
            torch.manual_seed(0)
            fn, args, kwargs = pickle.loads(msg[1])
            result = fn(*args, **kwargs)
            payload = _dumps_result(result)
            del fn, args, kwargs, result
        except BaseException:
            reply: tuple[str, Any] = (_MSG_ERR, traceback.format_exc())
        else:
            reply = (_MSG_OK, (payload, watch.take(), left, sys.getallocatedblocks() - blocks))
        _flush_std_streams()
        try:
            conn.send(reply)
        except (EOFError, OSError):
            break
        # After the reply (a rank still in the call is the parent's to report, not this rank's to wait for): once
        # every rank has returned, destroy the call's groups. The threads left after that go with the next reply.
        if reply[0] == _MSG_OK and _every_rank_returned(store, state, world_size):
            try:
                _release_groups()
            except BaseException:  # noqa: BLE001 - reported with the next call
                pass
        left = _thread_count()

    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # pragma: no cover
        pass
    _flush_std_streams()
    # no interpreter finalization: a gloo worker thread that releases a finished collective
    # while Py_FinalizeEx runs aborts the process (see benchmarks/spawn.py)
    os._exit(0)


# --------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------


def _context() -> Any:
    """The start method of the workers: a fork server where the platform has one, which imports torch and fully_shard
    once (:func:`preload`) and forks each worker from that (a 4-rank pool started in ~2.4 CPU-s per rank under spawn,
    each rank importing both again; the suite starts a few dozen pools); spawn elsewhere, and under the device switch:
    a process that asked CUDA anything (``is_available()`` initialises the driver) cannot pass it on to a fork, and
    the workers there are one per GPU, started rarely."""
    if on_accelerator() or "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests._forkserver_preload"])
    return ctx


class _Pool:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.store: Any = None  # the rendezvous TCPStore's server
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.conns: list[multiprocessing.connection.Connection] = []
        self.pids: list[int] = []
        self.stacks_dir = ""  # the workers' faulthandler files (module docstring)

    def start(self) -> None:
        last_error = ""
        for _ in range(_STARTUP_ATTEMPTS):
            error = self._try_start()
            if error is None:
                return
            last_error = error
            self.kill()
            lowered = error.lower()
            if "eaddrinuse" not in lowered and "address already in use" not in lowered:
                break  # only a port race is worth retrying
        raise RuntimeError(
            f"tests.harness: could not start a pool of {self.world_size} worker(s) "
            f"({_context().get_start_method()} start method, device {device_type()}); last error:\n{last_error}"
        )

    def _try_start(self) -> str | None:
        import torch.distributed as dist

        ctx = _context()
        # port 0: the server takes a free port itself; it lives as long as the pool
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=_PG_TIMEOUT)
        port = self.store.port
        self.procs, self.conns, self.pids = [], [], []
        self.stacks_dir = tempfile.mkdtemp(prefix=f"fully_shard-pool{self.world_size}-")
        for rank in range(self.world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, port, child_conn, dict(os.environ), self._stacks_path(rank)),
                name=f"fully_shard-test-rank{rank}-of-{self.world_size}",
                daemon=False,
            )
            proc.start()
            child_conn.close()  # so that a dead worker shows up as EOF
            self.procs.append(proc)
            self.conns.append(parent_conn)
        pids: dict[int, int] = {}
        errors: list[str] = []
        pending = {conn: rank for rank, conn in enumerate(self.conns)}
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while pending and not errors:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                errors.append(f"ranks {sorted(pending.values())} did not start within {_STARTUP_TIMEOUT_S:.0f} s")
                break
            for conn in multiprocessing.connection.wait(list(pending), remaining):
                rank = pending.pop(conn)  # type: ignore[call-overload]
                try:
                    kind, value = conn.recv()  # type: ignore[union-attr]
                except (EOFError, OSError):
                    errors.append(
                        f"rank {rank}: worker died during start-up ({self._exit_desc(rank)}); its "
                        "traceback is on stderr. A worker (or the fork server it comes from) re-imports the "
                        "parent's __main__ module: a script must guard its code with "
                        "`if __name__ == '__main__':`."
                    )
                    continue
                if kind == _MSG_READY:
                    pids[rank] = value
                else:
                    errors.append(f"rank {rank}: {value}")
        if errors:
            return "\n".join(errors)
        self.pids = [pids[r] for r in range(self.world_size)]
        return None

    def _stacks_path(self, rank: int) -> str:
        return os.path.join(self.stacks_dir, f"rank{rank}.stacks")

    def stacks(self, rank: int) -> str:
        """What the rank's faulthandler wrote (its threads' Python stacks at a fatal signal or a SIGUSR1), or ""."""
        try:
            with open(self._stacks_path(rank), errors="replace") as f:
                text = f.read(_STACKS_QUOTED + 1).strip()
        except OSError:
            return ""
        return text if len(text) <= _STACKS_QUOTED else text[:_STACKS_QUOTED] + "\n[... cut]"

    def dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """The Python stacks of the live ``ranks`` (hung in a call), through SIGUSR1 (faulthandler in the worker)."""
        if not hasattr(signal, "SIGUSR1"):
            return {}
        alive = [r for r in ranks if r < len(self.procs) and self.procs[r].is_alive() and self.procs[r].pid]
        for rank in alive:
            os.kill(self.procs[rank].pid, signal.SIGUSR1)  # type: ignore[arg-type]
        deadline, seen = time.monotonic() + _STACKS_WAIT_S, None
        while time.monotonic() < deadline:  # until every rank wrote something and nothing more came for 0.1 s
            time.sleep(0.1)
            now = {rank: self.stacks(rank) for rank in alive}
            if now == seen and all(now.values()):
                break
            seen = now
        return {rank: self.stacks(rank) for rank in alive}

    def _exit_desc(self, rank: int) -> str:
        proc = self.procs[rank]
        proc.join(1.0)
        code = proc.exitcode
        if code is None:
            return "process still alive but its pipe closed"
        if code < 0:
            try:
                desc = f"killed by signal {signal.Signals(-code).name} (exit code {code}) as pid {proc.pid}"
            except ValueError:
                desc = f"exit code {code}"
            stacks = self.stacks(rank)
            return desc + (f"; its Python stacks (faulthandler):\n{stacks}" if stacks else "")
        return f"exit code {code}"

    def request_stop(self) -> None:
        """Ask the workers to leave their serve loop and exit (non-blocking)."""
        for conn in self.conns:
            try:
                conn.send((_MSG_STOP,))
            except (EOFError, OSError):
                pass

    def join(self, deadline: float) -> None:
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + 1.0
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
        for conn in self.conns:
            try:
                conn.close()
            except OSError:  # pragma: no cover
                pass
        for proc in self.procs:
            try:
                proc.close()
            except ValueError:  # pragma: no cover - still running after SIGKILL?
                pass
        self.procs, self.conns = [], []
        self.store = None  # every worker is gone: the server may go
        if self.stacks_dir:
            shutil.rmtree(self.stacks_dir, ignore_errors=True)
            self.stacks_dir = ""


_POOLS: dict[int, _Pool] = {}
# world size -> (the most threads a worker held during a call, that call, rank); and the calls that went over the limit
_THREAD_PEAKS: dict[int, tuple[int, str, int]] = {}
_POOL_STARTS: dict[int, int] = {}
# A worker still holding more threads than this after a call's clean-up (groups that something outside the call's own
# objects keeps: a cache of torch's the clean-up does not know) is replaced before the next call, so that what leaks
# cannot add up over calls; the world sizes to replace.
_RECYCLE_AT = THREAD_LIMIT // 2
_RECYCLE: set[int] = set()


def _see_threads(world_size: int, rank: int, peak: int, after: int, what: str) -> str | None:
    """Note a worker's thread counts (during a call, after its clean-up); the error if it went over the limit."""
    if peak > _THREAD_PEAKS.get(world_size, (0, "", 0))[0]:
        _THREAD_PEAKS[world_size] = (peak, what, rank)
    if max(peak, after) <= THREAD_LIMIT:
        if after > _RECYCLE_AT:
            _RECYCLE.add(world_size)
        return None
    return (
        f"the worker held {peak} threads during the call and {after} before it (the previous call's groups "
        "destroyed): over "
        f"tests.harness.THREAD_LIMIT={THREAD_LIMIT}. A gloo process group holds 3 threads until its last reference "
        "goes (a DeviceMesh makes a group per dimension): make fewer groups in one call, and hold none across calls"
    )


def thread_peaks() -> dict[int, tuple[int, str, int]]:
    """World size -> ``(threads, call, rank)``: the most threads a worker of that world size held during a call,
    in this process's calls so far."""
    return dict(_THREAD_PEAKS)


def _get_pool(world_size: int) -> _Pool:
    pool = _POOLS.get(world_size)
    if pool is None:
        pool = _Pool(world_size)
        pool.start()
        _POOLS[world_size] = pool
        _POOL_STARTS[world_size] = _POOL_STARTS.get(world_size, 0) + 1
    return pool


def pool_starts() -> dict[int, int]:
    """World size -> how many pools of that size this process started (a failed call discards its pool)."""
    return dict(_POOL_STARTS)


def _discard_pool(world_size: int) -> None:
    pool = _POOLS.pop(world_size, None)
    if pool is not None:
        pool.kill()


def shutdown_pools(grace: float = 2.0) -> None:
    """Stop every cached worker pool (called at pytest session end and atexit).

    Workers get ``grace`` seconds to exit cleanly, then they are killed.
    """
    pools = list(_POOLS.values())
    _POOLS.clear()
    for pool in pools:
        pool.request_stop()
    deadline = time.monotonic() + grace
    for pool in pools:
        pool.join(deadline)
    for pool in pools:
        pool.kill()


atexit.register(shutdown_pools)


def _describe(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 180.0,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return the per-rank results.

    ``fn`` must be a module-level function (it is pickled by reference) and
    its arguments and return value must be picklable.  Inside ``fn`` the
    default process group is initialised (gloo, CPU; see :func:`backend_for` under the
    accelerator switch), ``torch.manual_seed(0)``
    has been called and ``FULLY_SHARD_TEST_WORKER=1`` is set.

    Returns a list indexed by rank.  Raises :class:`DistributedTestFailure`
    if any rank raises or dies, or if not all ranks finish within ``timeout``
    seconds (a "hang"); the pool is then discarded and re-created by the next
    call.
    """
    if world_size < 1:
        raise ValueError(f"run_distributed: world_size must be >= 1, got {world_size}")
    what = f"run_distributed({_describe(fn)}, world_size={world_size})"
    try:
        payload = pickle.dumps((fn, args, kwargs))
    except Exception as exc:
        raise TypeError(
            f"{what}: the function and its arguments must be picklable; define the "
            f"body as a module-level function of the test module ({exc!r})"
        ) from exc

    pool = _get_pool(world_size)
    failures: dict[int, str] = {}
    results: dict[int, Any] = {}
    pending: dict[Any, int] = {}
    hung_stacks: dict[int, str] = {}
    ok = False
    try:
        for rank, conn in enumerate(pool.conns):
            try:
                conn.send((_MSG_CALL, payload))
                pending[conn] = rank
            except (EOFError, OSError):
                failures[rank] = f"worker pipe closed before the call ({pool._exit_desc(rank)})"

        start = time.monotonic()
        deadline = start + timeout
        first_failure_at = 0.0
        while pending:
            now = time.monotonic()
            limit = deadline if not failures else min(deadline, first_failure_at + _ERROR_GRACE_S)
            if now >= limit:
                break
            for conn in multiprocessing.connection.wait(list(pending), limit - now):
                rank = pending.pop(conn)
                try:
                    kind, value = conn.recv()  # type: ignore[union-attr]
                except (EOFError, OSError):
                    kind, value = _MSG_ERR, f"worker process died ({pool._exit_desc(rank)})"
                if kind == _MSG_OK:
                    value, peak, after, grown = value
                    too_many = _see_threads(world_size, rank, peak, after, what)
                    if grown > RECYCLE_BLOCKS:
                        _RECYCLE.add(world_size)
                    try:
                        results[rank] = pickle.loads(value)
                    except Exception:
                        kind, value = (_MSG_ERR,
                                       "result could not be unpickled in the parent:\n" + traceback.format_exc())
                    if too_many is not None:  # a leak: the pool is discarded below, the next call gets a fresh one
                        kind, value = _MSG_ERR, too_many
                if kind == _MSG_ERR:
                    if not failures:
                        first_failure_at = time.monotonic()
                    failures[rank] = value
        ok = not failures and not pending
    finally:
        if not ok:
            if pending:  # where the ranks still in the call are, before their pool goes
                hung_stacks = pool.dump_stacks(sorted(pending.values()))
            # Unknown collective state (or hung ranks): never reuse this pool.
            _discard_pool(world_size)

    if ok:
        if world_size in _RECYCLE:
            _RECYCLE.discard(world_size)
            _discard_pool(world_size)
        return [results[r] for r in range(world_size)]

    unfinished = sorted(pending.values())
    reason = gloo_skip_reason(failures, world_size)
    if reason is not None:
        import pytest

        pytest.skip(f"{what}: {reason}")
    lines: list[str] = []
    if failures:
        ranks = sorted(failures)
        lines.append(f"{what} failed on rank(s) {ranks}:")
        for rank in ranks:
            lines.append(f"\n----- rank {rank} -----\n{failures[rank].rstrip()}")
        if unfinished:
            lines.append(
                f"\nrank(s) {unfinished} did not finish within {_ERROR_GRACE_S:.0f} s after the "
                "failure (likely blocked in a collective); the worker pool was killed."
            )
    else:
        elapsed = time.monotonic() - start
        done = sorted(results)
        lines.append(
            f"{what} hang: rank(s) {unfinished} did not finish within timeout={timeout:g} s "
            f"(waited {elapsed:.1f} s; rank(s) {done} finished). Likely a collective that "
            "not every rank entered, or mismatched collective order. The worker pool was killed."
        )
    for rank, stacks in sorted(hung_stacks.items()):
        lines.append(f"\n----- rank {rank}: Python stacks when it was killed (faulthandler) -----\n{stacks}")
    raise DistributedTestFailure("\n".join(lines), failures, unfinished, results)


def concurrently(*calls: Callable[[], Any]) -> list[Any]:
    """Run independent ``calls`` at the same time, one thread each; return their results in order, or raise the
    exception of the first call (in order) that raised, once every call has ended. For tests that start several
    independent jobs as subprocesses (examples/train.py runs, each with its own ports and files): a job spends much of
    its time waiting (process start-up, polling, a replica group idle while another restarts), which the other jobs
    fill::

        full, first = concurrently(lambda: _train(FULL), lambda: _train(FIRST))
    """
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        return [future.result() for future in futures]
