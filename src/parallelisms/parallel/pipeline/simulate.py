"""Event simulator for pipeline schedules, following the Zero Bubble paper's cost model
(Qi et al., ICLR 2024, Sec. 3 and App. D).

Inputs are per-microbatch times of ONE STAGE, i.e. of one rank's whole share of the model:
``t_f`` forward, ``t_b`` input gradient, ``t_w`` weight gradient, ``t_comm`` per cross-rank
dependency.  A schedule with ``chunks`` stages per rank and microbatch (interleaved: v; ZB-V and
DualPipeV: 2) spends ``t / chunks`` on each action.  A full backward costs ``t_b + t_w``.

Every action starts when its rank is free (``t_host`` after its previous action) and every input it
needs is ready; an input computed on another rank is ready ``t_comm`` after it was computed.  Sends
never block, receives wait for the data, optimizer steps take no time.  A DualPipe F&B chunk
(``overlap``) starts when the inputs of both its forward and its backward are ready and lasts their
sum (no overlap speed-up is assumed, so "F&B" = F + B in the DeepSeek-V3 formula).  Results:

* ``timeline[r]``: (action, start, end) per compute action of rank ``r``;
* ``makespan``: the end of the last action;
* ``bubble_rate`` = (cost - m (T_F + T_B + T_W)) / cost, with cost the longest span (first start
  to last end) over ranks: the paper's definition, which reproduces its Table 5 (with per-stage times, the
  ranks' mean busy time in place of m (T_F + T_B + T_W), as a measured bubble is computed);
* ``peak_activations[r]``: the most microbatches whose activations rank ``r`` holds at once.  A
  microbatch is held from the start of its forward until its backward is complete, i.e. the end
  of B, or of W when backward is split (the weight pass needs the stored inputs).  A chunk of an
  interleaved/V schedule counts 1/chunks of a microbatch.  Gives p, p and 2p-1 for 1F1B, ZB-H1
  and ZB-H2, PP+1 for DualPipe and m for GPipe.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .schedules import Action, Kind, Schedule, produces, requires


@dataclass(frozen=True)
class Times:
    """Per-microbatch times of one rank's share (``t_f``, ``t_b``, ``t_w``) and of a cross-rank dependency;
    or, where the stages differ (the first holds the embedding, the last the head and loss), ``stages``: one
    (forward, input gradient, weight gradient) per stage of the schedule, each the time of one action.
    ``t_host``: host time between two actions of a rank (posting its sends and receives), 0 in the paper."""
    t_f: float = 1.0
    t_b: float = 1.0
    t_w: float = 1.0
    t_comm: float = 0.0
    stages: tuple = ()
    t_host: float = 0.0

    def of(self, kind: Kind, chunks: int, stage: int = 0) -> float:
        t_f, t_b, t_w = self.stages[stage] if self.stages else (t / chunks for t in (self.t_f, self.t_b, self.t_w))
        return {Kind.FORWARD: t_f, Kind.BACKWARD: t_b + t_w, Kind.BACKWARD_INPUT: t_b,
                Kind.BACKWARD_WEIGHT: t_w}.get(kind, 0.0)


@dataclass
class Simulation:
    schedule: Schedule
    times: Times
    timeline: list[list[tuple[Action, float, float]]]
    peak_activations: list[float] = field(default_factory=list)

    @property
    def makespan(self) -> float:
        return max((end for row in self.timeline for _, _, end in row), default=0.0)

    @property
    def spans(self) -> list[float]:
        return [row[-1][2] - row[0][1] if row else 0.0 for row in self.timeline]

    @property
    def ideal(self) -> float:
        """Busy time of one rank: m microbatches of its whole share (with per-stage times, the ranks' mean)."""
        t = self.times
        if t.stages:
            return sum(end - start for row in self.timeline for _, start, end in row) / len(self.timeline)
        return self.schedule.microbatches * (t.t_f + t.t_b + t.t_w)

    @property
    def bubble(self) -> float:
        return max(self.spans) - self.ideal

    @property
    def bubble_rate(self) -> float:
        cost = max(self.spans)
        return (cost - self.ideal) / cost if cost > 0 else 0.0

    def to_dict(self) -> dict:
        s, t = self.schedule, self.times
        return {"schedule": s.name, "pp": s.pp, "microbatches": s.microbatches, "chunks": s.chunks,
                "tf": t.t_f, "tb": t.t_b, "tw": t.t_w, "tcomm": t.t_comm,
                "makespan": round(self.makespan, 9), "cost": round(max(self.spans), 9),
                "bubble_rate": round(self.bubble_rate, 9), "peak_activations": self.peak_activations}


def simulate(schedule: Schedule, times: Times | None = None) -> Simulation:
    times = times or Times()
    S, pp = schedule.num_stages, schedule.pp
    lists = [schedule.compute(r) for r in range(pp)]
    ready: dict[tuple[str, int, int], tuple[float, int]] = {}  # result -> (time, rank)
    timeline: list[list[tuple[Action, float, float]]] = [[] for _ in range(pp)]
    free = [0.0] * pp
    pc = [0] * pp
    progress = True
    while progress:
        progress = False
        for r in range(pp):
            while pc[r] < len(lists[r]):
                a = lists[r][pc[r]]
                chunk = lists[r][pc[r]:pc[r] + 2] if a.overlap else [a]  # a fused F&B starts as one
                inside = {(t, x.stage, x.mb) for x in chunk for t in produces(x)}
                needs = [n for x in chunk for n in requires(x, S) if n not in inside]
                if any(n not in ready for n in needs):
                    break
                free_at = free[r] + (times.t_host if timeline[r] else 0.0)
                start = max([free_at] + [t + (times.t_comm if src != r else 0.0)
                                         for t, src in (ready[n] for n in needs)])
                for x in chunk:
                    end = start + times.of(x.kind, schedule.chunks, x.stage)
                    for result in produces(x):
                        ready[(result, x.stage, x.mb)] = (end, r)
                    if x.kind is not Kind.OPTIMIZER:
                        timeline[r].append((x, start, end))
                    start = end
                free[r] = end
                pc[r] += len(chunk)
                progress = True
    stuck = [r for r in range(pp) if pc[r] < len(lists[r])]
    if stuck:
        r = stuck[0]
        raise ValueError(f"schedule {schedule.name} cannot run: rank {r} waits at {lists[r][pc[r]]}")
    return Simulation(schedule, times, timeline, [_peak(lists[r], schedule.chunks) for r in range(pp)])


def _peak(actions: list[Action], chunks: int) -> float:
    """Peak held microbatches on a rank (it runs its actions one at a time, in order)."""
    held = peak = 0
    for a in actions:
        if a.kind is Kind.FORWARD:
            held += 1
            peak = max(peak, held)
        elif a.kind in (Kind.BACKWARD, Kind.BACKWARD_WEIGHT):
            held -= 1
    return peak / chunks if peak % chunks else peak // chunks


_COLOURS = {Kind.FORWARD: "#4c78a8", Kind.BACKWARD: "#e45756", Kind.BACKWARD_INPUT: "#f58518",
            Kind.BACKWARD_WEIGHT: "#54a24b"}


def plot(sim: Simulation, path: str | Path) -> Path:
    """Draw ranks as rows of coloured F / B / I / W blocks (microbatch numbers inside) to .png/.svg."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    path = Path(path)
    s = sim.schedule
    fig, ax = plt.subplots(figsize=(max(6.0, min(24.0, 0.25 * sum(map(len, sim.timeline)) / s.pp)), 0.6 * s.pp + 1.2))
    for r, row in enumerate(sim.timeline):
        for a, start, end in row:
            ax.barh(r, end - start, left=start, height=0.8, color=_COLOURS[a.kind], edgecolor="white", linewidth=0.5)
            if s.microbatches <= 32:
                ax.text((start + end) / 2, r, str(a.mb), ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(s.pp), [f"rank {r}" for r in range(s.pp)])
    ax.invert_yaxis()
    ax.set_xlabel("time")
    ax.set_title(f"{s.name}: pp={s.pp}, m={s.microbatches}, bubble rate {sim.bubble_rate:.4f}")
    used = {a.kind for row in sim.timeline for a, _, _ in row}
    names = {Kind.FORWARD: "F", Kind.BACKWARD: "B (full)", Kind.BACKWARD_INPUT: "B (input)", Kind.BACKWARD_WEIGHT: "W"}
    ax.legend(handles=[Patch(color=c, label=names[k]) for k, c in _COLOURS.items() if k in used],
              loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=4, fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
