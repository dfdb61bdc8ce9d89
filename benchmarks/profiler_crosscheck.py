"""Cross-check the project's timeline against torch.profiler on the same DDP steps (dp 2, tiny model).

Both observe the same steps: our spans (forward / backward / optimizer compute, each all-reduce from
issue to completion) and the profiler's CPU events (a ``train_step`` range around each step, and gloo's
own collective events, which time each all-reduce on gloo's worker thread). Prints rank 0's totals from
each source; docs/architecture.md records how they compare.
Run: python benchmarks/profiler_crosscheck.py
"""

import json

import torch
from torch.profiler import ProfilerActivity, profile

from parallelisms.comm import CommLedger, Comms, Timeline
from parallelisms.config import TrainConfig, preset
from parallelisms.data import BatchLoader, load_corpus
from parallelisms.launch import launch
from parallelisms.mesh import ParallelDims
from parallelisms.model import build_model
from parallelisms.optim import make_optimizer
from parallelisms.training import MicrobatchLoop, Trainer
from parallelisms.parallel.data import DataParallel


def _rank(info, steps):
    cfg, train = preset("small"), TrainConfig(global_batch=8, seq_len=64, bucket_mb=1.0)
    comms = Comms(ParallelDims(dp_replicate=info.world_size).build_meshes(), CommLedger(), Timeline(info.rank))
    model = build_model(cfg, 0)
    runner = Trainer(DataParallel(model, comms, "dp", bucket_cap_mb=train.bucket_mb), MicrobatchLoop(model, comms, 1),
                     comms, train, make_optimizer(model.parameters(), train))
    inputs, targets = BatchLoader(load_corpus(), 8, 64).shard(0, info.rank, info.world_size)
    runner.train_step(inputs, targets)  # warm-up, not measured
    comms.timeline.spans.clear()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with torch.profiler.record_function("train_step"):
                runner.train_step(inputs, targets)
    ours = {}
    for s in comms.timeline.spans:
        key = s.cat if s.cat != "compute" else s.name
        ours[key] = ours.get(key, 0) + (s.end - s.start) / 1e6
    events = prof.events()
    theirs = {"train_step": sum(e.cpu_time_total for e in events if e.name == "train_step") / 1e3}
    comm_events = [e for e in events if "all_reduce" in e.name or "allreduce" in e.name.lower()]
    theirs["comm_events"] = sorted({e.name for e in comm_events})
    theirs["comm_cpu_ms"] = sum(e.cpu_time_total for e in comm_events if e.name.startswith("gloo")) / 1e3
    stats = comms.timeline.overlap_stats()
    ours["comm_union"] = stats["comm_ns"] / 1e6
    ours["comm_calls"] = sum(1 for s in comms.timeline.spans if s.cat == "comm")
    theirs["gloo_calls"] = sum(1 for e in comm_events if e.name.startswith("gloo"))
    ours["train_step"] = sum(v for k, v in ours.items() if k in ("forward", "backward", "optimizer"))
    return {"ours_ms": ours, "profiler_ms": theirs}


if __name__ == "__main__":
    print(json.dumps(launch(_rank, 2, 5, threads=1)[0], indent=1))
