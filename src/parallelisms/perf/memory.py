"""Memory per rank as this runtime holds it: the peak over a training step of the rank whose peak is highest,
split as the dry run splits it (``docs/dryrun.md``): params, grads and optimizer state as the engine holds them
at the peak, buffers (the rotary tables) and activations (every other live tensor: what the blocks keep for
backward, the loss's logits, the engines' gathered or compute-dtype weights, the pipeline's fresh gradients).

What a block keeps for backward follows the code (``model/transformer.py``), per token of the microbatch, with e
the activation's bytes (2 in bf16, 4 in fp32) and h, q, kv, f the hidden, query, key/value and MLP widths:

* each RMSNorm keeps its input in fp32 (4h), the normalised input and its output (e h each);
* attention (PyTorch's SDPA, flash: no scores) keeps q, the key and value repeated to every query head and its
  output (4 e q) and the log-sum-exp (4 bytes per head); under context parallelism the mode's descriptor says
  what its core keeps (``parallel/cp_modes.py``: ``kept``, ``kept_per_layer``; ring attention q, k, v and the
  output unrepeated, Ulysses also the output as the all-to-all returns it, all-gather attention the whole
  sequence's key and value and on CPU its causal masks);
* the SwiGLU MLP keeps the gate and up projections, the gate's activation and their product (4 e f; GELU: 2 e f);
* tensor parallelism divides the attention and MLP terms by t; sequence parallelism divides the norms by t too
  (the column layers' input is kept sequence-sharded and re-gathered for the weight gradient);
* selective recompute keeps the attention core's inputs and output, e(2q + 2kv), not the repeated ones;
* full recompute keeps only the block's input, e h (Korthikanti et al. 2023's 2sbh; 2sbh/t with sequence
  parallelism), and recomputes one block at a time in backward.

That is Korthikanti et al. (MLSys'23) Table 2's accounting for this code: its 34sbh + 5as^2b comes from Megatron's
fused kernels (layer norm on 16-bit inputs, dropout masks, materialised attention scores), which
:func:`parallelisms.perf.model.activation_bytes_per_layer` keeps for the published rows.

The peak's moment: with the head on the rank, the loss's backward (plain cross-entropy: the fp32 log-probabilities,
the loss's gradient and the log-softmax's gradient, 12 bytes a logit; vocabulary-parallel: the fp32 logits, their
shifted copy and exponentials in forward, 3 max(4, e) + e); without it (a pipeline's first stage), a block's
backward (three e f-wide gradients). Microbatches in flight come from the pipeline schedule (the simulator's
held activations per rank; a chunk holds its share of the layers); a pipeline stage's gradients exist from its
first backward on (with as many microbatches as stages, the first stage peaks at the end of warm-up, before them):
the walk of a rank's actions is :mod:`parallelisms.perf.pipeline_walk`. Without a pipeline a fully sharded engine's
(ZeRO-3, FSDP) backward, unit by unit, is a later candidate (:mod:`parallelisms.perf.sharded_backward`), as the end
of an engine's backward that keeps the full gradient or reduces it into shards (ZeRO-1/2) is (:func:`end_of_backward`).
"""

from __future__ import annotations

from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig
from parallelisms.options import Balance, FsdpStrategy, FsdpStyle, Precision, Recompute, Schedule
from parallelisms.parallel.cp_modes import MODES
from parallelisms.parallel.wrap import merged_units
from parallelisms.perf.buckets import module_parameters
from parallelisms.perf.model import (flat_mixed_precision, microbatches_per_step, pipedream, sharding_stage,
                                     vocab_rows)
from parallelisms.perf.pipeline_walk import StageGradients, held_at_peak, peak_candidates
from parallelisms.perf.sharded_backward import fully_sharded_backward
from parallelisms.perf.stages import schedule_of, stage_sizes

KINDS = ("params", "grads", "optimizer", "buffers", "activations")


def element_bytes(parallel: ParallelConfig, train: TrainConfig) -> int:
    """Bytes of an activation: bf16 under mixed precision, else the parameters' dtype."""
    return 2 if parallel.mixed_precision is Precision.BF16 else train.dtype.bytes


