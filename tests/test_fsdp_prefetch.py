"""FSDP prefetch depth (``--fsdp-prefetch N``) on the flat engine: each pass gathers N units ahead of the one
running, training stays float64-exact against one process, and bad combinations fail in one line."""

import pytest
import torch

from parallelisms.comm import Comms
from parallelisms.config import ParallelConfig, TrainConfig, preset
from parallelisms.errors import ConfigError
from parallelisms.mesh import ParallelDims
from parallelisms.model import build_model
from parallelisms.parallel.flat import ShardedEngine
from parallelisms.parallel.wrap import module_units
from parallelisms.parallel.zero import zero_plan
from parallelisms.support import validate_layout
from parallelisms.equivalence import compare, reference_train


MODEL = preset("tiny")
FLOAT64 = TrainConfig(steps=2, global_batch=8, seq_len=32, dtype="float64")
SPECS = {"prefetch2": (3, 2), "prefetch3_full_shard": (None, 3)}


def _parallel(zero, depth):
    return ParallelConfig(ParallelDims(dp_shard=2), zero=zero or 0, fsdp=None if zero else "full_shard",
                          fsdp_prefetch=depth)


@pytest.mark.fast
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_each_unit_runs_with_the_next_depth_units_already_gathering(depth):
    """One process (the engine's one-rank Comm gathers by copy, the hooks run the same): when unit i's forward
    runs, units 0 .. i + depth have been gathered or launched; in backward, units i - depth .. last."""
    model = build_model(MODEL)
    engine = ShardedEngine(model, module_units(model), zero_plan(3), Comms(), prefetch=depth)
    issued, seen = [], {}
    unshard = engine._unshard
    engine._unshard = lambda unit: (issued.append(engine.units.index(unit)), unshard(unit))[1]
    last = len(engine.units) - 1
    def record(key):  # a hook that returns nothing (a hook's result would replace its input or gradient)
        def hook(*_):
            seen.setdefault(key, set(issued))
        return hook

    for index, unit in enumerate(engine.units):  # after the engine's own pre-forward hook
        unit.modules[0].register_forward_pre_hook(record(("forward", index)))
    for index, block in enumerate(model.layers.values()):  # block b is unit b + 1; its attention's backward
        block.attention.register_full_backward_pre_hook(record(("backward", index + 1)))
    tokens = torch.randint(0, MODEL.vocab_size, (2, 16))
    loss = model(tokens, tokens)
    for i in range(last + 1):
        assert seen[("forward", i)] == set(range(min(i + depth, last) + 1)), (i, seen[("forward", i)])
    issued.clear()
    loss.backward()
    for i in range(1, last):
        assert seen[("backward", i)] >= set(range(max(0, i - depth), last + 1)), (i, seen[("backward", i)])
        assert min(seen[("backward", i)]) == max(0, i - depth)  # no further ahead than depth


def _run(info, world):
    from parallelisms.training import RunSpec, train_rank

    return {name: train_rank(info, RunSpec(MODEL, FLOAT64, _parallel(*spec), collect_state=True))
            for name, spec in SPECS.items()}


def test_deeper_prefetch_trains_exactly_as_one_process_in_float64():
    from _launching import launch_once_per_world

    reports = launch_once_per_world(_run)(2)
    reference = reference_train(MODEL, FLOAT64)
    for name in SPECS:
        result = compare(reports[name], reference, 1e-10)
        assert result["ok"], (name, result)


@pytest.mark.fast
def test_deeper_prefetch_needs_sharded_parameters_on_the_flat_engine():
    for bad in (ParallelConfig(ParallelDims(dp_shard=2), zero=2, fsdp_prefetch=2),
                ParallelConfig(ParallelDims(dp_shard=2), fsdp="full_shard", fsdp_style="per_param", fsdp_prefetch=2),
                ParallelConfig(ParallelDims(dp_shard=2, pp=2), zero=3, fsdp_prefetch=2)):
        with pytest.raises(ConfigError, match="--fsdp-prefetch 2"):
            validate_layout(MODEL, TrainConfig(global_batch=8, seq_len=32), bad)
    validate_layout(MODEL, TrainConfig(global_batch=8, seq_len=32), _parallel(3, 2))
