"""The tensor-parallel plan of the Transformer (Megatron-LM, Shoeybi et al. 2019; sequence parallelism,
Korthikanti et al. 2023): which module of a block, and of the model's two vocabulary ends, becomes which
parallel module. The modules themselves are in :mod:`parallelisms.parallel.tensor` and
:mod:`parallelisms.parallel.vocab`."""

from __future__ import annotations

from torch import nn

from parallelisms.comm import Comm
from parallelisms.model.moe import MoE
from parallelisms.parallel.moe_sequence import shard_moe_sequences
from parallelisms.parallel.row_split import rows_per_rank
from parallelisms.parallel.tensor import (ColumnParallelLinear, ParallelAttention, ParallelFeedForward, Region,
                                          SequenceParallelRMSNorm)
from parallelisms.parallel.tied import tie
from parallelisms.parallel.vocab import VocabParallelCrossEntropy, VocabParallelEmbedding


def tensor_parallel_swap(model: nn.Module, comms, parallel, train) -> None:
    """The registry's transform (:func:`parallelisms.train_setup.parallelize`): tensor parallelism, and sequence
    parallelism with it, over the ``tp`` group when ``--tp`` is above 1."""
    if parallel.dims.tp > 1:
        apply_tensor_parallel(model, comms["tp"], sequence_parallel=parallel.sequence_parallel,
                              overlap=parallel.tp_overlap, chunks=max(1, parallel.tp_overlap_chunks))


def apply_tensor_parallel(model: nn.Module, comm: Comm, sequence_parallel: bool = False,
                          overlap: bool = False, chunks: int = 1) -> nn.Module:
    """Shard ``model`` (the full seeded plain Transformer, or a pipeline stage of it) over ``comm`` in place.

    Blocks get parallel attention and MLP; the embedding, the output head and the loss become
    vocabulary-parallel; under SP the norms become sequence-parallel, and the residual stream between
    the embedding and the head is ``[batch, seq/N, dim]``. Parameter names are those of the plain model;
    every sharded parameter is marked for :func:`gather_full`. With ``targets`` the model returns the
    same mean loss as the plain one; without, its logits are this rank's vocabulary shard. A mixture of
    experts stays whole on every tensor-parallel rank (experts replicated over tp, as Megatron-Core does when
    the expert tensor-parallel size is 1): the residual stream it reads is replicated, so each rank routes the
    same tokens, and expert parallelism splits the experts over its own group. Under SP the layer gathers the
    sequence over tp around itself (:mod:`parallelisms.parallel.moe_sequence`). ``overlap``, ``chunks``:
    :class:`~parallelisms.parallel.tensor.Region`.
    """
    cfg = model.cfg
    region = Region(comm, sequence_parallel, overlap, chunks)
    model.seq_shards = comm.size if sequence_parallel else 1  # the residual stream between layers
    padded_vocab = rows_per_rank(cfg.vocab_size, comm.size) * comm.size
    for layer in model.layers.values():
        layer.attention = ParallelAttention(layer.attention, region, cfg.n_heads, cfg.n_kv_heads)
        if not isinstance(layer.feed_forward, MoE):  # experts stay whole, replicated over tp (see docstring)
            layer.feed_forward = ParallelFeedForward(layer.feed_forward, region)
        if sequence_parallel:
            layer.attention_norm = SequenceParallelRMSNorm(layer.attention_norm, comm)
            layer.ffn_norm = SequenceParallelRMSNorm(layer.ffn_norm, comm)
    if sequence_parallel:
        shard_moe_sequences(model, tp=comm)
    if model.tok_embeddings is not None:
        model.tok_embeddings = VocabParallelEmbedding(model.tok_embeddings, region, padded_vocab)
    if model.output is not None:
        if sequence_parallel:
            model.norm = SequenceParallelRMSNorm(model.norm, comm)
        model.output = ColumnParallelLinear(model.output, region, rows=padded_vocab)
        model.loss = VocabParallelCrossEntropy(comm, cfg.vocab_size)
    tie(model)  # a tied head and the embedding split the vocabulary alike: one shard
    return model
