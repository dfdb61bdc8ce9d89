"""Validator for pipeline schedules (:mod:`.schedules`).

It executes the per-rank lists symbolically, the way the executor will: each rank runs its actions
in order, a ``RECV_*`` blocks until the peer has posted the matching ``SEND_*`` (same stage, mb and
direction), sends never block (they are posted, possibly batched, and complete later).  While doing
so it checks

* placement: every action runs on the rank that owns its (stage, microbatch);
* dependencies: F(s, mb) after F(s-1, mb); B/I(s, mb) after F(s, mb) and after the input gradient
  of s+1; W(s, mb) after I(s, mb); each input that lives on another rank was received first;
* exactly-once: each (stage, mb) has one forward and either one full backward or one I and one W;
* matching: every send is received exactly once, by the peer it names, and vice versa;
* progress: if every unfinished rank is blocked on a receive, the schedule deadlocks;
* PipeDream versions: a forward uses the stage's current version, its backward the same one.

Any violation raises :class:`ScheduleValidationError` naming the rank, the action and the reason.
"""

from __future__ import annotations

from .schedules import COMM, Action, Kind, Schedule, ScheduleError, produces, requires

_SEND_TAG = {Kind.SEND_F: "F", Kind.SEND_B: "B"}
_RECV_TAG = {Kind.RECV_F: "F", Kind.RECV_B: "B"}


class ScheduleValidationError(ScheduleError):
    def __init__(self, rank: int | None, action: Action | None, reason: str):
        self.rank, self.action, self.reason = rank, action, reason
        where = "" if rank is None else f"rank {rank}: " + ("" if action is None else f"{action}: ")
        super().__init__(where + reason)


def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleValidationError` unless ``schedule`` is correct and deadlock-free."""
    S, pp = schedule.num_stages, schedule.pp
    if len(schedule.ranks) != pp:
        raise ScheduleValidationError(None, None, f"{len(schedule.ranks)} rank lists for pp={pp}")
    have: list[set[tuple[str, int, int]]] = [set() for _ in range(pp)]  # results present on a rank
    done: dict[tuple[str, int, int], int] = {}  # result -> rank that computed it
    in_flight: dict[tuple[int, int, str, int, int], Action] = {}  # (src, dst, tag, stage, mb)
    received: set[tuple[int, int, str, int, int]] = set()
    version: dict[int, int] = {}  # stage -> number of optimizer steps applied
    stashed: dict[tuple[int, int], int | None] = {}  # (stage, mb) -> version its forward used
    pc = [0] * pp

    def fail(r: int, a: Action, reason: str) -> None:
        raise ScheduleValidationError(r, a, reason)

    def step(r: int, a: Action) -> bool:
        """Execute one action; False if it is a receive that cannot complete yet."""
        if a.stage < 0 or a.stage >= S or a.mb < 0 or a.mb >= schedule.microbatches:
            fail(r, a, "stage or microbatch out of range")
        if a.kind in COMM:
            return _communicate(r, a)
        if schedule.rank_of(a.stage, a.mb) != r:
            fail(r, a, f"(stage {a.stage}, mb {a.mb}) is placed on rank {schedule.rank_of(a.stage, a.mb)}")
        for need in requires(a, S):
            if need not in have[r]:
                tag, s, mb = need
                how = "computed" if tag in ("W", "OPT") or schedule.rank_of(s, mb) == r else "received"
                fail(r, a, f"needs {_describe(need)}, which was not {how} before it on this rank")
        _check_version(r, a)
        for result in produces(a):
            key = (result, a.stage, a.mb)
            if key in done:
                fail(r, a, f"{_describe(key)} is computed a second time")
            done[key] = r
            have[r].add(key)
        return True

    def _communicate(r: int, a: Action) -> bool:
        if a.peer is None or not 0 <= a.peer < pp or a.peer == r:
            fail(r, a, f"invalid peer {a.peer}")
        if a.kind in _SEND_TAG:
            tag = _SEND_TAG[a.kind]
            key = (r, a.peer, tag, a.stage, a.mb)
            if (tag, a.stage, a.mb) not in have[r]:
                fail(r, a, f"sends {_describe((tag, a.stage, a.mb))} before it exists on this rank")
            if key in in_flight or key in received:
                fail(r, a, "duplicate send")
            in_flight[key] = a
            return True
        tag = _RECV_TAG[a.kind]
        key = (a.peer, r, tag, a.stage, a.mb)
        if key in received:
            fail(r, a, "duplicate receive")
        if key not in in_flight:
            return False
        del in_flight[key]
        received.add(key)
        have[r].add((tag, a.stage, a.mb))
        return True

    def _check_version(r: int, a: Action) -> None:
        if a.kind is Kind.OPTIMIZER:
            version[a.stage] = version.get(a.stage, 0) + 1
            if a.version is not None and a.version != version[a.stage]:
                fail(r, a, f"optimizer step produces version {version[a.stage]}, not {a.version}")
        elif a.kind is Kind.FORWARD:
            if a.version is not None and a.version != version.get(a.stage, 0):
                fail(r, a, f"forward must use the current weight version {version.get(a.stage, 0)}")
            stashed[a.stage, a.mb] = a.version
        elif stashed.get((a.stage, a.mb)) != a.version:
            fail(r, a, f"backward must use the stashed version {stashed.get((a.stage, a.mb))} of its forward")

    progress = True
    while progress:
        progress = False
        for r in range(pp):
            acts = schedule.ranks[r]
            while pc[r] < len(acts) and step(r, acts[pc[r]]):
                pc[r] += 1
                progress = True
    blocked = [r for r in range(pp) if pc[r] < len(schedule.ranks[r])]
    if blocked:
        waits = "; ".join(f"rank {r} waits at {schedule.ranks[r][pc[r]]} (action {pc[r]})" for r in blocked)
        raise ScheduleValidationError(blocked[0], schedule.ranks[blocked[0]][pc[blocked[0]]],
                                      f"deadlock, no matching send is ever posted: {waits}")
    for (src, dst, tag, s, mb), a in in_flight.items():
        raise ScheduleValidationError(src, a, f"never received by rank {dst}")
    for s in range(S):
        for mb in range(schedule.microbatches):
            for tag in ("F", "B", "W"):
                if (tag, s, mb) not in done:
                    r = schedule.rank_of(s, mb)
                    raise ScheduleValidationError(r, None, f"{_describe((tag, s, mb))} is never computed")


def _describe(result: tuple[str, int, int]) -> str:
    tag, s, mb = result
    what = {"F": "the activation", "B": "the input gradient", "W": "the weight gradient",
            "OPT": "the optimizer step"}[tag]
    return f"{what} of stage {s}, mb {mb}"
