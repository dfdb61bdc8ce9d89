"""Point-to-point messages through shared memory between ranks of one host: every message arrives whole and in
send order (sizes from none to several times a ring, many in flight both ways, three peers); the ledger records
them as gloo's do; a message of the wrong size and a peer that never sends fail with a clear error naming it; a
pipeline trains the same on it as on gloo and as one process; nothing is left in /dev/shm."""

import os

import pytest
import torch
import torch.distributed as dist

from parallelisms.comm.ops import Comm, CommError
from parallelisms.config import ParallelConfig, TrainConfig, preset
from parallelisms.launch import launch
from parallelisms.mesh import ParallelDims
from parallelisms.training import RunSpec, train_rank
from parallelisms.equivalence import reference_train

from _launching import settled

SIZES = [7, 0, 300_000, 5 << 20, 1, 123_457]  # float32 elements; 5 Mi of them is 20 MiB, several rings' worth
MODEL = preset("tiny")
TRAIN = TrainConfig(steps=3, global_batch=8, seq_len=32)


def _message(src: int, dst: int, index: int, numel: int) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.float32) + 1000 * src + 100 * dst + index


def _error(call) -> str | None:
    """The CommError ``call()`` raises, as text (None if it returns)."""
    try:
        call()
    except CommError as exc:
        return str(exc)
    return None


def _ranks(info):
    me, world = info.rank, info.world_size
    comm = Comm("p2p-test", dist.group.WORLD)
    peers = [p for p in range(world) if p != me]
    out = {}
    for round_ in range(2):  # sends first, then receives; then receives posted before the peers send
        sends = [(_message(me, p, i, n), p) for p in peers for i, n in enumerate(SIZES)]
        recvs = [(torch.empty(n), p) for p in peers for n in SIZES]
        if round_ == 0:
            sent = comm.send_recv(sends=sends)
            comm.send_recv(recvs=recvs).wait()
        else:
            posted = comm.send_recv(recvs=recvs)
            sent = comm.send_recv(sends=sends)
            posted.wait()
        sent.wait()
        out[f"exact_{round_}"] = all(torch.equal(t, _message(p, me, i % len(SIZES), t.numel()))
                                     for i, (t, p) in enumerate(recvs))
    out["transport"] = type(comm._p2p).__name__
    out["ledger"] = sorted({(r.kind, r.numel) for r in comm.ledger.records})

    # a message of another size than the one posted: the receiver says so
    wrong = Comm("p2p-wrong", dist.group.WORLD)
    if me == 0:
        wrong.send_recv(sends=[(torch.ones(10), 1)]).wait()
    elif me == 1:
        out["wrong_size"] = _error(lambda: wrong.send_recv(recvs=[(torch.empty(12), 0)]).wait())
    dist.barrier()

    # rank 0 never sends: rank 1 fails within the timeout, naming it
    silent = Comm("p2p-silent", dist.group.WORLD)
    silent.timeout_s = 1.0
    if me == 1:
        out["silent"] = _error(lambda: silent.send_recv(recvs=[(torch.empty(4), 0)]).wait())
    dist.barrier()
    return out


def _pipeline(info):
    """pp 2 on each transport, and how many rings rank 0 had made for rank 1 after each run (the store counts)."""
    from parallelisms.comm.liveness import default_store

    store = default_store()
    os.environ["PARALLELISMS_SPIN"] = "1"  # a core per rank: the waits poll (the suite's default sleeps)
    layout = ParallelConfig(ParallelDims(pp=2), schedule="1f1b", microbatches=4)
    runs, rings = {}, {}
    for transport in ("shared memory", "gloo"):
        os.environ["PARALLELISMS_SHM"] = "1" if transport == "shared memory" else "0"
        runs[transport] = train_rank(info, RunSpec(MODEL, TRAIN, layout, collect_state=True))
        job = store.compare_set("parallelisms/p2p/job", "", "none").decode()
        rings[transport] = store.add(f"parallelisms/p2p/{job}/pp/0-1/sender", 0)
    return runs, rings


@pytest.fixture(scope="module")
def reports():
    before = {f for f in os.listdir("/dev/shm") if f.startswith("parallelisms-p2p-")}
    results = launch(_ranks, 3, threads=1)
    return results, {f for f in os.listdir("/dev/shm") if f.startswith("parallelisms-p2p-")} - before


@pytest.fixture(scope="module")
def skip_elsewhere():
    from parallelisms.comm.shm import shm_machine

    if not shm_machine():
        pytest.skip("shared-memory transports run on x86 with /dev/shm only")


def test_every_message_arrives_whole_and_in_order(skip_elsewhere, reports):
    for out in reports[0]:
        assert out["transport"] == "SharedMemoryP2P"
        assert out["exact_0"] and out["exact_1"]


def test_the_ledger_records_each_send_and_receive(skip_elsewhere, reports):
    expected = {(kind, n) for kind in ("send", "recv") for n in SIZES}
    assert set(reports[0][0]["ledger"]) == expected


def test_a_message_of_the_wrong_size_is_an_error_naming_both_sizes(skip_elsewhere, reports):
    line = reports[0][1]["wrong_size"]
    assert "message #0 of 40 bytes arrived where #0 of 48 bytes was posted" in line, line


def test_a_peer_that_never_sends_is_named_within_the_timeout(skip_elsewhere, reports):
    line = reports[0][1]["silent"]
    assert "rank 0 did not arrive at p2p 0 send 1 recv over 'p2p-silent' within 1 s" in line, line


def test_nothing_is_left_in_dev_shm(skip_elsewhere, reports):
    assert not reports[1]


def test_a_pipeline_trains_alike_on_shared_memory_gloo_and_one_process(skip_elsewhere):
    runs, rings = launch(_pipeline, 2, threads=1)[0]
    assert rings == {"shared memory": 1, "gloo": 1}  # the first run made the ring; the second sent over gloo
    reference = reference_train(MODEL, TRAIN)
    for transport, result in runs.items():
        assert settled(result, MODEL, TRAIN, reference)["ok"], transport
    assert runs["shared memory"]["losses"] == runs["gloo"]["losses"]
