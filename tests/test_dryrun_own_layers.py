"""A pipeline rank's dry run builds only its own stages' blocks (parallelisms.dryrun.run.layers_on) and equals
the run that builds the whole model: the same ledger, events and memory on every rank class, since the pipeline
cut releases what the rank's stages do not share (parallel/pipeline/runner.py: release_other_stages)."""

import dataclasses
import functools

import pytest

from parallelisms.dryrun import dry_run
from parallelisms.dryrun.run import dry_run_rank, layers_on

from _layouts import assert_same_dry_runs, layout_with

LAYOUTS = [
    ["1f1b", "zero1", "bf16"],
    ["interleaved", "sp"],
    ["zb-v", "tp"],
    ["dualpipev"],
    ["1f1b", "ep"],
]


@pytest.mark.parametrize("features", LAYOUTS, ids="+".join)
def test_own_layers_equal_the_whole_model(features):
    model, train, parallel = layout_with(features)
    model = dataclasses.replace(model, n_layers=4)  # one layer a stage chunk even when interleaved or V-shaped
    whole = dry_run(model, train, parallel, run_rank=functools.partial(dry_run_rank, own_layers=False))
    own = dry_run(model, train, parallel)
    assert_same_dry_runs(whole, own)
    assert all(len(layers_on(parallel, model, rank)) < model.n_layers for rank in whole["runs"])


def test_every_layer_is_some_ranks():
    """The pp ranks' layers together are the model's, each once (twice under DualPipe: two paths)."""
    for features, times in ((["interleaved"], 1), (["zb-v"], 1), (["dualpipe"], 2)):
        model, _, parallel = layout_with(features)
        dims = parallel.dims
        ranks = [r for r in range(dims.world_size) if all(v == 0 for k, v in dims.coordinates(r).items() if k != "pp")]
        held = sorted(i for r in ranks for i in layers_on(parallel, model, r))
        assert held == sorted(list(range(model.n_layers)) * times), features
