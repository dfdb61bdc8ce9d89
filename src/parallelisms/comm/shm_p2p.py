"""Point-to-point messages through shared memory between ranks of one host (CPU tensors).

gloo delivers a message on a background thread of the receiving process. When every core is busy computing,
that thread waits for the scheduler: at pp 2 on 2 cores most activations landed 0.4-0.6 ms after their send,
but those sent while the next stage ran its backward landed 3-6 ms late (a scheduler time slice), and the
pipeline's measured bubble grew by as much. Here each ordered pair of ranks shares a ring buffer in /dev/shm,
a byte stream of framed messages (as intra-node transports do: NCCL's SHM, MPI's shared-memory channels): the
sender copies a message in on its own thread when it sends, the receiver copies it out on its own thread when
it waits, and no other thread is involved. A message that does not fit the free space stays in the sender's
outbox and is pushed on by the sender's next call into the transport (another send, any wait), so a send never
blocks the schedule, as gloo's asynchronous send does not; messages on a pair arrive in send order.

A wait polls while each rank has a core of its own. Where ranks outnumber the cores it sleeps in the kernel on
the one counter it waits for (futex(2), as :mod:`.shm` does: the head of the peer's ring for a receive, the tail
of its own for a send held back), woken by the peer that moves it; polling there woke each rank every 100 us,
and at dp 2 x tp 2 x pp 2 on 2 cores cost 7,300-8,000 context switches a step where sleeping costs 3,600-4,200
(step 454-491 ms before, 424-439 after).

A ring is made by whichever end needs it first: both ends map the same file (named from the job, the mesh
dimension, the pair and how many rings the pair had), and the second to map it unlinks it, so nothing is left in
/dev/shm. A peer that does not send in time fails the wait with :class:`ShmTimeout` naming it; a peer process
that has exited fails it at once. Counters rely on x86's store order, as :mod:`.shm` does.
"""

from __future__ import annotations

import collections
import os
import re
import uuid

import torch

from parallelisms.comm.liveness import late_ranks, peer_host
from parallelisms.comm.shm import FLAG_STRIDE, Backoff, Futex, ShmRefused, ShmTimeout, open_shared, shm_path, unlink_own

HEADER = 16                    # bytes framing each message: its size and its sequence number on the pair
MIN_CAPACITY = 1 << 20         # a ring holds at least 1 MiB, or this many of the pair's first message:
MESSAGES_PER_RING = 4
HEAD, TAIL, SENDER_PID, RECEIVER_PID = (i * FLAG_STRIDE for i in range(4))  # one cache line each


class _Work:
    """One send or receive: ``wait()`` moves data until it is complete; ``is_completed()`` moves what it can."""

    def __init__(self, transport: "SharedMemoryP2P", peer: int, sending: bool):
        self.transport, self.peer, self.sending, self.done = transport, peer, sending, False

    def is_completed(self) -> bool:
        if not self.done:
            self.transport.progress()
        return self.done

    def wait(self) -> bool:
        self.transport.wait_for(self)
        return True

    def get_future(self):
        raise RuntimeError("completion is not observable")  # the timeline closes the span at the wait


class _Ring:
    """One direction of one pair: ``capacity`` bytes of stream plus the counters, mapped from ``path``."""

    def __init__(self, path: str, capacity: int, sending: bool):
        size = 4 * 64 + capacity
        memory = open_shared(path, size, create=None)  # whichever end comes first makes it
        self.counters = memory[:4 * 64].view(torch.int64).numpy()  # polled: numpy reads allocate nothing
        self.data, self.capacity = memory[4 * 64:], capacity
        self.counters[SENDER_PID if sending else RECEIVER_PID] = os.getpid()
        self.path = None      # set while the file may still need unlinking by this rank
        self.sequence = 0     # messages framed (sender) or read (receiver) on this ring
        self.queue = collections.deque()  # [bytes, offset, work, header]: the outbox, or the posted receives

    def address(self, counter: int) -> int:
        """The address of one of the ring's counters (HEAD, TAIL): a futex word."""
        return self.counters.ctypes.data + counter * self.counters.itemsize

    def copy(self, position: int, piece: torch.Tensor, into_ring: bool) -> None:
        """Copy ``piece`` to (or fill it from) the stream at ``position``, wrapping at the end of the ring."""
        start, n = position % self.capacity, piece.numel()
        first = min(n, self.capacity - start)
        for ring, part in ((self.data[start:start + first], piece[:first]), (self.data[:n - first], piece[first:])):
            if part.numel():
                (ring.copy_(part) if into_ring else part.copy_(ring))


