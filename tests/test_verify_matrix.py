"""The float64 equivalence matrix: every engine and layout against single-process float64 training at
TOLERANCE_FLOAT64 (1e-10), on per-step losses, per-step gradient norms before clipping and final
parameters. Correct layouts land between 0 and 3e-13 here, so a logic error cannot hide in rounding. Each
scenario targets a path a bug can hide in:

- DDP, ZeRO-1/2/3, FSDP full_shard / shard_grad_op / no_shard (flat), per_param, reuse, and hybrid_shard /
  hybrid_shard_zero2 on dp_replicate 2 x dp_shard 2: each with several gradient buckets (0.05 MB; the
  ledger shows the whole float64 gradient reduced once, in more than one collective) and each with
  gradient accumulation 2; padded shards (odd vocabulary at dp 2, odd widths at dp 4);
- ZeRO-1/2 with the updated parameters' all-gather overlapped with the next forward (--overlap-param-gather);
- tensor parallelism above the KV-head count (tp 4 replicates tiny's 2 KV heads), an odd vocabulary over
  tp 4 (padded vocab-parallel embedding and head), sequence parallelism, the overlapped input gradient and
  the forward's all-reduces pipelined over row blocks;
- ring attention at cp 4 (the direction of the ring matters) and Ulysses, alone and under ZeRO-3 / FSDP;
- expert parallelism (tiny-moe at dp 4 with ep 2 and ep 4; ep 2 with capacity and accumulation; ep 8);
- every pipeline schedule at pp 2 (unclipped) and pp 4 (clipped), pp 2 x dp 2 with ZeRO-1, pp 2 x tp 2,
  pp 2 x cp 2 (ring and Ulysses, and with dp 2 and ZeRO-1), pp 2 with MoE (zb-v, DualPipeV) and pp 2 x dp 2 x ep 2; MoE
  under tp 2 (experts replicated over tp), with ep 2, and pp 2 x dp 2 x tp 2 x ep 2;
- sharded engines over tensor-parallel shards (ZeRO-1/2/3, hybrid, pipeline ZeRO-1) on eight ranks;
- activation recomputation under DDP and ZeRO-3;
- clipping active (0.5, below every step's reference norm, which is asserted, and shown to change the
  training) and off.

Adam is invariant to a constant gradient scale, and clipping absorbs one too, so a wrong scale shows in
the gradient norms only: a test shows that the comparison catches a doubled gradient with clipping
active. A NaN or Inf fails the comparison, naming the step or tensor (pure Python).

One launch per world size trains every scenario of that size in the same processes (process start-up
dominates on two cores); two families run in launches of their own (see OWN_LAUNCH); the comparisons run
in pytest, one per scenario.
"""

import dataclasses
import functools
import math

import pytest
import torch

from parallelisms.support import validate_layout
from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig, preset
from parallelisms.launch import LaunchError
from parallelisms.mesh import ParallelDims
from parallelisms.parallel.pipeline.pipedream import pipedream_reference
from parallelisms.parallel.pipeline.schedules import SCHEDULES
from parallelisms import equivalence
from parallelisms.training import RunSpec
from parallelisms.equivalence import (BF16_ENVELOPE, TOLERANCE, TOLERANCE_FLOAT64, Run, batch_slices, bf16_samples,
                                 compare, compare_mixed_precision, reference_train, reference_train_bf16)

from _launching import assert_pipeline_report, launch_once_per_world, one_thread, train_each

TINY = preset("tiny")
MOE = preset("tiny-moe")
CAPPED_MOE = dataclasses.replace(MOE, capacity_factor=1.0)  # tokens beyond an expert's capacity are dropped
# vocabulary 257: embedding and head rows split unevenly over 2 or 4 ranks (padded per-parameter shards,
# a padded vocab-parallel embedding and head at tp 4)
ODD_VOCAB = dataclasses.replace(TINY, vocab_size=257)
# odd widths: the embedding's flat unit (257 x 30 elements) is 2 mod 4, and rows of 257, 30, 10 and 50 do
# not split over 4 either: padded flat and per-parameter shards at dp 4
ODD = ModelConfig(vocab_size=257, dim=30, n_layers=2, n_heads=3, n_kv_heads=1, ffn_dim=50, max_seq_len=64)
# eight thin layers: a layer for each of pp 4 x 2 virtual stages (interleaved, zb-v, dualpipev)
PIPE = ModelConfig(vocab_size=256, dim=32, n_layers=8, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64)
PIPE_MOE = ModelConfig(vocab_size=256, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=32, max_seq_len=64,
                       n_experts=4, top_k=2)

