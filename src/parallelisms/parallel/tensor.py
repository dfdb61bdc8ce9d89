"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) with its sequence parallelism (Korthikanti et al.
2023), applied to the plain model by swapping modules in place.

A *column-parallel region* is one input ``x`` multiplied by several column-sharded weights (Q/K/V, or
gate/up): no forward communication (SP: one all-gather of the sequence-sharded ``x``), and in backward
one all-reduce of the summed input gradient (SP: one reduce-scatter along the sequence). A
*row-parallel* layer (``wo``, ``w_down``) multiplies its sharded input by a row-sharded weight and
all-reduces the partial outputs (SP: reduce-scatters them along the sequence). So a block costs 2
all-reduces (or 2 all-gathers + 2 reduce-scatters) of the block activation in forward and the same in
backward, 4(N-1)A/N bytes per rank each way. Under SP the column regions keep only the sharded input for
backward and all-gather it again there, asynchronously behind the input-gradient GEMMs (Megatron's
choice, which gives Korthikanti's Table 2 memory), and the replicated norm weights, which see only their
sequence shard, get their gradients all-reduced over TP by an identity-forward / all-reduce-backward op.

``overlap=True`` launches the input-gradient reduction asynchronously and computes the weight gradients
while it runs (Megatron's async grad all-reduce, spec "Critical path and latency hiding"). ``chunks`` > 1
hides the forward's too, by decomposing each GEMM and its collective into ``chunks`` pieces that pipeline
(Wang et al. ASPLOS'23, "Overlap communication with dependent computation via decomposition"; Transformer
Engine's comm overlap, PyTorch's async TP): without SP a row-parallel layer computes its output in row blocks
and all-reduces each asynchronously while the next block's GEMM runs; under SP a column-parallel region
gathers its sequence shard piece by piece, piece i+1's all-gather in flight while piece i's GEMMs run, and a
row-parallel layer reduce-scatters its output piece by piece behind the next piece's GEMM (a piece: the
same positions of every rank's shard). Each piece's result is the whole one's rows; the backward is the
unchunked one.
Under a split-backward pipeline schedule (Zero Bubble, Qi et al. 2024) the region holds the pipeline's
weight-gradient ``store``: while it defers, both layers leave (weight, output gradient, input) there instead
of computing the weight gradients (the column region's input is the re-gathered one under SP), and only the
input gradient and its communication run in backward.
The vocabulary-parallel embedding and cross-entropy are in :mod:`parallelisms.parallel.vocab`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from parallelisms.comm import Comm, copy_to_group, gather_along
from parallelisms.model.transformer import rotate_queries_keys
from parallelisms.model.numerics import upcast
from parallelisms.parallel.common import mark_sharded


class Region:
    """How a tensor-parallel layer talks to its group: ``comm`` (the TP Comm), ``sequence_parallel`` (the
    activations outside the TP region are sharded along dim 1, the sequence) and ``overlap``; ``store``, the
    pipeline's ``WeightGradStore`` under a split schedule (set by ``split_linears``), else None."""

    def __init__(self, comm: Comm, sequence_parallel: bool = False, overlap: bool = False, chunks: int = 1):
        self.comm, self.sequence_parallel, self.overlap = comm, sequence_parallel, overlap
        self.chunks = chunks  # pieces of a forward GEMM, each one's collective pipelined with the next's GEMM
        self.store = None

    def weight_grad(self, weight: torch.Tensor, grad: torch.Tensor, inp: torch.Tensor) -> torch.Tensor | None:
        """``weight``'s gradient from its output gradient and input, or None when it is left in the store."""
        if self.store is not None and self.store.can_defer(weight):
            self.store.put(weight, grad, inp)
            return None
        return torch.mm(_mm2d(grad).t(), _mm2d(inp))

    def gather_seq(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather(x, dim=1) if self.sequence_parallel else x

    def start_gather_seq(self, x: torch.Tensor):
        """Asynchronous :meth:`gather_seq` (gathered sequence-first, viewed back batch-first); ``.wait()``."""
        if not self.sequence_parallel:
            return _Ready(x)
        return _Then(self.comm.all_gather(x.transpose(0, 1).contiguous(), dim=0, async_op=True),
                     lambda t: t.transpose(0, 1))

    def reduce_input_grad(self, grad: torch.Tensor, async_op: bool):
        """Sum ``grad`` over TP (SP: keep this rank's sequence shard); returns something with ``.wait()``."""
        if not self.sequence_parallel:
            return self.comm.all_reduce(grad, async_op=True) if async_op else _Ready(self.comm.all_reduce(grad))
        # Comm reduce-scatters asynchronously along dim 0 only: make the sequence dim 0 (one copy, as the
        # stacking that a dim-1 reduce-scatter does anyway), then view the shard back as [batch, seq/N, ...].
        shard = self.comm.reduce_scatter(grad.transpose(0, 1).contiguous(), dim=0, async_op=async_op)
        return _Then(shard if async_op else _Ready(shard), lambda t: t.transpose(0, 1))


class _Ready:
    def __init__(self, result):
        self.result = result

    def wait(self):
        return self.result


class _Then:
    def __init__(self, pending, fn):
        self.pending, self.fn = pending, fn

    def wait(self):
        return self.fn(self.pending.wait())


def _mm2d(a: torch.Tensor) -> torch.Tensor:
    return a.reshape(-1, a.shape[-1])


class _ColumnParallel(torch.autograd.Function):
    """``(x W_1^T, ..., x W_k^T)`` for the column-sharded weights of one region, one input-gradient reduction."""

    @staticmethod
    def forward(ctx, x, region: Region, *weights):
        ctx.region, ctx.weights = region, weights  # the weights themselves, for a deferred gradient's .grad
        ctx.save_for_backward(x, *weights)   # x as given: the sequence shard under SP
        if region.chunks > 1 and region.sequence_parallel:
            return _chunked_gather(x, weights, region)
        full = region.gather_seq(x)
        return tuple(F.linear(full, w) for w in weights)

    @staticmethod
    def backward(ctx, *grads):
        region = ctx.region
        x, *weights = ctx.saved_tensors
        full_shape = (*grads[0].shape[:-1], x.shape[-1])
        gathering = region.start_gather_seq(x)   # SP: gather the input again (hidden behind the dX GEMMs)
        grad_x = torch.mm(_mm2d(grads[0]), weights[0])
        for g, w in zip(grads[1:], weights[1:]):
            grad_x.addmm_(_mm2d(g), w)
        x2d = _mm2d(gathering.wait())
        pending = region.reduce_input_grad(grad_x.view(full_shape), async_op=region.overlap)
        grad_ws = [region.weight_grad(w, g, x2d) for g, w in zip(grads, ctx.weights)]  # while it runs
        return (pending.wait(), None, *grad_ws)


class _RowParallel(torch.autograd.Function):
    """``x W^T`` with ``x`` and ``W`` sharded along the inner dimension, partial outputs summed over TP
    in place (no copy); SP: reduce-scattered along the sequence instead. Backward needs no communication
    (SP: all-gather of the output gradient)."""

    @staticmethod
    def forward(ctx, x, weight, region: Region):
        ctx.region, ctx.weight = region, weight  # the weight itself, for a deferred gradient's .grad
        ctx.save_for_backward(x, weight)
        if region.chunks > 1:
            return (_chunked_reduce_scatter if region.sequence_parallel else _chunked_all_reduce)(x, weight, region)
        y = F.linear(x, weight)
        if region.sequence_parallel:
            return region.comm.reduce_scatter(y, dim=1)
        return region.comm.all_reduce(y)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = ctx.region.gather_seq(grad.contiguous())
        grad_x = torch.mm(_mm2d(grad), weight).view(*grad.shape[:-1], weight.shape[-1])
        return grad_x, ctx.region.weight_grad(ctx.weight, grad, x), None


def _chunked_all_reduce(x: torch.Tensor, weight: torch.Tensor, region: Region) -> torch.Tensor:
    """``x W^T`` summed over TP, in ``region.chunks`` row blocks: block i's all-reduce runs (in place,
    asynchronously) while block i+1's GEMM computes."""
    rows = _mm2d(x)
    y = rows.new_empty(rows.shape[0], weight.shape[0])
    pending = []
    for start, stop in _pieces(rows.shape[0], region.chunks):
        torch.mm(rows[start:stop], weight.t(), out=y[start:stop])
        pending.append(region.comm.all_reduce(y[start:stop], async_op=True))
    for p in pending:
        p.wait()
    return y.view(*x.shape[:-1], weight.shape[0])


def _pieces(n: int, chunks: int) -> list[tuple[int, int]]:
    """(start, stop) of ``chunks`` near-equal pieces of ``range(n)`` (fewer where n is smaller)."""
    return [(int(b[0]), int(b[-1]) + 1) for b in torch.arange(n).tensor_split(min(chunks, n))]


def _chunked_gather(x: torch.Tensor, weights, region: Region) -> tuple[torch.Tensor, ...]:
    """``gather_seq(x) W^T`` for each weight, ``x`` (the sequence shard) all-gathered in ``region.chunks``
    pieces of its positions: piece i+1's all-gather in flight while piece i's GEMMs run. A piece gathered
    (sequence-first, rank-major) holds positions ``r * shard + j`` of every rank r."""
    n, (batch, shard, dim) = region.comm.size, x.shape
    rows = x.transpose(0, 1)  # [shard, batch, dim]: a piece of positions is a dim-0 block
    pieces = _pieces(shard, region.chunks)
    outs = [x.new_empty(batch, n, shard, w.shape[0]) for w in weights]

    def gather(i):
        start, stop = pieces[i]
        return region.comm.all_gather(rows[start:stop].contiguous(), dim=0, async_op=True)
    pending = gather(0)
    for i, (start, stop) in enumerate(pieces):
        following = gather(i + 1) if i + 1 < len(pieces) else None
        gathered = pending.wait().view(-1, dim)
        for out, w in zip(outs, weights):
            piece = torch.mm(gathered, w.t()).view(n, stop - start, batch, w.shape[0])
            out[:, :, start:stop].copy_(piece.permute(2, 0, 1, 3))
        pending = following
    return tuple(out.view(batch, n * shard, -1) for out in outs)


def _chunked_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, region: Region) -> torch.Tensor:
    """``x W^T`` summed over TP and reduce-scattered along the sequence, in ``region.chunks`` pieces of the
    shard's positions: piece i (those positions of every rank's shard, rank-major) is reduce-scattered,
    asynchronously into this rank's rows, while piece i+1's GEMM computes."""
    n, (batch, seq, k) = region.comm.size, x.shape
    shard = seq // n
    blocks = x.reshape(batch, n, shard, k).permute(1, 2, 0, 3)  # [rank, position in shard, batch, k]
    y = x.new_empty(shard, batch, weight.shape[0])  # this rank's positions, sequence-first
    pending = []
    for start, stop in _pieces(shard, region.chunks):
        partial = torch.mm(blocks[:, start:stop].reshape(-1, k), weight.t())
        pending.append(region.comm.reduce_scatter(partial, dim=0, async_op=True, scratch=True,
                                                  out=y[start:stop].view(-1, weight.shape[0])))
    for p in pending:
        p.wait()
    return y.transpose(0, 1)


def column_parallel(x: torch.Tensor, region: Region, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Outputs of the column-parallel weights applied to one input (see :class:`_ColumnParallel`)."""
    if region.comm.size == 1:
        return tuple(F.linear(x, w) for w in weights)
    return _ColumnParallel.apply(x, region, *weights)


def shard_rows(full: torch.Tensor, comm: Comm, rows: int | None = None) -> torch.Tensor:
    """This rank's equal chunk along dim 0 of ``full``, zero-padded to ``rows`` first if given."""
    full = full.detach()
    if rows is not None and rows > full.shape[0]:
        full = torch.cat([full, full.new_zeros(rows - full.shape[0], *full.shape[1:])])
    return full.chunk(comm.size, dim=0)[comm.rank].clone()


class ColumnParallelLinear(nn.Module):
    """A linear layer holding rows ``[r*out/N, (r+1)*out/N)`` of the full weight (its ``weight``), and the same
    entries of the full bias when it has one (a column's bias shards with its column).

    ``replicas > 1`` is for grouped key/value heads when TP exceeds their number: the full weight is
    still stored as N equal row chunks, gathered in forward (reduce-scattered in backward, so the shared
    head's gradient is summed over the ranks using it) and this rank takes the rows of head
    ``rank // replicas``. ``rows`` pads the output dimension (a vocabulary TP does not divide).
    """

    def __init__(self, full: nn.Linear, region: Region, replicas: int = 1, head_rows: int = 0,
                 rows: int | None = None):
        super().__init__()
        self.region, self.replicas, self.head_rows = region, replicas, head_rows
        out_features = full.weight.shape[0]
        self.weight = nn.Parameter(shard_rows(full.weight, region.comm, rows))
        mark_sharded(self.weight, region.comm.name, 0, out_features)
        self.bias = None
        if full.bias is not None:
            self.bias = nn.Parameter(shard_rows(full.bias, region.comm, rows))
            mark_sharded(self.bias, region.comm.name, 0, out_features)

    def _local(self, shard: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's rows of the weight or bias (the shared head's, gathered, when ``replicas`` > 1)."""
        if shard is None or self.replicas == 1:
            return shard
        full = gather_along(shard, self.region.comm, dim=0)
        return full.narrow(0, (self.region.comm.rank // self.replicas) * self.head_rows, self.head_rows)

    def local_weight(self) -> torch.Tensor:
        return self._local(self.weight)

    def local_bias(self) -> torch.Tensor | None:
        return self._local(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return with_bias(column_parallel(x, self.region, self.local_weight())[0], self.local_bias())


def with_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias


class RowParallelLinear(nn.Module):
    """A linear layer holding columns ``[r*in/N, (r+1)*in/N)`` of the full weight; its bias (whole on every
    rank) is added once, after the partial outputs are summed. Under SP each rank adds it to its sequence shard,
    so its gradient is summed over TP as the sequence-parallel norms' are."""

    def __init__(self, full: nn.Linear, region: Region):
        super().__init__()
        self.region = region
        in_features = full.weight.shape[1]
        self.weight = nn.Parameter(shard_rows(full.weight.t(), region.comm).t().contiguous())
        mark_sharded(self.weight, region.comm.name, 1, in_features)
        self.bias = full.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.region.comm.size == 1:
            return F.linear(x, self.weight, self.bias)
        y = _RowParallel.apply(x, self.weight, self.region)
        if self.bias is None:
            return y
        return y + (copy_to_group(self.bias, self.region.comm) if self.region.sequence_parallel else self.bias)


class ParallelAttention(nn.Module):
    """Attention over this rank's heads: Q/K/V one column-parallel region, local attention, row-parallel
    output projection. Same submodule names as the plain ``Attention``."""

    def __init__(self, plain: nn.Module, region: Region, n_heads: int, n_kv_heads: int):
        super().__init__()
        tp, self.head_dim, self.region = region.comm.size, plain.head_dim, region
        replicas = max(1, tp // n_kv_heads)
        self.wq = ColumnParallelLinear(plain.wq, region)
        self.wk = ColumnParallelLinear(plain.wk, region, replicas, self.head_dim)
        self.wv = ColumnParallelLinear(plain.wv, region, replicas, self.head_dim)
        self.wo = RowParallelLinear(plain.wo, region)
        # the per-head q/k norms are whole on every rank and see only its heads: gradients summed over TP
        self.q_norm = None if plain.q_norm is None else HeadShardRMSNorm(plain.q_norm, region.comm)
        self.k_norm = None if plain.k_norm is None else HeadShardRMSNorm(plain.k_norm, region.comm)
        self.core = plain.core

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = column_parallel(x, self.region, self.wq.weight, self.wk.local_weight(), self.wv.local_weight())
        q, k, v = (with_bias(t, layer.local_bias()) for t, layer in zip((q, k, v), (self.wq, self.wk, self.wv)))
        batch, seq = q.shape[:2]
        q, k, v = (t.view(batch, seq, -1, self.head_dim) for t in (q, k, v))
        q, k = rotate_queries_keys(self, q, k, cos, sin)
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class ParallelFeedForward(nn.Module):
    """SwiGLU with gate/up one column-parallel region (GELU: up alone), the activation on the local FFN
    shard, and a row-parallel down projection."""

    def __init__(self, plain: nn.Module, region: Region):
        super().__init__()
        self.region = region
        self.w_gate = None if plain.w_gate is None else ColumnParallelLinear(plain.w_gate, region)
        self.w_up = ColumnParallelLinear(plain.w_up, region)
        self.w_down = RowParallelLinear(plain.w_down, region)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w_gate is None:
            return self.w_down(F.gelu(column_parallel(x, self.region, self.w_up.weight)[0]))
        gate, up = column_parallel(x, self.region, self.w_gate.weight, self.w_up.weight)
        return self.w_down(F.silu(gate) * up)


class SequenceParallelRMSNorm(nn.Module):
    """The plain RMSNorm on a sequence shard; its replicated weight passes through identity-forward /
    all-reduce-backward, so its gradient sums the contributions of every shard (Korthikanti et al. 2023).
    The same holds for a per-head q/k norm (Qwen3) on a rank's share of the heads: :data:`HeadShardRMSNorm`."""

    def __init__(self, plain: nn.Module, comm: Comm):
        super().__init__()
        self.eps, self.comm, self.weight = plain.eps, comm, plain.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = upcast(x)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * copy_to_group(self.weight, self.comm)


HeadShardRMSNorm = SequenceParallelRMSNorm  # a per-head norm over this rank's heads: the same sum over TP
