"""The shared-memory all-reduce for ranks of one host: the sums gloo gives (every rank the same bits; maxima and
minima its exact bits), in issue
order with several in flight, through a growing mapping; DDP training on it reproduces single-process
training; a sum /dev/shm has no room for stays on gloo; a rank that never arrives makes its peers fail with the missing ranks named, not hang.

The threshold is lowered so that the small test tensors take the shared-memory path.
"""

import os
import weakref

import pytest
import torch
import torch.distributed as dist

from parallelisms.comm import Comms
from parallelisms.config import ParallelConfig, TrainConfig, preset
from parallelisms.launch import launch
from parallelisms.mesh import ParallelDims
from parallelisms.model import build_model
from parallelisms.parallel.data import DataParallel
from parallelisms.training import RunSpec, train_rank

from _launching import settled

MODEL = preset("tiny")
TRAIN = TrainConfig(steps=3, global_batch=8, seq_len=32)


def _ranks(info):
    from parallelisms.comm.shm import SharedMemoryCollectives

    comms = Comms(ParallelDims(dp_replicate=info.world_size).build_meshes())
    comm, r = comms["dp"], info.rank
    tensors = [torch.randn(numel, generator=torch.Generator().manual_seed(10 * r + i))
               for i, numel in enumerate([300, 5000, 70, 20000, 20000])]  # the fourth outgrows the mapping
    expected = [t.clone() for t in tensors]
    for t in expected:
        dist.all_reduce(t)
    pending = [comm.all_reduce(t, async_op=True, shared_memory=True) for t in tensors]  # all in flight at once
    for p in pending:
        p.wait()
    out = {"used": bool(comm._shm), "close": all(torch.allclose(a, b, rtol=1e-6, atol=1e-6)
                                                 for a, b in zip(tensors, expected))}
    sums = torch.stack([t.double().sum() for t in tensors])
    everyone = [torch.empty_like(sums) for _ in range(info.world_size)]
    dist.all_gather(everyone, sums)
    out["same_bits"] = all(torch.equal(everyone[0], s) for s in everyone)
    out["ledger"] = [(rec.kind, rec.bytes_per_rank) for rec in comms.ledger.records if rec.kind == "all_reduce"]
    # the worker thread keeps nothing of a finished call: the caller's last reference frees the tensor, in its
    # own thread (where the allocator profiler of the benches sees the free)
    finished = torch.ones(4096)
    comm.all_reduce(finished, async_op=True, shared_memory=True).wait()
    finished_ref = weakref.ref(finished)
    del finished
    out["released_by_caller"] = finished_ref() is None
    # blocking calls run in this thread, in pieces of at most PARALLELISMS_SHM_CHUNK_BYTES (1,000 here) per slot
    n, gen = info.world_size, torch.Generator().manual_seed(r)
    for numel in (1, 999, 4 * 1001):
        x = torch.randn(numel * n, generator=gen, dtype=torch.float64)
        total = x.clone()
        dist.all_reduce(total)
        summed, shard, gathered = x.clone(), torch.empty(numel, dtype=torch.float64), torch.empty(numel * n * n,
                                                                                                   dtype=torch.float64)
        comm.all_reduce(summed)
        comm.reduce_scatter(x, out=shard)
        comm.all_gather(x, out=gathered)
        everyone = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(everyone, x)
        out.setdefault("in_thread", []).append(
            torch.allclose(summed, total, rtol=1e-12) and torch.allclose(shard, total.view(n, -1)[r], rtol=1e-12)
            and torch.equal(gathered, torch.cat(everyone)))
        # maxima and minima (the vocabulary-parallel loss's row maxima) too: gloo's bits exactly
        for op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN):
            mine, expected, piece = x.clone(), x.clone(), torch.empty(numel, dtype=torch.float64)
            dist.all_reduce(expected, op=op)
            calls = comm._shm_now.calls
            comm.all_reduce(mine, op=op)
            comm.reduce_scatter(x, out=piece, op=op)
            out.setdefault("extrema", []).append(torch.equal(mine, expected) and comm._shm_now.calls > calls + 1
                                                 and torch.equal(piece, expected.view(n, -1)[r]))
    # all-to-all through shared memory: even, uneven (some blocks empty, some many rounds of a 192-byte
    # segment), one rank sending nothing, blocking and queued: the same bits as gloo's
    agree, calls = [], (comm._shm_now.calls, comm._shm.calls)
    uneven = ([(r * 7 + j * 29) % 60 for j in range(n)], [(i * 7 + r * 29) % 60 for i in range(n)])  # sent, received
    empty = ([0] * n if r == 0 else [2] * n, [0] + [2] * (n - 1))  # rank 0 sends no row at all
    for splits, receives in (([3] * n, [3] * n), uneven, empty):
        x = torch.randn(sum(splits), 5, generator=gen, dtype=torch.float64)
        expected = x.new_empty(sum(receives), 5)
        dist.all_to_all_single(expected, x, receives, splits)
        for async_op in (False, True):
            got = comm.all_to_all(x, receives, splits, async_op=async_op)
            agree.append(torch.equal(got.wait() if async_op else got, expected))
    out["all_to_all"] = agree
    out["all_to_all_on_shm"] = comm._shm_now.calls > calls[0] and comm._shm.calls > calls[1]
    out["in_thread_chunk"] = comm._shm_now.chunk_bytes
    out["in_thread_mapping"] = comm._shm_now.capacity
    # DDP's buckets opt in: a fresh Comm over the same group carries the first bucket through shared memory
    fresh = Comms(comms.meshes)
    model = build_model(MODEL)
    DataParallel(model, fresh, "dp")
    tokens = torch.randint(0, MODEL.vocab_size, (2, 16), generator=torch.Generator().manual_seed(r))
    model(tokens, tokens).backward()
    out["ddp_bucket_on_shm"] = bool(fresh["dp"]._shm)
    out["ddp"] = train_rank(info, RunSpec(MODEL, TRAIN, ParallelConfig(ParallelDims(dp_replicate=info.world_size)),
                                          collect_state=True))
    # rank 1 never arrives: the others fail within the timeout, naming it
    lonely = SharedMemoryCollectives(comm.group, comm.rank, comm.size, timeout_s=1.0)
    out["fits_a_petabyte"] = lonely.fits(1 << 50)  # /dev/shm has no room: gloo carries it instead
    assert lonely.fits(1024)  # mapping the file is collective; the calls after it are not
    if r != 1:
        try:
            lonely.submit(lonely.all_reduce_now, torch.ones(8)).wait()
            out["timeout"] = None
        except RuntimeError as exc:
            out["timeout"] = str(exc)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def reports():
    settings = {"PARALLELISMS_SHM_MIN_BYTES": "256", "PARALLELISMS_SHM_CHUNK_BYTES": "1000"}
    previous = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        return launch(_ranks, 4, threads=1)
    finally:
        for name, value in previous.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def test_sums_match_gloo_on_every_rank_bit_for_bit(reports):
    for out in reports:
        assert out["used"] and out["close"] and out["same_bits"]


