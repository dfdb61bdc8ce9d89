"""Collectives through shared memory for the ranks of one group that share a host (CPU tensors).

gloo moves an all-reduce through the kernel's loopback TCP: for 11 MB over 2 ranks 13 ms of wall time, 9.2 ms
of it CPU per rank (7.6 ms in the kernel), which on a small machine is taken from compute. Here the ranks
map one shared file (``/dev/shm``) holding a slot per rank, as intra-node transports do (NCCL's SHM, oneCCL,
DeepSpeed's CPU all-reduce): for an all-reduce each rank copies its tensor into its slot, sums its 1/N chunk
over all slots (a reduce-scatter in memory, ranks added in rank order; a maximum or a minimum likewise), and
copies every rank's reduced chunk back (the all-gather); an all-gather or a reduce-scatter is the first half of
that. An all-to-all (expert dispatch and combine, Ulysses) puts each destination's block in its own segment of
the rank's slot, and each rank reads its segment from every other slot (uneven blocks: the slot's first word
tells the peers how many rounds of segments a rank's largest block needs). Each phase is closed by a flag barrier in the same file; slots alternate between two sets so that a call never overwrites what a slower
rank still reads from the previous one. Every rank holds the same bits afterwards.

Two ways to call it, one per instance: queued (``submit``: a background thread runs the calls in issue order,
asynchronous like gloo's: DDP's buckets, the sharded engines' gathers and reduce-scatters), or in the caller's
thread (``*_now``: blocking calls such as tensor parallelism's, where a hand-off to another thread would cost what
the transport saves). Calls move at most ``chunk_bytes`` per rank at a time, so the mapping stays small. A rank that
waits longer than ``timeout_s`` (the group's timeout, the run's ``--timeout``) for its peers fails the call with
:class:`ShmTimeout`, naming the phase and the (global) ranks whose flags did not arrive. The flags rely on x86's
store order (data stores become visible before the flag store after them); other machines keep gloo.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import mmap
import os
import platform
import queue
import re
import socket
import stat
import threading
import time
import uuid

import torch
import torch.distributed as dist

from parallelisms.comm.liveness import late_ranks

FLAG_STRIDE = 8  # int64 per flag: one 64-byte cache line per rank


class Backoff:
    """The pause between two polls of shared memory: yield the core for the first 10 ms where each local rank
    has a core of its own (sleeping at once costs about 60 us a phase, the timer's slack, which took DDP's bucket
    in pieces from 0.95 to 0.99 of torch's time; ranks outnumbering the cores would take turns spinning), then
    sleep, up to 100 us. ``elapsed`` is the time since the wait began; ``spin_s`` comes from :meth:`spin_for` once
    per transport (a wait is too short to ask the system each time: 17 us per call)."""

    def __init__(self, spin_s: float):
        self.start, self.sleep_s, self.spin_s = time.monotonic(), 0.0, spin_s

    @staticmethod
    def spin_for() -> float:
        """Seconds a wait of this process may spin: 10 ms where each local rank has a core of its own, else 0; 0 as
        well under ``PARALLELISMS_SPIN=0``, for a machine whose cores other jobs use (a test suite's other workers):
        there the spinning ranks' turns are cores those jobs wait for."""
        if os.environ.get("PARALLELISMS_SPIN", "1") == "0":
            return 0.0
        return 0.01 if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) <= (os.cpu_count() or 1) else 0.0

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def pause(self) -> None:
        if self.elapsed < self.spin_s:
            os.sched_yield()  # the rank waits anyway; other runnable processes go first
        else:
            time.sleep(self.sleep_s)
            self.sleep_s = min(1e-4, self.sleep_s + 1e-6)


class Futex:
    """Sleep in the kernel until a 32-bit word of shared memory changes, and wake its sleepers (Linux futex(2) on
    x86-64, shared between processes): where ranks outnumber the cores, a rank whose peers are late gives its
    core to them until one of them publishes, instead of waking every few microseconds to look (at 8 ranks on 2
    cores that polling cost each rank about 2,000 context switches a step)."""

    SYSCALL, WAIT, WAKE = 202, 0, 1

    class _Timespec(ctypes.Structure):
        _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

    def __init__(self):
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.syscall.restype = ctypes.c_long

    def wait(self, address: int, expected: int, timeout_s: float) -> None:
        """Sleep while the word at ``address`` holds ``expected`` (its low 32 bits), at most ``timeout_s``."""
        timeout = self._Timespec(int(timeout_s), int(timeout_s % 1 * 1e9))
        self.libc.syscall(ctypes.c_long(self.SYSCALL), ctypes.c_void_p(address), ctypes.c_int(self.WAIT),
                          ctypes.c_uint32(expected & 0xFFFFFFFF), ctypes.byref(timeout), None, ctypes.c_int(0))

    def wake(self, address: int) -> None:
        """Wake every process sleeping on the word at ``address``."""
        self.libc.syscall(ctypes.c_long(self.SYSCALL), ctypes.c_void_p(address), ctypes.c_int(self.WAKE),
                          ctypes.c_int(2**31 - 1), None, None, ctypes.c_int(0))


def shm_machine() -> bool:
    """True where this process may move data through shared memory: x86 (the flags' store order), /dev/shm,
    and not turned off (``PARALLELISMS_SHM=0``)."""
    return (platform.machine() in ("x86_64", "AMD64") and os.path.isdir("/dev/shm")
            and os.environ.get("PARALLELISMS_SHM", "1") != "0")


def shm_path(name: str) -> str:
    """The /dev/shm file ``name`` of this rank's launch: named after the run id that torch's elastic agent gives
    every rank (``TORCHELASTIC_RUN_ID``), so the launcher removes what a rank killed between creating a file and
    unlinking it leaves behind (:func:`remove_run_files`). ``name`` carries a random token of the group's
    (unguessable; :func:`open_shared` refuses a file someone else made under it all the same)."""
    run = re.sub(r"[^0-9A-Za-z]", "", os.environ.get("TORCHELASTIC_RUN_ID", ""))
    return f"/dev/shm/parallelisms-{run}-{name}" if run else f"/dev/shm/parallelisms-{name}"


class ShmRefused(RuntimeError):
    """A shared-memory file that this run did not make (another user's, a link, another kind of file)."""


def open_shared(path: str, size: int, create: bool) -> torch.Tensor:
    """``size`` bytes of the /dev/shm file ``path`` mapped shared, as a uint8 tensor (which keeps the mapping).
    ``create``: make it, ``O_CREAT|O_EXCL`` (a file already there, anyone's, is refused), else open the one a peer
    made, or make it where none is there yet (``create=None``: whichever end comes first). Opened with
    ``O_NOFOLLOW`` (a symbolic link is refused), then checked on the descriptor (a regular file of this user, no
    access for others) and mapped from it, so the file checked is the file mapped."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        if create is False:
            fd = os.open(path, flags)
        else:
            try:
                fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                if create:
                    raise
                fd = os.open(path, flags)
    except OSError as exc:
        kind = ("is a symbolic link" if os.path.islink(path) else
                "exists already, made by another process" if isinstance(exc, FileExistsError) else
                f"cannot be opened ({exc.strerror})")
        raise ShmRefused(f"shared-memory file {path} {kind}: refused (another user may be reading or changing this "
                         f"run's data; remove the file or find who made it)") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise ShmRefused(f"shared-memory file {path} is not this run's (owner uid {st.st_uid}, mode "
                             f"{stat.filemode(st.st_mode)}; this run is uid {os.geteuid()}, mode -rw-------): refused")
        if st.st_size < size:
            os.ftruncate(fd, size)
        mapping = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    return torch.frombuffer(mapping, dtype=torch.uint8)


def unlink_own(path: str) -> None:
    """Unlink ``path`` if it is a regular file of this user (not someone else's file under a run's name)."""
    with contextlib.suppress(FileNotFoundError):  # a rank of the run unlinked it meanwhile
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
            os.unlink(path)


def remove_run_files(run_id: str) -> None:
    """Unlink the /dev/shm files of run ``run_id`` (its ranks have ended)."""
    for path in glob.glob(f"/dev/shm/parallelisms-{run_id}-*"):
        unlink_own(path)


def shm_supported(group) -> bool:
    """True when shared memory can carry this group's all-reduces: :func:`shm_machine` and every rank on this
    host (a collective over ``group``)."""
    hosts = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    return shm_machine() and len(set(hosts)) == 1


class ShmTimeout(RuntimeError):
    """Peers did not reach a phase in time; ``late`` holds their global ranks."""

    def __init__(self, message: str, late: list[int]):
        super().__init__(message)
        self.late = late


class ShmWork:
    """The handle of one queued call: ``wait()`` blocks until it ran (and re-raises its failure)."""

    def __init__(self):
        self.done, self.failure, self.tensors = threading.Event(), None, None

    def wait(self) -> bool:
        self.done.wait()
        self.tensors = None  # the call's tensors, released here in the caller's thread
        if self.failure is not None:
            raise self.failure
        return True

    def get_future(self):
        raise RuntimeError("completion is not observable")  # the timeline closes the span at the wait


class SharedMemoryCollectives:
    """Sums and gathers over ``group`` (rank ``rank`` of ``size``) through one shared file per capacity."""

    def __init__(self, group, rank: int, size: int, timeout_s: float = 300.0, inline: bool = False,
                 chunk_bytes: int = 1 << 18):
        self.group, self.rank, self.size, self.timeout_s = group, rank, size, timeout_s
        self.spin_s = Backoff.spin_for()
        self.futex = None if self.spin_s else Futex()  # ranks outnumber the cores: sleep until peers publish
        self.chunk_bytes = chunk_bytes  # the most bytes per slot a call moves at a time
        self.inline = inline  # calls run in the caller's thread (``*_now``), else queued to a worker thread
        token = [uuid.uuid4().hex if rank == 0 else None]
        dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0), group=group)
        self.prefix = shm_path(token[0])
        self.capacity, self.generation, self.calls, self.arrivals = 0, 0, 0, 0
        self.too_large = float("inf")  # the smallest size found not to fit in /dev/shm
        self.jobs: queue.Queue = queue.Queue()
        if not inline:
            threading.Thread(target=self._serve, daemon=True).start()

    # -- the caller's side (main thread, same order on every rank) ---------------------------------------------
    def fits(self, nbytes: int) -> bool:
        """Whether a slot of ``nbytes`` (a piece of a call) can go through shared memory, growing the mapping if
        /dev/shm has room on every rank (a collective when it must grow; a small /dev/shm keeps gloo instead)."""
        if nbytes <= self.capacity:
            return True
        if nbytes >= self.too_large:
            return False
        capacity = -(-max(nbytes, 2 * self.capacity) // 64) * 64
        stats = os.statvfs("/dev/shm")
        room = torch.tensor([int(stats.f_bavail * stats.f_frsize >= 2 * self._bytes(capacity))])
        dist.all_reduce(room, op=dist.ReduceOp.MIN, group=self.group)
        if not room.item():
            self.too_large = nbytes
            return False
        self._grow(capacity)
        return True

    def _bytes(self, capacity: int) -> int:
        return 64 * self.size + 2 * self.size * capacity

    def submit(self, call, *args) -> ShmWork:
        """Queue ``call(*args)``, one of the ``*_now`` calls below, for the worker thread (an instance used so
        makes no call in the caller's thread); :meth:`fits` its slot first."""
        work = ShmWork()
        work.tensors = args  # released with the handle, by the caller's thread (the allocator profiler sees it)
        self.jobs.put((call, args, work))
        return work

    # -- the calls (in the caller's thread, or the worker's when submitted) ----------------------------------
    # Each call moves at most ``chunk_bytes`` per slot at a time (pieces one after the other), so the mapping, held
    # from the first call on and counted in the rank's memory, stays 2 x N x ``chunk_bytes`` whatever the sizes.
    def all_reduce_now(self, tensor: torch.Tensor, reduce=torch.sum) -> None:
        """Sum ``tensor`` (contiguous, CPU) over the group in place (or ``reduce`` it: ``torch.amax``, the
        vocabulary-parallel loss's row maxima; ``torch.amin``)."""
        for piece in tensor.view(-1).split(self._width(tensor, 1)):
            self._run(piece, self._next_call(), reduce)

    def all_gather_now(self, out: torch.Tensor, shard: torch.Tensor) -> None:
        """Every rank's ``shard`` into its 1/N of ``out`` (contiguous, CPU), in rank order."""
        flat, rows, width = shard.view(-1), out.view(self.size, -1), self._width(shard, 1)
        for start in range(0, flat.numel(), width):
            piece = flat[start:start + width]
            slots = self._slots(self._next_call(), piece)
            slots[self.rank].copy_(piece)
            self._arrive("copy-in")
            rows[:, start:start + piece.numel()].copy_(slots)

    def reduce_scatter_now(self, out: torch.Tensor, tensor: torch.Tensor, reduce=torch.sum) -> None:
        """This rank's 1/N of the sum (or ``reduce``) of ``tensor`` over the group into ``out``, ranks added in
        rank order."""
        blocks, mine, width = tensor.view(self.size, -1), out.view(-1), self._width(tensor, self.size)
        for start in range(0, mine.numel(), width):
            piece = blocks[:, start:start + width]  # every destination's next columns: [size, w]
            w = piece.shape[1]
            slots = self._slots(self._next_call(), piece)
            slots[self.rank].view(self.size, w).copy_(piece)
            self._arrive("copy-in")
            reduce(slots[:, self.rank * w:(self.rank + 1) * w], dim=0, out=mine[start:start + w])

    def all_to_all_slot_bytes(self) -> int:
        """The slot an all-to-all uses: a 64-byte header and a segment per destination (the chunk over the ranks,
        at least 64 bytes)."""
        return 64 + self.size * max(64, (self.chunk_bytes - 64) // self.size // 64 * 64)

    def all_to_all_now(self, out: torch.Tensor, tensor: torch.Tensor, sends: list[int], receives: list[int]) -> None:
        """Rank i's block j of ``tensor`` into block i of rank j's ``out`` (contiguous, CPU): ``sends[j]`` and
        ``receives[i]`` bytes, each rank knowing only its own. A round moves up to ``w`` bytes of every block,
        each destination's in its own segment of the slot (``w`` = the chunk over the ranks: the same on every
        rank); the slot's first word says how many rounds this rank's sends need, so that after the first
        round every rank knows how many to run (the most any rank needs)."""
        source, sink = tensor.reshape(-1).view(torch.uint8), out.reshape(-1).view(torch.uint8)
        sent_at = [sum(sends[:j]) for j in range(self.size)]        # where block j starts in ``tensor``
        received_at = [sum(receives[:i]) for i in range(self.size)]  # where block i lands in ``out``
        me, width = self.rank, (self.all_to_all_slot_bytes() - 64) // self.size
        sink[received_at[me]:received_at[me] + receives[me]].copy_(source[sent_at[me]:sent_at[me] + sends[me]])
        needed = max([-(-b // width) for j, b in enumerate(sends) if j != me], default=0)
        rounds, done = 1, 0  # one round at least: it carries every rank's count
        while done < rounds:
            slots = self.slots[self._next_call() % 2, :, :64 + self.size * width]
            slots[me, :8].view(torch.int64)[0] = needed
            lo = done * width
            for j in range(self.size):  # this round's piece of every block, each in its destination's segment
                hi = min(lo + width, sends[j])
                if j != me and hi > lo:
                    slots[me, 64 + j * width:64 + j * width + hi - lo].copy_(source[sent_at[j] + lo:sent_at[j] + hi])
            self._arrive("copy-in")
            if done == 0:
                rounds = max(1, int(slots[:, :8].view(torch.int64).max()))
            for i in range(self.size):  # and this rank's segment of every other slot
                hi = min(lo + width, receives[i])
                if i != me and hi > lo:
                    sink[received_at[i] + lo:received_at[i] + hi].copy_(slots[i, 64 + me * width:64 + me * width + hi - lo])
            done += 1

    def _width(self, tensor: torch.Tensor, rows: int) -> int:
        """Elements per row of a piece, so that ``rows`` rows of them fill at most ``chunk_bytes``."""
        return max(1, self.chunk_bytes // (rows * tensor.element_size()))

    def _next_call(self) -> int:
        self.calls += 1
        return self.calls - 1

    def _slots(self, call: int, tensor: torch.Tensor) -> torch.Tensor:
        """The slot set of ``call`` as ``[size, numel]`` of ``tensor``'s dtype."""
        return self.slots[call % 2, :, :tensor.numel() * tensor.element_size()].view(tensor.dtype)

    def _grow(self, capacity: int) -> None:
        """Map a larger file (every rank, once the queued calls have run): two sets of N slots and the flags."""
        if not self.inline:
            drained = ShmWork()
            self.jobs.put((None, (), drained))
            drained.wait()
        path = f"{self.prefix}-{self.generation}"
        total = self._bytes(capacity)
        try:
            memory = open_shared(path, total, create=True) if self.rank == 0 else None
            dist.barrier(group=self.group)
            memory = memory if memory is not None else open_shared(path, total, create=False)
            dist.barrier(group=self.group)
        except BaseException:  # a peer failed before the file was shared: remove it here (torchrun has no
            unlink_own(path)  # launcher of ours to do it); someone else's file under the name stays
            raise
        if self.rank == 0:
            os.unlink(path)  # the mappings keep the memory; nothing is left behind
        # a numpy view: reading and writing the flags allocates nothing (polls run often)
        self.flags = memory[:64 * self.size].view(torch.int64)[::FLAG_STRIDE].numpy()
        self.flag_addresses = [self.flags[r:].ctypes.data for r in range(self.size)]  # the futex words
        self.slots = memory[64 * self.size:].view(2, self.size, capacity)
        self.capacity, self.generation, self.calls, self.arrivals = capacity, self.generation + 1, 0, 0

    # -- the worker thread -----------------------------------------------------------------------------------
    def close(self) -> None:
        """End the worker thread (after the calls queued before) and let go of the mapping."""
        if not self.inline:
            self.jobs.put(None)
        self.slots = self.flags = None

    def _serve(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            call, args, work = job
            del job  # else the queued tuple keeps the call's tensors alive here until the next call arrives
            try:
                if call is not None:
                    call(*args)
                del call, args  # the worker keeps no tensor of a finished call alive
            except ShmTimeout as exc:  # reported to the waiter, who raises it naming the ranks
                work.failure = exc
            except Exception as exc:
                work.failure = RuntimeError(f"{exc.__class__.__name__}: {exc}")
            work.done.set()
            del work

    def _run(self, tensor: torch.Tensor, call: int, reduce=torch.sum) -> None:
        flat, n, size = tensor.view(-1), tensor.numel(), self.size
        slots = self._slots(call, tensor)
        bounds = [c * n // size for c in range(size + 1)]
        slots[self.rank].copy_(flat)
        self._arrive("copy-in")
        lo, hi = bounds[self.rank], bounds[self.rank + 1]
        reduce(slots[:, lo:hi], dim=0, out=flat[lo:hi])
        slots[self.rank, lo:hi].copy_(flat[lo:hi])
        self._arrive("reduce")
        for c in range(size):
            if c != self.rank:
                flat[bounds[c]:bounds[c + 1]].copy_(slots[c, bounds[c]:bounds[c + 1]])

    def _arrive(self, phase: str) -> None:
        """Publish this rank's progress and wait until every rank has arrived as often (the same calls, in
        order, on every rank)."""
        self.arrivals += 1
        value = self.arrivals
        self.flags[self.rank] = value
        if self.futex:
            self.futex.wake(self.flag_addresses[self.rank])
        backoff = Backoff(self.spin_s)
        while int(self.flags.min()) < value:
            if backoff.elapsed > self.timeout_s:
                late = [dist.get_global_rank(self.group, r) for r in range(self.size) if int(self.flags[r]) < value]
                raise ShmTimeout(f"shared memory: {late_ranks(late)} did not arrive at {phase} "
                                 f"within {self.timeout_s:g} s", late)
            if self.futex:  # sleep on the furthest-behind rank's flag until it changes (or 10 ms pass)
                behind = int(self.flags.argmin())
                self.futex.wait(self.flag_addresses[behind], int(self.flags[behind]), 0.01)
            else:
                backoff.pause()
