"""The straggler report: who made the others wait, at which collectives, and what it cost, per dimension.

Synchronous parallelism runs at the pace of its slowest member. Each rank's arrival notes
(:mod:`parallelisms.comm.arrivals`) reach rank 0 as int64 rows, every few steps, in one all-gather outside the
timed steps. For each
collective, the member that arrived last is its late rank, and every other member lost
``last arrival - max(own arrival, start of its wait)`` (a rank that issued an asynchronous call early and
only blocked later lost only the blocked part). For a point-to-point transfer, the receiver lost
``send's arrival - max(receive posted, start of its wait)`` when the sender came later. Losses are summed per
late rank and mesh dimension (dp, tp, cp, ep, pp; the data-parallel gradient groups dp x cp and the expert
weights' replicas count as dp), aggregated as the run goes (memory does not grow with steps), the first step
(warm-up) left out. Megatron-LM's straggler detector reports per-rank throughput; this report ties the
straggler to the time the others lost waiting for it.

Noise: a busy machine makes any rank late now and then. A dimension names its straggler only when the same
rank caused the most waiting in at least ``NAMED_STEPS`` of the steps, each time at least ``NOISE_FRACTION``
of the step (the others' mean loss), and caused at least ``DOMINANCE`` of all the waiting; otherwise the report says "none beyond noise" and shows the most
waited-for rank. Clocks: ranks of one host share CLOCK_MONOTONIC; ranks of other hosts are moved onto rank
0's clock by an offset read right after a barrier at the start (error: the barrier's release skew).
"""

from __future__ import annotations

import socket
import time
import zlib
from collections import defaultdict

import torch

NOISE_FRACTION = 0.10  # of the step: the others' mean wait for one rank in a step below this is noise
NAMED_STEPS = 0.75     # share of the measured steps in which that rank must be over the noise line
DOMINANCE = 0.75       # and its share of all the time lost waiting in that dimension
TRACE_MIN_WAIT_NS = 20_000  # waits drawn in the Chrome trace: at least this long (20 us)


def dimension(comm_name: str) -> str:
    """The reported dimension of a Comm: gradient groups (dp, dp_cp, dp_shard, dp_shard_cp, the expert
    weights' ep_replicate) are dp; ep_bwd is ep; the rest are their own name."""
    if comm_name.startswith("dp") or comm_name.startswith("ep_replicate"):
        return "dp"
    return comm_name.split("_")[0]


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


DIMS = ("dp", "tp", "cp", "ep", "pp", "world")  # reported dimensions, by their code in the exchanged rows
KINDS = {"c": 0, "s": 1, "r": 2}  # a collective, a send, a receive


def encode(notes: list[tuple]) -> torch.Tensor:
    """A rank's notes as int64 rows (kind, call id, sequence number, dimension code, arrival, block or -1): one
    tensor, gathered through the comm layer (shared memory on one host) rather than pickled. A collective's id
    is the CRC-32 of its group's identity (the same on every member); a transfer's is source x 2^20 +
    destination."""
    rows = []
    for key, dim, arrive, block in notes:
        call = zlib.crc32(repr(key[1]).encode()) if key[0] == "c" else key[1] * (1 << 20) + key[2]
        name = dimension(dim)
        rows.append((KINDS[key[0]], call, key[-1], DIMS.index(name) if name in DIMS else len(DIMS) - 1, arrive,
                     -1 if block is None else block))
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 6)


