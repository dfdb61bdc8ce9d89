"""Tied input embedding and output head (``tie_embeddings``, Press and Wolf 2017; Hugging Face's
``tie_word_embeddings``) under every layout: one weight, one optimizer entry, counted once in the gradient norm.

* One stage (local, DDP, tensor/sequence, context and expert parallelism, and every sharding engine): the model's
  head *is* the embedding's parameter (:class:`parallelisms.model.Transformer`), so autograd sums both uses'
  gradients into it and every engine sees it once. Under tensor parallelism the vocabulary-parallel embedding
  and the column-parallel head split the (padded) vocabulary alike, so they share one shard (:func:`tie`). A
  sharding engine (ZeRO, FSDP flat, per-parameter or buffer reuse) holds it in the embedding's unit and serves
  the head from that unit's gathered weight (:func:`shared_uses` finds the head): one shard set, and the two
  uses' gradients summed by autograd before the reduce-scatter.
* Pipeline parallelism (Megatron-LM's embedding group): the first stage holds the embedding and the last the
  head, each its own copy of the weight (:func:`untie`, before the cut). After the layout's reductions the two
  ranks (pipeline ranks ``r`` and ``pp - 1 - r``) exchange their gradient boxes and both add, so each copy's
  optimizer entry gets the same gradient and AdamW makes the same update on both; the head's copy is left out of
  the gradient norm, so the weight counts once. A stage's sharding engine wraps the head's copy in a unit of its
  own, sharded as the embedding's (:func:`parallelisms.parallel.wrap.module_units`). A rank holding both ends (a
  V-shaped schedule) holds both copies and adds them in place; only the embedding's is an optimizer parameter
  there: the head's boxes are left out of :meth:`TiedEmbeddings.placements` (so of the optimizer and the
  checkpoint) and set to the embedding's in :meth:`TiedEmbeddings.after_step`. A head copy on a rank without
  the embedding is placed under the embedding's name, so checkpoints hold the weight once
  (``tok_embeddings.weight``) whatever the layout.

:class:`TiedEmbeddings` wraps the layout's gradient sync (any ``GradSync``). It finds the copies through
``placements()``: the boxes of ``tok_embeddings.weight`` and of ``output.weight`` that each optimizer parameter
holds (every engine shards the two alike).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from parallelisms.comm import Comms
from parallelisms.parallel.common import SHARD_ATTR

EMBEDDING, HEAD = "tok_embeddings.weight", "output.weight"


def tie(model: nn.Module) -> None:
    """Make ``model``'s head (when it also holds the embedding) the embedding's own parameter."""
    if model.cfg.tie_embeddings and model.tok_embeddings is not None and model.output is not None:
        assert model.output.weight.shape == model.tok_embeddings.weight.shape
        model.output.weight = model.tok_embeddings.weight


def shared_uses(model: nn.Module, modules: list[nn.Module], owned=lambda param: True) -> list[tuple]:
    """The modules of ``model`` outside ``modules`` that hold one of their (``owned``) parameters too, as
    (module, attribute, parameter): the output head holding the tied embedding, which a sharding engine serves
    from the embedding unit's gathered weight (one shard set, one gradient)."""
    inside = {id(sub) for module in modules for sub in module.modules()}
    params = {id(p) for module in modules for p in module.parameters() if owned(p)}
    return [(module, attr, p) for module in model.modules() if id(module) not in inside
            for attr, p in module._parameters.items() if p is not None and id(p) in params]


def untie(model: nn.Module) -> None:
    """Give ``model``'s head a copy of the tied weight of its own (its tensor-parallel marks kept): the
    pipeline's last stage and the sharding engines' head unit hold the head apart from the embedding."""
    if model.cfg.tie_embeddings and model.output.weight is model.tok_embeddings.weight:
        weight = model.tok_embeddings.weight
        copy = nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad)
        if hasattr(weight, SHARD_ATTR):
            setattr(copy, SHARD_ATTR, getattr(weight, SHARD_ATTR))
        model.output.weight = copy