# two steps: the second's loss, gradient norm and update read what the first left (Adam's moments, sharded
# optimizer state, the updated shards gathered), and the final parameters carry both updates
PLAIN = TrainConfig(steps=2, global_batch=8, seq_len=16, grad_clip=0.0, bucket_mb=0.05, dtype="float64")
CLIP = PLAIN.replace(grad_clip=0.5)  # the clipped models' norms measure 1.6 to 2.7: every step is scaled
ACCUM = PLAIN.replace(grad_accum=2)
PIPE_PLAIN, PIPE_CLIP = PLAIN, CLIP


def _dp(world: int, sharded: bool) -> ParallelDims:
    return ParallelDims(dp_shard=world) if sharded else ParallelDims(dp_replicate=world)


# data-parallel engines on a 1-D mesh of dp ranks: name -> ParallelConfig for dp
ENGINES = {
    "ddp": lambda dp: ParallelConfig(_dp(dp, False)),
    "zero1": lambda dp: ParallelConfig(_dp(dp, True), zero=1),
    "zero2": lambda dp: ParallelConfig(_dp(dp, True), zero=2),
    "zero3": lambda dp: ParallelConfig(_dp(dp, True), zero=3),
    "fsdp_full_shard": lambda dp: ParallelConfig(_dp(dp, True), fsdp="full_shard"),
    "fsdp_shard_grad_op": lambda dp: ParallelConfig(_dp(dp, True), fsdp="shard_grad_op"),
    "fsdp_no_shard": lambda dp: ParallelConfig(_dp(dp, True), fsdp="no_shard"),
    "per_param_full_shard": lambda dp: ParallelConfig(_dp(dp, True), fsdp="full_shard", fsdp_style="per_param"),
    "per_param_shard_grad_op": lambda dp: ParallelConfig(_dp(dp, True), fsdp="shard_grad_op", fsdp_style="per_param"),
    "reuse_full_shard": lambda dp: ParallelConfig(_dp(dp, True), fsdp="full_shard", fsdp_style="reuse"),
}
HYBRID = ParallelDims(dp_replicate=2, dp_shard=2)

SCENARIOS: dict[str, tuple[ModelConfig, TrainConfig, ParallelConfig]] = {}
for _name, _engine in ENGINES.items():
    # 0.05 MB buckets: DDP and ZeRO-1/2 cut several (the others reduce per block anyway); accumulation on
    # the odd vocabulary, whose 257 rows pad the per-parameter shards
    SCENARIOS[f"{_name}_buckets_clip"] = (TINY, CLIP, _engine(2))
    SCENARIOS[f"{_name}_accum"] = (ODD_VOCAB, ACCUM, _engine(2))
for _strategy in ("hybrid_shard", "hybrid_shard_zero2"):
    SCENARIOS[f"{_strategy}_buckets_clip"] = (TINY, CLIP, ParallelConfig(HYBRID, fsdp=_strategy))
    SCENARIOS[f"{_strategy}_accum"] = (TINY, ACCUM, ParallelConfig(HYBRID, fsdp=_strategy))
for _name in ("zero1", "zero2", "zero3", "fsdp_full_shard", "per_param_full_shard"):
    SCENARIOS[f"{_name}_dp4_padded"] = (ODD, PLAIN, ENGINES[_name](4))
