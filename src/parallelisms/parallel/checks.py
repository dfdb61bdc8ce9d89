"""The rules of the parallelisms that are checked before any process starts, in a module without torch: one
function per parallelism (its descriptor in :mod:`parallelisms.parallel.registry` names it), each a one-line
:class:`~parallelisms.errors.ConfigError` on failure. The command line validates a layout through them
(:func:`parallelisms.support.validate_layout`) and ``estimate``, ``plan`` and ``--help`` run without importing
torch. The engines that follow these rules import them from here; context parallelism's modes carry their own
(:mod:`parallelisms.parallel.cp_modes`).
"""

from __future__ import annotations

from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig
from parallelisms.errors import ConfigError, divisors, require
from parallelisms.options import Balance, FsdpStrategy, FsdpStyle, Schedule
from parallelisms.parallel.cp_modes import MODES, Shape
from parallelisms.parallel.ep_placement import check_ep_balance
from parallelisms.parallel.pipeline.schedules import ScheduleError, pipeline_microbatches, schedule_for

# FSDP1's sharding strategies (:mod:`parallelisms.parallel.fsdp`), and the ones that need a 2-D
# ``dp_replicate x dp_shard`` mesh
STRATEGIES = tuple(FsdpStrategy)
HYBRID = tuple(s for s in FsdpStrategy if s.hybrid)


def check_data_parallel(parallel: ParallelConfig, model: ModelConfig, train: TrainConfig) -> None:
    """--dp-balance measured splits each global batch over the data-parallel ranks by measured speed (with a
    pipeline, each replica's share in whole microbatch rounds; with experts too: the router's load-balancing
    loss is a mean over sequences, so weighting it like the language-model loss keeps training exact)."""
    dims = parallel.dims
    if parallel.dp_balance is not Balance.MEASURED:
        require(parallel.rebalance_every == 0, f"--rebalance-every {parallel.rebalance_every} applies only with "
                                               f"--dp-balance measured; add it or drop --rebalance-every")
        return
    require(dims.dp > 1, f"--dp-balance measured needs data parallelism, got dp {dims.dp}; add --dp 2 or more")
    require(dims.pp == 1 or parallel.schedule is not Schedule.PIPEDREAM,
            "--dp-balance measured with --schedule pipedream: its updates after each microbatch would each group "
            "other sequences than single-process training's microbatches do (a replica's microbatches follow its "
            "share); use another schedule or --dp-balance even")


def check_zero(parallel: ParallelConfig, model: ModelConfig, train: TrainConfig) -> None:
    """--zero: a stage, a one-dimensional data-parallel group to shard over, not with --fsdp;
    --overlap-param-gather only for stages 1 and 2 without a pipeline."""
    dims, zero, fsdp = parallel.dims, parallel.zero, parallel.fsdp
    require(zero in (0, 1, 2, 3), f"--zero {zero} is not a ZeRO stage; use 1, 2 or 3 (or 0 for plain DDP)")
    require(not parallel.overlap_param_gather or (zero in (1, 2) and dims.pp == 1),
            f"--overlap-param-gather overlaps ZeRO-1/2's gather of the updated parameters with the next forward: it "
            f"needs --zero 1 or 2 without --pp (got --zero {zero}, --pp {dims.pp})")
    require(not (zero and fsdp), f"--zero {zero} and --fsdp {fsdp} both shard data parallelism; pick one "
                                 f"(--zero 3 is --fsdp full_shard, --zero 2 is close to shard_grad_op)")
    require(not zero or dims.dp * dims.cp > 1,
            f"--zero {zero} shards over data-parallel ranks but the data-parallel degree is {dims.dp}; use --dp 2 or more")
    require(not zero or not _two_d(dims),
            f"--zero {zero} shards over one data-parallel dimension, but the layout is 2-D (dp_replicate "
            f"{dims.dp_replicate} x dp_shard {dims.dp_shard}); use --dp {dims.dp}, or --fsdp hybrid_shard for 2-D")


def _two_d(dims) -> bool:
    return dims.dp_replicate > 1 and dims.dp_shard > 1


