"""Context parallelism: attention over a sequence sharded across ranks, by a ring or by Ulysses all-to-alls.

Ring attention (Liu et al. 2023, arXiv:2310.01889; blockwise online softmax as in Milakov and
Gimelshein 2018 and FlashAttention): each rank keeps its queries and passes key/value blocks around the
ring, one block per step, overlapping the next transfer with the current block's attention. Partial
results are merged exactly by their log-sum-exp, so no rank holds the whole sequence of K/V or the
attention matrix. The backward pass is written by hand: it recomputes each block's probabilities from
the saved log-sum-exp and passes dK/dV around the ring with their blocks, one step further so each
returns to its owner. Causal balance uses zigzag sharding (Brandon et al. 2023; ring-flash-attention):
the sequence is cut into 2N chunks and rank r holds chunks r and 2N-1-r, so every rank has the same
amount of unmasked work.

Ulysses (Jacobs et al. 2023, arXiv:2309.14509): an all-to-all turns [sequence/N, all heads] into
[all of the sequence, heads/N]; each rank attends over the full sequence for its heads; a second
all-to-all restores sequence sharding. Its degree is limited by the number of query heads; with fewer
key/value heads than ranks (grouped-query attention, or the KV heads tensor parallelism leaves a rank) each
KV head is repeated N/KV times before the all-to-all, so rank j receives the head its query heads share
(as DeepSpeed-Ulysses does for GQA): N/KV times the K/V bytes, and the repeat's backward sums the copies.

Apply with ``apply_context_parallel(model, comm, style, seq_len)``; the runner slices each sequence to
the positions it returns (:func:`shard_sequence`) and passes them to the model for rotary embeddings.
Gradients of the (replicated) weights are then averaged over dp x cp, since cp ranks see different tokens.
Mixture-of-experts layers gather their router logits over cp to route whole sequences
(:mod:`parallelisms.parallel.moe_sequence`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from parallelisms.comm import Comm, all_to_all
from parallelisms.errors import divisors, require
from parallelisms.parallel.moe_sequence import shard_moe_sequences


def shard_sequence(seq_len: int, rank: int, size: int, zigzag: bool) -> torch.Tensor:
    """Positions of the tokens held by ``rank``: chunks r and 2N-1-r (zigzag) or the r-th contiguous chunk."""
    if not zigzag:
        chunk = seq_len // size
        return torch.arange(rank * chunk, (rank + 1) * chunk)
    chunk = seq_len // (2 * size)
    first, second = rank * chunk, (2 * size - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def _block_scores(q, k, q_pos, k_pos, scale):
    """Masked scores [B, H, Sq, Sk] of one query block against one key block (GQA heads expanded)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    return scores.masked_fill(q_pos[:, None] < k_pos[None, :], float("-inf"))


def _attend_block(q, k, v, q_pos, k_pos, scale):
    """Unnormalised block attention: (softmax-weighted values, log-sum-exp per query) for one block."""
    scores = _block_scores(q, k, q_pos, k_pos, scale)
    lse = torch.logsumexp(scores, dim=-1)                               # -inf where the block is all masked
    probs = torch.exp(scores - lse.clamp_min(-1e30)[..., None])           # zero on masked entries
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return torch.matmul(probs, v), lse


def _merge(out, lse, block_out, block_lse):
    """Combine two normalised partial attentions by their log-sum-exps (exact softmax over the union)."""
    new_lse = torch.logaddexp(lse, block_lse)
    safe = new_lse.clamp_min(-1e30)[..., None]
    return out * torch.exp(lse[..., None] - safe) + block_out * torch.exp(block_lse[..., None] - safe), new_lse


def _ring_pass(comm: Comm, tensors: list[torch.Tensor]):
    """Send ``tensors`` to the next rank and receive the previous rank's; returns (pending, buffers)."""
    buffers = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    nxt, prv = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    pending = comm.send_recv(sends=[(t.contiguous(), nxt) for t in tensors], recvs=[(b, prv) for b in buffers])
    return pending, buffers


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, positions, comm: Comm, zigzag: bool):
        scale = 1.0 / math.sqrt(q.shape[-1])
        seq = positions.numel() * comm.size
        acc = torch.promote_types(q.dtype, torch.float32)  # accumulate in fp32 at least
        out = torch.zeros_like(q, dtype=acc)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc)
        k_cur, v_cur = k, v
        for step in range(comm.size):
            pending = _ring_pass(comm, [k_cur, v_cur]) if step < comm.size - 1 else None
            owner = (comm.rank - step) % comm.size
            k_pos = shard_sequence(seq, owner, comm.size, zigzag).to(q.device)
            block_out, block_lse = _attend_block(q.to(acc), k_cur.to(acc), v_cur.to(acc), positions, k_pos, scale)
            out, lse = _merge(out, lse, block_out, block_lse)
            if pending is not None:
                pending[0].wait()
                k_cur, v_cur = pending[1]
        ctx.save_for_backward(q, k, v, out, lse, positions)
        ctx.comm, ctx.zigzag, ctx.scale = comm, zigzag, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, positions = ctx.saved_tensors
        comm, scale = ctx.comm, ctx.scale
        seq = positions.numel() * comm.size
        groups = q.shape[1] // k.shape[1]
        acc = out.dtype
        q_acc, grad_out = q.to(acc), grad_out.to(acc)
        delta = (grad_out * out).sum(-1, keepdim=True)  # rowsum(dO * O), FlashAttention-2's D
        dq = torch.zeros_like(q, dtype=acc)
        k_cur, v_cur = k, v
        dk_cur, dv_cur = torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc)
        for step in range(comm.size):
            owner = (comm.rank - step) % comm.size
            k_pos = shard_sequence(seq, owner, comm.size, ctx.zigzag).to(q.device)
            scores = _block_scores(q_acc, k_cur.to(acc), positions, k_pos, scale)
            probs = torch.exp(scores - lse.clamp_min(-1e30)[..., None])
            v_full = v_cur.to(acc).repeat_interleave(groups, dim=1)
            dprobs = torch.matmul(grad_out, v_full.transpose(-1, -2))
            dscores = probs * (dprobs - delta)
            dq += torch.matmul(dscores, k_cur.to(acc).repeat_interleave(groups, dim=1)) * scale
            dk_full = torch.matmul(dscores.transpose(-1, -2), q_acc) * scale
            dv_full = torch.matmul(probs.transpose(-1, -2), grad_out)
            dk_cur = dk_cur + dk_full.unflatten(1, (-1, groups)).sum(2)
            dv_cur = dv_cur + dv_full.unflatten(1, (-1, groups)).sum(2)
            # K/V go on to the next rank for its step; dK/dV travel with them and, after the last step,
            # one hop more brings every block's gradient home to its owner.
            tensors = [dk_cur, dv_cur] + ([k_cur, v_cur] if step < comm.size - 1 else [])
            pending, received = _ring_pass(comm, tensors)
            pending.wait()
            dk_cur, dv_cur = received[0], received[1]
            if step < comm.size - 1:
                k_cur, v_cur = received[2], received[3]
        return dq.to(q.dtype), dk_cur.to(k.dtype), dv_cur.to(v.dtype), None, None, None