SCENARIOS.update({
    "tp2_sp_clip": (TINY, CLIP, ParallelConfig(ParallelDims(tp=2), sequence_parallel=True)),
    "tp4_kv_replicated_clip": (TINY, CLIP, ParallelConfig(ParallelDims(tp=4))),
    "tp4_odd_vocab": (ODD_VOCAB, PLAIN, ParallelConfig(ParallelDims(tp=4))),
    "tp4_odd_vocab_sp": (ODD_VOCAB, PLAIN, ParallelConfig(ParallelDims(tp=4), sequence_parallel=True)),
    "dp2_tp2_overlap": (TINY, PLAIN, ParallelConfig(ParallelDims(dp_replicate=2, tp=2), tp_overlap=True)),
    "dp2_tp2_overlap_forward_chunks": (TINY, ACCUM, ParallelConfig(ParallelDims(dp_replicate=2, tp=2), tp_overlap=True,
                                                                   tp_overlap_chunks=3)),
    # the distributed optimizer's parameter all-gather completed unit by unit in the next forward
    "zero1_overlap_param_gather_buckets_clip": (TINY, CLIP, ParallelConfig(_dp(2, True), zero=1,
                                                                           overlap_param_gather=True)),
    "zero2_overlap_param_gather_accum": (ODD_VOCAB, ACCUM, ParallelConfig(_dp(2, True), zero=2,
                                                                          overlap_param_gather=True)),
    "ulysses_cp2": (TINY, PLAIN, ParallelConfig(ParallelDims(cp=2), cp_attention="ulysses")),
    "ring_cp4_clip": (TINY, CLIP, ParallelConfig(ParallelDims(cp=4), cp_attention="ring")),
    "ring_cp4": (TINY, PLAIN, ParallelConfig(ParallelDims(cp=4), cp_attention="ring")),
    "ring_cp2_tp2": (TINY, PLAIN, ParallelConfig(ParallelDims(cp=2, tp=2))),
    "dp2_ring_cp2_zero3_clip": (TINY, CLIP, ParallelConfig(ParallelDims(dp_shard=2, cp=2), zero=3)),
    "dp2_ulysses_cp2_full_shard": (TINY, PLAIN, ParallelConfig(ParallelDims(dp_shard=2, cp=2), fsdp="full_shard",
                                                               cp_attention="ulysses")),
    "moe_dp4_ep2_clip": (MOE, CLIP, ParallelConfig(ParallelDims(dp_replicate=4, ep=2))),
    "moe_dp4_ep4": (MOE, PLAIN, ParallelConfig(ParallelDims(dp_replicate=4, ep=4))),
    "moe_dp2_ep2_capacity_accum": (CAPPED_MOE, ACCUM, ParallelConfig(ParallelDims(dp_replicate=2, ep=2))),
    "moe_dp2_zero3_clip": (MOE, CLIP, ParallelConfig(_dp(2, True), zero=3)),
    # PipeDream's replicated stages average every update over dp (x cp; experts over their replicas)
    "pp2_dp2_pipedream_clip": (PIPE, PIPE_CLIP, ParallelConfig(ParallelDims(pp=2, dp_replicate=2), schedule="pipedream",
                                                               microbatches=2)),
    "pp2_ring_cp2_pipedream": (PIPE, PIPE_PLAIN, ParallelConfig(ParallelDims(pp=2, cp=2), schedule="pipedream",
                                                                microbatches=4)),
    "pp2_ulysses_cp2_pipedream_recompute_full": (PIPE, PIPE_PLAIN, ParallelConfig(
        ParallelDims(pp=2, cp=2), schedule="pipedream", microbatches=4, cp_attention="ulysses", recompute="full")),
    "moe_pp2_dp2_ep2_pipedream_clip": (PIPE_MOE, PIPE_CLIP, ParallelConfig(ParallelDims(pp=2, dp_replicate=2, ep=2),
                                                                           schedule="pipedream", microbatches=2)),
    "ddp_recompute_selective": (TINY, PLAIN, ParallelConfig(_dp(2, False), recompute="selective")),
    "zero3_recompute_full_clip": (TINY, CLIP, ParallelConfig(_dp(2, True), zero=3, recompute="full")),
    "dp2_tp2_per_param_accum": (ODD_VOCAB, ACCUM, ParallelConfig(ParallelDims(dp_shard=2, tp=2), fsdp="full_shard",
                                                                 fsdp_style="per_param")),
})
MICROBATCHES = {2: 4, 4: 8}  # per pipeline: rows of 2 (pp 2) or 1 (pp 4) of the global batch of 8
for _pp, _train in ((2, PIPE_PLAIN), (4, PIPE_CLIP)):  # each schedule unclipped at pp 2, clipped at pp 4
    for _schedule in SCHEDULES:
        SCENARIOS[f"pp{_pp}_{_schedule}" + ("_clip" if _train.grad_clip else "")] = (PIPE, _train, ParallelConfig(
            ParallelDims(pp=_pp), schedule=_schedule, microbatches=MICROBATCHES[_pp],
            chunks=2 if _schedule == "interleaved" else 1))
