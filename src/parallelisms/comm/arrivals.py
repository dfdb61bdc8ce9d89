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

A note is already the row the report exchanges, a list of ints (``ROW``): its kind, the call's id (a
collective's: the CRC-32 of its group's identity, found once per group; a transfer's: source x 2^20 +
destination), the sequence number, the dimension's code in ``DIMS``, the arrival and the start of blocking
(-1: not yet). The log holds the notes since :meth:`Arrivals.take` last emptied it. Cost: one clock read, a
dictionary look-up and one list append per call.
"""

from __future__ import annotations

import time
import zlib
from collections import defaultdict

ROW = ("kind", "call", "seq", "dim", "arrive", "block")
COLLECTIVE, SEND, RECEIVE = 0, 1, 2  # a note's kind
DIMS = ("dp", "tp", "cp", "ep", "pp", "world")  # reported dimensions, by their code in the rows


def dimension(comm_name: str) -> str:
    """The reported dimension of a Comm: gradient groups (dp, dp_cp, dp_shard, dp_shard_cp, the expert
    weights' ep_replicate) are dp; ep_bwd is ep; the rest are their own name."""
    if comm_name.startswith("dp") or comm_name.startswith("ep_replicate"):
        return "dp"
    return comm_name.split("_")[0]


def dimension_code(comm_name: str) -> int:
    name = dimension(comm_name)
    return DIMS.index(name) if name in DIMS else len(DIMS) - 1


class Arrivals:
    """This rank's arrival notes since the last :meth:`take` (see the module docstring)."""

    def __init__(self):
        self.active = False
        self.notes: list[list[int]] = []
        self._calls: dict[tuple, int] = defaultdict(int)  # per group, per (source, destination) pair
        self._codes: dict[tuple, tuple[int, int]] = {}    # per (Comm name, group): (call id, dimension code)

    def collective(self, dim: str, group: tuple, blocking: bool) -> list[int] | None:
        """Note this rank's arrival at the next collective of ``group`` (its name and member ranks); the
        caller sets the block of an asynchronous one when it waits (:meth:`blocked`). Counted also while
        inactive, so the sequence numbers stay equal on every member."""
        self._calls[group] += 1
        if not self.active:
            return None
        codes = self._codes.get((dim, group))
        if codes is None:
            codes = self._codes[dim, group] = (zlib.crc32(repr(group).encode()), dimension_code(dim))
        now = time.perf_counter_ns()
        note = [COLLECTIVE, codes[0], self._calls[group], codes[1], now, now if blocking else -1]
        self.notes.append(note)
        return note

    def transfer(self, dim: str, source: int, destination: int, receiving: bool) -> list[int] | None:
        """Note a send (``receiving`` False) or a receive between global ranks ``source`` and ``destination``;
        a receive's block is set when the rank waits for it."""
        pair = ("p", source, destination)
        self._calls[pair] += 1
        if not self.active:
            return None
        note = [RECEIVE if receiving else SEND, source * (1 << 20) + destination, self._calls[pair],
                dimension_code(dim), time.perf_counter_ns(), -1]
        self.notes.append(note)
        return note

    @staticmethod
    def blocked(notes) -> None:
        """The rank starts to wait for the calls of ``notes`` (a ``Pending``'s): the first start counts."""
        now = time.perf_counter_ns()
        for note in notes:
            if note is not None and note[5] < 0:
                note[5] = now

    def take(self) -> list[list[int]]:
        """The notes since the last call, and an empty log."""
        notes, self.notes = self.notes, []
        return notes
