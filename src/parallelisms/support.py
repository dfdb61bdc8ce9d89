"""Which layouts can run: every cross-check of a layout against the model and the training settings, run
before any process starts (one-line :class:`ConfigError` each: the constraint, the values, what would work).

This module sits above the parallelisms (it asks the pipeline for its schedule, context parallelism for its
sequence constraints) and below the training loop and the CLI, which call :func:`validate_layout`.
"""

from __future__ import annotations

from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig, divisors
from parallelisms.errors import ConfigError, require
from parallelisms.parallel.context import check_context_parallel
from parallelisms.parallel.fsdp import HYBRID, STRATEGIES
from parallelisms.parallel.pipeline.schedules import ScheduleError, build_schedule


def validate_layout(model: ModelConfig, train: TrainConfig, parallel: ParallelConfig) -> ParallelConfig:
    """Every cross-check of layout, model and training settings (one-line ConfigError on failure)."""
    dims = parallel.dims
    _check_pipeline(parallel, model, train)
    _check_expert_parallel(parallel, model)
    require(parallel.recompute in ("none", "selective", "full"),
            f"unknown --recompute {parallel.recompute!r}; choose none, selective or full")
    _check_tensor_parallel(parallel, model, train)
    _check_context_parallel(parallel, model, train)
    _check_sharded_data_parallel(parallel)
    train.validate(model, dp=dims.dp)
    require(parallel.mixed_precision == "fp32" or train.dtype == "float32",
            f"--mixed-precision {parallel.mixed_precision} keeps float32 master weights; drop --dtype {train.dtype}")
    return parallel


def _check_pipeline(parallel: ParallelConfig, model: ModelConfig, train: TrainConfig) -> None:
    """--pp / --schedule / --microbatches / --chunks: a schedule that exists for these degrees (its own
    one-line ScheduleError), a layer per virtual stage, a global batch that splits into dp x microbatches."""
    dims, name = parallel.dims, parallel.schedule
    if dims.pp == 1:
        return
    require(dims.cp == 1 and dims.ep == 1 and not parallel.fsdp,
            f"--pp {dims.pp} composes with --dp, --tp (with or without --sp) and --zero 1 only so far; drop --cp/--ep/--fsdp")
    require(parallel.zero in (0, 1), f"--pp {dims.pp} with --zero {parallel.zero}: pipeline stages shard optimizer "
                                     f"state only (--zero 1, Megatron's distributed optimizer); use --zero 1")
    require(not parallel.zero or parallel.mixed_precision == "fp32",
            f"--pp {dims.pp} with --zero 1 trains in fp32 only so far, got --mixed-precision "
            f"{parallel.mixed_precision}; drop --mixed-precision")
    require(parallel.microbatches >= 0, f"--microbatches must be positive, got {parallel.microbatches}")
    require(name != "pipedream" or parallel.recompute != "full",
            "--recompute full with --schedule pipedream: weight stashing swaps a microbatch's weight version in "
            "only for its forward call, so a block recomputed in backward would read the live, already updated "
            "weights; use --recompute selective (no weights inside) or another schedule")
    require(parallel.pp_balance in ("layers", "measured"),
            f"unknown --pp-balance {parallel.pp_balance!r}; choose layers or measured")
    require(name == "interleaved" or parallel.chunks == 1,
            f"--chunks {parallel.chunks} applies to --schedule interleaved only ({name} fixes its chunks)")
    require(train.grad_accum == 1, f"--grad-accum {train.grad_accum} with --pp: the pipeline's --microbatches "
                                   f"already accumulate; use --microbatches instead")
    require(name != "pipedream" or dims.dp == 1,
            f"--schedule pipedream updates weights per microbatch and runs with --dp 1 only, got --dp {dims.dp}")
    m = parallel.microbatches or 2 * dims.pp
    try:
        schedule = build_schedule(name, dims.pp, m, parallel.chunks if name == "interleaved" else None)
    except ScheduleError as exc:
        raise ConfigError(f"--schedule {exc}") from None
    require(not parallel.zero or not (len(schedule.placement) > 1 or name == "pipedream"),
            f"--zero 1 with --schedule {name}: DualPipe keeps two copies of each stage and PipeDream updates per "
            f"microbatch, neither has one sharded optimizer step; use gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-v "
            f"or dualpipev")
    require(dims.tp == 1 or not (schedule.split_backward or len(schedule.placement) > 1 or name == "pipedream"),
            f"--pp {dims.pp} with --tp {dims.tp} runs --schedule gpipe, 1f1b or interleaved; {name} (split backward, "
            f"DualPipe copies or per-stage clipping) does not handle tensor-parallel layers yet")
    require(model.n_layers >= schedule.num_stages,
            f"{model.n_layers} layers cannot fill {schedule.num_stages} pipeline stages ({name}: pp {dims.pp} x "
            f"{schedule.chunks} chunk(s)); use at least {schedule.num_stages} layers or a smaller --pp/--chunks")
    require(train.global_batch % (dims.dp * m) == 0,
            f"global batch {train.global_batch} must split into dp x microbatches = {dims.dp} x {m}; "
            f"try --global-batch {dims.dp * m * max(1, train.global_batch // (dims.dp * m))}")