for _schedule, _train in (("1f1b", PIPE_CLIP), ("interleaved", PIPE_PLAIN)):
    SCENARIOS[f"pp2_dp2_zero1_{_schedule}" + ("_clip" if _train.grad_clip else "")] = (PIPE, _train, ParallelConfig(
        ParallelDims(pp=2, dp_shard=2), zero=1, schedule=_schedule, microbatches=4,
        chunks=2 if _schedule == "interleaved" else 1))
SCENARIOS.update({
    "pp2_tp2_sp_1f1b_clip": (PIPE, PIPE_CLIP, ParallelConfig(ParallelDims(pp=2, tp=2), schedule="1f1b",
                                                             microbatches=4, sequence_parallel=True)),
    "pp2_tp2_interleaved": (PIPE, PIPE_PLAIN, ParallelConfig(ParallelDims(pp=2, tp=2), schedule="interleaved",
                                                             chunks=2, microbatches=4)),
    # pipeline x context parallelism: every stage runs on the rank's sequence positions, gradients averaged
    # over dp x cp
    "pp2_ring_cp2_1f1b_clip": (PIPE, PIPE_CLIP, ParallelConfig(ParallelDims(pp=2, cp=2), schedule="1f1b",
                                                               microbatches=4)),
    "pp2_ulysses_cp2_zbv": (PIPE, PIPE_PLAIN, ParallelConfig(ParallelDims(pp=2, cp=2), schedule="zb-v",
                                                             cp_attention="ulysses", microbatches=4)),
    "pp2_dp2_ring_cp2_zero1_interleaved": (PIPE, PIPE_PLAIN, ParallelConfig(
        ParallelDims(pp=2, dp_shard=2, cp=2), zero=1, schedule="interleaved", chunks=2, microbatches=2)),
    # pipeline x mixture of experts: a stage without the head backpropagates its layers' load-balancing term
    # beside its output; expert weights reduced over their replicas only
    "pp2_moe_zbv_clip": (PIPE_MOE, PIPE_CLIP, ParallelConfig(ParallelDims(pp=2), schedule="zb-v", microbatches=4)),
    "pp2_moe_dualpipev": (PIPE_MOE, PIPE_PLAIN, ParallelConfig(ParallelDims(pp=2), schedule="dualpipev",
                                                               microbatches=4)),
    "pp2_dp2_ep2_moe_1f1b": (PIPE_MOE, PIPE_PLAIN, ParallelConfig(ParallelDims(pp=2, dp_replicate=2, ep=2),
                                                                  schedule="1f1b", microbatches=2)),
    # mixture of experts under tensor parallelism: experts whole on every tp rank (replicated over tp)
    "tp2_moe_clip": (PIPE_MOE, CLIP, ParallelConfig(ParallelDims(tp=2))),
    "dp2_tp2_ep2_moe": (PIPE_MOE, PLAIN, ParallelConfig(ParallelDims(dp_replicate=2, tp=2, ep=2))),
    "pp2_dp2_tp2_ep2_moe_interleaved": (PIPE_MOE, PIPE_PLAIN, ParallelConfig(
        ParallelDims(pp=2, dp_replicate=2, tp=2, ep=2), schedule="interleaved", chunks=2, microbatches=2)),
})
# sharded data parallelism under pipelines (each stage's flat engine held through the step) with every kind of
# schedule, and ZeRO/FSDP with expert parallelism (expert units sharded over the ranks holding the same experts)
SCENARIOS.update({
    "pp2_dp2_zero2_gpipe": (PIPE, PIPE_PLAIN, ParallelConfig(ParallelDims(pp=2, dp_shard=2), zero=2,
                                                             schedule="gpipe", microbatches=4)),
    "pp2_dp2_zero3_zbh1_clip": (PIPE, PIPE_CLIP, ParallelConfig(ParallelDims(pp=2, dp_shard=2), zero=3,
                                                                schedule="zb-h1", microbatches=4)),
    "pp2_dp2_full_shard_dualpipe_clip": (PIPE, PIPE_CLIP, ParallelConfig(ParallelDims(pp=2, dp_shard=2),
                                                                         fsdp="full_shard", schedule="dualpipe",
                                                                         microbatches=4)),
    "pp2_dp2_shard_grad_op_dualpipev": (PIPE, PIPE_PLAIN, ParallelConfig(ParallelDims(pp=2, dp_shard=2),
                                                                         fsdp="shard_grad_op", schedule="dualpipev",
                                                                         microbatches=4)),
    "pp2_dp2_no_shard_zbv": (PIPE, PIPE_PLAIN, ParallelConfig(ParallelDims(pp=2, dp_shard=2), fsdp="no_shard",
                                                              schedule="zb-v", microbatches=4)),
    "moe_dp4_ep2_zero3_clip": (MOE, CLIP, ParallelConfig(ParallelDims(dp_shard=4, ep=2), zero=3)),
    "moe_dp2_ep2_shard_grad_op": (CAPPED_MOE, PLAIN, ParallelConfig(ParallelDims(dp_shard=2, ep=2),
                                                                    fsdp="shard_grad_op")),
    "pp2_dp2_ep2_moe_zero1_dualpipe": (PIPE_MOE, PIPE_PLAIN, ParallelConfig(ParallelDims(pp=2, dp_shard=2, ep=2),
                                                                            zero=1, schedule="dualpipe",
                                                                            microbatches=4)),
    # the N-D layouts on eight ranks
    "pp2_dp2_tp2_zero1": (PIPE, PIPE_PLAIN, ParallelConfig(ParallelDims(pp=2, dp_shard=2, tp=2), zero=1,
                                                           microbatches=2)),
    "pp2_dp2_tp2_full_shard_clip": (PIPE, PIPE_CLIP, ParallelConfig(ParallelDims(pp=2, dp_shard=2, tp=2),
                                                                    fsdp="full_shard", microbatches=2)),
    "pp2_dp2_tp2_ep2_moe_zero3": (PIPE_MOE, PIPE_PLAIN, ParallelConfig(ParallelDims(pp=2, dp_shard=2, tp=2, ep=2),
                                                                       zero=3, microbatches=2)),
    "pp2_hybrid_shard_zbv": (PIPE, PIPE_PLAIN.replace(global_batch=16), ParallelConfig(
        ParallelDims(pp=2, dp_replicate=2, dp_shard=2), fsdp="hybrid_shard", schedule="zb-v", microbatches=4)),
    # mixed precision (fp32 training; verify's bf16 check, see test_bf16_layouts_within_the_envelope)
    "bf16_dp2_tp2_sp_zero3": (TINY, CLIP.replace(steps=3, dtype="float32"), ParallelConfig(
        ParallelDims(dp_shard=2, tp=2), zero=3, sequence_parallel=True, mixed_precision="bf16")),
    "bf16_pp2_dp2_full_shard": (PIPE, PIPE_PLAIN.replace(dtype="float32"), ParallelConfig(
        ParallelDims(pp=2, dp_shard=2), fsdp="full_shard", microbatches=4, mixed_precision="bf16")),
    "bf16_pp2_dp2_pipedream_clip": (PIPE, PIPE_CLIP.replace(dtype="float32"), ParallelConfig(
        ParallelDims(pp=2, dp_replicate=2), schedule="pipedream", microbatches=4, mixed_precision="bf16")),
})
# Launched on their own, so that a process aborting in gloo (which ends every scenario of its launch) is
# pinned to its family: flat shards of tensor-parallel weights, whose pieces sum their squared norms over
# different mesh dimensions (a rank may hold no piece of a group: both aborted until the empty groups took
# the gradients' dtype); expert parallelism over eight ranks (aborted until a rank whose expert receives no
# token kept its place in the backward all-to-alls).
OWN_LAUNCH = {
    "sharded_tp": {
        "dp4_tp2_sp_zero3_clip": (TINY, CLIP, ParallelConfig(ParallelDims(dp_shard=4, tp=2), zero=3,
                                                             sequence_parallel=True)),
        "dp4_tp2_zero1_accum": (TINY, ACCUM, ParallelConfig(ParallelDims(dp_shard=4, tp=2), zero=1)),
        "hybrid_shard_tp2_clip": (TINY, CLIP, ParallelConfig(ParallelDims(dp_replicate=2, dp_shard=2, tp=2),
                                                             fsdp="hybrid_shard")),
        "dp2_cp2_tp2_ring_zero2": (TINY, PLAIN, ParallelConfig(ParallelDims(dp_shard=2, cp=2, tp=2), zero=2)),
        "pp2_dp2_tp2_sp_zero1_1f1b_clip": (PIPE, PIPE_CLIP, ParallelConfig(ParallelDims(pp=2, dp_shard=2, tp=2),
                                                                           zero=1, sequence_parallel=True,
                                                                           microbatches=2)),
    },
    "ep8": {"moe_dp8_ep8": (MOE, PLAIN, ParallelConfig(ParallelDims(dp_replicate=8, ep=8)))},
    # sixteen ranks: torchtitan's 4-D layout, and every dimension at once (dp, tp, sp, cp, ep, pp, recompute, bf16)
    "four_d": {
        "pp2_dp2_cp2_tp2_sp_full_shard": (PIPE, PIPE_PLAIN, ParallelConfig(
            ParallelDims(pp=2, dp_shard=2, cp=2, tp=2), fsdp="full_shard", sequence_parallel=True,
            microbatches=2)),
        "bf16_everything": (PIPE_MOE, PIPE_CLIP.replace(dtype="float32"), ParallelConfig(
            ParallelDims(pp=2, dp_shard=2, cp=2, tp=2, ep=2), zero=1, sequence_parallel=True, microbatches=2,
            recompute="selective", mixed_precision="bf16")),
    },
}
GROUP = dict.fromkeys(SCENARIOS, "main")
for _group, _scenarios in OWN_LAUNCH.items():
    SCENARIOS.update(_scenarios)
    GROUP.update(dict.fromkeys(_scenarios, _group))

