"""The straggler report: who made the others wait, at which collectives, and what it cost, per dimension.

Synchronous parallelism runs at the pace of its slowest member. Each rank's arrival notes
(:mod:`parallelisms.comm.arrivals`, already int rows) reach rank 0 every few steps in one all-gather outside
the timed steps. For each collective, the member that arrived last is its late rank, and every other member
lost ``last arrival - max(own arrival, start of its wait)`` (a rank that issued an asynchronous call early and
only blocked later lost only the blocked part). For a point-to-point transfer, the receiver lost
``send's arrival - max(receive posted, start of its wait)`` when the sender came later. Losses are summed per
late rank and mesh dimension (dp, tp, cp, ep, pp; the data-parallel gradient groups dp x cp and the expert
weights' replicas count as dp), all the steps of a hand-over at once, into running totals of a few numbers
per rank, the first step (warm-up) left out: memory does not grow with steps. Megatron-LM's straggler detector reports per-rank throughput; this
report ties the straggler to the time the others lost waiting for it.

Noise: a busy machine makes any rank late now and then. A dimension names its straggler only when the same
rank caused the most waiting in at least ``NAMED_STEPS`` of the steps, each time at least ``NOISE_FRACTION``
of the step (the others' mean loss), and caused at least ``DOMINANCE`` of all the waiting; otherwise the
report says "none beyond noise" and shows the most waited-for rank. Clocks: ranks of one host share CLOCK_MONOTONIC; ranks of other hosts are moved onto rank
0's clock by an offset read right after a barrier at the start (error: the barrier's release skew).
"""

from __future__ import annotations

import math
import socket
import time
from array import array
from collections import defaultdict

import torch

from parallelisms.comm.arrivals import COLLECTIVE, DIMS, SEND

NOISE_FRACTION = 0.10  # of the step: the others' mean wait for one rank in a step below this is noise
NAMED_STEPS = 0.75     # share of the measured steps in which that rank must be over the noise line
DOMINANCE = 0.75       # and its share of all the time lost waiting in that dimension
TRACE_MIN_WAIT_NS = 20_000  # waits drawn in the Chrome trace: at least this long (20 us)
FIRST_EVERY = 1    # steps before the first hand-over of the notes to rank 0
EXCHANGE_S = 2.0   # then a hand-over about every this many seconds of steps,
MAX_EVERY = 64     # and at least every this many steps (the notes held in memory)
WIDTH = 7          # an exchanged row: a note (arrivals.ROW) and its step's index in the hand-over


def clock_offsets(comms, world_size: int) -> tuple[list[int], str]:
    """Per rank, the ns to subtract from its clock to read rank 0's, and how they were found (every rank
    calls it, once, before training)."""
    if world_size == 1:
        return [0], "one process"
    hosts = comms["world"].all_gather_object(socket.gethostname())
    if len(set(hosts)) == 1:
        return [0] * world_size, "same-host monotonic clock"
    comms["world"].all_reduce(torch.zeros(1))  # everyone leaves together (to the release skew)
    now = comms["world"].all_gather_object(time.perf_counter_ns())
    return [t - now[0] for t in now], "offsets measured after a barrier at the start"


def _events(notes: list[list[int]], offsets: list[int]):
    """(dimension code, step, members, late rank, late arrival, [(waiting rank, wait start, lost ns)]) per
    matched call of ``notes`` (rank, kind, call, seq, dim, arrive, block or -1, step rows)."""
    calls, sends, receives = defaultdict(list), {}, {}
    shifted = any(offsets)
    for rank, kind, call, seq, dim, arrive, block, step in notes:
        if shifted:
            arrive, block = arrive - offsets[rank], block - offsets[rank] if block >= 0 else -1
        if kind == COLLECTIVE:
            calls[call, seq].append((rank, arrive, block, dim, step))
        elif kind == SEND:
            sends[call, seq] = (rank, arrive, dim, step)
        else:
            receives[call, seq] = (rank, arrive, block)
    for members in calls.values():
        if len(members) < 2:
            continue
        late, last, _, dim, step = max(members, key=lambda m: m[1])
        lost = [(r, max(a, b), last - max(a, b)) for r, a, b, _, _ in members
                if r != late and b >= 0 and last > max(a, b)]
        yield dim, step, [m[0] for m in members], late, last, lost
    for pair, (source, sent, dim, step) in sends.items():
        if pair not in receives:
            continue
        target, posted, block = receives[pair]
        began = max(posted, block)
        lost = [(target, began, sent - began)] if block >= 0 and sent > began else []
        yield dim, step, [source, target], source if sent > posted else target, max(sent, posted), lost


