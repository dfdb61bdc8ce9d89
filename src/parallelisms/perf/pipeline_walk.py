"""A pipeline rank's memory over its schedule: one walk of its actions in order gives the moments its memory may
peak (microbatches in flight per stage, split-backward remainders, the stages' gradients, weight passes' deposits,
forwards paused at an expert dispatch), and each moment's bytes are priced from the layout's per-stage figures
(:mod:`parallelisms.perf.memory` supplies them). The schedules are the runtime's own
(:mod:`parallelisms.parallel.pipeline.schedules`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from parallelisms.perf.stages import schedule_of


@lru_cache(maxsize=4096)
def peak_candidates(name: str, pp: int, m: int, chunks: int, rank: int, inside: bool = False) -> tuple[tuple, ...]:
    """The distinct moments at which a rank's memory may peak, from one walk of its actions in order (``plan``
    prices thousands of layouts of a few schedules): (forwards held per stage, split-backward remainders held per
    stage, the stages whose gradients exist (a backward ran on them), the stages holding a weight pass's deposited
    gradients (a weight pass ran since the stage's last backward), forwards paused per stage, PipeDream's stashed
    weight versions alive per stage (the in-flight microbatches' and the latest stashed), the moment: 0 a
    forward off the last stage, 1 a forward on it (4 where its backward is an input pass), 2 a backward (5 on the
    last stage, whose backward begins with the loss's), 3 between actions, (6, stage, first) a full backward's end on
    the stage, its microbatch freed, its first unit's gradient formed; ``first``: the stage's first backward). A
    forward holds its stage-microbatch until its backward frees it; a split backward's input pass (Zero Bubble)
    leaves what the weight pass reads, which the weight pass frees. ``inside``: a DualPipe F&B chunk's backward runs
    inside its forward, paused at its stage's first expert dispatch (``executor._compute_pair``), so the forward's
    stage-microbatch is whole only once the backward has freed its own."""
    from parallelisms.parallel.pipeline.schedules import Kind

    schedule = schedule_of(name, pp, m, chunks)
    last = schedule.num_stages - 1
    flying, weighing = [0] * schedule.num_stages, [0] * schedule.num_stages
    made, deposited = [0] * schedule.num_stages, [0] * schedule.num_stages
    paused = [0] * schedule.num_stages
    versions = [[] for _ in range(schedule.num_stages)]  # PipeDream: the in-flight microbatches' weight versions
    latest: list = [None] * schedule.num_stages  # and the version stashed last, kept until the next one
    seen = set()

    def note(when: int) -> None:
        stashed = tuple(len(set(v) | ({latest[s]} if latest[s] is not None else set())) for s, v in enumerate(versions))
        seen.add((tuple(flying), tuple(weighing), tuple(made), tuple(deposited), tuple(paused), stashed, when))

    def forward(a) -> None:
        flying[a.stage] += 1
        if a.version is not None:
            versions[a.stage].append(a.version)
            latest[a.stage] = a.version
        note((4 if a.mb in split else 1) if a.stage == last else 0)

    actions = schedule.compute(rank)
    split = {a.mb for a in actions if a.kind is Kind.BACKWARD_INPUT and a.stage == last}
    chunk = None  # the forward of the F&B chunk whose backward runs now
    for i, a in enumerate(actions):
        if a.kind is Kind.FORWARD:
            if inside and a.overlap and i + 1 < len(actions) and actions[i + 1].kind in (
                    Kind.BACKWARD, Kind.BACKWARD_INPUT):
                chunk = a
                paused[a.stage] += 1
            else:
                forward(a)
            continue
        if a.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT):
            note(5 if a.stage == last else 2)  # its microbatch still held, a unit's gradient being formed
            flying[a.stage] -= 1
            if a.version is not None:
                versions[a.stage].remove(a.version)
            weighing[a.stage] += a.kind is Kind.BACKWARD_INPUT
            deposited[a.stage] = 0  # the unit hooks take the deposits into the stage's gradients
            if a.kind is Kind.BACKWARD:  # its end: the stage's first unit's gradient formed from its parameters'
                first, made[a.stage] = not made[a.stage], 1
                note((6, a.stage, first))
        elif a.kind is Kind.BACKWARD_WEIGHT:
            deposited[a.stage] = 1
            note(3)  # a weight pass begins: its remainder still held, the stage's gradients deposited
            weighing[a.stage] -= 1
        else:
            continue
        made[a.stage] = 1
        note(3)
        if chunk is not None:  # the chunk's forward goes on past its dispatch
            paused[chunk.stage] -= 1
            forward(chunk)
            chunk = None
    return tuple(_undominated(seen))


def _undominated(states: set[tuple]) -> list[tuple]:
    """The states no other state of the same moment holds at least as much of, in every count: every byte figure
    is non-negative, so only these can be the peak."""
    def covers(a: tuple, b: tuple) -> bool:
        return all(x >= y for x, y in zip(sum(a[:-1], ()), sum(b[:-1], ())))

    ordered = sorted(states, key=lambda st: -sum(sum(counts) for counts in st[:-1]))
    kept: list[tuple] = []
    for state in ordered:
        if not any(k[-1] == state[-1] and covers(k, state) for k in kept):
            kept.append(state)
    return kept


def held_at_peak(candidates: tuple[tuple, ...], full: list[float], partial: tuple[list[float], float],
                 moment: tuple[float, float], head_kept: float, grads: "StageGradients | None" = None,
                 paused: float = 0.0, stash: list[float] | None = None) -> float:
    """The most bytes a rank holds over its :func:`peak_candidates` beyond its model states: a stage-microbatch in
    flight holds ``full[stage]`` bytes (on the last stage also the head's ``head_kept``), a split backward's
    remainder ``partial`` ((per stage, the last stage's head)), a forward paused at its first expert dispatch
    ``paused`` (:func:`dispatch_bytes`); a forward peaks at ``moment`` beyond what is held
    (the loss's on the last stage, a block's backward elsewhere: (other, last)), a backward at a block's backward
    (on the last stage, or the loss's backward) and the unit gradient it forms; and the stages' gradients
    (:class:`StageGradients`) from their first backward; PipeDream's stashed versions ``stash[stage]`` bytes each."""
    best = 0.0
    for flying, weighing, made, deposited, pausing, stashed, when in candidates:
        held = (sum(n * b for n, b in zip(flying, full)) + head_kept * flying[-1] + paused * sum(pausing)
                + sum(n * b for n, b in zip(weighing, partial[0])) + partial[1] * weighing[-1]
                + sum(n * b for n, b in zip(stashed, stash or ())))
        if grads is not None:
            held += grads.held(made, deposited)
        at_loss, transient = (grads.at_loss, grads.transient) if grads else (0.0, 0.0)
        loss, block = moment[1] - head_kept, transient + moment[0]
        if isinstance(when, tuple):  # a backward's end on stage when[1], the stage's first (when[2]) or a later one
            extra = grads.formed[when[1]] / (2 if when[2] else 1) if grads and grads.formed else 0.0
        else:
            extra = {0: moment[0], 1: loss, 2: block, 4: at_loss + loss, 5: max(loss, block)}.get(when, 0.0)
        best = max(best, held + extra)
    return best


@dataclass(frozen=True)
class StageGradients:
    """A pipeline rank's gradients by stage (bytes): ``made`` those a stage holds from its first backward on (every
    stage's through the whole step where ``whole``: DDP's buckets, made with the engine and zeroed each step, and
    buffer reuse's gradient buffers, each unit's own, zeroed at the step's first forward and kept for the next),
    ``deposited`` a split backward's weight passes' compute-dtype gradients, held from a weight pass to the stage's
    next backward (mixed precision: the flat engine's unit hook adds them into the fp32 main gradient there),
    ``transient`` the unit gradient a backward forms (a flat unit's gradient, the unit's size, before it is added
    to the held one), and ``at_loss`` the
    same beside the loss where the loss's backward is an input pass, which forms it while the loss's tensors live
    (fp32, as the dry run shows it); ``formed``, per stage, what a full backward's end holds beyond them: a flat
    engine's first unit (formed last) as its parameters' gradients and their concatenation, before the unit hook adds
    it into the held gradient (at the stage's first backward the concatenation becomes the held gradient, or its
    fp32 copy does: the parameters' gradients, or the concatenation, beside the held ones)."""
    made: tuple[float, ...]
    deposited: tuple[float, ...]
    transient: float = 0.0
    whole: bool = False
    at_loss: float = 0.0
    formed: tuple[float, ...] = ()

    def held(self, made: tuple, deposited: tuple) -> float:
        grads = sum(self.made) if self.whole else sum(n * b for n, b in zip(made, self.made))
        return grads + sum(n * b for n, b in zip(deposited, self.deposited))
