"""``parallelisms bench zero1|zero2|zero3|fsdp``: the sharded data-parallel layouts against torch's own and
DeepSpeed's, in the same processes, on the same model, data and AdamW settings (no clipping on either).

Peers: ``ZeroRedundancyOptimizer`` over ``DistributedDataParallel`` (ZeRO-1, and the ZeRO-2 headline),
FSDP1 ``FullyShardedDataParallel`` per strategy (each embedding and block wrapped, the root holding the
head, like our units), FSDP2 ``fully_shard`` (blocks, then the root), and DeepSpeed stage k when it
imports (``DS_ACCELERATOR=cpu``). Time: median step seconds, alternating rounds (``bench.alternate``).

Memory, measured the same way for every implementation: the CPU allocator's events under
``torch.profiler`` (``profile_memory``) from before the full model is built, through wrapping and two
training steps. ``peak_bytes`` is the highest live total during the steps (parameters, gradients,
optimizer state, communication buffers, activations), ``allocations_per_step`` the allocator calls in
the second step. Frees of blocks allocated outside the window are ignored, so garbage of another
implementation collected meanwhile does not count; a block freed on a thread the profiler does not see
(a communication thread dropping the last reference) counts as freed when its address is reused. Our
comm layer's worker thread keeps no tensor of a finished call, so our frees are seen; torch's process
groups can free a bucket on their own threads, so a peer's peak can be high by a buffer or two (FSDP2's
measured 72.2-75.4 MB over runs of the same step). ``peak_memory_ratio`` = ours / peer. Ranks report
their own figures; the maximum over ranks is kept.

``floor_ratio``: the time of the same step with no communication at all and AdamW over a 1/N share of the
parameters (:func:`_alone`, in the same processes and rounds) over the headline peer's: no sharded
data parallelism can go below it on these cores. ``meet_ratio``: the same step with the ranks meeting once
after backward (:data:`MEET`), what the sharding would take if its communication cost nothing but the wait
for the later rank. ``peak_floor_ratio``: the same for memory, the least peak
the stage can have (:func:`peak_floor`) over the headline peer's peak.
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

from parallelisms.bench import (alternate, bench, phase_medians, phase_timed, plain_step, profiled, ratios, scaling,
                               single_process_step_time, transient_peak)
from parallelisms.comm import Comms
from parallelisms.config import ParallelConfig, TrainConfig, preset
from parallelisms.data import BatchLoader, load_corpus
from parallelisms.launch import RankInfo, launch
from parallelisms.mesh import ParallelDims
from parallelisms.model import build_model
from parallelisms.model.transformer import Block
from parallelisms.optim import make_optimizer
from parallelisms.parallel.wrap import module_units
from parallelisms.train_setup import parallelize


# -- implementations ----------------------------------------------------------------------------------------

def _ours(parallel: ParallelConfig, meshes: dict):
    def build(model_cfg, train_cfg, batch):
        trainer = parallelize(build_model(model_cfg, train_cfg.seed), parallel, train_cfg, Comms(meshes))
        return _phase_timed(lambda: trainer.train_step(*batch), trainer.forward_backward.model, trainer.optimizer)
    return build


def _plain_step(model: nn.Module, optimizer, batch, zero_grad=None, after_backward=None):
    return _phase_timed(plain_step(model, optimizer, batch, zero_grad, after_backward), model, optimizer)


def _phase_timed(step, model: nn.Module, optimizer):
    """``step`` with its phase times as ``.phases`` (``profiled`` and ``alternate`` take the step alone)."""
    timed, timed.phases = phase_timed(step, [model], optimizer)
    return timed


ALONE = "alone (no communication)"
MEET = "alone, ranks meeting after backward"


def _alone(world: int, meet=None):
    """The floor of every sharded layout's time here: this rank's rows through the plain model with no
    communication at all, and AdamW over a 1/``world`` share of the parameters (a sharded rank's optimizer
    work). ``meet``: a one-element all-reduce after backward, the one meeting of the ranks every synchronous
    data parallelism has (the floor plus the wait for the later rank)."""
    def build(model_cfg, train_cfg, batch):
        model = build_model(model_cfg, train_cfg.seed)
        total, share, held = sum(p.numel() for p in model.parameters()), [], 0
        for p in model.parameters():
            if held * world < total:
                share.append(p)
                held += p.numel()
        after_backward = None if meet is None else (lambda one=torch.zeros(1): meet.all_reduce(one))
        return _plain_step(model, make_optimizer(share, train_cfg), batch, model.zero_grad, after_backward)
    return build


def peak_floor(stage: int, world: int, model_cfg, train_cfg: TrainConfig, batch) -> int:
    """The least peak memory a ZeRO stage can have on this rank (``stage`` 3 for FULL_SHARD too): the
    transient bytes of the plain model's forward and backward on the rank's rows (activations and
    temporaries, measured with the gradients already allocated, so that only what comes and goes counts),
    plus the parameters the stage holds throughout (all of them for stages 1-2; for stage 3 a 1/``world``
    shard and the largest unit gathered) and AdamW's state over 1/``world`` of them. Gradients are left out
    (dropped at ``zero_grad``, they grow as backward frees activations), and so are buckets and a prefetched
    unit: no implementation goes below it."""
    model = build_model(model_cfg, train_cfg.seed)
    optimizer = make_optimizer(model.parameters(), train_cfg)
    plain_step(model, optimizer, batch)()  # gradients and the optimizer's state allocated
    model.zero_grad(set_to_none=False)
    transient = transient_peak(lambda: model(*batch).backward())
    nbytes = lambda tensors: sum(t.numel() * t.element_size() for t in tensors)  # noqa: E731
    params = nbytes(model.parameters())
    state = nbytes(t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))
    unit = max(nbytes(p for m in modules for p in m.parameters()) for _, modules in module_units(model))
    held = params // world + unit if stage == 3 else params
    return transient + held + state // world


def _torch_zero1(model_cfg, train_cfg, batch):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(build_model(model_cfg, train_cfg.seed), bucket_cap_mb=train_cfg.bucket_mb)
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=train_cfg.lr,
                                        betas=train_cfg.betas, weight_decay=train_cfg.weight_decay, eps=train_cfg.eps)
    return _plain_step(model, optimizer, batch)


def _torch_fsdp1(strategy: str, mesh=None):
    def build(model_cfg, train_cfg, batch):
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FullyShardedDataParallel(build_model(model_cfg, train_cfg.seed),
                                         auto_wrap_policy=ModuleWrapPolicy({Block, nn.Embedding}),
                                         sharding_strategy=ShardingStrategy[strategy.upper()],
                                         device_id=torch.device("cpu"), device_mesh=mesh)
        return _plain_step(model, make_optimizer(model.parameters(), train_cfg), batch)
    return build


def _torch_fsdp2(mesh):
    def build(model_cfg, train_cfg, batch):
        from torch.distributed.fsdp import fully_shard

        model = build_model(model_cfg, train_cfg.seed)
        for module in [model.tok_embeddings, *model.layers.values()]:
            fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return _plain_step(model, make_optimizer(model.parameters(), train_cfg), batch)
    return build


def _deepspeed(stage: int):
    def build(model_cfg, train_cfg, batch):
        import deepspeed

        model = build_model(model_cfg, train_cfg.seed)
        config = {"train_micro_batch_size_per_gpu": batch[0].shape[0], "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": stage, **_deepspeed_buckets(train_cfg)},
                  "optimizer": {"type": "AdamW", "params": {
                      "lr": train_cfg.lr, "betas": list(train_cfg.betas), "weight_decay": train_cfg.weight_decay,
                      "eps": 1e-8, "torch_adam": True}}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

        def step():
            loss = engine(*batch)
            engine.backward(loss)
            engine.step()
        return step
    return build


def _deepspeed_buckets(train_cfg: TrainConfig) -> dict:
    """DeepSpeed's bucket sizes (elements) at the same cap as ours, instead of its 5e8-element defaults."""
    elements = int(train_cfg.bucket_mb * 2**20 / 4)
    return {"reduce_bucket_size": elements, "allgather_bucket_size": elements,
            "stage3_prefetch_bucket_size": elements, "stage3_param_persistence_threshold": 0}


