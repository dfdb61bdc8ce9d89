"""Closed forms for a layout's cost: parameters, FLOPs, activation and model-state memory, and the bytes
each collective moves per step. They take the same ``ModelConfig`` / ``ParallelConfig`` / ``TrainConfig``
the runtime takes, so a prediction can be set beside a measurement (the ledger, the memory report).

Sources: parameters and FLOPs of GPT models, Narayanan et al. SC'21 (Eq. 2, 3) and Korthikanti et al.
MLSys'23 (Eq. 7); activation memory per layer, Korthikanti Table 2; model states per rank, ZeRO
(Rajbhandari et al. SC'20); communication per step, the spec's formulas (DP 2(N-1)/N G; TP 4(N-1)A/N per
block each way; ZeRO-3 1.5x DP) and ring attention / Ulysses volumes.
"""

from __future__ import annotations

import functools
import importlib
import math
from dataclasses import dataclass

from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig
from parallelisms.options import Balance, FsdpStyle, Precision, Recompute, Schedule
from parallelisms.parallel.ep_placement import canonical, replicated, slots_per_rank
from parallelisms.parallel.memory import zero_formula
from parallelisms.parallel.registry import PARALLELISMS
from parallelisms.parallel.row_split import padding_rows, rows_per_rank
from parallelisms.parallel.shard_group import shard_dim
from parallelisms.perf.stages import rank0_held, rank0_layers
from parallelisms.parallel.pipeline.schedules import V_SHAPED, pipeline_microbatches


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
                               sequence_parallel: bool = False, recompute: str = Recompute.NONE, kv_heads: int | None = None,
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
    if recompute == Recompute.FULL:  # the layer's input, sequence-sharded under sequence parallelism
        return 2 * sbh / (tp if sequence_parallel else 1)
    if sequence_parallel:
        return sbh * ((10 + sharded) / tp + (attention if recompute == Recompute.NONE else 0))
    return sbh * (10 + sharded / tp + (attention if recompute == Recompute.NONE else 0))


def pipeline_activation_factor(pp: int, chunks: int = 1) -> float:
    """Layers' worth of activations the first 1F1B stage holds, as a multiple of the whole model's L/p per
    microbatch: p microbatches in flight x L/p layers = L layers; interleaving multiplies by 1 + (p-1)/(p v)
    (Korthikanti section 4.2.3)."""
    return 1.0 + (pp - 1) / (pp * chunks) if chunks > 1 else 1.0


def sharding_stage(parallel: ParallelConfig) -> int:
    """The ZeRO stage of the layout's sharding engine: ``--zero``, or the one its FSDP strategy matches (0: none)."""
    return parallel.zero or (parallel.fsdp.stage if parallel.fsdp else 0)


def model_state_bytes(num_params: int, parallel: ParallelConfig, expert_params: int = 0) -> dict:
    """Parameters, gradients and optimizer state per rank (ZeRO's accounting); parameters are first divided
    by tp x pp (each rank holds 1/(tp pp) of the model), then by the sharding data-parallel degree. Of them,
    ``expert_params`` are divided by pp x ep instead (experts replicate over tp) and shard over the ranks holding
    the same experts."""
    dims = parallel.dims
    stage = sharding_stage(parallel)
    shard = dims.dp_shard if parallel.fsdp else dims.dp
    bf16 = parallel.mixed_precision is Precision.BF16
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
    """Bytes rank 0 sends per step, by collective and mesh dimension, from the spec's formulas: each parallelism's
    collectives from the function its descriptor names (``volumes`` in :data:`PARALLELISMS`, in
    :mod:`parallelisms.perf.volumes`), in the registry's order, then the gradient norm's (PipeDream's per stage
    and update); ``pipeline`` False leaves out the stages' sends (the step model prices
    them through the schedule).

    Every collective the runtime's ledger counts, expert all-to-alls assuming uniform routing. Parameter
    all-gathers and activations move the compute dtype (``dtype_bytes``, 2 in bf16); gradient reductions and the
    cross-entropy's are fp32.
    """
    out = []
    for p in PARALLELISMS.values():
        if p.volumes and (pipeline or p.dim != "pp"):
            out += _named(p.volumes)(cfg, parallel, train, dtype_bytes)
    return out + grad_norm_volumes(parallel, train.dtype.bytes)


