"""Pipeline stages cut from the plain model (GPipe, Huang et al. 2019: consecutive layers per stage).

A stage is the model itself (:meth:`Transformer.stage`): stage 0 holds the token embedding, the last stage
the final norm, the output head and the loss, every stage a contiguous range of blocks under the plain
model's parameter names (``layers.5.attention.wq.weight``), so the full model is reassembled by name across
pipeline ranks. Stages share the plain model's modules (no copy) unless asked for a copy (DualPipe's second
direction), whose parameters keep the originals' sharding marks (tensor, expert parallelism). Whatever was applied to the model before the cut (tensor, sequence, context parallelism,
recomputation) is what each stage runs.
"""

from __future__ import annotations

import copy

import torch

from parallelisms.comm import Comm
from parallelisms.model.transformer import Transformer
from parallelisms.parallel.common import SHARD_ATTR


def build_stages(model: Transformer, bounds: list[int], wanted: list[tuple[int, int]]) -> dict[int, Transformer]:
    """The stages ``wanted`` as (path, stage) pairs, keyed by stage; ``bounds[s]..bounds[s+1]`` are stage
    ``s``'s layers. Path 1 (DualPipe's reverse direction) gets its own copy of the parameters."""
    num_stages = len(bounds) - 1
    stages = {}
    for path, s in wanted:
        stage = model.stage(range(bounds[s], bounds[s + 1]), s == 0, s == num_stages - 1)
        stages[s] = _copy_with_marks(stage) if path else stage
    return stages


def _copy_with_marks(stage: Transformer) -> Transformer:
    """A deep copy of ``stage`` whose parameters carry the originals' :func:`mark_sharded` marks (a copied
    ``nn.Parameter`` drops its Python attributes)."""
    copied = copy.deepcopy(stage)
    for original, param in zip(stage.parameters(), copied.parameters()):
        if hasattr(original, SHARD_ATTR):
            setattr(param, SHARD_ATTR, getattr(original, SHARD_ATTR))
    return copied


def stage_of_parameter(name: str, bounds: list[int]) -> int:
    """The stage holding plain-model parameter ``name`` under layer ``bounds``."""
    if name.startswith("tok_embeddings."):
        return 0
    if name.startswith("layers."):
        layer = int(name.split(".")[1])
        return next(s for s in range(len(bounds) - 1) if bounds[s] <= layer < bounds[s + 1])
    return len(bounds) - 2


def add_mirror_copies(pp: Comm, tensors: list[torch.Tensor]) -> None:
    """DualPipe's two copies of a stage: rank r and rank pp-1-r hold the same two stages, and ``tensors``
    (their gradients, in the same order on both) become the sum of both ranks' (a batched exchange)."""
    peer = pp.size - 1 - pp.rank
    theirs = [torch.empty_like(t) for t in tensors]
    pp.send_recv(sends=[(t, peer) for t in tensors], recvs=[(t, peer) for t in theirs]).wait()
    for mine, other in zip(tensors, theirs):
        mine.add_(other)