def test_the_worker_keeps_no_tensor_of_a_finished_call(reports):
    assert all(out["released_by_caller"] for out in reports)


def test_all_to_all_even_and_uneven_gives_gloo_s_bits(reports):
    for out in reports:
        assert out["all_to_all"] == [True] * 6 and out["all_to_all_on_shm"]


def test_blocking_calls_run_in_this_thread_in_bounded_pieces(reports):
    for out in reports:
        assert out["in_thread"] == [True] * 3 and out["extrema"] == [True] * 6
        assert out["in_thread_chunk"] == 1000 and out["in_thread_mapping"] <= 1024  # slots never outgrow a piece


def test_ledger_counts_the_logical_all_reduce(reports):
    sizes = [300, 5000, 70, 20000, 20000]
    assert reports[0]["ledger"][:5] == [("all_reduce", 2 * 3 / 4 * 4 * n) for n in sizes]


def test_ddp_on_shared_memory_reproduces_single_process_training(reports):
    assert all(out["ddp_bucket_on_shm"] for out in reports)
    ddp = reports[0]["ddp"]
    result = settled(ddp, MODEL, TRAIN)
    assert result["ok"], result


def test_a_sum_too_large_for_dev_shm_stays_on_gloo(reports):
    assert not any(out["fits_a_petabyte"] for out in reports)


def test_a_missing_rank_fails_its_peers_with_a_named_timeout(reports):
    for r, out in enumerate(reports):
        if r != 1:
            assert "rank 1 did not arrive at copy-in" in out["timeout"], out["timeout"]


def test_futex_sleeps_until_the_word_changes():
    """Where ranks outnumber the cores a wait sleeps in the kernel on the late rank's flag: it returns at once
    when the word already differs, after its timeout when nobody writes, and as soon as a writer wakes it."""
    import threading
    import time

    import numpy as np

    from parallelisms.comm.shm import Futex, shm_machine

    if not shm_machine():
        pytest.skip("futex waits are used with shared memory on x86 Linux only")
    futex, word = Futex(), np.zeros(8, dtype=np.int64)
    address = word.ctypes.data
    start = time.monotonic()
    futex.wait(address, 1, 5.0)  # holds 0, not 1: no sleep
    futex.wait(address, 0, 0.05)  # nobody writes: the timeout
    assert 0.04 < time.monotonic() - start  # slept until the timeout (it returned: the timeout ended the wait)

    def publish():
        time.sleep(0.1)
        word[0] = 1
        futex.wake(address)

    writer, timeout = threading.Thread(target=publish), 60.0
    start = time.monotonic()
    writer.start()
    while word[0] == 0:
        futex.wait(address, 0, timeout)
    writer.join()
    assert 0.09 < time.monotonic() - start < timeout  # woken, not timed out


@pytest.mark.fast
def test_spinning_is_for_ranks_with_a_core_each(monkeypatch):
    """A wait polls for 10 ms where each local rank has a core of its own, sleeps at once where they outnumber the
    cores, and under ``PARALLELISMS_SPIN=0`` (a machine other jobs share) sleeps whatever the count."""
    from parallelisms.comm.shm import Backoff

    cores = os.cpu_count() or 1
    for spin, ranks, expected in (("1", cores, 0.01), ("1", cores + 1, 0.0), ("0", 1, 0.0)):
        monkeypatch.setenv("PARALLELISMS_SPIN", spin)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
        assert Backoff.spin_for() == expected, (spin, ranks)
