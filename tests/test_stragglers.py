"""The straggler report: a rank slowed with --slow-rank is named in every dimension it slows (dp, tp, cp, ep,
pp), nobody is named without one, and the waits are computed from arrivals as the module says."""

import functools
import json
import os

import pytest
import torch

from parallelisms.config import PRESETS, ModelConfig, ParallelConfig, TrainConfig
from parallelisms.mesh import ParallelDims
from parallelisms.stragglers import DIMS, StragglerReport, chrome_wait_events, describe
from parallelisms.training import RunSpec

from _launching import launch_once_per_world, train_each

TINY = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=128)
SLOW = (1, 4.0)  # a large factor: the slowed rank's lateness dwarfs a busy machine's noise
TRAIN = TrainConfig(steps=8, global_batch=8, seq_len=64)


def _spec(slow=SLOW, model=TINY, train=TRAIN, **dims) -> RunSpec:
    return RunSpec(model, train.replace(slow_rank=slow), ParallelConfig(dims=ParallelDims(**dims)))


SPECS = {  # data parallelism: more rows a rank, so compute (which --slow-rank slows) outweighs the optimizer
    "dp": _spec(dp_replicate=2, train=TRAIN.replace(global_batch=16, seq_len=128)), "tp": _spec(tp=2), "cp": _spec(cp=2),
    "pp": RunSpec(TINY, TRAIN.replace(slow_rank=SLOW), ParallelConfig(dims=ParallelDims(pp=2), microbatches=8)),
    "ep": _spec(model=PRESETS["tiny-moe"], dp_replicate=2, ep=2),
    "none": _spec(slow=None, dp_replicate=2), "none_tp": _spec(slow=None, tp=2),
}


def _train_on_one_core(info, world: int, specs: dict) -> dict:
    """``train_each`` with every rank on the same core: on a machine shared with other jobs, ranks held on
    different cores run at those cores' speeds, and the rank on the busier one is a real straggler that the
    report rightly names (docs/measurements-history.md); on one core the machine treats the ranks alike."""
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    return train_each(info, world, specs)


_results = launch_once_per_world(functools.partial(_train_on_one_core, specs=SPECS))


def launched(name: str) -> dict:
    return _results(SPECS[name].parallel.dims.world_size)[name]


@pytest.fixture(scope="module")
def report_of(alone):
    """name -> rank 0's report; the runs happen alone (conftest's ``alone``): on a machine shared with another
    test's ranks, whichever rank shares a core with them is a real straggler, and the report would rightly name it."""
    with alone():
        reports = {name: launched(name) for name in SPECS}
    return reports.__getitem__


@pytest.mark.parametrize("dim", ["dp", "tp", "cp", "ep", "pp"])
def test_the_slowed_rank_is_named_in_its_dimension(dim, report_of):
    stragglers = report_of(dim)["stragglers"]
    assert stragglers["dims"][dim]["rank"] == 1, stragglers
    assert stragglers["clock"] == "same-host monotonic clock"


@pytest.mark.parametrize("name", ["none", "none_tp"])
def test_nobody_is_named_without_a_slowed_rank(name, report_of):
    stragglers = report_of(name)["stragglers"]
    assert stragglers["dims"], stragglers  # the collectives were seen
    assert all(d["rank"] is None for d in stragglers["dims"].values()), stragglers
    assert all("none beyond noise" in line for line in describe(stragglers))


def _rows(*notes):
    """Encoded notes: (kind 0 collective / 1 send / 2 receive, call, seq, dim, arrive ns, block ns or -1)."""
    return torch.tensor(notes, dtype=torch.int64).reshape(-1, 6)


