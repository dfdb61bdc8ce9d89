"""Process launch: torch's elastic launcher locally, or the current process when started by ``torchrun``.

``launch(entry, world_size, *args)`` runs ``entry(rank_info, *args)`` on every rank and returns the per-rank
results. Locally it uses ``torch.distributed.launcher.api.elastic_launch`` (the machinery of ``torchrun``),
so a failing rank stops the others and is reported by number; under ``torchrun`` (``TORCHELASTIC_RUN_ID``
set) it runs this process's rank only. Collectives time out after ``timeout_s``; a rank whose collective timed
out names the peers that did not arrive, and the launcher reports them as the ranks that failed; a rank whose
collective broke because a peer exited waits a moment before it exits, so that the peer's own error is the one
reported. Ranks are spawned fresh, or forked from a forkserver that has imported torch once
(``PARALLELISMS_START_METHOD=forkserver``; see :func:`_start_method`).

Faults end in one line. Once a rank has failed, a watcher continues (SIGCONT) the others, so that a stopped
rank takes elastic's SIGTERM at once rather than its SIGKILL 30 s later. Ctrl-C ends every rank (each dies of
SIGINT without a traceback) and raises ``KeyboardInterrupt`` in the caller; other signals to the launcher end
the ranks and raise :class:`LaunchError`. Once the ranks have ended, the launcher removes the shared-memory files
of the run that a rank killed while making one left in /dev/shm.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import types
import uuid
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record

from parallelisms.comm.liveness import LATE, Heartbeat
from parallelisms.comm.ops import CommError
from parallelisms.comm.shm import remove_run_files
from parallelisms.device import under_torchrun  # noqa: F401  (importers of the launcher find it here too)
from parallelisms.errors import LaunchError
from parallelisms.fit import killed_for_memory, oom_signs


PEER_GONE_GRACE_S = 1.0  # a rank whose collective broke because a peer exited waits this long before it exits
OVERSUBSCRIBED = 4  # ranks per CPU core beyond which a local launch warns (CPU ranks share the cores)


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    heartbeat: Heartbeat | None = field(default=None, compare=False, repr=False)  # follow() the rank's ledger


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


LOOPBACK_RENDEZVOUS = "parallelisms-loopback"


def _loopback_rendezvous(params):
    """Elastic's c10d rendezvous handler, with the store it serves the ranks (``MASTER_PORT``) on loopback as
    well: torch's handler makes that one on every interface (``_create_tcp_store_server``)."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    handler = create_handler(*reversed(create_backend(params)), params)
    handler._create_tcp_store_server = lambda addr, port: _loopback_store()
    handler.get_backend = lambda: LOOPBACK_RENDEZVOUS  # what the registry checks
    return handler


def _loopback_store() -> dist.TCPStore:
    """The rendezvous store of a local launch, listening on 127.0.0.1 only: torch's ``TCPStore`` binds every
    interface, unauthenticated, so it is handed a socket bound to loopback (``master_listen_fd``); elastic's c10d
    rendezvous, given the same port, shares this server (``multi_tenant``). The port is the socket's own (no
    race with another process for a port found free). The store owns the socket; keep it until the launch ends."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1024)
    store = dist.TCPStore("127.0.0.1", listener.getsockname()[1], is_master=True, multi_tenant=True,
                          master_listen_fd=listener.fileno(), wait_for_workers=False)
    listener.detach()  # the store closes it
    return store


@record
def _worker(entry, args, backend: str, timeout_s: float, threads: int | None):
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if threads:
        torch.set_num_threads(threads)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s),
                            device_id=device if backend == "nccl" else None, store=_attempt_store(world, timeout_s))
    interrupt = signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C ends the rank at once, even inside a wait
    from tqdm import tqdm
    tqdm.set_lock(threading.RLock())  # its default, a named semaphore, would be reported leaked by a killed rank
    try:
        with Heartbeat(rank) as heartbeat:
            result = entry(RankInfo(rank, world, local, device, heartbeat), *args)
    except CommError as exc:
        if not LATE.search(str(exc)) or " is dead" in str(exc):  # a peer went: the launcher sees its failure first
            time.sleep(PEER_GONE_GRACE_S)
        raise
    except (KeyboardInterrupt, SystemExit, Exception):
        raise
    except BaseException as exc:  # torch's CheckpointException: ``record`` writes down Exceptions only
        lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
        raise RuntimeError(f"{exc.__class__.__name__}: {lines[-1] if lines else ''}") from None
    finally:
        signal.signal(signal.SIGINT, interrupt)
    # only after success: a failing rank keeps its group until it exits, once its error is recorded, so that its
    # peers' broken collectives (which its exit causes) are seen after its own error
    dist.destroy_process_group()
    return result


def _rank_process(entry, args, backend: str, timeout_s: float, threads: int | None, handed: dict):
    """A launched rank's process: :func:`_worker`, and where it fails (its error recorded by ``record``), the
    process ends at once: the interpreter's finalization (the process groups and their threads torn down with a
    peer stopped or gone) took 1.1-1.9 s here, which every fault added to the time the run took to end.
    ``handed``: the launcher's values of the :data:`HANDED` variables (None: unset), which a forked rank's
    forkserver may hold from an earlier launch."""
    for name, value in handed.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    try:
        return _worker(entry, args, backend, timeout_s, threads)
    except BaseException:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _attempt_store(world: int, timeout_s: float):
    """Under torchrun's agent store, a prefix per restart attempt: torch's env:// rendezvous uses one prefix for
    every attempt, so a restarted group would read the dead attempt's gloo addresses (connection refused).
    None elsewhere (init_process_group's own env:// store)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timedelta(seconds=timeout_s))
    return dist.PrefixStore(f"/worker/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", agent)


def _children(parent: int) -> list[tuple[int, bytes]]:
    """(pid, command line) of each child of ``parent``, from /proc (empty where there is none)."""
    children = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rpartition(")")[2].split()[1]) != parent:
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                children.append((int(entry), f.read()))
        except (OSError, ValueError, IndexError):
            continue
    return children


