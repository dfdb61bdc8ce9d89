"""Where the expert slots of a layer under ``--ep-balance measured`` live in the optimizer's parameters, for every
engine that lays them out: DDP's own slot tensors, or the flat buffers of ZeRO-1/2/3, the flat FSDP strategies and
bf16 mixed precision (:mod:`parallelisms.parallel.flat`: a block's expert weights are a unit of their own, sharded
over ``ep_replicate``, the ranks holding the same slots).

A :class:`Holder` is one expert weight of one layer (``w_gate``, ``w_up`` or ``w_down``, shaped [slots, ...]): the
optimizer parameter that holds it (the weight itself, or its unit's flat shard), the positions of each slot's
elements in that parameter's full flat buffer, and this rank's range ``[lo, hi)`` of it. Each slot's elements are
contiguous and laid out alike on every expert-parallel rank, so an expert's copies line up element by element.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

WEIGHTS = ("w_gate", "w_up", "w_down")


@dataclass
class Holder:
    param: torch.nn.Parameter  # the optimizer's parameter (AdamW's state is shaped like it)
    start: int                 # the weight's first element in the parameter's full flat buffer
    per_slot: int              # elements per slot
    lo: int                    # this rank's range of the full flat buffer
    hi: int
    comm: object = None        # the ranks holding the other ranges (a flat unit's shard group), None: whole

    def span(self, slot: int) -> tuple[int, int, int]:
        """(first element of ``slot`` inside this rank's range, its offset in the slot, count); count 0: none."""
        a = max(self.start + slot * self.per_slot, self.lo)
        b = min(self.start + (slot + 1) * self.per_slot, self.hi)
        return a - self.lo, a - self.start - slot * self.per_slot, max(0, b - a)

    def rows(self, tensor: torch.Tensor, slots: int) -> torch.Tensor:
        """``tensor`` (the parameter or state shaped like it) as [slots, per_slot]: gathered over ``comm``."""
        flat = tensor.detach().reshape(-1)
        if self.comm is not None and self.comm.size > 1:
            flat = self.comm.all_gather(flat.contiguous())
        else:
            flat = torch.cat([flat.new_zeros(self.lo), flat])
        return flat[self.start:self.start + slots * self.per_slot].reshape(slots, self.per_slot).clone()

    def put(self, tensor: torch.Tensor, rows: torch.Tensor) -> None:
        """Write ``rows`` ([slots, per_slot]) into this rank's range of ``tensor``."""
        flat = tensor.detach().reshape(-1)
        for slot in range(rows.shape[0]):
            at, within, count = self.span(slot)
            if count:
                flat[at:at + count].copy_(rows[slot, within:within + count])


def holders(module, engines) -> list[Holder]:
    """The holders of ``module``'s (a ``BalancedExperts``) three weights: in a flat engine's unit where one holds
    them, else the module's own parameters (DDP and plain local gradients)."""
    for engine in engines:
        for unit in getattr(engine, "units", ()):
            found = {attr: i for i, (_, owner, attr, _) in enumerate(getattr(unit, "slots", ()))
                     if owner is module and attr in WEIGHTS}
            if found:
                lo = unit.comm.rank * unit.shard_numel
                return [Holder(unit.shard, sum(unit.numels[:found[name]]), unit.numels[found[name]] // module.local,
                               lo, lo + unit.shard_numel, unit.comm) for name in WEIGHTS]
    out = []
    for name in WEIGHTS:
        p = getattr(module, name)
        out.append(Holder(p, 0, p[0].numel(), 0, p.numel()))
    return out


def engines_of(grad_sync) -> list:
    """The engines under a gradient sync: a pipeline's one per stage, else the sync itself."""
    return list(grad_sync.engines.values()) if hasattr(grad_sync, "engines") else [grad_sync]
