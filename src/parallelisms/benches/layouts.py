"""Shared by ``bench cp`` and ``bench ep``: layouts of one model trained through ``parallelize`` on the same
ranks, and plain training in one process on the same global batch.

Each layout's step is timed in alternating rounds (``bench.alternate``, one thread per rank); each step is
split into phases read from the timeline: forward, backward (with the gradient sync's wait), optimizer, and
exposed communication (communication no computation covered, ``Timeline.overlap_stats``). Peak memory is the
allocator's, measured as the other benches measure it (``benches.zero.profiled``: from before the model is
built through two steps), and the ledger gives each layout's bytes per step by collective kind.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from parallelisms.bench import alternate
from parallelisms.benches.zero import profiled
from parallelisms.comm import CommLedger, Comms, Timeline
from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig
from parallelisms.data import BatchLoader, load_corpus
from parallelisms.launch import RankInfo
from parallelisms.model import build_model
from parallelisms.train import parallelize

PHASES = ("forward_s", "backward_s", "optimizer_s", "exposed_comm_s")


def long_context(model_cfg: ModelConfig, seq_len: int) -> ModelConfig:
    """The model with a context of at least ``seq_len`` (rotary tables only; the weights do not change)."""
    return dataclasses.replace(model_cfg, max_seq_len=max(model_cfg.max_seq_len, seq_len))


def _phases(timeline: Timeline, start: int, end: int) -> dict[str, float]:
    spent = {name: sum(s.end - s.start for s in timeline.between(start, end) if s.name == name and s.cat == "compute")
             for name in ("forward", "optimizer")}
    exposed = timeline.overlap_stats(start, end)["exposed_ns"]
    return {"forward_s": spent["forward"] / 1e9, "optimizer_s": spent["optimizer"] / 1e9,
            "backward_s": (end - start - spent["forward"] - spent["optimizer"]) / 1e9, "exposed_comm_s": exposed / 1e9}


def _medians(rows: list[dict]) -> dict[str, float]:
    return {key: statistics.median(row[key] for row in rows) for key in rows[0]}


def layouts_rank(info: RankInfo, model_cfg: ModelConfig, train_cfg: TrainConfig, layouts: dict[str, ParallelConfig],
                 steps: int, rounds: int) -> dict:
    """Every layout on this rank: median step seconds, per-phase medians, peak bytes, ledger bytes per step."""
    loader = BatchLoader(load_corpus(), train_cfg.global_batch, train_cfg.seq_len, train_cfg.seed)
    runs, out = {}, {}
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
        out[name] = {"memory": memory, "phases": phases, "comms": comms, "mark": comms.ledger.mark()}
    times = alternate(runs, steps, rounds)
    return {name: {"step_s": times[name], "peak_bytes": o["memory"]["peak_bytes"], **_medians(o["phases"][1:]),
                   "comm_per_step": o["comms"].ledger.summary(since=o["mark"], per=len(o["phases"]),
                                                              exclude_phases=("report", "setup"))}
            for name, o in out.items()}


def one_process(model_cfg: ModelConfig, train_cfg: TrainConfig, steps: int) -> dict:
    """Plain training on the whole global batch in this process, one thread: median step seconds, per-phase
    medians (no communication) and peak bytes."""
    torch.set_num_threads(1)
    inputs, targets = BatchLoader(load_corpus(), train_cfg.global_batch, train_cfg.seq_len, train_cfg.seed).batch(0)
    phases = []

    def build():
        model = build_model(model_cfg, train_cfg.seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=train_cfg.lr)

        def step():
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = model(inputs, targets)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            optimizer.step()
            phases.append({"forward_s": t1 - t0, "backward_s": t2 - t1, "optimizer_s": time.perf_counter() - t2,
                           "exposed_comm_s": 0.0})
        return step
    step, memory = profiled(build)
    seconds = alternate({"one": step}, steps, 1)["one"]
    return {"step_s": seconds, "peak_bytes": memory["peak_bytes"], **_medians(phases[3:])}


def per_rank_max(results: list[dict], name: str) -> dict:
    """Rank 0's figures for layout ``name``, with the highest peak over ranks."""
    first = dict(results[0][name])
    first["peak_bytes"] = max(r[name]["peak_bytes"] for r in results)
    return first
