"""The backward of a fully sharded engine unit by unit (ZeRO-3, FSDP FULL_SHARD and HYBRID_SHARD, flat or
per-parameter; no pipeline): where model states outweigh activations its peak comes after the loss, as each
unit's gradient forms beside its gathered weights and the previous unit's reduction in flight, and the reduced
shards' gradients accumulate to the optimizer.

The engines' units (``parallel/wrap.py: module_units``) in backward order: the head (its table and the final
norm), each block from the last (under expert parallelism two units: its experts, sharded over the ranks holding
the same experts, ``ep_replicate``, complete first, then its other weights), the embedding. With c the compute
dtype's bytes and m the shards' (fp32), a unit of U parameters sharded n ways holds:

* gathered, c U: a block's units from its backward's start; the next unit (the flat engine's next
  ``--fsdp-prefetch`` units) once the block's MLP is done (``parallel/common.py: after_last_child_backward``), with
  the flat engine's gather source (c U / n); the flat engine prefetches as the head's backward begins, and gathers
  the embedding; per-parameter FSDP only units
  whose forward saved weights, so not the embedding, and not the last block until its backward;
* its gradient: the flat engine's per-parameter gradients (c U), then their concatenation (c U); resharded,
  once the previous unit's reduction completes, the concatenation and its fp32 copy being reduced
  (``parallel/flat.py: _launch_reduce``; in fp32 the copy is the gradient itself; over one rank the copy is the
  shard's gradient); per-parameter FSDP the unit's fp32 main gradient (m U) from its first parameter's gradient
  on, each parameter's compute-dtype gradient beside it until it is added in, and the reduced shard's output
  (``parallel/fsdp2.py: _reduce_scatter``); in fp32 the parameters' gradients and the send buffer they are copied
  into; the previous unit's send buffer in flight until then;
* reduced, its shard's gradient, m U / n, held to the optimizer (the dry run's grads): every unit's by the end of
  backward, the experts' whole where expert parallelism spans every data-parallel rank; with gradient
  accumulation every shard's from the first microbatch on, a unit's reduced output added into it.

The blocks below the one in backward keep their activations; a block's backward holds its MLP's backward (the
recomputation and the layers' gradients) and then its attention's, the MLP's gradients formed (the flat engine's
and fp32's per-parameter gradients, the fp32 main gradient) and the next unit prefetched.
"""

from __future__ import annotations

from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig
from parallelisms.options import FsdpStyle, Precision