def check_fsdp(parallel: ParallelConfig, model: ModelConfig, train: TrainConfig) -> None:
    """--fsdp / --fsdp-style / --fsdp-prefetch: a data-parallel group to shard over, a 2-D dp_replicate x
    dp_shard mesh exactly for the hybrid strategies, a style that runs the strategy, prefetch on the flat engine."""
    dims, zero, fsdp, style = parallel.dims, parallel.zero, parallel.fsdp, parallel.fsdp_style
    require(parallel.fsdp_prefetch >= 1, f"--fsdp-prefetch {parallel.fsdp_prefetch}: give 1 or more units")
    sharded = zero == 3 or fsdp not in (None, FsdpStrategy.NO_SHARD)
    require(parallel.fsdp_prefetch == 1 or (sharded and style is FsdpStyle.FLAT and dims.pp == 1),
            f"--fsdp-prefetch {parallel.fsdp_prefetch} gathers that many units ahead: it needs sharded parameters on "
            f"the flat engine without a pipeline (--zero 3 or --fsdp full_shard/shard_grad_op/hybrid_shard, "
            f"--fsdp-style flat, no --pp; got --zero {zero}, --fsdp {fsdp}, --fsdp-style {style}, --pp {dims.pp})")
    if fsdp in HYBRID:
        require(_two_d(dims), f"--fsdp {fsdp} shards within dp_shard and replicates across dp_replicate, so it needs "
                              f"a 2-D layout with both above 1 (got dp_replicate {dims.dp_replicate} x dp_shard "
                              f"{dims.dp_shard}); use --dp-replicate 2 --dp-shard 2, or --fsdp full_shard for 1-D")
    else:
        require(not _two_d(dims), f"a 2-D data-parallel mesh (dp_replicate {dims.dp_replicate} x dp_shard "
                                  f"{dims.dp_shard}) needs --fsdp hybrid_shard or hybrid_shard_zero2; use a single "
                                  f"--dp degree otherwise")
    require(fsdp is None or dims.dp * dims.cp > 1,
            f"--fsdp {fsdp} needs a data-parallel degree above 1, got {dims.dp}; use --dp 2 or more")
    require(not zero or style is FsdpStyle.FLAT or fsdp is not None,
            f"--fsdp-style {style} applies to --fsdp; --zero uses flat parameters")
    if style is not FsdpStyle.FLAT:
        strategies = ((FsdpStrategy.FULL_SHARD,) if style is FsdpStyle.REUSE
                      else (FsdpStrategy.FULL_SHARD, FsdpStrategy.SHARD_GRAD_OP))
        require(fsdp in strategies, f"--fsdp-style {style} runs --fsdp {' or '.join(strategies)}, got {fsdp}; use "
                                    f"--fsdp-style flat for the others")


def check_tensor_parallel(parallel: ParallelConfig, model: ModelConfig, train: TrainConfig) -> None:
    """Heads, KV heads and FFN width split evenly over --tp (vocab is padded instead); --sp needs tp > 1 and
    a sequence length that tp divides."""
    tp = parallel.dims.tp
    require(not parallel.sequence_parallel or tp > 1, "--sp (sequence parallelism) needs --tp > 1; add --tp 2")
    require(not parallel.tp_overlap or tp > 1, "--tp-overlap needs --tp > 1; add --tp 2")
    require(parallel.tp_overlap_chunks <= 1 or parallel.tp_overlap,
            f"--tp-overlap-chunks {parallel.tp_overlap_chunks} pipelines the forward's collectives with their GEMMs "
            f"over chunks: it needs --tp-overlap; add --tp-overlap")
    if tp == 1:
        return
    require(model.n_heads % tp == 0,
            lambda: f"--tp {tp} must divide n_heads {model.n_heads}; try --tp in {divisors(model.n_heads)}")
    kv = model.n_kv_heads
    if tp <= kv:
        require(kv % tp == 0, lambda: f"--tp {tp} must divide n_kv_heads {kv} (or be a multiple of it, replicating "
                                      f"KV heads); "
                              f"try --tp in {[d for d in divisors(model.n_heads) if kv % d == 0 or d % kv == 0]}")
    else:
        require(tp % kv == 0 and (kv * model.head_dim) % tp == 0,
                lambda: f"--tp {tp} exceeds n_kv_heads {kv}, so KV heads are replicated, which needs tp a multiple of "
                f"n_kv_heads and kv_heads x head_dim = {kv * model.head_dim} divisible by tp; "
                f"try --tp in {[d for d in divisors(model.n_heads) if kv % d == 0 or d % kv == 0]}")
    require(model.ffn_dim % tp == 0,
            lambda: f"--tp {tp} must divide the FFN width {model.ffn_dim}; try --tp in {divisors(model.ffn_dim)}")
    require(not parallel.sequence_parallel or train.seq_len % tp == 0,
            f"--sp shards the sequence over --tp {tp}, so seq_len {train.seq_len} must be divisible by it; "
            f"try --seq-len {max(tp, train.seq_len // tp * tp)}")


