"""Pipeline stages cut from the plain model (GPipe, Huang et al. 2019: consecutive layers per stage).

Stage 0 holds the token embedding, the last stage the final norm, the output head and the loss; every
stage holds a contiguous range of blocks. A stage keeps the plain model's parameter names
(``layers.5.attention.wq.weight``), so the full model is reassembled by name across pipeline ranks.
Stages share the plain model's modules (no copy) unless asked for a copy (DualPipe's second direction).
Under tensor parallelism the modules are already the tensor-parallel ones; with sequence parallelism the
hidden states between stages are the sequence-sharded residual stream (``seq_shards`` = tp).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from parallelisms.model.transformer import Transformer


class Stage(nn.Module):
    """Layers ``first .. last-1`` of ``model``, plus the embedding (``first_stage``) and head and loss
    (``last_stage``). ``forward(x, targets)``: tokens or hidden states in; hidden states, or the loss (the
    logits when ``targets`` is None) out. Hidden states hold 1/``seq_shards`` of the sequence (SP)."""

    def __init__(self, model: Transformer, layers: range, first_stage: bool, last_stage: bool,
                 seq_shards: int = 1):
        super().__init__()
        self.index_range, self.seq_shards = layers, seq_shards
        self.tok_embeddings = model.tok_embeddings if first_stage else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layers})
        self.norm = model.norm if last_stage else None
        self.output = model.output if last_stage else None
        self.loss = model.loss if last_stage else None
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    @property
    def is_last(self) -> bool:
        return self.output is not None

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if self.tok_embeddings is not None:
            seq, h = x.shape[1], self.tok_embeddings(x)
        else:
            seq, h = x.shape[1] * self.seq_shards, x
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if self.output is None:
            return h
        logits = self.output(self.norm(h))
        return logits if targets is None else self.loss(logits, targets)


def build_stages(model: Transformer, bounds: list[int], wanted: list[tuple[int, int]],
                 seq_shards: int = 1) -> dict[int, Stage]:
    """The stages ``wanted`` as (path, stage) pairs, keyed by stage; ``bounds[s]..bounds[s+1]`` are stage
    ``s``'s layers. Path 1 (DualPipe's reverse direction) gets its own copy of the parameters."""
    num_stages = len(bounds) - 1
    stages = {}
    for path, s in wanted:
        stage = Stage(model, range(bounds[s], bounds[s + 1]), s == 0, s == num_stages - 1, seq_shards)
        stages[s] = copy.deepcopy(stage) if path else stage
    return stages


def stage_of_parameter(name: str, bounds: list[int]) -> int:
    """The stage holding plain-model parameter ``name`` under layer ``bounds``."""
    if name.startswith("tok_embeddings."):
        return 0
    if name.startswith("layers."):
        layer = int(name.split(".")[1])
        return next(s for s in range(len(bounds) - 1) if bounds[s] <= layer < bounds[s + 1])
    return len(bounds) - 2