# as verify runs them: fresh memory filled with NaN, so an engine reading a buffer before writing it fails here
SPECS = {name: RunSpec(model, train, validate_layout(model, train, parallel), collect_state=True,
                       poison_fresh_memory=True)
         for name, (model, train, parallel) in SCENARIOS.items()}


def _world(name: str) -> int:
    return SPECS[name].parallel.dims.world_size


def _run(group, info, world):
    return train_each(info, world, {name: spec for name, spec in SPECS.items() if GROUP[name] == group})


def _once_even_if_it_fails(get):
    """``get(world)``, launched once: a failed launch fails every scenario of it without launching again."""
    failed = {}

    def run(world: int) -> dict:
        if world in failed:
            raise failed[world]
        try:
            return get(world)
        except LaunchError as exc:
            failed[world] = exc
            raise
    return run


LAUNCHES = {group: _once_even_if_it_fails(launch_once_per_world(functools.partial(_run, group)))
            for group in ("main", *OWN_LAUNCH)}


def _report(name: str) -> dict:
    return LAUNCHES[GROUP[name]](_world(name))[name]


@functools.cache
def _reference(model: ModelConfig, train: TrainConfig, splits: int, pipedream_pp: int = 0, dp: int = 1) -> Run:
    """Single-process training on ``splits`` slices, or PipeDream's delayed-update reference over
    ``pipedream_pp`` stages and ``splits`` microbatches of each of ``dp`` replicas."""
    with one_thread():
        if pipedream_pp:
            return Run(*pipedream_reference(model, train, pipedream_pp, splits, dp))
        return reference_train(model, train, splits=splits)


