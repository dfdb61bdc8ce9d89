"""Where the expert slots of a layer under ``--ep-balance measured`` live in the optimizer's parameters, for every
engine that lays them out: DDP's own slot tensors; the flat buffers of ZeRO-1/2/3, the flat FSDP strategies and
bf16 mixed precision (:mod:`parallelisms.parallel.flat`) and of buffer reuse (:mod:`parallelisms.parallel.yafsdp`);
or per-parameter FSDP's dim-0 rows (:mod:`parallelisms.parallel.fsdp2`). In every sharding engine a block's expert
weights are a unit of their own, sharded over ``ep_replicate``, the ranks holding the same slots.

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
    """The holders of ``module``'s (a ``BalancedExperts``) three weights: in a flat engine's unit (ZeRO, flat FSDP,
    bf16 over DDP), a buffer-reuse unit's flat shard, or a per-parameter unit's dim-0 rows where one holds them,
    else the module's own parameters (DDP and plain local gradients)."""
    for engine in engines:
        for unit in getattr(engine, "units", ()):
            if hasattr(unit, "slots"):  # the flat engine: the weights run back to back in the unit's buffer
                found = {attr: i for i, (_, owner, attr, _) in enumerate(unit.slots)
                         if owner is module and attr in WEIGHTS}
                param, numels, chunk = unit.shard, unit.numels, unit.shard_numel
            else:  # per-parameter (FSDP2) and buffer-reuse (YaFSDP) units: (owner, attribute, parameter) entries
                found = {attr: i for i, (owner, attr, _) in enumerate(unit.entries)
                         if owner is module and attr in WEIGHTS}
                param, numels, chunk = unit.flat_param, [s.numel() for s in unit.shapes], unit.shard.numel()
            if not found:
                continue
            if param is None:  # per-parameter: each weight is its own optimizer parameter, its dim-0 rows here
                return [_rows_holder(unit.entries[found[name]][2], numels[found[name]] // module.local, unit.comm)
                        for name in WEIGHTS]
            lo = unit.comm.rank * chunk
            return [Holder(param, sum(numels[:found[name]]), numels[found[name]] // module.local, lo, lo + chunk,
                           unit.comm) for name in WEIGHTS]
    return [Holder(p, 0, p[0].numel(), 0, p.numel()) for p in (getattr(module, name) for name in WEIGHTS)]


def _rows_holder(param: torch.nn.Parameter, per_slot: int, comm) -> Holder:
    """A weight sharded by dim-0 rows over ``comm`` (equal padded chunks of its flattened elements)."""
    return Holder(param, 0, per_slot, comm.rank * param.numel(), (comm.rank + 1) * param.numel(), comm)


def engines_of(grad_sync) -> list:
    """The engines under a gradient sync: a pipeline's one per stage, else the sync itself."""
    return list(grad_sync.engines.values()) if hasattr(grad_sync, "engines") else [grad_sync]
