"""Print the step model's predictions for `bench predict`'s cases (and a few more CPU layouts) on the ``cpu``
hardware preset, one line each: run before and after a change to perf/ to check that the CPU predictions do not
move (a GPU-side change must leave them as they are)."""

import json

from parallelisms.config import ParallelConfig, TrainConfig, preset
from parallelisms.mesh import ParallelDims
from parallelisms.perf.hardware import PRESETS
from parallelisms.perf.predict import CASES
from parallelisms.perf.step import predict_step

MORE = {
    "dp2_zero1": (ParallelDims(dp_shard=2), {"zero": 1}),
    "dp2_zero2": (ParallelDims(dp_shard=2), {"zero": 2}),
    "tp2": (ParallelDims(tp=2), {}),
    "tp2_overlap": (ParallelDims(tp=2), {"tp_overlap": True}),
    "pp2_zb": (ParallelDims(pp=2), {"schedule": "zb-h1", "microbatches": 4}),
    "cp2_ulysses": (ParallelDims(cp=2), {"cp_attention": "ulysses"}),
    "fsdp2": (ParallelDims(dp_shard=2), {"fsdp": "full_shard"}),
    "dp2_recompute": (ParallelDims(dp_replicate=2), {"recompute": "full"}),
}


def main() -> None:
    cfg, hw = preset("small"), PRESETS["cpu"]
    train = TrainConfig(global_batch=8, seq_len=128)
    for name, (dims, options) in {**CASES, **MORE}.items():
        r = predict_step(cfg, ParallelConfig(dims, **options), train, hw)
        print(json.dumps({"case": name, "step_s": r["step_s"], "memory": r["memory_per_rank"]["total"],
                          "stage": r["per_microbatch_stage_s"]}))


if __name__ == "__main__":
    main()
