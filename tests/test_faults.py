"""Faults end in time and in one line: a stopped rank (SIGSTOP) under ``--timeout 10`` ends the run within the
timeout and a few seconds on every transport and is named; a killed rank ends every rank within seconds and is named; Ctrl-C ends every
rank with ``interrupted`` and exit code 130, also while the ranks are still importing torch. Each leaves no process and no shared-memory file behind.

The command line runs as a subprocess (in a session of its own, so Ctrl-C can reach its whole process group as
a terminal's would). The scenarios run at once, each acting once its run has trained a step (or, for Ctrl-C
while starting, once both ranks have begun to import torch), to keep the file within a minute on a small
machine. Other workers' tests run beside them (conftest's ``beside_the_others``): the seconds allowed beyond the
timeout scale with the same run's measured start-up time (:func:`_slack`), so that a loaded machine stretches
bound and run alike, and the mechanism is told by the line (a stopped rank's missing heartbeat, a killed rank's
exit code, ``interrupted``), not by the seconds.
"""

import os
import pathlib
import platform
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from parallelisms.launch import _worker_pids

import parallelisms

SRC = pathlib.Path(parallelisms.__file__).resolve().parents[1]


def _stepped(metrics: pathlib.Path) -> bool:
    """Whether the run has finished a step (its metrics file holds a line; stderr is a pipe: no progress bar)."""
    return metrics.is_file() and b"\n" in metrics.read_bytes()

SCENARIOS = {  # name -> (train arguments, extra environment, action, rank acted on)
    "stop_shm": (["--preset", "tiny", "--dp", "2", "--timeout", "10"], {}, "stop", 1),
    "stop_gloo": (["--preset", "tiny", "--dp", "2", "--timeout", "10"], {"PARALLELISMS_SHM": "0"}, "stop", 0),
    "stop_pipeline": (["--preset", "tiny", "--pp", "2", "--dp", "1", "--timeout", "10"], {}, "stop", 0),
    "kill": (["--preset", "tiny", "--dp", "2", "--timeout", "10"], {}, "kill", 1),
    "interrupt": (["--preset", "tiny", "--dp", "2", "--timeout", "10"], {}, "interrupt", None),
    "interrupt_starting": (["--preset", "tiny", "--dp", "2", "--timeout", "10"], {}, "interrupt", "starting"),
    "kill_forkserver": (["--preset", "tiny", "--dp", "2", "--timeout", "10"], {"PARALLELISMS_START_METHOD": "forkserver"},
                        "kill", 0),
    "interrupt_forkserver": (["--preset", "tiny", "--dp", "2", "--timeout", "10"],
                             {"PARALLELISMS_START_METHOD": "forkserver"}, "interrupt", None),
}


def _catches_ctrl_c(pid: int) -> bool:
    """Whether the process has a handler for SIGINT (a Python process has one until parallelisms sets it back to
    the default, which a spawned rank does before it imports torch)."""
    with open(f"/proc/{pid}/status") as f:
        caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return bool(caught >> (signal.SIGINT - 1) & 1)


def _ranks(launcher: int) -> list[int]:
    """The rank processes (multiprocessing-spawned children of the launcher), in rank order."""
    return sorted(_worker_pids(launcher))


def _importing_torch(launcher: int, started: set) -> bool:
    """Whether both ranks are spawned and past the point where they let Ctrl-C end them, and one of them has not
    loaded torch's library yet (a rank that already runs has loaded it). ``started`` collects the ranks seen with
    Python's own Ctrl-C handler (a process just spawned has none yet)."""
    try:
        ranks = _ranks(launcher)
        started |= {pid for pid in ranks if _catches_ctrl_c(pid)}
        if len(ranks) != 2 or any(pid not in started or _catches_ctrl_c(pid) for pid in ranks):
            return False
        return not all(_maps(pid, "libtorch_cpu") for pid in ranks)
    except (OSError, StopIteration):
        return False


def _maps(pid: int, name: str) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return name in f.read()


def _maps_shared_memory(pid: int) -> bool:
    """Whether the process maps a shared-memory all-reduce or point-to-point file (unlinked once every rank
    has mapped it)."""
    return _maps(pid, "/dev/shm/parallelisms-")


