"""The suite runs on every core (pytest-xdist, one file per worker, so a file's launches and fixtures happen once)
and launches its ranks from a forkserver that has imported torch once (``PARALLELISMS_START_METHOD``): an
8-rank launch takes half a second instead of eight. The fault tests pin the default, ``spawn``, where they need
it; ``test_launch`` checks both. The ranks wait on shared memory sleeping in the kernel (``PARALLELISMS_SPIN=0``)
rather than polling where a launch has a core per rank: the two workers' launches share the cores, and a polling
rank's turns are cores the other worker's ranks wait for. test_comm_shm_p2p's two-rank pipeline polls, and
``test_spinning_is_for_ranks_with_a_core_each`` checks the switch. Each worker computes on one thread itself
(:func:`_one_thread_per_worker`).

Tiers: ``-m fast`` runs the tests marked ``fast`` (a file's ``pytestmark`` or a test's decorator): pure
functions that start no process (schedules, the performance model, configuration and its rules, the modes'
descriptors), a fraction of the suite's time; the suite without ``-m`` runs everything.

A test or fixture whose result depends on no other process competing for the cores (which rank the straggler
report names) runs :func:`alone`: no test of another worker runs meanwhile (an exclusive lock that every other test
holds shared). A module fixture that starts processes holds the lock shared itself (:func:`beside_the_others`): the
autouse lock below is taken after module fixtures are set up."""

import contextlib
import fcntl
import os
import sys

import pytest

os.environ.setdefault("PARALLELISMS_START_METHOD", "forkserver")
os.environ.setdefault("PARALLELISMS_SPIN", "0")


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per core, at most four (each test launches up to 16 ranks of its own)."""
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


# pytest-xdist hands the files out in the order collected (pyproject's --no-loadscope-reorder: by default it sorts
# them by their count of tests, which put files of one or two long tests, calibrate's, last): the longest first,
# longest to shortest (seconds measured one file after another in one process, two such processes at once: 80 to
# 12 s), so that no worker is left running a long one alone at the end; the rest follow by name. test_stragglers
# runs last: its runs hold the other worker off (``alone``), which costs nothing once the other worker has no file
# left.
FIRST = ("test_verify_matrix.py", "test_dryrun_replay.py", "test_estimate_check.py", "test_dryrun.py",
         "test_checkpoint.py", "test_faults.py", "test_output.py", "test_docs.py", "test_perf_plan.py",
         "test_launch.py", "test_api.py", "test_perf_plan_choices.py", "test_perf_calibrate.py",
         "test_dryrun_own_layers.py", "test_tied.py", "test_ep_balance.py", "test_pipeline_runtime.py",
         "test_benches.py", "test_hf_architectures.py", "test_zero_composed.py", "test_perf_cpu_mechanisms.py",
         "test_long_runs.py", "test_recompute.py")
LAST = ("test_stragglers.py",)


def pytest_collection_modifyitems(config, items):
    order = {name: i for i, name in enumerate(FIRST)}
    # stable: every file keeps its tests' order
    items.sort(key=lambda item: (item.path.name in LAST, order.get(item.path.name, len(FIRST))))


def _lock_path(factory) -> str:
    """A file every worker of this session sees: the parent of the workers' temporary directories."""
    return str(factory.getbasetemp().parent / "alone.lock")


@contextlib.contextmanager
def _locked(path: str, mode: int):
    with open(path, "a") as f:
        fcntl.flock(f, mode)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(scope="session", autouse=True)
def _one_thread_per_worker():
    """Each worker computes on one thread (the suite runs one worker per core): work done in pytest's process
    (references, ``verify``'s single-process run, transformers' training) on two threads waits at every parallel
    region for a core that the other worker's processes hold. The ranks set their own (``launch``'s ``threads``)."""
    torch = sys.modules.get("torch")  # imported by the collected files that compute; a fast run may not import it
    if torch is None:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def alone(tmp_path_factory):
    """A context manager: the code under it runs while no test of another worker does."""
    return lambda: _locked(_lock_path(tmp_path_factory), fcntl.LOCK_EX)


@pytest.fixture(scope="session")
def beside_the_others(tmp_path_factory):
    """A context manager: the code under it runs beside other workers' tests, but not beside an :func:`alone` one."""
    return lambda: _locked(_lock_path(tmp_path_factory), fcntl.LOCK_SH)


@pytest.fixture(autouse=True)
def _with_the_others(tmp_path_factory):
    """Every test holds the lock shared, so :func:`alone` waits for the other workers' running tests."""
    with _locked(_lock_path(tmp_path_factory), fcntl.LOCK_SH):
        yield


@pytest.fixture
def small_disk(tmp_path):
    """``make(size)``: a tmpfs of ``size`` (``"1m"``) mounted in ``tmp_path``, where this process may mount one
    (a full disk on demand); unmounted lazily afterwards (a failed run may still hold a file there)."""
    import subprocess

    mounts = []

    def make(size: str):
        mount = tmp_path / f"disk{len(mounts)}"
        mount.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                          capture_output=True).returncode:
            pytest.skip("cannot mount a small file system here")
        mounts.append(mount)
        return mount
    yield make
    for mount in mounts:
        subprocess.run(["umount", "--lazy", str(mount)], capture_output=True)
