"""``parallelisms bench cp``: context parallelism on long sequences. Every context-parallel mode that runs at
cp = ``--world`` (:mod:`parallelisms.parallel.cp_modes`: ring attention with each block pair through the fused
kernel, Ulysses, all-gather, and from 4 ranks hierarchical with Ulysses over 2) on the same ranks, for each
``--seq-lens`` length, against each other (``ratio`` = ring / Ulysses) and against one process training the
same global batch in the same rounds (speed-up, peak memory per rank over the one process's, scaling
efficiency). No external implementation is the peer: the headline compares our two oldest modes.
"""

from __future__ import annotations

from parallelisms.bench import bench, ratios
from parallelisms.benches.layouts import ONE_PROCESS, PHASES, layouts_rank, long_context, per_rank_max
from parallelisms.config import ParallelConfig, TrainConfig, preset
from parallelisms.errors import ConfigError
from parallelisms.launch import launch
from parallelisms.mesh import ParallelDims
from parallelisms.parallel.cp_modes import MODES
from parallelisms.support import validate_layout


def _layouts(model_cfg, train_cfg, world: int) -> dict[str, ParallelConfig]:
    """The modes that run at cp = world (hierarchical: Ulysses over 2 ranks, the ring over world / 2)."""
    layouts = {}
    for style in MODES:
        parallel = ParallelConfig(ParallelDims(cp=world), cp_attention=style, cp_ulysses_size=2)
        try:
            layouts[style] = validate_layout(model_cfg, train_cfg, parallel)
        except ConfigError:
            if style in ("ring", "ulysses"):  # the headline's pair must run
                raise
    return layouts


def _length(args, seq_len: int) -> dict:
    model_cfg = long_context(preset(args.preset), seq_len).validate()
    train_cfg = TrainConfig(global_batch=args.global_batch, seq_len=seq_len)
    layouts = _layouts(model_cfg, train_cfg, args.world)
    ranks = launch(layouts_rank, args.world, model_cfg, train_cfg, layouts, args.steps, args.rounds,
                   backend="gloo", threads=1)
    single = ranks[0][ONE_PROCESS]
    row = {"seq_len": seq_len, "tokens_per_step": args.global_batch * seq_len, "one_process": single}
    for style in layouts:
        figures = per_rank_max(ranks, style)
        figures.update(speedup=single["step_s"] / figures["step_s"],
                       peak_memory_vs_one_process=figures["peak_bytes"] / single["peak_bytes"],
                       scaling_efficiency=single["step_s"] / (args.world * figures["step_s"]))
        row[style] = figures
    row["ratio"] = row["ring"]["step_s"] / row["ulysses"]["step_s"]
    row["ratio_rounds"] = ratios(row["ring"]["step_s_rounds"], row["ulysses"]["step_s_rounds"])
    row["peak_memory_ratio"] = row["ring"]["peak_bytes"] / row["ulysses"]["peak_bytes"]
    modes = ", ".join(f"{style} {row[style]['step_s']:.2f} s (x{row[style]['speedup']:.2f}, memory "
                      f"{row[style]['peak_memory_vs_one_process']:.2f})" for style in layouts)
    print(f"bench cp {seq_len:>6} tokens: one process {single['step_s']:.2f} s, {modes}, ring/ulysses "
          f"{row['ratio']:.3f}", flush=True)
    return row


@bench("cp")
def bench_cp(args) -> dict:
    """Ring (zigzag, fused) against Ulysses at cp = --world, and both against one process, per length."""
    rows = [_length(args, seq_len) for seq_len in args.seq_lens]
    last = rows[-1]
    ring, ulysses = last["ring"], last["ulysses"]
    return {"bench": "cp", "world_size": args.world, "preset": args.preset, "global_batch": args.global_batch,
            "seq_len": last["seq_len"], "ours": "ring attention (zigzag, fused kernel)", "ours_s": ring["step_s"],
            "peer": "ulysses (all-to-all over heads)", "peer_s": ulysses["step_s"], "ratio": last["ratio"],
            "ratio_rounds": last["ratio_rounds"],
            "phases": {"ours": {k: ring[k] for k in PHASES}, "peer": {k: ulysses[k] for k in PHASES},
                       "one_process": {k: last["one_process"][k] for k in PHASES}},
            "one_process_s": last["one_process"]["step_s"], "ours_speedup": ring["speedup"],
            "ours_peak_memory_vs_one_process": ring["peak_memory_vs_one_process"],
            "ours_scaling_efficiency": ring["scaling_efficiency"],
            "peer_scaling_efficiency": ulysses["scaling_efficiency"], "lengths": rows}