def _events(rows_per_rank: list[torch.Tensor], offsets: list[int]):
    """(dimension, members, late rank, late arrival, {waiting rank: (wait start, lost ns)}) per matched call."""
    calls, dims, sends, receives = defaultdict(list), {}, {}, {}
    for rank, rows in enumerate(rows_per_rank):
        shift = offsets[rank]
        for kind, call, seq, dim, arrive, block in rows.tolist():
            arrive, block = arrive - shift, None if block < 0 else block - shift
            if kind == 0:
                calls[call, seq].append((rank, arrive, block))
                dims[call, seq] = DIMS[dim]
            elif kind == 1:
                sends[call, seq] = (rank, arrive, DIMS[dim])
            else:
                receives[call, seq] = (rank, arrive, block)
    for key, members in calls.items():
        if len(members) < 2:
            continue
        late, last, _ = max(members, key=lambda m: m[1])
        lost = {r: (max(a, b), last - max(a, b)) for r, a, b in members
                if r != late and b is not None and last > max(a, b)}
        yield dims[key], [m[0] for m in members], late, last, lost
    for pair, (source, sent, dim) in sends.items():
        if pair not in receives:
            continue
        target, posted, block = receives[pair]
        late = source if sent > posted else target
        began = max(posted, block) if block is not None else None
        lost = {target: (began, sent - began)} if began is not None and sent > began else {}
        yield dim, [source, target], late, max(sent, posted), lost


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
        """Fold one step in (``measured`` False: the warm-up step, only traced); returns its per-step figures
        for the metrics file: ``straggler_<dim>`` (the rank beyond noise, else None) and
        ``straggler_wait_<dim>_s`` (the others' mean wait for the step's most waited-for rank)."""
        step_ns = max(1, sum(e - s for s, e in windows) // len(windows))  # the ranks' mean step time
        caused: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        for dim, members, late, last, lost in _events(notes_per_rank, self.offsets):
            caused[dim][late] += sum(ns for _, ns in lost.values())
            if self.waits is not None:
                self.waits.extend((r, late, start - self.offsets[0], ns, last - self.offsets[0], dim)
                                  for r, (start, ns) in lost.items() if ns >= TRACE_MIN_WAIT_NS)
            if not measured:
                continue
            totals = self.dims[dim]
            totals.last[late] += 1
            for r in members:
                totals.events[r] += 1
                totals.peers[r].update(members)
            for r, (_, ns) in lost.items():
                totals.waited[r] += ns
            totals.caused[late] += sum(ns for _, ns in lost.values())
        if not measured:
            return {}
        self.steps += 1
        self.step_ns += step_ns
        figures = {}
        for dim, by_rank in caused.items():
            totals = self.dims[dim]
            rank = max(by_rank, key=by_rank.get)
            mean = by_rank[rank] / totals.others(rank)
            beyond = mean >= NOISE_FRACTION * step_ns
            if beyond:
                totals.over_noise[rank] += 1
            figures[f"straggler_{dim}"] = rank if beyond else None
            figures[f"straggler_wait_{dim}_s"] = mean / 1e9
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
    """Every rank's side. After each step the step's arrival notes become int64 rows behind a head row (row
    count, step start and end, this rank's time spent on the report); every ``every`` steps, and when asked
    (the last step; every step when a metrics file wants per-step figures), one all-gather over the world
    (ledger phase ``report``, outside the timed steps) hands them to rank 0, which folds each step into a
    :class:`StragglerReport`. The report's cost: every rank's own encoding time (the largest counts) plus,
    per exchange, rank 0's time from the last rank's hand-over to the end of its analysis (the wait for that
    last rank is the straggler's, paid at the next collective anyway)."""

    def __init__(self, comms, rank: int, world_size: int, trace: bool, every: int = 8):
        self.comms, self.rank, self.world_size, self.every = comms, rank, world_size, every
        with comms.ledger.in_phase("report"):
            offsets, clock = clock_offsets(comms, world_size)
        self.report = StragglerReport(world_size, offsets, clock, trace) if rank == 0 else None
        self.steps = 0
        self.blocks: list[torch.Tensor] = []  # the steps not yet handed over (at most ``every``)
        self.capacity = 0  # rows each rank sends: the most any rank had so far (steps repeat, so it settles)

    def end_step(self, window: tuple[int, int], exchange: bool = False) -> dict:
        """Note the step that ran in ``window``; hand the notes over when due or ``exchange``. Rank 0 returns
        the last handed step's figures (:meth:`StragglerReport.add_step`), other ranks and steps not handed {}."""
        began = time.perf_counter_ns()
        rows = encode(self.comms.ledger.arrivals.take())
        head = torch.tensor([[len(rows), window[0], window[1], time.perf_counter_ns() - began, 0, 0]])
        self.blocks.append(torch.cat([head, rows]))
        self.steps += 1
        return self.flush() if exchange or len(self.blocks) >= self.every else {}

    def flush(self) -> dict:
        """Hand the steps noted so far to rank 0 (every rank calls it after the last step); as :meth:`end_step`."""
        if not self.blocks:
            return {}
        handed = time.perf_counter_ns()
        mine = torch.cat([torch.tensor([[len(self.blocks), handed, 0, 0, 0, 0]]), *self.blocks])
        first, self.blocks = self.steps - len(self.blocks), []
        with self.comms.ledger.in_phase("report"):
            gathered = self._gather(mine)
        if self.report is None:
            return {}
        steps = [_blocks(gathered[r]) for r in range(self.world_size)]
        figures = {}
        for k in range(len(steps[0])):
            heads = [steps[r][k][0] for r in range(self.world_size)]
            figures = self.report.add_step([steps[r][k][1] for r in range(self.world_size)],
                                           [(h[1], h[2]) for h in heads], measured=first + k > 0)
            self.report.cost_ns += max(h[3] for h in heads)
        self.report.cost_ns += time.perf_counter_ns() - max(int(gathered[r, 0, 1]) - self.report.offsets[r]
                                                            for r in range(self.world_size))
        return figures

    def _gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Every rank's ``rows`` padded to the capacity, as [world, capacity, 6]: one all-gather once the
        capacity has settled; a second, wider one when some rank had more rows than it."""
        rows[0, 2] = len(rows)
        if self.world_size == 1:
            return rows[None]
        while True:
            padded = torch.cat([rows, rows.new_zeros((max(0, self.capacity - len(rows)), 6))])[:max(self.capacity, 1)]
            gathered = self.comms["world"].all_gather(padded).view(self.world_size, -1, 6)
            needed = int(gathered[:, 0, 2].max())
            if needed <= self.capacity:
                return gathered
            self.capacity = needed


def _blocks(rows: torch.Tensor) -> list[tuple[list[int], torch.Tensor]]:
    """A rank's gathered rows back into steps: (head row, the step's note rows) each."""
    out, at = [], 1
    for _ in range(int(rows[0, 0])):
        head = rows[at].tolist()
        out.append((head, rows[at + 1: at + 1 + head[0]]))
        at += 1 + head[0]
    return out
