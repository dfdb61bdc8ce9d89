"""Tied input embedding and output head (``tie_embeddings``, Press and Wolf 2017; Hugging Face's
``tie_word_embeddings``) under every layout, kept as Megatron-LM keeps them under pipeline parallelism: the
embedding and the head are two copies of one weight, started equal, whose gradients are summed (Megatron's
embedding group all-reduces the word-embedding gradient between the first and the last stage), counted once
in the gradient norm and stepped alike, so both stay the one weight a tied model trains.

:class:`TiedEmbeddings` wraps the layout's gradient sync (any ``GradSync``). It finds the two copies through
``placements()``: the boxes of ``tok_embeddings.weight`` and of ``output.weight`` that each optimizer parameter
holds. Every engine shards the two alike (tensor parallelism splits both by vocabulary rows; the sharding
engines give the head a unit of its own, :func:`parallelisms.parallel.flat.module_units`), so a rank holding
both copies holds the same boxes of each and adds them in place; under pipeline parallelism the first stage's
rank and the last stage's (pipeline ranks ``r`` and ``pp - 1 - r``) exchange their boxes over ``comms["pp"]``
and both add. The gradient norm is taken with the head's boxes zeroed, so the weight counts once, and after
the optimizer step the head's boxes are set to the embedding's wherever one rank holds both (they are equal
already: the same gradient and the same AdamW arithmetic; this keeps them bit-equal).
"""

from __future__ import annotations

import math

import torch

from parallelisms.comm import Comms

EMBEDDING, HEAD = "tok_embeddings.weight", "output.weight"


class TiedEmbeddings:
    """``inner`` (a ``GradSync``) with the embedding and head copies' gradients summed in :meth:`finish` and the
    head left out of :meth:`grad_norm`; every other call goes to ``inner``."""

    def __init__(self, inner, comms: Comms):
        self.inner, self.comms = inner, comms
        ends: dict[str, dict] = {EMBEDDING: {}, HEAD: {}}
        for param, pieces in inner.placements():
            for piece in pieces:
                if piece.name in ends:  # a box -> (optimizer parameter, its flat element range)
                    span = (param, piece.flat_lo, piece.flat_lo + math.prod(piece.box_shape))
                    ends[piece.name].setdefault((piece.offsets, piece.sizes), span)
        embedding, head = ends[EMBEDDING], ends[HEAD]
        self.local = [(embedding[box], head[box]) for box in sorted(embedding.keys() & head.keys())]
        self.remote = [spans[box] for spans in (embedding, head) for box in sorted(spans.keys() - (embedding.keys()
                                                                                                    & head.keys()))]
        self.heads = list(head.values())
        pp = comms["pp"]
        assert not self.remote or pp.size > 1, "a tied copy without its peer outside pipeline parallelism"
        self.peer = pp.size - 1 - pp.rank  # the first and last stages' ranks mirror each other

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @staticmethod
    def _grad(span) -> torch.Tensor | None:
        param, lo, hi = span
        return None if param.grad is None else param.grad.view(-1)[lo:hi]

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

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """After each step of ``optimizer``, set the head's boxes to the embedding's on this rank."""
        optimizer.register_step_post_hook(lambda *_: self._copy_weights())

    @torch.no_grad()
    def _copy_weights(self) -> None:
        for (e, e_lo, e_hi), (h, h_lo, h_hi) in self.local:
            h.detach().view(-1)[h_lo:h_hi].copy_(e.detach().view(-1)[e_lo:e_hi])
