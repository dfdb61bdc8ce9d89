"""The communication half of ``parallelisms calibrate`` (perf/calibrate.py): the comm layer's collectives
between two ranks, and what a collective costs a rank's CPU beyond them where ranks share cores or overlap
collectives with compute.

* Collectives: two ranks over the project's comm layer (gloo, or shared memory where the runtime uses it: the
  all-reduce as DDP's gradient buckets call it), each kind over message sizes, medians; alpha and beta fitted
  per kind (Hockney) on the ledger's ring bytes. Each call follows a burst of GEMMs on both ranks, as a
  training step issues them: a collective that meets ranks coming from compute pays more than one in a tight
  loop (the ranks arrive apart; on gloo the comm threads also wake from sleep), and that is the latency a step
  sees. Only the call itself is timed, and the median over the rounds kept (subtracting the burst's mean time
  from the pair's left the noise of two 4 ms means in a sub-millisecond result: alphas from 0 to 1.5 ms).
  ``comm_cpu_fraction``: the share of a large collective's time the rank's own CPU spends on it (process CPU
  time over wall time; gloo copies through the kernel's TCP, shared memory through memcpy): on a CPU that part
  is not hidden by overlapping it with compute, which runs on the same core.
* Ranks outnumbering the cores (``meeting_overhead_us``): pairs of ranks run the ``small`` model's step under
  tensor parallelism 2 with sequence parallelism (56 blocking collectives an iteration), one rank per core and
  then four; the CPU time per iteration grows by what each meeting costs a rank that sleeps until its peer
  arrives while other ranks use its core (:func:`measure_meeting_overhead`; 135-275 us here, where a burst of
  two GEMMs between meetings gave 80-130).
* Overlapped collectives (``overlap_overhead_us``): the CPU an asynchronous call, issued before a burst of GEMMs
  and waited after it, costs the rank beyond the same call blocking after the burst: the comm layer's worker
  thread shares the rank's core with the compute (:func:`measure_overlap_overhead`; 178-276 us here). Only the
  calls' own CPU is counted (their thread's time in them and the other threads'), the burst's left out.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from parallelisms.perf.collectives import fit

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")


def _gemm_burst(width: int):
    """A burst of a layer's GEMMs (two [512, 256] x [256, ``width``]: a few ms), as runs between a step's
    collectives."""
    x, w = torch.randn(512, 256), torch.randn(256, width)
    return lambda: [x @ w for _ in range(2)]


def _cpu_per_iteration(comm, iteration, iterations: int, repeats: int) -> float:
    """The process's CPU seconds (every thread's) per call of ``iteration``: the median of ``repeats`` loops of
    ``iterations``, each loop started together with the peers of ``comm``."""
    runs = []
    for _ in range(repeats):
        comm.all_reduce(torch.zeros(1))
        start = time.process_time()
        for _ in range(iterations):
            iteration()
        runs.append((time.process_time() - start) / iterations)
    return statistics.median(runs)


def _collectives_rank(info, sizes: list[int], repeats: int, kinds: tuple[str, ...] = KINDS) -> dict:
    from parallelisms.comm import Comms
    from parallelisms.mesh import ParallelDims

    comm = Comms(ParallelDims(dp_replicate=info.world_size).build_meshes())["dp"]
    peer = 1 - comm.rank
    burst = _gemm_burst(688)
    rounds = 3 * repeats

    def after_burst(fn) -> float:  # median seconds of one call that follows a burst on both ranks
        fn()
        comm.all_reduce(torch.zeros(1))  # start together
        times = []
        for _ in range(rounds):
            burst()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    out = {}
    for kind in kinds:
        for numel in sizes:
            full = torch.ones(numel)
            shard = torch.ones(numel // comm.size)
            fn = {"all_reduce": lambda: comm.all_reduce(full, shared_memory=True),
                  "all_gather": lambda: comm.all_gather(shard),
                  "reduce_scatter": lambda: comm.reduce_scatter(full),
                  "all_to_all": lambda: comm.all_to_all(full),
                  "send": lambda: comm.send_recv([(full, peer)], [(torch.empty_like(full), peer)]).wait()}[kind]
            out.setdefault(kind, []).append(after_burst(fn))
        cpu, wall = time.process_time(), time.perf_counter()  # the largest message alone, in a tight loop: the
        for _ in range(rounds):                                 # rank's CPU time (every thread) over the wall time
            fn()
        out.setdefault("cpu_fraction", []).append((time.process_time() - cpu) / (time.perf_counter() - wall))
    return out


def measure_collectives(sizes: list[int], repeats: int = 7, kinds: tuple[str, ...] = KINDS) -> dict:
    """{kind: {"alpha_us", "gbps", "r2", "rows": [...]}} fitted on two ranks for each of ``kinds``, and
    "cpu_fraction": the share of a large collective's wall time the rank's own CPU is busy with it (median over
    the kinds)."""
    from parallelisms.comm.ledger import ring_bytes_per_rank
    from parallelisms.launch import launch

    timings = launch(_collectives_rank, 2, sizes, repeats, tuple(kinds), backend="gloo", threads=1)[0]
    out = {"cpu_fraction": min(1.0, statistics.median(timings.pop("cpu_fraction")))}
    for kind, seconds in timings.items():
        sent = [ring_bytes_per_rank(kind, 4 * n, 2) for n in sizes]
        model, r2 = fit(sent, seconds)
        alpha = max(model.alpha_s, 0.0)
        # a noisy machine can tilt the fit; the largest message then bounds the bandwidth from below
        beta = model.beta_s_per_byte if model.beta_s_per_byte > 0 else max(seconds[-1] - alpha, 1e-9) / sent[-1]
        out[kind] = {"alpha_us": alpha * 1e6, "gbps": 1 / beta / 1e9, "r2": r2,
                     "rows": [{"bytes": 4 * n, "seconds": t} for n, t in zip(sizes, seconds)]}
    return out


def _comm_cpu(comm, iteration, iterations: int) -> float:
    """The median over ``iterations`` calls of ``iteration()`` (started together with the peers of ``comm``) of
    the CPU seconds it spends communicating: what it returns (its own thread's time in the collective's calls)
    plus every other thread's CPU over the call (the comm layer's worker). Compute between the calls (a burst of
    GEMMs) stays out of both: the per-call figure is not the small difference of two large ones."""
    comm.all_reduce(torch.zeros(1))
    samples = []
    for _ in range(iterations):
        others = time.process_time() - time.thread_time()
        own = iteration()
        samples.append(own + time.process_time() - time.thread_time() - others)
    return statistics.median(samples)


def _overlap_rank(info, sizes: list[int], repeats: int) -> list[float]:
    """CPU seconds an asynchronous collective (issued, a burst of GEMMs, waited: a gradient bucket behind the
    backward) costs this rank beyond the same call blocking after the burst, per kind (the all-reduce as DDP's
    buckets call it, the all-gather and reduce-scatter as ZeRO-3's units do) and size (:func:`_comm_cpu`, over
    ten calls per repeat)."""
    from parallelisms.comm import Comms
    from parallelisms.mesh import ParallelDims

    comm = Comms(ParallelDims(dp_replicate=info.world_size).build_meshes())["dp"]
    burst = _gemm_burst(1376)
    out = []
    for n in sizes:
        shard, full = torch.randn(n // 2), torch.randn(n)
        calls = (lambda a: comm.all_reduce(full.clone(), async_op=a, shared_memory=True),
                 lambda a: comm.all_gather(shard, async_op=a),
                 lambda a: comm.reduce_scatter(full.clone(), async_op=a, scratch=True))
        for call in calls:
            def blocking():
                burst()
                comm.all_reduce(torch.zeros(1))  # together: a peer still in its burst would add spinning
                start = time.thread_time()
                call(False)
                return time.thread_time() - start

            def overlapped():
                start = time.thread_time()
                pending = call(True)
                issued = time.thread_time() - start
                burst()
                start = time.thread_time()
                pending.wait()
                return issued + time.thread_time() - start
            alone = _comm_cpu(comm, blocking, 10 * repeats)
            out.append(_comm_cpu(comm, overlapped, 10 * repeats) - alone)
    return out


def measure_overlap_overhead(sizes: tuple[int, ...] = (2**18, 2**20), repeats: int = 7) -> float:
    """Seconds of CPU an asynchronous (overlapped) collective costs a rank beyond the blocking call: the comm
    layer's worker thread takes the call and shares the rank's core with the compute it overlaps, waking and
    polling between its slices. Median over kinds, sizes (1 and 4 MB) and the two ranks: 178-276 us in eight
    runs here. Each blocking call starts with its peer (after a one-element all-reduce, untimed): a peer still
    in its burst made the blocking call spin for it, 1.2-1.8 ms in one call of ten, and the process's CPU over
    whole loops (the burst's included) had the difference scatter from 43 to 397 us between runs."""
    from parallelisms.launch import launch

    runs = launch(_overlap_rank, 2, list(sizes), repeats, backend="gloo", threads=1)
    return max(statistics.median(v for rank in runs for v in rank), 0.0)


def _meetings_rank(info, iterations: int, repeats: int) -> tuple[float, float]:
    """(CPU seconds, blocking collectives) per iteration of this rank: the ``small`` model's forward and
    backward on one sequence of 128 tokens under tensor parallelism 2 with sequence parallelism (ranks paired
    0-1, 2-3, ...), whose collectives the ledger counts; the median of ``repeats`` timed loops. The CPU seconds
    are the process's (the comm layer's threads included)."""
    from parallelisms.comm import Comms
    from parallelisms.config import preset
    from parallelisms.mesh import ParallelDims
    from parallelisms.model import build_model
    from parallelisms.parallel.tensor_plan import apply_tensor_parallel

    comm = Comms(ParallelDims(dp_replicate=info.world_size // 2, tp=2).build_meshes())["tp"]
    model = apply_tensor_parallel(build_model(preset("small")), comm, sequence_parallel=True)
    tokens = torch.zeros(1, 128, dtype=torch.long)
    step = lambda: model(tokens, tokens).backward()
    for _ in range(3):  # warm: the allocator's pools, the autograd graph's first builds
        step()
    mark = comm.ledger.mark()
    step()
    meetings = comm.ledger.mark() - mark
    return _cpu_per_iteration(comm, step, iterations, repeats), meetings


def measure_meeting_overhead(iterations: int = 8, repeats: int = 3, per_core: int = 4) -> float:
    """Seconds of CPU each blocking collective costs a rank beyond its own work when ``per_core`` ranks (four
    for ``meeting_overhead_us``) share each core: the rank sleeps until its peer arrives, other ranks' work runs
    in between, and the core's caches, TLB and branch predictors hold their state when it wakes. The model's own
    tensor-parallel step (:func:`_meetings_rank`: 56 collectives with about half a millisecond of work between
    them, as training meets) with one rank per core and with ``per_core``, two launches (ranks idling in a
    barrier beside the first would slow it by a tenth): the difference in CPU time per iteration, mean over the
    ranks, over the collectives per iteration. Needs an even number of cores (0 where there is one)."""
    from parallelisms.launch import launch

    cores = os.cpu_count() or 1
    if cores < 2 or cores % 2:
        return 0.0
    alone, shared = (launch(_meetings_rank, ranks, iterations, repeats, backend="gloo", threads=1)
                     for ranks in (cores, per_core * cores))
    cpu = [statistics.fmean(seconds for seconds, _ in runs) for runs in (alone, shared)]
    return max(cpu[1] - cpu[0], 0.0) / statistics.fmean(meetings for _, meetings in shared)


def collective_keys(collectives: dict) -> dict:
    """The hardware keys of :func:`measure_collectives`' fit: alpha and bandwidth per kind measured, the
    all-reduce's (where measured) as the links' (one host: intra- and inter-node alike), and the comm CPU
    fraction."""
    keys = {"comm_cpu_fraction": collectives["cpu_fraction"],
            "collectives": {k: {"alpha_us": v["alpha_us"], "gbps": v["gbps"]} for k, v in collectives.items()
                            if k != "cpu_fraction"}}
    ar = collectives.get("all_reduce")
    if ar:
        keys.update(intra_node_gbps=ar["gbps"], inter_node_gbps=ar["gbps"], intra_latency_us=ar["alpha_us"],
                    inter_latency_us=ar["alpha_us"])
    return keys
