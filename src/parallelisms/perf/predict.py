"""Predicted against measured on this machine: ``train --predict`` (the run just done) and
``parallelisms bench predict`` (six layouts: dp, tp with sp, pp 1f1b, ZeRO-3, cp ring, a 3-D mix), each
predicted by perf/step.py on the ``cpu`` hardware (or ``--hardware FILE`` from ``parallelisms calibrate``).

Measured step time: the train report's median (first step left out); phase times: rank 0's forward,
backward and optimizer spans per step, medians over the same steps (the pipeline runtime records its own
phases); bytes: the ledger."""

from __future__ import annotations

import contextlib
import dataclasses
import statistics

from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig
from parallelisms.mesh import ParallelDims
from parallelisms.perf.hardware import Hardware
from parallelisms.perf.model import microbatches_per_step, predicted_comm_by_kind
from parallelisms.perf.step import predict_step

PHASES = ("forward", "backward", "optimizer")


def _measured_phases(report: dict, spans: list) -> dict:
    """Seconds per step of each phase: its spans summed step by step (each step records as many), the median
    over the steps the step time's median is taken over (all but the first)."""
    out = {}
    for name in PHASES:
        durations = [(s.end - s.start) / 1e9 for s in spans if getattr(s, "name", None) == name]
        per_step = len(durations) // report["steps"]
        if per_step:
            sums = [sum(durations[i:i + per_step]) for i in range(0, per_step * report["steps"], per_step)]
            out[name] = statistics.median(sums[1:] or sums)
    return out


def compare(cfg: ModelConfig, parallel: ParallelConfig, train: TrainConfig, report: dict, hw: Hardware,
            spans: list = ()) -> dict:
    """Predicted and measured step time, phases (from rank 0's timeline ``spans``), bytes per collective kind
    and memory of one run."""
    predicted = predict_step(cfg, parallel, train, hw)
    stage = predicted["per_microbatch_stage_s"]
    m = microbatches_per_step(parallel, train)
    phases = {"forward": m * stage["forward"], "backward": m * (stage["input_grad"] + stage["weight_grad"]),
              "optimizer": predicted["time_breakdown"]["optimizer"]}
    measured_phases = _measured_phases(report, spans)
    comm = predicted_comm_by_kind(cfg, parallel, train, parallel.mixed_precision.compute_bytes)
    ranks = report.get("memory_per_rank") or [report.get("memory") or {}]
    mem = predicted["memory_per_rank"]
    return {
        "layout": parallel.dims.describe(), "predicted_s": predicted["step_s"], "measured_s": report["step_time_s"],
        "error": predicted["step_s"] / report["step_time_s"] - 1,
        "phases": {k: {"predicted_s": phases[k], "measured_s": measured_phases.get(k)} for k in PHASES},
        "bytes": {k: {"predicted": v, "measured": report["comm"].get(k, {}).get("bytes_per_rank")} for k, v in comm.items()},
        "memory": {"predicted_model_states": mem["params"] + mem["grads"] + mem["optimizer"],
                   "measured_model_states": max(r.get("persistent", 0) for r in ranks),
                   "predicted_total": mem["total"], "measured_process_peak": max(r.get("process_peak") or 0 for r in ranks)},
    }


def format_comparison(c: dict) -> str:
    phases = ", ".join(f"{k} {v['predicted_s'] * 1e3:.1f}/{v['measured_s'] * 1e3:.1f} ms" if v["measured_s"] is not None
                       else f"{k} {v['predicted_s'] * 1e3:.1f}/- ms" for k, v in c["phases"].items())
    kinds = ", ".join(f"{k} {v['predicted'] / 1e3:,.1f}/{(v['measured'] or 0) / 1e3:,.1f} kB" for k, v in c["bytes"].items())
    mem = {k: v / 2**20 for k, v in c["memory"].items()}
    return (f"predicted/measured: step {c['predicted_s'] * 1e3:.1f}/{c['measured_s'] * 1e3:.1f} ms ({c['error']:+.1%}); "
            f"{phases}; {kinds or 'no communication'}; model states {mem['predicted_model_states']:,.1f}/"
            f"{mem['measured_model_states']:,.1f} MiB; peak {mem['predicted_total']:,.1f} MiB predicted, process "
            f"{mem['measured_process_peak']:,.1f} MiB (with the interpreter)")


