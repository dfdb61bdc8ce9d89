"""``bench straggler``: data parallelism with one slowed rank (``--slow-rank 1:1.5``), the even split against
``--dp-balance measured``, and both against the ideal proportional split, at dp 2 and dp 4.

Each case is a training run (real processes on the CPU, the straggler report on), rank r held on core r mod cores
(:func:`_pinned`: at dp 4 on two cores, two ranks a core); the three cases of a degree (unslowed, slowed with the
even split, slowed and balanced) alternate over ``--rounds`` rounds, so drift on a shared machine hits all three
alike, and each figure is the median over rounds of the run's median step.
The balanced run's first split is measured over steps 2-4 and settles over the next few
(:mod:`parallelisms.parallel.dp_balance`), so at least 24 steps leave its median on the settled split. The global
batch is at least 8 x dp sequences: a split is in whole sequences (each is one causal context, so tokens cannot
move between ranks), and at 4 x dp the best whole split at dp 4 ([4, 3, 4, 5] or [5, 3, 4, 4] for 4.36 / 2.91
each) leaves a fast rank 15% over the proportional share, at 8 x dp ([9, 6, 9, 8] for 8.73 / 5.82) 3%. The ideal: with rank speeds 1 and 1/F, a proportional split takes
dp / (dp - 1 + 1/F) of the unslowed run's step (the whole step scaled as if it were compute, which overstates it
a little: the optimizer is not split). ``ours`` is the balanced run, ``peer`` the even split; ``ratio`` below 1
is the time balance saves.
"""

from __future__ import annotations

import os
import statistics

from parallelisms.bench import bench
from parallelisms.config import ParallelConfig, TrainConfig, preset
from parallelisms.mesh import ParallelDims

SLOW = (1, 1.5)
CASES = {"unslowed": (None, "even"), "slowed_even": (SLOW, "even"), "slowed_balanced": (SLOW, "measured")}


def _pinned(info, spec) -> dict | None:
    """``train_rank`` with rank r held on core r mod cores, so that every core holds as many ranks: left to the
    scheduler, ranks beyond the cores share them unevenly (three on one core, one alone), a rank's measured speed is
    its core's share, and the split made from it no longer fits once the scheduler moves the ranks."""
    from parallelisms.training import train_rank

    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[info.rank % len(cores)]})
    return train_rank(info, spec)


def _run(model, train: TrainConfig, dp: int, balance: str) -> dict:
    from parallelisms.launch import launch
    from parallelisms.training import RunSpec

    parallel = ParallelConfig(dims=ParallelDims(dp_replicate=dp), dp_balance=balance)
    return launch(_pinned, dp, RunSpec(model, train, parallel), backend="gloo", timeout_s=train.timeout_s)[0]


@bench("straggler")
def bench_straggler(args) -> dict:
    model = preset(args.preset).validate()
    rows = {}
    for dp in (2, 4):
        train = TrainConfig(steps=max(args.steps, 24), global_batch=max(args.global_batch, 8 * dp),
                            seq_len=args.seq_len, bucket_mb=args.bucket_mb)
        times, last = {name: [] for name in CASES}, {}
        for _ in range(args.rounds):
            for name, (slow, balance) in CASES.items():
                last[name] = _run(model, train.replace(slow_rank=slow), dp, balance)
                times[name].append(last[name]["step_time_s"])
        median = {name: statistics.median(t) for name, t in times.items()}
        ideal_s = median["unslowed"] * dp / (dp - 1 + 1 / SLOW[1])
        waits = {name: last[name]["stragglers"]["dims"].get("dp", {}) for name in ("slowed_even", "slowed_balanced")}
        rows[f"dp{dp}"] = {**{f"{name}_s": median[name] for name in CASES}, "rounds_s": times, "ideal_s": ideal_s,
                           "balanced_over_ideal": median["slowed_balanced"] / ideal_s,
                           "splits": last["slowed_balanced"]["dp_balance"]["splits"],
                           "straggler_even": waits["slowed_even"].get("rank"),
                           "others_waited_even_s": waits["slowed_even"].get("wait_s_per_step"),
                           "others_waited_balanced_s": waits["slowed_balanced"].get("wait_s_per_step")}
        r = rows[f"dp{dp}"]
        print(f"dp {dp}, rank 1 at 1/{SLOW[1]:g} speed (median of {args.rounds} rounds): even split "
              f"{median['slowed_even'] * 1e3:.1f} ms, measured split {r['splits'][-1]} "
              f"{median['slowed_balanced'] * 1e3:.1f} ms, ideal {ideal_s * 1e3:.1f} ms "
              f"({r['balanced_over_ideal']:.2f}x), unslowed {median['unslowed'] * 1e3:.1f} ms; rounds "
              + ", ".join(f"{name} " + "/".join(f"{t * 1e3:.0f}" for t in ts) for name, ts in times.items()))
    return {"bench": "straggler", "slow_rank": list(SLOW), "cases": rows, "ours": "dp balance measured",
            "ours_s": rows["dp2"]["slowed_balanced_s"], "peer": "even split", "peer_s": rows["dp2"]["slowed_even_s"],
            "ratio": rows["dp2"]["slowed_balanced_s"] / rows["dp2"]["slowed_even_s"]}