def _run(args: list[str], env: dict, action: str, rank: int | None, tmp: pathlib.Path) -> dict:
    """Train until a step is done, act, and time the rest: exit code, seconds, stderr,
    whether the ranks used shared memory, and the rank processes still alive afterwards."""
    metrics = tmp / "metrics.jsonl"
    launched = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "parallelisms", "train", *args, "--steps", "100000",
                             "--metrics", str(metrics)],
                            env={**os.environ, "PYTHONPATH": str(SRC), "PARALLELISMS_START_METHOD": "spawn", **env}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    err = bytearray()
    reader = threading.Thread(target=lambda: [err.extend(chunk) for chunk in iter(lambda: os.read(
        proc.stderr.fileno(), 4096), b"")], daemon=True)
    reader.start()
    ranks = []
    try:
        deadline = time.monotonic() + 90
        started = set()
        while not (_importing_torch(proc.pid, started) if rank == "starting" else _stepped(metrics)):
            assert proc.poll() is None and time.monotonic() < deadline, err.decode(errors="replace")
            time.sleep(0.01 if rank == "starting" else 0.1)
        assert rank != "starting" or not _stepped(metrics), "the ranks ran already"
        ranks = _ranks(proc.pid)
        shm = all(_maps_shared_memory(pid) for pid in ranks)
        start = time.monotonic()
        startup = start - launched  # how slow the machine is now: the load that stretches it stretches the ending too
        if action == "interrupt":
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the foreground process group
        else:
            os.kill(ranks[rank], signal.SIGSTOP if action == "stop" else signal.SIGKILL)
        code = proc.wait(timeout=30)
        elapsed = time.monotonic() - start
        reader.join(timeout=5)
        gone = time.monotonic() + 5
        while any(os.path.exists(f"/proc/{pid}") for pid in ranks) and time.monotonic() < gone:
            time.sleep(0.1)
        text = err.decode(errors="replace")
        return {"code": code, "seconds": elapsed, "startup": startup, "shm": shm, "lines": [ln.strip() for ln in re.split(r"[\r\n]", text) if ln.strip()],
                "left": [pid for pid in ranks if os.path.exists(f"/proc/{pid}")]}
    finally:
        if proc.poll() is None or any(os.path.exists(f"/proc/{pid}") for pid in ranks):
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
            proc.wait()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, beside_the_others):
    if not os.path.isdir("/proc") or not hasattr(os, "killpg"):
        pytest.skip("needs Linux /proc and process groups to find and signal the ranks")
    dirs = {name: tmp_path_factory.mktemp(name) for name in SCENARIOS}  # not in the threads: it numbers them
    with beside_the_others():  # not beside an ``alone`` test, whose result the eight runs' load would change
        return _run_all(dirs)


def _run_all(dirs: dict) -> dict:
    shm_before = {f for f in os.listdir("/dev/shm") if f.startswith("parallelisms-")}
    results = {}

    def scenario(name):
        try:
            results[name] = _run(*SCENARIOS[name], dirs[name])
        except Exception as exc:  # reported by the scenario's test
            results[name] = exc
    threads = [threading.Thread(target=scenario, args=(name,)) for name in SCENARIOS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results["shm_left"] = {f for f in os.listdir("/dev/shm") if f.startswith("parallelisms-")} - shm_before
    return results


def _slack(result: dict) -> float:
    """What a run may take to end beyond its --timeout: 5 s, or on a loaded machine the same run's start-up time
    (launch to its first step; 6-9 s on an idle 2-core machine), which the load stretches alike."""
    return max(5.0, result["startup"])


def _result(runs, name) -> dict:
    result = runs[name]
    if isinstance(result, Exception):
        raise result
    assert not result["left"], f"rank processes left: {result['left']}"
    assert not any("Traceback" in ln for ln in result["lines"]), result["lines"]
    assert len(result["lines"]) == 1, result["lines"]
    return result


@pytest.mark.parametrize("name", ["stop_shm", "stop_gloo", "stop_pipeline"])
def test_a_stopped_rank_ends_the_run_within_the_timeout_and_is_named(runs, name):
    if name == "stop_shm" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the shared-memory all-reduce runs on x86 only")
    stopped = SCENARIOS[name][3]
    result = _result(runs, name)
    assert result["shm"] == (name != "stop_gloo")  # dp's all-reduce or the pipeline's messages: shared memory
    line = result["lines"][0]
    assert result["code"] == 1 and result["seconds"] < 10 + _slack(result), (result["seconds"], line)
    assert line.startswith(f"error: rank {stopped} failed: did not arrive at "), line
    assert f"no heartbeat from rank {stopped}" in line and "stopped or dead" in line, line


@pytest.mark.parametrize("name", ["kill", "kill_forkserver"])
def test_a_killed_rank_ends_every_rank_within_seconds_and_is_named(runs, name):
    result = _result(runs, name)
    assert result["code"] == 1 and result["seconds"] < _slack(result), result  # 0.5-1.0 s, at a load average of 12 too
    assert result["lines"][0].startswith(f"error: rank {SCENARIOS[name][3]} failed (exit code -9)"), result["lines"]


@pytest.mark.parametrize("name", ["interrupt", "interrupt_starting", "interrupt_forkserver"])
def test_ctrl_c_ends_every_rank_with_one_line_and_exit_code_130(runs, name):
    result = _result(runs, name)
    assert result["code"] == 130 and result["seconds"] < _slack(result), result
    assert result["lines"] == ["interrupted"]


def test_no_shared_memory_file_is_left(runs):
    assert not runs["shm_left"]