def deepspeed_status() -> str | None:
    """None when DeepSpeed imports with the CPU accelerator; otherwise why it is left out."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:  # not installed, or fails to import on this machine
        return f"{exc.__class__.__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
    return None


# -- the benchmark rank and the entries --------------------------------------------------------------------

def _implementations(name: str, world: int, with_deepspeed: bool) -> tuple[dict, dict]:
    """(ours, peers) for one benchmark: label -> builder. The first peer is the headline one."""
    from torch.distributed.device_mesh import init_device_mesh

    dims = ParallelDims(dp_shard=world)
    meshes = dims.build_meshes()
    flat = init_device_mesh("cpu", (world,))

    def config(**kw):
        return ParallelConfig(dims, **kw)
    if name in ("zero1", "zero2", "zero3"):
        stage = int(name[-1])
        ours = {f"zero{stage}": _ours(config(zero=stage), meshes)}
        peers = {1: {"torch ZeroRedundancyOptimizer+DDP": _torch_zero1},
                 2: {"torch ZeroRedundancyOptimizer+DDP": _torch_zero1,
                     "torch FSDP1 shard_grad_op": _torch_fsdp1("shard_grad_op")},
                 3: {"torch FSDP2 fully_shard": _torch_fsdp2(flat),
                     "torch FSDP1 full_shard": _torch_fsdp1("full_shard")}}[stage]
        if stage == 3:
            ours["fsdp per_param"] = _ours(config(fsdp="full_shard", fsdp_style="per_param"), meshes)
            ours["fsdp reuse"] = _ours(config(fsdp="full_shard", fsdp_style="reuse"), meshes)
        if with_deepspeed:
            peers[f"DeepSpeed ZeRO stage {stage}"] = _deepspeed(stage)
        return ours, peers
    strategies = ["full_shard", "shard_grad_op", "no_shard"]
    ours = {f"fsdp {s}": _ours(config(fsdp=s), meshes) for s in strategies}
    peers = {f"torch FSDP1 {s}": _torch_fsdp1(s) for s in strategies}
    if world >= 4 and world % 2 == 0:
        hybrid_dims = ParallelDims(dp_replicate=2, dp_shard=world // 2)
        hybrid_meshes = hybrid_dims.build_meshes()
        hybrid_mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        for s in ("hybrid_shard", "hybrid_shard_zero2"):
            ours[f"fsdp {s}"] = _ours(ParallelConfig(hybrid_dims, fsdp=s), hybrid_meshes)
            peers[f"torch FSDP1 {s}"] = _torch_fsdp1(s, hybrid_mesh)
    ours["fsdp per_param"] = _ours(config(fsdp="full_shard", fsdp_style="per_param"), meshes)
    ours["fsdp reuse"] = _ours(config(fsdp="full_shard", fsdp_style="reuse"), meshes)
    peers["torch FSDP2 fully_shard"] = _torch_fsdp2(flat)
    return ours, peers


def _bench_rank(info: RankInfo, name: str, model_cfg, train_cfg: TrainConfig, steps: int, rounds: int,
                with_deepspeed: bool):
    if with_deepspeed:
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo")
    batch = BatchLoader(load_corpus(), train_cfg.global_batch, train_cfg.seq_len, train_cfg.seed).shard(
        0, info.rank, info.world_size)
    ours, peers = _implementations(name, info.world_size, with_deepspeed)
    runs, memory = {}, {}
    meet = Comms(ParallelDims(dp_shard=info.world_size).build_meshes())["dp"]
    floors = {ALONE: _alone(info.world_size), MEET: _alone(info.world_size, meet)}
    for label, build in {**ours, **peers, **floors}.items():
        runs[label], memory[label] = profiled(lambda: build(model_cfg, train_cfg, batch))
    floor = peak_floor(3 if name == "fsdp" else int(name[-1]), info.world_size, model_cfg, train_cfg, batch)
    times = alternate(runs, steps, rounds)
    # the two profiled steps and the warm-up step left out of the phases
    return ({label: {"s": times[label], "rounds_s": times.per_round(label, rounds), **memory[label], "phases": phase_medians(
                getattr(runs[label], "phases", None), times[label], times[ALONE], skip=3)} for label in runs},
            list(ours), list(peers), floor)


def _pair(ours: dict, peer: dict) -> dict:
    return {"ours_s": ours["s"], "peer_s": peer["s"], "ratio": ours["s"] / peer["s"],
            "ratio_rounds": ratios(ours["rounds_s"], peer["rounds_s"]),
            "peak_memory_ratio": ours["peak_bytes"] / peer["peak_bytes"],
            "ours_peak_bytes": ours["peak_bytes"], "peer_peak_bytes": peer["peak_bytes"],
            "ours_allocations_per_step": ours["allocations_per_step"],
            "peer_allocations_per_step": peer["allocations_per_step"]}


def run_zero_bench(name: str, args) -> dict:
    model_cfg = preset(args.preset).validate()
    train_cfg = TrainConfig(global_batch=args.global_batch, seq_len=args.seq_len, bucket_mb=args.bucket_mb,
                            grad_clip=0.0)
    train_cfg.validate(model_cfg, dp=args.world)
    why_not = deepspeed_status()
    if why_not is not None:  # the optional peer: one line naming the extra that adds it
        print(f"note: DeepSpeed left out ({why_not}); pip install 'parallelisms[deepspeed]' to compare with it",
              file=sys.stderr)
    per_rank = launch(_bench_rank, args.world, name, model_cfg, train_cfg, args.steps, args.rounds,
                      why_not is None, backend="gloo", threads=1)
    ours_labels, peer_labels = per_rank[0][1], per_rank[0][2]
    floor_bytes = max(r[3] for r in per_rank)
    results = {label: {"s": per_rank[0][0][label]["s"], "rounds_s": per_rank[0][0][label]["rounds_s"],
                       "peak_bytes": max(r[0][label]["peak_bytes"] for r in per_rank),
                       "allocations_per_step": max(r[0][label]["allocations_per_step"] for r in per_rank)}
               for label in per_rank[0][0]}
    headline_ours, headline_peer = ours_labels[0], peer_labels[0]
    out = {"bench": name, "world_size": args.world, "params": model_cfg.num_params(), "ours": headline_ours,
           "peer": headline_peer, **_pair(results[headline_ours], results[headline_peer])}
    out["phases"] = {"ours": per_rank[0][0][headline_ours]["phases"], "peer": per_rank[0][0][headline_peer]["phases"],
                     "alone": per_rank[0][0][ALONE]["phases"], "meet": per_rank[0][0][MEET]["phases"]}  # rank 0's
    out["alone_s"] = results[ALONE]["s"]
    out["floor_ratio"] = results[ALONE]["s"] / results[headline_peer]["s"]  # the lowest ratio any sharding reaches
    out["meet_s"] = results[MEET]["s"]
    out["meet_ratio"] = results[MEET]["s"] / results[headline_peer]["s"]  # ... when the ranks must also meet
    out["peak_floor_bytes"] = floor_bytes  # the least peak this stage can have (peak_floor)
    out["peak_floor_ratio"] = floor_bytes / results[headline_peer]["peak_bytes"]
    out["implementations"] = results
    out["comparisons"] = {f"{o} vs {p}": _pair(results[o], results[p]) for o, p in _comparisons(ours_labels,
                                                                                                 peer_labels)}
    out.update(scaling(single_process_step_time(model_cfg, train_cfg, args.steps), args.world,
                       results[headline_ours]["s"], results[headline_peer]["s"]))
    out["deepspeed"] = "included" if why_not is None else f"not run: {why_not}"
    return out


def _comparisons(ours: list[str], peers: list[str]) -> list[tuple[str, str]]:
    """Each of ours against the peer of the same strategy, per-parameter against FSDP2, reuse against flat."""
    pairs = []
    for o in ours:
        strategy = o.split()[-1]
        same = [p for p in peers if p.endswith(strategy)]
        if o.endswith("per_param") or o.endswith("reuse"):
            same = [p for p in peers if "FSDP2" in p]
        pairs += [(o, p) for p in (same or peers)]
    if "fsdp reuse" in ours:
        flat = "fsdp full_shard" if "fsdp full_shard" in ours else ours[0]
        pairs.append(("fsdp reuse", flat))
    return pairs


def _entry(name: str):
    @bench(name)
    def run(args) -> dict:
        return run_zero_bench(name, args)
    run.__doc__ = f"Our {name} against torch (and DeepSpeed when installed): time and peak memory."
    return run


for _name in ("zero1", "zero2", "zero3", "fsdp"):
    _entry(_name)