def check_context_parallel(parallel: ParallelConfig, model: ModelConfig, train: TrainConfig) -> None:
    """--cp / --cp-attention: the mode's own rules (a sequence its chunks divide; for Ulysses query heads the
    degree divides and KV heads it divides or repeats to, per tensor-parallel rank)."""
    dims = parallel.dims
    if dims.cp == 1:
        return
    MODES[parallel.cp_attention].check(Shape(dims.cp, parallel.cp_ulysses_size, model.n_heads // dims.tp,
                                             max(1, model.n_kv_heads // dims.tp), train.seq_len))


def check_expert_parallel(parallel: ParallelConfig, model: ModelConfig, train: TrainConfig) -> None:
    """--ep: a mixture-of-experts model whose experts split evenly over it; --ep-balance's own rules
    (:func:`parallelisms.parallel.ep_placement.check_ep_balance`)."""
    dims = parallel.dims
    if dims.ep > 1:
        require(model.n_experts > 0, f"--ep {dims.ep} needs a mixture-of-experts model, but this one is dense; "
                                     f"use --preset tiny-moe or a config with num_local_experts")
        require(model.n_experts % dims.ep == 0,
                lambda: f"--ep {dims.ep} must divide n_experts {model.n_experts}; "
                f"try --ep in {[d for d in divisors(model.n_experts) if d > 1]}")
    check_ep_balance(parallel, model)


def check_pipeline(parallel: ParallelConfig, model: ModelConfig, train: TrainConfig) -> None:
    """--pp / --schedule / --microbatches / --chunks: a schedule that exists for these degrees (its own
    one-line ScheduleError), a layer per virtual stage, a global batch that splits into dp x microbatches."""
    dims, name = parallel.dims, parallel.schedule
    if dims.pp == 1:
        return
    require(parallel.microbatches >= 0, f"--microbatches must be positive, got {parallel.microbatches}")
    require(name is Schedule.INTERLEAVED or parallel.chunks == 1,
            f"--chunks {parallel.chunks} applies to --schedule interleaved only ({name} fixes its chunks)")
    require(train.grad_accum == 1, f"--grad-accum {train.grad_accum} with --pp: the pipeline's --microbatches "
                                   f"already accumulate; use --microbatches instead")
    m = pipeline_microbatches(parallel)
    try:
        schedule = schedule_for(parallel)
    except ScheduleError as exc:
        raise ConfigError(f"--schedule {exc}") from None
    require(model.n_layers >= schedule.num_stages,
            f"{model.n_layers} layers cannot fill {schedule.num_stages} pipeline stages ({name}: pp {dims.pp} x "
            f"{schedule.chunks} chunk(s)); use at least {schedule.num_stages} layers or a smaller --pp/--chunks")
    require(train.global_batch % (dims.dp * m) == 0,
            f"global batch {train.global_batch} must split into dp x microbatches = {dims.dp} x {m}; "
            f"try --global-batch {dims.dp * m * max(1, train.global_batch // (dims.dp * m))}")
    require(not (model.tie_embeddings and name is Schedule.PIPEDREAM),
            "tied embeddings with --schedule pipedream: its per-stage updates would step the embedding and the "
            "head apart; use another schedule (1f1b) or an untied model")
