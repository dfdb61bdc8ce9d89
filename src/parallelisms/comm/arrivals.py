"""When each rank arrives at each collective and point-to-point transfer, and when it starts to block on it:
the raw material of the straggler report (:mod:`parallelisms.stragglers`).

Every :class:`parallelisms.comm.Comm` call notes its arrival while the log is ``active`` (the training loop
turns it on for the step only): a collective by its group and its sequence number in that group (every member
enters the same collectives in the same order, so rank A's call #k and rank B's call #k are the same call); a
send or receive by its (source, destination) pair and its sequence number on that pair (point-to-point keeps
its order per pair). An asynchronous call also notes when the rank starts to wait for it (``Pending.wait``):
a rank that issued early and blocked only later lost the time between blocking and the last arrival, not
more. Times are ``time.perf_counter_ns`` (CLOCK_MONOTONIC, one clock for every process of a machine); the
report moves other hosts' times onto rank 0's clock by an offset measured at the start.

The log holds one step at a time: :meth:`Arrivals.take` hands the step's notes over and empties it, so its
memory does not grow with the run. Cost: one clock read and one list append per call.
"""

from __future__ import annotations

import time
from collections import defaultdict


class Arrival:
    """One rank's note of one call: its identity ``key`` (the same on every rank that takes part), the mesh
    dimension ``dim``, the arrival and the start of blocking (ns; ``block`` None: never waited for)."""

    __slots__ = ("key", "dim", "arrive", "block")

    def __init__(self, key: tuple, dim: str, arrive: int, block: int | None):
        self.key, self.dim, self.arrive, self.block = key, dim, arrive, block

    def as_tuple(self) -> tuple:
        return self.key, self.dim, self.arrive, self.block


class Arrivals:
    """This rank's arrival notes of the current step (see the module docstring)."""

    def __init__(self):
        self.active = False
        self.notes: list[Arrival] = []
        self._calls: dict[tuple, int] = defaultdict(int)  # per group, per (source, destination) pair

    def collective(self, dim: str, group: tuple, blocking: bool) -> Arrival | None:
        """Note this rank's arrival at the next collective of ``group`` (its name and member ranks); the
        caller sets ``block`` of an asynchronous one when it waits. Counted also while inactive, so the
        sequence numbers stay equal on every member."""
        self._calls[group] += 1
        if not self.active:
            return None
        now = time.perf_counter_ns()
        note = Arrival(("c", group, self._calls[group]), dim, now, now if blocking else None)
        self.notes.append(note)
        return note

    def transfer(self, dim: str, source: int, destination: int, receiving: bool) -> Arrival | None:
        """Note a send (``receiving`` False) or a receive between global ranks ``source`` and ``destination``;
        a receive's ``block`` is set when the rank waits for it."""
        pair = ("p", source, destination)
        self._calls[pair] += 1
        if not self.active:
            return None
        note = Arrival(("s" if not receiving else "r", source, destination, self._calls[pair]), dim,
                       time.perf_counter_ns(), None)
        self.notes.append(note)
        return note

    @staticmethod
    def blocked(notes) -> None:
        """The rank starts to wait for the calls of ``notes`` (a ``Pending``'s): the first start counts."""
        now = time.perf_counter_ns()
        for note in notes:
            if note is not None and note.block is None:
                note.block = now

    def take(self) -> list[tuple]:
        """The notes since the last call, as plain tuples (picklable), and an empty log."""
        notes, self.notes = self.notes, []
        return [n.as_tuple() for n in notes]
