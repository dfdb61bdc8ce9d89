"""``parallelisms calibrate --out FILE.json``: measure this machine and write a hardware file perf/ reads.

Every compute rate is measured as each rank gets it when the ranks share the cores: one process per core
measures at once, and the rates are their mean (:func:`calibrate_shared`).

* GEMM: fp32 matmul throughput on one thread (what each rank gets when the ranks share the cores) over square,
  thin and short-k shapes, each in a linear layer's three layouts (forward x w^T, input gradient g w, weight
  gradient g^T x) with the outputs kept alive as activations are (fresh memory, not a cache-hot buffer), medians:
  ``gemm_k_half`` is fitted to the short-k shapes' efficiency k / (k + k_half) against the shapes with every side
  at least 256 (the mechanism compute.py models). ``peak_tflops`` is the rate a block's own GEMMs reach, forward
  and backward, in the ``small`` model, with their cold operands' loads (:func:`measure_model_compute`).
* Elementwise bandwidth (``hbm_tbps``) and operator dispatch (``op_overhead_us``): the same model's step less
  its GEMM and attention calls, from no gradients (a step's first microbatch: nothing accumulated), at seven
  sizes from 16 to 1,024 tokens: a straight line in the elementwise bytes compute.py counts, its intercept the
  operators' dispatch, its slope the bandwidth (:func:`measure_model_compute`).
* Attention (``attention_fraction``, ``attention_backward``): the same model's attention kernel, forward and
  backward timed apart: the forward's share of compute.py's GEMM time for its QK^T and AV (half the score
  blocks) at that peak, and the backward's time over the forward's (:func:`measure_model_compute`).
* Optimizer (``optimizer_tbps``, ``optimizer_tensor_us``): the runtime's step (global gradient norm, clipping,
  ``make_optimizer``'s AdamW), each step after the caches are flushed (training's forward and backward leave none
  of the optimizer's state there), over a few large tensors (the nominal 36 bytes per parameter over the time per
  parameter) and over many small ones (the time per tensor beyond that: the per-tensor operators' overhead).
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

import contextlib
import dataclasses
import json
import os
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from parallelisms.perf.collectives import fit
from parallelisms.perf.hardware import PRESETS

GEMMS = [(512, 512, 512), (1024, 1024, 1024), (256, 256, 256), (2048, 256, 256), (1024, 1024, 32),
         (1024, 1024, 64), (1024, 1024, 128), (128, 128, 128), (4096, 64, 64)]
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")


def _median_seconds(fn, repeats: int, before=None) -> float:
    """Median seconds of ``fn`` (after one untimed call), ``before()`` run untimed ahead of each."""
    fn()
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _kept_seconds(fn, repeats: int, calls: int = 8) -> float:
    """Median seconds per call of ``fn`` over ``repeats`` rounds of ``calls`` calls whose results stay alive
    until the round ends (as a forward's activations do): each output is fresh memory."""
    fn()
    times = []
    for _ in range(repeats):
        kept = []
        start = time.perf_counter()
        for _ in range(calls):
            kept.append(fn())
        times.append((time.perf_counter() - start) / calls)
        del kept
    return statistics.median(times)


def measure_gemms(repeats: int = 7) -> list[dict]:
    """Per shape [m, k] x [k, n]: the median over a linear layer's three layouts (module docstring)."""
    torch.set_num_threads(1)
    rows = []
    for m, n, k in GEMMS:
        x, w, g = torch.randn(m, k), torch.randn(n, k), torch.randn(m, n)
        xt, gt = torch.randn(k, m), torch.randn(n, m)  # the weight gradient's operands: m is its reduction
        layouts = (lambda: x @ w.t(), lambda: g @ w, lambda: gt @ xt.t())
        t = statistics.median(_kept_seconds(fn, repeats) for fn in layouts)
        rows.append({"m": m, "n": n, "k": k, "seconds": t, "tflops": 2 * m * n * k / t / 1e12})
    return rows


class _KernelTimes(TorchDispatchMode):
    """Seconds inside it of GEMMs, of the attention kernel's forward and of its backward."""

    def __init__(self):
        super().__init__()
        self.seconds = {"gemm": 0.0, "attention": 0.0, "attention_backward": 0.0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        seconds, name = time.perf_counter() - start, func.__name__
        if name.split(".")[0] in ("mm", "addmm", "bmm"):
            self.seconds["gemm"] += seconds
        elif "scaled_dot_product" in name:
            self.seconds["attention_backward" if "backward" in name else "attention"] += seconds
        return out


def measure_model_compute(hw, repeats: int = 7) -> dict:
    """The compute keys as the ``small`` model (four layers: a layer's weights are evicted by the others before
    they are used again, as in training) runs its work, forward and backward from no gradients (a step's first
    microbatch; compute.py prices the later ones' accumulation apart) at 16, 32, 64, 128, 256, 512 and 1,024
    tokens after a few steps, medians over ``repeats``:

    * ``op_overhead_us`` and ``hbm_tbps``: the step's time outside its GEMM and attention calls (each timed as
      it is dispatched, in a second run) is its operators' dispatch and the elementwise bytes compute.py counts
      (:func:`eager_elementwise_bytes`, the loss's): a straight line in those bytes over the seven sizes (least
      squares on relative errors; the short sequences pin the intercept), whose intercept over the operators
      compute.py charges (``BLOCK_OPS``, ``HEAD_OPS``) is the time per operator (Python, autograd and allocation
      included: 2.5-3.1 us here; with every pass accumulating into the last one's gradients, 3 x 8.7 MB a block,
      the four sizes at 128 tokens and up gave 2.5-4.7, the accumulation mistaken for dispatch) and whose slope
      the bandwidth (12.0-13.1 GB/s);
    * GEMM and attention rates: the sizes of 128 tokens and up (a 16-row GEMM is not the shapes training runs);
    * ``peak_tflops``: the GEMM calls' rate, their cold operands' loads (:func:`layer_gemms`,
      :func:`head_gemms`) at that bandwidth taken out, at ``hw``'s ``gemm_k_half``;
    * ``attention_fraction`` and ``attention_backward``: the attention calls' forward against
      :func:`causal_attention_gemms` at that peak, and their backward over their forward. Alone in a loop that
      keeps their operands in cache, the same calls took 1.05 ms forward and 2.5 backward where in the model
      they took 1.5 and 2.0 (4 x 8 heads x 128 x 32)."""
    from parallelisms.config import preset
    from parallelisms.model import build_model
    from parallelisms.perf.compute import (BLOCK_OPS, HEAD_OPS, LayerShape, causal_attention_gemms,
                                           eager_elementwise_bytes, gemm_efficiency, head_gemms, layer_gemms)

    torch.set_num_threads(1)
    cfg, seq = preset("small"), 128
    sizes = [(1, 16), (1, 32), (1, 64)] + [(batch, seq) for batch in (1, 2, 4, 8)]  # (batch, sequence)
    model = build_model(cfg)
    kernels = {"gemm": 0.0, "attention": 0.0, "attention_backward": 0.0}
    moved, rest = [], []  # per size: elementwise bytes; seconds outside GEMMs and attention
    work = cold = 0.0  # GEMM seconds at 1 FLOP/s; cold operand bytes
    for batch, length in sizes:
        tokens = torch.zeros(batch, length, dtype=torch.long)
        for _ in range(3):
            model(tokens, tokens).backward()
        walls, runs = [], []
        for _ in range(repeats):  # each pass from no gradients, as a step's first microbatch (no accumulation)
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            model(tokens, tokens).backward()
            walls.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
            with _KernelTimes() as timed:
                model(tokens, tokens).backward()
            runs.append(timed.seconds)
        measured = {key: statistics.median(r[key] for r in runs) for key in kernels}
        rest.append(statistics.median(walls) - sum(measured.values()))
        shape, positions = LayerShape(cfg, batch, length), batch * length
        moved.append(cfg.n_layers * 3 * eager_elementwise_bytes(shape, 4) + 2 * 3 * positions * cfg.vocab_size * 4)
        if length < seq:  # short sequences pin the dispatch line's intercept; the kernels' rates come from full ones
            continue
        for key in kernels:
            kernels[key] += measured[key]
        gemms = [g for gemms in layer_gemms(shape) for g in gemms] * cfg.n_layers
        for m, n, k, b, elements in gemms + list(head_gemms(cfg, positions, 1)):
            work += 2 * m * n * k * b / gemm_efficiency(hw, m, n, k, b)
            cold += elements * b * hw.bytes_per_element
    operators = cfg.n_layers * sum(BLOCK_OPS[cfg.mlp]) + sum(HEAD_OPS)
    # least squares on relative errors (each size weighs alike: the smallest sets the intercept)
    rows = torch.tensor([[operators / r, b / r] for b, r in zip(moved, rest)], dtype=torch.float64)
    per_operator, per_byte = torch.linalg.lstsq(rows, torch.ones(len(rest), 1, dtype=torch.float64)).solution.flatten().tolist()
    if per_operator < 0:  # noise (a loaded machine, few repeats) tipped the line: no dispatch term, the bytes alone
        per_operator, per_byte = 0.0, float(rows[:, 1].sum() / (rows[:, 1] ** 2).sum())
    bandwidth = 1 / max(per_byte, 1e-15)
    peak = work / max(kernels["gemm"] - cold / bandwidth, 1e-9) / 1e12
    at_peak = dataclasses.replace(hw, peak_tflops=peak)
    attention = sum(cfg.n_layers * causal_attention_gemms(at_peak, batch * cfg.n_heads, seq, seq, cfg.head_dim)
                    for batch, length in sizes if length == seq)
    return {"peak_tflops": peak, "hbm_tbps": bandwidth / 1e12, "op_overhead_us": per_operator * 1e6,
            "attention_fraction": min(1.0, attention / kernels["attention"]),
            "attention_backward": kernels["attention_backward"] / kernels["attention"]}


def measure_optimizer(repeats: int = 7) -> tuple[float, float]:
    """(bytes per second at 36 bytes per parameter, seconds per parameter tensor) of the runtime's optimizer
    step: global gradient norm, clipping and AdamW (module docstring)."""
    from parallelisms.comm import Comms
    from parallelisms.config import TrainConfig
    from parallelisms.optim import make_optimizer
    from parallelisms.parallel.common import clip_grad_norm_, global_grad_norm

    torch.set_num_threads(1)

    def seconds(tensors: int, numel: int) -> float:
        params = [torch.nn.Parameter(torch.randn(numel)) for _ in range(tensors)]
        for p in params:
            p.grad = torch.randn(numel)
        optimizer, comms = make_optimizer(params, TrainConfig()), Comms()

        def step():
            clip_grad_norm_(params, 1.0, comms, norm=global_grad_norm(params, comms))
            optimizer.step()
        return _median_seconds(step, repeats, before=lambda: evict.add_(1.0))

    evict = torch.zeros(2**26)  # 256 MB written before each step: the forward and backward leave none of the
    # optimizer's state in cache (here 5.5-6.8 GB/s so, against 9.4 on the same tensors stepped back to back)

    large = 8 * 2**18  # a model's parameter tensors: 1 MB each
    per_param = seconds(8, 2**18) / large
    small = seconds(64, 2**10)
    return 36 / per_param, max(0.0, (small - 64 * 2**10 * per_param) / 64)


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


def _collectives_rank(info, sizes: list[int], repeats: int) -> dict:
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
    for kind in KINDS:
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


def measure_collectives(sizes: list[int], repeats: int = 7) -> dict:
    """{kind: {"alpha_us", "gbps", "r2", "rows": [...]}} fitted on two ranks, and "cpu_fraction": the share of
    a large collective's wall time the rank's own CPU is busy with it (median over the kinds)."""
    from parallelisms.comm.ledger import ring_bytes_per_rank
    from parallelisms.launch import launch

    timings = launch(_collectives_rank, 2, sizes, repeats, backend="gloo", threads=1)[0]
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


def calibrate_compute(repeats: int = 9) -> tuple[dict, list[dict]]:
    """The hardware keys of one rank's own work (GEMMs, elementwise bandwidth, attention, optimizer, operator
    dispatch), and the GEMM rows they came from."""
    gemms = measure_gemms(repeats)
    peak = statistics.median(r["tflops"] for r in gemms if min(r["m"], r["n"], r["k"]) >= 256)
    short = [r for r in gemms if r["k"] <= 128 and min(r["m"], r["n"]) >= 1024]
    k_half = statistics.median(r["k"] * (peak / r["tflops"] - 1) for r in short) if short else 0.0
    optimizer_bandwidth, optimizer_tensor_s = measure_optimizer(repeats)
    keys = {"gemm_k_half": max(k_half, 0.0), "optimizer_tbps": optimizer_bandwidth / 1e12,
            "optimizer_tensor_us": optimizer_tensor_s * 1e6}
    keys.update(measure_model_compute(dataclasses.replace(PRESETS["cpu"], **keys), repeats))
    return keys, gemms


@contextlib.contextmanager
def calibration_pool():
    """One process per core, for :func:`calibrate_shared` (a caller that calibrates often keeps one open), each
    warmed by one measurement first, left out: a fresh pool's first measurement gave 0.7-1.1 us per operator
    and 12.6 GB/s where the next five gave 2.5-2.9 and 14.7-15.6."""
    from concurrent.futures import ProcessPoolExecutor
    import multiprocessing

    processes = os.cpu_count() or 1
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(calibrate_compute, [1] * processes))
        yield pool


def calibrate_shared(repeats: int, pool=None) -> tuple[dict, list[dict]]:
    """:func:`calibrate_compute` as each rank gets it when every core runs one: that many processes measure at
    once (in ``pool``, else a :func:`calibration_pool` of its own), and each key is their mean. Ranks that
    share a machine's caches and memory run slower than one process alone (here a two-rank forward took 62-63
    ms where one process alone took 54-55 ms, back to back); the GEMM rows are the first process's."""
    processes = os.cpu_count() or 1
    if processes == 1:
        return calibrate_compute(repeats)
    with contextlib.nullcontext(pool) if pool else calibration_pool() as workers:
        results = list(workers.map(calibrate_compute, [repeats] * processes))
    keys = {k: statistics.fmean(r[0][k] for r in results) for k in results[0][0]}
    return keys, results[0][1]


def calibrate(quick: bool = False) -> dict:
    """A hardware dict (perf/hardware.py's keys) for this machine, with the measurements it came from."""
    repeats = 3 if quick else 9
    compute, gemms = calibrate_shared(repeats)
    sizes = [2**k for k in range(8, 21 if quick else 23, 2)]
    collectives = measure_collectives(sizes, repeats)
    cores = os.cpu_count() or 1
    meeting = measure_meeting_overhead(*((2, 1, 2) if quick else (8, 3, 4)))  # quick: a test's four ranks
    overlap = measure_overlap_overhead((2**18,) if quick else (2**18, 2**20), 3 if quick else 7)
    return {"name": f"this machine ({cores} cores, fp32, comm layer over gloo/shared memory)", **compute,
            "meeting_overhead_us": meeting * 1e6, "overlap_overhead_us": overlap * 1e6,
            "hbm_gb": round(_memory_gb(), 1), "gpus_per_node": 1024, **collective_keys(collectives),
            "gemm_fraction": 1.0, "sms": 0, "tile": 0, "hbm_fraction": 1.0, "link_fraction": 1.0,
            "bytes_per_element": 4, "cores": cores,
            "measurements": {"gemm": gemms, "collectives": {k: v for k, v in collectives.items() if k != "cpu_fraction"}}}


def collective_keys(collectives: dict) -> dict:
    """The hardware keys of :func:`measure_collectives`' fit: alpha and bandwidth per kind, the all-reduce's as
    the links' (one host: intra- and inter-node alike), and the comm CPU fraction."""
    ar = collectives["all_reduce"]
    return {"intra_node_gbps": ar["gbps"], "inter_node_gbps": ar["gbps"], "intra_latency_us": ar["alpha_us"],
            "inter_latency_us": ar["alpha_us"], "comm_cpu_fraction": collectives["cpu_fraction"],
            "collectives": {k: {"alpha_us": v["alpha_us"], "gbps": v["gbps"]} for k, v in collectives.items()
                            if k != "cpu_fraction"}}


def _memory_gb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError, AttributeError):
        return 16.0


