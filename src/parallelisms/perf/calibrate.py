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
* Collectives, ranks outnumbering the cores and overlapped collectives (``collectives``, ``comm_cpu_fraction``,
  ``meeting_overhead_us``, ``overlap_overhead_us``): perf/calibrate_comm.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from parallelisms.perf.calibrate_comm import (collective_keys, measure_collectives, measure_meeting_overhead,
                                             measure_overlap_overhead)
from parallelisms.perf.hardware import PRESETS

GEMMS = [(512, 512, 512), (1024, 1024, 1024), (256, 256, 256), (2048, 256, 256), (1024, 1024, 32),
         (1024, 1024, 64), (1024, 1024, 128), (128, 128, 128), (4096, 64, 64)]


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
def calibration_pool(warm: bool = True):
    """One process per core, for :func:`calibrate_shared` (a caller that calibrates often keeps one open), each
    warmed by one measurement first, left out: a fresh pool's first measurement gave 0.7-1.1 us per operator
    and 12.6 GB/s where the next five gave 2.5-2.9 and 14.7-15.6 (``warm=False``: not warmed, for ``--quick``,
    which trades that accuracy for half the time)."""
    from concurrent.futures import ProcessPoolExecutor
    import multiprocessing

    processes = os.cpu_count() or 1
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        if warm:
            list(pool.map(calibrate_compute, [1] * processes))
        yield pool


def calibrate_shared(repeats: int, pool=None, warm: bool = True) -> tuple[dict, list[dict]]:
    """:func:`calibrate_compute` as each rank gets it when every core runs one: that many processes measure at
    once (in ``pool``, else a :func:`calibration_pool` of its own, ``warm`` or not), and each key is their mean.
    Ranks that share a machine's caches and memory run slower than one process alone (here a two-rank forward took
    62-63 ms where one process alone took 54-55 ms, back to back); the GEMM rows are the first process's."""
    processes = os.cpu_count() or 1
    if processes == 1:
        return calibrate_compute(repeats)
    with contextlib.nullcontext(pool) if pool else calibration_pool(warm) as workers:
        results = list(workers.map(calibrate_compute, [repeats] * processes))
    keys = {k: statistics.fmean(r[0][k] for r in results) for k in results[0][0]}
    return keys, results[0][1]


STAGES = ("compute (GEMMs, the model's kernels, the optimizer)", "collectives", "ranks sharing the cores",
          "overlapped collectives")


def calibrate(quick: bool = False, progress=lambda stage: None) -> dict:
    """A hardware dict (perf/hardware.py's keys) for this machine, with the measurements it came from;
    ``progress(i)`` is called as stage ``STAGES[i]`` starts."""
    repeats = 2 if quick else 9
    progress(0)
    compute, gemms = calibrate_shared(repeats, warm=not quick)
    sizes = [2**k for k in range(8, 19 if quick else 23, 2)]
    progress(1)
    collectives = measure_collectives(sizes, repeats)
    cores = os.cpu_count() or 1
    progress(2)
    meeting = measure_meeting_overhead(*((2, 1, 2) if quick else (8, 3, 4)))  # quick: a test's four ranks
    progress(3)
    overlap = measure_overlap_overhead((2**18,) if quick else (2**18, 2**20), 3 if quick else 7)
    return {"name": f"this machine ({cores} cores, fp32, comm layer over gloo/shared memory)", **compute,
            "meeting_overhead_us": meeting * 1e6, "overlap_overhead_us": overlap * 1e6,
            "hbm_gb": round(_memory_gb(), 1), "gpus_per_node": 1024, **collective_keys(collectives),
            "gemm_fraction": 1.0, "sms": 0, "tile": 0, "hbm_fraction": 1.0, "link_fraction": 1.0,
            "bytes_per_element": 4, "cores": cores,
            "measurements": {"gemm": gemms, "collectives": {k: v for k, v in collectives.items() if k != "cpu_fraction"}}}


def _memory_gb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError, AttributeError):
        return 16.0
