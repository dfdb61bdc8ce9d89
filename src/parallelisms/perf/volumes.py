"""The collectives each parallelism makes per step, as perf/ prices them: one function per descriptor of
:data:`parallelisms.parallel.registry.PARALLELISMS` (its ``volumes`` names it), each giving rank 0's bytes per
collective and mesh dimension (:class:`~parallelisms.perf.model.CommVolume`) for a layout, and nothing where the
parallelism is off; :func:`parallelisms.perf.model.comm_per_step` adds them up in the registry's order.

Sources: the spec's formulas (DP 2(N-1)/N G; TP 4(N-1)A/N per block each way; ZeRO-3 1.5x DP), ZeRO
(Rajbhandari et al. SC'20), Megatron's f and g (Shoeybi et al. 2019) and sequence parallelism (Korthikanti et al.
MLSys'23), the context-parallel modes' registry (:mod:`parallelisms.parallel.cp_modes`), the pipeline schedules'
own sends. Every collective the runtime's ledger counts.
"""

from __future__ import annotations

from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig
from parallelisms.options import FsdpStyle, Precision, Recompute, Schedule
from parallelisms.perf.context import context_volumes
from parallelisms.perf.model import (CommVolume, block_params, dense_shards, expert_block_change, expert_slot_params,
                                     expert_slots, microbatches_per_step, mirror_gradient_bytes, per_param_padding,
                                     pipedream_updates, rank0_dense_and_experts, rank0_end_shares,
                                     redundant_expert_grads, sharding_stage, tied_gradient_bytes)
from parallelisms.perf.stages import rank0_held, rank0_layers, schedule_of


# -- data parallelism: one gradient sync engine, DDP's, ZeRO's or FSDP's ---------------------------------------

def ddp(cfg: ModelConfig, parallel: ParallelConfig, train: TrainConfig, dtype_bytes: int) -> list[CommVolume]:
    """DDP's all-reduces, where no sharding engine replaces it."""
    return [] if parallel.zero or parallel.fsdp else _gradient_sync(cfg, parallel, train, dtype_bytes)


def zero(cfg: ModelConfig, parallel: ParallelConfig, train: TrainConfig, dtype_bytes: int) -> list[CommVolume]:
    """ZeRO's reduce-scatters and all-gathers (``--zero 1/2/3``)."""
    return _gradient_sync(cfg, parallel, train, dtype_bytes) if parallel.zero else []


def fsdp(cfg: ModelConfig, parallel: ParallelConfig, train: TrainConfig, dtype_bytes: int) -> list[CommVolume]:
    """FSDP's (``--fsdp``, any style), HSDP's all-reduce across its replicas included."""
    return _gradient_sync(cfg, parallel, train, dtype_bytes) if parallel.fsdp else []


def _gradient_sync(cfg: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
                   dtype_bytes: int) -> list[CommVolume]:
    """The layout's engine over every rank that saw different tokens (dp x cp) for the dense weights, and over the
    ranks holding the same experts (``ep_replicate``) for rank 0's expert weights (sharded over ep; rank0_params
    splits the experts and the router over tp instead), with EPLB's copies of a hot expert summing their gradients
    over ep (and over the replicas where the engine shards the slots)."""
    dims = parallel.dims
    out = []
    dense, expert_params = rank0_dense_and_experts(cfg, parallel)
    if dims.span("dp_cp")[0] > 1:
        hybrid = bool(parallel.fsdp and parallel.fsdp.hybrid)
        shards = dense_shards(parallel)  # HSDP shards within dp_shard, replicates across
        dense += sum(per_param_padding(cfg, parallel, shards))
        if hybrid and dims.dp_replicate > 1:  # each shard's reduced gradient all-reduced over the replicas
            replicas = dims.span("dp_replicate")[0]
            m_reduce = microbatches_per_step(parallel, train) if dims.pp == 1 else 1
            out.append(CommVolume("all_reduce", "dp", m_reduce * 2 * (replicas - 1) / replicas * dense * 4 / shards))
        out += _engine_volumes(parallel, train, "dp", shards, dense, dtype_bytes,
                               _gathered_per_microbatch(cfg, parallel, dtype_bytes))
    if expert_params:
        replicas = dims.span("ep_replicate")[0]
        out += _engine_volumes(parallel, train, "ep_replicate", replicas, expert_params, dtype_bytes,
                               expert_params * dtype_bytes * (1 if dims.pp > 1 else 2))
        copies = redundant_expert_grads(cfg, parallel, rank0_held(cfg, parallel)[0])
        if copies:
            out.append(CommVolume("all_reduce", "ep", 2 * (dims.ep - 1) / dims.ep * copies * 4))
            if replicas > 1 and sharding_stage(parallel):
                out.append(CommVolume("all_reduce", "ep_replicate", 2 * (replicas - 1) / replicas * copies * 4))
    return out


