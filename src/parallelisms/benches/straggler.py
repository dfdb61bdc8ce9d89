"""``bench straggler``: data parallelism with one slowed rank (``--slow-rank 1:1.5``), the even split against
``--dp-balance measured``, and both against the ideal proportional split, at dp 2 and dp 4.

Each case is a training run (``train.run_layout``: real processes, the straggler report on); the step time is
the run's median, the first measured split applied after step 2. The ideal: with rank speeds 1 and 1/F, a
proportional split takes dp / (dp - 1 + 1/F) of the unslowed run's step (the whole step scaled as if it were
compute, which overstates it a little: the optimizer is not split). ``ours`` is the balanced run, ``peer``
the even split; ``ratio`` below 1 is the time balance saves.
"""

from __future__ import annotations

from parallelisms.bench import bench
from parallelisms.config import ParallelConfig, TrainConfig, preset
from parallelisms.mesh import ParallelDims

SLOW = (1, 1.5)


def _step_s(model, train: TrainConfig, dp: int, balance: str) -> tuple[float, dict]:
    from parallelisms.device import choose
    from parallelisms.train import RunSpec, run_layout

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
