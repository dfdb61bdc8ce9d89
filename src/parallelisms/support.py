"""Which layouts can run: every cross-check of a layout against the model and the training settings, run
before any process starts (one-line :class:`ConfigError` each: the constraint, the values, what would work).

This module sits above the parallelisms (it asks the pipeline for its schedule, context parallelism for its
sequence constraints) and below the training loop and the CLI, which call :func:`validate_layout`.
"""

from __future__ import annotations

from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig
from parallelisms.errors import ConfigError, divisors, require
from parallelisms.parallel.checks import HYBRID, STRATEGIES
from parallelisms.parallel.cp_modes import MODES, Shape
from parallelisms.parallel.ep_placement import check_ep_balance
from parallelisms.parallel.pipeline.schedules import ScheduleError, build_schedule
from parallelisms.options import (Balance, Dtype, FsdpStrategy, FsdpStyle, PpBalance, Precision, Recompute, Schedule,
                                  choices)

# -- the support table ---------------------------------------------------------------------------------------
# Features a layout can switch on, as `features()` names them, with the flag a user writes for each.
FLAGS = {
    "ddp": "--dp (DDP)", "zero1": "--zero 1", "zero2": "--zero 2", "zero3": "--zero 3",
    **{f"fsdp-{s}": f"--fsdp {s}" for s in STRATEGIES},
    "per_param": "--fsdp-style per_param", "reuse": "--fsdp-style reuse",
    "tp": "--tp", "sp": "--sp", "tp-overlap": "--tp-overlap",
    **{name: f"--cp-attention {name}" for name in MODES}, "ring": "--cp (ring)",
    "moe": "a mixture-of-experts model", "ep": "--ep", "pp": "--pp",
    **{s: f"--schedule {s}" for s in Schedule},
    "recompute-selective": "--recompute selective", "recompute-full": "--recompute full",
    "bf16": "--mixed-precision bf16", "float64": "--dtype float64",
}

_FSDP = [f"fsdp-{s}" for s in STRATEGIES]


def _pairs(left, right, reason: str) -> dict:
    left, right = ([left] if isinstance(left, str) else left), ([right] if isinstance(right, str) else right)
    return {frozenset((a, b)): reason for a in left for b in right}


# Every pair of features that cannot run together, with the reason; any pair not listed works (each tested
# or verified; see README's feature table). Validation reads this table before any per-value check.
UNSUPPORTED: dict[frozenset, str] = {
    **_pairs(["zero1", "zero2", "zero3"], _FSDP + ["per_param", "reuse"], "two ways to shard the same data-parallel "
             "state: pick one (--zero 3 is --fsdp full_shard, --zero 2 is close to shard_grad_op)"),
    **_pairs("pipedream", ["zero1", "zero2", "zero3", "per_param", "reuse"] + _FSDP, "PipeDream updates a stage after "
             "every microbatch and stashes a full copy of each weight version in flight, so sharded weights would be "
             "gathered, kept whole and re-sharded per microbatch: no memory saved, every update a full collective"),
    **_pairs("bf16", "float64", "mixed precision keeps float32 master weights"),
}


def features(model: ModelConfig, train: TrainConfig, parallel: ParallelConfig) -> list[str]:
    """The features this layout switches on, by the support table's names."""
    dims, out = parallel.dims, []
    if dims.dp > 1 and not (parallel.zero or parallel.fsdp):
        out.append("ddp")
    if parallel.zero:
        out.append(f"zero{parallel.zero}")
    if parallel.fsdp:
        out.append(f"fsdp-{parallel.fsdp}")
    if parallel.fsdp_style in (FsdpStyle.PER_PARAM, FsdpStyle.REUSE):
        out.append(parallel.fsdp_style)
    out += [name for name, on in (("tp", dims.tp > 1), ("sp", parallel.sequence_parallel),
                                  ("tp-overlap", parallel.tp_overlap), ("moe", model.n_experts > 0),
                                  ("ep", dims.ep > 1), ("pp", dims.pp > 1)) if on]
    if dims.cp > 1:
        out.append(parallel.cp_attention)
    if dims.pp > 1:
        out.append(parallel.schedule)
    if parallel.recompute is not Recompute.NONE:
        out.append(f"recompute-{parallel.recompute}")
    if parallel.mixed_precision is Precision.BF16:
        out.append("bf16")
    if train.dtype is Dtype.FLOAT64:
        out.append("float64")
    return out