class _Dimension:
    """Running totals of one dimension over the measured steps (a few numbers per rank)."""

    def __init__(self):
        self.events, self.last = defaultdict(int), defaultdict(int)
        self.caused, self.waited = defaultdict(int), defaultdict(int)  # ns, summed over steps
        self.peers: dict[int, set] = defaultdict(set)
        self.over_noise = defaultdict(int)  # steps in which the rank was the step's straggler beyond noise

    def others(self, rank: int) -> int:
        return max(1, len(self.peers[rank] - {rank}))


class StragglerReport:
    """Rank 0's aggregate of every step's arrivals (see the module docstring). ``trace``: keep each wait for
    the Chrome trace (its size then grows with the run, as the trace does)."""

    def __init__(self, world_size: int, offsets: list[int], clock: str, trace: bool = False):
        self.world_size, self.offsets, self.clock = world_size, offsets, clock
        self.dims: dict[str, _Dimension] = defaultdict(_Dimension)
        self.steps, self.step_ns, self.cost_ns = 0, 0, 0
        self.waits: list[tuple] | None = [] if trace else None

    def add_step(self, notes_per_rank: list[torch.Tensor], windows: list[tuple[int, int]], measured: bool) -> dict:
        """Fold one step in: each rank's rows (kind, call, seq, dim, arrive, block) and step window; ``measured``
        False: the warm-up step, only traced. Returns its figures as :meth:`fold` does."""
        notes = [[r, *row, 0] for r, rows in enumerate(notes_per_rank) for row in rows.tolist()]
        return self.fold(notes, [windows], 0 if measured else 1)[0]

    def fold(self, notes: list[list[int]], windows: list[list[tuple[int, int]]], first_measured: int = 0) -> list[dict]:
        """Fold a hand-over's steps in: ``notes`` (rank, kind, call, seq, dim, arrive, block, step index), per
        step each rank's (start, end); steps before ``first_measured`` are only traced. Returns per step the
        metrics file's figures: ``straggler_<dim>`` (the rank beyond noise, else None) and
        ``straggler_wait_<dim>_s`` (the others' mean wait for the step's most waited-for rank), for the
        dimensions with calls in that step ({} for a step not measured)."""
        caused = [defaultdict(lambda: defaultdict(int)) for _ in windows]  # per step, dimension, late rank
        origin = self.offsets[0]
        for code, step, members, late, last, lost in _events(notes, self.offsets):
            dim = DIMS[code]
            total = sum(ns for _, _, ns in lost)
            caused[step][dim][late] += total
            if self.waits is not None:
                self.waits.extend((r, late, start - origin, ns, last - origin, dim)
                                  for r, start, ns in lost if ns >= TRACE_MIN_WAIT_NS)
            if step < first_measured:
                continue
            totals = self.dims[dim]
            totals.last[late] += 1
            totals.caused[late] += total
            for r in members:
                totals.events[r] += 1
                totals.peers[r].update(members)
            for r, _, ns in lost:
                totals.waited[r] += ns
        figures = [{} for _ in windows]
        for step in range(first_measured, len(windows)):
            step_ns = max(1, sum(e - s for s, e in windows[step]) // len(windows[step]))  # the ranks' mean step
            self.steps += 1
            self.step_ns += step_ns
            for dim, by_rank in caused[step].items():
                totals = self.dims[dim]
                rank = max(by_rank, key=by_rank.get)
                mean = by_rank[rank] / totals.others(rank)
                beyond = mean >= NOISE_FRACTION * step_ns
                totals.over_noise[rank] += beyond
                figures[step][f"straggler_{dim}"] = rank if beyond else None
                figures[step][f"straggler_wait_{dim}_s"] = mean / 1e9
        return figures

    def result(self) -> dict:
        """The ``stragglers`` object of ``--json``: per dimension the named rank (or None), the most waited-for
        rank, how often it arrived last, the others' mean wait a step and its share of the step, per-rank rows."""
        steps = max(1, self.steps)
        step_s = self.step_ns / steps / 1e9
        dims = {}
        for dim, t in sorted(self.dims.items()):
            suspect = max(t.events, key=lambda r: (t.caused[r], t.last[r]))
            wait_s = t.caused[suspect] / t.others(suspect) / steps / 1e9
            share = t.caused[suspect] / max(1, sum(t.caused.values()))
            named = self.steps > 0 and t.over_noise[suspect] >= NAMED_STEPS * self.steps and share >= DOMINANCE
            dims[dim] = {
                "rank": suspect if named else None, "most_waited_for": suspect,
                "last_fraction": t.last[suspect] / max(1, t.events[suspect]),
                "wait_s_per_step": wait_s, "wait_fraction": wait_s / step_s if step_s else 0.0,
                "steps_over_noise": t.over_noise[suspect], "share_of_waiting": share,
                "per_rank": {r: {"last": t.last[r], "calls": t.events[r],
                                 "others_waited_s_per_step": t.caused[r] / t.others(r) / steps / 1e9,
                                 "waited_s_per_step": t.waited[r] / steps / 1e9} for r in sorted(t.events)},
            }
        return {"steps": self.steps, "step_time_s": step_s, "clock": self.clock,
                "cost_s_per_step": self.cost_ns / steps / 1e9,
                "noise_fraction": NOISE_FRACTION, "named_steps": NAMED_STEPS, "dominance": DOMINANCE, "dims": dims}


CALLS = {"pp": "pp transfers", "cp": "cp transfers and collectives"}


def describe(stragglers: dict) -> list[str]:
    """The summary's lines: per dimension, the straggler and its cost, or none beyond noise."""
    lines = []
    for dim, d in stragglers["dims"].items():
        calls = CALLS.get(dim, f"{dim} collectives")
        if d["rank"] is not None:
            lines.append(f"straggler {dim}: rank {d['rank']} arrived last at {d['last_fraction']:.0%} of {calls}; "
                         f"the other ranks waited {d['wait_s_per_step'] * 1e3:.1f} ms a step, "
                         f"{d['wait_fraction']:.0%} of the step")
        else:
            lines.append(f"straggler {dim}: none beyond noise (most waited for: rank {d['most_waited_for']}, "
                         f"{d['wait_s_per_step'] * 1e3:.1f} ms a step, {d['wait_fraction']:.0%} of the step; named at "
                         f">= {stragglers['noise_fraction']:.0%} of the step in {stragglers['named_steps']:.0%} "
                         f"of the steps and {stragglers['dominance']:.0%} of the waiting)")
    if lines:
        lines[-1] += (f" [report cost {stragglers['cost_s_per_step'] * 1e3:.2f} ms a step, "
                      f"{stragglers['cost_s_per_step'] / max(stragglers['step_time_s'], 1e-12):.1%}; "
                      f"{stragglers['clock']}]")
    return lines


def chrome_wait_events(waits: list[tuple], origin_ns: int) -> list[dict]:
    """The Chrome-trace events of the waits: on the waiting rank's row "waits for stragglers", a span
    ``waiting for rank L`` with a flow arrow to the late rank's arrival (a mark on its own row)."""
    events = []
    for i, (rank, late, start, ns, arrival, dim) in enumerate(waits):
        ts, end = (start - origin_ns) / 1e3, (arrival - origin_ns) / 1e3
        events += [
            {"name": f"waiting for rank {late} ({dim})", "cat": "straggler", "ph": "X", "pid": rank, "tid": 3,
             "ts": ts, "dur": ns / 1e3, "args": {"late_rank": late, "dim": dim, "wait_ms": ns / 1e6}},
            {"name": f"arrived last ({dim})", "cat": "straggler", "ph": "X", "pid": late, "tid": 3, "ts": end,
             "dur": 1.0},
            {"name": "waited for", "cat": "straggler", "ph": "s", "id": i, "pid": rank, "tid": 3, "ts": ts},
            {"name": "waited for", "cat": "straggler", "ph": "f", "bp": "e", "id": i, "pid": late, "tid": 3,
             "ts": end},
        ]
    return events


class StragglerWatch:
    """Every rank's side. After each step the step's arrival notes (already int rows) are kept with the step's
    window; every ``every`` steps, and when asked (the last step, a checkpoint's), one all-gather over the
    world (ledger phase ``report``, outside the timed steps) hands them to rank 0, which folds them in, all
    the steps at once (:meth:`StragglerReport.fold`). ``every`` starts at ``FIRST_EVERY`` and then follows
    the step time, the same on every rank (it is read from the gathered rows): the steps of about
    ``EXCHANGE_S`` seconds, at most ``MAX_EVERY``. The report's cost: every rank's time spent on the notes
    and their rows (the largest counts) plus, per exchange, rank 0's time from the last rank's hand-over to
    the end of its analysis (the wait for that last rank is the straggler's, paid at the next collective
    anyway). ``enabled`` False: no notes, no exchange, no report (the cost's A/B in ``bench straggler-cost``)."""

    def __init__(self, comms, rank: int, world_size: int, trace: bool, enabled: bool = True):
        self.comms, self.rank, self.world_size, self.enabled = comms, rank, world_size, enabled
        self.report = None
        if enabled:
            with comms.ledger.in_phase("report"):
                offsets, clock = clock_offsets(comms, world_size)
            self.report = StragglerReport(world_size, offsets, clock, trace) if rank == 0 else None
        comms.ledger.arrivals.active = False
        self.every, self.steps, self.encode_ns = FIRST_EVERY, 0, 0
        self.windows: list[list[int]] = []  # the steps not handed over yet: their start and end
        self.notes: list[list[int]] = []    # and their notes, each ending with its step's index among them
        self.capacity = 64  # rows each rank sends: the most any rank had so far, to a power of two

    def start_step(self) -> None:
        self.comms.ledger.arrivals.active = self.enabled

    def end_step(self, window: tuple[int, int], exchange: bool = False) -> list[dict]:
        """Note the step that ran in ``window``; hand the notes over when due or ``exchange``. Returns, on rank
        0, the figures of each step handed over now (oldest first; :meth:`StragglerReport.fold`), else []."""
        arrivals = self.comms.ledger.arrivals
        arrivals.active = False
        if not self.enabled:
            return [{}] if self.rank == 0 else []
        began = time.perf_counter_ns()
        index = len(self.windows)
        notes = arrivals.take()
        for note in notes:
            note.append(index)
        self.notes += notes
        self.windows.append(list(window))
        self.steps += 1
        self.encode_ns += time.perf_counter_ns() - began
        return self.flush() if exchange or len(self.windows) >= self.every else []

    def flush(self) -> list[dict]:
        """Hand the steps noted so far to rank 0 (every rank calls it after the last step); as :meth:`end_step`."""
        if not self.enabled or not self.windows:
            return []
        handed = time.perf_counter_ns()
        steps = len(self.windows)
        flat = array("q", [steps, handed, 0, sum(e - s for s, e in self.windows), 0, 0, 0])
        for s, e in self.windows:
            flat.extend((s, e, 0, 0, 0, 0, 0))
        for note in self.notes:
            flat.extend(note)
        rows = torch.frombuffer(flat, dtype=torch.int64).view(-1, WIDTH)
        rows[0, 4] = self.encode_ns + time.perf_counter_ns() - handed
        self.windows, self.notes, self.encode_ns = [], [], 0
        with self.comms.ledger.in_phase("report"):
            gathered = self._gather(rows)
        heads = gathered[:, 0].tolist()
        step_ns = max(h[3] for h in heads) / steps  # the slowest rank's mean step: the same on every rank
        self.every = min(MAX_EVERY, max(1, math.ceil(EXCHANGE_S * 1e9 / max(step_ns, 1))))
        if self.report is None:
            return []
        ranks = [g[:h[2]] for g, h in zip(gathered.tolist(), heads)]
        notes = [[r, *row] for r, rows in enumerate(ranks) for row in rows[1 + steps:]]
        windows = [[(rows[1 + k][0], rows[1 + k][1]) for rows in ranks] for k in range(steps)]
        first = self.steps - steps
        figures = self.report.fold(notes, windows, 1 if first == 0 else 0)
        self.report.cost_ns += max(h[4] for h in heads) + time.perf_counter_ns() - max(
            h[1] - self.report.offsets[r] for r, h in enumerate(heads))
        return figures

    def result(self) -> dict | None:
        """Rank 0's ``stragglers`` object (None elsewhere, or with the report off)."""
        return self.report.result() if self.report is not None else None

    def _gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Every rank's ``rows`` padded to the capacity, as [world, capacity, 7]: one all-gather once the
        capacity has settled; a second, wider one when some rank had more rows than it."""
        rows[0, 2] = len(rows)
        if self.world_size == 1:
            return rows[None]
        while True:
            padded = torch.cat([rows, rows.new_zeros((max(0, self.capacity - len(rows)), WIDTH))])
            gathered = self.comms["world"].all_gather(padded[:max(self.capacity, 1)]).view(self.world_size, -1, WIDTH)
            needed = int(gathered[:, 0, 2].max())
            if needed <= self.capacity:
                return gathered
            self.capacity = 1 << (needed - 1).bit_length()
