"""Layouts that shard the sequence twice, or shard it under a mixture of experts, against single-process
float64 training at TOLERANCE_FLOAT64 (losses, gradient norms, final parameters):

- Megatron sequence parallelism inside context parallelism (tp 2 x sp x cp 2, ring and Ulysses, alone and
  with pp 2): SP shards each cp rank's chunk over tp; Ulysses on tiny's one KV head per tp rank repeats it;
- the forward's SP collectives pipelined with their GEMMs (--tp-overlap --tp-overlap-chunks: the column
  GEMMs consume the sequence all-gather piece by piece, the row GEMMs' outputs are reduce-scattered piece by
  piece) at tp 2, dp 2 x tp 2 and pp 2 x tp 2;
- MoE with routing per whole sequence (capacity that drops tokens, sequence-wise aux loss) under SP (the
  layer gathers the sequence over tp), under cp ring and Ulysses (router logits gathered over cp), under
  cp with expert parallelism (ep 2 over the cp ranks; dp 2 x cp 2 x ep 2), and under tp 2 x sp x cp 2.

One launch per world size trains all its scenarios (see test_verify_matrix.py for the pattern).
"""

import dataclasses
import functools

import pytest
import torch

from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig
from parallelisms.data import BatchLoader, load_corpus
from parallelisms.mesh import ParallelDims
from parallelisms.model import build_model
from parallelisms.support import validate_layout
from parallelisms.training import RunSpec
from parallelisms.equivalence import TOLERANCE_FLOAT64, batch_slices, compare, reference_train

from _launching import launch_reports

# tp 2 leaves each rank 2 query heads and 1 KV head: Ulysses cp 2 repeats the KV head
DENSE = ModelConfig(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64)
# capacity ceil(1.0 x 16 x 2 / 4) = 8 assignments per expert and sequence: some are dropped (asserted below)
MOE = dataclasses.replace(DENSE, n_experts=4, top_k=2, capacity_factor=1.0)
TRAIN = TrainConfig(steps=2, global_batch=8, seq_len=16, grad_clip=0.0, dtype="float64")
CLIP = TRAIN.replace(grad_clip=0.05)


def _layout(sp: bool = False, cp_attention: str = "ring", chunks: int = 0, **dims) -> ParallelConfig:
    return ParallelConfig(ParallelDims(**dims), sequence_parallel=sp, cp_attention=cp_attention,
                          tp_overlap=chunks > 0, tp_overlap_chunks=chunks)


SCENARIOS = {
    "tp2_sp_ring_cp2": (DENSE, CLIP, _layout(True, tp=2, cp=2)),
    "tp2_sp_ulysses_cp2": (DENSE, TRAIN, _layout(True, "ulysses", tp=2, cp=2)),
    "pp2_tp2_sp_ring_cp2": (DENSE, TRAIN, _layout(True, pp=2, tp=2, cp=2)),
    "pp2_tp2_sp_ulysses_cp2": (DENSE, TRAIN, _layout(True, "ulysses", pp=2, tp=2, cp=2)),
    "tp2_sp_overlap_chunks2": (DENSE, CLIP, _layout(True, chunks=2, tp=2)),
    "dp2_tp2_sp_overlap_chunks3": (DENSE, TRAIN, _layout(True, chunks=3, dp_replicate=2, tp=2)),  # 3 + 3 + 2 positions
    "pp2_tp2_sp_overlap_chunks2": (DENSE, TRAIN, _layout(True, chunks=2, pp=2, tp=2)),
    "moe_tp2_sp": (MOE, CLIP, _layout(True, tp=2)),
    "moe_ring_cp2": (MOE, TRAIN, _layout(cp=2)),
    "moe_ulysses_cp2": (MOE, CLIP, _layout(cp_attention="ulysses", cp=2)),
    "moe_dp2_ring_cp2_ep2": (MOE, TRAIN, _layout(dp_replicate=2, cp=2, ep=2)),
    "moe_tp2_sp_ulysses_cp2": (MOE, TRAIN, _layout(True, "ulysses", tp=2, cp=2)),
}
SPECS = {name: RunSpec(model, train, validate_layout(model, train, parallel), collect_state=True)
         for name, (model, train, parallel) in SCENARIOS.items()}
REPORT = launch_reports(SPECS)
ORDER = sorted(SCENARIOS, key=lambda name: SPECS[name].parallel.dims.world_size)


@functools.cache
def _reference(model: ModelConfig, train: TrainConfig, splits: int):
    return reference_train(model, train, splits=splits)


@pytest.mark.parametrize("name", ORDER)
def test_float64_matches_single_process(name):
    model, train, parallel = SCENARIOS[name]
    report = REPORT(name)
    result = compare(report, _reference(model, train, batch_slices(parallel, train)), TOLERANCE_FLOAT64)
    assert result["ok"] and result["max_grad_norm_rel_diff"] is not None, (name, result)
    if train.grad_clip:  # clipping scaled the steps, and it changed the training
        unclipped = compare(report, _reference(model, train.replace(grad_clip=0.0), batch_slices(parallel, train)))
        assert unclipped["max_param_rel_diff"] > 1e-3, (name, unclipped)


def test_the_capacity_drops_assignments():
    """The MoE scenarios exercise capacity in token order: the first batch overflows some expert."""
    model = build_model(MOE, TRAIN.seed, dtype=torch.float64)
    tokens, _ = BatchLoader(load_corpus(), TRAIN.global_batch, TRAIN.seq_len, TRAIN.seed).shard(0, 0, 1)
    moe = model.layers["0"].feed_forward
    _, _, keep, _ = moe.route(model.tok_embeddings(tokens))
    assert not keep.all()
