"""The parsers of the verbs whose code imports torch (``bench``, ``calibrate``), apart from that code.

The command line's rule: ``--help``, ``--version``, ``estimate``, ``plan`` and ``simulate`` never import torch
(about 1.5 s and more of a busy machine's time). ``parallelisms.cli`` and every module it imports at load stay
torch-free; a verb whose code needs torch keeps its arguments in a light module (here, or next to the verb as
``data/options.py`` and ``resume.py`` do) and imports its code inside the function that runs it.
``tests/test_cli_light.py`` fails when ``--help`` or those verbs import torch.
"""

from __future__ import annotations

import json
import os
import sys
import time

from parallelisms.flags import DEGREE, check_writable, integer, integer_list, json_line, number

BUSY_LOAD_PER_CORE = 0.5  # a 1-minute load average above this share of the cores distorts calibrate's figures


def add_bench_parser(sub) -> None:
    count = integer(1, 10**9)
    p = sub.add_parser("bench", help="compare an implementation with the best runnable peer")
    p.add_argument("name", help="what to benchmark: ddp, all-reduce, tp, zero, pipeline, pipeline-balance, cp, ep, "
                                "predict, ... (an unknown name lists them all)")
    p.add_argument("--preset", help="model preset (default small; ep, ep-balance: tiny-moe)")
    p.add_argument("--world", type=DEGREE, default=2, help="ranks")
    p.add_argument("--global-batch", type=count, help="sequences per step (default 8; cp: 2)")
    p.add_argument("--seq-len", type=integer(2, 10**9), default=128, help="tokens per sequence")
    p.add_argument("--steps", type=count, help="timed steps per round and implementation (default 5; predict: 12)")
    p.add_argument("--rounds", type=count, help="alternating rounds (default 3; predict: 5)")
    p.add_argument("--bucket-mb", type=number(0, 2**20, above=True), default=25.0, help="gradient bucket cap")
    p.add_argument("--schedule", help="pipeline: the schedule (gpipe, 1f1b (default), interleaved, zb-v, dualpipev)")
    p.add_argument("--microbatches", type=count, help="pipeline: microbatches per step (default 2 x world)")
    p.add_argument("--sp", action="store_true", default=None, help="tp: with Megatron sequence parallelism")
    p.add_argument("--target", choices=("block", "mlp"), help="tp: what the headline ratio times (default block)")
    p.add_argument("--hardware", help="predict: `calibrate` (measure this machine first; the default), a hardware preset or a `calibrate` file")
    p.add_argument("--seq-lens", type=integer_list(2, 10**6),
                   help="cp: sequence lengths (default 1024,2048,4096,8192,16384)")
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    p.set_defaults(func=_run_bench)


def _run_bench(args) -> int:
    from parallelisms.bench import run_bench

    result = run_bench(args)
    if args.json:
        print(json_line(result))
    return 0


def add_calibrate_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="measure this machine's GEMMs, memory and collectives into a hardware file")
    p.add_argument("--out", required=True, metavar="FILE.json", help="the hardware file to write")
    p.add_argument("--quick", action="store_true", help="fewer repeats and sizes (a test's budget)")
    p.add_argument("--json", action="store_true", help="print the measured hardware as one JSON object")
    p.set_defaults(func=run_calibrate)


def machine_load() -> float | None:
    """The 1-minute load average (None where the system keeps none)."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def _warn_if_busy(load: float | None, cores: int, when: str) -> bool:
    """One warning line when other work shares the cores calibrate measures; whether it was busy."""
    busy = load is not None and load > BUSY_LOAD_PER_CORE * cores
    if busy:
        print(f"warning: this machine is busy {when} (load average {load:.1f} on {cores} cores): calibrate times "
              f"every core, so its figures come out slower than the machine is; calibrate on an idle machine "
              f"(the load is recorded in the file's measurements)", file=sys.stderr, flush=True)
    return busy


def run_calibrate(args) -> int:
    """Calibrate with a progress line per stage; the load average before and after is recorded in the file, and a
    busy machine is warned of."""
    from parallelisms.perf.calibrate import STAGES, calibrate

    check_writable("--out", args.out)
    cores, start = os.cpu_count() or 1, time.perf_counter()
    before = machine_load()
    busy = _warn_if_busy(before, cores, "before calibrating")

    def progress(stage: int) -> None:
        print(f"calibrate {stage + 1}/{len(STAGES)}: {STAGES[stage]} ({time.perf_counter() - start:.0f} s so far)",
              file=sys.stderr, flush=True)

    result = calibrate(args.quick, progress)
    after = machine_load()  # calibrate's own processes have ended: the last minute's load is mostly others' work
    if not busy:
        _warn_if_busy(after, cores, "while calibrating")
    result["measurements"]["load_average"] = {"before": before, "after": after, "cores": cores}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"peak {result['peak_tflops'] * 1e3:.1f} GFLOP/s per thread (k_half {result['gemm_k_half']:.0f}), "
          f"attention {result['attention_fraction']:.0%} of it (backward {result['attention_backward']:.2f}x the "
          f"forward), {result['op_overhead_us']:.1f} us per operator, "
          f"optimizer {result['optimizer_tbps'] * 1e3:.1f} GB/s + {result['optimizer_tensor_us']:.0f} us per tensor, "
          f"collectives {result['comm_cpu_fraction']:.0%} CPU (+{result['overlap_overhead_us']:.0f} us overlapped), "
          f"memory {result['hbm_tbps'] * 1e3:.1f} GB/s; "
          + ", ".join(f"{k} alpha {v['alpha_us']:.0f} us, {v['gbps']:.2f} GB/s" for k, v in result["collectives"].items()))
    print(f"wrote {args.out}")
    if args.json:
        print(json_line(result))
    return 0
