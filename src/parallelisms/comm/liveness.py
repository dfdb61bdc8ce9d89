"""Which ranks are alive: a heartbeat per rank in the job's key-value store.

A collective that times out only tells the rank that waited that *someone* did not arrive. With every rank's
wall-clock time written to the store (the one ``torch.distributed`` rendezvoused through) every ``interval_s``
by a background thread, the rank that waited can name the peers that went silent: stopped (SIGSTOP, a
debugger), dead, or wedged in the kernel. A heartbeat following a rank's ledger (:meth:`Heartbeat.follow`) also
carries how many collectives the rank has entered per mesh dimension, so a peer that is alive but never
arrived (busy in its own code, or waiting at another collective) is named too: it is behind the waiting
rank's count on that dimension (:func:`lagging_ranks`). A beat also carries the rank's host and process id, so a
peer on this host whose process has exited is named dead (:func:`dead_ranks`) at once: a collective that a
killed peer broke fails before its heartbeat has aged, and its last count would read as "behind". Nothing is added to the hot path; the store sees two
small writes per second per rank. ``late_ranks`` phrases the finding the way the launcher recognises (``LATE``).
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import threading
import time

import torch.distributed as dist

KEY = "parallelisms/heartbeat/{}"
HOST_KEY = "parallelisms/host/{}"
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


def publish_host(rank: int, store=None) -> None:
    """Write this rank's host name to the store (once, at start): which peers share a host, without a collective."""
    store = store if store is not None else default_store()
    if store is not None:
        store.set(HOST_KEY.format(rank), socket.gethostname())


def peer_host(rank: int, store) -> str | None:
    """The host ``rank`` published, or None (not published, or no store)."""
    key = HOST_KEY.format(rank)
    try:
        return store.get(key).decode() if store is not None and store.check([key]) else None
    except RuntimeError:
        return None


class Heartbeat:
    """While entered, a daemon thread writes this rank's wall-clock time to the store every ``interval_s``."""

    def __init__(self, rank: int, interval_s: float = 0.5, store=None):
        self.rank, self.interval_s = rank, interval_s
        self.store = store if store is not None else default_store()
        self.ledger = None  # a CommLedger whose collective counts each beat carries
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="parallelisms-heartbeat", daemon=True)

    def __enter__(self) -> "Heartbeat":
        if self.store is not None:
            publish_host(self.rank, self.store)
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout=2 * self.interval_s)

    def follow(self, ledger) -> None:
        """Carry ``ledger``'s collective counts per mesh dimension in every beat from now on."""
        self.ledger = ledger

    def _beat(self) -> None:
        while True:
            counts = dict(self.ledger.collectives) if self.ledger is not None else {}
            try:
                self.store.set(KEY.format(self.rank), json.dumps({"time": time.time(), "collectives": counts,
                                                                  "host": socket.gethostname(), "pid": os.getpid()}))
            except Exception:  # the store is gone: the job is ending
                return
            if self.stop.wait(self.interval_s):
                return


def _beats(ranks, store) -> dict[int, dict]:
    """Rank -> its last heartbeat (``time``, ``collectives``), for the ``ranks`` that have one."""
    store = store if store is not None else default_store()
    beats = {}
    for rank in ranks if store is not None else ():
        key = KEY.format(rank)
        try:
            beat = json.loads(store.get(key)) if store.check([key]) else None
        except (RuntimeError, ValueError, RecursionError):
            return {}
        if _is_beat(beat):
            beats[rank] = beat
    return beats


def _is_beat(beat) -> bool:
    """Whether a value read from the store is a heartbeat (the store is a network service: values are checked)."""
    return (isinstance(beat, dict) and isinstance(beat.get("time"), (int, float)) and math.isfinite(beat["time"])
            and isinstance(beat.get("collectives"), dict)
            and all(isinstance(k, str) and type(v) is int for k, v in beat["collectives"].items()))


def silent_ranks(ranks, older_than_s: float, store=None) -> dict[int, float]:
    """Rank -> seconds since its last heartbeat, for the ``ranks`` silent for longer than ``older_than_s``
    (empty where no heartbeats are kept)."""
    now = time.time()
    ages = {rank: now - beat["time"] for rank, beat in _beats(ranks, store).items()}
    return {rank: age for rank, age in ages.items() if age > older_than_s}


def lagging_ranks(ranks, dim: str, entered: int, store=None) -> dict[int, int]:
    """Rank -> collectives it has entered on mesh dimension ``dim``, for the ``ranks`` (alive, following a
    ledger) behind ``entered``, the waiting rank's own count including the collective it waits at."""
    counts = {rank: beat["collectives"].get(dim, 0) for rank, beat in _beats(ranks, store).items()
              if beat["collectives"]}
    return {rank: count for rank, count in counts.items() if count < entered}


def _exited(pid: int) -> bool:
    """Whether process ``pid`` of this host has exited (gone, or a zombie not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


def dead_ranks(ranks, store=None) -> dict[int, int]:
    """Rank -> process id, for the ``ranks`` on this host whose process has exited (killed, or ended) although it
    published a heartbeat; ranks on other hosts are judged by their heartbeat's age (:func:`silent_ranks`)."""
    host = socket.gethostname()
    return {rank: beat["pid"] for rank, beat in _beats(ranks, store).items()
            if beat.get("host") == host and "pid" in beat and _exited(beat["pid"])}

