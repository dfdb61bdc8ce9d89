"""--ep-balance measured: experts placed on expert-parallel ranks by measured load (EPLB), with redundant copies of
the hottest experts; training equal to single-process training in float64 at ep 2 and ep 4, with and without
redundant experts, with data parallelism over expert replicas, under every sharding engine (ZeRO-1/2/3, FSDP flat,
per-parameter and buffer reuse), with pipelines (1F1B, DualPipe, DualPipeV, and PipeDream against its own
single-process semantics: each per-microbatch update sums an expert's copies and counts it once in the stage's
norm), and across checkpoint resumes under
DDP, ZeRO-1, ZeRO-3 and a pipeline (the placement and the counts since it are in the checkpoint; a balanced save
also resumes in the plain expert-parallel layout); bf16 mixed precision within verify's bf16 envelope."""

import atexit
import dataclasses
import functools
import random
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig
from parallelisms.mesh import ParallelDims
from parallelisms.parallel.ep_placement import canonical, max_redundant, place, rank_loads, valid
from parallelisms.resume import CheckpointOptions, layout_meta
from parallelisms.support import validate_layout
from parallelisms.training import RunSpec
from parallelisms.equivalence import (TOLERANCE, TOLERANCE_FLOAT64, Run, batch_slices, compare,
                                      compare_mixed_precision, reference_train, reference_train_bf16)
from parallelisms.parallel.pipeline.pipedream import pipedream_reference

from _launching import launch_reports, one_thread, settled
from test_bad_input import _one_line, tripwire  # noqa: F401 (a fixture)

# a skewed router: the first two experts get a fixed logit bias, so a measured placement differs from the even one
MOE = ModelConfig(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=32, max_seq_len=64,
                  n_experts=8, top_k=2, router_skew=2.0)
MOE4 = dataclasses.replace(MOE, n_layers=4)  # DualPipeV: two stages a rank at pp 2
TRAIN = TrainConfig(steps=5, global_batch=8, seq_len=16, dtype="float64", grad_clip=0.5)
BF16 = TRAIN.replace(dtype="float32")  # with --mixed-precision bf16: fp32 master weights, bf16 compute
SAVE_AT = 3
ROOT = Path(tempfile.mkdtemp(prefix="test-ep-balance-"))
atexit.register(shutil.rmtree, ROOT, True)


def _layout(dp: int, ep: int, redundant: int = 0, balance: str = "measured", every: int = 1, **options) -> ParallelConfig:
    degrees = {k: options.pop(k) for k in ("tp", "cp", "pp", "dp_shard") if k in options}
    return ParallelConfig(ParallelDims(dp_replicate=dp, ep=ep, **degrees), ep_balance=balance, ep_redundant=redundant,
                          ep_rebalance_every=every if balance == "measured" else 0, **options)


def _spec(parallel: ParallelConfig, model: ModelConfig = MOE, train: TrainConfig = TRAIN, **checkpoint) -> RunSpec:
    parallel = validate_layout(model, train, parallel)
    options = CheckpointOptions(meta=layout_meta(model, train, parallel), **checkpoint) if checkpoint else None
    return RunSpec(model, train, parallel, collect_state=True, checkpoint=options)


def _saved(name: str, parallel: ParallelConfig) -> dict:
    """``name`` saved after step SAVE_AT, and ``name/resumed`` from that checkpoint."""
    return {name: _spec(parallel, save_dir=str(ROOT / name), save_every=SAVE_AT),
            f"{name}/resumed": _spec(parallel, resume=str(ROOT / name / f"step_{SAVE_AT}"))}


SHARDED = {"zero1": {"zero": 1, "every": 2}, "zero2": {"zero": 2}, "zero3": {"zero": 3}, "full_shard": {"fsdp": "full_shard"},
           **{style: {"fsdp": "full_shard", "fsdp_style": style} for style in ("per_param", "reuse")}}
