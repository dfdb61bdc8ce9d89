"""The per-parameter (FSDP2) and buffer-reuse (YaFSDP) engines composed with pipeline, context and tensor
parallelism, and the hybrid flat strategies with context parallelism, against single-process float64 training
at TOLERANCE_FLOAT64 (losses, gradient norms before clipping, final parameters):

- per_param and reuse at pp 2 x dp 2, each under 1F1B and one more schedule (interleaved with clipping that
  bites, ZB-H1's split backward), every stage's engine held through the step: one all-gather and one
  reduce-scatter per unit and step, the full parameters freed after the stage's last backward (per_param),
  one buffer pair per unit of the stage (reuse); persistent parameters are the shards;
- hybrid_shard over dp_replicate 2 x dp_shard 2 x cp 2 (shards over dp_shard x cp, torchtitan's mesh);
- per_param with ring attention and reuse with Ulysses at dp 2 x cp 2; reuse at dp 2 x tp 2.

One launch per world size trains its scenarios in sequence (process start-up dominates on two cores).
"""

import pytest

from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig, preset
from parallelisms.mesh import ParallelDims
from parallelisms.support import validate_layout
from parallelisms.training import RunSpec
from parallelisms.equivalence import TOLERANCE_FLOAT64, batch_slices

from _launching import assert_reproduces, launch_reports

TINY = preset("tiny")
PIPE = ModelConfig(vocab_size=256, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64)
PLAIN = TrainConfig(steps=2, global_batch=8, seq_len=16, grad_clip=0.0, dtype="float64")
CLIP = PLAIN.replace(grad_clip=0.5)  # below every step's reference norm: asserted below
PP_DP = ParallelDims(pp=2, dp_shard=2)
MICROBATCHES = 2


def _pipeline(style: str, schedule: str) -> ParallelConfig:
    return ParallelConfig(PP_DP, fsdp="full_shard", fsdp_style=style, schedule=schedule, microbatches=MICROBATCHES,
                          chunks=2 if schedule == "interleaved" else 1)


SCENARIOS = {  # name -> (model, train, layout)
    "per_param_pp2_dp2_1f1b": (PIPE, PLAIN, _pipeline("per_param", "1f1b")),
    "per_param_pp2_dp2_interleaved_clip": (PIPE, CLIP, _pipeline("per_param", "interleaved")),
    "reuse_pp2_dp2_1f1b": (PIPE, PLAIN, _pipeline("reuse", "1f1b")),
    "reuse_pp2_dp2_zbh1_clip": (PIPE, CLIP, _pipeline("reuse", "zb-h1")),
    "per_param_dp2_ring_cp2": (TINY, PLAIN, ParallelConfig(ParallelDims(dp_shard=2, cp=2), fsdp="full_shard",
                                                           fsdp_style="per_param")),
    "reuse_dp2_ulysses_cp2": (TINY, PLAIN, ParallelConfig(ParallelDims(dp_shard=2, cp=2), fsdp="full_shard",
                                                          fsdp_style="reuse", cp_attention="ulysses")),
    "reuse_dp2_tp2": (TINY, PLAIN, ParallelConfig(ParallelDims(dp_shard=2, tp=2), fsdp="full_shard",
                                                  fsdp_style="reuse")),
    "hybrid_shard_ring_cp2": (TINY, PLAIN, ParallelConfig(ParallelDims(dp_replicate=2, dp_shard=2, cp=2),
                                                          fsdp="hybrid_shard")),
}
SPECS = {name: RunSpec(model, train, validate_layout(model, train, parallel), collect_state=True)
         for name, (model, train, parallel) in SCENARIOS.items()}



_report = launch_reports(SPECS)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_reproduces_single_process_float64(name):
    model, train, parallel = SCENARIOS[name]
    assert_reproduces(_report(name), model, train, batch_slices(parallel, train), TOLERANCE_FLOAT64)


def _stage0_units() -> int:
    """Units of stage 0 at pp 2 under 1F1B: the embedding and the first half of the blocks."""
    return 1 + PIPE.n_layers // 2


@pytest.mark.parametrize("style", ["per_param", "reuse"])
def test_held_stage_gathers_and_reduces_each_unit_once_per_step(style):
    """Held through the step: per unit and step one all-gather and one reduce-scatter (per microbatch
    regathering would be 2 x microbatches all-gathers), whatever the number of microbatches."""
    comm = _report(f"{style}_pp2_dp2_1f1b")["comm"]
    assert round(comm["all_gather"]["calls"], 6) == _stage0_units()
    assert round(comm["reduce_scatter"]["calls"], 6) == _stage0_units()


def test_held_memory_counts_shards_as_persistent():
    """Persistent parameters and gradients are the dp shards of the stage (rank 0: stage 0; every row count
    and unit is even here, so no padding), the gathered stage and its full gradients are transient and freed
    after the step (per_param), and buffer reuse keeps one weight and one gradient buffer per unit of the
    stage, together twice the stage's full parameters."""
    stage_bytes = 8 * (PIPE.vocab_size * PIPE.dim + PIPE.n_layers // 2 * _block_numel())  # float64
    per_param = _report("per_param_pp2_dp2_1f1b")["memory"]
    assert per_param["params"] == per_param["grads"] == stage_bytes // 2
    assert per_param["gathered_params_peak"] >= stage_bytes  # the whole stage held at once
    assert per_param["grad_buffers_peak"] >= stage_bytes     # its full gradients too, before the reduction
    assert per_param["live_buffers"] == {"weight": 0, "grad": 0}
    reuse = _report("reuse_pp2_dp2_1f1b")["memory"]
    assert reuse["params"] == reuse["grads"] == stage_bytes // 2
    assert reuse["buffer_allocations"] == {"weight": _stage0_units(), "grad": _stage0_units()}
    assert reuse["live_buffers"] == reuse["buffer_allocations"]
    assert reuse["reused_buffers"] == 2 * stage_bytes


def _block_numel() -> int:
    from parallelisms.model import build_model
    return sum(p.numel() for p in build_model(PIPE, 0, device="meta").layers["0"].parameters())
