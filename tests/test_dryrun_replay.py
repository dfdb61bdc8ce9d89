"""The dry run's microbatch replay (parallelisms.dryrun.replay) equals the full run: the same ledger, the same
events and the same memory (peak, split, moment) on every rank class of small pipelined layouts."""

import dataclasses

import pytest

from parallelisms.dryrun import dry_run

from _layouts import assert_same_dry_runs, layout_with

LAYOUTS = [
    ["1f1b", "ddp"],
    ["gpipe", "zero1", "bf16"],
    ["interleaved", "sp", "recompute-selective"],
    ["1f1b", "recompute-full", "zero2"],
    ["1f1b", "ring"],
    ["1f1b", "fsdp-full_shard"],
]
NOT_REPLAYED = [  # run for real, and still equal: a split backward, fused F&B chunks, MoE routing statistics
    ["zb-v", "tp"],
    ["dualpipev"],
    ["1f1b", "ep"],
]


@pytest.mark.parametrize("features", LAYOUTS + NOT_REPLAYED, ids="+".join)
def test_replay_equals_the_full_run(features):
    model, train, parallel = layout_with(features)
    model = dataclasses.replace(model, n_layers=4)  # one layer a stage chunk even when interleaved or V-shaped
    parallel = parallel.replace(microbatches=4)  # the fewest with middle microbatches to replay on every schedule
    full = dry_run(model, train, parallel, replay=False)
    fast = dry_run(model, train, parallel)
    assert_same_dry_runs(full, fast)
    assert (sum(run.replayed for run in fast["runs"].values()) > 0) == (features in LAYOUTS)
