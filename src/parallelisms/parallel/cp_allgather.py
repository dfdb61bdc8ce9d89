"""All-gather context parallelism (Llama 3, Dubey et al. 2024, arXiv:2407.21783, Sec. 3.3.2): every rank
all-gathers the keys and values of the whole sequence over cp and attends its own queries to them; the
backward reduce-scatters dK and dV home (:func:`parallelisms.comm.gather_along`). K and V travel stacked, one
all-gather forward and one reduce-scatter backward. The queries are the zigzag chunks the ring uses (chunks r
and 2N-1-r of 2N), and each chunk attends only the keys up to its own end, under a causal mask aligned to its
last key, so every rank does the same unmasked work. Llama 3 picks it over a ring for GQA models, where K
and V are small beside Q, and for masks other than causal; it holds the whole sequence's K/V per layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from parallelisms.comm import Comms, gather_along


def _runs(positions: list[int]) -> list[tuple[int, int, int]]:
    """Runs of consecutive positions as (local start, length, end position + 1)."""
    runs = []
    for i, p in enumerate(positions):
        if runs and p == runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, p + 1)
        else:
            runs.append((i, 1, p + 1))
    return runs


class AllGatherAttentionCore(nn.Module):
    """Replaces the model's causal attention core; q/k/v are [batch, heads, local sequence, head_dim] of the
    positions ``held[comm.rank]``; ``held``: every cp rank's positions."""

    def __init__(self, comms: Comms, held: list[torch.Tensor]):
        super().__init__()
        self.comm = comms["cp"]
        self.order = torch.argsort(torch.cat(held))  # gathered (rank by rank) -> sequence order
        self.runs = _runs(held[self.comm.rank].tolist())

    def forward(self, q, k, v):
        kv = gather_along(torch.stack([k, v]), self.comm, dim=3)[:, :, :, self.order]  # [2, B, Hkv, S, D]
        groups = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(groups, dim=1) if groups > 1 else t for t in kv)
        out = []
        for start, length, end in self.runs:  # the run's queries see keys 0 .. end-1, the last ones causally
            out.append(F.scaled_dot_product_attention(q[:, :, start:start + length], k[:, :, :end], v[:, :, :end],
                                                      attn_mask=_lower_right(length, end, q)))
        return torch.cat(out, dim=2)


def _lower_right(length: int, end: int, q: torch.Tensor):
    """The causal mask aligned to the last key: torch's CausalBias, which a fused GPU kernel takes without a mask;
    elsewhere the boolean mask CausalBias becomes there (``torch.nn.attention.bias.CausalBias._materialize``), made
    directly, since a CausalBias (a tensor subclass the legacy constructor makes) cannot be made under a Python
    dispatch mode: fake tensors (the dry run), memory trackers."""
    if q.is_cuda:
        return causal_lower_right(length, end)
    return torch.ones(length, end, dtype=torch.bool, device=q.device).tril(end - length)


def all_gather_core(comms: Comms, held: list[torch.Tensor], inner: nn.Module, parallel) -> nn.Module:
    return AllGatherAttentionCore(comms, held)
