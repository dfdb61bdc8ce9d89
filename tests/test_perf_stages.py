"""Uneven pipeline stages as the runtime cuts them, a fully sharded engine's collectives sharing their link, and
HSDP's collectives on their own groups: each against its closed form."""

import pytest

from parallelisms.config import PRESETS, ParallelConfig, TrainConfig
from parallelisms.mesh import ParallelDims
from parallelisms.parallel.pipeline.partition import equal_bounds
from parallelisms.perf.hardware import PRESETS as HARDWARE
from parallelisms.perf.memory import _ranks
from parallelisms.perf.network import collective_time
from parallelisms.perf.plan import _balanced
from parallelisms.perf.prefetch import exposed_gathers
from parallelisms.perf.stages import busiest_rank, pipeline_ranks, rank0_layers
from parallelisms.perf.step import Layout, _data_parallel_exposed, _data_parallel_traffic

BF16 = ParallelConfig(mixed_precision="bf16")
H100 = HARDWARE["h100"]


def _pipeline(pp, schedule="1f1b", chunks=1, m=16, **kw):
    return BF16.replace(dims=ParallelDims(tp=8, pp=pp, dp_shard=kw.pop("dp", 1)), schedule=schedule, chunks=chunks,
                        microbatches=m, **kw)


def test_126_layers_on_16_stages_as_the_runtime_cuts_them():
    """equal_bounds gives the first 126 % 16 = 14 stages 8 layers and the last two 7: the head's stage is short."""
    cfg = PRESETS["llama3-405b"]
    assert cfg.n_layers == 126
    ranks = pipeline_ranks(cfg, _pipeline(16), 16)
    assert [r.layers for r in ranks] == [8] * 14 + [7, 7]
    assert ranks[0].embedding and ranks[-1].head and not any(r.head for r in ranks[:-1])
    # interleaved, 4 chunks: 64 stages, 62 of 2 layers and 2 of 1; rank r holds stages r, r+16, r+32, r+48
    interleaved = pipeline_ranks(cfg, _pipeline(16, "interleaved", 4), 16)
    assert [r.stage_layers for r in interleaved[13:]] == [(2, 2, 2, 2), (2, 2, 2, 1), (2, 2, 2, 1)]
    assert rank0_layers(cfg, _pipeline(16, "interleaved", 4)) == 8
    # the busiest rank: 8 layers, unless the head outweighs a layer (then 7 layers and the head)
    assert busiest_rank(ranks, 1.0, 0.5).layers == 8
    assert (busiest_rank(ranks, 1.0, 1.5).layers, busiest_rank(ranks, 1.0, 1.5).head) == (7, True)


def test_memory_counts_each_ranks_own_layers():
    cfg, train = PRESETS["llama3-405b"], TrainConfig(global_batch=2048, seq_len=8192)
    parallel = _pipeline(16, "interleaved", 2, dp=128, zero=1, sequence_parallel=True, recompute="full")
    bounds = equal_bounds(126, 32)
    expected = [sum(bounds[s + 1] - bounds[s] for s in (r, r + 16)) for r in range(16)]
    assert [r["layers"] for r in _ranks(cfg, parallel, train, 1.0, 8192, 2, (0.0, 0.0), 0.0)] == expected


def test_the_planner_searches_only_near_even_cuts():
    assert _balanced(126, 16) and _balanced(80, 16) and _balanced(126, 1)
    assert not _balanced(80, 32) and not _balanced(80, 64) and not _balanced(8, 16)


