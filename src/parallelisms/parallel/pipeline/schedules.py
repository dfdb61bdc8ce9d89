"""Pipeline schedules as data: per-rank lists of actions, as the Zero Bubble paper (Qi et al., ICLR 2024)
writes them and ``torch.distributed.pipelining`` runs them.

A schedule is a pure value: for every pipeline rank an ordered list of :class:`Action` s over
``(stage, microbatch)``, where ``stage`` is the *global* (virtual) stage index.  The same lists are
checked by :mod:`.validate`, simulated by :mod:`.simulate`, drawn by :func:`.simulate.plot` and run
by the executor.  Each schedule is one generator function that writes the compute-only lists;
:func:`lower` then inserts the explicit point-to-point ``SEND_*``/``RECV_*`` actions.

Placement.  A microbatch visits stages ``0 .. num_stages-1`` in order; ``placement[path][stage]``
is the rank that runs the stage for microbatches on ``path`` (``mb_path[mb]``).  Every schedule
has one path except DualPipe, whose second half of microbatches enters at the last rank: rank
``r`` runs stage ``r`` on path 0 and stage ``pp-1-r`` on path 1, i.e. it holds *two parameter
copies* (the copy is the path).  Their gradients must be summed (ranks ``s`` and ``pp-1-s``)
before the optimizer step.  Interleaved places stage ``s`` on rank ``s % pp`` (loop), ZB-V and
DualPipeV on rank ``s`` for ``s < pp`` and ``2pp-1-s`` after (V-shape).

Executor contract.  Run each rank's list in order.  ``RECV_*`` blocks until the matching
``SEND_*`` (same ``kind``-pair, ``stage``, ``mb``) from ``peer`` arrives; sends may be
non-blocking and consecutive send/recv actions may be batched.  ``BACKWARD`` is a full backward;
``BACKWARD_INPUT`` computes only the input gradient and leaves the weight gradient to the later
``BACKWARD_WEIGHT`` of the same (stage, mb).  ``SEND_F``/``RECV_F`` carry the output activation of
``stage`` (to ``stage+1``), ``SEND_B``/``RECV_B`` the gradient w.r.t. the input of ``stage`` (to
``stage-1``).  PipeDream: ``OPTIMIZER`` updates one stage's weights after one microbatch's
backward, and every F/B of that stage carries ``version``: the number of updates applied before
the forward.  The backward must use the weights stashed for that version (weight stashing).
DualPipe: an F with ``overlap=True`` and the backward right after it form one F&B chunk whose
computation and communication the executor may overlap; run sequentially, they are still correct.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from dataclasses import dataclass
from typing import Callable, Sequence


class ScheduleError(ValueError):
    """Bad schedule parameters (a one-line message, raised before anything runs)."""


class Kind(str, enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"  # full backward: input and weight gradients
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    OPTIMIZER = "OPT"


COMPUTE = frozenset({Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT})
COMM = frozenset({Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B})


@dataclass(frozen=True)
class Action:
    kind: Kind
    stage: int
    mb: int
    peer: int | None = None  # SEND/RECV: the other rank
    version: int | None = None  # PipeDream: stage weight version used (F/B) or produced (OPT)
    overlap: bool = False  # F only: runs as one fused chunk with the next compute action (DualPipe F&B)

    def __str__(self) -> str:
        arrow = "->" if self.kind.name.startswith("SEND") else "<-"
        peer = "" if self.peer is None else f"{arrow}r{self.peer}"
        ver = "" if self.version is None else f"@v{self.version}"
        return f"{self.kind.value}(s{self.stage},mb{self.mb}){peer}{ver}{'&' if self.overlap else ''}"


@dataclass(frozen=True)
class Schedule:
    name: str
    pp: int
    microbatches: int
    num_stages: int
    chunks: int  # stages a microbatch visits on each rank (per-action time = per-rank time / chunks)
    placement: tuple[tuple[int, ...], ...]  # placement[path][stage] -> rank
    mb_path: tuple[int, ...]  # path of each microbatch
    ranks: tuple[tuple[Action, ...], ...]  # per-rank ordered actions, send/recv included

    def rank_of(self, stage: int, mb: int) -> int:
        return self.placement[self.mb_path[mb]][stage]

    def modules_on(self, rank: int) -> list[tuple[int, int]]:
        """The (path, stage) parameter sets rank ``rank`` holds; the path is the DualPipe copy."""
        return sorted({(p, s) for p, row in enumerate(self.placement) for s, r in enumerate(row) if r == rank})

    def compute(self, rank: int) -> list[Action]:
        """The rank's compute and optimizer actions, communication left out."""
        return [a for a in self.ranks[rank] if a.kind not in COMM]

    @functools.cached_property
    def split_backward(self) -> bool:  # read per rank and layout by ``plan``: computed once
        return any(a.kind is Kind.BACKWARD_WEIGHT for acts in self.ranks for a in acts)

    @property
    def updates_per_microbatch(self) -> bool:
        """Whether the schedule updates the weights itself (PipeDream's OPTIMIZER actions) rather than the step."""
        return any(a.kind is Kind.OPTIMIZER for acts in self.ranks for a in acts)


