"""``parallelisms estimate``: memory per rank, communication per step and a step-time estimate for a layout,
before running it (on hardware from datasheets, or this CPU with its measured alpha and beta).

The time model is deliberately simple and says so: compute = model FLOPs / (peak x MFU); tensor- and
context-parallel communication sits on the critical path (spec: "each is a hard dependency"); data-parallel
communication overlaps the backward pass and only what exceeds it is exposed; a pipeline stretches the
step by 1 / (1 - bubble) with the bubble taken from the schedule simulator.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig
from parallelisms.perf.collectives import AlphaBeta
from parallelisms.perf.model import (activation_bytes_per_layer, comm_per_step, model_flops_per_token,
                                     model_state_bytes, pipeline_activation_factor)


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float       # dense, the training dtype
    memory_bytes: float
    fast_link: AlphaBeta    # within a node (NVLink); tp, cp, ep
    slow_link: AlphaBeta    # across nodes (InfiniBand per GPU); dp, pp
    gpus_per_node: int


# Datasheets (NVIDIA's published peak figures); latencies are typical NCCL figures, an assumption.
HARDWARE = {
    "a100": Hardware("A100 SXM 80GB", 312e12, 80e9, AlphaBeta(10e-6, 1 / 300e9), AlphaBeta(20e-6, 1 / 25e9), 8),
    "h100": Hardware("H100 SXM 80GB", 989e12, 80e9, AlphaBeta(10e-6, 1 / 450e9), AlphaBeta(20e-6, 1 / 50e9), 8),
    "h200": Hardware("H200 141GB", 989e12, 141e9, AlphaBeta(10e-6, 1 / 450e9), AlphaBeta(20e-6, 1 / 50e9), 8),
    # this 2-core machine over gloo: alpha and beta fitted by `parallelisms bench alpha-beta`; fp32 matmul peak
    "cpu": Hardware("2-core CPU, gloo", 50e9, 24 * 2**30, AlphaBeta(3.7e-4, 1 / 1.4e9), AlphaBeta(3.7e-4, 1 / 1.4e9), 2),
}


def estimate(cfg: ModelConfig, parallel: ParallelConfig, train: TrainConfig, hardware: str = "h100",
             mfu: float = 0.45, activation_bytes: int = 2) -> dict:
    """Per-rank memory, per-step communication and a step-time estimate (see the module docstring)."""
    hw = HARDWARE[hardware]
    dims = parallel.dims
    states = model_state_bytes(cfg.num_params(), parallel)
    local_batch = train.global_batch // dims.dp
    micro = max(1, parallel.microbatches or 2 * dims.pp) if dims.pp > 1 else train.grad_accum
    layer = activation_bytes_per_layer(train.seq_len // dims.cp, local_batch // micro, cfg.dim, cfg.n_heads,
                                       dims.tp, parallel.sequence_parallel, parallel.recompute) * activation_bytes / 2
    # one microbatch through all L layers; with 1F1B the first stage holds p microbatches x L/p layers, the same
    activations = layer * cfg.n_layers * pipeline_activation_factor(dims.pp, parallel.chunks)
    memory = {**{k: float(v) for k, v in states.items()}, "activations": activations,
              "total": states["peak_model_states"] + activations}

    tokens_per_rank = train.global_batch * train.seq_len / (dims.dp * dims.cp)
    flops = model_flops_per_token(cfg, train.seq_len) * tokens_per_rank / (dims.tp * dims.pp)
    compute_s = flops / (hw.peak_flops * mfu)
    volumes = comm_per_step(cfg, parallel, train, dtype_bytes=2 if parallel.mixed_precision == "bf16" else 4)
    comm_s, exposed_s = {}, 0.0
    for v in volumes:
        link = hw.fast_link if v.dim in ("tp", "cp", "ep") else hw.slow_link
        t = link.time(v.bytes_per_rank, calls=cfg.n_layers if v.dim in ("tp", "cp") else 1)
        comm_s[f"{v.kind}/{v.dim}"] = t
        exposed_s += t if v.dim in ("tp", "cp") else 0.0
    dp_s = sum(t for k, t in comm_s.items() if k.endswith("/dp"))
    exposed_s += max(0.0, dp_s - compute_s * 2 / 3)  # backward is about 2/3 of the compute
    step_s = compute_s + exposed_s
    bubble = 0.0
    if dims.pp > 1:
        from parallelisms.parallel.pipeline.schedules import build_schedule
        from parallelisms.parallel.pipeline.simulate import Times, simulate

        m = parallel.microbatches or 2 * dims.pp
        chunks = parallel.chunks if parallel.schedule == "interleaved" else None
        schedule = build_schedule(parallel.schedule, dims.pp, m, chunks)
        bubble = simulate(schedule, Times(1.0, 1.0, 1.0, 0.0)).bubble_rate
        step_s /= 1 - bubble
    return {"hardware": hw.name, "layout": parallel.label(), "params": cfg.num_params(),
            "memory_per_rank": memory, "fits": memory["total"] <= hw.memory_bytes,
            "comm_bytes_per_rank": {f"{v.kind}/{v.dim}": v.bytes_per_rank for v in volumes},
            "comm_s": comm_s, "flops_per_rank": flops, "compute_s": compute_s, "exposed_comm_s": exposed_s,
            "pipeline_bubble": bubble, "step_s": step_s, "mfu_assumed": mfu,
            "tokens_per_s": train.global_batch * train.seq_len / step_s}
