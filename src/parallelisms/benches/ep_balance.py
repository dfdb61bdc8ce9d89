"""``bench ep-balance``: a skewed router (a fixed logit bias toward the first quarter of the experts, which plain
expert parallelism puts all on rank 0) and experts 8 x dim wide (so that their compute leads the step), at ep 2
and ep 4: experts split evenly (``--ep-balance even``) against
``--ep-balance measured`` without and with redundant experts (``--ep-redundant 1``).

Each case is a training run (``train.run_layout``: real processes, timeline on); the step time is the run's
median (the first measured placement applies after step 2). The exposed all-to-all is, per rank, the time in
the expert all-to-alls (dispatch, combine and their backward) not hidden under compute, the median over the
measured steps, the slowest rank's; the all-to-all wait is the straggler report's ``ep`` figure: how long the
other ranks waited a step for the most waited-for rank at the ep collectives. ``ours`` is the balanced run with
redundant experts, ``peer`` the even split.
"""

from __future__ import annotations

import dataclasses

from parallelisms.bench import bench
from parallelisms.config import ParallelConfig, TrainConfig, preset
from parallelisms.errors import require
from parallelisms.mesh import ParallelDims

SKEW = 3.0  # logit bias toward the hot experts: most tokens pick them (top-2 of 8: experts 0 and 1)
FFN_PER_DIM = 8  # the experts' hidden width over the model's: expert compute, which balance moves, leads the step
CASES = {"even": ("even", 0), "measured": ("measured", 0), "measured_redundant1": ("measured", 1)}


def exposed_all_to_all_s(spans: list) -> float:
    """The median over the measured steps (all but the first) of one rank's time in expert all-to-alls (over
    ``ep`` and ``ep_bwd``) with no compute running; a step runs from its forward's start to its optimizer's end
    (the placement's moves, between steps, are left out)."""
    import statistics

    from parallelisms.comm.trace import Timeline

    starts = sorted(s.start for s in spans if s.name == "forward")
    ends = sorted(s.end for s in spans if s.name == "optimizer")
    kept = [s for s in spans if s.cat != "comm" or (s.name.startswith("all_to_all") and
                                                    s.args.get("dim") in ("ep", "ep_bwd"))]
    timeline = Timeline(0)
    return statistics.median(timeline.overlap_stats(start, end, kept)["exposed_ns"] / 1e9
                             for start, end in list(zip(starts, ends))[1:])


def _run(model, train: TrainConfig, ep: int, balance: str, redundant: int) -> dict:
    from parallelisms.device import choose
    from parallelisms.training import RunSpec, run_layout

    parallel = ParallelConfig(dims=ParallelDims(dp_replicate=ep, ep=ep), ep_balance=balance, ep_redundant=redundant)
    report = run_layout(RunSpec(model, train, parallel), choose("cpu", ep), trace=True)
    exposed = [exposed_all_to_all_s(spans) for spans in report["spans"]]
    wait = report["stragglers"]["dims"].get("ep", {})
    load = report.get("expert_load", {})
    balanced = report.get("ep_balance", {})
    return {"step_s": report["step_time_s"], "exposed_all_to_all_s": max(exposed),
            "exposed_all_to_all_per_rank_s": exposed, "ep_wait_s_per_step": wait.get("wait_s_per_step"),
            "most_waited_for": wait.get("most_waited_for"), "expert_imbalance": load.get("expert_imbalance"),
            "ep_rank_imbalance": balanced.get("rank_imbalance_after", load.get("ep_rank_imbalance")),
            "placements": balanced.get("placements")}


@bench("ep-balance")
def bench_ep_balance(args) -> dict:
    base = preset(args.preset)
    model = dataclasses.replace(base, router_skew=SKEW, ffn_dim=max(base.ffn_dim, FFN_PER_DIM * base.dim)).validate()
    require(model.n_experts >= 4, f"bench ep-balance needs a mixture-of-experts model with 4 experts or more, "
                                  f"but --preset {args.preset} has {model.n_experts}; use --preset tiny-moe")
    rows = {}
    for ep in (2, 4):
        train = TrainConfig(steps=max(args.steps, 8), global_batch=max(args.global_batch, 4 * ep), seq_len=args.seq_len,
                            bucket_mb=args.bucket_mb)
        rows[f"ep{ep}"] = {name: _run(model, train, ep, *case) for name, case in CASES.items()}
        for name, r in rows[f"ep{ep}"].items():
            print(f"ep {ep}, {name}: step {r['step_s'] * 1e3:.1f} ms, exposed all-to-all "
                  f"{r['exposed_all_to_all_s'] * 1e3:.1f} ms, ep wait {(r['ep_wait_s_per_step'] or 0) * 1e3:.1f} ms "
                  f"(rank {r['most_waited_for']}), ep rank load max/mean {r['ep_rank_imbalance'] or 0:.2f}")
    ours, peer = rows["ep4"]["measured_redundant1"], rows["ep4"]["even"]
    return {"bench": "ep-balance", "router_skew": SKEW, "preset": args.preset, "cases": rows,
            "ours": "ep 4, --ep-balance measured --ep-redundant 1", "ours_s": ours["step_s"],
            "peer": "ep 4, experts split evenly", "peer_s": peer["step_s"], "ratio": ours["step_s"] / peer["step_s"]}
