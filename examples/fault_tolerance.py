"""Fault-tolerant training with torchft, the pieces examples/train.py uses (``--ft-enable``).

* :func:`launch`: the one-machine launcher. Starts a torchft Lighthouse (unless given one) and R replica groups of
  ``nproc`` workers each, and restarts a group whose worker died: all of that group's workers, on a fresh store
  port (a restarted group never reads addresses its previous attempt left behind), while the other groups train on.
  On several machines, run one ``torchrun`` per replica group instead (docs/fault-tolerance.md).
* :func:`make_manager`: this worker's ``torchft.Manager`` (synchronous quorum: a recovery completes before the step).
* :func:`wait_for_all`: at a step, wait until every replica group is in the quorum (the start of a job, and the
  steps of ``--ft-join-at``, which make a run with failures deterministic).
* :class:`Chaos`: ``--ft-kill`` kills this worker with SIGKILL at a chosen step and place, as a lost machine would.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from datetime import timedelta
from typing import Any

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
LOOPBACK = "127.0.0.1"  # where the one-machine launcher's Lighthouse listens unless --ft-lighthouse-bind says otherwise


def free_port() -> int:
    """A port no socket of this machine is bound to, drawn below the range the kernel takes connections' own ports from
    (Linux: ``/proc/sys/net/ipv4/ip_local_port_range``), so that no connection made before our server binds it can
    take it; the kernel's choice (port 0) where that range starts too low to leave room below it."""
    low = _connection_ports_start()
    for _ in range(64 if low > 20000 else 0):
        port = random.randrange(10000, low)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _connection_ports_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # an IPv6 address in brackets


def lighthouse_command(port: int, bind: str = LOOPBACK, min_replicas: int = 1, heartbeat_timeout_ms: int = 5000,
                       join_timeout_ms: int = 10000) -> list[str]:
    """The ``torchft_lighthouse`` command line (the binary installed with torchft), listening on ``bind`` (an
    address of this machine: loopback by default, ``::`` for every interface)."""
    exe = os.path.join(sysconfig.get_path("scripts"), "torchft_lighthouse")
    exe = exe if os.path.exists(exe) else shutil.which("torchft_lighthouse") or ""
    if not exe:
        raise SystemExit("train.py: error: --ft-enable needs torchft (pip install 'fully-shard[ft]'): "
                         "torchft_lighthouse not found")
    return [exe, "--bind", _host_port(bind, port), "--min_replicas", str(min_replicas), "--quorum_tick_ms", "100",
            "--heartbeat_timeout_ms", str(heartbeat_timeout_ms), "--join_timeout_ms", str(join_timeout_ms)]


def _describe(code: int) -> str:
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"


