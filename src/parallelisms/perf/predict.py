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
    """Run every case ``args.rounds`` times and report each case's error as the median over its rounds of each
    round's own error (``bench predict``). Each round runs the cases in a rotated order, so no case always comes
    first. With ``--hardware calibrate`` (the default) this machine is measured at the start, and every round of
    every case is paired with a calibration taken around it, so that a slow minute slows both sides: the link
    rates the case depends on (:func:`link_groups`: its collective kinds, the meeting and the overlap overheads)
    measured just before it, the compute rates measured after every case and taken at the median of the three
    around it (:func:`_around`); the rest stay the start's. A preset or a ``parallelisms calibrate`` file is
    taken as given."""
    from parallelisms.device import choose
    from parallelisms.config import preset
    from parallelisms.support import validate_layout
    from parallelisms.perf.calibrate import calibration_pool
    from parallelisms.training import RunSpec, run_layout

    spec = getattr(args, "hardware", None) or "calibrate"
    start = _hardware(spec)
    cfg = preset(args.preset)
    train = TrainConfig(steps=args.steps, global_batch=args.global_batch, seq_len=args.seq_len, bucket_mb=args.bucket_mb)
    layouts = {name: validate_layout(cfg, train, ParallelConfig(dims, **options)) for name, (dims, options) in CASES.items()}
    calibrating = spec == "calibrate"
    depends = {name: link_groups(cfg, parallel, train, start) if calibrating else ()
               for name, parallel in layouts.items()}
    rounds = {name: [] for name in CASES}
    names, computed = list(layouts), [start]  # the compute calibrations: the start's, then one after each case
    with calibration_pool() if calibrating else contextlib.nullcontext() as pool:
        for round_ in range(args.rounds):
            for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                parallel = layouts[name]
                links = _measured_links(start, depends[name])
                report = run_layout(RunSpec(cfg, train, parallel), choose("cpu", parallel.dims.world_size), trace=True)
                computed.append(_recalibrated(start, pool) if pool else start)
                hw = _links_of(links, _around(computed[-3:]))
                c = compare(cfg, parallel, train, report, hw, report["spans"][0])
                with_start = predict_step(cfg, parallel, train, _links_of(start, hw))["step_s"]
                c["start_links_error"] = with_start / c["measured_s"] - 1
                rounds[name].append({**c, "calibration": calibration_figures(hw, depends[name])})
                print(f"round {round_ + 1} {name}: {_round_line(rounds[name][-1])}", flush=True)
    cases = [case_verdict(name, runs) for name, runs in rounds.items()]
    for case, runs in zip(cases, rounds.values()):
        shown = ", ".join(f"{r['predicted_s'] * 1e3:.1f}/{r['measured_s'] * 1e3:.1f} ({r['error']:+.1%})" for r in runs)
        print(f"{case['layout']}: {format_comparison(runs[case['median_round']])} (rounds, predicted/measured ms: "
              f"{shown}; links measured beside it: {', '.join(depends[case['layout']]) or 'none'})", flush=True)
    errors = [abs(c["error"]) for c in cases]
    ours, peer = (statistics.mean(c[k] for c in cases) for k in ("predicted_s", "measured_s"))
    return {"bench": "predict", "hardware": start.name, "cases": cases,
            "start": calibration_figures(start, tuple(start.collectives)),
            "compute_calibrations": [{k: calibration_figures(c, ())[k] for k in COMPUTE_FIGURES} for c in computed],
            "mean_error": statistics.mean(errors), "max_error": max(errors),
            "start_links_mean_error": statistics.mean(abs(c["start_links_error"]) for c in cases),
            "ours_s": ours, "peer": "measured step times", "peer_s": peer, "ratio": ours / peer}


