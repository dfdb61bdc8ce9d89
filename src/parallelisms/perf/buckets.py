"""DDP's gradient buckets as the runtime cuts them: the parameters each of rank 0's modules holds (the model, or
each pipeline stage it holds, each with its own engine), by size, in the order
:class:`~parallelisms.parallel.data.DataParallel` first buckets them (registration order reversed: the head's
first, the embedding's last), cut by the runtime's own
:func:`~parallelisms.parallel.wrap.gradient_buckets` under ``--bucket-mb``; a bucket holds one reducing group (the
expert weights under expert parallelism: the ranks holding the same experts, ``ep_replicate``). DDP all-reduces
each bucket once a step (under gradient accumulation, in the last microbatch's backward; a pipeline stage after
its last backward work; PipeDream before each of its per-microbatch updates)."""

from __future__ import annotations

from collections import Counter

from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig
from parallelisms.parallel.pipeline.schedules import pipeline_microbatches
from parallelisms.parallel.row_split import rows_per_rank
from parallelisms.parallel.wrap import gradient_buckets
from parallelisms.perf.model import expert_slots, pipedream_updates, vocab_rows
from parallelisms.perf.stages import schedule_of, stage_sizes


def block_parameters(cfg: ModelConfig, parallel: ParallelConfig) -> list[tuple[float, str]]:
    """(elements, reducing group) of a block's parameters on tensor-parallel rank 0, in registration order
    (``model/transformer.py``: the attention norm, q, k, v and output projections and their biases, the per-head
    q/k norms, the MLP norm, the MLP's matrices or the router and the grouped experts); the column-parallel
    layers split their output rows over tp, the row-parallel ones their input rows (``parallel/tensor.py``); an
    MoE layer stays whole on every tp rank, its experts the rank's slots under expert parallelism."""
    t, d, f = parallel.dims.tp, cfg.dim, cfg.ffn_dim
    q, kv = rows_per_rank(cfg.q_dim, t), rows_per_rank(cfg.n_kv_heads * cfg.head_dim, t)
    attention = [q * d] + [q] * cfg.qkv_bias + [kv * d] + [kv] * cfg.qkv_bias + [kv * d] + [kv] * cfg.qkv_bias
    attention += [d * q] + [d] * cfg.out_bias + [cfg.head_dim] * 2 * cfg.qk_norm
    dense = [(float(n), "dp") for n in [d] + attention + [d]]
    if not cfg.n_experts:
        return dense + [(float(rows_per_rank(f, t) * d), "dp")] * cfg.mlp_matrices
    ep = parallel.dims.ep > 1
    slots = expert_slots(cfg, parallel) if ep else cfg.n_experts
    return dense + [(float(cfg.n_experts * d), "dp")] + [(float(slots * d * f), "ep_replicate" if ep else "dp")] * 3


def module_parameters(cfg: ModelConfig, parallel: ParallelConfig, layers: int, embedding: bool,
                      head: bool) -> list[tuple[float, str]]:
    """(elements, reducing group) of the parameters of a module holding ``layers`` blocks and the ends named, in
    registration order: the embedding's table, the blocks, the final norm and the head's table (none where a tied
    head is the embedding's parameter: :meth:`ParallelConfig.one_tied_parameter`)."""
    table = (float(vocab_rows(cfg, parallel.dims.tp) * cfg.dim), "dp")
    tied = cfg.tie_embeddings and parallel.one_tied_parameter()
    return ([table] * embedding + block_parameters(cfg, parallel) * layers
            + ([(float(cfg.dim), "dp")] + [table] * (not tied)) * head)


def ddp_buckets(cfg: ModelConfig, parallel: ParallelConfig, train: TrainConfig) -> dict[str, int]:
    """Rank 0's DDP buckets by reducing group (``dp``, ``ep_replicate``): each of its modules' parameters
    (:func:`module_parameters`) in reverse registration order, cut by :func:`gradient_buckets`."""
    dims = parallel.dims
    if dims.pp == 1:
        modules = [(cfg.n_layers, True, True)]
    else:
        schedule = schedule_of(parallel.schedule, dims.pp, pipeline_microbatches(parallel), parallel.chunks)
        sizes, last = stage_sizes(cfg, schedule.num_stages), schedule.num_stages - 1
        modules = [(sizes[s], s == 0, s == last) for _, s in schedule.modules_on(0)]
    out = Counter()
    for layers, embedding, head in modules:
        params = module_parameters(cfg, parallel, layers, embedding, head)[::-1]
        cut = gradient_buckets([n * train.dtype.bytes for n, _ in params], int(train.bucket_mb * 2**20),
                               [group for _, group in params])
        out.update(params[bucket[0]][1] for bucket in cut)
    return {group: calls * pipedream_updates(parallel) for group, calls in out.items()}
