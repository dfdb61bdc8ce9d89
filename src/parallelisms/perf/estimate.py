"""``parallelisms estimate``: memory per rank and a mechanistic step-time prediction for a layout, before
running it, on a hardware preset or file (perf/hardware.py). The time model is perf/step.py's; the bytes
each collective moves are perf/model.py's (equal to the runtime ledger)."""

from __future__ import annotations

from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig
from parallelisms.perf.hardware import Hardware
from parallelisms.perf.model import comm_per_step
from parallelisms.perf.step import predict_step
from parallelisms.units import count, seconds, size

FIELDS = ("step_s", "tokens_per_s", "mfu", "hfu", "model_tflops_per_gpu", "hardware_tflops_per_gpu",
          "bubble_fraction", "memory_per_rank", "fits", "time_breakdown")


def estimate(cfg: ModelConfig, parallel: ParallelConfig, train: TrainConfig, hw: Hardware,
             attention: str = "flash", simulate_schedule: bool = True, fp8: bool = False,
             kernels: str = "eager") -> dict:
    """The estimate's fields (FIELDS first), then the hardware, layout, parameters and bytes per collective;
    ``fp8``: the blocks' linear layers priced in FP8, marked as not runnable by this runtime; ``kernels``: the
    non-GEMM work as this runtime runs it (eager) or fused as Megatron-LM's."""
    result = predict_step(cfg, parallel, train, hw, attention, simulate_schedule, fp8=fp8, kernels=kernels)
    comm: dict[str, float] = {}  # summed: a dimension's gradient norm shares its key with its other traffic
    for v in comm_per_step(cfg, parallel, train, dtype_bytes=parallel.mixed_precision.compute_bytes):
        comm[f"{v.kind}/{v.dim}"] = comm.get(f"{v.kind}/{v.dim}", 0.0) + v.bytes_per_rank
    return {**{k: result[k] for k in FIELDS}, "hardware": hw.name, "layout": parallel.label() + (" fp8" if fp8 else ""),
            "runnable": not fp8,
            "params": cfg.num_params(), "comm_bytes_per_rank": comm,
            "per_microbatch_stage_s": result["per_microbatch_stage_s"]}


def bottleneck(result: dict) -> str:
    """Where the step goes, largest first: the bound (compute, or the exposed term that costs most beyond it) and
    its share of the step, e.g. ``compute 81%; pipeline bubble 12%``: the planner's reason beside a layout."""
    t, step = result["time_breakdown"], result["step_s"]
    terms = {"compute": t["compute"], "pipeline bubble": t["bubble"], "optimizer": t["optimizer"],
             **{f"exposed {k}": v for k, v in t["exposed_comm"].items()}}
    if "shared_cores" in t:
        terms["ranks sharing cores"] = t["shared_cores"]
    ranked = sorted(((v / step, k) for k, v in terms.items() if v > 0), reverse=True)
    return "; ".join(f"{k} {share:.0%}" for share, k in ranked[:2] if share >= 0.05 or k == ranked[0][1])


def explain(result: dict) -> list[str]:
    """A few lines: where the step's time and each rank's memory go."""
    mem, t = result["memory_per_rank"], result["time_breakdown"]
    comm = ", ".join(f"{k} {seconds(v)}" for k, v in t["exposed_comm"].items() if v >= 1e-3 * result["step_s"]) or "none"
    return [
        f"{result['layout']} on {result['hardware']}: {count(result['params'])} parameters"
        + ("" if result.get("runnable", True) else " (FP8: predicted only; this runtime does not train in FP8)"),
        f"step {seconds(result['step_s'])} = compute {seconds(t['compute'])} + exposed communication {comm} + "
        f"pipeline bubble {seconds(t['bubble'])} + optimizer {seconds(t['optimizer'])}"
        + (f" + ranks sharing cores {seconds(t['shared_cores'])} (each waits for its peers while another works; the "
           f"cores are the bound)" if "shared_cores" in t else ""),
        f"{result['tokens_per_s']:,.0f} tokens/s; MFU {result['mfu']:.1%} ({result['model_tflops_per_gpu']:.3g} TFLOP/s "
        f"per GPU), HFU {result['hfu']:.1%} ({result['hardware_tflops_per_gpu']:.3g}); bubble fraction "
        f"{result['bubble_fraction']:.3f}",
        "memory per rank: " + ", ".join(f"{k} {size(mem[k])}" for k in mem)
        + (" (fits)" if result["fits"] else " (DOES NOT FIT)"),
    ]