def check_pairs(feats: list[str]) -> None:
    """One line for the first pair of ``feats`` the support table says cannot run together."""
    for i, a in enumerate(feats):
        for b in feats[i + 1:]:
            reason = UNSUPPORTED.get(frozenset((a, b)))
            require(reason is None, f"{FLAGS.get(a, a)} with {FLAGS.get(b, b)}: {reason}")


def not_supported_markdown() -> str:
    """The README's list of pairs that do not run, generated from the table (a test keeps them equal)."""
    by_reason: dict[str, list[str]] = {}
    for pair, reason in UNSUPPORTED.items():
        a, b = sorted(pair, key=list(FLAGS).index)
        by_reason.setdefault(reason, []).append(f"`{FLAGS[a]}` with `{FLAGS[b]}`")
    return "\n".join(f"- {', '.join(pairs)}: {reason}." for reason, pairs in by_reason.items())


def validate_layout(model: ModelConfig, train: TrainConfig, parallel: ParallelConfig,
                    runtime: bool = True) -> ParallelConfig:
    """Every cross-check of layout, model and training settings (one-line ConfigError on failure); ``runtime``
    False leaves out the support table (pairs this runtime does not run), for estimates that only compute."""
    dims = parallel.dims
    _check_names(parallel)
    if runtime:
        check_pairs(features(model, train, parallel))
    _check_pipeline(parallel, model, train)
    _check_expert_parallel(parallel, model)
    _check_tensor_parallel(parallel, model, train)
    _check_context_parallel(parallel, model, train)
    _check_sharded_data_parallel(parallel)
    _check_dp_balance(parallel)
    check_ep_balance(parallel, model)
    train.validate(model, dp=dims.dp)
    return parallel


def _check_dp_balance(parallel: ParallelConfig) -> None:
    """--dp-balance measured splits each global batch over the data-parallel ranks by measured speed (with a
    pipeline, each replica's share in whole microbatch rounds; with experts too: the router's load-balancing
    loss is a mean over sequences, so weighting it like the language-model loss keeps training exact)."""
    dims = parallel.dims
    require(parallel.dp_balance in tuple(Balance),
            f"unknown --dp-balance {parallel.dp_balance!r}; choose {choices(Balance)}")
    if parallel.dp_balance is not Balance.MEASURED:
        require(parallel.rebalance_every == 0, f"--rebalance-every {parallel.rebalance_every} applies only with "
                                               f"--dp-balance measured; add it or drop --rebalance-every")
        return
    require(dims.dp > 1, f"--dp-balance measured needs data parallelism, got dp {dims.dp}; add --dp 2 or more")
    require(dims.pp == 1 or parallel.schedule is not Schedule.PIPEDREAM,
            "--dp-balance measured with --schedule pipedream: its updates after each microbatch would each group "
            "other sequences than single-process training's microbatches do (a replica's microbatches follow its "
            "share); use another schedule or --dp-balance even")


def _check_names(parallel: ParallelConfig) -> None:
    """Every named option is one that exists (the support table names features by them)."""
    require(parallel.recompute in tuple(Recompute),
            f"unknown --recompute {parallel.recompute!r}; choose {choices(Recompute)}")
    require(parallel.zero in (0, 1, 2, 3), f"--zero {parallel.zero} is not a ZeRO stage; use 1, 2 or 3 (or 0 for plain DDP)")
    require(parallel.fsdp is None or parallel.fsdp in STRATEGIES,
            f"unknown --fsdp strategy {parallel.fsdp!r}; choose one of {', '.join(STRATEGIES)}")
    require(parallel.fsdp_style in tuple(FsdpStyle),
            f"unknown --fsdp-style {parallel.fsdp_style!r}; choose {choices(FsdpStyle)}")
    require(parallel.cp_attention in MODES,
            f"unknown --cp-attention {parallel.cp_attention!r}; choose {', '.join(MODES)}")
    require(parallel.mixed_precision in tuple(Precision),
            f"unknown --mixed-precision {parallel.mixed_precision!r}; choose {choices(Precision)}")


def _check_pipeline(parallel: ParallelConfig, model: ModelConfig, train: TrainConfig) -> None:
    """--pp / --schedule / --microbatches / --chunks: a schedule that exists for these degrees (its own
    one-line ScheduleError), a layer per virtual stage, a global batch that splits into dp x microbatches."""
    dims, name = parallel.dims, parallel.schedule
    if dims.pp == 1:
        return
    require(parallel.microbatches >= 0, f"--microbatches must be positive, got {parallel.microbatches}")
    require(parallel.pp_balance in tuple(PpBalance),
            f"unknown --pp-balance {parallel.pp_balance!r}; choose {choices(PpBalance)}")
    require(name is Schedule.INTERLEAVED or parallel.chunks == 1,
            f"--chunks {parallel.chunks} applies to --schedule interleaved only ({name} fixes its chunks)")
    require(train.grad_accum == 1, f"--grad-accum {train.grad_accum} with --pp: the pipeline's --microbatches "
                                   f"already accumulate; use --microbatches instead")
    m = parallel.microbatches or 2 * dims.pp
    try:
        schedule = build_schedule(name, dims.pp, m, parallel.chunks if name is Schedule.INTERLEAVED else None)
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