def _pipedream(parallel: ParallelConfig) -> bool:
    return parallel.dims.pp > 1 and parallel.schedule == "pipedream"


def _reference_for(name: str, train: TrainConfig | None = None) -> Run:
    model, own, parallel = SCENARIOS[name]
    train = train or own
    if _pipedream(parallel):  # per-microbatch updates: its own reference
        return _reference(model, train, parallel.microbatches, parallel.dims.pp, parallel.dims.dp)
    return _reference(model, train, batch_slices(parallel, train))


# one launch per (group, world size), in order
ORDER = sorted(SCENARIOS, key=lambda name: (GROUP[name] != "main", GROUP[name], _world(name)))


@pytest.mark.parametrize("name", [n for n in ORDER if SCENARIOS[n][2].mixed_precision == "fp32"])
def test_float64_matches_single_process(name):
    model, train, parallel = SCENARIOS[name]
    reference = _reference_for(name)
    # one PipeDream pipeline runs the same operations in the same order as its reference: bit for bit
    exact = _pipedream(parallel) and parallel.dims.dp == 1 and parallel.dims.cp == 1
    result = compare(_report(name), reference, 0.0 if exact else TOLERANCE_FLOAT64)
    assert result["ok"], (name, result)
    # every synchronous layout reports one global norm per step, and it was compared
    assert (result["max_grad_norm_rel_diff"] is None) == _pipedream(parallel), (name, result)
    if train.grad_clip:  # clipping scaled every step, and it changed the training
        if not _pipedream(parallel):
            assert min(reference.grad_norms) > 2 * train.grad_clip, (name, reference.grad_norms)
        unclipped = compare(_report(name), _reference_for(name, train.replace(grad_clip=0.0)))
        assert unclipped["max_param_rel_diff"] > 1e-3, (name, unclipped)


