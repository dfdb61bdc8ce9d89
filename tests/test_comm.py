"""The comm layer: results, ledger bytes (ring formulas), autograd conjugate pairs, timeline arithmetic."""

import os

import pytest
import torch

from parallelisms.comm import (CommLedger, Comms, Timeline, all_to_all, copy_to_group, gather_along,
                               reduce_from_group, reduce_scatter_along, ring_bytes_per_rank, split_along)
from parallelisms.comm.ops import Comm
from parallelisms.comm.shm import shm_machine
from parallelisms.launch import launch
from parallelisms.mesh import ParallelDims


@pytest.mark.fast
def test_ring_formulas():
    assert ring_bytes_per_rank("all_reduce", 1000, 4) == 1500
    assert ring_bytes_per_rank("all_gather", 1000, 4) == 750
    assert ring_bytes_per_rank("reduce_scatter", 1000, 4) == 750
    assert ring_bytes_per_rank("all_to_all", 1000, 4) == 750
    assert ring_bytes_per_rank("send", 1000, 4) == 1000 and ring_bytes_per_rank("recv", 1000, 4) == 0


@pytest.mark.fast
def test_one_rank_comm_is_a_no_op():
    comms = Comms()
    x = torch.ones(3)
    assert comms["dp"].all_reduce(x) is x and comms["tp"].all_gather(x) is x
    assert comms.ledger.records == []


def _collectives(info):
    n, r = info.world_size, info.rank
    comms = Comms(ParallelDims(dp_shard=n).build_meshes(), CommLedger(), Timeline(r))
    c = comms["dp_shard"]
    out = {}
    with comms.ledger.in_phase("forward"):
        out["all_reduce"] = c.all_reduce(torch.full((6,), float(r + 1))).tolist()
        out["all_gather"] = c.all_gather(torch.tensor([[float(r)]]), dim=1).tolist()
        out["reduce_scatter"] = c.reduce_scatter(torch.arange(2.0 * n)).tolist()
        out["all_to_all"] = c.all_to_all(torch.arange(float(n)) + 10 * r).tolist()
        splits = [1 + (r + j) % 2 for j in range(n)]  # uneven: rank r sends splits[j] rows to rank j
        recv = [1 + (j + r) % 2 for j in range(n)]
        out["uneven"] = c.all_to_all(torch.full((sum(splits),), float(r)), recv, splits).tolist()
        pending = c.all_reduce(torch.ones(4), async_op=True)
        out["async"] = pending.wait().tolist()
        nxt, prv = (r + 1) % n, (r - 1) % n
        buf = torch.empty(2)
        c.send_recv(sends=[(torch.full((2,), float(r)), nxt)], recvs=[(buf, prv)]).wait()
        out["p2p"] = buf.tolist()

    # into given buffers: the input of a reduce-scatter survives unless given up (scratch), and on gloo
    # neither collective allocates anything under the allocator profiler (no full-size temporaries)
    from torch.profiler import ProfilerActivity, profile

    from parallelisms.bench import _allocations as allocations
    os.environ["PARALLELISMS_SHM"] = "0"
    on_gloo = Comm("gloo", c.group)  # blocking calls too: no shared memory
    on_gloo.all_reduce(torch.ones(1))
    os.environ["PARALLELISMS_SHM"] = "1"
    for comm in (c, on_gloo):
        full, shard, gathered = torch.arange(4.0 * n) * (r + 1), torch.empty(4), torch.empty(4 * n)
        kept, mine = full.clone(), torch.full((4,), float(r))
        comm.reduce_scatter(full, out=shard)  # the shared-memory mappings grow to the size once
        comm.all_gather(mine, out=gathered, async_op=True).wait()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            comm.all_gather(mine, out=gathered, async_op=True).wait()
            comm.reduce_scatter(full, out=shard)
            out["rs_input_kept"] = torch.equal(full, kept)
            comm.reduce_scatter(full, out=shard, async_op=True, scratch=True).wait()
        out[f"allocated_bytes_{comm.name}"] = sum(size for _, size, _ in allocations(prof)[0] if size > 0)
        out[f"into_buffers_{comm.name}"] = (gathered.tolist(), shard.tolist())
        out[f"shared_memory_{comm.name}"] = comm._shm_now is not None

    # autograd pairs: each backward is the conjugate collective
    x = torch.full((2, 4), float(r + 1), requires_grad=True)
    with comms.ledger.in_phase("backward"):
        copy_to_group(x, c).sum().backward()
    out["copy_grad"] = x.grad[0, 0].item()
    x.grad = None
    y = reduce_from_group(x, c)
    y.sum().backward()
    out["reduce_from"] = (y[0, 0].item(), x.grad[0, 0].item())
    x.grad = None
    g = gather_along(x, c, dim=1)
    (g * torch.arange(g.shape[1]).float()).sum().backward()
    out["gather_grad"] = x.grad[0].tolist()
    x.grad = None
    s = reduce_scatter_along(x, c, dim=1)
    s.sum().backward()
    out["reduce_scatter_shape"] = (list(s.shape), x.grad.sum().item())
    x.grad = None
    sp = split_along(x, c, dim=1)
    sp.sum().backward()
    out["split_grad"] = x.grad.sum().item()
    z = torch.arange(float(n * 2), requires_grad=True)
    all_to_all(z * (r + 1), c).sum().backward()
    out["a2a_grad"] = z.grad.tolist()
    out["ledger"] = [(rec.kind, rec.numel, rec.bytes_per_rank, rec.phase) for rec in comms.ledger.records]
    out["span_kinds"] = sorted({s.cat for s in comms.timeline.spans})
    return out


@pytest.fixture(scope="module")
def four_ranks():
    return launch(_collectives, 4, threads=1)