def block_activation_bytes(cfg: ModelConfig, tokens: float, parallel: ParallelConfig, e: int,
                           recompute: str | None = None, attention: str = "flash", seq: float = 0.0) -> float:
    """Bytes one block keeps for backward for ``tokens`` tokens of a microbatch on this rank (module docstring);
    ``attention`` other than flash adds Megatron's materialised scores, softmax and dropout mask over sequences of
    ``seq`` (5 a s / t bytes per token, Korthikanti Table 2)."""
    dims, sp = parallel.dims, parallel.sequence_parallel
    recompute = parallel.recompute if recompute is None else recompute
    t, h = dims.tp, cfg.dim
    seq_shards = t if sp else 1
    if recompute == Recompute.FULL:
        return e * tokens * h / seq_shards
    norms = 2 * (max(4, e) + 2 * e) * h / seq_shards
    q, kv, heads = cfg.q_dim / t, cfg.n_kv_heads * cfg.head_dim / t, cfg.n_heads / t
    masks = 0.0
    if recompute == Recompute.SELECTIVE:
        core = e * (2 * q + 2 * kv)
    elif dims.cp > 1:  # the mode's core (``parallel/cp_modes.py``: its descriptor's kept bytes)
        mode = MODES[parallel.cp_attention]
        core, masks = mode.kept(e, q, kv, heads, dims.cp), mode.kept_per_layer(seq, dims.cp, e)
    else:
        core = 4 * e * q + 4 * heads
        if attention != "flash":
            core += 5 * heads * seq
    return tokens * (norms + core + mlp_activation_bytes(cfg, parallel, e)) + masks


def mlp_activation_bytes(cfg: ModelConfig, parallel: ParallelConfig, e: int) -> float:
    """Per token: the MLP's kept tensors (SwiGLU four f-wide, GELU two). An MoE layer (``model/moe.py``, SwiGLU
    experts whole on every tensor-parallel rank) keeps per routed row (top-k a token) the experts' four f-wide
    tensors and the grouped GEMM's padded input (h-wide), two more h-wide ones (the experts' output in routing
    order and its weighted copy), four int64 indices (five under expert parallelism), its weight and the top-k's
    index and softmax; per token the router's fp32 probabilities (the load-balancing loss). The grouped GEMM pads
    every slot to the fullest one's rows: with ``--ep-redundant`` copies (``--ep-balance measured``) a rank's
    n/ep + r slots each as full as an uncopied expert (:func:`padded_slots`)."""
    if not cfg.n_experts:
        return e * cfg.ffn_dim / parallel.dims.tp * (4 if cfg.mlp == "swiglu" else 2)
    padded = padded_slots(cfg, parallel) * (4 * e * cfg.ffn_dim + e * cfg.dim)
    return cfg.top_k * (padded + 2 * e * cfg.dim + _routing_bytes(parallel, e)) + 4 * cfg.n_experts


def _routing_bytes(parallel: ParallelConfig, e: int) -> float:
    """Per routed row, what an MoE layer keeps of its routing: four int64 indices (five under expert parallelism),
    its weight and the top-k's index and softmax."""
    return 8 * (4 + (parallel.dims.ep > 1)) + e + 4 + 8


def dispatch_bytes(cfg: ModelConfig, tokens: float, parallel: ParallelConfig, e: int, block: float) -> float:
    """What a forward holds when it pauses at its stage's first expert dispatch (DualPipe's F&B chunk runs the
    other chunk's backward there: ``executor._compute_pair``): the first block's kept bytes before its MoE layer
    (``block``, a whole block's, less :func:`mlp_activation_bytes`), and the layer's so far, per routed row the
    rows gathered for the dispatch and its receive buffer (placed experts, ``--ep-balance measured``, also the
    rows re-sorted by slot) and the routing, per token the router's fp32 probabilities."""
    rows = 2 + (parallel.ep_balance is Balance.MEASURED)
    moe = cfg.top_k * (rows * e * cfg.dim + _routing_bytes(parallel, e)) + 4 * cfg.n_experts
    return block - tokens * (mlp_activation_bytes(cfg, parallel, e) - moe)


def moe_combine_bytes(cfg: ModelConfig, parallel: ParallelConfig, e: int) -> float:
    """Per token, what an MoE layer's forward holds beyond what it keeps (:func:`mlp_activation_bytes`) at its
    peak, per routed row h-wide rows: under expert parallelism, as the combine's all-to-all returns, the rows
    gathered for the dispatch, the rows received and the experts' output put back in arrival order (its weighted
    copy not yet made), three; without it, as the output is weighted, the gathered rows, one. A full-recompute
    block's recomputation in backward peaks there."""
    return cfg.top_k * e * cfg.dim * (3 if parallel.dims.ep > 1 else 1)


