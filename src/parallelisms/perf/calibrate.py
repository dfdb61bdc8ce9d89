"""``parallelisms calibrate --out FILE.json``: measure this machine and write a hardware file perf/ reads.

* GEMM: fp32 matmul throughput on one thread (what each rank gets when the ranks share the cores) over square,
  thin and short-k shapes, medians. ``peak_tflops`` is the median over the shapes with every side at least 256
  (smaller ones run from cache); ``gemm_k_half`` is fitted to the
  short-k shapes' efficiency k / (k + k_half) (the mechanism compute.py models).
* Memory bandwidth: an elementwise add over tensors far beyond the caches (``hbm_tbps``).
* Operator dispatch: a one-block model too small to compute anything, per operator it dispatches.
* Collectives: two ranks over the project's comm layer (gloo, or shared memory where the runtime uses it),
  each kind over message sizes, medians; alpha and beta fitted per kind (Hockney) on the ledger's ring bytes.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch

from parallelisms.perf.collectives import fit

GEMMS = [(512, 512, 512), (1024, 1024, 1024), (256, 256, 256), (2048, 256, 256), (1024, 1024, 32),
         (1024, 1024, 64), (1024, 1024, 128), (128, 128, 128), (4096, 64, 64)]
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")


def _median_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_gemms(repeats: int = 7) -> list[dict]:
    torch.set_num_threads(1)
    rows = []
    for m, n, k in GEMMS:
        a, b = torch.randn(m, k), torch.randn(k, n)
        t = _median_seconds(lambda: a @ b, repeats)
        rows.append({"m": m, "n": n, "k": k, "seconds": t, "tflops": 2 * m * n * k / t / 1e12})
    return rows


def measure_memory_bandwidth(repeats: int = 7) -> float:
    """Bytes per second of x + y into out (three 64 MiB fp32 tensors: two read, one written)."""
    x, y, out = torch.ones(2**24), torch.ones(2**24), torch.empty(2**24)
    t = _median_seconds(lambda: torch.add(x, y, out=out), repeats)
    return 3 * 4 * 2**24 / t


def measure_op_overhead(repeats: int = 7) -> float:
    """Seconds per dispatched operator: a one-block model so small its work is negligible, forward and
    backward, divided by the operators it dispatches (counted with TorchDispatchMode)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from parallelisms.config import ModelConfig
    from parallelisms.model import build_model

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    torch.set_num_threads(1)
    model = build_model(ModelConfig(vocab_size=8, dim=8, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=8, max_seq_len=4))
    tokens = torch.zeros(1, 4, dtype=torch.long)
    with Count():
        model(tokens, tokens).backward()
    return _median_seconds(lambda: model(tokens, tokens).backward(), repeats * 5) / Count.ops


def _collectives_rank(info, sizes: list[int], repeats: int) -> dict:
    from parallelisms.comm import Comms
    from parallelisms.mesh import ParallelDims

    comm = Comms(ParallelDims(dp_replicate=info.world_size).build_meshes())["dp"]
    peer = 1 - comm.rank
    out = {}
    for kind in KINDS:
        for numel in sizes:
            full = torch.ones(numel)
            shard = torch.ones(numel // comm.size)
            fn = {"all_reduce": lambda: comm.all_reduce(full),
                  "all_gather": lambda: comm.all_gather(shard),
                  "reduce_scatter": lambda: comm.reduce_scatter(full),
                  "all_to_all": lambda: comm.all_to_all(full),
                  "send": lambda: comm.send_recv([(full, peer)], [(torch.empty_like(full), peer)]).wait()}[kind]
            comm.all_reduce(torch.zeros(1))  # start together
            out.setdefault(kind, []).append(_median_seconds(fn, repeats))
    return out


def measure_collectives(sizes: list[int], repeats: int = 7) -> dict:
    """{kind: {"alpha_us", "gbps", "r2", "rows": [...]}} fitted on two ranks."""
    from parallelisms.comm.ledger import ring_bytes_per_rank
    from parallelisms.launch import launch

    timings = launch(_collectives_rank, 2, sizes, repeats, backend="gloo", threads=1)[0]
    out = {}
    for kind, seconds in timings.items():
        sent = [ring_bytes_per_rank(kind, 4 * n, 2) for n in sizes]
        model, r2 = fit(sent, seconds)
        alpha = max(model.alpha_s, 0.0)
        # a noisy machine can tilt the fit; the largest message then bounds the bandwidth from below
        beta = model.beta_s_per_byte if model.beta_s_per_byte > 0 else max(seconds[-1] - alpha, 1e-9) / sent[-1]
        out[kind] = {"alpha_us": alpha * 1e6, "gbps": 1 / beta / 1e9, "r2": r2,
                     "rows": [{"bytes": 4 * n, "seconds": t} for n, t in zip(sizes, seconds)]}
    return out


def calibrate(quick: bool = False) -> dict:
    """A hardware dict (perf/hardware.py's keys) for this machine, with the measurements it came from."""
    repeats = 3 if quick else 9
    gemms = measure_gemms(repeats)
    peak = statistics.median(r["tflops"] for r in gemms if min(r["m"], r["n"], r["k"]) >= 256)
    short = [r for r in gemms if r["k"] <= 128 and min(r["m"], r["n"]) >= 1024]
    k_half = statistics.median(r["k"] * (peak / r["tflops"] - 1) for r in short) if short else 0.0
    bandwidth = measure_memory_bandwidth(repeats)
    sizes = [2**k for k in range(8, 21 if quick else 23, 2)]
    collectives = measure_collectives(sizes, repeats)
    ar = collectives["all_reduce"]
    cores = os.cpu_count() or 1
    return {"name": f"this machine ({cores} cores, fp32, comm layer over gloo/shared memory)",
            "peak_tflops": peak, "hbm_gb": round(_memory_gb(), 1), "hbm_tbps": bandwidth / 1e12,
            "gpus_per_node": 1024, "intra_node_gbps": ar["gbps"], "inter_node_gbps": ar["gbps"],
            "intra_latency_us": ar["alpha_us"], "inter_latency_us": ar["alpha_us"], "gemm_fraction": 1.0,
            "gemm_k_half": max(k_half, 0.0), "sms": 0, "tile": 0, "hbm_fraction": 1.0, "link_fraction": 1.0,
            "bytes_per_element": 4, "cores": cores, "op_overhead_us": measure_op_overhead(repeats) * 1e6,
            "collectives": {k: {"alpha_us": v["alpha_us"], "gbps": v["gbps"]} for k, v in collectives.items()},
            "measurements": {"gemm": gemms, "collectives": collectives}}


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
          f"{result['op_overhead_us']:.1f} us per operator, memory "
          f"{result['hbm_tbps'] * 1e3:.1f} GB/s; " + ", ".join(f"{k} alpha {v['alpha_us']:.0f} us, {v['gbps']:.2f} GB/s"
                                                              for k, v in result["collectives"].items()))
    print(f"wrote {args.out}")
    if args.json:
        print(json_line(result))
    return 0