def _engine_volumes(parallel: ParallelConfig, train: TrainConfig, dim: str, shards: int, params: float,
                    dtype_bytes: int, gathered: float) -> list[CommVolume]:
    """The gradient sync engine's bytes per step over ``dim`` (``shards`` ranks) for ``params`` parameters:
    without a pipeline the engines reduce sharded gradients (ZeRO-2/3, FSDP but NO_SHARD) and gather sharded
    parameters (``gathered`` bytes per microbatch before the ring factor) every microbatch; a pipeline stage holds
    its units through the step (once); ZeRO-1 reduces once a step and gathers after it, as ZeRO-2 does; DDP
    all-reduces (under PipeDream, each of its per-microbatch updates). Gradients travel in fp32, parameters in
    the compute dtype."""
    if shards <= 1:
        return []
    ring, grads = (shards - 1) / shards, params * 4
    m = microbatches_per_step(parallel, train) if parallel.dims.pp == 1 else 1
    stage = sharding_stage(parallel)
    if stage == 3:
        return [CommVolume("all_gather", dim, m * ring * gathered), CommVolume("reduce_scatter", dim, m * ring * grads)]
    if stage:
        gathers = m if parallel.fsdp and parallel.fsdp.stage == 2 else 1
        return [CommVolume("reduce_scatter", dim, (m if parallel.zero != 1 else 1) * ring * grads),
                CommVolume("all_gather", dim, gathers * ring * params * dtype_bytes)]
    return [CommVolume("all_reduce", dim, pipedream_updates(parallel) * 2 * ring * grads)]


def _gathered_per_microbatch(cfg: ModelConfig, parallel: ParallelConfig, dtype_bytes: int) -> float:
    """Bytes of parameters a fully sharded engine all-gathers per microbatch (before the ring factor): the flat
    engine every unit for forward and again for backward; the per-parameter one (FSDP2) every unit for forward
    and the blocks again for backward (the head stays gathered after its forward, the embedding's backward needs
    no weights); buffer reuse (YaFSDP) the same less the last block, still in its buffer when backward starts.
    A pipeline stage holds its units through the step: one gather a step (per-parameter FSDP's padded rows too).
    The dense weights only: the experts
    gather over the ranks holding the same experts (:func:`_gradient_sync`)."""
    params = rank0_dense_and_experts(cfg, parallel)[0] * dtype_bytes
    padding = per_param_padding(cfg, parallel, parallel.dims.dp_shard * parallel.dims.cp)
    if parallel.dims.pp > 1:
        return params + sum(padding) * dtype_bytes
    if parallel.fsdp_style is FsdpStyle.FLAT or parallel.zero:
        return 2 * params
    experts = expert_slot_params(cfg, parallel)  # a block's, on this rank
    block = (block_params(cfg, parallel.dims.tp) + expert_block_change(cfg, parallel) - experts) * dtype_bytes
    blocks = rank0_layers(cfg, parallel) * block
    reused = block if parallel.fsdp_style is FsdpStyle.REUSE else 0
    return params + blocks - reused + (sum(padding) + padding[1]) * dtype_bytes


# -- tensor (and sequence) parallelism ------------------------------------------------------------------

def tensor_parallel(cfg: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
                    dtype_bytes: int) -> list[CommVolume]:
    """Rank 0's tensor-parallel bytes per step, as its ledger counts them, with A the residual activation of its
    tokens. Per block and pass, Megatron's f and g (Shoeybi et al. 2019) for attention and the MLP: all-reduces
    of A (forward g, backward f); under sequence parallelism (Korthikanti et al. 2023) all-gathers and
    reduce-scatters of A instead, the backward re-gathering each column layer's input for its weight gradient,
    and the two norm weights' gradients all-reduced per microbatch. A full recompute repeats the forward's.
    The ends, for the microbatches that pass them on rank 0 (:func:`rank0_end_shares`): the vocabulary-parallel
    embedding (an all-reduce of its output, or a reduce-scatter into the sequence shards and an all-gather back),
    and the head's: the cross-entropy's two all-reduces (row maxima; sums of exponentials and target
    logits), the head input's f (or, under SP, the final norm's output gathered, re-gathered, its gradient
    reduce-scattered, and the final norm weight's gradient all-reduced). Sequence parallelism's are these."""
    dims, t, sp = parallel.dims, parallel.dims.tp, parallel.sequence_parallel
    if t == 1:
        return []
    tokens = train.global_batch // dims.dp * train.seq_len // dims.cp
    elem = train.dtype.bytes
    layers = rank0_layers(cfg, parallel)
    embedding, head = rank0_end_shares(parallel)
    gather = (t - 1) / t * tokens * cfg.dim * dtype_bytes  # one all-gather or reduce-scatter of A
    forward = layers * (2 if parallel.recompute is Recompute.FULL else 1)  # blocks' forwards run
    small = head * tokens * 3 * elem  # the cross-entropy: one value per token, then two
    # fewer key/value heads than ranks: each rank keeps 1/t of the K and V weights and all-gathers them (compute
    # dtype) in every forward, reduce-scattering their gradients in backward
    kv_weights = (t - 1) / t * 2 * cfg.n_kv_heads * cfg.head_dim * cfg.dim * dtype_bytes if t > cfg.n_kv_heads else 0.0
    m = microbatches_per_step(parallel, train)
    mlp = 0 if cfg.n_experts else 1  # an MoE layer is whole on every rank; under SP it gathers its input and the
    # output's gradient (parallel/moe_sequence.py), reduce-scattering nothing
    if not sp:  # the blocks' f and g; the embedding's output; the head input's f
        reduces = (forward + layers) * (1 + mlp) + embedding + head
        out = [CommVolume("all_reduce", "tp", reduces * 2 * gather + 2 * (t - 1) / t * small)]
        return out + ([CommVolume("all_gather", "tp", m * forward * kv_weights),
                       CommVolume("reduce_scatter", "tp", m * layers * kv_weights)] if kv_weights else [])
    gathers = (forward * 2 + layers * (3 + mlp) + embedding + 2 * head) * gather + m * forward * kv_weights  # the embedding's
    scatters = ((forward + layers) * (1 + mlp) + embedding + head) * gather + m * layers * kv_weights  # gradient; the head's
    norm_bytes = 2 if parallel.mixed_precision is Precision.BF16 else elem  # the compute dtype's gradients
    norms = m * (2 * layers + head) * cfg.dim * norm_bytes  # per microbatch
    return [CommVolume("all_gather", "tp", gathers), CommVolume("reduce_scatter", "tp", scatters),
            CommVolume("all_reduce", "tp", 2 * (t - 1) / t * (small + norms))]


