"""A failing rank is named and does not leave the others hanging; collectives time out."""

import glob
import os
import signal
import time

import pytest
import torch

from parallelisms import launch as launching
from parallelisms.comm import Comms
from parallelisms.comm.shm import shm_machine, shm_path
from parallelisms.launch import LaunchError, launch
from parallelisms.mesh import ParallelDims


def _rank_one_fails(info):
    comms = Comms(ParallelDims(dp_replicate=info.world_size).build_meshes())
    if info.rank == 1:
        raise ValueError("rank one gives up")
    comms["dp"].all_reduce(torch.ones(1))  # rank 0 would wait here forever without the launcher
    return "unreachable"


def _rank_one_dies_holding_a_shared_file(info):
    """Rank 1 makes a /dev/shm file and is killed before any rank unlinks it (as a rank killed inside a
    transport's set-up would be); rank 0 waits for it meanwhile."""
    comms = Comms(ParallelDims(dp_replicate=info.world_size).build_meshes())
    if info.rank == 1:
        path = shm_path("made-by-a-killed-rank")
        assert os.environ["TORCHELASTIC_RUN_ID"] in path
        open(path, "wb").close()
        os.kill(os.getpid(), signal.SIGKILL)
    comms["dp"].all_reduce(torch.ones(1))


def _rank_one_skips_a_collective(info, counted: bool):
    comms = Comms(ParallelDims(dp_replicate=info.world_size).build_meshes())
    if counted:  # the heartbeat carries the collectives entered
        info.heartbeat.follow(comms.ledger)
    comms["dp"].all_reduce(torch.ones(1))
    if info.rank == 0:
        comms["dp"].all_reduce(torch.ones(1))  # never matched: times out
    else:
        time.sleep(30)
    return "done"


def test_failing_rank_is_named_and_the_others_are_stopped():
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"rank 1 failed .*ValueError: rank one gives up"):
        launch(_rank_one_fails, 2, threads=1)
    assert time.monotonic() - start < 60


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_the_launcher_removes_the_shared_files_a_killed_rank_left(monkeypatch):
    """...and elastic's temporary directory of the launch (one stayed in /tmp per launch)."""
    made = []
    mkdtemp = launching.tempfile.mkdtemp
    monkeypatch.setattr(launching.tempfile, "mkdtemp", lambda **kw: made.append(mkdtemp(**kw)) or made[-1])
    with pytest.raises(LaunchError, match=r"rank 1 failed \(exit code -9\)"):
        launch(_rank_one_dies_holding_a_shared_file, 2, threads=1)
    assert not glob.glob("/dev/shm/parallelisms-*made-by-a-killed-rank")
    ours = [d for d in made if os.path.basename(d).startswith("parallelisms-launch-")]
    assert len(ours) == 1 and not os.path.exists(ours[0])


def test_a_rank_alive_but_not_arriving_is_named_with_where_it_is():
    """Rank 1 is busy (asleep) instead of entering its second all-reduce: rank 0 times out and names it, from
    the collective counts its heartbeat carries."""
    with pytest.raises(LaunchError) as info:
        launch(_rank_one_skips_a_collective, 2, True, threads=1, timeout_s=3)
    message = str(info.value)
    assert message.startswith("rank 1 failed: did not arrive at all_reduce 1xfloat32 over 'dp' within 3 s"), message
    assert "(rank 0 waited; alive but behind: rank 1 at its collective #1 over 'dp', this rank at #2)" in message
    assert "last collectives:" in message


def test_unmatched_collective_without_counts_times_out_with_the_waiting_rank_and_its_history(monkeypatch):
    """On gloo nothing says who is missing: the waiting rank names itself. Through shared memory (a blocking
    all-reduce between ranks of one host) the flags name the rank that did not arrive."""
    monkeypatch.setenv("PARALLELISMS_SHM", "0")
    with pytest.raises(LaunchError) as info:
        launch(_rank_one_skips_a_collective, 2, False, threads=1, timeout_s=3)
    message = str(info.value)
    assert message.startswith("rank 0 failed") and "CommError: rank 0: all_reduce" in message
    assert "last collectives:" in message
    if shm_machine():
        monkeypatch.setenv("PARALLELISMS_SHM", "1")
        with pytest.raises(LaunchError) as info:
            launch(_rank_one_skips_a_collective, 2, False, threads=1, timeout_s=3)
        message = str(info.value)
        assert message.startswith("rank 1 failed: did not arrive at all_reduce 1xfloat32 over 'dp' within 3 s "
                                  "(rank 0 waited; shared memory: rank 1 did not arrive at copy-in"), message


def _environment_and_pid(info):
    import os
    return os.environ.get("PARALLELISMS_TEST_VALUE"), os.getpid(), info.rank, os.environ.get("PYTEST_CURRENT_TEST")


def _forkserver_pid(info):
    import os
    return os.getppid(), os.environ.get("PYTEST_CURRENT_TEST")


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_every_start_method_gives_the_ranks_the_launchers_environment(method, monkeypatch):
    """Spawned ranks and ranks forked from a forkserver both see the environment the launcher has at launch
    (a forkserver started under another one is restarted); the ranks are distinct processes."""
    monkeypatch.setenv("PARALLELISMS_START_METHOD", method)
    for value in ("one", "two"):
        monkeypatch.setenv("PARALLELISMS_TEST_VALUE", value)
        results = launch(_environment_and_pid, 2, threads=1)
        assert [r[0] for r in results] == [value] * 2 and [r[2] for r in results] == [0, 1]
        assert len({r[1] for r in results}) == 2
        assert [r[3] for r in results] == [os.environ["PYTEST_CURRENT_TEST"]] * 2


def test_a_forkserver_outlives_what_pytest_writes_at_each_test(monkeypatch):
    """pytest rewrites ``PYTEST_CURRENT_TEST`` at every stage of every test: the forkserver stays (a restart took
    3-5 s a test), and each rank sees the launcher's value, set or unset."""
    monkeypatch.setenv("PARALLELISMS_START_METHOD", "forkserver")
    servers = set()
    for value in ("tests/a.py::one (call)", "tests/b.py::two (call)", None):
        if value is None:
            monkeypatch.delenv("PYTEST_CURRENT_TEST")
        else:
            monkeypatch.setenv("PYTEST_CURRENT_TEST", value)
        results = launch(_forkserver_pid, 2, threads=1)
        assert [r[1] for r in results] == [value] * 2
        servers |= {r[0] for r in results}
    assert len(servers) == 1 and os.getpid() not in servers, servers


def test_an_unknown_start_method_is_refused(monkeypatch):
    monkeypatch.setenv("PARALLELISMS_START_METHOD", "fork")
    with pytest.raises(LaunchError, match="PARALLELISMS_START_METHOD='fork' is not one of spawn, forkserver"):
        launch(_environment_and_pid, 2)
