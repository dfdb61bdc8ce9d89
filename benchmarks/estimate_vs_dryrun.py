"""``estimate`` against the dry run (the real code on fake tensors) over a matrix of layouts of the real presets at
64 to 16,384 GPUs: memory per rank (the busiest rank class's peak) and bytes per collective per step (rank 0),
as ``parallelisms estimate --check`` prints them for one layout (docs/performance-model.md, "Memory per rank").

Each row prints one JSON line; the end prints the table of memory differences (max and mean absolute) and the
rows whose collectives differ. Rows run cheapest first; ``--only SUBSTRING`` keeps matching rows, ``--limit-s``
stops starting rows after that many seconds (a dry run of a large pipeline layout takes minutes here),
``--start N`` skips the first N rows, ``--quick`` leaves out the rows marked :data:`SLOW`.

    PYTHONPATH=src python3 benchmarks/estimate_vs_dryrun.py [--quick] [--only llama3-8b] [--limit-s 1800]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

# the rows whose dry run takes longest (split backward's weight passes are not replayed; all-gather attention's
# masks are built for real), and rows whose mechanisms a quicker row covers: what ``--quick`` leaves out (the
# other 23 rows take about 9 minutes)
SLOW = "slow"

# (preset, GPUs, layout flags[, SLOW]): dp, ZeRO-1/2/3, every FSDP strategy and style, tp, sp, every cp mode, ep,
# pipeline schedules, recompute modes; one sequence per microbatch, bf16 mixed precision
MATRIX = [
    ("llama3-8b", 64, "--dp 64 --zero 1"),
    ("llama3-8b", 64, "--dp 64 --zero 2"),
    ("llama3-8b", 64, "--dp 64 --zero 3"),
    ("llama3-8b", 64, "--dp 64 --fsdp full_shard"),
    ("llama3-8b", 64, "--dp 64 --fsdp shard_grad_op"),
    ("llama3-8b", 64, "--dp 64 --fsdp full_shard --fsdp-style per_param"),
    ("llama3-8b", 64, "--dp 64 --fsdp full_shard --fsdp-style reuse"),
    ("llama3-8b", 64, "--dp-replicate 8 --dp-shard 8 --fsdp hybrid_shard"),
    ("llama3-8b", 64, "--dp 64 --fsdp full_shard --recompute full"),
    ("llama3-8b", 64, "--dp 64 --fsdp full_shard --recompute selective"),
    ("llama3-8b", 64, "--dp 8 --tp 8 --zero 1"),
    ("llama3-8b", 64, "--dp 8 --tp 8 --sp --zero 1 --recompute full"),
    ("llama3-8b", 64, "--dp 8 --cp 8 --zero 1"),
    ("llama3-8b", 64, "--dp 8 --cp 8 --cp-attention ulysses --zero 1"),
    ("llama3-8b", 64, "--dp 8 --cp 8 --cp-attention allgather --zero 1", SLOW),
    ("llama3-8b", 64, "--dp 8 --cp 8 --cp-attention hierarchical --cp-ulysses-size 4 --zero 1", SLOW),
    ("llama3-8b", 64, "--dp 8 --tp 8 --sp"),
    ("llama3-70b", 256, "--dp 32 --tp 8 --sp --fsdp full_shard --fsdp-style per_param --recompute full"),
    ("llama3-70b", 256, "--dp 8 --tp 8 --pp 4 --sp --zero 1"),
    ("llama3-70b", 256, "--dp 8 --tp 8 --pp 4 --sp --zero 1 --schedule gpipe", SLOW),
    ("llama3-70b", 256, "--dp 8 --tp 8 --pp 4 --sp --zero 1 --schedule zb-h1"),
    ("llama3-70b", 256, "--dp 8 --tp 8 --pp 4 --sp --zero 1 --schedule zb-v", SLOW),
    ("llama3-70b", 256, "--dp 8 --tp 8 --pp 4 --sp --zero 1 --schedule dualpipev", SLOW),
    ("llama3-70b", 1024, "--dp 16 --tp 8 --pp 8 --sp --zero 1 --schedule interleaved --chunks 2"),
    ("deepseek-v3-moe", 512, "--dp 64 --ep 64 --tp 8 --sp --zero 1 --recompute full"),
    ("deepseek-v3-moe", 512, "--dp 64 --ep 64 --tp 8 --sp --fsdp full_shard --recompute full"),
    ("llama3-405b", 1024, "--dp 128 --tp 8 --sp --fsdp full_shard --fsdp-style per_param --recompute full"),
    ("llama3-405b", 2048, "--dp-replicate 2 --dp-shard 128 --tp 8 --sp --fsdp hybrid_shard --recompute full"),
    ("llama3-405b", 2048, "--dp 16 --tp 8 --pp 16 --sp --zero 1", SLOW),
    ("llama3-405b", 2048, "--dp 16 --tp 8 --pp 16 --sp --zero 1 --schedule zb-v", SLOW),
    ("llama3-405b", 16384, "--dp 128 --tp 8 --pp 16 --sp --zero 1 --schedule interleaved --chunks 2", SLOW),
]


def _argv(preset: str, flags: str) -> list[str]:
    seq = "4096" if preset.startswith("deepseek") else "8192"
    argv = ["--preset", preset, "--seq-len", seq, "--mixed-precision", "bf16", *flags.split()]
    dims = {k: 1 for k in ("dp", "tp", "pp", "cp")}
    words = flags.split()
    for k in dims:
        if f"--{k}" in words:
            dims[k] = int(words[words.index(f"--{k}") + 1])
    if "--dp-replicate" in words:
        dims["dp"] = int(words[words.index("--dp-replicate") + 1]) * int(words[words.index("--dp-shard") + 1])
    if "--pp" not in words and "--dp" not in words and "--dp-replicate" not in words:
        argv += ["--dp", "1"]
    # V-shaped schedules (ZB-V, DualPipeV) need 2pp - 1 microbatches or more: 2pp
    microbatches = dims["pp"] * (2 if "dualpipe" in flags or "zb-v" in flags else 1) if dims["pp"] > 1 else 1
    argv += ["--global-batch", str(dims["dp"] * microbatches)]
    if dims["pp"] > 1:
        argv += ["--microbatches", str(microbatches)]
    return argv


def row(preset: str, gpus: int, flags: str) -> dict:
    from parallelisms.api import configure
    from parallelisms.estimate_check import check
    from parallelisms.perf.estimate import estimate
    from parallelisms.perf.hardware import load_hardware

    cfg = configure(_argv(preset, flags))
    assert cfg.layout.dims.world_size == gpus, (preset, flags, cfg.layout.dims.world_size)
    began = time.perf_counter()
    est = estimate(cfg.model, cfg.layout, cfg.train, load_hardware("h100"))
    out = check(cfg.model, cfg.layout, cfg.train, est["memory_per_rank"])
    differing = {k: v for k, v in out["collectives"].items() if v["difference"]}
    return {"preset": preset, "gpus": gpus, "layout": flags,
            "estimate_gib": out["memory"]["total"]["estimate"] / 2**30,
            "dry_run_gib": out["memory"]["total"]["dry_run"] / 2**30,
            "memory_difference": out["memory"]["total"]["relative"], "collectives_equal": out["collectives_ok"],
            "collectives_differing": differing, "peak": f"{out['peak_phase']}/{out['peak_module']}",
            "seconds": time.perf_counter() - began}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run the rows whose preset or layout contains this")
    parser.add_argument("--limit-s", type=float, default=float("inf"), help="start no row after this many seconds")
    parser.add_argument("--start", type=int, default=0, help="skip the matrix's first rows")
    parser.add_argument("--quick", action="store_true", help="leave out the slowest rows (SLOW)")
    args = parser.parse_args()
    began, rows = time.perf_counter(), []
    for preset, gpus, flags, *slow in MATRIX[args.start:]:
        if args.only not in f"{preset} {flags}" or (args.quick and slow):
            continue
        if time.perf_counter() - began > args.limit_s:
            print(json.dumps({"skipped": f"{preset} {gpus} {flags}"}), flush=True)
            continue
        try:
            rows.append(row(preset, gpus, flags))
        except Exception as exc:  # noqa: BLE001 -- a layout the dry run cannot follow: say so, go on
            print(json.dumps({"failed": f"{preset} {gpus} {flags}", "error": f"{type(exc).__name__}: {exc}"[:300]}),
                  flush=True)
            continue
        print(json.dumps(rows[-1]), flush=True)
    if rows:
        diffs = [abs(r["memory_difference"]) for r in rows]
        print(f"{len(rows)} rows: memory per rank |estimate / dry run - 1| max {max(diffs):.1%}, mean "
              f"{statistics.fmean(diffs):.1%}; collectives equal in {sum(r['collectives_equal'] for r in rows)}")


if __name__ == "__main__":
    main()
