"""The single door for every collective: :class:`Comm`, one per mesh dimension (its autograd-aware
conjugate pairs are in :mod:`.autograd`).

``Comm`` wraps one process group. Each call is recorded in the :class:`CommLedger` and, when a timeline
is enabled, as a ``comm`` span from issue to completion (asynchronous calls included). A group of one
rank makes every call a no-op with no record, so single-process reference code runs the same path.
A failing collective raises :class:`CommError` naming the rank, the collective and the last calls; when peers
did not arrive (the shared-memory flags say which, or their heartbeat went silent: :mod:`.liveness`), it names
them instead, as ``rank R did not arrive at ...``. Every wait ends at the group's timeout (the run's ``--timeout``).
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

from parallelisms.comm.arrivals import RECEIVE, Arrivals
from parallelisms.comm.ledger import CommLedger, ring_bytes_per_rank
from parallelisms.comm.liveness import dead_ranks, lagging_ranks, late_ranks, silent_ranks
from parallelisms.comm.trace import Timeline


# torch >= 2.11 names them *_single; older releases only have the *_tensor spelling.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# CPU sums at least this large may use shared memory between ranks of one host (PARALLELISMS_SHM=0 turns it off)
SHM_MIN_BYTES = int(os.environ.get("PARALLELISMS_SHM_MIN_BYTES", 1 << 20))
# CPU collectives through shared memory move at most this many bytes per rank at a time (0: gloo instead)
SHM_CHUNK_BYTES = int(os.environ.get("PARALLELISMS_SHM_CHUNK_BYTES", 1 << 18))
# the reductions the shared-memory all-reduce and reduce-scatter carry (others, such as products, stay on gloo)
SHM_REDUCTIONS = {dist.ReduceOp.SUM: torch.sum, dist.ReduceOp.MAX: torch.amax, dist.ReduceOp.MIN: torch.amin}
_A2A_SLOT = object()  # an all-to-all's slot: fixed, since each rank's share of it differs (uneven splits)


class CommError(RuntimeError):
    """A collective failed or timed out; the message names the rank (or the peers that did not arrive), the
    call and the recent history."""


def group_timeout_s(group) -> float:
    """The collective timeout of ``group`` in seconds: the one ``init_process_group`` was given, which
    ``DeviceMesh`` groups inherit (torch's default where the backend does not say)."""
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout.total_seconds()
        except (AttributeError, RuntimeError):
            continue
    return dist.default_pg_timeout.total_seconds()


class Pending:
    """An asynchronous collective. ``wait()`` blocks (recorded as a ``wait`` span) and returns the result."""

    def __init__(self, comm: "Comm", works: list, result=None, label: str = "", issued: int | None = None,
                 then=None, arrivals=()):
        self.comm, self.works, self.result, self.label = comm, works, result, label
        self.arrivals = arrivals  # this call's arrival notes: the wait's start is when the rank blocked
        self.issued = issued  # set when completion cannot be observed: the comm span then ends at the wait
        self.then = then      # run once, after completion (e.g. keep this rank's slice of an all-reduce)

    def wait(self):
        if self.arrivals:
            Arrivals.blocked(self.arrivals)
        timeline = self.comm.timeline
        start = timeline.now() if timeline.enabled else 0
        began = Timeline.now()
        try:
            for work in self.works:
                work.wait()
        except RuntimeError as exc:
            raise self.comm.error(self.label, exc) from exc
        self.comm.ledger.waited_ns += Timeline.now() - began
        if timeline.enabled:
            end = timeline.now()
            timeline.add(f"wait {self.label}", "wait", start, end)
            if self.issued is not None:
                timeline.add(self.label, "comm", self.issued, end, dim=self.comm.name)
        if self.then is not None:
            self.then, then = None, self.then
            then()
        return self.result


def _on_completion(work, callback) -> bool:
    """Run ``callback`` when ``work`` completes; False where the backend cannot say (gloo point-to-point)."""
    try:
        work.get_future().then(lambda _: callback())
    except RuntimeError:
        return False
    return True


class Comm:
    """Collectives over one mesh dimension ``name`` (its process group ``group``; ``None`` means one rank)."""

    def __init__(self, name: str, group=None, ledger: CommLedger | None = None, timeline: Timeline | None = None):
        self.name, self.group = name, group
        self.ledger = ledger if ledger is not None else CommLedger()
        self.timeline = timeline if timeline is not None else Timeline(enabled=False)
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self._one_host = None  # whether shared memory can carry the group's collectives: None until decided
        self._shm = None       # the queued shared-memory all-reduce (DDP's buckets), made on first use
        self._shm_now = None   # the shared-memory collectives run in the caller's thread (blocking calls)
        self._p2p = None  # the shared-memory point-to-point transport, likewise
        self.timeout_s = group_timeout_s(group) if group is not None else dist.default_pg_timeout.total_seconds()
        self._identity = None  # (name, group name, member global ranks): the group's key in the arrival notes

    def close(self) -> None:
        """Stop this Comm's shared-memory transports (their worker thread, their mappings)."""
        for shm in (self._shm, self._shm_now):
            if shm:
                shm.close()
        self._shm = self._shm_now = self._p2p = None

    def __deepcopy__(self, memo) -> "Comm":
        """A handle on a process group, not data: a copied module (DualPipe's second copy of a stage) talks over
        the same group and records into the same ledger."""
        return self

    def identity(self) -> tuple:
        """The group as every member names it: this Comm's name, the process group's name and its global ranks."""
        if self._identity is None:
            self._identity = (self.name, getattr(self.group, "group_name", ""),
                              tuple(dist.get_process_group_ranks(self.group)))
        return self._identity

    def global_rank(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def error(self, what: str, exc: BaseException) -> CommError:
        """The CommError for ``exc``: names the peers that did not arrive where the shared-memory flags or the
        heartbeats (a rank silent for half the timeout is stopped or dead) tell, else this rank."""
        me = dist.get_rank() if dist.is_initialized() else 0
        cause = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
        history = f"last collectives: {self.ledger.tail()}"
        members = dist.get_process_group_ranks(self.group) if self.group is not None else [me]
        peers = range(dist.get_world_size()) if dist.is_initialized() else []
        dead = dead_ranks([r for r in peers if r != me])
        if dead:  # a peer's process has exited: it is dead, whatever its last heartbeat said
            late = [r for r in dead if r in members] or sorted(dead)
            return CommError(f"{late_ranks(late)} did not arrive at {what} over '{self.name}' (rank {me} waited; "
                             + ", ".join(f"rank {r} is dead: its process {dead[r]} on this host has exited"
                                         for r in late) + f"); {history}")
        silent = silent_ranks([r for r in peers if r != me], older_than_s=max(1.0, self.timeout_s / 2))
        entered = self.ledger.collectives.get(self.name, 0)
        lagging = {} if silent else lagging_ranks([r for r in members if r != me], self.name, entered)
        late = (list(getattr(exc, "late", [])) or [r for r in silent if r in members] or sorted(silent)
                or sorted(lagging))
        if not late:
            return CommError(f"rank {me}: {what} over '{self.name}' (group rank {self.rank} of {self.size}) "
                             f"failed: {cause}; {history}")
        quiet = ", ".join(f"rank {r} for {silent[r]:.1f} s" for r in late if r in silent)
        behind = ", ".join(f"rank {r} at its collective #{lagging[r]}" for r in late if r in lagging)
        why = (f"no heartbeat from {quiet}: stopped or dead" if quiet else
               f"alive but behind: {behind} over '{self.name}', this rank at #{entered}" if behind else cause)
        return CommError(f"{late_ranks(late)} did not arrive at {what} over '{self.name}' within "
                         f"{self.timeout_s:g} s (rank {me} waited; {why}); {history}")

    def _run(self, kind: str, tensor: torch.Tensor, full_numel: int, launch, async_op: bool, result=None,
             sent_bytes: float | None = None, then=None):
        """Record, launch and (unless ``async_op``) wait for one collective; returns result or Pending.

        ``launch()`` returns a work or a list of works; ``then`` runs after they complete."""
        nbytes = full_numel * tensor.element_size()
        sent = ring_bytes_per_rank(kind, nbytes, self.size) if sent_bytes is None else sent_bytes
        self.ledger.add(kind, self.name, self.size, tensor.dtype, full_numel, sent)
        arrival = self.ledger.arrivals.collective(self.name, self.identity(), blocking=not async_op)
        label = f"{kind} {full_numel}x{str(tensor.dtype).removeprefix('torch.')}"
        timeline = self.timeline
        start = timeline.now() if timeline.enabled else 0
        began = Timeline.now()
        try:
            works = launch()  # None: done already (in this thread)
            works = [] if works is None else works if isinstance(works, list) else [works]
            if not async_op:
                for work in works:
                    work.wait()
        except RuntimeError as exc:
            raise self.error(label, exc) from exc
        if not async_op:
            self.ledger.waited_ns += Timeline.now() - began
        issued = None
        if timeline.enabled:
            if not async_op:  # a blocking collective: the rank waited all along (exposed unless other work ran)
                end = timeline.now()
                timeline.add(label, "comm", start, end, dim=self.name, bytes=sent)
                timeline.add(f"wait {label}", "wait", start, end)
            elif not _on_completion(works[-1], lambda: timeline.add(label, "comm", start, timeline.now(),
                                                                       dim=self.name)):
                issued = start
        if async_op:
            return Pending(self, works, result, label, issued, then, (arrival,) if arrival is not None else ())
        if then is not None:
            then()
        return result

    # -- collectives ---------------------------------------------------------------------------------
    # On CPU tensors (gloo) all-gather and reduce-scatter avoid gloo's emulations, which allocate full-size
    # temporaries (two per all-gather, one per reduce-scatter, seen under the allocator profiler) and free
    # them on a communication thread. The all-gather is N asynchronous in-place broadcasts, rank i's shard
    # into its slice of the output (8 MB gathered: 3.5 ms against 5.0 at 2 ranks, 7.3 against 10.9 at 4,
    # 17.6 against 26.3 at 8); the reduce-scatter of a tensor the caller gives up (``scratch``) is an in-place
    # all-reduce keeping this rank's slice (10.6 against 13.6 ms at 2 ranks). The ledger records them as the
    # collectives they implement, with the ring's logical bytes.

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False,
                   shared_memory: bool = False):
        """In-place all-reduce of ``tensor``; returns it (or a Pending). A blocking CPU sum between ranks of one
        host goes through shared memory (:mod:`parallelisms.comm.shm`); an asynchronous one too where the caller
        opts in with ``shared_memory`` and it has SHM_MIN_BYTES or more (DDP's buckets)."""
        if self.size == 1:
            return _Done(tensor) if async_op else tensor
        queued = shared_memory and tensor.numel() * tensor.element_size() >= SHM_MIN_BYTES

        def launch():
            shm = self._collectives(tensor, tensor, op, in_this_thread=not async_op) if queued or not async_op else None
            if shm is None:
                return dist.all_reduce(tensor, op=op, group=self.group, async_op=True)
            reduce = SHM_REDUCTIONS[op]
            return shm.submit(shm.all_reduce_now, tensor, reduce) if async_op else shm.all_reduce_now(tensor, reduce)
        return self._run("all_reduce", tensor, tensor.numel(), launch, async_op, tensor)

    def _on_one_host(self) -> bool:
        """Whether shared memory can carry this group's collectives (decided once, by a collective, at the
        first call that could use it: every rank reaches the same call)."""
        if self._one_host is None:
            from parallelisms.comm.shm import shm_supported
            self._one_host = shm_supported(self.group)
        return self._one_host

    def _collectives(self, tensor: torch.Tensor, slot: torch.Tensor, op=dist.ReduceOp.SUM,
                     in_this_thread: bool = False):
        """The group's shared-memory collectives (:mod:`parallelisms.comm.shm`) for a CPU sum (or maximum, minimum:
        :data:`SHM_REDUCTIONS`) or gather between ranks of one host, else None. ``slot``: what each rank puts in (a
        sum's tensor, a gather's shard), moved SHM_CHUNK_BYTES at a time (0: never), or ``_A2A_SLOT`` (an
        all-to-all's). Blocking calls run
        ``in_this_thread``: no hand-off to gloo's threads, which wait for a core when every core computes;
        asynchronous ones on the instance's worker."""
        if (tensor.device.type != "cpu" or op not in SHM_REDUCTIONS or not tensor.is_contiguous()
                or SHM_CHUNK_BYTES <= 0 or not self._on_one_host()):
            return None
        name = "_shm_now" if in_this_thread else "_shm"
        if getattr(self, name) is None:
            from parallelisms.comm.shm import SharedMemoryCollectives
            setattr(self, name, SharedMemoryCollectives(self.group, self.rank, self.size, self.timeout_s,
                                                        inline=in_this_thread, chunk_bytes=SHM_CHUNK_BYTES))
        shm = getattr(self, name)
        if slot is _A2A_SLOT:  # the same fixed slot on every rank, whatever each sends
            return shm if shm.fits(shm.all_to_all_slot_bytes()) else None
        return shm if shm.fits(min(slot.numel() * slot.element_size(), SHM_CHUNK_BYTES)) else None

    def all_gather(self, tensor: torch.Tensor, dim: int = 0, async_op: bool = False, out: torch.Tensor | None = None):
        """Concatenate every rank's ``tensor`` along ``dim`` (``out``, if given, is the dim-0 result buffer)."""
        if self.size == 1:
            return _Done(tensor) if async_op else tensor
        tensor = tensor.contiguous()
        if dim != 0:
            stacked = self.all_gather(tensor, dim=0)
            gathered = torch.cat(stacked.view(self.size, *tensor.shape).unbind(0), dim=dim)
            return _Done(gathered) if async_op else gathered
        if out is None:
            out = tensor.new_empty((self.size * tensor.shape[0], *tensor.shape[1:]))
        return self._run("all_gather", tensor, out.numel(), lambda: self._launch_gather(out, tensor, async_op),
                         async_op, out)

    def _launch_gather(self, out: torch.Tensor, tensor: torch.Tensor, async_op: bool):
        shm = self._collectives(out, tensor, in_this_thread=not async_op)
        if shm is not None:
            return shm.submit(shm.all_gather_now, out, tensor) if async_op else shm.all_gather_now(out, tensor)
        if tensor.device.type != "cpu":
            return _all_gather_single(out, tensor, group=self.group, async_op=True)
        slices = out.view(self.size, -1).unbind(0)
        slices[self.rank].copy_(tensor.view(-1))
        return [dist.broadcast(piece, self.global_rank(i), group=self.group, async_op=True)
                for i, piece in enumerate(slices)]

    def reduce_scatter(self, tensor: torch.Tensor, dim: int = 0, async_op: bool = False,
                       out: torch.Tensor | None = None, op=dist.ReduceOp.SUM, scratch: bool = False):
        """Sum ``tensor`` over ranks and keep this rank's 1/N slice along ``dim``.

        ``scratch``: the caller gives up ``tensor``'s contents, which lets CPU tensors be reduced in place."""
        if self.size == 1:
            return _Done(tensor) if async_op else tensor
        if dim != 0:
            chunks = tensor.chunk(self.size, dim=dim)
            tensor = torch.cat(chunks, dim=0)  # rank i's slice becomes the i-th dim-0 block
            shard = self.reduce_scatter(tensor, op=op, scratch=True)
            return _Done(shard) if async_op else shard
        tensor = tensor.contiguous()
        if out is None:
            out = tensor.new_empty((tensor.shape[0] // self.size, *tensor.shape[1:]))
        if tensor.device.type != "cpu":
            launch = lambda: _reduce_scatter_single(out, tensor, op=op, group=self.group, async_op=True)
            return self._run("reduce_scatter", tensor, tensor.numel(), launch, async_op, out)
        shm = self._collectives(tensor, tensor, op, in_this_thread=not async_op)
        if shm is not None:
            reduce = SHM_REDUCTIONS[op]
            launch = ((lambda: shm.submit(shm.reduce_scatter_now, out, tensor, reduce)) if async_op else
                      (lambda: shm.reduce_scatter_now(out, tensor, reduce)))
            return self._run("reduce_scatter", tensor, tensor.numel(), launch, async_op, out)
        summed = tensor if scratch else tensor.clone()
        mine = summed.view(self.size, -1)[self.rank]
        return self._run("reduce_scatter", tensor, tensor.numel(),
                         lambda: dist.all_reduce(summed, op=op, group=self.group, async_op=True), async_op, out,
                         then=lambda: out.view(-1).copy_(mine))

    def all_to_all(self, tensor: torch.Tensor, output_splits: list[int] | None = None,
                   input_splits: list[int] | None = None, async_op: bool = False):
        """Rank i sends the i-th dim-0 block of ``tensor`` (even, or sized by ``input_splits``) to rank i."""
        if self.size == 1:
            return _Done(tensor) if async_op else tensor
        tensor = tensor.contiguous()
        rows = tensor.shape[0]
        out_rows = rows if output_splits is None else sum(output_splits)
        out = tensor.new_empty((out_rows, *tensor.shape[1:]))
        row_bytes = math.prod(tensor.shape[1:]) * tensor.element_size()  # also when this rank sends no row
        kept = (input_splits[self.rank] if input_splits is not None else rows // self.size)
        shm = self._collectives(tensor, _A2A_SLOT, in_this_thread=not async_op)
        if shm is not None:  # between ranks of one host: through shared memory, in bytes per block
            sends = [n * row_bytes for n in (input_splits or [rows // self.size] * self.size)]
            receives = [n * row_bytes for n in (output_splits or [rows // self.size] * self.size)]
            args = (out, tensor, sends, receives)
            launch = (lambda: shm.submit(shm.all_to_all_now, *args)) if async_op else lambda: shm.all_to_all_now(*args)
        else:
            launch = lambda: dist.all_to_all_single(out, tensor, output_splits, input_splits, group=self.group,  # noqa: E731
                                                    async_op=True)
        return self._run("all_to_all", tensor, tensor.numel(), launch, async_op, out,
                         sent_bytes=(rows - kept) * row_bytes)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False):
        """In-place broadcast from group rank ``src``."""
        if self.size == 1:
            return _Done(tensor) if async_op else tensor
        return self._run("broadcast", tensor, tensor.numel(),
                         lambda: dist.broadcast(tensor, src=self.global_rank(src), group=self.group, async_op=True),
                         async_op, tensor)

    def all_gather_object(self, obj) -> list:
        """Every rank's picklable ``obj`` (reports, not training; recorded with unknown size)."""
        if self.size == 1:
            return [obj]
        self.ledger.add("all_gather_object", self.name, self.size, "object", 0, 0.0)
        out = [None] * self.size
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except RuntimeError as exc:
            raise self.error("all_gather_object", exc) from exc
        return out

    def send_recv(self, sends: list[tuple[torch.Tensor, int]] = (), recvs: list[tuple[torch.Tensor, int]] = ()) -> Pending:
        """Batched point-to-point: each (tensor, group peer) send and receive issued together; wait the result."""
        if not sends and not recvs:
            return _Done(None)
        for kind, items in (("send", sends), ("recv", recvs)):
            for t, _ in items:
                self.ledger.add(kind, self.name, self.size, t.dtype, t.numel(),
                                ring_bytes_per_rank(kind, t.numel() * t.element_size(), self.size))
        me, arrivals = dist.get_rank(), self.ledger.arrivals
        notes = [arrivals.transfer(self.name, me, self.global_rank(p), receiving=False) for _, p in sends]
        notes = [n for n in notes + [arrivals.transfer(self.name, self.global_rank(p), me, receiving=True)
                                     for _, p in recvs] if n is not None and n[0] == RECEIVE]
        label = f"p2p {len(sends)} send {len(recvs)} recv"
        start = self.timeline.now() if self.timeline.enabled else 0
        try:
            works = self._point_to_point(sends, recvs)
        except RuntimeError as exc:
            raise self.error(label, exc) from exc
        timeline = self.timeline
        observed = timeline.enabled and _on_completion(
            works[-1], lambda: timeline.add(label, "comm", start, timeline.now(), dim=self.name))
        return Pending(self, works, None, label, start if timeline.enabled and not observed else None,
                       arrivals=notes)


    def _point_to_point(self, sends, recvs) -> list:
        """Issue the sends and receives: through shared memory where every peer shares this host and the tensors
        are on the CPU (:mod:`parallelisms.comm.shm_p2p`), else as one gloo/NCCL batch."""
        peers = [self.global_rank(p) for _, p in (*sends, *recvs)]
        transport = self._shared_memory_p2p()
        if transport and all(t.device.type == "cpu" for t, _ in (*sends, *recvs)) and all(map(transport.carries, peers)):
            return ([transport.send(t.contiguous(), peer) for (t, _), peer in zip(sends, peers)]
                    + [transport.recv(t, peer) for (t, _), peer in zip(recvs, peers[len(sends):])])
        ops = [dist.P2POp(dist.isend, t, peer, self.group) for (t, _), peer in zip(sends, peers)]
        ops += [dist.P2POp(dist.irecv, t, peer, self.group) for (t, _), peer in zip(recvs, peers[len(sends):])]
        return dist.batch_isend_irecv(ops)

    def _shared_memory_p2p(self):
        """This Comm's shared-memory point-to-point transport, or False (not x86, no /dev/shm, no store, or
        PARALLELISMS_SHM=0); made on first use, without a collective."""
        if self._p2p is None:
            from parallelisms.comm.liveness import default_store
            from parallelisms.comm.shm import shm_machine

            store = default_store()
            self._p2p = False
            if shm_machine() and store is not None:
                from parallelisms.comm.shm_p2p import SharedMemoryP2P
                self._p2p = SharedMemoryP2P(self.name, dist.get_rank(), store, self.timeout_s)
        return self._p2p


class _Done:
    """A completed operation with the Pending interface (for one-rank groups)."""

    def __init__(self, result):
        self.result = result

    def wait(self):
        return self.result


class Comms:
    """The :class:`Comm` of every mesh dimension, sharing one ledger and one timeline.

    ``meshes`` maps dimension names to 1-D ``DeviceMesh`` objects (:meth:`ParallelDims.build_meshes`);
    a name that is absent, or of size one, gives a one-rank Comm. ``comm_type``: the Comm class (the dry run's
    recording transport, :mod:`.recording`, swaps it).
    """

    comm_type = Comm

    def __init__(self, meshes: dict | None = None, ledger: CommLedger | None = None, timeline: Timeline | None = None):
        self.meshes = meshes or {}
        self.ledger = ledger if ledger is not None else CommLedger()
        self.timeline = timeline if timeline is not None else Timeline(enabled=False)
        self._comms: dict[str, Comm] = {}

    def __getitem__(self, name: str) -> Comm:
        if name not in self._comms:
            group = None
            if name == "world" and dist.is_initialized() and dist.get_world_size() > 1:
                group = dist.group.WORLD
            elif name in self.meshes and self.meshes[name].size() > 1:
                group = self.meshes[name].get_group()
            self._comms[name] = self.comm_type(name, group, self.ledger, self.timeline)
        return self._comms[name]

    def close(self) -> None:
        """After a run, on every rank: wait for every rank to finish with the mesh's groups (one barrier over the
        world, outside any step), stop the shared-memory transports and destroy the groups the meshes made (every
        group but the default one). gloo keeps a transport thread and worker threads per group, which a process
        that trains again (the Python API, the test suite) would otherwise gather: a thousand threads per rank
        after fifty runs, whose timed wake-ups took half the CPU time of a launch that trained fifty layouts."""
        if self.meshes and dist.is_initialized() and dist.get_world_size() > 1:
            device = "cuda" if "nccl" in dist.get_backend() else "cpu"  # NCCL reduces on the rank's GPU only
            with self.ledger.in_phase("teardown"):
                self["world"].all_reduce(torch.zeros(1, device=device))
        for comm in self._comms.values():
            comm.close()
        groups = {group for mesh in self.meshes.values() for group in mesh.get_all_groups()}  # all, before any goes
        for group in groups - {dist.group.WORLD}:
            dist.destroy_process_group(group)
        self._comms, self.meshes = {}, {}
