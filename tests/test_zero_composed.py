"""ZeRO and FSDP composed with tensor parallelism (dp x tp, as torchtitan's FSDP2 + TP: flat and per-parameter
styles) and with context parallelism (dp x cp, flat style). With TP the engines shard each rank's
tensor-parallel shards over the data-parallel ranks of the same tp coordinate; with CP the flat engine
shards over dp x cp, whose ranks hold different tokens. Every scenario reproduces single-process AdamW within 1e-5 (clipping that bites included: the global
norm sums tensor-parallel shards over tp and counts replicated norm weights once), and the data-parallel
traffic is that of ZeRO over the tp-local parameters.

One launch of four ranks (dp 2 x tp 2, dp 2 x cp 2) runs every scenario.
"""

import pytest

from parallelisms.config import ParallelConfig, TrainConfig, preset
from parallelisms.mesh import ParallelDims
from parallelisms.training import RunSpec, train_rank

from _launching import launch_once_per_world, settled

MODEL = preset("tiny")
BASE = TrainConfig(steps=3, global_batch=8, seq_len=32, grad_clip=0.0)
CLIP = BASE.replace(grad_clip=0.05)  # far below the gradient norm (about 1): clipping scales every step
DIMS = ParallelDims(dp_shard=2, tp=2)
CP = ParallelDims(dp_shard=2, cp=2)
SCENARIOS = {  # name: (parallel config, train config)
    "zero3": (ParallelConfig(DIMS, zero=3), BASE),
    "zero3_sp_clip": (ParallelConfig(DIMS, zero=3, sequence_parallel=True), CLIP),
    "zero1_sp_clip": (ParallelConfig(DIMS, zero=1, sequence_parallel=True), CLIP),
    "zero2_clip": (ParallelConfig(DIMS, zero=2), CLIP),
    "shard_grad_op_sp": (ParallelConfig(DIMS, fsdp="shard_grad_op", sequence_parallel=True), BASE),
    "per_param_clip": (ParallelConfig(DIMS, fsdp="full_shard", fsdp_style="per_param"), CLIP),
    "per_param_sp": (ParallelConfig(DIMS, fsdp="shard_grad_op", fsdp_style="per_param", sequence_parallel=True),
                     BASE),
    "zero3_cp_clip": (ParallelConfig(CP, zero=3), CLIP),
    "full_shard_cp_ulysses": (ParallelConfig(CP, fsdp="full_shard", cp_attention="ulysses"), BASE),
    "zero1_cp": (ParallelConfig(CP, zero=1), BASE),
}


def _run(info, world):
    return {name: train_rank(info, RunSpec(MODEL, cfg, parallel, collect_state=True))
            for name, (parallel, cfg) in SCENARIOS.items()}


@pytest.fixture(scope="module")
def reports():
    return launch_once_per_world(_run)(4)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_reproduces_single_process_adamw(reports, name):
    cfg = SCENARIOS[name][1]
    result = settled(reports[name], MODEL, cfg, splits=2)
    assert result["ok"], result


def _tp_local_params(tp: int) -> int:
    """Parameters one tensor-parallel rank holds: every matrix split over tp, the norm weights whole."""
    m = MODEL
    vocab = -(-m.vocab_size // tp) * tp
    kv = m.n_kv_heads * m.head_dim
    block = (2 * m.dim * m.dim + 2 * m.dim * kv + 3 * m.dim * m.ffn_dim) // tp + 2 * m.dim
    return 2 * vocab * m.dim // tp + m.n_layers * block + m.dim


def test_data_parallel_traffic_is_zero3_over_the_tp_local_parameters(reports):
    """Without SP, tensor parallelism only all-reduces activations, so the all-gathers (forward and backward)
    and reduce-scatters are ZeRO-3's over the data-parallel pair: (N-1)/N x local bytes each (padding to an
    even shard per unit aside)."""
    comm = reports["zero3"]["comm"]
    ring = (2 - 1) / 2 * 4 * _tp_local_params(2)
    assert comm["reduce_scatter"]["bytes_per_rank"] == pytest.approx(ring, rel=1e-3)
    assert comm["all_gather"]["bytes_per_rank"] == pytest.approx(2 * comm["reduce_scatter"]["bytes_per_rank"])