def test_sharded_gathers_and_reduce_scatters_share_one_link():
    """Without a pipeline the forward's gathers (half) run under the forward, the backward's half and the
    reduce-scatters together under the backward: each pass exposes max(what the sum outlasts it by, its gathers'
    stall unit by unit), split by seconds, and each microbatch's last reduce-scatter bucket."""
    cfg = PRESETS["llama3-8b"]
    lay = Layout(m=1, batch=1, layers=32, dp=64)
    traffic = [("all_gather/dp", "gather", 4.0, 10), ("reduce_scatter/dp", "reduce", 3.0, 5),
               ("all_reduce/dp", "scalar", 0.5, 1)]
    out = _data_parallel_exposed(traffic, cfg, lay, 1.5, 4.0, H100, pp=1)  # stall: one unit's gather, 0.4
    forward, backward = max(2.0 - 1.5, 0.4), max(2.0 + 3.0 - 4.0, 0.4)
    assert out["all_gather/dp"] == pytest.approx(forward + backward * 2 / 5)
    assert out["reduce_scatter/dp"] == pytest.approx(backward * 3 / 5 + 3.0 / 5)
    assert out["all_reduce/dp"] == 0.5
    alone = _data_parallel_exposed(traffic, cfg, lay, 1.5, 4.0, H100, pp=2)  # a stage: gathered once, as before
    assert alone["reduce_scatter/dp"] == pytest.approx(3.0 / 5)
    # units: a forward of 0 + 4 x 0.5 s + 0 s and the gather (2.0 s a pass) split by parameters 1:1:1:1:4
    units = [(1, 0.0, 0.0)] + [(1, 0.5, 1.0)] * 3 + [(4, 0.0, 0.0)]
    staged = _data_parallel_exposed(traffic, cfg, lay, 1.5, 4.0, H100, pp=1, units=units, depth=1)
    stall = exposed_gathers([0.25, 0.25, 0.25, 0.25, 1.0], [0.0, 0.5, 0.5, 0.5, 0.0], 1)
    assert stall == pytest.approx(0.25 + 0.25 + (1.0 - 0.5))  # the first two on demand; the head behind one block
    back = max(backward, exposed_gathers([1.0, 0.25, 0.25, 0.25, 0.25], [0.0, 1.0, 1.0, 1.0, 0.0], 1))
    assert back == pytest.approx(1.0 + 0.25)  # backward: the head's gather on demand, then one block's behind it
    assert staged["all_gather/dp"] == pytest.approx(stall + back * 2 / 5)


def test_prefetch_depth_against_its_closed_forms():
    """Uniform units: a gather shorter than a unit's compute is hidden behind it (only the first is exposed);
    longer, the link is the bound at any depth, n g - (n - 1) c; one long gather after short units is hidden
    behind depth units."""
    assert exposed_gathers([1.0] * 6, [2.0] * 6, 1) == pytest.approx(1.0)
    for depth in (1, 2, 4):
        assert exposed_gathers([3.0] * 6, [2.0] * 6, depth) == pytest.approx(6 * 3.0 - 5 * 2.0)
    long = [0.1] * 5 + [3.0]
    compute = [1.0] * 6
    assert exposed_gathers(long, compute, 1) == pytest.approx(0.1 + (3.0 - 1.0))
    assert exposed_gathers(long, compute, 2) == pytest.approx(0.1 + (3.0 - 2.0))
    assert exposed_gathers(long, compute, 3) == pytest.approx(0.1)


def test_hsdp_gathers_within_its_shard_group_and_all_reduces_across_replicas():
    cfg, train = PRESETS["llama3-8b"], TrainConfig(global_batch=64, seq_len=8192)
    hsdp = BF16.replace(dims=ParallelDims(dp_shard=8, dp_replicate=8), fsdp="hybrid_shard")
    traffic = {name: (t, calls) for name, _, t, calls in _data_parallel_traffic(cfg, hsdp, train, H100)}
    from parallelisms.perf.model import comm_per_step

    volumes = {(v.kind, v.dim): v.bytes_per_rank for v in comm_per_step(cfg, hsdp, train, 2, pipeline=False)}
    gather, calls = traffic["all_gather/dp"]
    full = volumes[("all_gather", "dp")] / (7 / 8)  # the ring over the 8 ranks of a node
    assert gather == pytest.approx(collective_time(H100, "all_gather", full, 8, 1, calls))
    reduce, calls = traffic["all_reduce/dp"]
    full = volumes[("all_reduce", "dp")] / (2 * 7 / 8)  # across the 8 replicas, one a node
    assert reduce == pytest.approx(collective_time(H100, "all_reduce", full, 8, 8, calls))