def case_verdict(name: str, runs: list[dict]) -> dict:
    """A case's verdict from its rounds, each predicted with its own calibration: the error is the median of the
    rounds' errors (a round measured in a slow minute is predicted with that minute's rates), the step times
    the medians of each side; ``median_round`` is the round whose error is the (lower) median."""
    median = statistics.median
    by_error = sorted(range(len(runs)), key=lambda i: runs[i]["error"])
    return {"layout": name, "error": median(r["error"] for r in runs),
            "predicted_s": median(r["predicted_s"] for r in runs), "measured_s": median(r["measured_s"] for r in runs),
            "start_links_error": median(r["start_links_error"] for r in runs),
            "median_round": by_error[(len(runs) - 1) // 2],
            "rounds": [{k: r[k] for k in ("predicted_s", "measured_s", "error", "start_links_error", "calibration")}
                       for r in runs]}


def calibration_figures(hw: Hardware, groups: tuple[str, ...]) -> dict:
    """What a round was predicted with, in the units the calibration prints: the compute rates, the overheads
    and the collectives ``groups`` names (those measured beside the case)."""
    return {"gflops_per_thread": hw.peak_tflops * 1e3, "memory_gbps": hw.hbm_tbps * 1e3,
            "op_overhead_us": hw.op_overhead_us, "optimizer_gbps": hw.optimizer_tbps * 1e3,
            "meeting_overhead_us": hw.meeting_overhead_us, "overlap_overhead_us": hw.overlap_overhead_us,
            "comm_cpu_fraction": hw.comm_cpu_fraction, "links_measured": list(groups),
            "collectives": {k: dict(v) for k, v in hw.collectives.items() if k in groups}}


def _round_line(r: dict) -> str:
    """One round of a case as it is measured: its step times and error, and the calibration beside it."""
    cal = r["calibration"]
    links = "".join(f", {k} alpha {v['alpha_us']:.0f} us {v['gbps']:.2f} GB/s" for k, v in cal["collectives"].items())
    return (f"predicted/measured {r['predicted_s'] * 1e3:.1f}/{r['measured_s'] * 1e3:.1f} ms ({r['error']:+.1%}); "
            f"{cal['gflops_per_thread']:.1f} GFLOP/s per thread, memory {cal['memory_gbps']:.1f} GB/s, "
            f"{cal['op_overhead_us']:.2f} us per operator, meeting {cal['meeting_overhead_us']:.0f} us, "
            f"overlapped +{cal['overlap_overhead_us']:.0f} us{links}")


COMPUTE_FIGURES = ("gflops_per_thread", "memory_gbps", "op_overhead_us", "optimizer_gbps")
# a link group is worth measuring beside a case when doubling its cost moves the case's prediction by this much
LINK_SENSITIVITY = 0.02


def link_groups(cfg: ModelConfig, parallel: ParallelConfig, train: TrainConfig, hw: Hardware) -> tuple[str, ...]:
    """The link rates a case's prediction depends on: each collective kind of ``hw.collectives`` (its alpha
    doubled and bandwidth halved), ``meeting`` (``meeting_overhead_us``) and ``overlap``
    (``overlap_overhead_us``) whose doubled cost moves the predicted step by :data:`LINK_SENSITIVITY` or more."""
    base = predict_step(cfg, parallel, train, hw)["step_s"]
    slowed = {kind: {"collectives": {**hw.collectives,
                                     kind: {"alpha_us": 2 * row["alpha_us"], "gbps": row["gbps"] / 2}}}
              for kind, row in hw.collectives.items()}
    slowed["meeting"] = {"meeting_overhead_us": 2 * hw.meeting_overhead_us}
    slowed["overlap"] = {"overlap_overhead_us": 2 * hw.overlap_overhead_us}
    moved = {group: predict_step(cfg, parallel, train, dataclasses.replace(hw, **keys))["step_s"] / base - 1
             for group, keys in slowed.items()}
    return tuple(group for group, change in moved.items() if change >= LINK_SENSITIVITY)


RATES = ("peak_tflops", "hbm_tbps", "gemm_k_half", "op_overhead_us", "attention_fraction", "attention_backward",
         "optimizer_tbps", "optimizer_tensor_us")
LINKS = ("intra_node_gbps", "inter_node_gbps", "intra_latency_us", "inter_latency_us", "comm_cpu_fraction",
         "meeting_overhead_us", "overlap_overhead_us")


def _links_of(source: Hardware, hw: Hardware) -> Hardware:
    """``hw`` with ``source``'s collectives and links."""
    return dataclasses.replace(hw, **{k: getattr(source, k) for k in (*LINKS, "collectives")})


def _around(measured: list[Hardware]) -> Hardware:
    """The last of ``measured`` (the calibrations nearest a case: the one before the previous case's, the one
    just before it and the one just after it) with every compute rate (:data:`RATES`) at their median: a shared
    machine's speed drifts within a minute, and a three-repeat calibration now and then misfits a rate (the
    memory line's slope lost in the noise: a bandwidth many times the machine's), so the median of the three
    around the case follows the drift and drops such a one."""
    return dataclasses.replace(measured[-1], **{k: statistics.median(getattr(hw, k) for hw in measured) for k in RATES})


def _recalibrated(hw: Hardware, pool) -> Hardware:
    """``hw`` with each rank's own rates measured again (GEMMs, memory, attention, optimizer, dispatch, with
    every core measuring at once in ``pool``; three repeats, about 4 s)."""
    from parallelisms.perf.calibrate import calibrate_shared

    return dataclasses.replace(hw, **calibrate_shared(3, pool)[0])


def _measured_links(hw: Hardware, groups: tuple[str, ...]) -> Hardware:
    """``hw`` with the link ``groups`` (:func:`link_groups`) measured again: the collective kinds named (two
    ranks, 2-3 s a kind and the launch), the meetings of ranks outnumbering the cores (about 15 s), the
    overlapped calls' worker overhead (about 6 s)."""
    from parallelisms.perf.calibrate_comm import (KINDS, collective_keys, measure_collectives,
                                                 measure_meeting_overhead, measure_overlap_overhead)

    keys = {}
    kinds = [kind for kind in KINDS if kind in groups]
    if kinds:
        keys = collective_keys(measure_collectives([2**k for k in range(8, 23, 2)], 9, kinds))
        keys["collectives"] = {**hw.collectives, **keys["collectives"]}
    if "meeting" in groups:
        keys["meeting_overhead_us"] = measure_meeting_overhead() * 1e6
    if "overlap" in groups:
        keys["overlap_overhead_us"] = measure_overlap_overhead() * 1e6
    return dataclasses.replace(hw, **keys)


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