def _check_sharded_data_parallel(parallel: ParallelConfig) -> None:
    """--zero / --fsdp / --mixed-precision: a known stage or strategy, a data-parallel group to shard over, a
    2-D dp_replicate x dp_shard mesh exactly for the hybrid strategies."""
    require(not parallel.overlap_param_gather or (parallel.zero in (1, 2) and parallel.dims.pp == 1),
            f"--overlap-param-gather overlaps ZeRO-1/2's gather of the updated parameters with the next forward: it "
            f"needs --zero 1 or 2 without --pp (got --zero {parallel.zero}, --pp {parallel.dims.pp})")
    dims, zero, fsdp = parallel.dims, parallel.zero, parallel.fsdp
    require(parallel.fsdp_prefetch >= 1, f"--fsdp-prefetch {parallel.fsdp_prefetch}: give 1 or more units")
    require(parallel.fsdp_prefetch == 1 or ((zero == 3 or fsdp not in (None, FsdpStrategy.NO_SHARD)) and parallel.fsdp_style is FsdpStyle.FLAT
                                            and dims.pp == 1),
            f"--fsdp-prefetch {parallel.fsdp_prefetch} gathers that many units ahead: it needs sharded parameters on "
            f"the flat engine without a pipeline (--zero 3 or --fsdp full_shard/shard_grad_op/hybrid_shard, "
            f"--fsdp-style flat, no --pp; got --zero {zero}, --fsdp {fsdp}, --fsdp-style {parallel.fsdp_style}, "
            f"--pp {dims.pp})")
    two_d = dims.dp_replicate > 1 and dims.dp_shard > 1
    require(not (zero and fsdp), f"--zero {zero} and --fsdp {fsdp} both shard data parallelism; pick one "
                                 f"(--zero 3 is --fsdp full_shard, --zero 2 is close to shard_grad_op)")
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
    require(not (zero or fsdp) or parallel.fsdp_style is FsdpStyle.FLAT or fsdp is not None,
            f"--fsdp-style {parallel.fsdp_style} applies to --fsdp; --zero uses flat parameters")
    if parallel.fsdp_style is not FsdpStyle.FLAT:
        strategies = ((FsdpStrategy.FULL_SHARD,) if parallel.fsdp_style is FsdpStyle.REUSE
                      else (FsdpStrategy.FULL_SHARD, FsdpStrategy.SHARD_GRAD_OP))
        require(fsdp in strategies, f"--fsdp-style {parallel.fsdp_style} runs --fsdp {' or '.join(strategies)}, "
                                    f"got {fsdp}; use --fsdp-style flat for the others")


def _check_tensor_parallel(parallel: ParallelConfig, model: ModelConfig, train: TrainConfig) -> None:
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


def _check_context_parallel(parallel: ParallelConfig, model: ModelConfig, train: TrainConfig) -> None:
    """--cp / --cp-attention: the mode's own rules (a sequence its chunks divide; for Ulysses query heads the
    degree divides and KV heads it divides or repeats to, per tensor-parallel rank)."""
    dims = parallel.dims
    if dims.cp == 1:
        return
    MODES[parallel.cp_attention].check(Shape(dims.cp, parallel.cp_ulysses_size, model.n_heads // dims.tp,
                                             max(1, model.n_kv_heads // dims.tp), train.seq_len))


def _check_expert_parallel(parallel: ParallelConfig, model: ModelConfig) -> None:
    """--ep: a mixture-of-experts model whose experts split evenly over it."""
    dims = parallel.dims
    if dims.ep > 1:
        require(model.n_experts > 0, f"--ep {dims.ep} needs a mixture-of-experts model, but this one is dense; "
                                     f"use --preset tiny-moe or a config with num_local_experts")
        require(model.n_experts % dims.ep == 0,
                lambda: f"--ep {dims.ep} must divide n_experts {model.n_experts}; "
                f"try --ep in {[d for d in divisors(model.n_experts) if d > 1]}")