# -- context, expert and pipeline parallelism -------------------------------------------------------------

def context_parallel(cfg: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
                     dtype_bytes: int) -> list[CommVolume]:
    """Rank 0's context-parallel bytes per step over its stage's layers: its mode's exchanges per layer from the
    modes' registry (:mod:`parallelisms.perf.context`), with recomputed forwards' re-sends and the K/V heads
    Ulysses repeats, for the local queries and K (or V) of its tokens."""
    dims = parallel.dims
    if dims.cp == 1:
        return []
    layers = rank0_layers(cfg, parallel)
    tokens = train.global_batch // dims.dp * train.seq_len // dims.cp
    q = tokens * cfg.q_dim // dims.tp * dtype_bytes
    kv = tokens * cfg.n_kv_heads // dims.tp * cfg.head_dim * dtype_bytes
    return [CommVolume(kind, dim, per_layer * layers)
            for kind, dim, per_layer in context_volumes(cfg, parallel, q, kv, dtype_bytes)]


def expert_parallel(cfg: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
                    dtype_bytes: int) -> list[CommVolume]:
    """The experts' all-to-alls (their gradients are the engine's: :func:`_gradient_sync`)."""
    if not expert_slot_params(cfg, parallel):
        return []
    return [CommVolume("all_to_all", "ep", _expert_all_to_alls(cfg, parallel, train, dtype_bytes))]


def _expert_all_to_alls(cfg: ModelConfig, parallel: ParallelConfig, train: TrainConfig, dtype_bytes: int) -> float:
    """Rank 0's expert all-to-all bytes per step over its stage's layers (``parallel/expert.py``): per MoE layer,
    microbatch and forward run (a full recompute runs it again in backward), the tokens per expert (int64) and
    the dispatch and combine of the routed rows; backward the two reverse all-to-alls of their gradients, rows in
    the compute dtype. Uniform routing: (ep - 1)/ep of a rank's rows (its tokens x top-k) leave it. The counts are
    per slot: the experts, and ``--ep-redundant`` more per rank under ``--ep-balance measured``."""
    dims = parallel.dims
    leaving = (dims.ep - 1) / dims.ep
    rows = train.global_batch // dims.dp * train.seq_len // dims.cp * cfg.top_k * leaving
    forwards = 2 if parallel.recompute is Recompute.FULL else 1
    counts = microbatches_per_step(parallel, train) * leaving * expert_slots(cfg, parallel) * dims.ep * 8
    return rank0_layers(cfg, parallel) * (forwards * counts + (2 * forwards + 2) * rows * cfg.dim * dtype_bytes)


def pipeline_parallel(cfg: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
                      dtype_bytes: int) -> list[CommVolume]:
    """The stages' sends: as many activations and gradients as the schedule has rank 0 send, of the residual
    stream (sequence-sharded under SP); DualPipe's two copies of each stage exchange their fp32 gradient buffers, a
    tied embedding's two copies theirs."""
    from parallelisms.parallel.pipeline.schedules import Kind

    dims = parallel.dims
    if dims.pp == 1:
        return []
    m = microbatches_per_step(parallel, train)
    schedule = schedule_of(parallel.schedule, dims.pp, m, parallel.chunks)
    sends = sum(1 for a in schedule.ranks[0] if a.kind in (Kind.SEND_F, Kind.SEND_B))
    activation = train.global_batch // dims.dp // m * train.seq_len // dims.cp * cfg.dim * dtype_bytes
    if parallel.sequence_parallel:
        activation //= dims.tp
    out = [CommVolume("send", "pp", sends * activation)]
    if parallel.schedule is Schedule.DUALPIPE:
        out.append(CommVolume("send", "pp", mirror_gradient_bytes(cfg, parallel)))
    if tied_gradient_bytes(cfg, parallel):
        out.append(CommVolume("send", "pp", tied_gradient_bytes(cfg, parallel)))
    return out

