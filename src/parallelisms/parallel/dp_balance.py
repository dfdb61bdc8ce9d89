"""Data-parallel balance by measured speed (``--dp-balance measured``): a slower data-parallel rank gets fewer
sequences of every global batch, so every rank reaches the gradient all-reduce at about the same time.

Synchronous data parallelism runs at the pace of its slowest replica; with an even split a rank F times slower
makes the others wait (F - 1) x their compute every step. Here each rank times its own forward and backward
(the microbatch loop's compute) over the steps since the last split, the first step left out (warm-up); after
``MEASURE_STEPS`` steps, and again every ``--rebalance-every`` steps, one all-gather over the world gives every
rank every rank's time per sequence (the median over the measured steps of each step's compute over its rows: one step
slowed by another job on a shared machine does not set the split; a data-parallel rank counts at its slowest
member: tensor- or context-parallel peers compute together), and every rank derives the same split: sequences in proportion to
speed, in whole units of ``grad_accum`` sequences, at least one unit each, largest remainders first.

Without ``--rebalance-every`` the first split settles: a rank's speed measured under one split need not be its
speed under another where ranks share a resource (two ranks a core: under the even split the slowed rank's
core-mate finishes early and the slowed rank runs alone, fast, for the rest of the step, so the first measurement
understates the slowdown), so the split is measured again under itself, ``MEASURE_STEPS - 1`` steps at a time, and
re-split until a re-split moves no rank by more than one unit (rounding), at most ``SETTLE`` times.

Training stays equal to single-process training: rank r's loss (the mean over its n_r sequences) is scaled by
n_r x dp / B before the backward, so the engines' gradient average over dp (DDP, ZeRO, FSDP: a sum divided by
dp) becomes sum_r n_r / B x g_r, the gradient of the mean over all B sequences; the reported loss is weighted
the same way. Sequences of one run have one length, so sequences and tokens are in proportion. The split is
part of the data position in checkpoints: a resumed run continues with it.
"""

from __future__ import annotations

import statistics

import torch

MEASURE_STEPS = 4  # steps on the even split before the first measured one (the first warms up: three measured)
SETTLE = 3  # re-splits after the first, each measured under the split before it, while the split still moves


def proportional_split(speeds: list[float], total: int, unit: int) -> list[int]:
    """``total`` sequences in whole ``unit``s split in proportion to ``speeds``, at least one unit each, the
    leftover units to the largest remainders (ties: the lower rank); the same on every rank for the same input."""
    units = total // unit
    ideal = [units * s / sum(speeds) for s in speeds]
    counts = [max(1, int(x)) for x in ideal]
    while sum(counts) > units:  # the floor of one unit each took too many: trim the most over its ideal
        counts[max(range(len(counts)), key=lambda r: (counts[r] - ideal[r], counts[r]))] -= 1
    order = sorted(range(len(counts)), key=lambda r: (-(ideal[r] - counts[r]), r))
    for r in order[:units - sum(counts)]:
        counts[r] += 1
    return [c * unit for c in counts]


class DataBalance:
    """This rank's share of each global batch under ``--dp-balance measured`` (see the module docstring)."""

    def __init__(self, comms, dp: int, dp_rank: int, global_batch: int, grad_accum: int, rebalance_every: int):
        self.comms, self.dp, self.dp_rank = comms, dp, dp_rank
        self.global_batch, self.unit, self.every = global_batch, grad_accum, rebalance_every
        self.split = [global_batch // dp] * dp  # sequences per data-parallel rank
        self.per_row: list[float] = []  # each step's compute ns per sequence since the last split
        self.history: list[list[int]] = []  # each split in use, in order (the summary shows the last)
        self.settling = SETTLE if not rebalance_every else 0  # re-splits left until the split stops moving

    def rows_of(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the global batch (``inputs``, ``targets``) under the split in use."""
        start = sum(self.split[:self.dp_rank])
        end = start + self.split[self.dp_rank]
        return inputs[start:end], targets[start:end]

    @property
    def weight(self) -> float:
        """The factor on this rank's loss: n_r x dp / B."""
        return self.split[self.dp_rank] * self.dp / self.global_batch

    def after_step(self, step: int, compute_ns: int) -> None:
        """Count this rank's compute of step ``step`` (0-based, ``compute_ns`` for its rows), and re-split when
        due (every rank calls it after every step: the re-split is a collective)."""
        if step > 0:  # the first step warms up
            self.per_row.append(compute_ns / self.split[self.dp_rank])
        done = step + 1
        due = done == MEASURE_STEPS or (self.every and done > MEASURE_STEPS and (done - MEASURE_STEPS) % self.every == 0)
        settle = bool(self.history) and self.settling > 0 and len(self.per_row) >= MEASURE_STEPS - 1
        if (due or settle) and self.per_row:
            before = list(self.split)
            self._resplit()
            if settle:
                moved = max(abs(a - b) for a, b in zip(before, self.split))
                self.settling = 0 if moved <= self.unit else self.settling - 1

    def _resplit(self) -> None:
        mine = torch.tensor([float(self.dp_rank), statistics.median(self.per_row)], dtype=torch.float64)
        with self.comms.ledger.in_phase("report"):
            every = self.comms["world"].all_gather(mine[None]) if self.comms["world"].size > 1 else mine[None]
        per_row = [0.0] * self.dp
        for dp_rank, ns in every.tolist():
            per_row[int(dp_rank)] = max(per_row[int(dp_rank)], ns)  # a data-parallel rank at its slowest member
        self.split = proportional_split([1.0 / max(ns, 1e-9) for ns in per_row], self.global_batch, self.unit)
        self.history.append(list(self.split))
        self.per_row = []

    def state_dict(self) -> dict:
        return {"dp_split": list(self.split), "dp_settling": self.settling}

    def load_state_dict(self, state: dict) -> None:
        """Continue with a saved split when it fits this run (same dp degree, global batch and unit); a run
        resumed on another layout starts even and measures again."""
        split = state.get("dp_split") if isinstance(state, dict) else None
        if split and len(split) == self.dp and sum(split) == self.global_batch and all(
                n > 0 and n % self.unit == 0 for n in split):
            self.split = list(split)
            self.history.append(list(self.split))
            self.settling = int(state.get("dp_settling", self.settling))

    def report(self) -> dict:
        return {"split": list(self.split), "splits": self.history, "every": self.every,
                "settling": self.settling}