def _worker_pids(parent: int) -> list[int]:
    """The ranks a launch in ``parent`` started: its multiprocessing-spawned children, or the children of its
    forkserver (empty where there is no /proc)."""
    children = _children(parent)
    servers = [pid for pid, command in children if b"forkserver" in command]
    return [pid for pid, command in children if b"spawn_main" in command] + [
        pid for server in servers for pid, _ in _children(server)]


START_METHODS = ("spawn", "forkserver")
# what a forkserver imports once for every rank it forks: torch, what its optimizers import on first use (dynamo:
# about 3 s here), its FSDP and DTensor packages, and the training loop
PRELOAD = ["torch", "torch._dynamo", "torch.distributed.fsdp", "parallelisms.training"]
_forkserver_environment: dict = {}  # the environment the process's forkserver started with (one per process)
# Variables that do not restart a forkserver. elastic_launch writes the first into the launcher's environment (the
# same value at every launch) before any rank starts, so the forkserver holds it too. pytest rewrites the second at
# every stage of every test (a restart per test took 3-5 s); each rank is handed the launcher's value instead.
PASSING = ("TORCHELASTIC_SIGNALS_TO_HANDLE", "PYTEST_CURRENT_TEST")
HANDED = ("PYTEST_CURRENT_TEST",)


def _start_method() -> str:
    """``PARALLELISMS_START_METHOD``: ``spawn`` (default: each rank a fresh interpreter that imports torch) or
    ``forkserver`` (ranks forked from one process per launching process that has imported torch and this
    package once: an 8-rank launch here takes 0.3-0.6 s instead of 8.6 s). A forkserver whose environment
    differs from the launcher's (but for the :data:`PASSING` variables) is restarted, so ranks see the launcher's
    environment as spawned ones do."""
    method = os.environ.get("PARALLELISMS_START_METHOD", "spawn")
    if method not in START_METHODS:
        raise LaunchError(f"PARALLELISMS_START_METHOD={method!r} is not one of {', '.join(START_METHODS)}")
    if method == "forkserver":
        import multiprocessing
        from multiprocessing import forkserver
        environment = {k: v for k, v in os.environ.items() if k not in PASSING}
        if _forkserver_environment and _forkserver_environment != environment:
            forkserver._forkserver._stop()
        _forkserver_environment.clear()
        _forkserver_environment.update(environment)
        multiprocessing.set_forkserver_preload(PRELOAD)
    return method


@contextlib.contextmanager
def _ranks_run_the_package_main():
    """While ranks start: the caller's ``__main__`` module stood in for by one whose file is this package's
    ``__main__.py``. Multiprocessing's spawn re-runs the parent's main script in every child; a script, notebook or
    REPL that calls ``parallelisms.train(dp=2)`` without an ``if __name__ == "__main__"`` guard would otherwise be
    re-run by each rank (which tries to launch again and fails with a bootstrapping error). Each rank instead runs
    ``parallelisms/__main__.py`` as ``python -m parallelisms`` ranks do, and never the caller's code."""
    stand_in = types.ModuleType("__main__")
    stand_in.__file__ = os.path.join(os.path.dirname(os.path.abspath(__file__)), "__main__.py")
    stand_in.__spec__ = None
    callers = sys.modules["__main__"]
    sys.modules["__main__"] = stand_in
    try:
        yield
    finally:
        sys.modules["__main__"] = callers


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _continue_after_a_failure(stop: threading.Event, world_size: int) -> None:
    """Until ``stop``: once a rank has exited, send SIGCONT to the others every poll, so that a stopped rank
    receives the SIGTERM elastic sends it (a stopped process holds it until continued)."""
    ranks: set[int] = set()
    while not stop.wait(0.1):
        if len(ranks) < world_size:
            ranks |= set(_worker_pids(os.getpid()))
        running = [pid for pid in ranks if _running(pid)]
        if len(running) < len(ranks):
            for pid in running:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass


