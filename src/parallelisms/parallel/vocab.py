"""Vocabulary-parallel embedding and cross-entropy (Megatron-LM, Shoeybi et al. 2019, section 3).

The vocabulary is padded to a multiple of the TP degree N and split in N equal row ranges. The embedding
looks up only the tokens this rank owns (zeros elsewhere) and all-reduces (SP: reduce-scatters along the
sequence). The output head is column-parallel over the vocabulary, so each rank holds logits for its
range only; the loss reduces three per-token numbers over TP (the max, then the sum of exponentials
and the target logit together) and never materialises full-vocabulary logits. Padded columns are
masked to -inf, so a vocabulary that N does not divide gives exactly the single-device loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parallelisms.comm import Comm, reduce_from_group, reduce_scatter_along
from parallelisms.model.numerics import upcast
from parallelisms.parallel.common import mark_sharded
from parallelisms.parallel.tensor import Region, shard_rows


class VocabParallelEmbedding(nn.Module):
    """Rows ``[r*V'/N, (r+1)*V'/N)`` of the (padded, V') embedding table as ``weight``."""

    def __init__(self, plain: nn.Embedding, region: Region, padded_vocab: int):
        super().__init__()
        self.region = region
        self.weight = nn.Parameter(shard_rows(plain.weight, region.comm, padded_vocab))
        mark_sharded(self.weight, region.comm.name, 0, plain.weight.shape[0])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        comm, rows = self.region.comm, self.weight.shape[0]
        local = tokens - comm.rank * rows
        outside = (local < 0) | (local >= rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.region.sequence_parallel:
            return reduce_scatter_along(out, comm, dim=1)
        return reduce_from_group(out, comm)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of vocabulary-sharded logits [tokens, V'/N]; keeps only the local softmax."""

    @staticmethod
    def forward(ctx, logits, targets, comm: Comm, vocab_size: int):
        cols, ctx.dtype = logits.shape[-1], logits.dtype
        start = comm.rank * cols
        logits = upcast(logits)
        if start + cols > vocab_size:   # padded columns never win the max and add nothing to the sum
            logits = logits.masked_fill(torch.arange(start, start + cols, device=logits.device) >= vocab_size,
                                        float("-inf"))
        row_max = logits.max(dim=-1).values
        comm.all_reduce(row_max, op=dist.ReduceOp.MAX)
        exp = (logits - row_max.unsqueeze(-1)).exp()
        local_target = targets - start
        inside = (local_target >= 0) & (local_target < cols)
        local_target = local_target.masked_fill(~inside, 0)
        target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) - row_max
        sums = torch.stack([exp.sum(dim=-1), target_logit.masked_fill(~inside, 0.0)])
        comm.all_reduce(sums)
        sum_exp, target_logit = sums.unbind(0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, inside)
        return (sum_exp.log() - target_logit).mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, local_target, inside = ctx.saved_tensors
        grad_logits = softmax   # used once: updated in place (softmax minus one-hot, times dloss/dlogit)
        rows = torch.arange(grad_logits.shape[0], device=grad_logits.device)
        grad_logits[rows[inside], local_target[inside]] -= 1.0
        grad_logits.mul_(grad / grad_logits.shape[0])
        return grad_logits.to(ctx.dtype), None, None, None


class VocabParallelCrossEntropy(nn.Module):
    """Drop-in for the plain ``CrossEntropy``: ``forward(local_logits [..., V'/N], targets [...])``."""

    def __init__(self, comm: Comm, vocab_size: int):
        super().__init__()
        self.comm, self.vocab_size = comm, vocab_size

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        flat = logits.flatten(0, -2)
        if self.comm.size == 1:
            return F.cross_entropy(upcast(flat)[:, :self.vocab_size], targets.flatten())
        return _VocabParallelCrossEntropy.apply(flat, targets.flatten(), self.comm, self.vocab_size)
