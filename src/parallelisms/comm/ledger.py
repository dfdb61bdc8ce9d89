"""The communication ledger: every collective, with the bytes each rank sends under the ring algorithm.

Logical bytes sent per rank for a tensor of S bytes on N ranks (Thakur et al. 2005; nccl-tests
PERFORMANCE.md bus-bandwidth factors): all-reduce 2(N-1)/N x S; all-gather and reduce-scatter
(N-1)/N x S of the *full* tensor; all-to-all the bytes that leave the rank ((N-1)/N x S when even);
broadcast S; send S; receive 0. Counts are logical: gloo emulates reduce-scatter with an all-reduce,
but the ledger records what the algorithm needs, so it can be checked against the spec's formulas.

A ledger keeps every record in order (``records``) unless made with ``keep=False``, as a training run's is
without ``--trace``: it then keeps calls and bytes per kind, group and phase, summed from each :meth:`mark`
on, and the last few records for error messages, so its memory does not grow with the steps.
"""

from __future__ import annotations

from collections import defaultdict, deque
from contextlib import contextmanager
from dataclasses import dataclass

from parallelisms.comm.arrivals import Arrivals

PHASES = ("forward", "backward", "optimizer", "setup")


def ring_bytes_per_rank(kind: str, full_bytes: float, group_size: int) -> float:
    """Bytes one rank sends for collective ``kind`` over a tensor of ``full_bytes`` (see module docstring)."""
    n = group_size
    factors = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
               "all_to_all": (n - 1) / n, "broadcast": 1.0, "send": 1.0, "recv": 0.0}
    return factors[kind] * full_bytes


@dataclass(frozen=True)
class CommRecord:
    kind: str            # all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, send, recv
    dim: str             # mesh dimension name: dp, tp, pp, ...
    group_size: int
    dtype: str
    numel: int           # elements of the full tensor (the all-gather output, the reduce-scatter input)
    bytes_per_rank: float
    phase: str


class CommLedger:
    """Record of collectives, with the phase (forward, backward, optimizer, setup) set by the caller; every
    record in order (``keep``), or sums from each mark on (module docstring)."""

    TAIL = 5  # records kept for error messages

    def __init__(self, keep: bool = True):
        self.records: list[CommRecord] | None = [] if keep else None
        self.count = 0  # records added
        self.recent: deque[CommRecord] = deque(maxlen=self.TAIL)
        # (start position, {(kind, dim, phase): [calls, bytes]}): sums from each mark on (keep=False)
        self.windows: list[tuple[int, dict]] = [(0, {})]
        self.phase = "setup"
        # collectives entered per mesh dimension (point-to-point left out): every member of a group enters the
        # same ones in the same order, so a member behind this rank's count has not arrived (see .liveness)
        self.collectives: dict[str, int] = defaultdict(int)
        self.arrivals = Arrivals()  # when this rank arrived at each call of the step (the straggler report)
        self.waited_ns = 0  # time blocked in collectives and waits (--dp-balance measured: compute is the rest)

    @contextmanager
    def in_phase(self, phase: str):
        previous, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = previous

    def add(self, kind: str, dim: str, group_size: int, dtype, numel: int, bytes_per_rank: float) -> None:
        record = CommRecord(kind, dim, group_size, str(dtype).removeprefix("torch."), numel, bytes_per_rank,
                            self.phase)
        if self.records is not None:
            self.records.append(record)
        else:
            sums = self.windows[-1][1].setdefault((kind, dim, self.phase), [0, 0.0])
            sums[0] += 1
            sums[1] += bytes_per_rank
        self.recent.append(record)
        self.count += 1
        if kind not in ("send", "recv"):
            self.collectives[dim] += 1

    def mark(self) -> int:
        """A position to measure from: ``summary(since=ledger.mark())``."""
        if self.records is None and self.windows[-1][0] != self.count:
            self.windows.append((self.count, {}))
        return self.count

    def summary(self, since: int = 0, per: int = 1, exclude_phases: tuple[str, ...] = ()) -> dict:
        """Calls and bytes sent per rank by collective kind from position ``since`` (0 or a :meth:`mark`),
        divided by ``per`` (e.g. steps), leaving out records of ``exclude_phases``."""
        table = defaultdict(lambda: {"calls": 0, "bytes_per_rank": 0.0})
        for kind, phase, calls, sent in self._sums_since(since):
            if phase not in exclude_phases:
                table[kind]["calls"] += calls
                table[kind]["bytes_per_rank"] += sent
        return {kind: {"calls": v["calls"] / per, "bytes_per_rank": v["bytes_per_rank"] / per}
                for kind, v in sorted(table.items())}

    def _sums_since(self, since: int):
        """(kind, phase, calls, bytes) from position ``since``: each record, or each window's sums."""
        if self.records is not None:
            return ((r.kind, r.phase, 1, r.bytes_per_rank) for r in self.records[since:])
        starts = [start for start, _ in self.windows]
        if since not in starts:
            raise ValueError(f"no mark at position {since} of a ledger that keeps sums (marks: {starts})")
        return ((kind, phase, calls, sent) for start, sums in self.windows if start >= since
                for (kind, _, phase), (calls, sent) in sums.items())

    def tail(self, count: int = TAIL) -> str:
        """The last collectives, for error messages about hangs and mismatches."""
        last = list(self.recent)[-count:]
        return "; ".join(f"#{self.count - len(last) + i} {r.kind}[{r.dim}] {r.numel}x{r.dtype} ({r.phase})"
                         for i, r in enumerate(last)) or "none"