def padded_slots(cfg: ModelConfig, parallel: ParallelConfig) -> float:
    """The grouped GEMM's padded rows per routed row a rank receives, under balanced routing
    (``parallel/ep_balance.py``: an expert's rows split evenly over its copies, so an uncopied expert's slot is
    the fullest, or with copies of every expert the one with fewest): 1, or (n/ep + r) / (n/ep) / c with ``r``
    redundant slots per rank and c the fewest copies an expert has."""
    dims = parallel.dims
    if dims.ep == 1 or parallel.ep_balance is not Balance.MEASURED or not parallel.ep_redundant:
        return 1.0
    own, slots = cfg.n_experts // dims.ep, cfg.n_experts // dims.ep + parallel.ep_redundant
    return slots / own / (slots * dims.ep // cfg.n_experts)


def head_bytes(cfg: ModelConfig, tokens: float, parallel: ParallelConfig, e: int, kept: bool = False) -> float:
    """The loss's peak over the logits of ``tokens`` tokens and the final norm's kept tensors (module docstring);
    ``kept``: what a microbatch waiting for its backward keeps instead (the fp32 log-probabilities or softmax)."""
    t = parallel.dims.tp
    vocab = vocab_rows(cfg, t)
    per_logit = max(4, e) if kept else 3 * max(4, e) + (e if t > 1 and e < 4 else 0)
    norm = (max(4, e) + 2 * e) * cfg.dim / (t if parallel.sequence_parallel else 1)
    return tokens * (per_logit * vocab + norm)


def stage_parameters(cfg: ModelConfig, parallel: ParallelConfig, layers: float, embedding: bool, head: bool) -> float:
    """Parameters a rank holds for ``layers`` blocks and the ends it holds (tensor- and expert-parallel shards)."""
    from parallelisms.perf.model import block_params, expert_block_change

    block = block_params(cfg, parallel.dims.tp) + expert_block_change(cfg, parallel)
    table = vocab_rows(cfg, parallel.dims.tp) * cfg.dim
    return layers * block + embedding * table + head * (head_table(cfg, parallel, table) + cfg.dim)


def head_table(cfg: ModelConfig, parallel: ParallelConfig, table: float) -> float:
    """The head's own table: none where it is the tied embedding's parameter (one stage: ``parallel/tied.py``),
    else ``table`` (untied, or a pipeline's copy of the tied weight)."""
    return 0.0 if cfg.tie_embeddings and parallel.one_tied_parameter() else table


def weight_pass_bytes(cfg: ModelConfig, tokens: float, parallel: ParallelConfig, e: int) -> float:
    """Bytes a block keeps between a split backward's input and weight passes: each linear's input (the norms'
    outputs, the attention output, the MLP product) and output gradient, e(4h + (2q + 2kv + 3f)/t) per token."""
    t = parallel.dims.tp
    kv = cfg.n_kv_heads * cfg.head_dim
    return e * tokens * (4 * cfg.dim + (2 * cfg.q_dim + 2 * kv + 3 * cfg.ffn_dim) / t)


def _ranks(cfg: ModelConfig, parallel: ParallelConfig, train: TrainConfig, block: float, tokens: float, e: int,
           moment: tuple[float, float], head_kept: float, grads_of=None, paused: float = 0.0) -> list[dict]:
    """Per pipeline rank: layers held, which ends, the model copies its stages are cut from (DualPipe's second
    direction is a copy: ``parallel/pipeline/stage.py``), and the activations at its peak (bytes: the blocks' of the
    microbatches in flight, ``block`` a block's, and the peak's ``moment``: (without the head, with it)), with the
    stages' gradients (``grads_of(stages, layers per stage)``: :class:`StageGradients`) and ``paused`` the bytes of a
    forward paused at its first expert dispatch where DualPipe's F&B chunks run a backward there (else 0)."""

    dims = parallel.dims
    if dims.pp == 1:
        return [{"layers": cfg.n_layers, "peak": cfg.n_layers * block + moment[1], "embedding": True, "head": True,
                 "stages": 1, "copies": 1}]
    m = microbatches_per_step(parallel, train)
    schedule = schedule_of(parallel.schedule, dims.pp, m, parallel.chunks)
    sizes = stage_sizes(cfg, schedule.num_stages)  # the runtime's cut: uneven where the layers do not divide
    weight_pass = weight_pass_bytes(cfg, tokens, parallel, e)
    partial = ([n * weight_pass for n in sizes],
               e * tokens * (cfg.dim + vocab_rows(cfg, dims.tp)))  # the head's linear
    last = schedule.num_stages - 1
    stash = None
    if pipedream(parallel):  # a forward runs on a stashed copy of its version of the stage's weights (compute
        # dtype), which its microbatch holds until its backward (the walk counts the versions alive)
        stash = [e * stage_parameters(cfg, parallel, n, s == 0, s == last) for s, n in enumerate(sizes)]
    out = []
    for r in range(dims.pp):
        stages = [s for _, s in schedule.modules_on(r)]
        held = {"layers": sum(sizes[s] for s in stages), "stages": len(stages), "embedding": 0 in stages,
                "head": last in stages, "copies": len({p for p, _ in schedule.modules_on(r)})}
        grads = grads_of(stages, sizes) if grads_of else None
        candidates = peak_candidates(parallel.schedule, dims.pp, m, parallel.chunks, r, bool(paused))
        out.append({**held, "gradients": grads, "peak": held_at_peak(candidates, [n * block for n in sizes], partial,
                                                                     moment, head_kept, grads, paused, stash)})
    return out


def model_states(cfg: ModelConfig, parallel: ParallelConfig, params: float, microbatches: int = 1,
                 experts: float = 0.0, local_copy: float = 0.0) -> dict:
    """Params, grads and optimizer state at the peak, and the compute-dtype copy the engine keeps (activations),
    for ``params`` parameters on the rank, as the engines hold them (``parallel/zero.py``, ``fsdp*.py``). With
    gradient accumulation (``microbatches`` > 1, no pipeline) the peak comes in a later microbatch, beside the
    gradients accumulated so far: whole (local, DDP, ZeRO-1; bf16's own gradients under mixed precision without
    sharded gradients) or the reduced shards (ZeRO-2/3, FSDP). Of ``params``, the ``experts`` (expert-parallel
    weights) are sharded over the ranks that hold the same experts (``ep_replicate``: ``split_expert_units``);
    ``local_copy``: a tied head's copy on the rank holding the embedding too, which the optimizer leaves out (its
    gradient is added to the embedding's and it takes the embedding's update: ``parallel/tied.py``). PipeDream's
    compute-dtype weights are its stashed versions (:func:`_ranks`), its engine DDP over the fp32 ones."""
    dims = parallel.dims
    bf16 = flat_mixed_precision(parallel)
    full_shard, sharded = sharding_stage(parallel) == 3, bool(sharding_stage(parallel))
    shard = _shard_degree(parallel) if sharded else 1
    per_shard = _per_shard(params, experts, shard, dims.ep)
    master = 4 * (per_shard if (parallel.fsdp and parallel.fsdp.stage) or full_shard or (bf16 and sharded) else params)
    held_grads = 0.0
    if dims.pp > 1 and not (full_shard or bf16):
        held_grads = 4 * params  # the stage's gradient buffers
    elif not (sharded or bf16) and dims.dp * dims.cp > 1:
        held_grads = 4 * params  # DDP's buckets
    compute_copy = 0.0
    if (bf16 and not full_shard) or (dims.pp > 1 and sharded):  # a stage holds its units through the step
        compute_copy = (2 if bf16 else 4) * params if dims.pp > 1 and full_shard else 2 * params * bf16
    if parallel.fsdp and parallel.fsdp.stage == 2:  # gathered after forward, kept for backward
        compute_copy = (2 if bf16 else 4) * params
    if microbatches > 1 and dims.pp == 1:
        if parallel.zero == 1 or not sharded:
            if bf16:
                compute_copy += 2 * params
            else:
                held_grads = 4 * params
        else:
            held_grads = 4 * per_shard
    stepped = _per_shard(params - local_copy, experts, shard, dims.ep)
    return {"params": master, "grads": held_grads, "optimizer": 8 * stepped, "compute_copy": compute_copy}


def engine_buffers(cfg: ModelConfig, parallel: ParallelConfig, largest_unit: float) -> float:
    """Full weights the sharding engine holds at the loss beyond its compute copy: per-parameter FSDP the head's
    (gathered for its forward, kept for its backward); buffer reuse (YaFSDP) its two weight buffers (compute
    dtype) and two fp32 gradient buffers, each the size of the largest unit."""
    if (not parallel.fsdp or parallel.fsdp_style is FsdpStyle.FLAT or parallel.fsdp is FsdpStrategy.NO_SHARD
            or parallel.dims.pp > 1):
        return 0.0
    compute = parallel.mixed_precision.compute_bytes
    if parallel.fsdp_style is FsdpStyle.REUSE:
        return 2 * (compute + 4) * largest_unit
    return compute * largest_unit


def end_of_backward(cfg: ModelConfig, parallel: ParallelConfig, train: TrainConfig, params: float,
                    experts: float = 0.0, block: float = 0.0, during: float = 0.0) -> dict | None:
    """The later candidates for the peak of an engine that keeps the full gradient (ZeRO-1, and NO_SHARD: mixed
    precision over plain data parallelism, ``--fsdp no_shard``) or reduces it unit by unit into shards (ZeRO-2:
    :func:`reduced_unit_by_unit`, with ``block`` and ``during`` its activations) without a pipeline, the highest
    (``parallel/flat.py``: ``_launch_reduce``, ``_finish_reduce``):

    * the end of backward (ZeRO-1, NO_SHARD; the activations are gone by then), as the first unit's gradient (the
      embedding's, reduced last) is made and reduce-scattered: every unit's full gradient is held (compute dtype;
      in fp32 the shards' gradients are views of it) beside the fp32 shards' own gradients (mixed precision), and
      the last unit's per-parameter gradients as they are concatenated, or its fp32 copy being reduced and its
      reduced shard;
    * the optimizer, whose per-tensor AdamW makes two temporaries of the largest shard (DDP: of the largest
      parameter, ``perf/buckets.py: module_parameters``, beside its buckets).

    ``None`` for ZeRO-3 and FSDP (:mod:`parallelisms.perf.sharded_backward`) and under a pipeline."""
    from parallelisms.perf.model import block_params

    bf16, n = parallel.mixed_precision is Precision.BF16, (_shard_degree(parallel) if parallel.zero in (1, 2) else 1)
    plain = not parallel.zero and (parallel.fsdp is FsdpStrategy.NO_SHARD or (not parallel.fsdp and bf16))
    keeps_full, frees = parallel.zero == 1 or plain, parallel.zero == 2
    ddp = not (parallel.zero or parallel.fsdp or bf16) and parallel.dims.dp * parallel.dims.cp > 1
    if parallel.dims.pp > 1 or not (keeps_full or frees or ddp):
        return None
    if ddp:  # the optimizer beside DDP's buckets: per-tensor AdamW's two temporaries of the largest parameter
        temporaries = optimizer_temporaries(cfg, parallel, train, cfg.n_layers, True, True)
        return {"params": 4 * params, "grads": 4 * params, "optimizer": 8 * params, "activations": temporaries}
    if n == 1 and not bf16:
        return None  # one shard in fp32: the shard is the full parameter, its gradient the full gradient, no copy
    compute = 2 if bf16 else 4
    units = _units_and_blocks(cfg, parallel, train, cfg.n_layers, True, True)
    largest = max(max(size for size, _ in units), vocab_rows(cfg, parallel.dims.tp) * cfg.dim + cfg.dim,
                  block_params(cfg, parallel.dims.tp))
    per_shard = _per_shard(params, experts, n, parallel.dims.ep)
    states = {"params": 4 * per_shard if bf16 else 4 * params, "optimizer": 8 * per_shard}
    if frees:
        held = 2 * params if bf16 else 0.0  # the compute copy
        walk = reduced_unit_by_unit(parallel, train, units[::-1], n, block, during)
        optimizer = {**states, "grads": 4 * per_shard, "activations": held + 8 * largest / n}
        return max({**states, "grads": walk[0], "activations": held + walk[1]}, optimizer,
                   key=lambda kinds: sum(kinds.values()))
    first = units[0][0]
    in_flight = max(compute * first, (4 * first if bf16 else 0) + (4 * first / n if n > 1 else 0))
    held = 2 * params + compute * params if bf16 else 0.0  # the compute copy and the full gradient
    return {**states, "grads": 4 * per_shard if bf16 else 4 * params,
            "activations": held + max(in_flight, 8 * largest / n)}


def reduced_unit_by_unit(parallel: ParallelConfig, train: TrainConfig, units: list[tuple[float, int]], n: int,
                         block: float, during: float) -> tuple[float, float]:
    """(gradient shards, other bytes) at the highest moment of ZeRO-2's backward without a pipeline, over its
    ``units`` (parameters, blocks) in backward's order, the head's first (``parallel/flat.py``: a unit's hook
    concatenates its parameters' gradients and reduce-scatters the result, one unit in flight, completed as the next
    one launches). Beside the blocks not yet backpropagated (``block`` bytes each), the shards already reduced (in a
    later microbatch of gradient accumulation: every unit's) and the previous unit in flight (its gradient in the
    compute dtype, in bf16 its fp32 copy, and the shard the reduce-scatter makes), at each unit:

    * its blocks' backward (``during``: a block's gradients, under full recompute the recomputed block's tensors);
    * its gradient made: its parameters' gradients and their concatenation;
    * its reduction launched (the previous unit's completed): its gradient, in bf16 its fp32 copy, its shard."""
    bf16 = parallel.mixed_precision is Precision.BF16
    compute, master = (2, 4) if bf16 else (train.dtype.bytes, train.dtype.bytes)
    accumulated = microbatches_per_step(parallel, train) > 1
    all_shards = master * sum(size for size, _ in units) / n
    left, done, previous, highest = sum(blocks for _, blocks in units), 0.0, 0.0, (0.0, 0.0)
    for size, blocks in units:
        left -= blocks
        flight = compute * previous + (4 * previous if bf16 else 0.0) + master * previous / n
        made = max(blocks * block + during if blocks else 0.0, 2 * compute * size)
        before = (all_shards if accumulated else done, left * block + made + flight)
        done += master * previous / n
        launched = compute * size + (4 * size if bf16 else 0.0) + master * size / n
        highest = max(highest, before, (all_shards if accumulated else done, left * block + launched), key=sum)
        previous = size
    return highest


def mirror_exchange(parallel: ParallelConfig, grads: StageGradients, params: float, experts: float) -> float:
    """What DualPipe's two copies of a stage hold as they exchange their gradients after the step's reductions
    (``parallel/pipeline/stage.py: add_mirror_copies``, one batched send and receive): every stage's gradients on
    the rank and a receive buffer for the fp32 gradients the engine holds (its shards under a sharding engine);
    the activations are gone by then."""
    stages = len(grads.made)
    shard = _shard_degree(parallel) if sharding_stage(parallel) else 1
    return grads.held((1,) * stages, (0,) * stages) + 4 * _per_shard(params, experts, shard, parallel.dims.ep)


def optimizer_temporaries(cfg: ModelConfig, parallel: ParallelConfig, train: TrainConfig, layers: int,
                          embedding: bool, head: bool) -> float:
    """Bytes of per-tensor AdamW's two fp32 temporaries of the largest tensor the optimizer of a rank holding
    ``layers`` blocks and the ends named steps: a flat engine's largest unit's shard (its units merged under
    ``--bucket-mb`` for ZeRO-1/2), else the largest parameter (``perf/buckets.py: module_parameters``)."""
    flat = parallel.zero or parallel.fsdp or flat_mixed_precision(parallel)
    if not flat or parallel.fsdp_style is FsdpStyle.PER_PARAM and parallel.fsdp:
        return 8 * max(size for size, _ in module_parameters(cfg, parallel, layers, embedding, head))
    shard = _shard_degree(parallel) if sharding_stage(parallel) else 1
    return 8 * max(_stage_units(cfg, parallel, train, layers, embedding, head)) / shard


def _stage_units(cfg: ModelConfig, parallel: ParallelConfig, train: TrainConfig, layers: int, embedding: bool,
                 head: bool) -> list[float]:
    """Parameters of each of the engine's units (:func:`_units_and_blocks`)."""
    return [size for size, _ in _units_and_blocks(cfg, parallel, train, layers, embedding, head)]


def _units_and_blocks(cfg: ModelConfig, parallel: ParallelConfig, train: TrainConfig, layers: int, embedding: bool,
                      head: bool) -> list[tuple[float, int]]:
    """(parameters, blocks) of each of the engine's units on a rank holding ``layers`` blocks and the ends it holds,
    in order (``parallel/wrap.py: module_units``): the embedding, each block, the head (its table and the final
    norm); with ZeRO-1/2 consecutive units merged while their parameters fit the gradient bucket (``--bucket-mb``; a
    tied table stays alone: ``wrap.merged_units``)."""
    from parallelisms.perf.model import block_params, expert_block_change

    t, pbytes = parallel.dims.tp, train.dtype.bytes
    table = vocab_rows(cfg, t) * cfg.dim
    units = [(table, 0)] * embedding + [(block_params(cfg, t) + expert_block_change(cfg, parallel), 1)] * layers
    units += [(head_table(cfg, parallel, table) + cfg.dim, 0)] * head
    if parallel.zero not in (1, 2):
        return units
    alone = [cfg.tie_embeddings and ((embedding and i == 0) or (head and i == len(units) - 1))
             for i in range(len(units))]
    return [(sum(units[i][0] for i in group), sum(units[i][1] for i in group))
            for group in merged_units([size * pbytes for size, _ in units], train.bucket_mb * 2**20, alone)]


def _per_shard(params: float, experts: float, shard: int, ep: int) -> float:
    """A rank's share of ``params`` sharded ``shard`` ways, of which the ``experts`` (expert-parallel weights) are
    sharded only over the ranks holding the same experts (``ep_replicate``: ``split_expert_units``)."""
    return (params - experts) / shard + experts / max(1, shard // ep)


def _shard_degree(parallel: ParallelConfig) -> int:
    dims = parallel.dims
    if parallel.fsdp and (parallel.fsdp.hybrid or parallel.fsdp_style is not FsdpStyle.FLAT):
        return dims.dp_shard * dims.cp
    return dims.dp * dims.cp


def rank_memory(cfg: ModelConfig, parallel: ParallelConfig, train: TrainConfig, attention: str = "flash") -> dict:
    """The busiest rank's peak by kind (module docstring) and ``total``."""

    dims, e = parallel.dims, element_bytes(parallel, train)
    m = microbatches_per_step(parallel, train)
    rows = max(1, train.global_batch // (dims.dp * m))
    tokens = rows * train.seq_len / dims.cp
    seq = train.seq_len / dims.cp
    from parallelisms.perf.model import block_params, expert_block_change, expert_slot_params

    table = vocab_rows(cfg, dims.tp) * cfg.dim + cfg.dim  # the head's unit: its table and final norm
    block = block_activation_bytes(cfg, tokens, parallel, e, attention=attention, seq=seq)
    other = 3 * e * tokens * cfg.ffn_dim / dims.tp  # a block's backward: three f-wide gradients
    if parallel.recompute is Recompute.FULL:  # the block being recomputed, its activations all kept
        other += block_activation_bytes(cfg, tokens, parallel, e, recompute=Recompute.NONE, attention=attention, seq=seq)
    rank_block = block_params(cfg, dims.tp) + expert_block_change(cfg, parallel)  # its expert slots, not a tp share
    # --fsdp-prefetch N (flat, sharded, no pipeline): N - 1 more gathered blocks beside a block's backward than the
    # default's one ahead (a fully sharded engine's backward counts the units ahead itself)
    prefetched = (parallel.fsdp_prefetch - 1) * (2 if parallel.mixed_precision is Precision.BF16 else e) * rank_block
    # after the MLP's backward (its share freed) the attention's input projections' backward holds their input's
    # gradient (sequence parallelism: also the input gathered again and the gradient laid out for its reduce-scatter)
    mlp = tokens * mlp_activation_bytes(cfg, parallel, e) + 3 * e * tokens * cfg.ffn_dim / dims.tp
    attention_backward = other - mlp + e * tokens * cfg.dim * (3 if parallel.sequence_parallel else 1)
    recomputed_moe = parallel.recompute is Recompute.FULL and cfg.n_experts  # its recomputation peaks at the combine
    mlp_backward = other + tokens * moe_combine_bytes(cfg, parallel, e) * bool(recomputed_moe)
    held = engine_buffers(cfg, parallel, max(table, rank_block))  # at the loss
    moment = (other + prefetched, max(other + prefetched, head_bytes(cfg, tokens, parallel, e)))

    def states_of(layers: float, embedding: bool, head: bool, stages: int) -> tuple[float, float, dict]:
        params = stage_parameters(cfg, parallel, layers, embedding, head)
        experts = layers * expert_slot_params(cfg, parallel)
        local = head_table(cfg, parallel, vocab_rows(cfg, dims.tp) * cfg.dim) * (cfg.tie_embeddings and embedding)
        return params, experts, model_states(cfg, parallel, params, m, experts, local * head)

    def stage_gradients(stages: list[int], sizes: list[int]) -> StageGradients:
        """A pipeline rank's gradients by stage (:class:`StageGradients`), held through the step: DDP in fp32 the
        parameters' own gradients (its buckets), every stage's through the step; a flat engine in
        fp32 each unit's accumulated gradient, in bf16 the fp32 main gradient each microbatch's gradient is added
        into unit by unit, a stage's from its first backward; with a split backward's
        weight passes (Zero Bubble, DualPipe) in bf16, the units' deposited bf16 gradients (the units holding a
        linear layer) until the stage's next backward; a backward forms one flat unit's gradient at a time, the
        stage's first unit at its end as its parameters' gradients and their concatenation (the microbatch freed).
        PipeDream without data parallelism drops the stage's gradients at each update; its update after each
        backward holds per-tensor AdamW's two temporaries of the stage's largest tensor."""
        last, full_shard = len(sizes) - 1, sharding_stage(parallel) == 3
        bf16 = flat_mixed_precision(parallel)
        flat = bool(parallel.zero) or (bool(parallel.fsdp) or bf16) and parallel.fsdp_style is FsdpStyle.FLAT
        split = bf16 and schedule_of(parallel.schedule, dims.pp, m, parallel.chunks).split_backward
        made, deposited, largest = [0.0] * len(sizes), [0.0] * len(sizes), 0.0  # by stage index
        formed = [0.0] * len(sizes)
        for s in stages:
            units = _stage_units(cfg, parallel, train, sizes[s], s == 0, s == last)
            made[s] = 4 * sum(units)
            formed[s] = 2 * units[0] * (2 if bf16 else e) * (flat and not full_shard)
            deposited[s] = 2 * (sum(units) - (units[0] if s == 0 and units[0] == table - cfg.dim else 0)) * split
            largest = max(largest, *units)
        ddp = not (parallel.zero or parallel.fsdp or bf16)
        transient = largest * (2 if bf16 else e) * (flat and not full_shard)
        updates = [0.0] * len(sizes)
        if pipedream(parallel):
            dropped = dims.dp * dims.cp == 1  # without data parallelism the gradients go at each update
            updates = [(made[s] * dropped + optimizer_temporaries(cfg, parallel, train, sizes[s], s == 0, s == last))
                       * (s in stages) for s in range(len(sizes))]
            if dropped:
                made, transient, ddp = [0.0] * len(sizes), max(made), False
        # fp32 under a split backward: the input pass forms the unit's gradient while the loss's tensors live
        at_loss = transient * (not bf16 and schedule_of(parallel.schedule, dims.pp, m, parallel.chunks).split_backward)
        reuse = parallel.fsdp_style is FsdpStyle.REUSE and sharding_stage(parallel) == 3
        return StageGradients(tuple(made), tuple(deposited), transient, whole=ddp or reuse, at_loss=at_loss,
                              formed=tuple(formed), updates=tuple(updates))

    best = None
    paused = dispatch_bytes(cfg, tokens, parallel, e, block) if cfg.n_experts and dims.ep > 1 else 0.0
    for rank in _ranks(cfg, parallel, train, block, tokens, e, moment, head_bytes(cfg, tokens, parallel, e, True),
                       stage_gradients if dims.pp > 1 else None, paused):
        params, experts, states = states_of(rank["layers"], rank["embedding"], rank["head"], rank["stages"])
        if dims.pp > 1:  # the stage's gradients are in the walk's peak (:func:`held_at_peak`)
            states["grads"] = 0.0
        rotary = 4 * cfg.max_seq_len * cfg.head_dim * rank["copies"]  # the stages share their model's tables
        out = {"params": states["params"], "grads": states["grads"], "optimizer": states["optimizer"],
               "buffers": float(rotary), "activations": rank["peak"] + states["compute_copy"] + held}
        if parallel.schedule is Schedule.DUALPIPE and dims.pp > 1:
            exchange = mirror_exchange(parallel, rank["gradients"], params, experts)
            out["activations"] = max(out["activations"], exchange + states["compute_copy"] + held)
        if dims.pp > 1:  # the optimizer: every stage's gradients beside per-tensor AdamW's two temporaries
            temporaries = optimizer_temporaries(cfg, parallel, train, rank["layers"], rank["embedding"], rank["head"])
            stages = (1,) * len(rank["gradients"].made)
            optimizer = rank["gradients"].held(stages, (0,) * len(stages)) + temporaries + states["compute_copy"]
            out["activations"] = max(out["activations"], optimizer)
        out["total"] = sum(out[k] for k in KINDS)
        ending = end_of_backward(cfg, parallel, train, params, experts, block, other)
        if ending is not None and sum(ending.values()) + out["buffers"] > out["total"]:
            out = {**ending, "buffers": out["buffers"], "total": sum(ending.values()) + out["buffers"]}
        walk = fully_sharded_backward(cfg, parallel, train, _shard_degree(parallel), block,
                                      (mlp_backward, attention_backward), m)
        if walk is not None and sum(walk.values()) > out["grads"] + out["activations"]:
            out = {**out, **walk}
            out["total"] = sum(out[k] for k in KINDS)
        if best is None or out["total"] > best["total"]:
            best = out
    return best