@functools.cache
def _named(spec: str):
    """The function a descriptor names as ``module:function``."""
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def expert_placement(cfg: ModelConfig, parallel: ParallelConfig) -> list[int]:
    """The placement of a MoE layer's experts on the expert-parallel ranks before any measurement, the runtime's
    (:func:`~parallelisms.parallel.ep_placement.canonical`): plain expert parallelism's n_experts / ep a rank, with
    ``--ep-redundant`` more slots a rank copying the experts after its own under ``--ep-balance measured`` (EPLB)."""
    extra = parallel.ep_redundant if parallel.ep_balance is Balance.MEASURED else 0
    return canonical(cfg.n_experts, parallel.dims.ep, extra)


def expert_slots(cfg: ModelConfig, parallel: ParallelConfig) -> int:
    """Experts an expert-parallel rank holds per MoE layer: its slots under :func:`expert_placement`."""
    return slots_per_rank(expert_placement(cfg, parallel), parallel.dims.ep)


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
    reduction; PipeDream at each of its M per-microbatch updates), over the ``layers`` it holds (DualPipe's two
    copies of a stage each): the replicated experts of :func:`expert_placement` per layer (min(n_experts, ep x R) for R
    redundant slots per rank), before any measurement and under uniform routing alike (the extra slots go to the
    experts in turn); a skewed router copies fewer, hotter experts more often. A flat engine that
    shards the slots over the expert replicas (ZeRO, FSDP but NO_SHARD) all-reduces the same elements over them too,
    each rank's share of its copies being a range of them."""
    if parallel.ep_balance is not Balance.MEASURED or not parallel.ep_redundant or parallel.dims.ep == 1:
        return 0.0
    copied = len(replicated(expert_placement(cfg, parallel), cfg.n_experts))
    return pipedream_updates(parallel) * layers * copied * cfg.mlp_matrices * cfg.dim * cfg.ffn_dim


def pipedream(parallel: ParallelConfig) -> bool:
    """Whether the layout runs PipeDream: a pipeline whose stages update after every microbatch."""
    return parallel.dims.pp > 1 and parallel.schedule is Schedule.PIPEDREAM


def pipedream_updates(parallel: ParallelConfig) -> int:
    """Optimizer updates (and DDP gradient all-reduces) a step: PipeDream's one per microbatch, else one."""
    return pipeline_microbatches(parallel) if pipedream(parallel) else 1


def flat_mixed_precision(parallel: ParallelConfig) -> bool:
    """Whether bf16 mixed precision runs through the flat engine's plan (fp32 master shards, a bf16 compute copy):
    everywhere but PipeDream, whose bf16 is its stashed versions' and whose engine is DDP over the fp32 weights."""
    return parallel.mixed_precision is Precision.BF16 and not pipedream(parallel)