SPECS = {
    "ep2": _spec(_layout(2, 2)),
    **_saved("ep2_redundant1", _layout(2, 2, 1)),
    "ep2_redundant1/resumed_even": _spec(_layout(2, 2, balance="even"),
                                         resume=str(ROOT / "ep2_redundant1" / f"step_{SAVE_AT}")),
    "ep4": _spec(_layout(4, 4)),
    "ep4_redundant2": _spec(_layout(4, 4, 2)),
    "dp4_ep2_redundant1": _spec(_layout(4, 2, 1)),  # two replicas of each ep group (ep_replicate 2)
    "tp2_ep2_redundant1": _spec(_layout(2, 2, 1, tp=2)),  # experts replicated over tp
    "cp2_ep2_redundant1": _spec(_layout(1, 2, 1, cp=2)),  # ep carved out of cp: ranks route their own tokens
    **_saved("pp2_ep2_redundant1", _layout(2, 2, 1, pp=2)),  # a layer per stage: each stage places its own layer
    # PipeDream: a clipped update per microbatch and stage, each summing its layer's copies; placed between steps
    "pipedream_pp2_ep2_redundant1": _spec(_layout(2, 2, 1, pp=2, schedule="pipedream", microbatches=2)),
    # two copies of each stage (DualPipe), two stages a rank (DualPipeV); the FSDP styles held through the step
    "dualpipe_per_param_pp2_ep2_redundant1": _spec(_layout(1, 2, 1, pp=2, dp_shard=2, schedule="dualpipe",
                                                           microbatches=4, **SHARDED["per_param"])),
    "dualpipev_reuse_pp2_ep2_redundant1": _spec(_layout(1, 2, 1, pp=2, dp_shard=2, schedule="dualpipev",
                                                        microbatches=4, **SHARDED["reuse"]), MOE4),
    # the sharding engines: each block's expert slots a unit sharded over ep_replicate 2, a slot's elements in two
    # shards; ZeRO-1 re-places every second step, so its checkpoint carries the counts of a step since the last
    **{f"{name}_dp4_ep2_redundant1": _spec(_layout(1, 2, 1, dp_shard=4, **sharding))
       for name, sharding in SHARDED.items() if name not in ("zero1", "zero3")},
    **{key: spec for name in ("zero1", "zero3")
       for key, spec in _saved(f"{name}_dp4_ep2_redundant1", _layout(1, 2, 1, dp_shard=4, **SHARDED[name])).items()},
    "zero2_ep2_redundant1": _spec(_layout(1, 2, 1, dp_shard=2, zero=2)),  # shards of one
    # bf16 mixed precision: DDP's (the flat engine's NO_SHARD), ZeRO-1's persistent bf16 copies, a pipeline's
    "bf16_ep2_redundant1": _spec(_layout(2, 2, 1, mixed_precision="bf16"), train=BF16),
    "bf16_zero1_dp4_ep2_redundant1": _spec(_layout(1, 2, 1, dp_shard=4, zero=1, mixed_precision="bf16"), train=BF16),
    "bf16_pp2_ep2_redundant1": _spec(_layout(2, 2, 1, pp=2, mixed_precision="bf16"), train=BF16),
}
report_of = launch_reports(SPECS)
BALANCED = [name for name in SPECS if "/" not in name]
RESUMED = [name for name in SPECS if name.endswith("/resumed")]


@functools.cache
def _reference(model: ModelConfig, pipedream: tuple[int, int, int] | None = None):
    """Single-process float64 training, once per model (every float64 run here trains the same batches); with
    ``pipedream`` (pp, microbatches, dp), PipeDream's own single-process semantics, as ``verify`` compares it."""
    with one_thread():
        return Run(*pipedream_reference(model, TRAIN, *pipedream)) if pipedream else reference_train(model, TRAIN)


@pytest.mark.parametrize("name", [name for name in BALANCED if not name.startswith("bf16")])
def test_balanced_training_equals_single_process_training(name):
    model, parallel = SPECS[name].model, SPECS[name].parallel
    pipedream = (parallel.dims.pp, parallel.microbatches, parallel.dims.dp) if parallel.schedule == "pipedream" else None
    result = settled(report_of(name), model, TRAIN, _reference(model, pipedream), tolerance=TOLERANCE_FLOAT64)
    assert result["ok"] and result["max_param_rel_diff"] < TOLERANCE_FLOAT64, result


