"""A peer whose process has exited is named dead, not "alive but behind" (its last heartbeat's collective count
is stale): the heartbeat carries the host and process id, and a rank on this host checks the process."""

import json
import os
import socket
import subprocess
import sys
import time

from parallelisms.comm import liveness


class _Store:
    """The two calls liveness makes of a torch.distributed store."""

    def __init__(self, beats: dict):
        self.values = {liveness.KEY.format(rank): json.dumps(beat).encode() for rank, beat in beats.items()}

    def check(self, keys):
        return all(k in self.values for k in keys)

    def get(self, key):
        return self.values[key]


def test_an_exited_peer_on_this_host_is_dead_and_a_running_one_is_not():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    beat = {"time": time.time(), "collectives": {"dp": 266}, "host": socket.gethostname()}
    store = _Store({1: {**beat, "pid": gone.pid}, 2: {**beat, "pid": os.getpid()},
                    3: {**beat, "pid": gone.pid, "host": "elsewhere"}, 4: {"time": time.time(), "collectives": {}}})
    assert liveness.dead_ranks([1, 2, 3, 4], store) == {1: gone.pid}
    assert liveness.lagging_ranks([1, 2], "dp", 300, store) == {1: 266, 2: 266}  # what a dead peer read as before


def test_the_heartbeat_carries_host_and_pid():
    store = _Store({})
    store.set = lambda key, value: store.values.__setitem__(key, value.encode())
    with liveness.Heartbeat(5, interval_s=0.05, store=store):
        while liveness.KEY.format(5) not in store.values:
            time.sleep(0.01)
    beat = json.loads(store.values[liveness.KEY.format(5)])
    assert beat["pid"] == os.getpid() and beat["host"] == socket.gethostname()
    assert liveness.dead_ranks([5], store) == {}