class SharedMemoryP2P:
    """Sends and receives of Comm ``name`` (this rank is global rank ``me``) through one ring per direction and
    peer; ``carries(peer)`` says whether a peer is reachable so (same host, x86, /dev/shm)."""

    def __init__(self, name: str, me: int, store, timeout_s: float):
        self.name, self.me, self.store, self.timeout_s = name, me, store, timeout_s
        self.spin_s = Backoff.spin_for()
        self.futex = None if self.spin_s else Futex()  # ranks outnumber the cores: sleep until the peer moves
        self.job = store.compare_set("parallelisms/p2p/job", "", uuid.uuid4().hex).decode(errors="replace")
        if not re.fullmatch(r"[0-9a-f]{32}", self.job):  # the store is a network service: its values are checked
            raise ShmRefused(f"the store's p2p job token {self.job[:40]!r} is not one this project writes: refused")
        self.rings: dict[tuple[int, int], _Ring] = {}  # (src, dst) in global ranks
        self.reachable: dict[int, bool] = {}

    def carries(self, peer: int) -> bool:
        if peer not in self.reachable:
            self.reachable[peer] = peer_host(peer, self.store) == peer_host(self.me, self.store) is not None
        return self.reachable[peer]

    # -- the caller's side -----------------------------------------------------------------------------
    def send(self, tensor: torch.Tensor, peer: int) -> _Work:
        """Queue ``tensor`` (contiguous, CPU, kept unchanged until the work completes) for ``peer``."""
        return self._queue(tensor, peer, sending=True)

    def recv(self, tensor: torch.Tensor, peer: int) -> _Work:
        """Fill ``tensor`` (contiguous, CPU) with ``peer``'s next message on this Comm."""
        return self._queue(tensor, peer, sending=False)

    def _queue(self, tensor: torch.Tensor, peer: int, sending: bool) -> _Work:
        nbytes = tensor.numel() * tensor.element_size()
        ring = self._ring(self.me, peer, nbytes) if sending else self._ring(peer, self.me, nbytes)
        work = _Work(self, peer, sending)
        header = torch.tensor([nbytes, ring.sequence], dtype=torch.int64).view(torch.uint8)
        ring.sequence += 1
        ring.queue.append([tensor.view(-1).view(torch.uint8), 0, work, header])
        self.progress()
        return work

    def _ring(self, src: int, dst: int, nbytes: int) -> _Ring:
        if (src, dst) not in self.rings:
            key = f"parallelisms/p2p/{self.job}/{self.name}/{src}-{dst}"
            made = self.store.add(f"{key}/{'sender' if src == self.me else 'receiver'}", 1)
            path = shm_path(f"p2p-{self.job}-{self.name}-{src}-{dst}-{made}")
            capacity = -(-max(MIN_CAPACITY, MESSAGES_PER_RING * (HEADER + nbytes)) // 4096) * 4096
            ring = self.rings[(src, dst)] = _Ring(path, capacity, sending=src == self.me)
            if self.store.add(f"{key}/{made}/mapped", 1) == 2:  # both ends hold it now
                os.unlink(path)
            else:
                ring.path = path  # the peer unlinks it once it maps it too
        return self.rings[(src, dst)]

    def _unlink_unshared(self) -> None:
        """Remove the files of rings the peer never mapped (this rank is failing; nothing is left behind)."""
        for ring in self.rings.values():
            if ring.path is not None:
                unlink_own(ring.path)

    # -- moving data -------------------------------------------------------------------------------------
    def progress(self) -> None:
        """Push every outbox and pull every posted receive as far as the rings allow."""
        for (src, _), ring in self.rings.items():
            while ring.queue and (self._push(ring) if src == self.me else self._pull(ring)):
                ring.queue.popleft()[2].done = True

    def _push(self, ring: _Ring) -> bool:
        """Write as much of the outbox's first message as fits; True once all of it is in the ring."""
        item = ring.queue[0]
        payload, offset, _, header = item
        head = int(ring.counters[HEAD])
        free = ring.capacity - (head - int(ring.counters[TAIL]))
        if header is not None:
            if free < HEADER:
                return False
            ring.copy(head, header, into_ring=True)
            head, free, item[3] = head + HEADER, free - HEADER, None
        n = min(free, payload.numel() - offset)
        ring.copy(head, payload[offset:offset + n], into_ring=True)
        item[1] = offset + n
        ring.counters[HEAD] = head + n  # after the data: a receiver that sees the count sees the bytes
        if self.futex:
            self.futex.wake(ring.address(HEAD))
        return offset + n == payload.numel()

    def _pull(self, ring: _Ring) -> bool:
        """Read as much of the first posted receive as has arrived; True once all of it is in place."""
        item = ring.queue[0]
        buffer, offset, _, header = item
        tail = int(ring.counters[TAIL])
        ready = int(ring.counters[HEAD]) - tail
        if header is not None:
            if ready < HEADER:
                return False
            framed = torch.empty(HEADER, dtype=torch.uint8)
            ring.copy(tail, framed, into_ring=False)
            nbytes, sequence = framed.view(torch.int64).tolist()
            expected = header.view(torch.int64).tolist()
            if [nbytes, sequence] != expected:
                raise RuntimeError(f"message #{sequence} of {nbytes} bytes arrived where #{expected[1]} of "
                                   f"{expected[0]} bytes was posted")
            item[3] = None
            tail, ready = tail + HEADER, ready - HEADER
        n = min(ready, buffer.numel() - offset)
        ring.copy(tail, buffer[offset:offset + n], into_ring=False)
        item[1] = offset + n
        ring.counters[TAIL] = tail + n  # after the reads: the sender may reuse the space
        if self.futex:
            self.futex.wake(ring.address(TAIL))
        return offset + n == buffer.numel()

    def wait_for(self, work: _Work) -> None:
        """Move data until ``work`` is done; fail naming the peer after ``timeout_s``, or at once if it exited."""
        backoff, checked = Backoff(self.spin_s), 0.0
        # where ranks outnumber the cores, sleep until the peer moves the counter this work waits on: a receive
        # on the head of the peer's ring, a send held back on the tail of its own (or 10 ms pass)
        ring = self.rings[(self.me, work.peer) if work.sending else (work.peer, self.me)]
        counter = TAIL if work.sending else HEAD
        while True:
            seen = int(ring.counters[counter])  # read before looking: no wake-up is missed
            self.progress()
            if work.done:
                return
            elapsed = backoff.elapsed
            if elapsed > self.timeout_s:
                self._unlink_unshared()
                raise ShmTimeout(f"shared-memory point-to-point: {late_ranks([work.peer])} did not arrive "
                                 f"within {self.timeout_s:g} s", [work.peer])
            if elapsed - checked > 1.0:
                checked = elapsed
                self._check_alive(work.peer)
            if self.futex:
                self.futex.wait(ring.address(counter), seen, 0.01)
            else:
                backoff.pause()

    def _check_alive(self, peer: int) -> None:
        """Fail if ``peer``'s process (its pid, written into every ring it mapped) has exited."""
        for (src, dst), ring in self.rings.items():
            if peer in (src, dst):
                pid = int(ring.counters[SENDER_PID if src == peer else RECEIVER_PID])
                if pid and not os.path.exists(f"/proc/{pid}"):
                    raise RuntimeError(f"rank {peer} (process {pid}) exited")