@functools.cache
def _bf16_twin(splits: int):
    """Single-process bf16 training on ``splits`` batch slices (each slice's bf16 gradient summed in fp32)."""
    with one_thread():
        return reference_train_bf16(MOE, BF16, splits=splits)


def _bf16_samples(splits: int) -> list:
    """The envelope's other computations (``equivalence.bf16_samples``): the other slicings, and fp32 training."""
    with one_thread():
        return [reference_train(MOE, BF16)] + [_bf16_twin(k) for k in (1, 2, 4, 8) if k != splits]


@pytest.mark.parametrize("name", [name for name in BALANCED if name.startswith("bf16")])
def test_bf16_training_is_within_the_envelope_of_single_process_bf16_training(name):
    """As verify checks bf16 layouts: against single-process bf16 training on the same slices, within the envelope
    (every loss, gradient norm and tensor within 2x the spread of five legitimate computations of the run). Expert
    parallelism has no bf16 twin (an expert's weight gradient is one bf16 product over every ep rank's tokens, its
    copies' are several, summed in fp32), so the envelope decides; and the run is far from fp32 training, so the
    placement moves carried the bf16 working copies along with the fp32 master weights and AdamW's moments."""
    splits = batch_slices(SPECS[name].parallel, BF16)
    result = compare_mixed_precision(report_of(name), _bf16_twin(splits), lambda: _bf16_samples(splits))
    print(name, {k: v for k, v in result.items() if k.startswith(("envelope", "max_"))})
    assert result["ok"], result
    with one_thread():
        fp32 = compare(report_of(name), reference_train(MOE, BF16), TOLERANCE)
    assert fp32["max_param_rel_diff"] > 100 * TOLERANCE, fp32  # bf16 rounding: weights and compute were bf16


@pytest.mark.parametrize("name", [*RESUMED, "ep2_redundant1/resumed_even"])
def test_a_resumed_run_ends_where_single_process_training_does(name):
    """Resumed after step 3 (balanced, or in plain ep from the balanced save): the last steps' losses are the
    uninterrupted run's, the final parameters single-process training's."""
    full, report = report_of(name.split("/")[0]), report_of(name)
    assert report["first_step"] == SAVE_AT + 1
    assert max(abs(a - b) / abs(b) for a, b in zip(report["losses"], full["losses"][SAVE_AT:])) < TOLERANCE_FLOAT64
    result = settled(report, MOE, TRAIN, _reference(MOE), tolerance=TOLERANCE_FLOAT64)
    assert result["max_param_rel_diff"] < TOLERANCE_FLOAT64, result