# name: (dims, options); the small preset, global batch 8, sequence 128
CASES = {
    "dp2": (ParallelDims(dp_replicate=2), {}),
    "tp2_sp": (ParallelDims(tp=2), {"sequence_parallel": True}),
    "pp2_1f1b": (ParallelDims(pp=2), {"schedule": "1f1b", "microbatches": 4}),
    "zero3_dp2": (ParallelDims(dp_shard=2), {"zero": 3}),
    "cp2_ring": (ParallelDims(cp=2), {"cp_attention": "ring"}),
    "dp2_tp2_pp2": (ParallelDims(dp_replicate=2, tp=2, pp=2), {"sequence_parallel": True, "microbatches": 4}),
}


def bench_predict(args) -> dict:
    """Run every case ``args.rounds`` times, predict it, and report each case's error at its median round
    (``bench predict``). Each round runs the cases in a rotated order, so no case always comes first. The
    hardware is this machine measured at the start of the run, its compute rates measured again after every
    case and its collectives after every round (``--hardware calibrate``, the default: each case is predicted
    with the compute rates around it, :func:`_bracketed`, and the collectives' median over the run,
    :func:`_pooled_links`), a preset or a ``parallelisms calibrate`` file."""
    from parallelisms.device import choose
    from parallelisms.config import preset
    from parallelisms.support import validate_layout
    from parallelisms.perf.calibrate import calibration_pool
    from parallelisms.training import RunSpec, run_layout

    spec = getattr(args, "hardware", None) or "calibrate"
    hw = _hardware(spec)
    cfg = preset(args.preset)
    train = TrainConfig(steps=args.steps, global_batch=args.global_batch, seq_len=args.seq_len, bucket_mb=args.bucket_mb)
    layouts = {name: validate_layout(cfg, train, ParallelConfig(dims, **options)) for name, (dims, options) in CASES.items()}
    runs = {name: [] for name in CASES}
    names, done, links = list(layouts), [], [hw]
    with calibration_pool() if spec == "calibrate" else contextlib.nullcontext() as pool:
        for round_ in range(args.rounds):
            for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                parallel, before = layouts[name], hw
                report = run_layout(RunSpec(cfg, train, parallel), choose("cpu", parallel.dims.world_size), trace=True)
                hw = _recalibrated(hw, collectives=False, pool=pool) if pool else hw
                done.append((name, report, before, hw))
            if pool:
                hw = _recalibrated(hw, collectives=True)
                links.append(hw)
    pooled = _pooled_links(links)
    print(f"collectives, median of {len(links)} calibration(s): meeting overhead {pooled.meeting_overhead_us:.0f} us, "
          f"overlapped +{pooled.overlap_overhead_us:.0f} us; "
          + ", ".join(f"{k} alpha {v['alpha_us']:.0f} us, {v['gbps']:.2f} GB/s" for k, v in pooled.collectives.items()),
          flush=True)
    for name, report, before, after in done:  # compute rates around the case, collectives pooled over the run
        measured = _links_of(pooled, _bracketed(before, after))
        runs[name].append(compare(cfg, layouts[name], train, report, measured, report["spans"][0]))
    cases = []
    for name, comparisons in runs.items():
        c = sorted(comparisons, key=lambda c: c["measured_s"])[(len(comparisons) - 1) // 2]  # the median round
        rounds = ", ".join(f"{r['measured_s'] * 1e3:.1f}" for r in comparisons)
        print(f"{name}: {format_comparison(c)} (rounds: {rounds} ms)", flush=True)
        cases.append({"layout": name, "predicted_s": c["predicted_s"], "measured_s": c["measured_s"], "error": c["error"],
                      "measured_rounds_s": [r["measured_s"] for r in comparisons]})
    errors = [abs(c["error"]) for c in cases]
    mean = statistics.mean(errors)
    return {"bench": "predict", "hardware": hw.name, "cases": cases,
            "collectives": {"meeting_overhead_us": pooled.meeting_overhead_us,
                            "overlap_overhead_us": pooled.overlap_overhead_us, **pooled.collectives}, "mean_error": mean, "max_error": max(errors),
            "ours_s": statistics.mean(c["predicted_s"] for c in cases), "peer": "measured step times",
            "peer_s": statistics.mean(c["measured_s"] for c in cases),
            "ratio": statistics.mean(c["predicted_s"] for c in cases) / statistics.mean(c["measured_s"] for c in cases)}


RATES = ("peak_tflops", "hbm_tbps", "gemm_k_half", "op_overhead_us", "attention_fraction", "attention_backward",
         "optimizer_tbps", "optimizer_tensor_us")
LINKS = ("intra_node_gbps", "inter_node_gbps", "intra_latency_us", "inter_latency_us", "comm_cpu_fraction",
         "meeting_overhead_us", "overlap_overhead_us")


def _links_of(source: Hardware, hw: Hardware) -> Hardware:
    """``hw`` with ``source``'s collectives and links."""
    return dataclasses.replace(hw, **{k: getattr(source, k) for k in (*LINKS, "collectives")})


def _pooled_links(measured: list[Hardware]) -> Hardware:
    """The first of ``measured`` with every link key (:data:`LINKS`) and each collective kind's alpha and
    bandwidth at their median over all of them: these measurements scatter from one launch to the next (an
    all-reduce's alpha 1.5-2x, the meeting overhead 270-580 us) more than the machine drifts, so the run's
    median (the start's and one per round) describes every case better than the two around it."""
    median = statistics.median
    out = {k: median(getattr(hw, k) for hw in measured) for k in LINKS}
    out["collectives"] = {kind: {k: median(hw.collectives[kind][k] for hw in measured) for k in row}
                          for kind, row in measured[0].collectives.items()}
    return dataclasses.replace(measured[0], **out)


def _bracketed(before: Hardware, after: Hardware) -> Hardware:
    """``before`` with every compute rate (:data:`RATES`) at the geometric mean of the measurements just before
    and just after a run: a shared machine's speed drifts within seconds (consecutive calibrations here: GEMMs
    78-92 GFLOP/s, memory 10-17 GB/s), and two measurements around the run describe it better than one before
    it. The collectives are pooled over the whole run instead (:func:`_pooled_links`)."""
    return dataclasses.replace(before, **{k: (getattr(before, k) * getattr(after, k)) ** 0.5 for k in RATES})


def _recalibrated(hw: Hardware, collectives: bool, pool=None) -> Hardware:
    """``hw`` with each rank's own rates measured again (GEMMs, memory, attention, optimizer, dispatch, with
    every core measuring at once; three repeats, about 4 s), or with the collectives measured again (two ranks,
    about 10 s), the meetings of ranks outnumbering the cores (about 15 s) and the overlapped calls' worker
    overhead (about 6 s)."""
    from parallelisms.perf.calibrate import calibrate_shared
    from parallelisms.perf.calibrate_comm import (collective_keys, measure_collectives, measure_meeting_overhead,
                                                 measure_overlap_overhead)

    if collectives:
        return dataclasses.replace(hw, **collective_keys(measure_collectives([2**k for k in range(8, 23, 2)], 9)),
                                   meeting_overhead_us=measure_meeting_overhead() * 1e6,
                                   overlap_overhead_us=measure_overlap_overhead() * 1e6)
    return dataclasses.replace(hw, **calibrate_shared(3, pool)[0])


def _hardware(spec: str) -> Hardware:
    """``calibrate``: this machine measured now (``parallelisms calibrate``); else a preset or a hardware file."""
    from parallelisms.perf.hardware import load_hardware

    if spec != "calibrate":
        return load_hardware(spec)
    from parallelisms.perf.calibrate import calibrate

    return _announced("calibrated", Hardware(**calibrate()))


def _announced(what: str, hw: Hardware) -> Hardware:
    print(f"{what}: {hw.peak_tflops * 1e3:.1f} GFLOP/s per thread, memory {hw.hbm_tbps * 1e3:.1f} GB/s", flush=True)
    return hw
