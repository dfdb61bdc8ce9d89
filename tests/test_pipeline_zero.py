"""ZeRO-1 under pipeline parallelism (Megatron-LM's distributed optimizer): pp 2 x dp 2 with 1F1B, interleaved
with clipping that bites and ZB-H1 (split backward) reproduce single-process training (pp 2 x tp 2 x dp 2 with
SP: the float64 matrix); the data-parallel traffic equals plain pipeline DP's all-reduce (reduce-scatter +
all-gather), optimizer state per rank is 1/dp of the plain runner's; layouts that do not compose are one
line before launch.

One launch per world size runs every scenario in sequence (process start-up dominates on two cores).
"""

import dataclasses
import math

import pytest

from parallelisms.support import validate_layout
from parallelisms.config import PRESETS, ConfigError, ParallelConfig, TrainConfig
from parallelisms.mesh import ParallelDims
from parallelisms.perf.model import comm_per_step
from parallelisms.training import RunSpec

from _launching import assert_reproduces, launch_once_per_world, train_each

MODEL = dataclasses.replace(PRESETS["tiny"], n_layers=4)  # four layers: interleaved needs pp x 2 stages
TRAIN = TrainConfig(steps=2, global_batch=4, seq_len=32, grad_clip=0.0)
CLIPPED = TRAIN.replace(grad_clip=1e-3)  # far below the gradient norm: every step is scaled
PP_DP = ParallelDims(pp=2, dp_shard=2)

# name -> (dims, zero, sequence parallel, schedule, train config)
SCENARIOS = {
    "pp2_dp2_1f1b": (PP_DP, 1, False, "1f1b", TRAIN),
    "pp2_dp2_1f1b_plain": (ParallelDims(pp=2, dp_replicate=2), 0, False, "1f1b", TRAIN),  # ledger/memory baseline
    "pp2_dp2_interleaved_clip": (PP_DP, 1, False, "interleaved", CLIPPED),
    "pp2_dp2_zbh1": (PP_DP, 1, False, "zb-h1", TRAIN),
}


def _layout(name: str) -> ParallelConfig:
    dims, zero, sp, schedule, train = SCENARIOS[name]
    parallel = ParallelConfig(dims, zero=zero, sequence_parallel=sp, schedule=schedule, microbatches=2,
                              chunks=2 if schedule == "interleaved" else 1)
    return validate_layout(MODEL, train, parallel)


SPECS = {name: RunSpec(MODEL, SCENARIOS[name][-1], _layout(name), collect_state=True) for name in SCENARIOS}


def _run(info, world):
    return train_each(info, world, SPECS)


results = launch_once_per_world(_run)


@pytest.mark.parametrize("name", [n for n, s in SCENARIOS.items() if s[1]])
def test_matches_single_process(name):
    dims, _, _, _, train = SCENARIOS[name]
    # dp ranks x microbatches: four slices of one row each
    assert_reproduces(results(dims.world_size)[name], MODEL, train, splits=4)


def _stage_numel(stage: int) -> int:
    """Parameters of stage ``stage`` of pp 2 (equal layer counts): embedding or head plus two blocks."""
    block = sum(p.numel() for p in _blocks()["0"].parameters())
    edge = MODEL.vocab_size * MODEL.dim + (MODEL.dim if stage else 0)  # embedding; or output + final norm
    return edge + 2 * block


def _blocks():
    from parallelisms.model import build_model
    return build_model(MODEL, 0, device="meta").layers


def test_data_parallel_bytes_equal_the_all_reduce():
    """Per step, rank 0 (stage 0) sends (N-1)/N x G in the reduce-scatter and again in the all-gather: the
    plain pipeline's all-reduce bytes; the perf model predicts the same kinds."""
    ranks = results(4)
    zero, plain = ranks["pp2_dp2_1f1b"]["comm"], ranks["pp2_dp2_1f1b_plain"]["comm"]
    grad_bytes = 4 * _stage_numel(0)
    # the gradient norm's one-element all-reduces: over pp (plain: gradients are replicated over dp), over dp
    # and pp (ZeRO-1: each rank holds a slice), 2 (N-1)/N x 4 bytes each at N = 2
    assert plain["all_reduce"]["bytes_per_rank"] == 2 * (1 / 2) * grad_bytes + 4
    assert zero["reduce_scatter"]["bytes_per_rank"] == zero["all_gather"]["bytes_per_rank"] == grad_bytes / 2
    assert zero["all_reduce"]["bytes_per_rank"] == 4 + 4
    assert zero["send"] == plain["send"]
    predicted = {(c.kind, c.dim) for c in comm_per_step(MODEL, _layout("pp2_dp2_1f1b"), TRAIN)}
    assert predicted == {("reduce_scatter", "dp"), ("all_gather", "dp"), ("send", "pp"), ("all_reduce", "pp"),
                         ("all_reduce", "dp")}


def test_optimizer_state_is_one_dp_th_per_rank():
    """AdamW's two fp32 moments cover this rank's half of its stage's flat parameters (padded), plus one
    step counter per stage; the plain runner holds moments for the whole stage."""
    ranks = results(4)
    zero, plain = ranks["pp2_dp2_1f1b"]["memory_per_rank"], ranks["pp2_dp2_1f1b_plain"]["memory_per_rank"]
    n_params = len(list(_blocks()["0"].parameters())) * 2
    for rank in range(4):  # rank order: pp outermost, so ranks 0-1 hold stage 0
        numel = _stage_numel(rank // 2)
        assert zero[rank]["optimizer"] == 8 * math.ceil(numel / 2) + 4
        step_counters = 4 * (n_params + (1 if rank < 2 else 2))
        assert plain[rank]["optimizer"] == 8 * numel + step_counters
        assert zero[rank]["optimizer"] / plain[rank]["optimizer"] == pytest.approx(0.5, abs=1e-3)


@pytest.mark.parametrize("dims, extra, match", [
    (ParallelDims(pp=2), {"zero": 1, "schedule": "pipedream"}, "--zero 1 with --schedule pipedream"),
    (PP_DP, {"fsdp": "full_shard", "schedule": "pipedream"}, "--fsdp full_shard with --schedule pipedream: PipeDream "
                                                             "updates a stage after every microbatch"),
])
def test_rejected_layouts_are_one_line(dims, extra, match):
    with pytest.raises(ConfigError, match=match) as info:
        validate_layout(MODEL, TRAIN.replace(global_batch=8), ParallelConfig(dims, microbatches=4, **extra))
    assert "\n" not in str(info.value)