class TiedEmbeddings:
    """``inner`` (a ``GradSync``) with the embedding's and head's copies' gradients summed in :meth:`finish`, the
    head left out of :meth:`grad_norm`, and a local head copy out of :meth:`placements` and refreshed in
    :meth:`after_step`; every other call goes to ``inner``."""

    def __init__(self, inner, comms: Comms):
        self.inner, self.comms = inner, comms
        ends: dict[str, dict] = {EMBEDDING: {}, HEAD: {}}
        for param, pieces in inner.placements():
            for piece in pieces:
                if piece.name in ends:  # a box -> (optimizer parameter, its flat element range)
                    span = (param, piece.flat_lo, piece.flat_lo + math.prod(piece.box_shape))
                    ends[piece.name].setdefault((piece.offsets, piece.sizes), span)
        embedding, head = ends[EMBEDDING], ends[HEAD]
        both = embedding.keys() & head.keys()
        self.local = [(embedding[box], head[box]) for box in sorted(both)]
        pp = comms["pp"]
        # one stage: a head without a copy of its own is the embedding's parameter (nothing to exchange)
        self.remote = [spans[box] for spans in (embedding, head) for box in sorted(spans.keys() - both)
                       if pp.size > 1]
        assert pp.size > 1 or head.keys() <= both, "a tied head copy without its embedding outside pipelines"
        self.heads = list(head.values())
        self.copies = {id(param) for _, (param, _, _) in self.local}  # head copies the optimizer leaves out
        for param, pieces in inner.placements():
            assert id(param) not in self.copies or all(piece.name == HEAD for piece in pieces), \
                "a head copy shares an optimizer parameter with other weights"
        self.peer = pp.size - 1 - pp.rank  # the first and last stages' ranks mirror each other

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @staticmethod
    def _grad(span) -> torch.Tensor | None:
        param, lo, hi = span
        return None if param.grad is None else param.grad.view(-1)[lo:hi]

    def placements(self) -> list:
        """The inner placements without the local head copies, other head boxes named as the embedding's."""
        return [(param, [dataclasses.replace(pc, name=EMBEDDING) if pc.name == HEAD else pc for pc in pieces])
                for param, pieces in self.inner.placements() if id(param) not in self.copies]

    @torch.no_grad()
    def finish(self) -> None:
        """The layout's reductions, then each copy's gradient becomes the sum of both."""
        self.inner.finish()
        for embedding, head in self.local:
            e, h = self._grad(embedding), self._grad(head)
            e.add_(h)
            h.copy_(e)
        if self.remote:
            mine = [self._grad(span) for span in self.remote]
            theirs = [torch.empty_like(g) for g in mine]
            self.comms["pp"].send_recv(sends=[(g, self.peer) for g in mine],
                                       recvs=[(t, self.peer) for t in theirs]).wait()
            for g, t in zip(mine, theirs):
                g.add_(t)

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """The inner norm with the head's copy zeroed: the tied weight counts once."""
        saved = [(g, g.clone()) for g in map(self._grad, self.heads) if g is not None]
        for g, _ in saved:
            g.zero_()
        norm = self.inner.grad_norm()
        for g, copy in saved:
            g.copy_(copy)
        return norm

    @torch.no_grad()
    def after_step(self) -> None:
        """The local head copies take the embedding's updated (or loaded) values, then the inner after-step."""
        for (e, e_lo, e_hi), (h, h_lo, h_hi) in self.local:
            h.detach().view(-1)[h_lo:h_hi].copy_(e.detach().view(-1)[e_lo:e_hi])
        self.inner.after_step()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The inner full state, the head under its own name too where it is the embedding's parameter."""
        state = self.inner.full_state_dict()
        if EMBEDDING in state and HEAD not in state and self.comms["pp"].size == 1:
            state[HEAD] = state[EMBEDDING]
        return state