@pytest.mark.fast
def test_waits_follow_arrivals():
    """A blocking all-reduce where rank 1 arrives 30 us after rank 0; an asynchronous one rank 0 issued at 0 and
    blocked on at 50 while rank 1 arrived at 80 (rank 0 lost 30, not 80); a send rank 0 made at 200 to rank 1,
    which posted the receive at 100 and blocked at 150 (rank 1 lost 50). Times in us."""
    dp, pp, us = DIMS.index("dp"), DIMS.index("pp"), 1000
    rank0 = _rows((0, 7, 1, dp, 1000 * us, 1000 * us), (0, 7, 2, dp, 2000 * us, 2050 * us), (1, 1, 1, pp, 2200 * us, -1))
    rank1 = _rows((0, 7, 1, dp, 1030 * us, 1030 * us), (0, 7, 2, dp, 2080 * us, 2080 * us),
                  (2, 1, 1, pp, 2100 * us, 2150 * us))
    report = StragglerReport(2, [0, 0], "test clock", trace=True)
    figures = report.add_step([rank0, rank1], [(0, 1000 * us), (0, 1000 * us)], measured=True)
    assert figures == {"straggler_dp": None, "straggler_wait_dp_s": 60e-6, "straggler_pp": None,
                       "straggler_wait_pp_s": 50e-6}  # 6% and 5% of a 1 ms step: below the noise line
    result = report.result()
    assert result["dims"]["dp"]["per_rank"][1]["last"] == 2
    assert result["dims"]["dp"]["per_rank"][0]["waited_s_per_step"] == pytest.approx(60e-6)
    assert result["dims"]["pp"]["per_rank"][1]["waited_s_per_step"] == pytest.approx(50e-6)
    assert sorted((w[0], w[1], w[3]) for w in report.waits) == [(0, 1, 30 * us), (0, 1, 30 * us), (1, 0, 50 * us)]
    events = chrome_wait_events([(0, 1, 1000, 30_000, 31_000, "dp")], origin_ns=0)
    flows = [e for e in events if e["ph"] in ("s", "f")]
    assert [(e["ph"], e["pid"]) for e in flows] == [("s", 0), ("f", 1)]  # the arrow ends at the late rank
    json.dumps(events)


@pytest.mark.fast
def test_a_hand_over_folds_its_steps_at_once():
    """Two steps handed over together: the first (the run's warm-up) only traced, the second measured, where rank 1
    arrives 200 us late at a 1 ms step's all-reduce (20% of the step: beyond the noise line)."""
    dp, us = DIMS.index("dp"), 1000
    notes = [[0, 0, 7, 1, dp, 100 * us, 100 * us, 0], [1, 0, 7, 1, dp, 900 * us, 900 * us, 0],
             [0, 0, 7, 2, dp, 1100 * us, 1100 * us, 1], [1, 0, 7, 2, dp, 1300 * us, 1300 * us, 1]]
    report = StragglerReport(2, [0, 0], "test clock")
    figures = report.fold(notes, [[(0, 1000 * us)] * 2, [(1000 * us, 2000 * us)] * 2], first_measured=1)
    assert figures == [{}, {"straggler_dp": 1, "straggler_wait_dp_s": 200e-6}]
    result = report.result()
    assert result["steps"] == 1 and result["dims"]["dp"]["per_rank"][1]["last"] == 1
    assert result["dims"]["dp"]["rank"] == 1  # beyond noise in every measured step, all of the waiting


@pytest.mark.fast
def test_clock_offsets_move_other_hosts_onto_rank_0():
    """Rank 1's clock runs 5000 ns ahead: with that offset its arrival 5030 is rank 0's 30."""
    report = StragglerReport(2, [0, 5000], "offsets", trace=False)
    report.add_step([_rows((0, 3, 1, 0, 0, 0)), _rows((0, 3, 1, 0, 5030, 5030))], [(0, 100), (5000, 5100)],
                    measured=True)
    assert report.result()["dims"]["dp"]["per_rank"][0]["waited_s_per_step"] == pytest.approx(30e-9)


def test_expert_load_counts_every_routed_token(report_of):
    """tiny-moe routes each of 8 x 64 tokens to 2 experts in each of 2 layers: 2048 assignments a step, split over
    the 2 expert-parallel ranks, none dropped (no capacity limit)."""
    load = report_of("ep")["expert_load"]
    assert len(load["tokens_per_expert"]) == 8 and len(load["tokens_per_ep_rank"]) == 2
    assert sum(load["tokens_per_ep_rank"]) == pytest.approx(8 * 64 * 2 * 2)
    assert load["dropped_per_step"] == 0 and load["ep_rank_imbalance"] >= 1.0
