"""--ep-balance measured: experts placed on expert-parallel ranks by measured load (EPLB), with redundant copies of
the hottest experts; training equal to single-process training in float64 at ep 2 and ep 4, with and without
redundant experts, with data parallelism over expert replicas, with a pipeline, and across a checkpoint resume (the placement is
in the checkpoint; a balanced save also resumes in the plain expert-parallel layout)."""

import atexit
import dataclasses
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
from parallelisms.equivalence import TOLERANCE_FLOAT64

from _launching import launch_reports, settled
from test_bad_input import _one_line, tripwire  # noqa: F401 (a fixture)

# a skewed router: the first two experts get a fixed logit bias, so a measured placement differs from the even one
MOE = ModelConfig(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=32, max_seq_len=64,
                  n_experts=8, top_k=2, router_skew=2.0)
TRAIN = TrainConfig(steps=5, global_batch=8, seq_len=16, dtype="float64", grad_clip=0.5)
SAVE_AT = 3
ROOT = Path(tempfile.mkdtemp(prefix="test-ep-balance-"))
atexit.register(shutil.rmtree, ROOT, True)


def _layout(dp: int, ep: int, redundant: int = 0, balance: str = "measured", **degrees) -> ParallelConfig:
    return ParallelConfig(ParallelDims(dp_replicate=dp, ep=ep, **degrees), ep_balance=balance, ep_redundant=redundant,
                          ep_rebalance_every=1 if balance == "measured" else 0)


def _spec(parallel: ParallelConfig, **checkpoint) -> RunSpec:
    parallel = validate_layout(MOE, TRAIN, parallel)
    options = CheckpointOptions(meta=layout_meta(MOE, TRAIN, parallel), **checkpoint) if checkpoint else None
    return RunSpec(MOE, TRAIN, parallel, collect_state=True, checkpoint=options)


SPECS = {
    "ep2": _spec(_layout(2, 2)),
    "ep2_redundant1": _spec(_layout(2, 2, 1), save_dir=str(ROOT / "ep2"), save_every=SAVE_AT),
    "ep2_redundant1/resumed": _spec(_layout(2, 2, 1), resume=str(ROOT / "ep2" / f"step_{SAVE_AT}")),
    "ep2_redundant1/resumed_even": _spec(_layout(2, 2, balance="even"), resume=str(ROOT / "ep2" / f"step_{SAVE_AT}")),
    "ep4": _spec(_layout(4, 4)),
    "ep4_redundant2": _spec(_layout(4, 4, 2)),
    "dp4_ep2_redundant1": _spec(_layout(4, 2, 1)),  # two replicas of each ep group (ep_replicate 2)
    "tp2_ep2_redundant1": _spec(_layout(2, 2, 1, tp=2)),  # experts replicated over tp
    "cp2_ep2_redundant1": _spec(_layout(1, 2, 1, cp=2)),  # ep carved out of cp: ranks route their own tokens
    "pp2_ep2_redundant1": _spec(_layout(2, 2, 1, pp=2)),  # a layer per stage: each stage places its own layer
    # the flat engine: each block's expert slots a unit sharded over ep_replicate 2, a slot's elements in two shards
    **{f"{name}_dp4_ep2_redundant1": _spec(dataclasses.replace(_layout(1, 2, 1, dp_shard=4), **sharding))
       for name, sharding in (("zero1", {"zero": 1}), ("zero2", {"zero": 2}), ("zero3", {"zero": 3}),
                              ("full_shard", {"fsdp": "full_shard"}))},
    "zero2_ep2_redundant1": _spec(dataclasses.replace(_layout(1, 2, 1, dp_shard=2), zero=2)),  # shards of one
}
report_of = launch_reports(SPECS)
BALANCED = [name for name in SPECS if "/" not in name]


@pytest.mark.parametrize("name", BALANCED)
def test_balanced_training_equals_single_process_training(name):
    result = settled(report_of(name), MOE, TRAIN, tolerance=TOLERANCE_FLOAT64)
    assert result["ok"] and result["max_param_rel_diff"] < TOLERANCE_FLOAT64, result


@pytest.mark.parametrize("name", ["ep2_redundant1/resumed", "ep2_redundant1/resumed_even"])
def test_a_resumed_run_ends_where_single_process_training_does(name):
    """Resumed after step 3 (balanced, or in plain ep from the balanced save): the last steps' losses are the
    uninterrupted run's, the final parameters single-process training's."""
    full, report = report_of("ep2_redundant1"), report_of(name)
    assert report["first_step"] == SAVE_AT + 1
    assert max(abs(a - b) / abs(b) for a, b in zip(report["losses"], full["losses"][SAVE_AT:])) < TOLERANCE_FLOAT64
    result = settled(report, MOE, TRAIN, tolerance=TOLERANCE_FLOAT64)
    assert result["max_param_rel_diff"] < TOLERANCE_FLOAT64, result


@pytest.mark.parametrize("name", BALANCED)
def test_the_placement_follows_the_measured_load(name):
    parallel = SPECS[name].parallel
    ep, redundant = parallel.dims.ep, parallel.ep_redundant
    balance = report_of(name)["ep_balance"]
    assert balance["measured_after_steps"] == [2, 3, 4, 5]  # after the first two steps, then every step
    even = canonical(MOE.n_experts, ep, redundant)
    for placement in balance["placements"]:
        assert valid(placement, MOE.n_experts, ep, ep * (MOE.n_experts // ep + redundant)), placement
        assert placement != even  # the skew moved experts
        hottest = max(placement.count(0), placement.count(1))  # the skewed experts: the most copies
        assert hottest == 1 + min(ep - 1, redundant * ep), placement
    first = balance["measurements"][0]
    assert max(first["tokens_per_expert"][:2]) > 2 * max(first["tokens_per_expert"][2:])  # the router's skew
    assert balance["rank_imbalance_after"] <= balance["rank_imbalance_before"], balance


def test_the_placement_is_in_the_checkpoint():
    full, resumed = report_of("ep2_redundant1"), report_of("ep2_redundant1/resumed")
    assert resumed["first_step"] == SAVE_AT + 1 and resumed["losses"] == full["losses"][SAVE_AT:]
    assert resumed["ep_balance"]["placements"] == full["ep_balance"]["placements"]
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
    (["--preset", "tiny-moe", "--dp", "2", "--ep", "2", "--ep-balance", "measured", "--fsdp", "full_shard",
      "--fsdp-style", "per_param"], "--fsdp-style per_param"),
    (["--preset", "tiny-moe", "--dp", "2", "--ep", "2", "--ep-balance", "measured", "--mixed-precision", "bf16"],
     "--mixed-precision bf16"),
    (["--preset", "tiny-moe", "--dp", "2", "--ep", "2", "--pp", "2", "--schedule", "pipedream", "--global-batch",
      "16", "--ep-balance", "measured"], "--schedule pipedream"),
    (["--preset", "tiny-moe", "--dp", "2", "--ep", "2", "--ep-redundant", "-1"], "--ep-redundant"),
]


@pytest.mark.parametrize("verb", ["train", "verify"])
@pytest.mark.parametrize("argv,flag", BAD, ids=[" ".join(a[4:]) for a, _ in BAD])
def test_bad_settings_are_one_line(capsys, tripwire, verb, argv, flag):  # noqa: F811
    _one_line(capsys, [verb, *argv], flag)


def test_the_skewed_router_is_part_of_the_model():
    with pytest.raises(Exception, match="router_skew"):
        dataclasses.replace(MOE, router_skew=float("nan")).validate()
