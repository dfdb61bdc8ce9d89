"""Long runs stay flat: a training run's ledger (without --trace) keeps sums per kind, group and phase instead of
one record per collective, and reports what a ledger of every record reports."""

import random

import pytest

from parallelisms.comm import CommLedger

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "send")
PHASES = ("setup", "forward", "backward", "optimizer", "report")


def _replay(ledger: CommLedger, steps: int, seed: int = 0) -> list[int]:
    """The same random collectives into ``ledger``; the marks a training run takes (before steps 0 and 1)."""
    rng, marks = random.Random(seed), []
    with ledger.in_phase("setup"):
        ledger.add("broadcast", "dp", 2, "torch.float32", 10, 40.0)
    for step in range(steps):
        if step < 2:
            marks.append(ledger.mark())
        for _ in range(rng.randint(1, 6)):
            with ledger.in_phase(rng.choice(PHASES)):
                numel = rng.randint(1, 10**6)
                ledger.add(rng.choice(KINDS), rng.choice(("dp", "tp")), 2, "torch.float32", numel, numel * 3.7)
    return marks


def test_the_summing_ledger_reports_what_every_record_gives():
    full, summed = CommLedger(), CommLedger(keep=False)
    marks, summed_marks = _replay(full, 300), _replay(summed, 300)
    assert marks == summed_marks and summed.records is None and summed.count == len(full.records)
    for since in (0, *marks):
        for exclude in ((), ("report", "setup")):
            want = full.summary(since, per=299, exclude_phases=exclude)
            got = summed.summary(since, per=299, exclude_phases=exclude)
            assert got.keys() == want.keys()
            for kind in want:
                assert got[kind]["calls"] == want[kind]["calls"]
                assert got[kind]["bytes_per_rank"] == pytest.approx(want[kind]["bytes_per_rank"], rel=1e-12)
    assert summed.tail() == full.tail() and summed.tail(2) == full.tail(2)
    with pytest.raises(ValueError, match="no mark at position 7"):
        summed.summary(since=7)


def test_the_summing_ledger_does_not_grow_with_the_steps():
    ledger = CommLedger(keep=False)
    _replay(ledger, 50)
    size = sum(len(sums) for _, sums in ledger.windows)
    _replay(ledger, 5000, seed=1)  # a hundred times the steps (marks only at the first two)
    assert len(ledger.windows) <= 5  # the first replay's two marks, the second's two, and the start
    assert sum(len(sums) for _, sums in ledger.windows) <= size + 2 * len(KINDS) * 2 * len(PHASES)
    assert len(ledger.recent) == CommLedger.TAIL