@bench("straggler-cost")
def bench_straggler_cost(args) -> dict:
    """The straggler report's cost, A/B: data parallelism at dp 2 with the report on and off
    (``RunSpec.straggler_report``), each with and without a metrics file, alternating in rounds so drift on a
    shared machine hits all four alike. The figure is the loop's time a step (``loop_time_s``: from the second
    step's start to after the last hand-over, everything between steps included), median over rounds; ``ours``
    is the report on, ``peer`` off. The report's own measure of its cost is shown next to it."""
    import tempfile

    from parallelisms.device import choose
    from parallelisms.training import RunSpec, run_layout

    model = preset(args.preset).validate()
    train = TrainConfig(steps=max(args.steps, 40), global_batch=args.global_batch, seq_len=args.seq_len,
                        bucket_mb=args.bucket_mb)
    parallel = ParallelConfig(dims=ParallelDims(dp_replicate=2))
    loop, cost = {}, {}
    with tempfile.TemporaryDirectory() as folder:
        cases = {"off": (False, None), "on": (True, None), "off_metrics": (False, f"{folder}/off.jsonl"),
                 "on_metrics": (True, f"{folder}/on.jsonl")}
        for _ in range(args.rounds):
            for name, (on, metrics) in cases.items():
                report = run_layout(RunSpec(model, train, parallel, metrics_path=metrics, straggler_report=on),
                                    choose("cpu", 2))
                loop.setdefault(name, []).append(report["loop_time_s"])
                if on:
                    cost.setdefault(name, []).append(report["stragglers"]["cost_s_per_step"])
    median = {name: statistics.median(times) for name, times in loop.items()}
    rows = {}
    for with_metrics in (False, True):
        on, off = ("on_metrics", "off_metrics") if with_metrics else ("on", "off")
        rows[on] = {"loop_on_s": median[on], "loop_off_s": median[off], "ab_fraction": median[on] / median[off] - 1,
                    "self_measured_s": statistics.median(cost[on]),
                    "self_measured_fraction": statistics.median(cost[on]) / median[on]}
        r = rows[on]
        print(f"report {'with' if with_metrics else 'without'} a metrics file: loop {r['loop_on_s'] * 1e3:.2f} ms a "
              f"step on, {r['loop_off_s'] * 1e3:.2f} ms off (A/B {r['ab_fraction']:+.1%}, rounds: "
              f"{', '.join(f'{a * 1e3:.1f}/{b * 1e3:.1f}' for a, b in zip(loop[on], loop[off]))}); its own measure "
              f"{r['self_measured_s'] * 1e3:.2f} ms a step ({r['self_measured_fraction']:.2%})")
    return {"bench": "straggler-cost", "cases": rows, "ours": "report on", "ours_s": median["on"],
            "peer": "report off", "peer_s": median["off"], "ratio": median["on"] / median["off"]}