@pytest.mark.parametrize("name", BALANCED)
def test_the_placement_follows_the_measured_load(name):
    parallel = SPECS[name].parallel
    ep, redundant, every = parallel.dims.ep, parallel.ep_redundant, parallel.ep_rebalance_every
    balance = report_of(name)["ep_balance"]
    assert balance["measured_after_steps"] == list(range(2, TRAIN.steps + 1, every))  # after two steps, then every
    even = canonical(MOE.n_experts, ep, redundant)
    assert len(balance["placements"]) == SPECS[name].model.n_layers  # every layer's, whichever stages rank 0 holds
    for placement in balance["placements"]:
        assert valid(placement, MOE.n_experts, ep, ep * (MOE.n_experts // ep + redundant)), placement
        assert placement != even  # the skew moved experts
        hottest = max(placement.count(0), placement.count(1))  # the skewed experts: the most copies
        assert hottest == 1 + min(ep - 1, redundant * ep), placement
    first = balance["measurements"][0]
    assert max(first["tokens_per_expert"][:2]) > 2 * max(first["tokens_per_expert"][2:])  # the router's skew
    assert balance["rank_imbalance_after"] <= balance["rank_imbalance_before"], balance


@pytest.mark.parametrize("name", RESUMED)
def test_a_resumed_run_continues_bit_identically(name):
    """The placement and the tokens counted since it are in the checkpoint: the resumed run's losses, later
    placements and measurements (ZeRO-1's after step 4 counts step 3, before the save, too) and final parameters
    are the uninterrupted run's, bit for bit."""
    full, resumed = report_of(name.split("/")[0]), report_of(name)
    assert resumed["first_step"] == SAVE_AT + 1 and resumed["losses"] == full["losses"][SAVE_AT:]
    assert resumed["ep_balance"]["placements"] == full["ep_balance"]["placements"]
    after = [i for i, step in enumerate(full["ep_balance"]["measured_after_steps"]) if step > SAVE_AT]
    assert resumed["ep_balance"]["measurements"] == [full["ep_balance"]["measurements"][i] for i in after]
    for key, tensor in full["state"].items():
        assert torch.equal(resumed["state"][key], tensor), key


def test_placement_balances_ranks_and_copies_the_hottest():
    loads = [100.0, 90.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0]
    assert rank_loads(loads, place(loads, 2, 1), 2) == [110.0, 110.0]  # both hot experts on both ranks
    assert rank_loads(loads, place(loads, 4, 2), 4) == [55.0] * 4
    assert sorted(place(loads, 4, 0)[:2]) != [0, 1]  # the two hot experts on different ranks
    assert canonical(8, 2, 0) == list(range(8)) and canonical(8, 4, 1) == [0, 1, 2, 2, 3, 4, 4, 5, 6, 0, 6, 7]
    rng = random.Random(0)
    for _ in range(300):  # any loads: a valid placement (every expert, no two copies on one rank)
        experts = rng.choice([4, 8, 16])
        ranks = rng.choice([r for r in (2, 4, 8) if experts % r == 0])
        redundant = rng.randint(0, max_redundant(experts, ranks))
        placement = place([rng.random() ** 4 for _ in range(experts)], ranks, redundant)
        assert valid(placement, experts, ranks, ranks * (experts // ranks + redundant)), placement


def test_a_saved_placement_that_does_not_fit_is_refused():
    assert not valid([0, 0, 1, 2], 4, 2, 4)  # expert 3 missing
    assert not valid([0, 0, 1, 2, 3, 1], 4, 2, 6)  # two copies of expert 0 on rank 0
    assert not valid([0, 1, 2, 3], 4, 2, 6) and not valid("0123", 4, 2, 4)


BAD = [  # (argv after the verb, the flag the one line names)
    (["--preset", "tiny-moe", "--dp", "2", "--ep-balance", "measured"], "--ep-balance"),  # no ep
    (["--preset", "tiny", "--dp", "2", "--ep-balance", "measured"], "--ep-balance"),  # no experts
    (["--preset", "tiny-moe", "--dp", "2", "--ep", "2", "--ep-balance", "sometimes"], "--ep-balance"),
    (["--preset", "tiny-moe", "--dp", "2", "--ep", "2", "--ep-balance", "measured", "--ep-redundant", "5"],
     "--ep-redundant"),  # 8 experts over ep 2: at most 4 more slots per rank
    (["--preset", "tiny-moe", "--dp", "2", "--ep", "2", "--ep-redundant", "1"], "--ep-redundant"),  # without measured
    (["--preset", "tiny-moe", "--dp", "2", "--ep", "2", "--ep-rebalance-every", "2"], "--ep-rebalance-every"),
    (["--preset", "tiny-moe", "--dp", "2", "--ep", "2", "--ep-redundant", "-1"], "--ep-redundant"),
]


@pytest.mark.parametrize("verb", ["train", "verify"])
@pytest.mark.parametrize("argv,flag", BAD, ids=[" ".join(a[4:]) for a, _ in BAD])
def test_bad_settings_are_one_line(capsys, tripwire, verb, argv, flag):  # noqa: F811
    _one_line(capsys, [verb, *argv], flag)


def test_the_skewed_router_is_part_of_the_model():
    with pytest.raises(Exception, match="router_skew"):
        dataclasses.replace(MOE, router_skew=float("nan")).validate()
