"""Pipeline parallelism composed with tensor parallelism (Megatron-LM's PP x TP): pp 2 x tp 2 (1F1B), with
sequence parallelism (1F1B, and interleaved with clipping that bites) reproduce single-process training (pp x
tp x dp: the float64 matrix); under SP the stages send 1/tp of the bytes, as the perf model predicts;
layouts that do not compose are one line before launch (the split, DualPipe and PipeDream schedules
with tp: test_pipeline_tp_split.py).

One launch per world size runs every scenario in sequence (process start-up dominates on two cores).
"""

import dataclasses

import pytest

from parallelisms.support import validate_layout
from parallelisms.config import PRESETS, ConfigError, ParallelConfig, TrainConfig
from parallelisms.mesh import ParallelDims
from parallelisms.perf.model import comm_per_step
from parallelisms.training import RunSpec
from parallelisms.equivalence import TOLERANCE, TOLERANCE_FLOAT64

from _launching import assert_reproduces, launch_once_per_world, train_each

MODEL = dataclasses.replace(PRESETS["tiny"], n_layers=4)  # four layers: interleaved needs pp x 2 stages
# seq 32 as in test_tensor_parallel: at seq 16 this model's Adam noise floor (first updates are lr x sign(g),
# so rounding of near-zero gradient elements shows) is 1.2e-5 for pp 2 x tp 2, where pp 2 alone is exact
TRAIN = TrainConfig(steps=2, global_batch=4, seq_len=32, grad_clip=0.0)
CLIPPED = TRAIN.replace(grad_clip=1e-3)  # far below the gradient norm: every step is scaled

GELU = dataclasses.replace(MODEL, mlp="gelu", ffn_dim=256)  # GPT's two-matrix MLP
MODELS = {"pp2_tp2_sp_1f1b_gelu_selective": GELU}  # the others train MODEL
FLOAT64 = TRAIN.replace(dtype="float64")  # GELU's fp32 noise floor here is 2.7e-5 (0.8x the reference's own)
# name -> (dims, sequence parallel, schedule, train config)
SCENARIOS = {
    "pp2_tp2_1f1b": (ParallelDims(pp=2, tp=2), False, "1f1b", TRAIN),
    "pp2_tp2_sp_1f1b": (ParallelDims(pp=2, tp=2), True, "1f1b", TRAIN),
    "pp2_tp2_sp_interleaved_clip": (ParallelDims(pp=2, tp=2), True, "interleaved", CLIPPED),
    "pp2_tp2_sp_1f1b_gelu_selective": (ParallelDims(pp=2, tp=2), True, "1f1b", FLOAT64),
}


def _layout(name: str) -> ParallelConfig:
    dims, sp, schedule, train = SCENARIOS[name]
    parallel = ParallelConfig(dims, sequence_parallel=sp, schedule=schedule, microbatches=4 // dims.dp,
                              chunks=2 if schedule == "interleaved" else 1,
                              recompute="selective" if name.endswith("selective") else "none")
    return validate_layout(MODELS.get(name, MODEL), train, parallel)


SPECS = {name: RunSpec(MODELS.get(name, MODEL), SCENARIOS[name][-1], _layout(name), collect_state=True)
         for name in SCENARIOS}


def _run(info, world):
    return train_each(info, world, SPECS)


results = launch_once_per_world(_run)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_matches_single_process(name):
    dims, _, _, train = SCENARIOS[name]
    # dp ranks x microbatches: four slices of one row each
    assert_reproduces(results(dims.world_size)[name], MODELS.get(name, MODEL), train, splits=4,
                      tolerance=TOLERANCE_FLOAT64 if train.dtype == "float64" else TOLERANCE)


def test_sequence_parallel_sends_one_tp_th_of_the_bytes():
    """Rank 0's point-to-point bytes per step: 1F1B at pp 2 sends each of 4 microbatches' activations once,
    [1 row, 32 positions, 64] fp32 = 8,192 B, or its sequence shard under SP (4,096 B); the perf model
    predicts both exactly."""
    ranks = results(4)
    plain = ranks["pp2_tp2_1f1b"]["comm"]["send"]["bytes_per_rank"]
    sharded = ranks["pp2_tp2_sp_1f1b"]["comm"]["send"]["bytes_per_rank"]
    assert plain == 4 * 32 * MODEL.dim * 4 and sharded == plain / 2
    for name, measured in (("pp2_tp2_1f1b", plain), ("pp2_tp2_sp_1f1b", sharded)):
        predicted = {(c.kind, c.dim): c.bytes_per_rank for c in comm_per_step(MODEL, _layout(name), TRAIN)}
        assert predicted[("send", "pp")] == measured


@pytest.mark.parametrize("dims, options, match", [
    (ParallelDims(pp=2, dp_shard=2), {"schedule": "pipedream", "zero": 1}, "PipeDream updates a stage after every"),
    (ParallelDims(pp=2, cp=2), {"microbatches": 4}, None),
    (ParallelDims(pp=2, dp_shard=2), {"zero": 2, "microbatches": 2}, None),
    (ParallelDims(pp=2, tp=2), {"sequence_parallel": True, "microbatches": 4}, None),
])
def test_layout_validation(dims, options, match):
    parallel = ParallelConfig(dims, **options)
    if match is None:
        validate_layout(MODEL, TRAIN, parallel)
        return
    with pytest.raises(ConfigError, match=match):
        validate_layout(MODEL, TRAIN, parallel)