def per_param_padding(cfg: ModelConfig, parallel: ParallelConfig, shards: int) -> tuple[float, float]:
    """Per-parameter FSDP (FSDP2) shards each parameter's rows, padded to a multiple of the ``shards`` ranks
    (:mod:`parallelisms.parallel.row_split`, the engine's split), and gathers and reduce-scatters the padded rows:
    the padding elements of rank 0's tables and final norm, and of its blocks (dense blocks: their q, k, v, output
    and MLP matrices and norms). Nothing for the other engines."""
    if parallel.fsdp_style is not FsdpStyle.PER_PARAM or not parallel.fsdp or shards <= 1:
        return 0.0, 0.0
    t, d = parallel.dims.tp, cfg.dim

    def pad(rows: int, width: int) -> int:
        return padding_rows(rows, shards) * width
    layers, head = rank0_held(cfg, parallel)
    tables = 1 + (head and not (cfg.tie_embeddings and parallel.one_tied_parameter()))
    ends = tables * pad(vocab_rows(cfg, t), d) + head * pad(d, 1)
    if cfg.n_experts or t > cfg.n_kv_heads:
        return float(ends), 0.0
    kv = cfg.n_kv_heads * cfg.head_dim // t
    block = (pad(cfg.q_dim // t, d) + 2 * pad(kv, d) + pad(d, cfg.q_dim // t) + 2 * pad(d, 1)
             + (cfg.mlp_matrices - 1) * pad(cfg.ffn_dim // t, d) + pad(d, cfg.ffn_dim // t))
    return float(ends), float(layers * block)


def microbatches_per_step(parallel: ParallelConfig, train: TrainConfig) -> int:
    """Microbatches each rank runs per step: the pipeline's (default 2 x pp), else the gradient accumulation."""
    return pipeline_microbatches(parallel) if parallel.dims.pp > 1 else train.grad_accum


def rank0_holds_head(parallel: ParallelConfig) -> bool:
    """Whether rank 0 holds the last layers, the final norm and the head: one stage, or a V-shaped schedule."""
    return parallel.dims.pp == 1 or parallel.schedule in V_SHAPED


def rank0_end_shares(parallel: ParallelConfig) -> tuple[float, float]:
    """The shares of rank 0's microbatches that run through the embedding and through the head: both for every
    microbatch on one stage or a V-shaped schedule, the embedding only on a pipeline's first rank, and half each
    under DualPipe, whose rank 0 holds the first stage of the forward direction and the last of the reverse one
    (each direction carries half the microbatches)."""
    if parallel.dims.pp > 1 and parallel.schedule is Schedule.DUALPIPE:
        return 0.5, 0.5
    return 1.0, float(rank0_holds_head(parallel))


def vocab_rows(cfg: ModelConfig, tp: int) -> int:
    """Vocabulary rows of the embedding and of the head on a tensor-parallel rank: the runtime's split
    (:func:`parallelisms.parallel.row_split.rows_per_rank`), whose padding rows it holds, computes and reduces."""
    return rows_per_rank(cfg.vocab_size, tp)


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
    dims, d = parallel.dims, cfg.dim
    layers, head = rank0_held(cfg, parallel)
    tables = 1 + (head and not (cfg.tie_embeddings and parallel.one_tied_parameter()))
    return layers * block_params(cfg, dims.tp) + vocab_rows(cfg, dims.tp) * d * tables + head * d


def rank0_dense_and_experts(cfg: ModelConfig, parallel: ParallelConfig) -> tuple[float, float]:
    """The parameters of the layers rank 0 holds (every stage on it: DualPipe's two copies) and its ends, as (the
    dense weights, the expert weights of its slots, split over ep where rank0_params splits them over tp): a
    sharding engine splits the first over :func:`dense_shards`, the second over the ranks holding the same experts
    (``ep_replicate``)."""
    layers = rank0_held(cfg, parallel)[0]
    experts = layers * expert_slot_params(cfg, parallel)
    return rank0_params(cfg, parallel) + layers * expert_block_change(cfg, parallel) - experts, experts


def dense_shards(parallel: ParallelConfig) -> int:
    """The ranks a data-parallel engine splits the dense weights over: HSDP's shard group, else every rank that saw
    different tokens (dp x cp)."""
    return parallel.dims.span("dp_shard_cp" if parallel.fsdp and parallel.fsdp.hybrid else "dp_cp")[0]


def mirror_gradient_bytes(cfg: ModelConfig, parallel: ParallelConfig) -> float:
    """Bytes of the fp32 gradients DualPipe's two copies of a stage exchange after the step's reductions: what
    the engine holds on the rank, the dense weights' shard over the sharding ranks (the replicas' under HSDP) and
    the experts' over the ranks holding the same experts where the engine shards them, else whole."""
    dense, experts = rank0_dense_and_experts(cfg, parallel)
    if not sharding_stage(parallel):
        return 4 * (dense + experts)
    shards = dense_shards(parallel)
    padded = dense + sum(per_param_padding(cfg, parallel, shards))
    return 4 * (padded / shards + experts / parallel.dims.span("ep_replicate")[0])


def tied_gradient_bytes(cfg: ModelConfig, parallel: ParallelConfig) -> float:
    """Bytes of the fp32 gradient a tied embedding's two copies exchange over pp after the step's reductions
    (``parallel/tied.py``), where rank 0 holds the embedding and the last stage's rank the head's copy (a rank
    holding both adds them in place): what the engine holds of the table, its shard (the flat engine's unit
    padded to the shards, per-parameter FSDP's rows) or the whole table."""
    if not cfg.tie_embeddings or parallel.dims.pp == 1 or rank0_held(cfg, parallel)[1]:
        return 0.0
    rows = vocab_rows(cfg, parallel.dims.tp)
    if not sharding_stage(parallel):
        return 4.0 * rows * cfg.dim
    shards = dense_shards(parallel)
    if parallel.fsdp and parallel.fsdp_style is FsdpStyle.PER_PARAM:
        return 4.0 * (rows + padding_rows(rows, shards)) // shards * cfg.dim
    return 4.0 * math.ceil(rows * cfg.dim / shards)


def _sharding_dim(parallel: ParallelConfig) -> tuple[str, int] | None:
    """The mesh dimension (and its size) a sharded engine splits parameters or optimizer state over: the runtime's
    (:func:`~parallelisms.parallel.shard_group.shard_dim`)."""
    name = shard_dim(parallel) if sharding_stage(parallel) else None
    return None if name is None else (name, parallel.dims.span(name)[0])


def grad_norm_volumes(parallel: ParallelConfig, elem_bytes: int = 4) -> list[CommVolume]:
    """The global gradient norm, measured every step: the squared norms of parameters sharded over the same
    mesh dimensions form a group, and each group is all-reduced (one element) over each of its dimensions.
    Groups: tensor-parallel weights (tp), weights replicated across tp (the norms), each also over pp (stages)
    and the sharding dimension of ZeRO/FSDP, and expert weights (ep), over pp and, sharded, over the ranks
    holding the same experts (``ep_replicate``); dimensions of size 1 send nothing. PipeDream clips each stage's
    gradient on its own, at each of its per-microbatch updates: not over pp."""
    dims = parallel.dims
    sharding = _sharding_dim(parallel)
    updates = pipedream_updates(parallel)
    stages = [] if pipedream(parallel) else [("pp", dims.pp)]
    base = stages + ([sharding] if sharding else [])
    groups = [base] + ([base + [("tp", dims.tp)]] if dims.tp > 1 else [])
    if dims.ep > 1:  # expert weights are sharded over the ranks holding the same experts, not over dp
        replicas = [("ep_replicate", dims.span("ep_replicate")[0])] if sharding else []
        groups.append(stages + replicas + [("ep", dims.ep)])
    out = []
    for group in groups:
        for name, size in group:
            if size > 1:
                out.append(CommVolume("all_reduce", name, updates * 2 * (size - 1) / size * elem_bytes))
    return out


def predicted_comm_by_kind(cfg: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
                           dtype_bytes: int = 4) -> dict[str, float]:
    """``comm_per_step`` summed by collective kind, in the shape of a train report's ``comm`` entry."""
    table: dict[str, float] = {}
    for c in comm_per_step(cfg, parallel, train, dtype_bytes):
        table[c.kind] = table.get(c.kind, 0.0) + c.bytes_per_rank
    return dict(sorted(table.items()))