def add_calibrate_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="measure this machine's GEMMs, memory and collectives into a hardware file")
    p.add_argument("--out", required=True, metavar="FILE.json", help="the hardware file to write")
    p.add_argument("--quick", action="store_true", help="fewer repeats and sizes (a test's budget)")
    p.add_argument("--json", action="store_true", help="print the measured hardware as one JSON object")
    p.set_defaults(func=run_calibrate)


def run_calibrate(args) -> int:
    from parallelisms.flags import check_writable, json_line

    check_writable("--out", args.out)
    result = calibrate(args.quick)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"peak {result['peak_tflops'] * 1e3:.1f} GFLOP/s per thread (k_half {result['gemm_k_half']:.0f}), "
          f"attention {result['attention_fraction']:.0%} of it (backward {result['attention_backward']:.2f}x the forward), {result['op_overhead_us']:.1f} us per operator, "
          f"optimizer {result['optimizer_tbps'] * 1e3:.1f} GB/s + {result['optimizer_tensor_us']:.0f} us per tensor, "
          f"collectives {result['comm_cpu_fraction']:.0%} CPU (+{result['overlap_overhead_us']:.0f} us overlapped), memory "
          f"{result['hbm_tbps'] * 1e3:.1f} GB/s; " + ", ".join(f"{k} alpha {v['alpha_us']:.0f} us, {v['gbps']:.2f} GB/s"
                                                              for k, v in result["collectives"].items()))
    print(f"wrote {args.out}")
    if args.json:
        print(json_line(result))
    return 0