# --- dependencies, shared by lowering, validator and simulator ---------------------------------
# Results are keyed (tag, stage, mb): "F" activation, "B" input gradient, "W" weight gradient.

def produces(a: Action) -> tuple[str, ...]:
    return {Kind.FORWARD: ("F",), Kind.BACKWARD: ("B", "W"), Kind.BACKWARD_INPUT: ("B",),
            Kind.BACKWARD_WEIGHT: ("W",), Kind.OPTIMIZER: ("OPT",)}.get(a.kind, ())


def requires(a: Action, num_stages: int) -> list[tuple[str, int, int]]:
    """Results (tag, stage, mb) a compute/optimizer action needs before it may start."""
    s, mb = a.stage, a.mb
    if a.kind is Kind.FORWARD:
        return [("F", s - 1, mb)] if s > 0 else []
    if a.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT):
        return [("F", s, mb)] + ([("B", s + 1, mb)] if s < num_stages - 1 else [])
    if a.kind is Kind.BACKWARD_WEIGHT:
        return [("B", s, mb)]
    if a.kind is Kind.OPTIMIZER:
        return [("W", s, mb)]
    return []


def lower(name: str, pp: int, m: int, compute: Sequence[Sequence[Action]],
          placement: Sequence[Sequence[int]], mb_path: Sequence[int] | None = None,
          chunks: int = 1) -> Schedule:
    """Insert explicit SEND/RECV: a RECV right before the consumer, a SEND right after the producer."""
    mb_path = tuple(mb_path or [0] * m)
    placement = tuple(tuple(p) for p in placement)
    S = len(placement[0])
    rank_of = lambda stage, mb: placement[mb_path[mb]][stage]  # noqa: E731
    out = []
    for r, acts in enumerate(compute):
        lowered: list[Action] = []
        for a in acts:
            for tag, s, mb in requires(a, S):
                if tag in ("F", "B") and rank_of(s, mb) != r:
                    kind = Kind.RECV_F if tag == "F" else Kind.RECV_B
                    lowered.append(Action(kind, s, mb, peer=rank_of(s, mb)))
            lowered.append(a)
            if a.kind is Kind.FORWARD and a.stage + 1 < S and rank_of(a.stage + 1, a.mb) != r:
                lowered.append(Action(Kind.SEND_F, a.stage, a.mb, peer=rank_of(a.stage + 1, a.mb)))
            if a.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT) and a.stage > 0 and rank_of(a.stage - 1, a.mb) != r:
                lowered.append(Action(Kind.SEND_B, a.stage, a.mb, peer=rank_of(a.stage - 1, a.mb)))
        out.append(tuple(lowered))
    return Schedule(name, pp, m, S, chunks, placement, mb_path, tuple(out))


