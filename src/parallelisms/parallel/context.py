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

Apply with ``apply_context_parallel(model, comms, parallel, seq_len)``, which builds the cores of the layout's
mode (:mod:`parallelisms.parallel.cp_modes` lists them: these two, all-gather and hierarchical); the runner slices each sequence to
the positions it returns (:func:`shard_sequence`) and passes them to the model for rotary embeddings.
Gradients of the (replicated) weights are then averaged over dp x cp, since cp ranks see different tokens.
Mixture-of-experts layers gather their router logits over cp to route whole sequences
(:mod:`parallelisms.parallel.moe_sequence`).
"""

from __future__ import annotations

import importlib
import math

import torch
from torch import nn

from parallelisms.comm import Comm, Comms, all_to_all
from parallelisms.errors import require
from parallelisms.parallel.cp_modes import MODES, Shape  # the modes' rules, read before launch, and sharding
from parallelisms.parallel.moe_sequence import shard_moe_sequences


def shard_sequence(seq_len: int, rank: int, size: int, zigzag: bool) -> torch.Tensor:
    """Positions of the tokens held by ``rank``: chunks r and 2N-1-r (zigzag) or the r-th contiguous chunk."""
    if not zigzag:
        chunk = seq_len // size
        return torch.arange(rank * chunk, (rank + 1) * chunk)
    chunk = seq_len // (2 * size)
    first, second = rank * chunk, (2 * size - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def _segments(positions: list[int]) -> list[tuple[int, int, int]]:
    """Runs of consecutive positions as (local start, first position, length)."""
    runs = []
    for i, p in enumerate(positions):
        if runs and p == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, p, 1))
    return runs


def block_plan(q_pos: torch.Tensor, k_pos: torch.Tensor) -> list[tuple[slice, slice, bool]]:
    """The attention calls one (query block, key block) pair needs under the causal mask, as (query rows, key
    rows, causal): one causal call when both hold the same positions (the diagonal block), unmasked calls
    for key runs every query of a run sees, nothing for runs no query sees (ring-flash-attention's zigzag
    cases fall out: the own block causal, an earlier rank's first chunk to all queries, a later rank's
    whole block to the second chunk). Layouts of contiguous runs only (zigzag or contiguous chunks)."""
    if torch.equal(q_pos, k_pos):
        return [(slice(0, q_pos.numel()), slice(0, k_pos.numel()), True)]
    k_runs = _segments(k_pos.tolist())
    calls = []
    for q_start, q_first, q_len in _segments(q_pos.tolist()):
        for k_start, k_first, k_len in k_runs:
            if k_first + k_len - 1 <= q_first:        # every query of the run sees every key of this run
                calls.append((slice(q_start, q_start + q_len), slice(k_start, k_start + k_len), False))
            else:
                require(k_first > q_first + q_len - 1, "ring attention: a key run partly visible to a query run; "
                        "shard the sequence in zigzag or contiguous chunks (shard_sequence)")
    merged = []  # adjacent calls sharing their keys (or their queries) become one call
    for q, k, causal in calls:
        if merged and merged[-1][1] == k and merged[-1][0].stop == q.start:
            merged[-1] = (slice(merged[-1][0].start, q.stop), k, False)
        elif merged and merged[-1][0] == q and merged[-1][1].stop == k.start:
            merged[-1] = (q, slice(merged[-1][1].start, k.stop), False)
        else:
            merged.append((q, k, causal))
    return merged


# -- one attention call returning its log-sum-exp: the fused kernels, and the materialised fallback -------

def fused_available(q: torch.Tensor) -> bool:
    """Whether torch has a fused attention kernel returning log-sum-exp for this device and dtype."""
    if q.device.type == "cpu":
        return q.dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16)
    return q.device.type == "cuda" and q.dtype in (torch.float32, torch.bfloat16, torch.float16)


def _attention_forward(q, k, v, causal: bool, scale: float, fused: bool):
    """(output, log-sum-exp per query) of softmax attention of q over k, v (GQA: fewer k/v heads)."""
    if fused and q.device.type == "cpu":  # FlashAttention-2 tiling on CPU, grouped-query heads native
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    groups = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    if fused:  # CUDA: the memory-efficient kernel (fp32 too); its log-sum-exp is padded to a multiple of 32 rows
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                                 scale=scale)
        return out, lse[..., :q.shape[2]]
    scores = _scores(q, k, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]), v), lse


def _attention_backward(grad_out, q, k, v, out, lse, causal: bool, scale: float, fused: bool):
    """(dq, dk, dv) of one call, given the final output and log-sum-exp of the rows (FlashAttention-2's backward:
    probabilities recomputed from the log-sum-exp, D = rowsum(dO * O))."""
    if fused and q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal, scale=scale)
    groups = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    if fused:
        rows = -(-q.shape[2] // 32) * 32
        seed = offset = torch.zeros((), dtype=torch.int64)  # what the forward returns without dropout (unread)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            grad_out, q, k, v, None, out, torch.nn.functional.pad(lse, (0, rows - lse.shape[-1])).contiguous(),
            seed, offset, 0.0, [True, True, True, False], causal, scale=scale)
    else:
        probs = torch.exp(_scores(q, k, causal, scale) - lse[..., None])
        dscores = probs * (torch.matmul(grad_out, v.transpose(-1, -2)) - (grad_out * out).sum(-1, keepdim=True))
        dq = torch.matmul(dscores, k) * scale
        dk = torch.matmul(dscores.transpose(-1, -2), q) * scale
        dv = torch.matmul(probs.transpose(-1, -2), grad_out)
    return dq, dk.unflatten(1, (-1, groups)).sum(2), dv.unflatten(1, (-1, groups)).sum(2)


def _scores(q, k, causal: bool, scale: float):
    """Scaled scores [B, H, Sq, Sk], the upper triangle at -inf when causal (the fallback only)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores[0, 0], dtype=torch.bool).triu(1), float("-inf"))
    return scores


