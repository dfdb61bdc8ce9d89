"""The collective-order proof: before launch, from the dry run's ledgers, every group's members issue the same
collectives in the same order, every message is received, and the pipeline schedule cannot deadlock.

For every process group of the layout (every group of every mesh dimension, the mesh's
:meth:`~parallelisms.mesh.ParallelDims.groups`):

* collectives: each member's sequence over that group, as (kind, dtype, element count, reduction), is the same;
  an uneven all-to-all's splits agree (what member i sends to j is what j expects from i);
* point-to-point: for each ordered pair of members, the messages i sends to j are, in order and shape, the
  messages j receives from i;
* the pipeline schedule passes :func:`parallelisms.parallel.pipeline.validate.validate` (placement,
  dependencies, matching, and no cycle of waits).

A violation names the group, the ranks, the index of the first difference and both sides. Members of one rank
class run the same program (:mod:`.groups`), so a group whose members fall in the same classes as one already
checked is not checked again.
"""

from __future__ import annotations

from parallelisms.comm.recording import Event
from parallelisms.mesh import ParallelDims

P2P = ("send", "recv")


def precheck(dims: ParallelDims, events_of, schedule=None, cp_ulysses: int = 0) -> dict:
    """The proof over the layout ``dims`` (``cp_ulysses``: hierarchical context parallelism's split of cp);
    ``events_of(rank)`` gives a rank's recorded events (its class's).
    Returns ``{"ok", "groups", "collectives", "messages", "violations"}``."""
    from parallelisms.dryrun.groups import class_key

    violations, seen, checked = [], set(), {"groups": 0, "collectives": 0, "messages": 0}
    dims_used = sorted({e.dim for r in {min(rs) for rs in _class_ranks(dims).values()} for e in events_of(r)})
    for dim in dims_used:
        for group in dims.groups(dim, cp_ulysses):
            signature = (dim, tuple(class_key(dims, r) for r in group))
            if signature in seen or len(group) < 2:
                continue
            seen.add(signature)
            checked["groups"] += 1
            per_member = [[e for e in events_of(r) if e.dim == dim] for r in group]
            violations += _collectives(dim, group, [[e for e in es if e.kind not in P2P] for es in per_member],
                                       checked)
            violations += _messages(dim, group, per_member, checked)
    if schedule is not None:
        from parallelisms.parallel.pipeline.schedules import ScheduleError
        from parallelisms.parallel.pipeline.validate import validate

        try:
            validate(schedule)
        except ScheduleError as exc:
            violations.append(f"pipeline schedule {schedule.name}: {exc}")
    return {"ok": not violations, **checked, "violations": violations}


def _class_ranks(dims: ParallelDims) -> dict:
    from parallelisms.dryrun.groups import rank_classes

    return rank_classes(dims)


def _collectives(dim: str, group: tuple, sequences: list[list[Event]], checked: dict) -> list[str]:
    """Every member's collectives over ``group`` identical (and an all-to-all's splits consistent)."""
    first, name = sequences[0], f"group '{dim}' {list(group)}"
    checked["collectives"] += len(first)
    for rank, mine in zip(group[1:], sequences[1:]):
        for i, (a, b) in enumerate(zip(first, mine)):
            if a.signature() != b.signature():
                return [f"{name}: collective #{i} differs: rank {group[0]} issues {a.describe()}, "
                        f"rank {rank} issues {b.describe()}"]
        if len(first) != len(mine):
            longer, shorter = (group[0], rank) if len(first) > len(mine) else (rank, group[0])
            extra = (first if len(first) > len(mine) else mine)[min(len(first), len(mine))]
            return [f"{name}: collective #{min(len(first), len(mine))}: rank {longer} issues {extra.describe()}, "
                    f"rank {shorter} issues nothing more ({len(first)} against {len(mine)} collectives)"]
    for i, calls in enumerate(zip(*sequences)):
        if calls[0].kind == "all_to_all" and calls[0].splits:
            for a, sender in enumerate(calls):
                for b, receiver in enumerate(calls):
                    if sender.splits[0][b] != receiver.splits[1][a]:
                        return [f"{name}: all_to_all #{i}: rank {group[a]} sends {sender.splits[0][b]} rows to rank "
                                f"{group[b]}, which expects {receiver.splits[1][a]} from it"]
    return []


def _messages(dim: str, group: tuple, per_member: list[list[Event]], checked: dict) -> list[str]:
    """For each ordered pair, i's sends to j are j's receives from i, in order, dtype and shape."""
    index = {r: i for i, r in enumerate(group)}
    sent, received = {}, {}
    for i, events in enumerate(per_member):
        for e in events:
            if e.kind in P2P:
                peer = index[group[e.ranks.index(e.peer)]] if e.peer in e.ranks else -1
                book = sent if e.kind == "send" else received
                book.setdefault((i, peer) if e.kind == "send" else (peer, i), []).append(e)
    problems = []
    for pair in sorted(set(sent) | set(received)):
        src, dst = (group[p] if p >= 0 else p for p in pair)
        outs, ins = sent.get(pair, []), received.get(pair, [])
        checked["messages"] += len(outs)
        for k in range(max(len(outs), len(ins))):
            a = outs[k] if k < len(outs) else None
            b = ins[k] if k < len(ins) else None
            if a is None or b is None or (a.dtype, a.shape) != (b.dtype, b.shape):
                what = lambda e, verb: f"{verb} {e.shape}x{e.dtype} ({e.phase})" if e else "nothing"  # noqa: E731
                problems.append(f"group '{dim}' {list(group)}: message #{k} from rank {src} to rank {dst}: rank {src} "
                                f"sends {what(a, 'a')}, rank {dst} receives {what(b, 'a')}")
                break
    return problems[:1]
