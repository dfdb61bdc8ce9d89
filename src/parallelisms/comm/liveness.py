"""Which ranks are alive: a heartbeat per rank in the job's key-value store.

A collective that times out only tells the rank that waited that *someone* did not arrive. With every rank's
wall-clock time written to the store (the one ``torch.distributed`` rendezvoused through) every ``interval_s``
by a background thread, the rank that waited can name the peers that went silent: stopped (SIGSTOP, a
debugger), dead, or wedged in the kernel. Nothing is added to the hot path; the store sees two small writes per
second per rank. ``late_ranks`` phrases the finding the way the launcher recognises (``LATE``).
"""

from __future__ import annotations

import re
import threading
import time

import torch.distributed as dist

KEY = "parallelisms/heartbeat/{}"
LATE = re.compile(r"\b(ranks? \d+(?:, \d+)*) did not arrive\b")  # how an error names the ranks that did not arrive


def default_store():
    """The store the default process group was set up with, or None."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def late_ranks(ranks) -> str:
    """``rank 1`` or ``ranks 1, 3``: the subject of ``... did not arrive`` (see ``LATE``)."""
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


class Heartbeat:
    """While entered, a daemon thread writes this rank's wall-clock time to the store every ``interval_s``."""

    def __init__(self, rank: int, interval_s: float = 0.5, store=None):
        self.rank, self.interval_s = rank, interval_s
        self.store = store if store is not None else default_store()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="parallelisms-heartbeat", daemon=True)

    def __enter__(self) -> "Heartbeat":
        if self.store is not None:
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout=2 * self.interval_s)

    def _beat(self) -> None:
        while True:
            try:
                self.store.set(KEY.format(self.rank), repr(time.time()))
            except Exception:  # the store is gone: the job is ending
                return
            if self.stop.wait(self.interval_s):
                return


def silent_ranks(ranks, older_than_s: float, store=None) -> dict[int, float]:
    """Rank -> seconds since its last heartbeat, for the ``ranks`` silent for longer than ``older_than_s``
    (empty where no heartbeats are kept)."""
    store = store if store is not None else default_store()
    if store is None:
        return {}
    now, silent = time.time(), {}
    for rank in ranks:
        key = KEY.format(rank)
        try:
            if not store.check([key]):
                continue
            age = now - float(store.get(key))
        except (RuntimeError, ValueError):
            return {}
        if age > older_than_s:
            silent[rank] = age
    return silent