class RingAttentionCore(nn.Module):
    """Replaces the model's causal attention core; q/k/v are [batch, heads, local sequence, head_dim]."""

    def __init__(self, comm: Comm, positions: torch.Tensor, zigzag: bool = True):
        super().__init__()
        self.comm, self.positions, self.zigzag = comm, positions, zigzag

    def forward(self, q, k, v):
        return _RingAttention.apply(q, k, v, self.positions.to(q.device), self.comm, self.zigzag)


class UlyssesAttentionCore(nn.Module):
    """All-to-all from sequence shards to head shards, full-sequence causal attention, and back."""

    def __init__(self, comm: Comm, inner: nn.Module):
        super().__init__()
        self.comm, self.inner = comm, inner

    def _to_heads(self, x):
        n = self.comm.size  # [B, H, S/n, D] -> [B, H/n, S, D]
        send = x.unflatten(1, (n, -1)).movedim(1, 0).contiguous()          # [n, B, H/n, S/n, D]
        recv = all_to_all(send.flatten(0, 1), self.comm).unflatten(0, (n, -1))  # [n (seq chunk), B, H/n, S/n, D]
        return recv.movedim(0, 2).flatten(2, 3)

    def _to_sequence(self, x):
        n = self.comm.size  # [B, H/n, S, D] -> [B, H, S/n, D]
        send = x.unflatten(2, (n, -1)).movedim(2, 0).contiguous()          # [n (seq chunk), B, H/n, S/n, D]
        recv = all_to_all(send.flatten(0, 1), self.comm).unflatten(0, (n, -1))  # [n (head group), B, H/n, S/n, D]
        return recv.movedim(0, 1).flatten(1, 2)

    def forward(self, q, k, v):
        n = self.comm.size
        if k.shape[1] < n:  # fewer KV heads than ranks: a copy for every rank (see the module docstring)
            k, v = (t.repeat_interleave(n // t.shape[1], dim=1) for t in (k, v))
        out = self.inner(self._to_heads(q), self._to_heads(k), self._to_heads(v))
        return self._to_sequence(out)


def check_context_parallel(style: str, cp: int, n_heads: int, n_kv_heads: int, seq_len: int) -> None:
    """One-line errors for layouts context parallelism cannot run (before launch)."""
    require(style in ("ring", "ulysses"), f"unknown context-parallel attention {style!r}; choose ring or ulysses")
    if style == "ring":
        require(seq_len % (2 * cp) == 0, f"ring attention with --cp {cp} cuts the sequence into 2 x cp = {2 * cp} "
                                          f"zigzag chunks, but --seq-len {seq_len} is not divisible by {2 * cp}")
    else:
        require(seq_len % cp == 0, f"--seq-len {seq_len} must be divisible by --cp {cp}")

        def fits(d: int) -> bool:
            return n_heads % d == 0 and (n_kv_heads % d == 0 or d % n_kv_heads == 0)
        require(fits(cp), lambda: f"Ulysses --cp {cp} gives each rank heads/cp query heads and needs n_kv_heads a "
                                  f"multiple or a divisor of cp, but n_heads {n_heads} and n_kv_heads {n_kv_heads} "
                                  f"do not fit {cp} (per tensor-parallel rank); use --cp-attention ring or --cp in "
                                  f"{list(filter(fits, divisors(n_heads)))}")


def apply_context_parallel(model: nn.Module, comm: Comm, style: str, seq_len: int) -> torch.Tensor:
    """Swap every attention core for a context-parallel one and give MoE layers the sequence layout; returns
    the positions of this rank's tokens (zigzag chunks for the ring, a contiguous chunk for Ulysses), which
    the runner slices and passes on."""
    held = [shard_sequence(seq_len, r, comm.size, zigzag=style == "ring") for r in range(comm.size)]
    positions = held[comm.rank]
    shard_moe_sequences(model, cp=comm, positions=positions, order=torch.argsort(torch.cat(held)))
    for layer in model.layers.values():
        attention = layer.attention
        if style == "ring":
            attention.core = RingAttentionCore(comm, positions)
        else:
            attention.core = UlyssesAttentionCore(comm, attention.core)
    return positions