@pytest.mark.parametrize("name", [n for n in ORDER if 1 < SCENARIOS[n][2].dims.pp == SCENARIOS[n][2].dims.world_size])
def test_pipelines_alone_hold_what_the_simulator_says(name):
    """Every schedule alone at pp 2 and pp 4 (and the MoE pipelines): activations held per rank, bubble rates
    and stage times as the schedule simulator says (:func:`assert_pipeline_report`)."""
    assert_pipeline_report(_report(name), SCENARIOS[name][2].dims.pp)


@pytest.mark.parametrize("name", [n for n in ORDER if "_buckets" in n])
def test_gradients_are_reduced_in_several_buckets(name):
    """Per step the whole float64 gradient is reduced once (the ring's share of 8 bytes per parameter:
    nothing downcast, nothing skipped), in more than one collective: several 0.05 MB buckets for DDP and
    ZeRO-1/2, one per block for the others. A sharded engine's all-reduce is the replicas' (hybrid) or the
    8-byte norm."""
    model, _, parallel = SCENARIOS[name]
    comm = _report(name)["comm"]
    kind = "reduce_scatter" if "reduce_scatter" in comm else "all_reduce"
    n = parallel.dims.dp_shard if kind == "reduce_scatter" else parallel.dims.dp
    ring = (n - 1) / n * 8 * model.num_params() * (2 if kind == "all_reduce" else 1)
    assert comm[kind]["bytes_per_rank"] == pytest.approx(ring, rel=1e-12), (name, comm)
    assert comm[kind]["calls"] > 1, (name, comm)


def test_ddp_and_zero_cut_buckets_under_the_cap():
    """The 0.05 MB cap is below every unit's float64 gradient: DDP all-reduces and ZeRO-1/2 reduce-scatter
    several buckets per step where the 25 MB default makes one."""
    units = TINY.n_layers + 2
    assert _report("ddp_buckets_clip")["comm"]["all_reduce"]["calls"] > units
    for stage in (1, 2):
        assert _report(f"zero{stage}_buckets_clip")["comm"]["reduce_scatter"]["calls"] == units


def _doubled_gradients(monkeypatch) -> Run:
    """Single-process training whose every gradient is twice the true one: a layout that sums over two
    data-parallel ranks instead of averaging."""
    build = equivalence.build_model

    def build_doubling(*args, **kwargs):
        model = build(*args, **kwargs)
        for p in model.parameters():
            p.register_hook(lambda g: 2 * g)
        return model
    with monkeypatch.context() as patch, one_thread():
        patch.setattr(equivalence, "build_model", build_doubling)
        return reference_train(TINY, CLIP, splits=2)


def test_wrong_gradient_scale_is_caught_by_the_norms_even_with_clipping(monkeypatch):
    """With clipping active the doubled gradient is clipped to almost the same update (only the clip's
    1e-6 guard differs), and Adam would hide a constant scale anyway: losses and parameters stay within the
    fp32 contract of the true run. The gradient norm before clipping is off by 100% and fails it."""
    truth = _reference(TINY, CLIP, 2)
    doubled = _doubled_gradients(monkeypatch)
    result = compare(doubled, truth, TOLERANCE)
    assert result["max_grad_norm_rel_diff"] == pytest.approx(1.0, rel=1e-6), result
    assert not result["ok"] and result["nonfinite"] is None, result
    blind = compare(dataclasses.replace(doubled, grad_norms=None), truth, TOLERANCE)
    assert blind["ok"], blind  # what losses and parameters alone would have let through
    assert not compare(doubled, truth, TOLERANCE_FLOAT64)["ok"]
    # while the same clipped layout run for real (DDP over two ranks) matches the norms to float64 rounding
    ddp = compare(_report("ddp_buckets_clip"), truth, TOLERANCE_FLOAT64)
    assert ddp["ok"] and ddp["max_grad_norm_rel_diff"] < TOLERANCE_FLOAT64, ddp


def _toy_run(**changes) -> Run:
    state = {"a.weight": torch.ones(2, 3, dtype=torch.float64), "b.bias": torch.full((3,), 2.0, dtype=torch.float64)}
    run = Run([3.0, 2.5, 2.0], state, [1.5, 1.25, 1.0])
    return dataclasses.replace(run, **changes)