# --- the schedules -----------------------------------------------------------------------------

F, B, I, W = Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT


def gpipe(pp: int, m: int) -> Schedule:
    """GPipe (Huang et al., NeurIPS 2019): all forwards, then all backwards (flush)."""
    compute = [[Action(F, r, i) for i in range(m)] + [Action(B, r, i) for i in range(m)] for r in range(pp)]
    return lower("gpipe", pp, m, compute, [range(pp)])


def _one_f_one_b_rank(stage: int, m: int, warmup: int, deferred_w: int | None,
                      optimizer: bool = False) -> list[Action]:
    """One rank of the 1F1B family: ``warmup`` forwards, then (F, B) pairs, then the last Bs.

    ``deferred_w=None`` runs full backwards; otherwise backward is split and at most
    ``deferred_w`` weight passes are kept pending (oldest first), the rest fill the tail.
    ``optimizer`` adds a PipeDream weight update after every backward, with versions.
    """
    acts: list[Action] = []
    version = 0
    stashed: dict[int, int] = {}
    pending: list[int] = []
    nf = 0

    def forward() -> None:
        nonlocal nf
        stashed[nf] = version
        acts.append(Action(F, stage, nf, version=version if optimizer else None))
        nf += 1

    for _ in range(min(warmup, m)):
        forward()
    for nb in range(m):
        if nf < m:
            forward()
        if deferred_w is None:
            acts.append(Action(B, stage, nb, version=stashed[nb] if optimizer else None))
            if optimizer:
                version += 1
                acts.append(Action(Kind.OPTIMIZER, stage, nb, version=version))
            continue
        acts.append(Action(I, stage, nb))
        pending.append(nb)
        if len(pending) > deferred_w:
            acts.append(Action(W, stage, pending.pop(0)))
    acts += [Action(W, stage, i) for i in pending]
    return acts


def one_f_one_b(pp: int, m: int) -> Schedule:
    """1F1B / PipeDream-Flush (Narayanan et al., ICML 2021): p-1-r warm-up forwards on rank r."""
    compute = [_one_f_one_b_rank(r, m, pp - 1 - r, None) for r in range(pp)]
    return lower("1f1b", pp, m, compute, [range(pp)])


