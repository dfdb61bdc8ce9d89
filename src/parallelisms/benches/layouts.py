"""Shared by ``bench cp`` and ``bench ep``: layouts of one model trained through ``parallelize`` on the same
ranks, and plain training of the same global batch in one process (rank 0's, one thread), in the same rounds.

Each layout's step is timed in alternating rounds (``bench.alternate``, one thread per rank); each step is
split into phases read from the timeline: forward, backward (with the gradient sync's wait), optimizer, and
exposed communication (communication no computation covered, ``Timeline.overlap_stats``). Peak memory is the
allocator's, measured as the other benches measure it (``bench.profiled``: from before the model is
built through two steps), and the ledger gives each layout's bytes per step by collective kind.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from parallelisms.bench import alternate, profiled
from parallelisms.comm import CommLedger, Comms, Timeline
from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig
from parallelisms.data import BatchLoader, load_corpus
from parallelisms.launch import RankInfo
from parallelisms.model import build_model
from parallelisms.train_setup import parallelize

PHASES = ("forward_s", "backward_s", "optimizer_s", "exposed_comm_s")
ONE_PROCESS = "one_process"


def long_context(model_cfg: ModelConfig, seq_len: int) -> ModelConfig:
    """The model with a context of at least ``seq_len`` (rotary tables only; the weights do not change)."""
    return dataclasses.replace(model_cfg, max_seq_len=max(model_cfg.max_seq_len, seq_len))


def _phases(timeline: Timeline, start: int, end: int) -> dict[str, float]:
    """Forward, backward (the rest of the step), optimizer and exposed communication between ``start`` and
    ``end`` of a trainer's timeline, in seconds."""
    spent = {name: sum(s.end - s.start for s in timeline.between(start, end) if s.name == name and s.cat == "compute")
             for name in ("forward", "optimizer")}
    exposed = timeline.overlap_stats(start, end)["exposed_ns"]
    return {"forward_s": spent["forward"] / 1e9, "optimizer_s": spent["optimizer"] / 1e9,
            "backward_s": (end - start - spent["forward"] - spent["optimizer"]) / 1e9, "exposed_comm_s": exposed / 1e9}


def _medians(rows: list[dict]) -> dict[str, float]:
    return {key: statistics.median(row[key] for row in rows) for key in rows[0]}


def layouts_rank(info: RankInfo, model_cfg: ModelConfig, train_cfg: TrainConfig, layouts: dict[str, ParallelConfig],
                 steps: int, rounds: int) -> dict:
    """Every layout on this rank, and on rank 0 plain training of the whole global batch in the same rounds (the
    other ranks wait for it in their next step's first collective, outside rank 0's timing): median step
    seconds, per-phase medians, peak bytes, ledger bytes per step (the layouts)."""
    loader = BatchLoader(load_corpus(), train_cfg.global_batch, train_cfg.seq_len, train_cfg.seed)
    runs, out = {}, {}
    if info.rank == 0:
        phases = []
        step, memory = profiled(lambda: _plain_step(model_cfg, train_cfg, loader.batch(0), phases))
        runs[ONE_PROCESS] = step
        out[ONE_PROCESS] = {"memory": memory, "phases": phases, "skip": 3}  # two profiled steps, one warm-up
    else:
        runs[ONE_PROCESS] = lambda: None
    for name, parallel in layouts.items():
        dims = parallel.dims.check_world_size(info.world_size)
        comms = Comms(dims.build_meshes(), CommLedger(), Timeline(info.rank))
        coords = dims.coordinates(info.rank)
        batch = loader.shard(0, coords["dp_replicate"] * dims.dp_shard + coords["dp_shard"], dims.dp)

        def build(parallel=parallel, comms=comms, batch=batch):
            trainer = parallelize(build_model(model_cfg, train_cfg.seed), parallel, train_cfg, comms)
            return lambda: trainer.train_step(*batch)
        step, memory = profiled(build)
        comms.timeline.spans.clear()
        phases = []

        def timed(step=step, timeline=comms.timeline, phases=phases):
            start = timeline.now()
            step()
            phases.append(_phases(timeline, start, timeline.now()))
            timeline.spans.clear()
        runs[name] = timed
        out[name] = {"memory": memory, "phases": phases, "skip": 1, "ledger": comms.ledger,
                     "mark": comms.ledger.mark()}
    times = alternate(runs, steps, rounds)
    result = {}
    for name, o in out.items():
        result[name] = {"step_s": times[name], "step_s_rounds": times.per_round(name, rounds),
                        "peak_bytes": o["memory"]["peak_bytes"],
                        **_medians(o["phases"][o["skip"]:])}
        if "ledger" in o:
            result[name]["comm_per_step"] = o["ledger"].summary(since=o["mark"], per=len(o["phases"]),
                                                                exclude_phases=("report", "setup"))
    return result


def _plain_step(model_cfg: ModelConfig, train_cfg: TrainConfig, batch, phases: list):
    """Plain training (one process, ``torch.optim.AdamW``) on ``batch``; each step appends its phase times."""
    model = build_model(model_cfg, train_cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=train_cfg.lr)

    def step():
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = model(*batch)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        phases.append({"forward_s": t1 - t0, "backward_s": t2 - t1, "optimizer_s": time.perf_counter() - t2,
                       "exposed_comm_s": 0.0})
    return step


def per_rank_max(results: list[dict], name: str) -> dict:
    """Rank 0's figures for layout ``name``, with the highest peak over ranks."""
    first = dict(results[0][name])
    first["peak_bytes"] = max(r[name]["peak_bytes"] for r in results)
    return first
