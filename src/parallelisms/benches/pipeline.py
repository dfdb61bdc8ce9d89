"""``parallelisms bench pipeline --schedule S``: our executor against ``torch.distributed.pipelining``'s schedule
of the same name on the same stages; ``parallelisms bench pipeline-balance``: stages balanced by measured
per-layer time against equal layer counts on a model with a large vocabulary head.

Both implementations run in the same processes on their own copy of the same seeded model, cut at the same
layer bounds, one thread per rank, alternating one step each (``bench.alternate`` with rounds of one step,
so load drift on a shared machine hits both alike). A step is zero-grad, one pass
of the schedule over the global batch, and an AdamW step (no clipping: the peer has none).

``floor_s``: the schedule simulated with our measured forward, backward and weight-gradient times per stage and
nothing between actions (no message time, no host time), without the optimizer step: no executor of these
stages can take less, so ``floor_ratio`` (floor over the peer's step) bounds the ratio any pipeline reaches here.
``phases`` (rank 0's, ours and the peer's): forward, backward with the waits, optimizer, and exposed
communication, the step beyond the floor and the optimizer.
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from parallelisms.support import validate_layout
from parallelisms.bench import (alternate, bench, phase_medians, phase_timed, round_ratios, scaling,
                               single_process_step_time)
from parallelisms.comm import Comms
from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig, preset
from parallelisms.errors import require
from parallelisms.data import BatchLoader, load_corpus
from parallelisms.launch import RankInfo, launch
from parallelisms.mesh import ParallelDims
from parallelisms.model import build_model

PEERS = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
         "zb-v": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}


def _layout(world: int, schedule: str, microbatches: int) -> ParallelConfig:
    return ParallelConfig(ParallelDims(pp=world), schedule=schedule, microbatches=microbatches or 2 * world,
                          chunks=2 if schedule == "interleaved" else 1)


def _ours(info: RankInfo, model_cfg: ModelConfig, train_cfg: TrainConfig, parallel: ParallelConfig,
          comms: Comms, bounds=None):
    from parallelisms.train_setup import parallelize

    trainer = parallelize(build_model(model_cfg, train_cfg.seed), parallel, train_cfg, comms, bounds)
    inputs, targets = BatchLoader(load_corpus(), train_cfg.global_batch, train_cfg.seq_len).batch(0)
    return trainer, lambda: trainer.train_step(inputs, targets)


def _peer_step(model_cfg: ModelConfig, train_cfg: TrainConfig, runner, rank: int):
    """torch.distributed.pipelining on the same stages (a fresh copy of the model, the same bounds)."""
    from torch.distributed import pipelining
    from torch.distributed.pipelining import PipelineStage

    from parallelisms.parallel.pipeline.stage import build_stages
    from parallelisms.optim import make_optimizer

    schedule = runner.schedule
    stages = build_stages(build_model(model_cfg, train_cfg.seed), runner.bounds, schedule.modules_on(rank))
    pipe = [PipelineStage(stages[s], s, schedule.num_stages, torch.device("cpu")) for s in sorted(stages)]
    loss_fn = lambda logits, y: F.cross_entropy(logits.flatten(0, -2).float(), y.flatten())  # noqa: E731
    cls = getattr(pipelining, PEERS[schedule.name])
    peer = cls(pipe[0] if len(pipe) == 1 else pipe, schedule.microbatches, loss_fn=loss_fn)
    optimizer = make_optimizer([p for st in stages.values() for p in st.parameters()], train_cfg)
    inputs, targets = BatchLoader(load_corpus(), train_cfg.global_batch, train_cfg.seq_len).batch(0)
    args = (inputs,) if 0 in stages else ()
    target = targets if schedule.num_stages - 1 in stages else None

    def step():
        optimizer.zero_grad()
        peer.step(*args, target=target, losses=[] if target is not None else None)
        optimizer.step()
    return step, stages.values(), optimizer


def _pipeline_rank(info: RankInfo, model_cfg, train_cfg, parallel, steps: int, rounds: int):
    comms = Comms(parallel.dims.build_meshes())
    trainer, ours = _ours(info, model_cfg, train_cfg, parallel, comms)
    runner = trainer.forward_backward
    runs = {"ours": phase_timed(ours, runner.stages.values(), trainer.optimizer),
            "peer": phase_timed(*_peer_step(model_cfg, train_cfg, runner, comms["pp"].rank))}
    times = alternate({name: step for name, (step, _) in runs.items()}, 1, steps * rounds)  # one step each, in turn
    pipeline = runner.report()["pipeline"]
    floor = pipeline["simulated_makespan_s"]
    phases = {name: _beyond_floor(seconds, times[name], floor) for name, (_, seconds) in runs.items()}
    return times, pipeline, phases, round_ratios(times, "ours", "peer", rounds)


def _beyond_floor(seconds: dict, step_s: float, floor_s: float) -> dict:
    """Phase medians with exposed communication the step beyond the simulated floor and the optimizer:
    messages, their waits, host time between actions."""
    return phase_medians(seconds, step_s, floor_s + statistics.median(seconds["optimizer_s"][1:]))


def _configs(args) -> tuple[ModelConfig, TrainConfig, ParallelConfig]:
    model_cfg = preset(args.preset).validate()
    train_cfg = TrainConfig(global_batch=args.global_batch, seq_len=args.seq_len, grad_clip=0.0)
    require(args.schedule in PEERS, f"bench pipeline --schedule {args.schedule!r} has no torch peer; "
                                    f"choose one of {', '.join(PEERS)}")
    parallel = _layout(args.world, args.schedule, args.microbatches)
    return model_cfg, train_cfg, validate_layout(model_cfg, train_cfg, parallel)


@bench("pipeline")
def bench_pipeline(args) -> dict:
    """Our executor against torch.distributed.pipelining's schedule of the same name."""
    model_cfg, train_cfg, parallel = _configs(args)
    times, pipeline, phases, ratio_rounds = launch(_pipeline_rank, args.world, model_cfg, train_cfg, parallel, args.steps,
                                     args.rounds, backend="gloo", threads=1)[0]
    floor = pipeline["simulated_makespan_s"]
    single = single_process_step_time(model_cfg, train_cfg, args.steps)
    return {"bench": "pipeline", "schedule": args.schedule, "world_size": args.world,
            "microbatches": parallel.microbatches, "params": model_cfg.num_params(),
            "ours_s": times["ours"], "peer": f"torch.distributed.pipelining.{PEERS[args.schedule]}",
            "peer_s": times["peer"], "ratio": times["ours"] / times["peer"], "ratio_rounds": ratio_rounds,
            "floor_s": floor, "floor_ratio": floor / times["peer"], "phases": phases, "bubble": pipeline,
            **scaling(single, args.world, times["ours"], times["peer"])}


