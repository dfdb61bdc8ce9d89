"""--dp-balance measured: a slowed data-parallel rank gets fewer sequences, and training stays equal to
single-process training in float64 (DDP, ZeRO, a pipeline per replica, experts over the data-parallel ranks),
the split resumes from a checkpoint's data state."""

import contextlib
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from parallelisms.config import PRESETS, ModelConfig, ParallelConfig, TrainConfig
from parallelisms.errors import ConfigError
from parallelisms.mesh import ParallelDims
from parallelisms.parallel.dp_balance import DataBalance, proportional_split
from parallelisms.support import validate_layout
from parallelisms.training import RunSpec
from parallelisms.equivalence import TOLERANCE_FLOAT64

from _launching import launch_reports, settled

TINY = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=128)
TRAIN = TrainConfig(steps=6, global_batch=16, seq_len=32, dtype="float64", slow_rank=(1, 3.0))


def _spec(model=TINY, dims=ParallelDims(dp_replicate=2), **options) -> RunSpec:
    dims = ParallelDims(dp_shard=2) if options.get("zero") else dims
    parallel = ParallelConfig(dims=dims, dp_balance="measured", rebalance_every=1, **options)
    return RunSpec(model, TRAIN, parallel, collect_state=True)


SPECS = {"ddp": _spec(), "zero2": _spec(zero=2),
         # a pipeline per replica: each replica's share in whole rounds of its 2 microbatches
         "pp": _spec(dims=ParallelDims(dp_replicate=2, pp=2), microbatches=2),
         # experts: the load-balancing loss is a mean over sequences, weighted like the language-model loss; the
         # expert-parallel group spans both data-parallel ranks, so the all-to-alls carry unequal shares
         "moe_ep": _spec(model=dataclasses.replace(PRESETS["tiny-moe"], capacity_factor=1.25),
                         dims=ParallelDims(dp_replicate=2, ep=2))}
report_of = launch_reports(SPECS)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_balanced_training_equals_single_process_training(name):
    report, spec = report_of(name), SPECS[name]
    splits = report["dp_balance"]["splits"]
    dims = spec.parallel.dims
    coords = dims.coordinates(TRAIN.slow_rank[0])
    slow = coords["dp_replicate"] * dims.dp_shard + coords["dp_shard"]  # the slowed rank's data-parallel rank
    assert len(splits) == 3 and splits[-1] == report["dp_balance"]["split"]  # after step 4, re-measured after 5, 6
    unit = spec.parallel.microbatches if dims.pp > 1 else TRAIN.grad_accum
    assert all(sum(split) == TRAIN.global_batch and all(n > 0 and n % unit == 0 for n in split) for split in splits)
    # fewer: the split measured over three steps (each re-split after it reads one step, which another test's
    # ranks on the same cores can slow; the training stays equal whatever the split)
    assert splits[0][slow] < splits[0][1 - slow], report["dp_balance"]
    result = settled(report, spec.model, TRAIN, splits=2, tolerance=TOLERANCE_FLOAT64)
    assert result["ok"] and result["max_param_rel_diff"] < TOLERANCE_FLOAT64, result


@pytest.mark.fast
def test_proportional_split():
    assert proportional_split([1.0, 1.0], 16, 1) == [8, 8]
    assert proportional_split([3.0, 1.0], 16, 1) == [12, 4]
    assert proportional_split([1.0, 1 / 1.5, 1.0, 1.0], 16, 2) == [4, 4, 4, 4]  # 4.36/2.9: whole units of 2
    assert proportional_split([100.0, 1.0], 8, 2) == [6, 2]  # at least one unit each
    assert sum(proportional_split([1.0, 2.0, 3.0], 60, 1)) == 60


class _World:
    """Two data-parallel ranks' all-gather of (dp rank, ns per sequence): rank 0 at 1.0, rank 1 at ``slow()``."""
    size = 2

    def __init__(self, slow):
        self.slow = slow

    def all_gather(self, mine):
        return torch.tensor([[0.0, 1.0], [1.0, self.slow()]], dtype=torch.float64)


class _Comms(dict):
    ledger = SimpleNamespace(in_phase=lambda phase: contextlib.nullcontext())


@pytest.mark.fast
def test_the_first_split_settles_when_the_speed_depends_on_the_split():
    """Without --rebalance-every: measured again under each new split until a re-split moves no rank by more than a
    unit. The slowed rank looks 1.2x slow under the even split (its core-mate finished early) and 1.5x under its
    share: [9, 7] after step 4, [10, 6] after step 7 (moved one sequence: settled), then no more re-splits."""
    measured = iter([1.2, 1.5, 1.5, 1.5])
    balance = DataBalance(_Comms(world=_World(lambda: next(measured))), 2, 0, 16, 1, 0)
    for step in range(20):
        balance.after_step(step, 1000)
    assert balance.history == [[9, 7], [10, 6]] and balance.settling == 0
    periodic = DataBalance(_Comms(world=_World(lambda: 1.2)), 2, 0, 16, 1, 5)  # --rebalance-every 5: no settling
    for step in range(8):
        periodic.after_step(step, 1000)
    assert periodic.history == [[9, 7]]
    resumed = DataBalance(None, 2, 0, 16, 1, 0)  # the checkpoint carries the re-splits left
    resumed.load_state_dict(balance.state_dict())
    assert resumed.split == [10, 6] and resumed.settling == 0


@pytest.mark.fast
def test_the_split_resumes_from_the_data_state():
    balance = DataBalance(None, 2, 0, 16, 1, 0)
    balance.load_state_dict({"step": 3, "dp_split": [12, 4]})
    assert balance.split == [12, 4] and balance.weight == 12 * 2 / 16
    other = DataBalance(None, 4, 0, 16, 1, 0)  # resumed on another layout: even, measured again
    other.load_state_dict({"step": 3, "dp_split": [12, 4]})
    assert other.split == [4, 4, 4, 4]


@pytest.mark.fast
def test_bad_settings_are_one_line():
    with pytest.raises(ConfigError, match="needs data parallelism"):
        validate_layout(TINY, TrainConfig(global_batch=8), ParallelConfig(dims=ParallelDims(tp=2), dp_balance="measured"))
    pipedream = ParallelConfig(dims=ParallelDims(pp=2, dp_replicate=2), schedule="pipedream", dp_balance="measured")
    with pytest.raises(ConfigError, match="pipedream"):
        validate_layout(TINY, TrainConfig(global_batch=8), pipedream)
    with pytest.raises(ConfigError, match="--rebalance-every"):
        validate_layout(TINY, TrainConfig(), ParallelConfig(dims=ParallelDims(dp_replicate=2), rebalance_every=3))
