"""``parallelisms bench ep``: expert parallelism (GShard / Switch: experts sharded over ranks, tokens
dispatched and combined by all-to-all) at ep = --world against the same mixture-of-experts model with every
expert replicated (ep 1, plain data parallelism) on the same ranks: tokens/s, peak memory per rank,
all-to-all bytes per step and exposed communication, with per-phase times and scaling efficiency against
one process on the same global batch.
"""

from __future__ import annotations

from parallelisms.bench import bench, ratios
from parallelisms.benches.layouts import ONE_PROCESS, PHASES, layouts_rank, per_rank_max
from parallelisms.config import ParallelConfig, TrainConfig, preset
from parallelisms.errors import require
from parallelisms.launch import launch
from parallelisms.mesh import ParallelDims
from parallelisms.support import validate_layout


@bench("ep")
def bench_ep(args) -> dict:
    """Experts sharded (ep = --world) against experts replicated (ep 1), both data parallel over --world."""
    model_cfg = preset(args.preset).validate()
    require(model_cfg.n_experts > 1, f"bench ep needs a mixture-of-experts model, but --preset {args.preset} has "
                                     f"no experts; use --preset tiny-moe")
    train_cfg = TrainConfig(global_batch=args.global_batch, seq_len=args.seq_len)
    layouts = {"ep": ParallelConfig(ParallelDims(dp_replicate=args.world, ep=args.world)),
               "replicated": ParallelConfig(ParallelDims(dp_replicate=args.world))}
    for parallel in layouts.values():
        validate_layout(model_cfg, train_cfg, parallel)
    ranks = launch(layouts_rank, args.world, model_cfg, train_cfg, layouts, args.steps, args.rounds,
                   backend="gloo", threads=1)
    single = ranks[0][ONE_PROCESS]
    tokens = args.global_batch * args.seq_len
    figures = {}
    for name in layouts:
        f = per_rank_max(ranks, name)
        f.update(tokens_per_s=tokens / f["step_s"], scaling_efficiency=single["step_s"] / (args.world * f["step_s"]),
                 all_to_all_bytes_per_rank=f["comm_per_step"].get("all_to_all", {}).get("bytes_per_rank", 0.0))
        figures[name] = f
    ours, peer = figures["ep"], figures["replicated"]
    return {"bench": "ep", "world_size": args.world, "preset": args.preset, "params": model_cfg.num_params(),
            "tokens_per_step": tokens, "ours": f"expert parallel (ep {args.world})", "ours_s": ours["step_s"],
            "peer": "experts replicated (ep 1)", "peer_s": peer["step_s"], "ratio": ours["step_s"] / peer["step_s"],
            "ratio_rounds": ratios(ours["step_s_rounds"], peer["step_s_rounds"]),
            "peak_memory_ratio": ours["peak_bytes"] / peer["peak_bytes"],
            "phases": {"ours": {k: ours[k] for k in PHASES}, "peer": {k: peer[k] for k in PHASES},
                       "one_process": {k: single[k] for k in PHASES}},
            "one_process_s": single["step_s"], "ours_scaling_efficiency": ours["scaling_efficiency"],
            "peer_scaling_efficiency": peer["scaling_efficiency"], "ep": ours, "replicated": peer,
            "one_process": single}
