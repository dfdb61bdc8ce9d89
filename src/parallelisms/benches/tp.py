"""``parallelisms bench tp``: our tensor-parallel transformer block (and its MLP alone) against torch
DTensor ``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel`` (plus ``SequenceParallel``
norms and sequence-sharded inputs/outputs under ``--sp``), same weights and shapes, forward + backward.

``phases``: forward and backward for ours, the peer and one process running the plain block on the whole
batch (rank 0, in the same rounds); exposed communication is the time beyond that one process's split
evenly over the ranks, which is also the floor (``floor_ratio``); scaling efficiency against it.

It also reports what ``--tp-overlap --tp-overlap-chunks 2`` hides (ours_overlap), read from the timeline: in
the backward, the time the asynchronous input-gradient reductions of the column-parallel regions were in
flight, and the part of it a rank spent waiting for them (exposed), the rest overlapped the weight-gradient
GEMMs; in the forward, the same of the collectives pipelined with their GEMMs (the row-parallel all-reduces;
under SP the column regions' all-gathers and the row-parallel reduce-scatters).
"""

from __future__ import annotations

import statistics
import time

import torch

from parallelisms.support import validate_layout
from parallelisms.bench import alternate, bench, phase_medians, round_ratios, scaling
from parallelisms.config import ParallelConfig, TrainConfig, preset
from parallelisms.errors import ConfigError
from parallelisms.launch import RankInfo, launch
from parallelisms.mesh import ParallelDims
from parallelisms.model import build_model

OVERLAP_CHUNKS = 2  # ours_overlap: --tp-overlap --tp-overlap-chunks 2


def _peer_plan(sp: bool) -> dict:
    """The torchtitan-style DTensor plan for one block of the plain model (its MLP is benchmarked alone too)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    out = Shard(1) if sp else Replicate()
    plan = {f"attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")}
    plan.update({"feed_forward.w_gate": ColwiseParallel(), "feed_forward.w_up": ColwiseParallel(),
                 "attention.wo": RowwiseParallel(output_layouts=out),
                 "feed_forward.w_down": RowwiseParallel(output_layouts=out)})
    if sp:
        plan.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                     "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                     desired_input_layouts=(Replicate(), None, None)),
                     "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))})
    return plan


def _tp_rank(info: RankInfo, model_cfg, train_cfg: TrainConfig, sp: bool, steps: int, rounds: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from parallelisms.comm import CommLedger, Comms, Timeline
    from parallelisms.parallel.tensor_plan import apply_tensor_parallel

    mesh = init_device_mesh("cpu", (info.world_size,), mesh_dim_names=("tp",))
    gen = torch.Generator().manual_seed(0)
    seq = train_cfg.seq_len // info.world_size if sp else train_cfg.seq_len
    batch = train_cfg.global_batch
    full = torch.randn(batch, train_cfg.seq_len, model_cfg.dim, generator=gen)
    x = (full.chunk(info.world_size, dim=1)[info.rank] if sp else full).contiguous().requires_grad_()
    grad_out = torch.randn(batch, seq, model_cfg.dim, generator=gen)

    timings, runs = {}, {}
    for overlap in (False, True):
        timeline = Timeline(info.rank, enabled=False)
        comms = Comms({"tp": mesh}, CommLedger(), timeline)
        ours = apply_tensor_parallel(build_model(model_cfg, train_cfg.seed), comms["tp"], sp, overlap,
                                     OVERLAP_CHUNKS if overlap else 1)
        runs[overlap] = (ours, timeline)
    peer = build_model(model_cfg, train_cfg.seed)
    cos, sin = peer.rope_cos[:train_cfg.seq_len], peer.rope_sin[:train_cfg.seq_len]
    parallelize_module(peer.layers["0"], mesh, _peer_plan(sp))
    one = build_model(model_cfg, train_cfg.seed).layers["0"]  # the plain block on the whole batch, rank 0 only
    whole_x, whole_grad = full.clone().requires_grad_(), torch.randn(batch, train_cfg.seq_len, model_cfg.dim, generator=gen)
    phases = {}
    for target in ("block", "mlp"):
        fns, seconds = {}, {}
        for overlap, (model, _) in runs.items():
            name = "ours_overlap" if overlap else "ours"
            fns[name] = _step(model.layers["0"], x, grad_out, cos, sin, target, seconds.setdefault(name, _phases()))
        fns["peer"] = _step(peer.layers["0"], x, grad_out, cos, sin, target, seconds.setdefault("peer", _phases()))
        # the other ranks wait for rank 0 in their next collective, outside rank 0's timing
        fns["one_process"] = (_step(one, whole_x, whole_grad, cos, sin, target, seconds.setdefault("one_process", _phases()))
                              if info.rank == 0 else lambda: None)
        timings[target] = alternate(fns, steps, rounds)
        split = timings[target]["one_process"] / info.world_size  # the one process's time split evenly: no communication
        phases[target] = {name: phase_medians(seconds[name], timings[target][name], split)
                          for name in ("ours", "peer", "one_process")} if info.rank == 0 else None

    # What the overlap hides: blocks traced per setting (``steps`` each, alternating; medians). The backward's only
    # input-gradient reductions are the two column-parallel regions' (all-reduce; SP: reduce-scatter); the
    # forward's collectives are the row-parallel all-reduces (SP: the all-gathers and reduce-scatters).
    kinds = {"forward": ("all_gather", "reduce_scatter") if sp else ("all_reduce",),
             "backward": ("reduce_scatter",) if sp else ("all_reduce",)}
    traced = {overlap: [] for overlap in runs}
    for _ in range(steps):
        for overlap, (model, timeline) in runs.items():
            timeline.enabled = True
            start = timeline.now()
            out = model.layers["0"](x, cos, sin)
            middle = timeline.now()
            out.backward(grad_out)
            end = timeline.now()
            row = []
            for phase, (lo, hi) in (("forward", (start, middle)), ("backward", (middle, end))):
                spans = [t for t in timeline.spans if lo <= t.start < hi]
                comm = sum(t.end - t.start for t in spans if t.cat == "comm" and t.name.startswith(kinds[phase]))
                waits = tuple(f"wait {k}" for k in kinds[phase])
                waited = sum(t.end - t.start for t in spans if t.name.startswith(waits))
                row += [(hi - lo) / 1e6, comm / 1e6, (waited if overlap else comm) / 1e6]
            traced[overlap].append(row)
            timeline.enabled = False
            timeline.spans.clear()
    names = [f"{phase}_{k}" for phase in ("forward", "backward") for k in ("ms", "collectives_ms", "exposed_ms")]
    hidden = {("overlap" if overlap else "sync"): dict(zip(names, (statistics.median(col) for col in zip(*rows))))
              for overlap, rows in traced.items()}
    return {"timings": timings, "overlap": hidden, "phases": phases}


def _phases() -> dict:
    return {"forward_s": [], "backward_s": []}


def _step(block, x, grad_out, cos, sin, target: str, seconds: dict):
    """Forward and backward of ``block`` (or its MLP) on ``x``; each call appends its two phases' seconds."""
    module = block if target == "block" else block.feed_forward
    params = list(module.parameters())

    def run():
        for p in params:
            p.grad = None
        start = time.perf_counter()
        out = module(x, cos, sin) if target == "block" else module(x)
        out = out.to_local() if hasattr(out, "to_local") else out
        if hasattr(out, "trigger_wait"):   # DTensor's output all-reduce is lazy: wait as a consumer would
            out.trigger_wait()
        middle = time.perf_counter()
        out.backward(grad_out)
        seconds["forward_s"].append(middle - start)
        seconds["backward_s"].append(time.perf_counter() - middle)
    return run