def _check_sharded_data_parallel(parallel: ParallelConfig) -> None:
    """--zero / --fsdp / --mixed-precision: a known stage or strategy, a data-parallel group to shard over, a
    2-D dp_replicate x dp_shard mesh exactly for the hybrid strategies."""
    dims, zero, fsdp = parallel.dims, parallel.zero, parallel.fsdp
    two_d = dims.dp_replicate > 1 and dims.dp_shard > 1
    require(zero in (0, 1, 2, 3), f"--zero {zero} is not a ZeRO stage; use 1, 2 or 3 (or 0 for plain DDP)")
    require(fsdp is None or fsdp in STRATEGIES, f"unknown --fsdp strategy {fsdp!r}; choose one of {', '.join(STRATEGIES)}")
    require(not (zero and fsdp), f"--zero {zero} and --fsdp {fsdp} both shard data parallelism; pick one "
                                 f"(--zero 3 is --fsdp full_shard, --zero 2 is close to shard_grad_op)")
    require(parallel.mixed_precision in ("fp32", "bf16"),
            f"unknown --mixed-precision {parallel.mixed_precision!r}; choose fp32 or bf16")
    require(parallel.mixed_precision == "fp32" or zero or fsdp,
            "--mixed-precision bf16 needs --zero or --fsdp (plain DDP trains in fp32); add --zero 1")
    require(parallel.mixed_precision == "fp32" or dims.tp == 1,
            f"--mixed-precision bf16 with --tp {dims.tp} is not supported: its bf16 partial sums have no "
            f"single-process reference to verify against (1.7e-2 off the bf16 one); use fp32 with --tp")
    require(not zero or dims.dp * dims.cp > 1,
            f"--zero {zero} shards over data-parallel ranks but the data-parallel degree is {dims.dp}; use --dp 2 or more")
    require(not zero or not two_d,
            f"--zero {zero} shards over one data-parallel dimension, but the layout is 2-D (dp_replicate "
            f"{dims.dp_replicate} x dp_shard {dims.dp_shard}); use --dp {dims.dp}, or --fsdp hybrid_shard for 2-D")
    if fsdp in HYBRID:
        require(two_d, f"--fsdp {fsdp} shards within dp_shard and replicates across dp_replicate, so it needs a 2-D "
                       f"layout with both above 1 (got dp_replicate {dims.dp_replicate} x dp_shard {dims.dp_shard}); "
                       f"use --dp-replicate 2 --dp-shard 2, or --fsdp full_shard for 1-D")
    else:
        require(not two_d, f"a 2-D data-parallel mesh (dp_replicate {dims.dp_replicate} x dp_shard {dims.dp_shard}) "
                           f"needs --fsdp hybrid_shard or hybrid_shard_zero2; use a single --dp degree otherwise")
    require(fsdp is None or dims.dp * dims.cp > 1,
            f"--fsdp {fsdp} needs a data-parallel degree above 1, got {dims.dp}; use --dp 2 or more")
    require(not fsdp or dims.pp == 1,
            f"--fsdp {fsdp} combines with --dp, --tp and --cp only so far (got {dims.describe()}); drop --pp, "
            f"or use --zero 1, which composes with --pp")
    require(not (zero or fsdp) or dims.cp == 1 or (fsdp not in HYBRID and parallel.fsdp_style == "flat"),
            f"--cp {dims.cp} with --fsdp {fsdp} --fsdp-style {parallel.fsdp_style} is not supported; with --cp "
            f"use --zero 1/2/3 or a 1-D --fsdp strategy in the flat style")
    require(not (zero or fsdp) or dims.tp == 1 or parallel.fsdp_style in ("flat", "per_param"),
            f"--fsdp-style {parallel.fsdp_style} with --tp {dims.tp} is not supported; use --fsdp-style flat or "
            f"per_param, which shard the tensor-parallel shards")
    require(not (zero or fsdp) or parallel.fsdp_style == "flat" or fsdp is not None,
            f"--fsdp-style {parallel.fsdp_style} applies to --fsdp; --zero uses flat parameters")
    require(parallel.fsdp_style in ("flat", "per_param", "reuse"),
            f"unknown --fsdp-style {parallel.fsdp_style!r}; choose flat, per_param or reuse")
    if parallel.fsdp_style != "flat":
        strategies = ("full_shard",) if parallel.fsdp_style == "reuse" else ("full_shard", "shard_grad_op")
        require(fsdp in strategies, f"--fsdp-style {parallel.fsdp_style} runs --fsdp {' or '.join(strategies)}, "
                                    f"got {fsdp}; use --fsdp-style flat for the others")
        require(parallel.mixed_precision == "fp32", f"--fsdp-style {parallel.fsdp_style} trains in fp32 only; "
                                                    f"use --fsdp-style flat for --mixed-precision bf16")
        require(parallel.recompute != "full",
                f"--recompute full with --fsdp-style {parallel.fsdp_style}: this engine swaps a unit's full weights "
                f"in around its forward call, which the block's recomputation in backward does not pass through, "
                f"and re-gathers only what autograd saved; use --recompute selective (no weights inside) or "
                f"--fsdp-style flat")


