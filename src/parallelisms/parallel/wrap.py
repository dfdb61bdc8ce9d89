"""The wrapping units the sharding engines cut a model (or a pipeline stage) into, in forward order: FSDP's wrapping
policy for this transformer (Zhao et al. 2023), shared by the flat engine (:mod:`parallelisms.parallel.flat`,
ZeRO and FSDP1 styles) and per-parameter sharding (:mod:`parallelisms.parallel.fsdp2`)."""

from __future__ import annotations

from torch import nn

from parallelisms.parallel.common import sharded_over


def module_units(model: nn.Module, cap_bytes: int | None = None) -> list[tuple[str, list[nn.Module]]]:
    """The wrapping units of the transformer (or pipeline stage) in forward order: embedding, each block,
    head (norm + output; with tied embeddings the norm alone, the output using the embedding's unit, or, holding a
    copy of the tied weight, a unit of its own).

    With ``cap_bytes``, consecutive units are merged while their parameters fit under it: gradient
    buckets in the sense of DDP (ZeRO-1/2 communicate a unit's gradient as one bucket)."""
    units = [("tok_embeddings", [model.tok_embeddings])] if model.tok_embeddings is not None else []
    units += [(f"layers.{i}", [block]) for i, block in model.layers.items()]
    # tied: a head that is the embedding's parameter uses the embedding unit (FlatUnit's aliases); a head's copy
    # of it (a pipeline's last stage) is a unit alone, sharded as the embedding is (parallelisms.parallel.tied)
    tied = model.cfg.tie_embeddings
    one = tied and None not in (model.tok_embeddings, model.output) and model.output.weight is model.tok_embeddings.weight
    if model.output is not None:  # a pipeline stage holds the embedding or the head only where it lives
        units += ([("head", [model.norm])] if one else [("head", [model.norm]), ("output", [model.output])] if tied
                  else [("head", [model.norm, model.output])])
    if cap_bytes is None:
        return units
    alone = {"tok_embeddings", "output"} if tied else set()  # never merged (parallelisms.parallel.tied)
    merged, sizes = [], []
    for name, modules in units:
        size = sum(p.numel() * p.element_size() for m in modules for p in m.parameters())
        if merged and sizes[-1] + size <= cap_bytes and not {name, merged[-1][0]} & alone:
            merged[-1] = (f"{merged[-1][0]}+{name}", merged[-1][1] + modules)
            sizes[-1] += size
        else:
            merged.append((name, list(modules)))
            sizes.append(size)
    return merged


def split_expert_units(units: list[tuple[str, list[nn.Module]]]) -> list[tuple]:
    """``units`` as (name, modules, owned, experts): a unit holding expert weights (marked sharded over ``ep``:
    they differ between expert-parallel ranks) becomes two, its other weights (``owned`` picks them) and its
    expert weights (``experts`` True), which the engines shard over the ranks holding the same experts,
    ``ep_replicate``, instead of the data-parallel dimension."""
    out = []
    for name, modules in units:
        if any("ep" in sharded_over(p) for m in modules for p in m.parameters()):
            out.append((name, modules, lambda p: "ep" not in sharded_over(p), False))
            out.append((f"{name}.experts", modules, lambda p: "ep" in sharded_over(p), True))
        else:
            out.append((name, modules, lambda p: True, False))
    return out