@bench("tp")
def bench_tp(args) -> dict:
    """Our block / MLP against DTensor ColwiseParallel/RowwiseParallel(/SequenceParallel), fwd+bwd."""
    model_cfg = preset(args.preset).validate()
    sp, target = getattr(args, "sp", False), getattr(args, "target", "block")
    train_cfg = TrainConfig(global_batch=args.global_batch, seq_len=args.seq_len)
    if args.world < 2:
        raise ConfigError(f"bench tp needs --world >= 2 (the TP degree), got {args.world}")
    validate_layout(model_cfg, train_cfg, ParallelConfig(ParallelDims(tp=args.world), sequence_parallel=sp))
    result = launch(_tp_rank, args.world, model_cfg, train_cfg, sp, args.steps, args.rounds, backend="gloo",
                    threads=1)
    times = result[0]["timings"]
    out = {"bench": "tp", "world_size": args.world, "sp": sp, "target": target,
           "shape": [args.global_batch, args.seq_len, model_cfg.dim],
           "ours_s": times[target]["ours"], "peer": "torch DTensor parallelize_module "
           + ("Colwise/Rowwise/SequenceParallel" if sp else "Colwise/RowwiseParallel"),
           "peer_s": times[target]["peer"], "ratio": times[target]["ours"] / times[target]["peer"],
           "ratio_rounds": round_ratios(times[target], "ours", "peer", args.rounds),
           "phases": result[0]["phases"][target],
           "floor_ratio": times[target]["one_process"] / args.world / times[target]["peer"],
           **scaling(times[target]["one_process"], args.world, times[target]["ours"], times[target]["peer"])}
    for name, t in times.items():
        out[f"{name}_ours_s"], out[f"{name}_ours_overlap_s"], out[f"{name}_peer_s"] = t["ours"], t["ours_overlap"], t["peer"]
        out[f"{name}_ratio"] = t["ours"] / t["peer"]
    out["overlap_per_rank"] = [r["overlap"] for r in result]
    return out