def test_collective_results(four_ranks):
    n = 4
    for r, out in enumerate(four_ranks):
        assert out["all_reduce"] == [10.0] * 6
        assert out["all_gather"] == [[0.0, 1.0, 2.0, 3.0]]
        assert out["reduce_scatter"] == [4.0 * (2 * r), 4.0 * (2 * r + 1)]
        assert out["all_to_all"] == [10.0 * j + r for j in range(n)]
        assert out["uneven"] == [float(j) for j in range(n) for _ in range(1 + (j + r) % 2)]
        assert out["async"] == [4.0] * 4
        assert out["p2p"] == [float((r - 1) % n)] * 2
        total = sum(range(1, n + 1))
        for name in ("dp_shard", "gloo"):
            assert out[f"into_buffers_{name}"] == ([float(j) for j in range(n) for _ in range(4)],
                                                   [total * (4.0 * r + k) for k in range(4)])
        assert out["rs_input_kept"]


def test_gloo_all_gather_and_reduce_scatter_allocate_no_temporaries(four_ranks):
    """gloo's own emulations allocate full-size temporaries; the comm layer's broadcasts and in-place
    all-reduce do not (the one non-scratch reduce-scatter clones its 64-byte input: that is all), nor do the
    blocking calls through shared memory once its mapping has grown."""
    for out in four_ranks:
        assert out["shared_memory_dp_shard"] == shm_machine() and not out["shared_memory_gloo"]
        assert out["allocated_bytes_gloo"] <= 16 * 4, out["allocated_bytes_gloo"]
        assert out["allocated_bytes_dp_shard"] <= 16 * 4, out["allocated_bytes_dp_shard"]


def test_autograd_conjugates(four_ranks):
    for r, out in enumerate(four_ranks):
        assert out["copy_grad"] == 4.0                       # all-reduce of ones over 4 ranks
        assert out["reduce_from"] == (10.0, 1.0)              # sum forward, identity backward
        assert out["gather_grad"] == [4.0 * (4 * r + k) for k in range(4)]  # reduce-scatter of 4 equal grads
        assert out["reduce_scatter_shape"] == ([2, 1], 8.0)   # all-gather of ones
        assert out["split_grad"] == 8.0                        # the slices' gradients gathered: the full tensor
        assert out["a2a_grad"] == [float(r + 1)] * 8            # reverse all-to-all of ones, times the scale


def test_ledger_bytes(four_ranks):
    ledger = four_ranks[0]["ledger"]
    forward = [rec for rec in ledger if rec[3] == "forward"]
    kinds = [rec[0] for rec in forward]
    assert kinds[:4] == ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"]
    assert forward[0][2] == 2 * 3 / 4 * 6 * 4              # all-reduce of 6 fp32
    assert forward[1][1] == 4 and forward[1][2] == 3 / 4 * 16  # all-gather: full tensor of 4 fp32
    assert forward[2][1] == 8 and forward[2][2] == 3 / 4 * 32  # reduce-scatter: full input of 8 fp32
    assert forward[3][2] == 3 / 4 * 16
    uneven = forward[4]
    assert uneven[0] == "all_to_all" and uneven[2] == (6 - 1) * 4  # rank 0 keeps 1 of its 6 rows
    assert [rec[0] for rec in forward[-2:]] == ["send", "recv"] and forward[-1][2] == 0
    assert "backward" in {rec[3] for rec in ledger}
    assert four_ranks[0]["span_kinds"] == ["comm", "wait"]


@pytest.mark.fast
def test_overlap_stats_arithmetic():
    t = Timeline(0)
    t.add("backward", "compute", 0, 100)
    t.add("wait", "wait", 80, 100)        # blocked on communication: not busy
    t.add("bucket 0", "comm", 30, 60)     # hidden behind compute
    t.add("bucket 1", "comm", 70, 95)     # 70-80 hidden, 80-95 exposed
    t.add("optimizer", "compute", 100, 120)
    stats = t.overlap_stats()
    assert stats == {"comm_ns": 55, "busy_ns": 100, "exposed_ns": 15, "wall_ns": 120}
    assert t.overlap_stats(0, 50) == {"comm_ns": 20, "busy_ns": 50, "exposed_ns": 0, "wall_ns": 50}


def _train_three_times(info):
    """Threads and process groups of this rank after each of three runs in one process (dp 2 x pp 2 with ZeRO-1:
    queued shared-memory collectives and point-to-point rings on four mesh dimensions)."""
    import gc

    import torch.distributed as dist

    from parallelisms.config import ParallelConfig, TrainConfig, preset
    from parallelisms.support import validate_layout
    from parallelisms.training import RunSpec, train_rank

    model, train = preset("tiny"), TrainConfig(steps=2, global_batch=8, seq_len=16)
    spec = RunSpec(model, train, validate_layout(model, train, ParallelConfig(ParallelDims(dp_shard=2, pp=2), zero=1,
                                                                              microbatches=2)))
    after = []
    for _ in range(3):
        train_rank(info, spec)
        gc.collect()  # the run's objects form ordinary cycles (model, engine, hooks): the collector frees them
        after.append((len(os.listdir("/proc/self/task")), len(dist.distributed_c10d._world.pg_map)))
    return after


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_a_run_leaves_no_group_and_no_thread_behind():
    """Each run destroys the groups its meshes made, stops its transports' threads and takes its hooks out of the
    model: the default group alone is left, and a process that trains again does not gather threads (gloo keeps
    three per group). With the hooks left in, ZeRO-1 under a pipeline kept a group alive per run."""
    for after in launch(_train_three_times, 4, threads=1):
        assert [groups for _, groups in after] == [1, 1, 1], after
        assert after[0][0] == after[1][0] == after[2][0], after