def _merge(out, lse, block_out, block_lse):
    """Combine two normalised partial attentions by their log-sum-exps (exact softmax over the union), in place."""
    new_lse = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new_lse)[..., None]).add_(block_out * torch.exp(block_lse - new_lse)[..., None])
    lse.copy_(new_lse)


def _ring_pass(comm: Comm, tensors: list[torch.Tensor]):
    """Send ``tensors`` to the next rank and receive the previous rank's; returns (pending, buffers)."""
    buffers = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    nxt, prv = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    pending = comm.send_recv(sends=[(t.contiguous(), nxt) for t in tensors], recvs=[(b, prv) for b in buffers])
    return pending, buffers


class _RingAttention(torch.autograd.Function):
    """``plans[step]``: the calls of this rank's queries against the K/V block held at ``step`` (block_plan)."""

    @staticmethod
    def forward(ctx, q, k, v, comm: Comm, plans, fused: bool):
        scale = 1.0 / math.sqrt(q.shape[-1])
        acc = torch.promote_types(q.dtype, torch.float32)  # accumulate in fp32 at least
        out = lse = None
        k_cur, v_cur = k, v
        for step, plan in enumerate(plans):
            pending = _ring_pass(comm, [k_cur, v_cur]) if step < comm.size - 1 else None
            for rows, keys, causal in plan:
                block_out, block_lse = _attention_forward(q[:, :, rows], k_cur[:, :, keys], v_cur[:, :, keys],
                                                          causal, scale, fused)
                if out is None:  # the first call is the own block's diagonal: every row
                    out, lse = block_out.to(acc), block_lse.to(acc)
                else:
                    _merge(out[:, :, rows], lse[:, :, rows], block_out.to(acc), block_lse.to(acc))
            if pending is not None:
                pending[0].wait()
                k_cur, v_cur = pending[1]
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.plans, ctx.scale, ctx.fused = comm, plans, scale, fused
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        comm, scale = ctx.comm, ctx.scale
        acc = lse.dtype
        grad_out = grad_out.contiguous()
        dq = torch.zeros_like(q, dtype=acc)
        k_cur, v_cur = k, v
        grads = None  # the (dK, dV) accumulators travelling with their blocks, in flight
        for step, plan in enumerate(ctx.plans):
            last = step == comm.size - 1
            kv = None if last else _ring_pass(comm, [k_cur, v_cur])
            dk_blk, dv_blk = torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc)
            for rows, keys, causal in plan:
                dq_c, dk_c, dv_c = _attention_backward(grad_out[:, :, rows], q[:, :, rows], k_cur[:, :, keys],
                                                       v_cur[:, :, keys], out[:, :, rows],
                                                       lse[:, :, rows].contiguous(), causal, scale, ctx.fused)
                dq[:, :, rows] += dq_c
                dk_blk[:, :, keys] += dk_c
                dv_blk[:, :, keys] += dv_c
            # dK/dV of this block so far arrive from the previous rank (which held it one step earlier); after
            # this rank adds its share they go on with the block, and one hop after the last step they are home.
            if grads is not None:
                grads[0].wait()
                dk_blk += grads[1][0]
                dv_blk += grads[1][1]
            grads = _ring_pass(comm, [dk_blk, dv_blk])
            if kv is not None:
                kv[0].wait()
                k_cur, v_cur = kv[1]
        grads[0].wait()
        dk, dv = grads[1]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


