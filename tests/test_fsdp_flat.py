"""The FSDP1 flat-parameter strategies (configurations of the engine in parallel/flat.py) reproduce
single-process AdamW within 1e-5 at world sizes 2 and 4 (hybrid ones on a 2 x 2 replicate x shard mesh),
send the bytes their sharding implies, and hold ZeRO-3's memory for FULL_SHARD.

One launch per world size runs every scenario.
"""

import pytest

from parallelisms.config import ParallelConfig, TrainConfig, preset
from parallelisms.mesh import ParallelDims
from parallelisms.parallel.memory import zero_formula
from parallelisms.training import RunSpec, train_rank
from parallelisms.equivalence import reference_train

from _launching import launch_once_per_world, settled

MODEL = preset("tiny")
BASE = TrainConfig(steps=3, global_batch=8, seq_len=32)
ACCUM = BASE.replace(grad_accum=2)
SCENARIOS = {  # name: (strategy, train config, world sizes)
    "full_shard": ("full_shard", BASE, (2, 4)),
    "shard_grad_op": ("shard_grad_op", BASE, (2, 4)),
    "no_shard": ("no_shard", BASE, (2, 4)),
    "no_shard_accum": ("no_shard", ACCUM, (2,)),
    "shard_grad_op_accum": ("shard_grad_op", ACCUM, (2,)),
    "hybrid_shard": ("hybrid_shard", BASE, (4,)),
    "hybrid_shard_zero2": ("hybrid_shard_zero2", BASE, (4,)),
}


def _dims(strategy, world):
    return ParallelDims(dp_replicate=2, dp_shard=world // 2) if strategy.startswith("hybrid") else \
        ParallelDims(dp_shard=world)


def _run(info, world):
    reports = {}
    for name, (strategy, cfg, worlds) in SCENARIOS.items():
        if world in worlds:
            parallel = ParallelConfig(_dims(strategy, world), fsdp=strategy)
            reports[name] = train_rank(info, RunSpec(MODEL, cfg, parallel, collect_state=True))
    return reports


@pytest.fixture(scope="module")
def runs():
    """world size -> rank 0's reports of every scenario at that size (one launch each, on first use)."""
    return launch_once_per_world(_run)


@pytest.fixture(params=[2, 4], ids=["w2", "w4"])
def run(request, runs):
    return request.param, runs(request.param)


@pytest.fixture(scope="module")
def references():
    return {cfg: reference_train(MODEL, cfg) for cfg in (BASE, ACCUM)}


@pytest.mark.parametrize("name, world", [(n, w) for n, (*_, worlds) in SCENARIOS.items() for w in worlds])
def test_reproduces_single_process_adamw(runs, references, name, world):
    report = runs(world)[name]
    result = settled(report, MODEL, SCENARIOS[name][1], references[SCENARIOS[name][1]])
    assert result["ok"], result


def test_ledger_bytes_per_strategy(run):
    """Sharded strategies reduce-scatter G over the shard group; FULL_SHARD gathers twice (forward and
    backward), SHARD_GRAD_OP once (kept from forward to backward); NO_SHARD all-reduces like DDP; hybrid
    strategies also all-reduce the G/S shard over the replicas."""
    world, reports = run
    g = MODEL.num_params() * 4

    def ring(n, nbytes):
        return (n - 1) / n * nbytes

    for name, gathers in (("full_shard", 2), ("shard_grad_op", 1)):
        comm = reports[name]["comm"]
        assert comm["reduce_scatter"]["bytes_per_rank"] == pytest.approx(ring(world, g), rel=1e-9)
        assert comm["all_gather"]["bytes_per_rank"] == pytest.approx(gathers * ring(world, g), rel=1e-9)
    comm = reports["no_shard"]["comm"]
    assert set(comm) == {"all_reduce"}
    assert comm["all_reduce"]["bytes_per_rank"] == pytest.approx(2 * ring(world, g), rel=1e-9)
    if world == 4:
        for name, gathers in (("hybrid_shard", 2), ("hybrid_shard_zero2", 1)):
            comm = reports[name]["comm"]
            assert comm["reduce_scatter"]["bytes_per_rank"] == pytest.approx(ring(2, g), rel=1e-9)
            assert comm["all_gather"]["bytes_per_rank"] == pytest.approx(gathers * ring(2, g), rel=1e-9)
            # the shard's all-reduce over 2 replicas (plus the clip norm's scalar over the shard group)
            assert comm["all_reduce"]["bytes_per_rank"] == pytest.approx(2 * ring(2, g / 2), abs=16)


def test_memory(run):
    """FULL_SHARD holds ZeRO-3's P/N + G/N + O/N; NO_SHARD holds everything; hybrid divides by the shard degree."""
    world, reports = run
    psi = MODEL.num_params()
    for name, n, stage in (("full_shard", world, 3), ("no_shard", 1, 0), ("shard_grad_op", world, 3)):
        got, want = reports[name]["memory"], zero_formula(psi, n, stage)
        for kind in ("params", "grads", "optimizer"):
            assert got[kind] == pytest.approx(want[kind], rel=0.05), (name, kind, got, want)
    if world == 4:
        got, want = reports["hybrid_shard"]["memory"], zero_formula(psi, 2, 3)
        assert got["persistent"] == pytest.approx(want["total"], rel=0.05)