def _check_tensor_parallel(parallel: ParallelConfig, model: ModelConfig, train: TrainConfig) -> None:
    """Heads, KV heads and FFN width split evenly over --tp (vocab is padded instead); --sp needs tp > 1 and
    a sequence length that tp divides."""
    tp = parallel.dims.tp
    require(not parallel.sequence_parallel or tp > 1, "--sp (sequence parallelism) needs --tp > 1; add --tp 2")
    require(not parallel.tp_overlap or tp > 1, "--tp-overlap needs --tp > 1; add --tp 2")
    if tp == 1:
        return
    require(model.n_heads % tp == 0,
            f"--tp {tp} must divide n_heads {model.n_heads}; try --tp in {divisors(model.n_heads)}")
    kv = model.n_kv_heads
    if tp <= kv:
        require(kv % tp == 0, f"--tp {tp} must divide n_kv_heads {kv} (or be a multiple of it, replicating KV heads); "
                              f"try --tp in {[d for d in divisors(model.n_heads) if kv % d == 0 or d % kv == 0]}")
    else:
        require(tp % kv == 0 and (kv * model.head_dim) % tp == 0,
                f"--tp {tp} exceeds n_kv_heads {kv}, so KV heads are replicated, which needs tp a multiple of "
                f"n_kv_heads and kv_heads x head_dim = {kv * model.head_dim} divisible by tp; "
                f"try --tp in {[d for d in divisors(model.n_heads) if kv % d == 0 or d % kv == 0]}")
    require(model.ffn_dim % tp == 0,
            f"--tp {tp} must divide the FFN width {model.ffn_dim}; try --tp in {divisors(model.ffn_dim)}")
    require(not parallel.sequence_parallel or train.seq_len % tp == 0,
            f"--sp shards the sequence over --tp {tp}, so seq_len {train.seq_len} must be divisible by it; "
            f"try --seq-len {max(tp, train.seq_len // tp * tp)}")


def _check_context_parallel(parallel: ParallelConfig, model: ModelConfig, train: TrainConfig) -> None:
    """--cp / --cp-attention: a sequence the ring's zigzag chunks (or Ulysses' contiguous chunks) divide, and
    for Ulysses heads the degree divides (after tensor parallelism has split them)."""
    dims = parallel.dims
    require(parallel.cp_attention in ("ring", "ulysses"),
            f"unknown --cp-attention {parallel.cp_attention!r}; choose ring or ulysses")
    if dims.cp == 1:
        return
    require(not parallel.sequence_parallel, f"--cp {dims.cp} with --sp is not supported yet; drop --sp")
    check_context_parallel(parallel.cp_attention, dims.cp, model.n_heads // dims.tp,
                           max(1, model.n_kv_heads // dims.tp), train.seq_len)


def _check_expert_parallel(parallel: ParallelConfig, model: ModelConfig) -> None:
    """--ep: an MoE model whose experts split evenly; MoE models compose with dp and ep only so far."""
    dims = parallel.dims
    if dims.ep > 1:
        require(model.n_experts > 0, f"--ep {dims.ep} needs a mixture-of-experts model, but this one is dense; "
                                     f"use --preset tiny-moe or a config with num_local_experts")
        require(model.n_experts % dims.ep == 0,
                f"--ep {dims.ep} must divide n_experts {model.n_experts}; "
                f"try --ep in {[d for d in divisors(model.n_experts) if d > 1]}")
    if model.n_experts:
        require(dims.tp == dims.pp == dims.cp == 1,
                f"a mixture-of-experts model runs with --dp, --ep, --zero and --fsdp only so far, got "
                f"{dims.describe()}; drop --tp/--pp/--cp")
        require(dims.ep == 1 or not (parallel.zero or parallel.fsdp),
                f"--zero/--fsdp with --ep {dims.ep} is not supported yet (expert weights would need sharding over "
                f"the ranks holding the same experts); use --ep 1 with --zero/--fsdp, or --ep without them")