@pytest.mark.parametrize("changes, where", [
    ({"losses": [3.0, math.nan, 2.0]}, "step 1 loss nan"),
    ({"losses": [3.0, 2.5, math.inf]}, "step 2 loss inf"),
    ({"grad_norms": [1.5, 1.25, math.nan]}, "step 2 gradient norm nan"),
    ({"state": {"a.weight": torch.ones(2, 3, dtype=torch.float64),
                "b.bias": torch.tensor([2.0, math.nan, 2.0], dtype=torch.float64)}}, "parameter b.bias"),
])
def test_nonfinite_run_fails_naming_where(changes, where):
    reference = _toy_run()
    assert compare(reference, reference, TOLERANCE_FLOAT64)["ok"]
    result = compare(_toy_run(**changes), reference, tolerance=1.0)  # even under a tolerance that lets anything pass
    assert not result["ok"] and result["nonfinite"] == where, result


@pytest.mark.parametrize("name", [n for n in ORDER if SCENARIOS[n][2].mixed_precision == "bf16"])
def test_bf16_layouts_within_the_envelope(name):
    """bf16 layouts against single-process bf16 training on the same slices (their twin); the pipeline alone
    accumulates its microbatches in fp32 main grads and is the exact twin, as data parallelism is. PipeDream's
    twin is its delayed-update reference forwarding and backwarding bf16 casts of the fp32 weights.

    Tensor parallelism's bf16 partial sums have no single-process twin: such a layout is checked against the
    envelope (verify's ``BF16_ENVELOPE``): every step's loss and gradient norm and every tensor within 2x the
    spread of several computations of the same run: the twin, single-process bf16 with the batch's bf16 gradient
    taken over each other count of 1, 2, 4 and 8 slices (four orders of bf16 rounding in all), and fp32 training
    (five runs here); the spread is their largest pairwise distance (a series: at its worst step; a tensor: relative to the
    twin's, floored at bf16's unit roundoff). The default decay groups apply. On bf16_dp2_tp2_sp_zero3 the worst
    ratio is step 2's gradient norm, 1.21: 4.3e-3 from the twin, where the slicings span 3.5e-3 (the twin alone is
    1.7e-3 from fp32: a one-sample envelope scored 2.56); its worst tensor scores 0.92."""
    model, train, parallel = SCENARIOS[name]
    with one_thread():
        if _pipedream(parallel):
            dims = (parallel.dims.pp, parallel.microbatches, parallel.dims.dp)
            bf16 = Run(*pipedream_reference(model, train, *dims, compute_dtype=torch.bfloat16))
            samples = [Run(*pipedream_reference(model, train, *dims))]
        else:
            bf16 = reference_train_bf16(model, train, splits=batch_slices(parallel, train))
            samples = lambda: bf16_samples(model, train, batch_slices(parallel, train))  # noqa: E731
        result = compare_mixed_precision(_report(name), bf16, samples)
    print(name, {k: v for k, v in result.items() if k.startswith(("envelope", "max_"))})
    assert result["ok"], (name, result)
    if parallel.dims.tp == 1:
        assert "envelope" not in result, (name, result)  # the same arithmetic: within the fp32 contract
    else:
        assert result["envelope_samples"] >= 4, result  # the twin, fp32, and two slicings at least


def test_bf16_envelope_catches_a_tensor_moved_by_a_quarter_of_its_update():
    """The envelope is not a loosened tolerance: one tensor off by a quarter of its update over the run fails,
    against the spread of the five computations as against the twin and fp32 alone (a tenth scores under 2, inside the
    envelope: that is its resolution on this model, where bf16 itself moves the tensor by about 2% of its
    value)."""
    model, train, parallel = SCENARIOS["bf16_pp2_dp2_full_shard"]
    splits = batch_slices(parallel, train)
    with one_thread():
        bf16 = reference_train_bf16(model, train, splits=splits)
        samples = bf16_samples(model, train, splits)
        start = reference_train(model, train.replace(steps=0))
    name = "layers.1.attention.wq.weight"
    state = dict(bf16.state)
    state[name] = state[name] + 0.25 * (state[name] - start.state[name])
    for others in (samples, samples[:1]):
        result = compare_mixed_precision(Run(bf16.losses, state, bf16.grad_norms), bf16, others)
        print(len(others), result["envelope"])
        assert not result["ok"] and result["envelope"] > 2 * BF16_ENVELOPE, result