def _root_cause(failures: dict) -> tuple[int, object]:
    """The failure to report: a rank killed by a signal or naming live late peers first, then a rank whose own
    code failed before one that only saw a collective break because a peer had gone (a ``CommError``, or a peer
    named dead: its process exited, so its own failure says why), then the earliest, then the lowest rank."""
    def key(item):
        rank, failure = item
        line = _last_line(failure)
        named, dead = bool(LATE.search(line)), " is dead" in line
        return (not (failure.exitcode < 0 or named and not dead), "CommError" in line or dead, failure.timestamp, rank)
    return min(failures.items(), key=key)


def _message(failure) -> str:
    return failure.message if isinstance(failure.message, str) else failure.message.get("message", "")


def _last_line(failure) -> str:
    lines = [ln for ln in str(_message(failure)).strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "no error message"


def _launch_error(failures: dict, oom_before: dict | None = None) -> BaseException:
    """One line for the failed ranks: the late peers a rank named, a rank the kernel killed for memory (SIGKILL,
    and since ``oom_before`` an out-of-memory kill counted: :func:`parallelisms.fit.killed_for_memory`), or the
    rank that failed and its error."""
    rank, failure = _root_cause(failures)
    if failure.exitcode == -signal.SIGINT:
        return KeyboardInterrupt()
    if failure.exitcode == -signal.SIGKILL and oom_before is not None and killed_for_memory(oom_before):
        return LaunchError(f"rank {rank} ran out of memory: the kernel's out-of-memory killer ended it (SIGKILL); "
                           f"`parallelisms estimate` with the same flags shows the memory per rank: shard more "
                           f"(--zero, --fsdp, --tp, --pp), use fewer ranks per machine or a smaller model")
    line, details = _last_line(failure), str(_message(failure))
    late = LATE.search(line)
    if late:
        return LaunchError(f"{late[1]} failed: {line[late.end(1):].strip()}", details)
    return LaunchError(f"rank {rank} failed (exit code {failure.exitcode}): {line}", details)


def launch(entry, world_size: int, *args, backend: str | None = None, timeout_s: float = 300.0,
           threads: int | None = None) -> list:
    """Run ``entry(RankInfo, *args)`` on ``world_size`` ranks; return the results indexed by rank.

    Under ``torchrun`` only this process's rank runs and the list holds its result alone. ``threads``
    sets ``torch.set_num_threads`` per rank (default: cores divided among the local ranks).
    """
    backend = backend or default_backend()
    if under_torchrun():
        return [_worker(entry, args, backend, timeout_s, threads)]
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    cores = os.cpu_count() or 1
    if backend != "nccl" and world_size > OVERSUBSCRIBED * cores:
        print(f"warning: {world_size} ranks on {cores} CPU cores ({world_size / cores:.0f} per core): each rank is a "
              f"process with its own model copy, so this will be slow and use much memory", file=sys.stderr)
    for name in [*logging.root.manager.loggerDict, "torch.distributed.elastic", "torch.distributed.launcher"]:
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    threads = threads or max(1, cores // world_size)
    run_id, start_method = uuid.uuid4().hex, _start_method()
    logs = tempfile.mkdtemp(prefix="parallelisms-launch-")  # elastic's per-rank error files; removed afterwards
    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)  # elastic replaces their handlers
    handlers = {sig: signal.getsignal(sig) for sig in handled}
    stop = threading.Event()
    watcher = threading.Thread(target=_continue_after_a_failure, args=(stop, world_size), daemon=True)
    watcher.start()
    os.environ["PARALLELISMS_RANK_STARTING"] = "1"  # read by parallelisms.__main__ as each rank imports it
    oom_before = oom_signs()
    try:
        from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
        rendezvous_handler_registry.register(LOOPBACK_RENDEZVOUS, _loopback_rendezvous)
        store = _loopback_store()  # one host: neither store is reachable from another
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world_size, run_id=run_id,
                              rdzv_backend=LOOPBACK_RENDEZVOUS, rdzv_endpoint=f"127.0.0.1:{store.port}",
                              local_addr="127.0.0.1",
                              rdzv_configs={"is_host": True}, max_restarts=0, monitor_interval=0.05,
                              start_method=start_method, logs_specs=DefaultLogsSpecs(log_dir=logs))
        try:
            with _ranks_run_the_package_main():
                results = elastic_launch(config, _rank_process)(entry, args, backend, timeout_s, threads,
                                                                 {name: os.environ.get(name) for name in HANDED})
        finally:
            del store
    except ChildFailedError as exc:
        raise _launch_error(exc.failures, oom_before) from None
    except SignalException as exc:
        if exc.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None
        raise LaunchError(f"the launcher received {exc.sigval.name}; every rank was stopped") from None
    finally:
        os.environ.pop("PARALLELISMS_RANK_STARTING", None)
        remove_run_files(run_id)  # the ranks have ended: what a killed one was making goes too
        shutil.rmtree(logs, ignore_errors=True)  # elastic's own temporary directory stayed in /tmp per launch
        stop.set()
        watcher.join()
        for sig, handler in handlers.items():
            if handler is not None:
                signal.signal(sig, handler)
    return [results[r] for r in range(world_size)]
