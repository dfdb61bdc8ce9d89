"""The performance model against one GPU: measured GEMM throughput over shapes, elementwise bandwidth, operator
dispatch and ``train --device cuda`` steps and peak memory, beside what ``estimate`` predicts for them
(docs/performance-model.md, "Checked on a GPU").

Two halves, so that the GPU's time holds measurements only:

    python3 benchmarks/gpu_check.py measure --out DIR [--budget-s 300]    # on the GPU machine
    PYTHONPATH=src python3 benchmarks/gpu_check.py compare DIR/gpu_check.json [--hardware h200]

``measure`` writes ``gpu_check.json`` after every phase (a run cut short keeps what it measured): the GPU and its
clocks, the bf16 matrix-product and copy ceilings, a GEMM sweep over the linear layers' shapes of four model
widths at tensor-parallel slices 1 to 8 (forward ``x w^T`` and weight-gradient ``g^T x`` layouts, inputs rotated
over more memory than the L2 holds, medians of CUDA-event times), eager elementwise kernels, and one ``train``
per entry of :data:`RUNS` (its median step and ``torch.cuda.max_memory_allocated``). ``compare`` prices the same
GEMMs with perf/compute.py and each run with ``estimate --check`` (its dry run's peak beside the estimate's), and
prints the errors.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# (name, flags): one rank each; the medium preset (the dispatch-bound end) and Llama 3 8B layers (GEMM-bound)
RUNS = [
    ("medium fp32", "--preset medium"),
    ("medium bf16", "--preset medium --mixed-precision bf16"),
    ("medium bf16 b32 s512", "--preset medium --mixed-precision bf16 --global-batch 32 --seq-len 512"),
    ("llama3-8b x2 bf16 s4096 b2", "--preset llama3-8b --layers 2 --mixed-precision bf16 --seq-len 4096 --global-batch 2"),
    ("llama3-8b x2 bf16 s4096 b2 full", "--preset llama3-8b --layers 2 --mixed-precision bf16 --seq-len 4096 "
                                        "--global-batch 2 --recompute full"),
    ("llama3-8b x4 bf16 s8192 b1", "--preset llama3-8b --layers 4 --mixed-precision bf16 --seq-len 8192 --global-batch 1"),
]
COMMON = "--dp 1 --lr 1e-4"

# (hidden, ffn, q+k+v width): the medium preset, a 2,048-wide GPT, Llama 3 8B and 70B
WIDTHS = [(512, 1376, 1536), (2048, 8192, 6144), (4096, 14336, 6144), (8192, 28672, 10240)]
TOKENS = (1024, 4096, 16384)
TP = (1, 2, 4, 8)


def gemm_shapes() -> list[tuple[str, int, int, int]]:
    """(layout, m, n, k) of every linear layer's forward and weight-gradient GEMM: qkv, attention output, fc1
    (gate and up together), fc2, at each width, tokens and tp slice (a slice under 64 wide is left out)."""
    shapes = set()
    for hidden, ffn, qkv in WIDTHS:
        for tp in TP:
            linears = [(qkv // tp, hidden), (hidden, hidden // tp), (2 * ffn // tp, hidden), (hidden, ffn // tp)]
            for tokens in TOKENS:
                for n, k in linears:
                    if min(n, k) >= 64:
                        shapes.add(("fwd", tokens, n, k))
                        if tokens == TOKENS[1]:
                            shapes.add(("wgrad", n, k, tokens))
    return sorted(shapes, key=lambda s: (s[0], s[1] * s[2] * s[3]))


# ---- measure (on the GPU) ----

def _timed(fn, reps: int, torch) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls after three warm-ups, by CUDA events."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _rotating(make, bytes_each: int, floor: int = 256 << 20) -> list:
    """Enough copies of an operand set that cycling through them overruns the L2 (``floor`` bytes in all)."""
    return [make() for _ in range(max(1, min(16, -(-floor // max(bytes_each, 1)))))]


def measure_gemms(torch, dtype, deadline: float) -> list[dict]:
    rows = []
    for layout, m, n, k in gemm_shapes():
        if time.time() > deadline:
            break
        size = (m * k + n * k) * 2
        if layout == "fwd":  # y[m, n] = x[m, k] w[n, k]^T, as nn.Linear
            sets = _rotating(lambda: (torch.randn(m, k, device="cuda", dtype=dtype),
                                      torch.randn(n, k, device="cuda", dtype=dtype)), size)
            op = torch.nn.functional.linear
        else:  # dW[m, n] = g[k, m]^T x[k, n]: the reduction runs over the tokens
            sets = _rotating(lambda: (torch.randn(k, m, device="cuda", dtype=dtype).t(),
                                      torch.randn(k, n, device="cuda", dtype=dtype)), size)
            op = torch.matmul
        turn = itertools.cycle(sets)
        seconds = _timed(lambda: op(*next(turn)), 20, torch)
        rows.append({"layout": layout, "m": m, "n": n, "k": k, "seconds": seconds,
                     "tflops": 2 * m * n * k / seconds / 1e12})
    return rows


def measure_ceilings(torch) -> dict:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    matmul = _timed(lambda: a @ b, 10, torch)
    f32a, f32b = a.float(), b.float()
    fp32 = _timed(lambda: f32a @ f32b, 5, torch)
    src = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    copy = _timed(lambda: dst.copy_(src), 10, torch)
    tiny = torch.zeros(16, device="cuda")

    def launches():
        for _ in range(1000):
            tiny.add_(1)
    dispatch = _timed(launches, 5, torch) / 1000
    return {"bf16_8192_tflops": 2 * 8192**3 / matmul / 1e12, "fp32_8192_tflops": 2 * 8192**3 / fp32 / 1e12,
            "copy_tbps": 2 * src.numel() * 2 / copy / 1e12, "eager_op_us": dispatch * 1e6}


def measure_elementwise(torch) -> list[dict]:
    """Eager operators a block runs, at 16,384 tokens x 4,096 in bf16: bytes read and written over time."""
    x = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16)
    y = torch.randn_like(x)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    nbytes = x.numel() * 2
    ops = {"add": (lambda: x + y, 3), "silu*mul": (lambda: torch.nn.functional.silu(x) * y, 5),
           "rmsnorm (eager, fp32 math)": (lambda: (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True)
                                                                            + 1e-5)).to(x.dtype) * w, 2),
           "cast to fp32": (lambda: x.float(), 3)}
    rows = []
    for name, (fn, passes) in ops.items():
        seconds = _timed(fn, 10, torch)
        rows.append({"op": name, "seconds": seconds, "min_bytes": passes * nbytes,
                     "tbps_at_min_bytes": passes * nbytes / seconds / 1e12})
    return rows


def run_train(name: str, flags: str, out: Path, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "parallelisms", "train", "--device", "cuda", *COMMON.split(), *flags.split(),
           "--steps", "12", "--json"]
    started = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"name": name, "flags": flags, "error": f"timed out after {timeout:.0f} s"}
    (out / "train.log").open("a").write(f"$ {' '.join(cmd)}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}\n")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        return {"name": name, "flags": flags, "error": (proc.stderr or proc.stdout)[-600:]}
    result = json.loads(lines[-1])
    return {"name": name, "flags": flags, "wall_s": time.time() - started, "step_time_s": result["step_time_s"],
            "loss_first": result["loss_first"], "loss_last": result["loss_last"], "memory": result["memory"]}


def _smi() -> str:
    query = "clocks.sm,clocks.max.sm,power.limit,power.draw,temperature.gpu"
    try:
        return subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv"], capture_output=True,
                              text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as error:
        return repr(error)


def measure(out: Path, budget_s: float) -> None:
    import torch

    start = time.time()
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"torch": torch.__version__}

    def save():
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    props = torch.cuda.get_device_properties(0)
    report["gpu"] = {"name": props.name, "sms": props.multi_processor_count, "memory_gib": props.total_memory / 2**30,
                     "nvidia_smi": _smi()}
    phases = {"ceilings": lambda: measure_ceilings(torch), "elementwise": lambda: measure_elementwise(torch),
              "gemms": lambda: measure_gemms(torch, torch.bfloat16, start + 0.3 * budget_s)}
    for phase, fn in phases.items():
        try:
            report[phase] = fn()
        except Exception as error:  # a phase that fails leaves the others to run
            report[phase + "_error"] = repr(error)
        print(f"{phase} done at {time.time() - start:.0f} s: {str(report.get(phase, report.get(phase + '_error')))[:300]}",
              flush=True)
        save()
        torch.cuda.empty_cache()
    report["gpu"]["nvidia_smi_after_gemms"] = _smi()
    report["runs"] = []
    for name, flags in RUNS:
        left = start + budget_s - time.time()
        if left < 30:
            report["runs"].append({"name": name, "flags": flags, "error": "left out: out of budget"})
            continue
        report["runs"].append(run_train(name, flags, out, left))
        print(report["runs"][-1], flush=True)
        save()
    report["seconds"] = time.time() - start
    save()


# ---- compare (here) ----

def compare(path: Path, hardware: str) -> dict:
    from parallelisms.perf.compute import gemm_time
    from parallelisms.perf.hardware import load_hardware

    report = json.loads(path.read_text())
    hw = load_hardware(hardware)
    print(f"{report['gpu']['name']}, torch {report['torch']}; ceilings: {report['ceilings']}")
    print(f"model: {hw.name}, GEMM rate {hw.gemm_peak_flops / 1e12:.0f} TFLOP/s x fraction {hw.gemm_fraction}, "
          f"k_half {hw.gemm_k_half}; elementwise {hw.memory_bytes_per_s / 1e12:.2f} TB/s; op {hw.op_overhead_us} us")
    errors = []
    for row in report.get("gemms", []):
        row["predicted_s"] = gemm_time(hw, row["m"], row["n"], row["k"])
        row["error"] = row["predicted_s"] / row["seconds"] - 1
        errors.append(abs(row["error"]))
    gemms = report.get("gemms", [])
    if gemms:
        print(f"GEMMs: {len(gemms)} shapes, predicted time vs measured: mean |error| {statistics.mean(errors):.1%}, "
              f"median {statistics.median(errors):.1%}, max {max(errors):.1%}")
        for layout in ("fwd", "wgrad"):
            for band, (lo, hi) in {"< 10 GFLOP": (0, 1e10), "10-100 GFLOP": (1e10, 1e11), ">= 100 GFLOP": (1e11, 1e30)}.items():
                sel = [r for r in gemms if r["layout"] == layout and lo <= 2 * r["m"] * r["n"] * r["k"] < hi]
                if sel:
                    print(f"  {layout:5s} {band:13s} {len(sel):3d} shapes: measured {statistics.median(r['tflops'] for r in sel):6.0f} "
                          f"TFLOP/s median; error mean {statistics.mean(r['error'] for r in sel):+.1%}, "
                          f"|mean| {statistics.mean(abs(r['error']) for r in sel):.1%}")
    for row in report.get("elementwise", []):
        print(f"  elementwise {row['op']:28s} {row['tbps_at_min_bytes']:.2f} TB/s at its fewest bytes")
    for run in report.get("runs", []):
        if "error" in run:
            print(f"run {run['name']}: {run['error'][-300:]}")
            continue
        flags = [*COMMON.split(), *run["flags"].split(), "--hardware", hardware, "--check", "--json"]
        proc = subprocess.run([sys.executable, "-m", "parallelisms", "estimate", *flags], capture_output=True, text=True)
        est = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
        measured, estimated = run["memory"]["process_peak"], est["memory_per_rank"]["total"]
        dry_run = est["check"]["memory"]["total"]["dry_run"]
        run["estimate"] = {"step_s": est["step_s"], "memory_total": estimated, "dry_run_peak": dry_run}
        print(f"run {run['name']}: step measured {run['step_time_s'] * 1e3:.1f} ms, estimate "
              f"{est['step_s'] * 1e3:.1f} ms ({est['step_s'] / run['step_time_s'] - 1:+.1%}); peak measured "
              f"{measured / 2**30:.2f} GiB, dry run {dry_run / 2**30:.2f} GiB ({dry_run / measured - 1:+.1%}), "
              f"estimate {estimated / 2**30:.2f} GiB ({estimated / measured - 1:+.1%}); loss "
              f"{run['loss_first']:.3f} -> {run['loss_last']:.3f}")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_check")))
    m.add_argument("--budget-s", type=float, default=300)
    c = sub.add_parser("compare")
    c.add_argument("path", type=Path)
    c.add_argument("--hardware", default="h200")
    args = parser.parse_args()
    if args.verb == "measure":
        measure(args.out, args.budget_s)
    else:
        compare(args.path, args.hardware)


if __name__ == "__main__":
    main()
