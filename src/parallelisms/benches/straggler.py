"""``bench straggler``: data parallelism with one slowed rank (``--slow-rank 1:1.5``), the even split against
``--dp-balance measured``, and both against the ideal proportional split, at dp 2 and dp 4.

Each case is a training run (``train.run_layout``: real processes, the straggler report on); the step time is
the run's median, the first measured split applied after step 2. The ideal: with rank speeds 1 and 1/F, a
proportional split takes dp / (dp - 1 + 1/F) of the unslowed run's step (the whole step scaled as if it were
compute, which overstates it a little: the optimizer is not split). ``ours`` is the balanced run, ``peer``
the even split; ``ratio`` below 1 is the time balance saves.
"""

from __future__ import annotations

import statistics

from parallelisms.bench import bench
from parallelisms.config import ParallelConfig, TrainConfig, preset
from parallelisms.mesh import ParallelDims

SLOW = (1, 1.5)


def _step_s(model, train: TrainConfig, dp: int, balance: str) -> tuple[float, dict]:
    from parallelisms.device import choose
    from parallelisms.training import RunSpec, run_layout

    parallel = ParallelConfig(dims=ParallelDims(dp_replicate=dp), dp_balance=balance)
    report = run_layout(RunSpec(model, train, parallel), choose("cpu", dp))
    return report["step_time_s"], report


@bench("straggler")
def bench_straggler(args) -> dict:
    model = preset(args.preset).validate()
    rows = {}
    for dp in (2, 4):
        train = TrainConfig(steps=max(args.steps, 8), global_batch=max(args.global_batch, 4 * dp), seq_len=args.seq_len,
                            bucket_mb=args.bucket_mb)
        even_s, _ = _step_s(model, train, dp, "even")
        slow_s, slow = _step_s(model, train.replace(slow_rank=SLOW), dp, "even")
        balanced_s, balanced = _step_s(model, train.replace(slow_rank=SLOW), dp, "measured")
        ideal_s = even_s * dp / (dp - 1 + 1 / SLOW[1])
        rows[f"dp{dp}"] = {"unslowed_s": even_s, "slowed_even_s": slow_s, "slowed_balanced_s": balanced_s,
                           "ideal_s": ideal_s, "balanced_over_ideal": balanced_s / ideal_s,
                           "split": balanced["dp_balance"]["split"],
                           "straggler_even": slow["stragglers"]["dims"].get("dp", {}).get("rank"),
                           "others_waited_even_s": slow["stragglers"]["dims"].get("dp", {}).get("wait_s_per_step"),
                           "others_waited_balanced_s":
                               balanced["stragglers"]["dims"].get("dp", {}).get("wait_s_per_step")}
        r = rows[f"dp{dp}"]
        print(f"dp {dp}, rank 1 at 1/{SLOW[1]:g} speed: even split {slow_s * 1e3:.1f} ms, measured split {r['split']} "
              f"{balanced_s * 1e3:.1f} ms, ideal {ideal_s * 1e3:.1f} ms ({r['balanced_over_ideal']:.2f}x), unslowed "
              f"{even_s * 1e3:.1f} ms")
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