def _stop(procs: list[subprocess.Popen[bytes]], grace: float = 5.0) -> None:
    """SIGTERM, then SIGKILL whatever is left after ``grace`` seconds."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _start_lighthouse(port: int, bind: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(lighthouse_command(port, bind), stdout=subprocess.DEVNULL,
                            env=dict(os.environ, RUST_LOG="warn"))


def _first_lighthouse(bind: str, tries: int = 5, wait_s: float = 60.0) -> tuple[subprocess.Popen[bytes], int]:
    """A Lighthouse listening on a free port of ``bind``, and the port. A port found free may be taken before the
    Lighthouse binds it (another process's connection draws from the same ports): it then exits at once ("Address
    already in use"), and another port is tried. It is listening once a connection to it succeeds."""
    host = LOOPBACK if bind in ("::", "0.0.0.0") else bind
    for _ in range(tries):
        port = free_port()
        house = _start_lighthouse(port, bind)
        deadline = time.monotonic() + wait_s
        while house.poll() is None and time.monotonic() < deadline:
            try:
                socket.create_connection((host, port), timeout=1.0).close()
                return house, port
            except OSError:
                time.sleep(0.05)
        _stop([house])
    raise SystemExit(f"fault tolerance: the Lighthouse did not start listening on {bind} ({tries} ports tried, "
                     f"{wait_s:.0f} s each); see its error above")


def launch(script: str, argv: list[str], *, replicas: int, nproc: int, max_restarts: int,
           lighthouse: str | None = None, timeout: float = 60.0, lighthouse_bind: str = LOOPBACK) -> int:
    """Run ``script`` as ``replicas`` replica groups of ``nproc`` workers on this machine (and a Lighthouse unless
    ``lighthouse`` is an address: it listens on ``lighthouse_bind``, loopback unless asked otherwise, so that nothing
    outside this machine reaches it); returns 0 when the groups finished, 1 when one failed more than ``max_restarts``
    times. Each worker gets torchrun's environment for its group (RANK, WORLD_SIZE, MASTER_PORT, ...),
    ``TORCHFT_LIGHTHOUSE``, ``TORCHELASTIC_RESTART_COUNT`` and ``--ft-replica-id``. Once a group has finished, the
    others get ``timeout`` seconds to finish too; a group that fails then is not restarted (no peer is left to
    recover from)."""
    procs: list[subprocess.Popen[bytes]] = []
    house = None
    if lighthouse is None:
        house, port = _first_lighthouse(lighthouse_bind)
        wildcard = lighthouse_bind in ("::", "0.0.0.0")  # every interface: the workers here connect through loopback
        lighthouse = f"http://{_host_port('localhost' if wildcard else lighthouse_bind, port)}"
        print(f"fault tolerance: Lighthouse at {lighthouse} (pid {house.pid}), {replicas} replica groups of {nproc} "
              f"workers, up to {max_restarts} restarts each; it listens on {_host_port(lighthouse_bind, port)}",
              flush=True)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", WORLD_SIZE=str(nproc),
               LOCAL_WORLD_SIZE=str(nproc), TORCHELASTIC_MAX_RESTARTS=str(max_restarts))
    env[LIGHTHOUSE_ENV] = lighthouse
    env.setdefault("RUST_LOG", "warn")  # torchft's manager and Lighthouse log every quorum at "info"
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // (replicas * nproc))))
    groups: dict[int, list[subprocess.Popen[bytes]]] = {}
    attempts = dict.fromkeys(range(replicas), 0)

    def start(r: int) -> None:
        group_env = dict(env, MASTER_PORT=str(free_port()), TORCHELASTIC_RESTART_COUNT=str(attempts[r]))
        groups[r] = [subprocess.Popen([sys.executable, script, *argv, f"--ft-replica-id={r}"],
                                      env=dict(group_env, RANK=str(k), LOCAL_RANK=str(k))) for k in range(nproc)]
        procs.extend(groups[r])

    finished: float | None = None  # when the first group finished
    try:
        for r in range(replicas):
            start(r)
        while groups:
            time.sleep(0.2)
            if finished is not None and time.monotonic() > finished + timeout:
                print(f"fault tolerance: replica groups {sorted(groups)} did not finish within {timeout:.0f} s of the "
                      "first one; stopping them", file=sys.stderr, flush=True)
                return 0
            if house is not None and house.poll() is not None:
                print(f"fault tolerance: the Lighthouse {_describe(house.returncode)}; restarting it", flush=True)
                house = _start_lighthouse(int(lighthouse.rsplit(":", 1)[1]), lighthouse_bind)
            for r, group in list(groups.items()):
                codes = [p.poll() for p in group]
                if all(c == 0 for c in codes):
                    del groups[r]
                    finished = time.monotonic() if finished is None else finished
                    continue
                failed = next(((k, c) for k, c in enumerate(codes) if c not in (None, 0)), None)
                if failed is None:
                    continue
                _stop(group)
                if finished is not None:
                    print(f"fault tolerance: replica group {r}: worker {failed[0]} {_describe(failed[1])} after "
                          "another group finished; not restarting it", file=sys.stderr, flush=True)
                    del groups[r]
                    continue
                if attempts[r] >= max_restarts:
                    print(f"fault tolerance: replica group {r}: worker {failed[0]} {_describe(failed[1])}, and the "
                          f"group has been restarted {max_restarts} times already: giving "
                          "up", file=sys.stderr, flush=True)
                    return 1
                attempts[r] += 1
                print(f"fault tolerance: replica group {r}: worker {failed[0]} {_describe(failed[1])}; restarting the "
                      f"group (restart {attempts[r]} of {max_restarts}); the other groups train on", flush=True)
                start(r)
        return 0
    finally:
        _stop(procs + ([house] if house is not None else []))