# -- balancing by measured runtime ----------------------------------------------------------------------

# A model whose last stage is heavy: an 8k-vocabulary head (two to three blocks of work) on a narrow model.
BIG_HEAD = ModelConfig(vocab_size=8192, dim=128, n_layers=8, n_heads=4, n_kv_heads=2, ffn_dim=344, max_seq_len=256)


def _balance_rank(info: RankInfo, model_cfg, train_cfg, parallel, layouts: dict, steps: int, rounds: int):
    comms = Comms(parallel.dims.build_meshes())
    runs, runners = {}, {}
    for name, bounds in layouts.items():
        trainer, step = _ours(info, model_cfg, train_cfg, parallel, comms, bounds)
        runners[name] = trainer.forward_backward
        runs[name] = phase_timed(step, runners[name].stages.values(), trainer.optimizer)
    times = alternate({name: step for name, (step, _) in runs.items()}, 1, steps * rounds)
    phases = {name: _beyond_floor(seconds, times[name], runners[name].report()["pipeline"]["simulated_makespan_s"])
              for name, (_, seconds) in runs.items()}  # each partition against its own floor
    return times, phases, round_ratios(times, "balanced", "equal", rounds)


@bench("pipeline-balance")
def bench_pipeline_balance(args) -> dict:
    """1F1B step time with stages cut by measured per-layer cost vs equal layer counts (large-vocab head)."""
    from parallelisms.parallel.pipeline.partition import balanced_bounds, equal_bounds, profile_costs, stage_costs

    train_cfg = TrainConfig(global_batch=args.global_batch, seq_len=args.seq_len, grad_clip=0.0)
    schedule = args.schedule
    require(schedule in ("gpipe", "1f1b", "zb-h1", "zb-h2"),
            f"bench pipeline-balance runs a one-stage-per-rank schedule (gpipe, 1f1b, zb-h1, zb-h2), not {schedule}")
    parallel = validate_layout(BIG_HEAD, train_cfg, _layout(args.world, schedule, args.microbatches))
    torch.set_num_threads(1)
    layers, first, last = profile_costs(BIG_HEAD, args.global_batch // parallel.microbatches, args.seq_len)
    layouts = {"equal": equal_bounds(BIG_HEAD.n_layers, args.world),
               "balanced": balanced_bounds(layers, first, last, args.world)}
    times, phases, ratio_rounds = launch(_balance_rank, args.world, BIG_HEAD, train_cfg, parallel, layouts,
                                         args.steps, args.rounds, backend="gloo", threads=1)[0]
    single = single_process_step_time(BIG_HEAD, train_cfg, args.steps)
    return {"bench": "pipeline-balance", "schedule": schedule, "world_size": args.world,
            "microbatches": parallel.microbatches, "layer_s": layers, "embedding_s": first, "head_s": last,
            "bounds": layouts,
            "predicted_stage_s": {k: stage_costs(b, layers, first, last) for k, b in layouts.items()},
            "ours_s": times["balanced"], "peer": "equal layer counts", "peer_s": times["equal"],
            "ratio": times["balanced"] / times["equal"], "ratio_rounds": ratio_rounds,
            "improvement": 1.0 - times["balanced"] / times["equal"],
            "phases": {"ours": phases["balanced"], "peer": phases["equal"]},
            **scaling(single, args.world, times["balanced"], times["equal"])}
