"""The dry run: the real runtime on every rank of a layout at target scale, from one process, without
allocating or sending anything (``parallelisms dryrun``, ``docs/dryrun.md``).

:func:`dry_run` runs one rank per rank class (:mod:`.groups`) through :func:`.run.dry_run_rank` (fake process
group, fake tensors, the recording transport), then proves the collective order (:mod:`.precheck`) and reports
memory per class and the collectives per group per step (:mod:`.report`).
"""

from __future__ import annotations

import functools
import time

from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig

__all__ = ["dry_run", "dry_run_rank", "rank_classes", "RankRun"]


def __getattr__(name: str):
    """The runtime's names load on first use: this package's ``cli`` module is imported by ``--help``, which must not
    import torch."""
    if name in ("dry_run_rank", "RankRun"):
        from parallelisms.dryrun import run
        return getattr(run, name)
    if name == "rank_classes":
        from parallelisms.dryrun.groups import rank_classes
        return rank_classes
    raise AttributeError(name)


def dry_run(model: ModelConfig, train: TrainConfig, parallel: ParallelConfig, every_rank: bool = False,
            memory: bool = True, run_rank=None, replay: bool = True) -> dict:
    """Dry-run the layout: one rank per class (``every_rank``: all of them), the precheck, the figures. Returns
    ``{"runs": {rank: RankRun}, "classes": {key: ranks}, "precheck": ..., "seconds": ...}``; ``run_rank`` is
    :func:`dry_run_rank` (tests plant faults through it); ``replay``: :mod:`.replay`'s shortcut (identical
    microbatches run once)."""
    from parallelisms.dryrun.groups import class_key, rank_classes
    from parallelisms.dryrun.precheck import precheck
    from parallelisms.dryrun.run import dry_run_rank

    run_rank = run_rank or functools.partial(dry_run_rank, replay=replay)
    began = time.perf_counter()
    dims = parallel.dims
    classes = rank_classes(dims)
    ranks = range(dims.world_size) if every_rank else [members[0] for members in classes.values()]
    runs = {r: run_rank(model, train, parallel, r, memory=memory) for r in ranks}
    representative = {key: members[0] for key, members in classes.items()}

    def events_of(rank: int):
        return runs[rank].events if rank in runs else runs[representative[class_key(dims, rank)]].events

    schedule = None
    if dims.pp > 1:
        from parallelisms.parallel.pipeline.schedules import schedule_for
        schedule = schedule_for(parallel)
    check = precheck(dims, events_of, schedule, parallel.cp_ulysses_size)
    return {"runs": runs, "classes": classes, "precheck": check, "seconds": time.perf_counter() - began}
