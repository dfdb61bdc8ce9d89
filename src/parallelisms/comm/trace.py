"""The timeline: compute and communication spans per rank, exposed communication, Chrome-trace export.

A span is (name, category, start, end) in ``time.perf_counter_ns`` (CLOCK_MONOTONIC, shared by the
processes of one machine). Categories: ``compute`` (forward, backward, optimizer work), ``comm`` (a
collective from issue to completion, also when it runs asynchronously) and ``wait`` (time blocked on a
collective inside a compute span, which is therefore not compute). A rank is busy during
compute minus wait; communication not covered by busy time is *exposed*: it lies on that rank's
critical path (spec: "Critical path and latency hiding").
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Span:
    name: str
    cat: str
    start: int
    end: int
    args: dict = field(default_factory=dict)


def _union(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def _subtract(base: list[tuple[int, int]], holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Parts of the disjoint sorted ``base`` intervals not covered by the disjoint sorted ``holes``."""
    out = []
    for start, end in base:
        cursor = start
        for h_start, h_end in holes:
            if h_end <= cursor or h_start >= end:
                continue
            if h_start > cursor:
                out.append((cursor, h_start))
            cursor = max(cursor, h_end)
        if cursor < end:
            out.append((cursor, end))
    return out


def _length(intervals) -> int:
    return sum(e - s for s, e in intervals)


def burn(ns: int) -> None:
    """Real work for ``ns`` nanoseconds: small matrix products until the deadline (``--slow-rank``)."""
    import torch

    deadline = time.perf_counter_ns() + ns
    a = torch.full((48, 48), 1.0 / 48)
    while time.perf_counter_ns() < deadline:
        a = a @ a + 1.0 / 48


class Timeline:
    """Spans of one rank. Disabled timelines record nothing and cost one attribute check per span. With
    ``keep=False`` the spans are summed step by step (:meth:`step_stats`) and dropped, so a long run's memory and
    report do not grow with its steps (``--trace`` keeps them all).

    ``slow`` above 1 makes this rank's compute that many times slower (``--slow-rank R:F``, a demonstration
    of stragglers): each compute span but the optimizer's is followed, inside the span, by (F - 1) x its
    own time of real work (:func:`burn`), so the rank reaches its next collective late as a slower chip would."""

    def __init__(self, rank: int = 0, enabled: bool = True, slow: float = 1.0, keep: bool = True):
        self.rank, self.enabled, self.slow, self.keep = rank, enabled, slow, keep
        self.spans: list[Span] = []
        self.recent: list[Span] = []  # spans not yet summed by step_stats

    @staticmethod
    def now() -> int:
        return time.perf_counter_ns()

    def add(self, name: str, cat: str, start: int, end: int, **args) -> None:
        if self.enabled:
            span = Span(name, cat, start, end, args)
            self.recent.append(span)
            if self.keep:
                self.spans.append(span)

    @contextmanager
    def span(self, name: str, cat: str = "compute", **args):
        slowed = self.slow > 1 and cat == "compute" and not name.startswith("optimizer")
        if not self.enabled and not slowed:
            yield
            return
        start = self.now()
        try:
            yield
            if slowed:
                burn(int((self.slow - 1) * (self.now() - start)))
        finally:
            self.add(name, cat, start, self.now(), **args)

    def between(self, start: int, end: int, spans: list[Span] | None = None) -> list[Span]:
        return [s for s in (self.spans if spans is None else spans) if s.end > start and s.start < end]

    def step_stats(self, start: int, end: int) -> dict:
        """:meth:`overlap_stats` of a step's window [start, end), from the spans recorded since the previous
        step's (a step's time, whatever the run's length); those ended by ``end`` are let go."""
        stats = self.overlap_stats(start, end, self.recent)
        self.recent = [s for s in self.recent if s.end > end]
        return stats

    def overlap_stats(self, start: int | None = None, end: int | None = None, spans: list[Span] | None = None) -> dict:
        """Communication, busy and exposed time (ns) in the window [start, end) (default: everything)."""
        spans = (self.spans if spans is None else spans) if start is None else self.between(start, end, spans)
        clip = (lambda s: (max(s.start, start), min(s.end, end))) if start is not None else (lambda s: (s.start, s.end))
        comm = _union([clip(s) for s in spans if s.cat == "comm"])
        busy = _subtract(_union([clip(s) for s in spans if s.cat == "compute"]),
                         _union([clip(s) for s in spans if s.cat == "wait"]))
        exposed = _subtract(comm, busy)
        wall = (end - start) if start is not None else (
            max((s.end for s in spans), default=0) - min((s.start for s in spans), default=0))
        return {"comm_ns": _length(comm), "busy_ns": _length(busy), "exposed_ns": _length(exposed), "wall_ns": wall}

    def chrome_events(self, origin_ns: int) -> list[dict]:
        """Complete events ("ph": "X") in microseconds; comm spans on their own thread row."""
        rows = {"compute": 0, "wait": 0, "comm": 1}
        return [{"name": s.name, "cat": s.cat, "ph": "X", "pid": self.rank, "tid": rows.get(s.cat, 2),
                 "ts": (s.start - origin_ns) / 1e3, "dur": (s.end - s.start) / 1e3, "args": s.args}
                for s in self.spans]


def write_chrome_trace(timelines: list[Timeline], path: str | Path, waits: list[tuple] = ()) -> Path:
    """One Chrome-trace JSON (Perfetto and chrome://tracing open it) with a process per rank; ``waits`` (the
    straggler report's) on a third row per rank, each with a flow arrow to the rank it waited for."""
    from parallelisms.stragglers import chrome_wait_events

    origin = min((s.start for t in timelines for s in t.spans), default=0)
    events = []
    for t in timelines:
        events.append({"name": "process_name", "ph": "M", "pid": t.rank, "args": {"name": f"rank {t.rank}"}})
        for tid, label in ((0, "compute"), (1, "communication"), (3, "waits for stragglers")):
            events.append({"name": "thread_name", "ph": "M", "pid": t.rank, "tid": tid, "args": {"name": label}})
        events.extend(t.chrome_events(origin))
    events.extend(chrome_wait_events(list(waits), origin))
    path = Path(path)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return path


def format_summary(stats_per_rank: list[dict]) -> str:
    """A printed table: per rank, communication, exposed communication and its share of the wall time."""
    lines = ["rank  comm ms  exposed ms  busy ms  wall ms  exposed/wall"]
    for rank, s in enumerate(stats_per_rank):
        lines.append(f"{rank:>4}  {s['comm_ns'] / 1e6:7.1f}  {s['exposed_ns'] / 1e6:10.1f}  {s['busy_ns'] / 1e6:7.1f}"
                     f"  {s['wall_ns'] / 1e6:7.1f}  {s['exposed_ns'] / max(s['wall_ns'], 1):12.3f}")
    return "\n".join(lines)
