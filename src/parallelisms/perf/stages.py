"""Pipeline stages as the runtime cuts and places them: ``partition.equal_bounds`` over the schedule's pp x chunks
stages (the first ``n % stages`` one layer longer: a layer count need not divide evenly), each stage on the rank the
schedule's placement names. The busiest rank is the one with the most work per microbatch: its layers and, where
it holds them, the head and loss (Llama 3's 126 layers on 16 stages: 8 layers on most ranks, 7 and the head on the
last, as Meta balanced theirs, Llama 3 report Sec. 3.3.2).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from parallelisms.config import ModelConfig, ParallelConfig
from parallelisms.parallel.pipeline.partition import equal_bounds
from parallelisms.parallel.pipeline.schedules import build_schedule, pipeline_microbatches, schedule_chunks


@lru_cache(maxsize=256)
def schedule_of(name: str, pp: int, m: int, chunks: int):
    """The schedule of ``--schedule name`` over ``pp`` ranks for ``m`` microbatches and ``--chunks chunks``, as the
    runtime builds it (:func:`~parallelisms.parallel.pipeline.schedules.schedule_chunks`), once per shape:
    ``plan`` prices many layouts of one."""
    return build_schedule(name, pp, m, schedule_chunks(name, chunks))


@dataclass(frozen=True)
class RankStages:
    """One pipeline rank's share: ``layers`` a microbatch runs on it (the stages of one path: a DualPipe rank holds
    two copies but runs each microbatch through one), its ``stage_layers`` (every stage it holds, both paths),
    whether that path holds the embedding (stage 0) and the head (the last stage), and whether any stage it holds
    is the last (``holds_last``: DualPipe's second copy too)."""
    layers: int
    stage_layers: tuple[int, ...]
    embedding: bool
    head: bool
    holds_last: bool


def stage_sizes(cfg: ModelConfig, stages: int) -> list[int]:
    """Layers in each of ``stages`` stages as the runtime cuts them (one line where the layers cannot fill them)."""
    return _layer_counts(cfg.n_layers, stages)


def _layer_counts(layers: int, stages: int) -> list[int]:
    bounds = equal_bounds(layers, stages)
    return [bounds[s + 1] - bounds[s] for s in range(stages)]


def pipeline_ranks(cfg: ModelConfig, parallel: ParallelConfig, m: int) -> list[RankStages]:
    """Each pipeline rank's stages for ``m`` microbatches (one rank holding everything without a pipeline)."""
    pp = parallel.dims.pp
    if pp == 1:
        return [RankStages(cfg.n_layers, (cfg.n_layers,), True, True, True)]
    return list(_rank_stages(cfg.n_layers, parallel.schedule, pp, m, parallel.chunks))


@lru_cache(maxsize=1024)
def _rank_stages(layers: int, name: str, pp: int, m: int, chunks: int) -> tuple[RankStages, ...]:
    """:func:`pipeline_ranks` of ``layers`` blocks, once per shape (``plan`` prices many layouts of one)."""
    schedule = schedule_of(name, pp, m, chunks)
    size = _layer_counts(layers, schedule.num_stages)
    last = schedule.num_stages - 1
    out = []
    for rank in range(pp):
        held = schedule.modules_on(rank)
        own = [s for path, s in held if path == 0]
        out.append(RankStages(sum(size[s] for s in own), tuple(size[s] for _, s in held), 0 in own, last in own,
                              any(s == last for _, s in held)))
    return tuple(out)


def busiest_rank(ranks: list[RankStages], layer_s: float, head_s: float) -> RankStages:
    """The rank with the most seconds a microbatch: ``layer_s`` a layer, ``head_s`` the head and loss."""
    return max(ranks, key=lambda r: (r.layers * layer_s + r.head * head_s, r.head))


def rank0_layers(cfg: ModelConfig, parallel: ParallelConfig) -> int:
    """Layers rank 0 runs a microbatch through (the first stages take a layer count's remainder)."""
    if parallel.dims.pp == 1:
        return cfg.n_layers
    return pipeline_ranks(cfg, parallel, pipeline_microbatches(parallel))[0].layers


def rank0_held(cfg: ModelConfig, parallel: ParallelConfig) -> tuple[int, bool]:
    """Layers rank 0 holds (every stage on it: DualPipe's two copies, a V's two chunks) and whether one of its stages
    holds the head: the parameters its gradient sync moves, where :func:`rank0_layers` counts the compute."""
    rank = pipeline_ranks(cfg, parallel, pipeline_microbatches(parallel))[0]
    return sum(rank.stage_layers), rank.holds_last
