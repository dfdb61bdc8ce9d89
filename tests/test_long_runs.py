"""Long runs stay flat: a training run's ledger (without --trace) keeps sums per kind, group and phase instead of
one record per collective, and reports what a ledger of every record reports; a real 2-rank run retains nothing
per step beyond the report's per-step numbers."""

import random

import pytest

from parallelisms.comm import CommLedger
from parallelisms.config import ModelConfig, ParallelConfig, ParallelDims, TrainConfig
from parallelisms.launch import launch
from parallelisms.step_log import LossLog
from parallelisms.training import RunSpec, train_rank

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


STEPS = 128  # the heap is read before steps STEPS, 2 x STEPS and 3 x STEPS (multiples of the loss log's block)
# the most each step may add to a rank's traced heap in the quieter of the two windows: a step's time and gradient
# norm (16 bytes, arrays of doubles, over-allocated by 1/16) and allocations torch makes inside tensor creation and
# its optimizer's record_function and keeps, not reachable from any Python object, uneven from window to window
# and falling as a run goes on. A span, a ledger record or a metrics record kept per step lifts every window over
# it (several spans and records a step, 150-700 bytes each); a tensor or other container kept per step is caught
# by the object counts.
HEAP_PER_STEP = 160


def _retained(info, spec: RunSpec) -> dict:
    """A rank of ``spec`` with its Python heap traced: before steps STEPS, 2 x STEPS and 3 x STEPS, after a collection, the
    traced bytes (the measurement's own left out) and the live objects of each type; measured once before, at
    step STEPS / 2, so that the measurement's first-use caches (patterns, isinstance caches) are filled by then.
    The buffers that drain on their own clocks are drained at each point: the straggler notes handed over after
    every step, the losses stacked every 64 steps."""
    import collections
    import gc
    import tracemalloc

    from parallelisms import stragglers, trainer

    ours = [tracemalloc.Filter(False, f) for f in (__file__, collections.__file__, tracemalloc.__file__)]
    stragglers.MAX_EVERY, LossLog.BLOCK = 1, 64
    step, seen, calls = trainer.Trainer.train_step, {}, [0]

    def measured(self, *args):
        if calls[0] in (STEPS // 2, STEPS, 2 * STEPS, 3 * STEPS):
            gc.collect()
            traced = sum(t.size for t in tracemalloc.take_snapshot().filter_traces(ours).statistics("filename"))
            seen[calls[0]] = traced, collections.Counter(type(o).__name__ for o in gc.get_objects())
        calls[0] += 1
        return step(self, *args)
    trainer.Trainer.train_step = measured
    tracemalloc.start(1)
    train_rank(info, spec, trace=True)
    tracemalloc.stop()
    return seen


def test_a_training_run_retains_nothing_per_step(tmp_path):
    """Two ranks of the command line's run (a timeline whose spans are summed per step, the summing ledger, the
    straggler report, metrics, the non-finite check): over each of two windows of STEPS steps each rank's Python
    heap grows, in the quieter window, by less than HEAP_PER_STEP bytes a step (what a run keeps per step grows
    both), and no kind of object grows by one per two steps (spans, ledger records, tensors, metrics records or
    notes kept per step would). The Python heap (tracemalloc), not the resident set: the figure is the run's own
    whatever else the machine runs."""
    model = ModelConfig(vocab_size=256, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=16)
    train = TrainConfig(steps=3 * STEPS + 1, global_batch=2, seq_len=8, nonfinite="stop")
    spec = RunSpec(model, train, ParallelConfig(dims=ParallelDims(dp_replicate=2)),
                   metrics_path=str(tmp_path / "metrics.jsonl"), keep_spans=False)
    for rank, seen in enumerate(launch(_retained, 2, spec, threads=1)):
        heap = [seen[k * STEPS][0] for k in (1, 2, 3)]
        per_step = [(after - before) / STEPS for before, after in zip(heap, heap[1:])]
        print(f"rank {rank}: {per_step[0]:.1f} and {per_step[1]:.1f} bytes a step")
        assert min(per_step) < HEAP_PER_STEP, (rank, per_step)
        objects, objects_after = seen[STEPS][1], seen[3 * STEPS][1]
        grown = {kind: n - objects[kind] for kind, n in objects_after.items() if n - objects[kind] >= STEPS}
        assert not grown, (rank, grown)
