"""Closed forms for a layout's cost: parameters, FLOPs, activation and model-state memory, and the bytes
each collective moves per step. They take the same ``ModelConfig`` / ``ParallelConfig`` / ``TrainConfig``
the runtime takes, so a prediction can be set beside a measurement (the ledger, the memory report).

Sources: parameters and FLOPs of GPT models, Narayanan et al. SC'21 (Eq. 2, 3) and Korthikanti et al.
MLSys'23 (Eq. 7); activation memory per layer, Korthikanti Table 2; model states per rank, ZeRO
(Rajbhandari et al. SC'20); communication per step, the spec's formulas (DP 2(N-1)/N G; TP 4(N-1)A/N per
block each way; ZeRO-3 1.5x DP) and ring attention / Ulysses volumes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig
from parallelisms.parallel.memory import zero_formula
from parallelisms.perf.context import context_volumes
from parallelisms.perf.stages import rank0_held, rank0_layers
from parallelisms.parallel.pipeline.schedules import V_SHAPED


# -- parameters and FLOPs ------------------------------------------------------------------------------

def gpt_params(layers: int, hidden: int, vocab: int, seq: int) -> float:
    """Narayanan et al. Eq. 2: P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)) (GPT: 4h MLP, learned positions)."""
    return 12 * layers * hidden**2 * (1 + 13 / (12 * hidden) + (vocab + seq) / (12 * layers * hidden))


def gpt_flops_per_iteration(batch: int, seq: int, layers: int, hidden: int, vocab: int,
                            full_recompute: bool = True) -> float:
    """Narayanan Eq. 3 (with full recompute: 96 B s l h^2 (1 + s/(6h) + V/(16 l h))) or Korthikanti Eq. 7
    (model FLOPs, no recompute: 72 B s l h^2 (1 + s/(6h) + V/(12 h l)))."""
    if full_recompute:
        return 96 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
    return 72 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (12 * hidden * layers))


def model_flops_per_token(cfg: ModelConfig, seq: int) -> float:
    """Training FLOPs per token of our model (forward + backward, no recompute): 6 x the matmul parameters a
    token touches (embedding lookups excluded; for MoE only its top-k experts) plus attention's
    QK^T and AV, 6 x 2 x layers x seq x n_heads x head_dim (causal masking not discounted, as in PaLM's MFU)."""
    kv = cfg.n_kv_heads * cfg.head_dim
    attention = cfg.dim * (2 * cfg.q_dim + 2 * kv)
    experts_used = cfg.top_k if cfg.n_experts else 1
    mlp = cfg.mlp_matrices * cfg.dim * cfg.ffn_dim * experts_used + cfg.dim * cfg.n_experts
    matmul_params = cfg.n_layers * (attention + mlp) + cfg.dim * cfg.vocab_size
    return 6 * matmul_params + 12 * cfg.n_layers * seq * cfg.q_dim


# -- memory --------------------------------------------------------------------------------------------

def activation_bytes_per_layer(seq: int, batch: int, hidden: int, heads: int, tp: int = 1,
                               sequence_parallel: bool = False, recompute: str = "none", kv_heads: int | None = None,
                               ffn: int | None = None, mlp_matrices: int = 2) -> float:
    """Korthikanti Table 2, 16-bit activations: bytes one transformer layer keeps for backward.

    ``recompute``: none, selective (attention's softmax/dropout recomputed) or full (only the layer input kept:
    2sbh, and 2sbh/t with sequence parallelism, whose layer input is the sequence-sharded residual stream).
    Table 2's terms: 10sbh replicated across tp (norm inputs, the QKV and MLP inputs, two dropout masks),
    24sbh/t sharded (Q, K, V and the projection input: 8; the MLP's 4h-wide tensors: 16) and 5as^2b/t for
    the attention scores. With ``kv_heads`` (GQA) and an MLP of width ``ffn`` and ``mlp_matrices`` matrices,
    the sharded terms become 4 + 4 kv/a and 2 x (matrices) x ffn/h; the defaults give Table 2 exactly.
    """
    sbh = seq * batch * hidden
    sharded = 4 + 4 * (kv_heads or heads) / heads + 2 * mlp_matrices * (ffn or 4 * hidden) / hidden
    attention = 5 * heads * seq / (hidden * tp)
    if recompute == "full":  # the layer's input, sequence-sharded under sequence parallelism
        return 2 * sbh / (tp if sequence_parallel else 1)
    if sequence_parallel:
        return sbh * ((10 + sharded) / tp + (attention if recompute == "none" else 0))
    return sbh * (10 + sharded / tp + (attention if recompute == "none" else 0))


def pipeline_activation_factor(pp: int, chunks: int = 1) -> float:
    """Layers' worth of activations the first 1F1B stage holds, as a multiple of the whole model's L/p per
    microbatch: p microbatches in flight x L/p layers = L layers; interleaving multiplies by 1 + (p-1)/(p v)
    (Korthikanti section 4.2.3)."""
    return 1.0 + (pp - 1) / (pp * chunks) if chunks > 1 else 1.0


def model_state_bytes(num_params: int, parallel: ParallelConfig, expert_params: int = 0) -> dict:
    """Parameters, gradients and optimizer state per rank (ZeRO's accounting); parameters are first divided
    by tp x pp (each rank holds 1/(tp pp) of the model), then by the sharding data-parallel degree. Of them,
    ``expert_params`` are divided by pp x ep instead (experts replicate over tp) and shard over the ranks holding
    the same experts."""
    dims = parallel.dims
    stage = parallel.zero or {"full_shard": 3, "hybrid_shard": 3, "shard_grad_op": 2, "hybrid_shard_zero2": 2,
                              "no_shard": 0, None: 0}[parallel.fsdp]
    shard = dims.dp_shard if parallel.fsdp else dims.dp
    bf16 = parallel.mixed_precision == "bf16"
    sizes = dict(param_bytes=2 if bf16 else 4, grad_bytes=2 if bf16 else 4, master_bytes=4 if bf16 else 0, optim_bytes=8)
    dense = zero_formula(int((num_params - expert_params) / (dims.tp * dims.pp)), shard if stage else 1, stage, **sizes)
    if not expert_params:
        return dense
    experts = zero_formula(int(expert_params / (dims.pp * dims.ep)), max(1, shard // dims.ep) if stage else 1, stage,
                           **sizes)
    return {k: dense[k] + experts[k] for k in dense}


# -- communication -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CommVolume:
    kind: str
    dim: str
    bytes_per_rank: float   # per optimizer step


def comm_per_step(cfg: ModelConfig, parallel: ParallelConfig, train: TrainConfig, dtype_bytes: int = 4,
                  pipeline: bool = True) -> list[CommVolume]:
    """Bytes rank 0 sends per step, by collective and mesh dimension, from the spec's formulas.

    Every collective the runtime's ledger counts (:func:`_tensor_parallel_volumes` for tensor parallelism's),
    expert all-to-alls assuming uniform routing. Parameter all-gathers and activations move the compute dtype
    (``dtype_bytes``, 2 in bf16); gradient reductions and the cross-entropy's are fp32.
    """
    dims = parallel.dims
    out = []
    local_params = rank0_params(cfg, parallel)
    # rank 0's expert weights: sharded over ep, reduced and gathered over ep_replicate only; rank0_params splits
    # the experts and the router over tp instead (every block it holds: DualPipe's two copies)
    layers = rank0_held(cfg, parallel)[0]
    expert_params = layers * expert_slot_params(cfg, parallel)
    local_params += layers * expert_block_change(cfg, parallel)
    dp = dims.dp * dims.cp  # gradients are averaged over every rank that saw different tokens
    if dp > 1:
        hybrid = parallel.fsdp in ("hybrid_shard", "hybrid_shard_zero2")
        shards = dims.dp_shard * dims.cp if hybrid else dp  # HSDP shards within dp_shard, replicates across
        dense = local_params - expert_params + sum(per_param_padding(cfg, parallel, shards))
        if hybrid and dims.dp_replicate > 1:  # each shard's reduced gradient all-reduced over the replicas
            replicas = dims.dp_replicate
            m_reduce = microbatches_per_step(parallel, train) if dims.pp == 1 else 1
            out.append(CommVolume("all_reduce", "dp", m_reduce * 2 * (replicas - 1) / replicas * dense * 4 / shards))
        out += _engine_volumes(parallel, train, "dp", shards, dense, dtype_bytes,
                               _gathered_per_microbatch(cfg, parallel, dtype_bytes))
    if expert_params:  # expert gradients: only over the ranks holding the same experts
        replicas = dp // dims.ep
        out += _engine_volumes(parallel, train, "ep_replicate", replicas, expert_params, dtype_bytes,
                               expert_params * dtype_bytes * (1 if dims.pp > 1 else 2))
        copies = redundant_expert_grads(cfg, parallel, layers)
        if copies:  # EPLB's copies of a hot expert sum their gradients over ep
            out.append(CommVolume("all_reduce", "ep", 2 * (dims.ep - 1) / dims.ep * copies * 4))
            if replicas > 1 and (parallel.zero or parallel.fsdp not in (None, "no_shard")):  # slots sharded over
                out.append(CommVolume("all_reduce", "ep_replicate", 2 * (replicas - 1) / replicas * copies * 4))
        out.append(CommVolume("all_to_all", "ep", _expert_all_to_alls(cfg, parallel, train, dtype_bytes)))
    if dims.tp > 1:
        out += _tensor_parallel_volumes(cfg, parallel, train, dtype_bytes)
    if dims.cp > 1:
        out += _context_parallel_volumes(cfg, parallel, train, dtype_bytes)
    if dims.pp > 1 and pipeline:  # the schedule says how many activations and gradients rank 0 sends
        from parallelisms.parallel.pipeline.schedules import Kind, build_schedule

        m = microbatches_per_step(parallel, train)
        schedule = build_schedule(parallel.schedule, dims.pp, m, parallel.chunks if parallel.schedule == "interleaved"
                                  else None)
        sends = sum(1 for a in schedule.ranks[0] if a.kind in (Kind.SEND_F, Kind.SEND_B))
        activation = train.global_batch // dims.dp // m * train.seq_len // dims.cp * cfg.dim * dtype_bytes
        if parallel.sequence_parallel:  # stages exchange the sequence-sharded residual stream
            activation //= dims.tp
        out.append(CommVolume("send", "pp", sends * activation))
        if parallel.schedule == "dualpipe":  # the two copies of each stage exchange their fp32 gradient buffers
            out.append(CommVolume("send", "pp", 4 * local_params))
    if dims.pp > 1 and parallel.schedule == "pipedream":  # it updates per microbatch, without a global norm
        return out
    return out + grad_norm_volumes(parallel, 8 if train.dtype == "float64" else 4)


def expert_slots(cfg: ModelConfig, parallel: ParallelConfig) -> int:
    """Experts an expert-parallel rank holds per MoE layer: its n_experts / ep, plus ``--ep-redundant`` slots for
    copies of hot experts under ``--ep-balance measured`` (EPLB; :mod:`parallelisms.parallel.ep_balance`)."""
    extra = parallel.ep_redundant if parallel.ep_balance == "measured" else 0
    return cfg.n_experts // parallel.dims.ep + extra


def expert_slot_params(cfg: ModelConfig, parallel: ParallelConfig) -> float:
    """A block's expert weights on a rank under expert parallelism (none without it: tp splits them then), its
    redundant slots included (``--ep-balance measured --ep-redundant``)."""
    if not cfg.n_experts or parallel.dims.ep == 1:
        return 0.0
    return cfg.mlp_matrices * cfg.dim * cfg.ffn_dim * expert_slots(cfg, parallel)


def expert_block_change(cfg: ModelConfig, parallel: ParallelConfig) -> float:
    """What expert parallelism changes in a block's parameters as ``block_params`` splits them over tp: the rank's
    expert slots instead of a tp shard of every expert, and the router whole (none without it)."""
    if not cfg.n_experts or parallel.dims.ep == 1:
        return 0.0
    tp, experts = parallel.dims.tp, cfg.mlp_matrices * cfg.dim * cfg.ffn_dim * cfg.n_experts
    return expert_slot_params(cfg, parallel) - experts / tp + cfg.dim * cfg.n_experts * (1 - 1 / tp)


def redundant_expert_grads(cfg: ModelConfig, parallel: ParallelConfig, layers: int) -> float:
    """Gradient elements a rank all-reduces over ep per step so that the copies of each replicated expert step as
    one expert (``ExpertBalance.finish``: every replicated expert's gradient, once a step, after the layout's
    reduction), over the ``layers`` it holds (DualPipe's two copies of a stage each): min(n_experts, ep x R) replicated experts per layer for R redundant slots per rank, under uniform
    routing (the extra slots go to the experts in turn) and before any measurement (each rank's extra slots copy
    the experts after its own) alike; a skewed router copies fewer, hotter experts more often. A flat engine that
    shards the slots over the expert replicas (ZeRO, FSDP but NO_SHARD) all-reduces the same elements over them too,
    each rank's share of its copies being a range of them."""
    if parallel.ep_balance != "measured" or not parallel.ep_redundant or parallel.dims.ep == 1:
        return 0.0
    replicated = min(cfg.n_experts, parallel.dims.ep * parallel.ep_redundant)
    return layers * replicated * cfg.mlp_matrices * cfg.dim * cfg.ffn_dim


def _engine_volumes(parallel: ParallelConfig, train: TrainConfig, dim: str, shards: int, params: float,
                    dtype_bytes: int, gathered: float) -> list[CommVolume]:
    """The gradient sync engine's bytes per step over ``dim`` (``shards`` ranks) for ``params`` parameters:
    without a pipeline the engines reduce sharded gradients (ZeRO-2/3, FSDP but NO_SHARD) and gather sharded
    parameters (``gathered`` bytes per microbatch before the ring factor) every microbatch; a pipeline stage holds
    its units through the step (once); ZeRO-1 reduces once a step and gathers after it, as ZeRO-2 does; DDP
    all-reduces. Gradients travel in fp32, parameters in the compute dtype."""
    if shards <= 1:
        return []
    ring, grads = (shards - 1) / shards, params * 4
    m = microbatches_per_step(parallel, train) if parallel.dims.pp == 1 else 1
    if parallel.zero == 3 or parallel.fsdp in ("full_shard", "hybrid_shard"):
        return [CommVolume("all_gather", dim, m * ring * gathered), CommVolume("reduce_scatter", dim, m * ring * grads)]
    if parallel.zero or parallel.fsdp not in (None, "no_shard"):
        gathers = m if parallel.fsdp in ("shard_grad_op", "hybrid_shard_zero2") else 1
        return [CommVolume("reduce_scatter", dim, (m if parallel.zero != 1 else 1) * ring * grads),
                CommVolume("all_gather", dim, gathers * ring * params * dtype_bytes)]
    return [CommVolume("all_reduce", dim, 2 * ring * grads)]


def _expert_all_to_alls(cfg: ModelConfig, parallel: ParallelConfig, train: TrainConfig, dtype_bytes: int) -> float:
    """Rank 0's expert all-to-all bytes per step over its stage's layers (``parallel/expert.py``): per MoE layer,
    microbatch and forward run (a full recompute runs it again in backward), the tokens per expert (int64) and
    the dispatch and combine of the routed rows; backward the two reverse all-to-alls of their gradients, rows in
    the compute dtype. Uniform routing: (ep - 1)/ep of a rank's rows (its tokens x top-k) leave it. The counts are
    per slot: the experts, and ``--ep-redundant`` more per rank under ``--ep-balance measured``."""
    dims = parallel.dims
    leaving = (dims.ep - 1) / dims.ep
    rows = train.global_batch // dims.dp * train.seq_len // dims.cp * cfg.top_k * leaving
    forwards = 2 if parallel.recompute == "full" else 1
    counts = microbatches_per_step(parallel, train) * leaving * expert_slots(cfg, parallel) * dims.ep * 8
    return rank0_layers(cfg, parallel) * (forwards * counts + (2 * forwards + 2) * rows * cfg.dim * dtype_bytes)


def _gathered_per_microbatch(cfg: ModelConfig, parallel: ParallelConfig, dtype_bytes: int) -> float:
    """Bytes of parameters a fully sharded engine all-gathers per microbatch (before the ring factor): the flat
    engine every unit for forward and again for backward; the per-parameter one (FSDP2) every unit for forward
    and the blocks again for backward (the head stays gathered after its forward, the embedding's backward needs
    no weights); buffer reuse (YaFSDP) the same less the last block, still in its buffer when backward starts.
    A pipeline stage holds its units through the step: one gather a step."""
    params = rank0_params(cfg, parallel) * dtype_bytes
    if parallel.dims.pp > 1:
        return params
    if parallel.fsdp_style == "flat" or parallel.zero:
        return 2 * params
    block = block_params(cfg, parallel.dims.tp) * dtype_bytes
    blocks = rank0_layers(cfg, parallel) * block
    padding = per_param_padding(cfg, parallel, parallel.dims.dp_shard * parallel.dims.cp)
    return params + blocks - (block if parallel.fsdp_style == "reuse" else 0) + (sum(padding) + padding[1]) * dtype_bytes


def per_param_padding(cfg: ModelConfig, parallel: ParallelConfig, shards: int) -> tuple[float, float]:
    """Per-parameter FSDP (FSDP2) shards each parameter's rows, padded to a multiple of the ``shards`` ranks
    (``parallel/fsdp2.py``), and gathers and reduce-scatters the padded rows: the padding elements of rank 0's
    tables and final norm, and of its blocks (dense blocks: their q, k, v, output and MLP matrices and norms).
    Nothing for the other engines."""
    if parallel.fsdp_style != "per_param" or not parallel.fsdp or shards <= 1:
        return 0.0, 0.0
    t, d = parallel.dims.tp, cfg.dim

    def pad(rows: int, width: int) -> int:
        return (-(-rows // shards) * shards - rows) * width
    layers, head = rank0_held(cfg, parallel)
    tables = 1 + (head and not (cfg.tie_embeddings and parallel.one_tied_parameter()))
    ends = tables * pad(math.ceil(cfg.vocab_size / t), d) + head * pad(d, 1)
    if cfg.n_experts or t > cfg.n_kv_heads:
        return float(ends), 0.0
    kv = cfg.n_kv_heads * cfg.head_dim // t
    block = (pad(cfg.q_dim // t, d) + 2 * pad(kv, d) + pad(d, cfg.q_dim // t) + 2 * pad(d, 1)
             + (cfg.mlp_matrices - 1) * pad(cfg.ffn_dim // t, d) + pad(d, cfg.ffn_dim // t))
    return float(ends), float(layers * block)


def _context_parallel_volumes(cfg: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
                              dtype_bytes: int) -> list[CommVolume]:
    """Rank 0's context-parallel bytes per step over its stage's layers: its mode's exchanges per layer from the
    modes' registry (:mod:`parallelisms.perf.context`), with recomputed forwards' re-sends and the K/V heads
    Ulysses repeats, for the local queries and K (or V) of its tokens."""
    dims = parallel.dims
    layers = rank0_layers(cfg, parallel)
    tokens = train.global_batch // dims.dp * train.seq_len // dims.cp
    q = tokens * cfg.q_dim // dims.tp * dtype_bytes
    kv = tokens * cfg.n_kv_heads // dims.tp * cfg.head_dim * dtype_bytes
    return [CommVolume(kind, dim, per_layer * layers)
            for kind, dim, per_layer in context_volumes(cfg, parallel, q, kv, dtype_bytes)]


def microbatches_per_step(parallel: ParallelConfig, train: TrainConfig) -> int:
    """Microbatches each rank runs per step: the pipeline's (default 2 x pp), else the gradient accumulation."""
    return (parallel.microbatches or 2 * parallel.dims.pp) if parallel.dims.pp > 1 else train.grad_accum


def rank0_holds_head(parallel: ParallelConfig) -> bool:
    """Whether rank 0 holds the last layers, the final norm and the head: one stage, or a V-shaped schedule."""
    return parallel.dims.pp == 1 or parallel.schedule in V_SHAPED


def block_params(cfg: ModelConfig, tp: int) -> float:
    """Parameters one block holds on a rank: its matrices split over ``tp``, its two norm weights whole."""
    d = cfg.dim
    tables = 1 if cfg.tie_embeddings else 2  # the embedding and the head (one weight when tied)
    return ((cfg.num_params() - tables * cfg.vocab_size * d - d) / cfg.n_layers - 2 * d) / tp + 2 * d


def rank0_params(cfg: ModelConfig, parallel: ParallelConfig) -> float:
    """Parameters rank 0 holds (its data-parallel traffic): its stages' blocks (:func:`block_params`; DualPipe's two
    copies), the vocabulary-parallel embedding, and the head with the final norm where rank 0 holds the last layers
    too (one stage, a V-shaped schedule, DualPipe's second copy; a tied head is no table of its own where it is the
    embedding's parameter: :meth:`ParallelConfig.one_tied_parameter`)."""
    dims, d, vocab = parallel.dims, cfg.dim, cfg.vocab_size
    layers, head = rank0_held(cfg, parallel)
    tables = 1 + (head and not (cfg.tie_embeddings and parallel.one_tied_parameter()))
    return layers * block_params(cfg, dims.tp) + vocab * d / dims.tp * tables + head * d


def _tensor_parallel_volumes(cfg: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
                             dtype_bytes: int) -> list[CommVolume]:
    """Rank 0's tensor-parallel bytes per step, as its ledger counts them, with A the residual activation of its
    tokens. Per block and pass, Megatron's f and g (Shoeybi et al. 2019) for attention and the MLP: all-reduces
    of A (forward g, backward f); under sequence parallelism (Korthikanti et al. 2023) all-gathers and
    reduce-scatters of A instead, the backward re-gathering each column layer's input for its weight gradient,
    and the two norm weights' gradients all-reduced per microbatch. A full recompute repeats the forward's.
    The ends: the vocabulary-parallel embedding (an all-reduce of its output, or a reduce-scatter into the
    sequence shards and an all-gather back), and on the rank holding the head (one stage, or rank 0 of a
    V-shaped schedule) the cross-entropy's two all-reduces (row maxima; sums of exponentials and target
    logits), the head input's f (or, under SP, the final norm's output gathered, re-gathered, its gradient
    reduce-scattered, and the final norm weight's gradient all-reduced)."""
    dims, t, sp = parallel.dims, parallel.dims.tp, parallel.sequence_parallel
    tokens = train.global_batch // dims.dp * train.seq_len // dims.cp
    elem = 8 if train.dtype == "float64" else 4
    layers, head = rank0_layers(cfg, parallel), rank0_holds_head(parallel)
    gather = (t - 1) / t * tokens * cfg.dim * dtype_bytes  # one all-gather or reduce-scatter of A
    forward = layers * (2 if parallel.recompute == "full" else 1)  # blocks' forwards run
    small = head * tokens * 3 * elem  # the cross-entropy: one value per token, then two
    # fewer key/value heads than ranks: each rank keeps 1/t of the K and V weights and all-gathers them (compute
    # dtype) in every forward, reduce-scattering their gradients in backward
    kv_weights = (t - 1) / t * 2 * cfg.n_kv_heads * cfg.head_dim * cfg.dim * dtype_bytes if t > cfg.n_kv_heads else 0.0
    m = microbatches_per_step(parallel, train)
    mlp = 0 if cfg.n_experts else 1  # an MoE layer is whole on every rank; under SP it gathers its input and the
    # output's gradient (parallel/moe_sequence.py), reduce-scattering nothing
    if not sp:  # the blocks' f and g; the embedding's output; the head input's f
        reduces = (forward + layers) * (1 + mlp) + 1 + head
        out = [CommVolume("all_reduce", "tp", reduces * 2 * gather + 2 * (t - 1) / t * small)]
        return out + ([CommVolume("all_gather", "tp", m * forward * kv_weights),
                       CommVolume("reduce_scatter", "tp", m * layers * kv_weights)] if kv_weights else [])
    gathers = (forward * 2 + layers * (3 + mlp) + 1 + 2 * head) * gather + m * forward * kv_weights  # the embedding's
    scatters = ((forward + layers) * (1 + mlp) + 1 + head) * gather + m * layers * kv_weights  # gradient; the head's
    norm_bytes = 2 if parallel.mixed_precision == "bf16" else elem  # the compute dtype's gradients
    norms = m * (2 * layers + head) * cfg.dim * norm_bytes  # per microbatch
    return [CommVolume("all_gather", "tp", gathers), CommVolume("reduce_scatter", "tp", scatters),
            CommVolume("all_reduce", "tp", 2 * (t - 1) / t * (small + norms))]


def _sharding_dim(parallel: ParallelConfig) -> tuple[str, int] | None:
    """The mesh dimension (and its size) a sharded engine splits parameters or optimizer state over."""
    dims = parallel.dims
    if parallel.fsdp == "no_shard" or not (parallel.zero or parallel.fsdp):
        return None
    if parallel.fsdp in ("hybrid_shard", "hybrid_shard_zero2") or parallel.fsdp_style != "flat":
        return "dp_shard", dims.dp_shard
    if dims.cp > 1 and dims.pp == 1:
        return "dp_cp", dims.dp * dims.cp
    return "dp", dims.dp


def grad_norm_volumes(parallel: ParallelConfig, elem_bytes: int = 4) -> list[CommVolume]:
    """The global gradient norm, measured every step: the squared norms of parameters sharded over the same
    mesh dimensions form a group, and each group is all-reduced (one element) over each of its dimensions.
    Groups: tensor-parallel weights (tp), weights replicated across tp (the norms), each also over pp (stages)
    and the sharding dimension of ZeRO/FSDP, and expert weights (ep), over pp and, sharded, over the ranks
    holding the same experts (``ep_replicate``); dimensions of size 1 send nothing."""
    dims = parallel.dims
    sharding = _sharding_dim(parallel)
    base = [("pp", dims.pp)] + ([sharding] if sharding else [])
    groups = [base] + ([base + [("tp", dims.tp)]] if dims.tp > 1 else [])
    if dims.ep > 1:  # expert weights are sharded over the ranks holding the same experts, not over dp
        replicas = [("ep_replicate", dims.dp * dims.cp // dims.ep)] if sharding else []
        groups.append([("pp", dims.pp)] + replicas + [("ep", dims.ep)])
    out = []
    for group in groups:
        for name, size in group:
            if size > 1:
                out.append(CommVolume("all_reduce", name, 2 * (size - 1) / size * elem_bytes))
    return out


def predicted_comm_by_kind(cfg: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
                           dtype_bytes: int = 4) -> dict[str, float]:
    """``comm_per_step`` summed by collective kind, in the shape of a train report's ``comm`` entry."""
    table: dict[str, float] = {}
    for c in comm_per_step(cfg, parallel, train, dtype_bytes):
        table[c.kind] = table.get(c.kind, 0.0) + c.bytes_per_rank
    return dict(sorted(table.items()))
