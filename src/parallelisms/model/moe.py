"""A mixture-of-experts feed-forward layer in plain PyTorch (Shazeer et al. 2017; Switch Transformer,
Fedus et al. 2021; Mixtral routing, Jiang et al. 2024).

A linear router scores the experts; each token goes to its top-k, weighted by a softmax over the k
selected scores. Tokens are sorted by expert and the experts run as one grouped GEMM (a batched matmul
over experts, each padded to the largest group) rather than a loop of small matmuls. Two choices keep
results independent of how a batch is split across ranks, which the project's equivalence tests need:
the load-balancing loss is computed per sequence and averaged (DeepSeek-V3's sequence-wise auxiliary
loss: E x sum_i f_i P_i with f_i the share of the sequence's assignments routed to expert i and P_i its
mean router probability), and the capacity limit is per sequence as well (at most
ceil(capacity_factor x seq x k / E) assignments of one sequence per expert, kept in token order;
capacity_factor 0 keeps every assignment). ``experts`` is the module that runs the sorted tokens, so
expert parallelism swaps it for one that all-to-alls them to the ranks owning the experts. ``sequence`` says
where the layer's input sits in its sequences (:class:`WholeSequences` here); parallelisms that shard the
sequence swap in a layout that gathers what routing needs (:mod:`parallelisms.parallel.moe_sequence`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from parallelisms.model.numerics import upcast


def grouped_swiglu(x: torch.Tensor, counts: torch.Tensor, w_gate, w_up, w_down) -> torch.Tensor:
    """SwiGLU experts over tokens ``x`` [n, dim] sorted by expert, ``counts[e]`` of them for expert e.

    The grouped GEMM: rows are scattered into one [experts, max_count, dim] tensor so three batched
    matmuls serve every expert at once; padding rows are zero and are never read back.

    No rows (an expert-parallel rank whose experts received no token) take the same path, so the [0, dim]
    output stays in the autograd graph of ``x`` and the weights: backward still reaches the rank's
    all-to-alls, which every rank of the group must issue, and the weights get zero gradients, not None.
    """
    experts = w_gate.shape[0]
    offsets = torch.cumsum(counts, 0) - counts
    expert_of = torch.repeat_interleave(torch.arange(experts, device=x.device), counts)
    slot = torch.arange(x.shape[0], device=x.device) - offsets[expert_of]
    padded = x.new_zeros((experts, int(counts.max()), x.shape[-1]))
    padded = padded.index_put((expert_of, slot), x)
    hidden = F.silu(torch.bmm(padded, w_gate)) * torch.bmm(padded, w_up)
    return torch.bmm(hidden, w_down)[expert_of, slot]


class GroupedExperts(nn.Module):
    """``n`` SwiGLU experts stored as stacked weights [n, dim, ffn] / [n, ffn, dim]."""

    def __init__(self, n: int, dim: int, ffn_dim: int):
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(n, dim, ffn_dim))
        self.w_up = nn.Parameter(torch.empty(n, dim, ffn_dim))
        self.w_down = nn.Parameter(torch.empty(n, ffn_dim, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return grouped_swiglu(x, counts, self.w_gate, self.w_up, self.w_down)


class WholeSequences:
    """The plain layout: the layer's input [batch, seq, dim] holds whole sequences, in position order."""

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """The tokens this rank routes and runs through the experts."""
        return x

    def whole(self, logits: torch.Tensor) -> torch.Tensor:
        """Router logits [batch, seq, E] of whole sequences in position order (capacity and the aux loss)."""
        return logits

    def own(self, t: torch.Tensor) -> torch.Tensor:
        """The rows along dim 1 of a whole-sequence tensor that belong to the tokens of :meth:`enter`."""
        return t

    def leave(self, y: torch.Tensor) -> torch.Tensor:
        """The layer's output, laid out as its input was."""
        return y


class MoE(nn.Module):
    def __init__(self, dim: int, ffn_dim: int, n_experts: int, top_k: int, capacity_factor: float,
                 router_skew: float = 0.0):
        super().__init__()
        self.n_experts, self.top_k, self.capacity_factor = n_experts, top_k, capacity_factor
        self.router_skew = router_skew  # added to the first quarter of the experts' logits (a skewed router)
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = GroupedExperts(n_experts, dim, ffn_dim)
        self.aux_loss: torch.Tensor | None = None   # the last forward's load-balancing loss
        self.tokens_per_expert: torch.Tensor | None = None
        self.dropped = 0  # the last forward's assignments over the capacity (left out)
        self.sequence = WholeSequences()

    def route(self, x: torch.Tensor):
        """Top-k experts, their weights, which assignments fit the per-sequence capacity (for the tokens of
        ``x``), and the aux loss (of whole sequences)."""
        logits = self.sequence.whole(upcast(self.router(x)))             # [B, S, E] of whole sequences
        if self.router_skew:
            hot = torch.arange(self.n_experts, device=logits.device) < max(1, self.n_experts // 4)
            logits = logits + self.router_skew * hot.to(logits.dtype)
        batch, seq, _ = logits.shape
        top_logits, top_experts = logits.topk(self.top_k, dim=-1)         # [B, S, k]
        weights = torch.softmax(top_logits, dim=-1)
        one_hot = F.one_hot(top_experts, self.n_experts).flatten(1, 2)   # [B, S*k, E] in token order
        if self.capacity_factor > 0:
            capacity = math.ceil(self.capacity_factor * seq * self.top_k / self.n_experts)
            rank_in_expert = (torch.cumsum(one_hot, dim=1) * one_hot).sum(-1)  # 1-based, per sequence
            keep = (rank_in_expert <= capacity).view(batch, seq, self.top_k)
        else:
            keep = torch.ones_like(top_experts, dtype=torch.bool)
        share = one_hot.to(logits.dtype).sum(1) / (seq * self.top_k)              # f_i: share of the sequence's assignments
        mean_prob = torch.softmax(logits, dim=-1).mean(1)                 # P_i per sequence
        aux = (self.n_experts * (share * mean_prob).sum(-1)).mean()
        own = self.sequence.own
        return own(top_experts), own(weights), own(keep), aux

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.sequence.enter(x)
        batch, seq, dim = x.shape
        top_experts, weights, keep, aux = self.route(x)
        if torch._C._current_graph_task_id() == -1:  # not a checkpoint's recomputation in backward: there the
            self.aux_loss = aux  # forward's loss was read already, and keeping this one would keep its graph
        tokens = x.reshape(batch * seq, dim)
        kept = keep.flatten().nonzero().squeeze(1)
        expert_ids = top_experts.flatten()[kept]
        order = torch.argsort(expert_ids, stable=True)
        source = torch.div(kept[order], self.top_k, rounding_mode="floor")  # token row of each assignment
        counts = torch.bincount(expert_ids, minlength=self.n_experts)
        self.tokens_per_expert, self.dropped = counts.detach(), keep.numel() - len(kept)
        out = self.experts(tokens[source], counts)                         # rows sorted by expert
        scale = weights.flatten()[kept[order]].to(out.dtype)
        combined = torch.zeros_like(tokens).index_add(0, source, out * scale[:, None])
        return self.sequence.leave(combined.view(batch, seq, dim))
