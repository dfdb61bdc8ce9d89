"""The wrapping units the sharding engines cut a model (or a pipeline stage) into, in forward order: FSDP's wrapping
policy for this transformer (Zhao et al. 2023), shared by the flat engine (:mod:`parallelisms.parallel.flat`,
ZeRO and FSDP1 styles) and per-parameter sharding (:mod:`parallelisms.parallel.fsdp2`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free at load: the performance model reads merged_units
    from torch import nn


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
    sizes = [sum(p.numel() * p.element_size() for m in modules for p in m.parameters()) for _, modules in units]
    return [("+".join(units[i][0] for i in group), [m for i in group for m in units[i][1]])
            for group in merged_units(sizes, cap_bytes, [name in alone for name, _ in units])]


def merged_units(sizes: list[float], cap_bytes: float, alone: list[bool]) -> list[list[int]]:
    """Consecutive units of ``sizes`` bytes merged while the merged unit fits under ``cap_bytes`` (none merge with a
    unit ``alone``), as the indices of each merged unit: :func:`gradient_buckets` over the units."""
    return gradient_buckets(sizes, cap_bytes, [("alone", i) if one else None for i, one in enumerate(alone)])


def gradient_buckets(sizes: list[float], cap_bytes: float, keys: list | None = None,
                     first_cap_bytes: float | None = None) -> list[list[int]]:
    """Gradients of ``sizes`` bytes, in the order backward makes them, cut into buckets of consecutive ones (the
    indices of each): a bucket closes before a gradient that would take it over ``cap_bytes`` (the first bucket
    over ``first_cap_bytes`` where that is smaller) or whose key differs (``keys``: what a bucket must share, DDP's
    dtype, device and reducing group); a gradient larger than the cap is a bucket alone. DDP cuts its parameters
    so (:mod:`parallelisms.parallel.data`, Li et al. 2020), ZeRO-1/2 their wrapping units (:func:`merged_units`), and
    the performance model the parameter sizes it prices."""
    keys = keys or [None] * len(sizes)
    buckets, total = [], 0.0
    for i, size in enumerate(sizes):
        cap = cap_bytes if len(buckets) > 1 or first_cap_bytes is None else min(cap_bytes, first_cap_bytes)
        if buckets and total + size <= cap and keys[i] == keys[buckets[-1][0]]:
            buckets[-1].append(i)
            total += size
        else:
            buckets.append([i])
            total = size
    return buckets


def split_expert_units(units: list[tuple[str, list[nn.Module]]]) -> list[tuple]:
    """``units`` as (name, modules, owned, experts): a unit holding expert weights (marked sharded over ``ep``:
    they differ between expert-parallel ranks) becomes two, its other weights (``owned`` picks them) and its
    expert weights (``experts`` True), which the engines shard over the ranks holding the same experts,
    ``ep_replicate``, instead of the data-parallel dimension."""
    from parallelisms.parallel.common import sharded_over

    out = []
    for name, modules in units:
        if any("ep" in sharded_over(p) for m in modules for p in m.parameters()):
            out.append((name, modules, lambda p: "ep" not in sharded_over(p), False))
            out.append((f"{name}.experts", modules, lambda p: "ep" in sharded_over(p), True))
        else:
            out.append((name, modules, lambda p: True, False))
    return out