def zb_h1(pp: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al., Zero Bubble PP, ICLR 2024, Fig. 3 top): 1F1B order with split backward;
    rank r keeps r weight passes deferred, which fill its tail bubble. Peak memory as 1F1B."""
    compute = [_one_f_one_b_rank(r, m, pp - 1 - r, deferred_w=r) for r in range(pp)]
    return lower("zb-h1", pp, m, compute, [range(pp)])


def zb_h2(pp: int, m: int) -> Schedule:
    """ZB-H2 (Qi et al., ICLR 2024, Fig. 3 bottom): 2(p-1-r) warm-up forwards fill the bubble
    before the first backward, 2r deferred weight passes fill the tail; 2p-1 microbatches live."""
    compute = [_one_f_one_b_rank(r, m, 2 * (pp - 1 - r), deferred_w=2 * r) for r in range(pp)]
    return lower("zb-h2", pp, m, compute, [range(pp)])


def pipedream(pp: int, m: int) -> Schedule:
    """PipeDream (Narayanan et al., SOSP 2019): asynchronous 1F1B without a flush.

    Each stage updates its weights (OPTIMIZER) right after every microbatch's backward, and each
    F/B carries the weight version it must use: the backward of a microbatch uses the version
    stashed at its forward.  The lists cover one window of m microbatches; in a long run the next
    window's warm-up overlaps this one's drain, so the steady state has no bubble.
    """
    compute = [_one_f_one_b_rank(r, m, pp - 1 - r, None, optimizer=True) for r in range(pp)]
    return lower("pipedream", pp, m, compute, [range(pp)])


def interleaved(pp: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B (Narayanan et al., SC'21; Megatron-Core): v chunks per rank, stage s on
    rank s % pp.  Microbatches go in groups of pp through each chunk; rank r warms up with
    2(pp-1-r) + (v-1)pp forward chunks, then alternates one forward and one backward chunk."""
    total = m * v

    def chunk_mb(k: int, backward: bool) -> tuple[int, int]:
        chunk = (k // pp) % v
        return (v - 1 - chunk if backward else chunk), (k // (pp * v)) * pp + k % pp

    compute = []
    for r in range(pp):
        warmup = min(2 * (pp - 1 - r) + (v - 1) * pp, total)
        acts = []
        for k in range(total + warmup):
            if k < total:
                c, mb = chunk_mb(k, False)
                acts.append(Action(F, c * pp + r, mb))
            if k >= warmup:
                c, mb = chunk_mb(k - warmup, True)
                acts.append(Action(B, c * pp + r, mb))
        compute.append(acts)
    return lower("interleaved", pp, m, compute, [[s % pp for s in range(v * pp)]], chunks=v)


def _v_placement(pp: int) -> list[int]:
    return list(range(pp)) + list(reversed(range(pp)))


def zb_v(pp: int, m: int) -> Schedule:
    """ZB-V (Qi et al., ICLR 2024, Sec. 6; "Pipeline Parallelism with Controllable Memory"):
    two chunks per rank in a V (rank r holds stages r and 2pp-1-r), split backward, peak memory
    as 1F1B and near-zero bubble when T_F = T_B = T_W."""
    compute = []
    for r in range(pp):
        down, up = r, 2 * pp - 1 - r
        nf = {down: 0, up: 0}
        ni = {down: 0, up: 0}
        nw = {down: 0, up: 0}
        acts: list[Action] = []

        def run(*kind_stage: Kind | int) -> None:
            """Append the next microbatch of each (kind, stage) pair given."""
            for kind, stage in zip(kind_stage[::2], kind_stage[1::2]):
                counter = {F: nf, I: ni, W: nw}[kind]
                acts.append(Action(kind, stage, counter[stage]))
                counter[stage] += 1

        for _ in range(2 * (pp - r) - 1):
            run(F, down)
        for _ in range(r):
            run(F, up)
            run(F, down)
        for _ in range(pp - r):
            run(F, up, I, up, W, up)
        while nf[up] < m:
            if nf[down] < m:
                run(F, down)
            run(I, down, W, down, F, up, I, up, W, up)
        for _ in range(r):
            run(I, down, I, up)
        while ni[down] < m:
            run(I, down, W, down)
        for stage in (up, down):
            while nw[stage] < m:
                run(W, stage)
        compute.append(acts)
    return lower("zb-v", pp, m, compute, [_v_placement(pp)], chunks=2)


def _dualpipe_program(n: int, pos: int, per_phase: int) -> list[tuple[str, int]]:
    """DualPipe's per-rank step list (DeepSeek-V3 report; deepseek-ai/DualPipe) as (op, phase).

    ``n`` ranks per half of the bidirectional pipeline, ``pos`` this rank's position in its half,
    ``per_phase`` microbatches per phase.  Phase 0 is the direction in which the rank is early.
    Ops: "F" forward, "F&" forward fused with the following full backward "B" (an overlapped F&B
    chunk), "I" input-only backward (its weight pass is queued), "W" the oldest queued weight pass.
    """
    ops: list[tuple[str, int]] = [("F", 0)] * (2 * (n - pos - 1))  # 1: nF0
    ops += [("F", 0), ("F", 1)] * (pos + 1)  # 2: nF0F1
    ops += [("I", 1), ("W", -1), ("F", 1)] * (n - pos - 1)  # 3: nB1W1F1
    main = [("F&", 0), ("B", 1), ("F&", 1), ("B", 0)] * (per_phase - 2 * n + pos + 1)  # 4: nF0B1F1B0
    if main and pos == n - 1:
        main[0] = ("F", 0)  # the middle ranks do not overlap their first pair (less bubble)
    ops += main
    ops += [("B", 1), ("F&", 1), ("B", 0)] * (n - pos - 1)  # 5: nB1F1B0
    split = False  # 6: nB1B0, the second half with zero bubble
    for i in range(pos + 1):
        split = split or (i == (pos + 1) // 2 and pos % 2 == 1)
        ops.append(("I" if split else "B", 1))
        split = split or (i == (pos + 1) // 2 and pos % 2 == 0)
        ops.append(("I" if split else "B", 0))
    ops += [("W", -1), ("I", 0)] * (n - pos - 1)  # 7: nWB0
    ops += [("W", -1)] * (pos + 1)  # 8: nW
    return ops


def _from_program(program: list[tuple[str, int]], where: Callable[[int, int], tuple[int, int]]) -> list[Action]:
    """Turn a DualPipe program into actions; ``where(phase, k)`` gives the k-th (stage, mb)."""
    count_f, count_b, queue, acts = [0, 0], [0, 0], [], []
    for op, phase in program:
        if op == "W":
            stage, mb = queue.pop(0)
            acts.append(Action(W, stage, mb))
            continue
        counter = count_f if op.startswith("F") else count_b
        stage, mb = where(phase, counter[phase])
        counter[phase] += 1
        acts.append(Action({"F": F, "F&": F, "B": B, "I": I}[op], stage, mb, overlap=op == "F&"))
        if op == "I":
            queue.append((stage, mb))
    return acts


def dualpipe(pp: int, m: int) -> Schedule:
    """DualPipe (DeepSeek-V3 technical report, 2024): microbatches 0..m/2-1 enter at rank 0 and
    m/2..m-1 at rank pp-1; each rank holds two parameter copies (paths), one per direction."""
    n, half = pp // 2, m // 2
    compute = []
    for r in range(pp):
        second = r >= n  # in the second half, logical phase 0 is the reverse path

        def where(phase: int, k: int, r: int = r, second: bool = second) -> tuple[int, int]:
            path = phase ^ second
            return (r if path == 0 else pp - 1 - r), k + path * half

        compute.append(_from_program(_dualpipe_program(n, min(r, pp - 1 - r), half), where))
    placement = [list(range(pp)), list(reversed(range(pp)))]
    return lower("dualpipe", pp, m, compute, placement, mb_path=[i // half for i in range(m)])


def dualpipev(pp: int, m: int) -> Schedule:
    """DualPipeV ("cut-in-half" DualPipe, deepseek-ai/DualPipe): one parameter copy, two chunks
    per rank in a V; phase 0 is stage r, phase 1 stage 2pp-1-r."""
    compute = []
    for r in range(pp):
        where = lambda phase, k, r=r: ((r if phase == 0 else 2 * pp - 1 - r), k)  # noqa: E731
        compute.append(_from_program(_dualpipe_program(pp, r, m), where))
    return lower("dualpipev", pp, m, compute, [_v_placement(pp)], chunks=2)


def fuse_overlapped(schedule: Schedule) -> Schedule:
    """DualPipe's F&B chunks made adjacent, for an executor that runs the backward inside the forward (while
    the forward's expert all-to-all is in flight): each overlapped F moves to just before the backward that
    follows it, the receives between them come first and the sends of that forward's output right after the
    backward. :func:`.validate.validate` checks the result like any schedule (dependencies, no deadlock)."""
    ranks = []
    for acts in schedule.ranks:
        out, i = [], 0
        while i < len(acts):
            a = acts[i]
            j = next((k for k in range(i + 1, len(acts)) if acts[k].kind not in COMM), None)
            if not (a.kind is Kind.FORWARD and a.overlap and j is not None
                    and acts[j].kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT)):
                out.append(a)
                i += 1
                continue
            own = [c for c in acts[i + 1:j] if c.kind is Kind.SEND_F and (c.stage, c.mb) == (a.stage, a.mb)]
            out += [c for c in acts[i + 1:j] if c not in own] + [a, acts[j]] + own
            i = j + 1
        ranks.append(tuple(out))
    return dataclasses.replace(schedule, ranks=tuple(ranks))


# --- the one entry point -----------------------------------------------------------------------

def _min_microbatches(name: str, pp: int) -> int:
    """The fewest microbatches for which the schedule's phases exist (1F1B-style ones run any m)."""
    return {"interleaved": pp, "zb-v": 2 * pp - 1, "dualpipev": 2 * pp - 1,
            "dualpipe": max(2, 2 * pp - 2)}.get(name, 1)


GENERATORS: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved, "zb-h1": zb_h1,
    "zb-h2": zb_h2, "zb-v": zb_v, "dualpipe": dualpipe, "dualpipev": dualpipev,
    "pipedream": pipedream,
}
SCHEDULES = tuple(GENERATORS)
V_SHAPED = ("zb-v", "dualpipev")  # two chunks a rank, folded: rank 0 holds the first layers and the last


MAX_SCHEDULE_SIZE = 2**16  # pp x microbatches x chunks: a few seconds to build, validate and simulate


def build_schedule(name: str, pp: int, microbatches: int, chunks: int | None = None) -> Schedule:
    """Build schedule ``name`` for ``pp`` ranks and ``microbatches``; ``chunks`` is the number of
    virtual stages per rank (interleaved only, default 2; zb-v and dualpipev are fixed at 2)."""
    if name not in GENERATORS:
        raise ScheduleError(f"unknown schedule {name!r}; valid: {', '.join(SCHEDULES)}")
    if pp < 1:
        raise ScheduleError(f"pp must be >= 1, got {pp}")
    size = pp * microbatches * ((chunks or 2) if name == "interleaved" else 1)
    if size > MAX_SCHEDULE_SIZE:  # building, validating and simulating take time and memory in proportion
        raise ScheduleError(f"pp {pp} x microbatches {microbatches} x chunks = {size:,} exceeds the cap of "
                            f"{MAX_SCHEDULE_SIZE:,} on a schedule's size; use a smaller --pp, --microbatches or "
                            f"--chunks")
    if name == "dualpipe" and (pp % 2 or microbatches % 2):
        raise ScheduleError("dualpipe needs an even pp and an even microbatch count, "
                            f"got pp={pp}, microbatches={microbatches}")
    need = _min_microbatches(name, pp)
    if microbatches < need:
        raise ScheduleError(f"{name} with pp={pp} needs at least {need} microbatches, got {microbatches}")
    if name == "interleaved":
        v = 2 if chunks is None else chunks
        if v < 2:
            raise ScheduleError(f"interleaved needs chunks >= 2 (one chunk is 1f1b), got {v}")
        if microbatches % pp:
            raise ScheduleError(f"interleaved needs microbatches divisible by pp ({pp}), got {microbatches}")
        return interleaved(pp, microbatches, v)
    fixed = 2 if name in V_SHAPED else 1
    if chunks is not None and chunks != fixed:
        raise ScheduleError(f"{name} has {fixed} chunk(s) per rank; chunks={chunks} is invalid "
                            "(only interleaved takes chunks)")
    return GENERATORS[name](pp, microbatches)


def pipeline_microbatches(parallel) -> int:
    """Microbatches a layout's (a ``ParallelConfig``) pipeline runs per step: ``--microbatches``, 2 x pp by
    default."""
    return parallel.microbatches or 2 * parallel.dims.pp


def schedule_chunks(name: str, chunks: int) -> int | None:
    """The :func:`build_schedule` chunks of a layout's ``--chunks``: interleaved's; the others fix theirs (None)."""
    return chunks if name == "interleaved" else None


def schedule_for(parallel) -> Schedule:
    """The schedule a layout runs: its ``--schedule`` over its pp ranks, for :func:`pipeline_microbatches`, with
    :func:`schedule_chunks`."""
    return build_schedule(parallel.schedule, parallel.dims.pp, pipeline_microbatches(parallel),
                          schedule_chunks(parallel.schedule, parallel.chunks))