def fully_sharded_backward(cfg: ModelConfig, parallel: ParallelConfig, train: TrainConfig, shard: int,
                           kept: float, backward: tuple[float, float], microbatches: int = 1) -> dict | None:
    """The highest moment of the backward (module docstring) as {grads, activations} bytes, for the dense weights
    sharded ``shard`` ways, ``kept`` bytes a block keeps for backward and ``backward`` what a block's backward holds
    beside them in its MLP and in its attention, ``microbatches`` accumulated without a pipeline. ``None`` for other
    engines and under a pipeline."""
    from parallelisms.perf.model import (block_params, expert_block_change, expert_slot_params, sharding_stage,
                                         vocab_rows)

    dims = parallel.dims
    if sharding_stage(parallel) != 3 or dims.pp > 1 or parallel.fsdp_style is FsdpStyle.REUSE and parallel.fsdp:
        return None
    flat = not (parallel.fsdp and parallel.fsdp_style is FsdpStyle.PER_PARAM)
    tied = cfg.tie_embeddings and parallel.one_tied_parameter()  # the head's table is the embedding's unit's
    m = max(4, train.dtype.bytes)
    c = 2 if parallel.mixed_precision is Precision.BF16 else train.dtype.bytes
    experts = expert_slot_params(cfg, parallel)
    dense = block_params(cfg, dims.tp) + expert_block_change(cfg, parallel) - experts
    table = vocab_rows(cfg, dims.tp) * cfg.dim
    matrix = max(cfg.q_dim, 0 if cfg.n_experts else cfg.ffn_dim) * cfg.dim / dims.tp  # a block's largest weight
    # (parameters, shard degree, largest parameter) of a block's units in backward order
    blocks = [(experts, max(1, shard // dims.ep), experts / cfg.mlp_matrices)] * bool(experts)
    blocks.append((dense, shard, matrix))
    units = [(cfg.dim if tied else table + cfg.dim, shard, cfg.dim if tied else table), *blocks * cfg.n_layers,
             (table, shard, table)]
    accumulated = microbatches > 1
    moments, done, in_flight = [], sum(m * size / n for size, n, _ in units) * accumulated, 0.0

    def sent(size: float, n: int) -> float:
        """The unit's buffers in flight once its reduction is launched, beside its reduced shard's gradient (a
        later microbatch: and the reduced output added into it)."""
        copies = m * size if not flat else c * size * (c != m or n > 1) + m * size * (c != m and n > 1)
        return copies + m * size / n * accumulated

    def unit(size: float, n: int, largest: float, act: float, gathered: float, after: float) -> None:
        """A unit of ``size`` parameters (sharded ``n`` ways, ``largest`` its largest parameter) completes its
        gradient over ``act`` bytes of activations, ``gathered`` bytes of units gathered (itself included),
        ``after`` of them gathered once it is resharded."""
        nonlocal done, in_flight
        if flat:  # its parameters' gradients and their concatenation; then resharded, its copy launched
            moments.append((done, act + gathered + 2 * c * size + in_flight))
            moments.append((done + m * size / n * (not accumulated), act + after + sent(size, n)))
        else:  # the fp32 main gradient (fp32: the gradients, the send buffer) beside a parameter's gradient
            forming = m * size * (1 + (c == m)) + max(c * largest * (c != m), m * size / n)
            moments.append((done, act + gathered + forming + in_flight))
        done, in_flight = done + m * size / n * (not accumulated), sent(size, n)

    first, last = blocks[0][0], blocks[-1][0]  # a block's unit that completes first (its experts) and last
    gathered = c * sum(size for size, _, _ in blocks)
    kv = cfg.n_kv_heads * cfg.head_dim
    mlp_weights = last - (2 * cfg.q_dim + 2 * kv) * cfg.dim / dims.tp - 2 * cfg.dim  # the last unit's but attention's
    main = m * (not flat and c != m)  # per-parameter FSDP's fp32 main gradient, from the unit's first gradient on

    order = [(size, n) for size, n, _ in units]  # every unit in backward order
    depth = parallel.fsdp_prefetch if flat else 1  # units gathered ahead (``--fsdp-prefetch``: the flat engine's)

    def ahead(position: int, count: int) -> float:
        """The ``count`` units after ``position`` in backward order, prefetched (the flat engine also gathers the
        embedding, and holds each gather's source until it completes)."""
        end = min(position + 1 + count, len(order) - (not flat))
        return sum(c * size * (1 + flat / n) for size, n in order[position + 1:end])

    prefetched = ahead(0, depth) * flat  # the flat engine prefetches as the head's backward begins
    unit(*units[0], cfg.n_layers * kept, c * (table + cfg.dim) + prefetched, prefetched)
    held_from = len(moments)
    for i in reversed(range(cfg.n_layers)):
        act, position = i * kept, len(blocks) * (cfg.n_layers - i)  # the position of the block's last unit
        earlier = ahead(position, max(0, depth - len(blocks)))  # prefetched by the block after it
        # the MLP's backward, then (its experts' unit done) the attention's, the next units prefetched
        moments.append((done, act + kept + backward[0] + gathered + earlier + main * first + in_flight))
        if len(blocks) > 1:
            unit(*blocks[0], act + kept, gathered + earlier, gathered + earlier - c * first)
        nxt = ahead(position, depth)
        formed = main * last or c * mlp_weights
        moments.append((done, act + kept + backward[1] + c * last + nxt + formed + in_flight))
        unit(*blocks[-1], act, c * last + nxt, nxt)
    # a tied table stays gathered from the head's backward to the embedding's, beside the head's gradient of it,
    # which the embedding's unit then completes
    moments[held_from:] = [(g, a + 2 * c * table * tied) for g, a in moments[held_from:]]
    unit(*units[-1], 0.0, c * table * flat * (not tied), 0.0)
    grads, activations = max(moments, key=sum)
    return {"grads": grads, "activations": activations}