class RingAttentionCore(nn.Module):
    """Replaces the model's causal attention core; q/k/v are [batch, heads, local sequence, head_dim].
    ``fused``: each block pair through torch's fused attention kernel (None: where one exists for the
    device and dtype), else the materialised fallback, which the tests use to cross-check."""

    def __init__(self, comm: Comm, positions: torch.Tensor, zigzag: bool = True, fused: bool | None = None):
        super().__init__()
        self.comm, self.positions, self.zigzag, self.fused = comm, positions, zigzag, fused
        seq = positions.numel() * comm.size
        self.plans = [block_plan(positions, shard_sequence(seq, (comm.rank - step) % comm.size, comm.size, zigzag))
                      for step in range(comm.size)]

    def forward(self, q, k, v):
        fused = fused_available(q) if self.fused is None else self.fused
        return _RingAttention.apply(q, k, v, self.comm, self.plans, fused)


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


def ring_core(comms: Comms, held: list[torch.Tensor], inner: nn.Module, parallel) -> nn.Module:
    return RingAttentionCore(comms["cp"], held[comms["cp"].rank])


def ulysses_core(comms: Comms, held: list[torch.Tensor], inner: nn.Module, parallel) -> nn.Module:
    return UlyssesAttentionCore(comms["cp"], inner)


def context_parallel_swap(model: nn.Module, comms: Comms, parallel, train) -> torch.Tensor | None:
    """The registry's transform (:func:`parallelisms.train_setup.parallelize`): when ``--cp`` is above 1,
    :func:`apply_context_parallel` and the positions of this rank's tokens; else None."""
    return apply_context_parallel(model, comms, parallel, train.seq_len) if parallel.dims.cp > 1 else None


def apply_context_parallel(model: nn.Module, comms: Comms, parallel, seq_len: int) -> torch.Tensor:
    """Swap every attention core for the one of the layout's context-parallel mode
    (:mod:`parallelisms.parallel.cp_modes`) and give MoE layers the sequence layout; returns the positions of
    this rank's tokens (the mode's sharding), which the runner slices and passes on."""
    mode = MODES[parallel.cp_attention]
    comm = comms["cp"]
    # the heads matter to the rules only; a one-rank build (no cp group) splits one rank
    shape = Shape(comm.size, min(parallel.cp_ulysses_size, comm.size), 0, 0, seq_len)
    held = [torch.tensor(mode.positions(shape, r)) for r in range(comm.size)]
    positions = held[comm.rank]
    shard_moe_sequences(model, cp=comm, positions=positions, order=torch.argsort(torch.cat(held)))
    module, name = mode.core.split(":")
    make_core = getattr(importlib.import_module(module), name)
    for layer in model.layers.values():
        layer.attention.core = make_core(comms, held, layer.attention.core, parallel)
    return positions
