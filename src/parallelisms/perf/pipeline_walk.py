"""A pipeline rank's memory over its schedule: one walk of its actions in order gives the moments its memory may
peak (microbatches in flight per stage, split-backward remainders, the stages' gradients, weight passes' deposits,
forwards paused at an expert dispatch), and each moment's bytes are priced from the layout's per-stage figures
(:mod:`parallelisms.perf.memory` supplies them). The schedules are the runtime's own
(:mod:`parallelisms.parallel.pipeline.schedules`).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from parallelisms.perf.stages import schedule_of


@lru_cache(maxsize=4096)
def peak_candidates(name: str, pp: int, m: int, chunks: int, rank: int, inside: bool = False) -> "Candidates":
    """The distinct moments at which a rank's memory may peak, from one walk of its actions in order (``plan``
    prices thousands of layouts of a few schedules), each as (its counts, :func:`counts` of: forwards held per
    stage, split-backward remainders held per stage, the stages whose gradients exist (a backward ran on them), the
    stages holding a weight pass's deposited gradients (a weight pass ran since the stage's last backward),
    forwards paused per stage, PipeDream's stashed weight versions alive per stage (the in-flight microbatches' and
    the latest stashed); the moment: 0 a
    forward off the last stage, 1 a forward on it (4 where its backward is an input pass), 2 a backward (5 on the
    last stage, whose backward begins with the loss's), 3 between actions, (6, stage, first) a full backward's end on
    the stage, its microbatch freed, its first unit's gradient formed; ``first``: the stage's first backward; (7,
    stage) PipeDream's update of the stage (its optimizer action), the other microbatches in flight). A
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

    def note(when: int | tuple) -> None:
        stashed = (0,) * schedule.num_stages
        if stashing:
            stashed = tuple(len(set(v) | ({latest[s]} - {None})) for s, v in enumerate(versions))
        seen.add((counts(flying, weighing, made, deposited, paused, stashed), when))

    def forward(a) -> None:
        flying[a.stage] += 1
        if a.version is not None:
            versions[a.stage].append(a.version)
            latest[a.stage] = a.version
        note((4 if a.mb in split else 1) if a.stage == last else 0)

    actions = schedule.compute(rank)
    split = {a.mb for a in actions if a.kind is Kind.BACKWARD_INPUT and a.stage == last}
    stashing = any(a.version is not None for a in actions)  # PipeDream's weight versions
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
        elif a.kind is Kind.OPTIMIZER:  # PipeDream's update of the stage, the other microbatches in flight
            note((7, a.stage))
            continue
        else:
            continue
        made[a.stage] = 1
        note(3)
        if chunk is not None:  # the chunk's forward goes on past its dispatch
            paused[chunk.stage] -= 1
            forward(chunk)
            chunk = None
    return _counted_columns(_undominated(seen))


def counts(flying, weighing, made, deposited, paused, stashed) -> tuple[int, ...]:
    """A moment's counts in the order of :func:`_weights`' bytes: per stage the forwards held, the remainders held,
    the stashed versions, the gradients made, the deposits; then the forwards paused, and the last stage's
    forwards and remainders held (its head's bytes)."""
    return (*flying, *weighing, *stashed, *made, *deposited, sum(paused), flying[-1], weighing[-1])


def _undominated(states: set[tuple]) -> list[tuple]:
    """The states no other state of the same moment holds at least as much of, in every count: every byte figure
    is non-negative, so only these can be the peak."""
    ordered = sorted(states, key=lambda state: -sum(state[0]))
    kept: list[tuple] = []
    for state in ordered:
        if not any(k[1] == state[1] and all(map(operator.ge, k[0], state[0])) for k in kept):
            kept.append(state)
    return kept


class Candidates(NamedTuple):
    """:func:`peak_candidates`' moments, each (its counts in ``columns``, the moment): the columns of
    :func:`counts` that some moment counts (a schedule without split backwards or PipeDream counts no remainders
    or stashed versions)."""
    columns: tuple[int, ...]
    moments: tuple[tuple, ...]


def _counted_columns(moments: list[tuple]) -> Candidates:
    columns = tuple(c for c in range(len(moments[0][0]) if moments else 0) if any(held[c] for held, _ in moments))
    return Candidates(columns, tuple((tuple(held[c] for c in columns), when) for held, when in moments))


def held_at_peak(candidates: Candidates, full: list[float], partial: tuple[list[float], float],
                 moment: tuple[float, float], head_kept: float, grads: "StageGradients | None" = None,
                 paused: float = 0.0, stash: list[float] | None = None) -> float:
    """The most bytes a rank holds over its :func:`peak_candidates` beyond its model states: a stage-microbatch in
    flight holds ``full[stage]`` bytes (on the last stage also the head's ``head_kept``), a split backward's
    remainder ``partial`` ((per stage, the last stage's head)), a forward paused at its first expert dispatch
    ``paused`` (:func:`dispatch_bytes`); a forward peaks at ``moment`` beyond what is held
    (the loss's on the last stage, a block's backward elsewhere: (other, last)), a backward at a block's backward
    (on the last stage, or the loss's backward) and the unit gradient it forms; and the stages' gradients
    (:class:`StageGradients`) from their first backward; PipeDream's stashed versions ``stash[stage]`` bytes each."""
    stages = len(full)
    weights = _weights(stages, full, partial, head_kept, grads, paused, stash)
    weights = [weights[c] for c in candidates.columns]
    whole = sum(grads.made) if grads is not None and grads.whole else 0.0
    at_loss, transient = (grads.at_loss, grads.transient) if grads else (0.0, 0.0)
    loss, block = moment[1] - head_kept, transient + moment[0]
    extras = {0: moment[0], 1: loss, 2: block, 4: at_loss + loss, 5: max(loss, block)}
    best = 0.0
    for held, when in candidates.moments:
        if isinstance(when, tuple) and when[0] == 7:  # PipeDream's update of stage when[1]
            extra = grads.updates[when[1]] if grads and grads.updates else 0.0
        elif isinstance(when, tuple):  # a backward's end on stage when[1], the stage's first (when[2]) or a later one
            extra = grads.formed[when[1]] / (2 if when[2] else 1) if grads and grads.formed else 0.0
        else:
            extra = extras.get(when, 0.0)
        best = max(best, sum(map(operator.mul, held, weights)) + whole + extra)
    return best


def _weights(stages: int, full: list[float], partial: tuple[list[float], float], head_kept: float,
             grads: "StageGradients | None", paused: float, stash: list[float] | None) -> list[float]:
    """The bytes of one of each count of :func:`counts`."""
    def per_stage(values) -> list[float]:
        return [*values[:stages], *[0.0] * (stages - len(values[:stages]))]

    made = () if grads is None or grads.whole else grads.made
    deposited = () if grads is None else grads.deposited
    return [*per_stage(full), *per_stage(partial[0]), *per_stage(stash or ()), *per_stage(made),
            *per_stage(deposited), paused, head_kept, partial[1]]


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
    fp32 copy does: the parameters' gradients, or the concatenation, beside the held ones); ``updates``, per stage,
    what PipeDream's update after each backward holds beyond them (its gradient where the update drops it, and
    per-tensor AdamW's two temporaries of the largest tensor it steps)."""
    made: tuple[float, ...]
    deposited: tuple[float, ...]
    transient: float = 0.0
    whole: bool = False
    at_loss: float = 0.0
    formed: tuple[float, ...] = ()
    updates: tuple[float, ...] = ()

    def held(self, made: tuple, deposited: tuple) -> float:
        grads = sum(self.made) if self.whole else sum(n * b for n, b in zip(made, self.made))
        return grads + sum(n * b for n, b in zip(deposited, self.deposited))