def make_manager(args: Any, device: Any, timeout_s: float) -> Any:
    """This worker's ``torchft.Manager``: synchronous quorum (a group that is behind recovers before its step, and
    trains on its own batch in that step), no sync at step 0 (every group initialises the same weights), every
    network operation bounded by ``timeout_s``."""
    import logging

    import torch.distributed as dist
    import torchft

    if device.type != "cuda":  # torchft warns at every new quorum that it cannot reset NCCL's flight recorder
        logging.getLogger("torchft.manager").addFilter(lambda r: "flight recorder" not in r.getMessage())
    timeout = timedelta(seconds=timeout_s)
    pg = torchft.ProcessGroupNCCL(timeout) if device.type == "cuda" else torchft.ProcessGroupGloo(timeout)

    def make() -> Any:
        return torchft.Manager(
            pg=pg, min_replica_size=args.ft_min_replica_size, load_state_dict=None, state_dict=None,
            replica_id=f"train_ft_{args.ft_replica_id}", use_async_quorum=False, init_sync=False, timeout=timeout,
            quorum_timeout=timeout, connect_timeout=timeout, rank=dist.get_rank(), world_size=dist.get_world_size(),
            lighthouse_addr=os.environ.get(LIGHTHOUSE_ENV), quorum_retries=3)

    # Group rank 0 publishes the group's manager address in the store before the others read it: a restarted
    # torchrun group shares its store with the attempt before, whose address must not be read.
    manager = make() if dist.get_rank() == 0 else None
    dist.barrier()
    return manager if manager is not None else make()


def wait_for_all(ft: Any, replicas: int, deadline_s: float, log: Any, why: str = "") -> None:
    """Start this step only with all ``replicas`` groups in the quorum (or after ``deadline_s``, derived by the caller
    from what the run measured and explained by ``why``; each quorum may take as long): quorums with fewer run no
    step (nothing committed, so nothing to undo) and are retried. Giving up is logged, saying how long it waited and
    why that long."""
    start = time.monotonic()
    while True:
        ft.start_step(timeout=deadline_s)
        if ft.manager.num_participants() >= replicas:
            return
        waited = time.monotonic() - start
        if waited > deadline_s:
            log(f"step {ft.manager.current_step() + 1}: {ft.manager.num_participants()} of {replicas} replica groups "
                f"in the quorum after waiting {waited:.0f} s (the wait: {why or f'{deadline_s:.0f} s'}); going on "
                "without the others: they took longer than that to (re)start or to reach this step")
            return
        ft.manager.report_error(RuntimeError(f"waiting for all {replicas} replica groups"))
        ft.should_commit()
        log(f"step {ft.manager.current_step() + 1}: {ft.manager.num_participants()} of {replicas} replica groups in "
            "the quorum; waiting for the others")
        time.sleep(0.5)


class Chaos:
    """``--ft-kill REPLICA:RANK:STEP:WHERE`` (repeatable): SIGKILL this worker in its first attempt, where WHERE is
    ``forward`` (step STEP, before its forward), ``optim`` (step STEP, inside the optimizer step, after the commit) or
    ``send`` (while sending its state to a recovering group, at step STEP or later)."""

    PLACES = ("forward", "optim", "send")

    def __init__(self, specs: list[str] | None, replica: int, rank: int) -> None:
        self.kills: list[tuple[str, int]] = []
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            for r, k, step, where in (spec.split(":") for spec in specs or []):
                if (int(r), int(k)) == (replica, rank):
                    self.kills.append((where, int(step)))

    def __call__(self, where: str, step: int) -> None:
        if any(w == where and (step == s or (where == "send" and step >= s)) for w, s in self.kills):
            print(f"fault tolerance: --ft-kill: killing this worker (SIGKILL) at step {step} ({where})", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def parse_kill(text: str) -> str:
    parts = text.split(":")
    if len(parts) != 4 or not all(p.isdigit() for p in parts[:3]) or parts[3] not in Chaos.PLACES:
        import argparse

        raise argparse.ArgumentTypeError(f"expected REPLICA:RANK:STEP:WHERE with WHERE one of {Chaos.PLACES}, got "
                                         f"{text!r}")
    return text
