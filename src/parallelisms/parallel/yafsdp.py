"""Buffer reuse in the style of YaFSDP (Yandex 2024): two preallocated full-weight buffers and two
gradient buffers, used round-robin by alternating units, gradients accumulated straight into the buffer
the reduce-scatter sends.

The layout is flat, as in YaFSDP and FSDP1: a unit's parameters are concatenated (padded to a multiple
of N) and rank r owns the r-th contiguous chunk. The all-gather of a unit therefore lands the unit's
parameters, in order, in weight buffer ``index % 2``; the full parameters are views into it, with no
copy-out and no allocation. As in YaFSDP, the optimizer updates one flat shard per unit (a few large
tensors instead of many small ones: a third fewer allocator calls per step than per-parameter AdamW
here); the model's own ``nn.Parameter`` objects stay registered, each holding the (possibly empty) 1-D
piece of this rank's chunk that belongs to it (FSDP1's ``use_orig_params``), so ``state_dict`` keys
are the plain model's.

In backward, before a unit's first gradient accumulates, gradient buffer ``index % 2`` is reclaimed
(waiting for the reduce-scatter of the unit two places later), zeroed, and each full leaf's ``.grad`` is
pointed at its slice, so autograd's accumulation adds into the communication buffer itself. A buffer
still holding a unit (the last ones of forward) is not gathered again in backward. Everything else (the
hooks, saved-tensor references, prefetch, waits) is the engine of :mod:`parallelisms.parallel.fsdp2`.

Buffers are sized for the largest unit's local parameters, so under tensor parallelism they hold the
tensor-parallel shards (the gradient norm splits a flat shard into its tensor-parallel and replicated
runs). A pipeline stage (:meth:`ReuseSharding.hold_through_step`) keeps every unit gathered from its first forward to the
end of its last backward, so there each unit has a buffer pair of its own, allocated at the first step and
reused by every later one; its gradient buffer is zeroed and handed to the leaves at the first forward of
the step, so autograd's accumulation and the deferred weight gradients of a split backward (which add to
the leaf's ``.grad``) both land in the buffer the step's one reduce-scatter sends.

Mixed precision: the weight buffers are bf16 and the gradient buffers fp32, so a gradient buffer is the unit's
main grad (Megatron's): each leaf's bf16 gradient is added into its slice right after autograd accumulates it,
and the buffer is divided and reduce-scattered in fp32. With expert parallelism a block's expert weights are a
unit of their own that runs alongside the block's dense unit, so expert units alternate over a second pair of
buffers (sized for them).
"""

from __future__ import annotations

import torch
from torch import nn

from parallelisms.comm import Comms
from parallelisms.parallel.common import SHARD_ATTR, mark_sharded
from parallelisms.parallel.fsdp2 import PerParamSharding
from parallelisms.parallel.shard_units import Unit
from parallelisms.parallel.placement import flat_pieces


class ReuseSharding(PerParamSharding):
    """Flat per-unit shards, two weight buffers and two gradient buffers for all units (FULL_SHARD; two more
    for expert units); one pair per unit when held through the step (a pipeline stage)."""

    def __init__(self, model: nn.Module, comms: Comms, dim: str = "dp_shard", compute_dtype: torch.dtype | None = None):
        super().__init__(model, comms, dim, reshard_after_forward=True, compute_dtype=compute_dtype)
        # dense units alternate over a pair of buffers and expert units (which run alongside their block's dense
        # unit, over ``ep_replicate``) over a pair of their own; a unit another module uses too (a tied embedding,
        # gathered from its forward to the head's backward) holds a slot of its own after those
        kinds = [2 if unit.aliases else int(unit.comm is not self.comm) for unit in self.units]
        self._assign_slots([2 * k + sum(kinds[j] == k for j in range(i)) % 2 if k < 2 else 4 + kinds[:i].count(2)
                            for i, k in enumerate(kinds)])

    def _assign_slots(self, slot_of: list[int]) -> None:
        """The buffer slot of each unit; buffers are allocated at their first use."""
        self.slot_of = slot_of
        slots = max(slot_of) + 1
        self.weight_buffers: list[torch.Tensor | None] = [None] * slots
        self.grad_buffers: list[torch.Tensor | None] = [None] * slots
        self.owners: list[Unit | None] = [None] * slots
        self.slot_numel = [max((u.shard.numel() * u.comm.size for u in self.units if self.slot_of[u.index] == slot),
                               default=0) for slot in range(slots)]  # a shared slot: sized for its largest unit

    def hold_through_step(self) -> None:
        """Held units stay gathered through the step: each has a buffer pair of its own (set before any use)."""
        assert all(b is None for b in self.weight_buffers + self.grad_buffers), "set before the first forward"
        super().hold_through_step()
        self._assign_slots(list(range(len(self.units))))

    # -- layout --------------------------------------------------------------------------------------------
    def _shard(self, unit: Unit) -> None:
        """Concatenate, pad to N equal chunks, keep chunk ``rank``; each parameter views its piece of it."""
        total = sum(s.numel() for s in unit.shapes)
        chunk = -(-total // unit.comm.size)
        start = unit.comm.rank * chunk
        like = unit.entries[0][2]
        unit.shard = torch.zeros(chunk, dtype=like.dtype, device=like.device)
        offset = 0
        for (_, _, p), shape in zip(unit.entries, unit.shapes):
            lo, hi = max(offset, start), max(min(offset + shape.numel(), start + chunk), start)
            piece = unit.shard[lo - start:max(hi, lo) - start]
            piece.copy_(p.detach().reshape(-1)[lo - offset:max(hi, lo) - offset])
            p.data = piece
            mark_sharded(p, unit.comm.name, None)
            offset += shape.numel()
        unit.flat_param = mark_sharded(nn.Parameter(unit.shard), unit.comm.name, None)

    def parameters(self) -> list[nn.Parameter]:
        """One flat shard per unit (sharing storage with the model's parameters)."""
        return [unit.flat_param for unit in self.units]

    def placements(self) -> list:
        """Each unit's flat shard with the boxes of the parameters its chunk covers (the flat layout's)."""
        names = {id(p): name for name, p in self.model.named_parameters()}
        out = []
        for unit in self.units:
            params = [p for _, _, p in unit.entries]
            lo = unit.comm.rank * unit.shard.numel()
            out.append((unit.flat_param, flat_pieces([names[id(p)] for p in params], unit.shapes,
                                                     [getattr(p, SHARD_ATTR, ()) for p in params], self.comms,
                                                     lo, lo + unit.shard.numel())))
        return out

    def _attach_grads(self, unit: Unit) -> None:
        super()._attach_grads(unit)
        unit.flat_param.grad = unit.grad

    def _slot(self, unit: Unit) -> int:
        return self.slot_of[unit.index]

    def _buffer(self, buffers: list, kind: str, unit: Unit) -> torch.Tensor:
        """Weight buffers in the compute dtype, gradient buffers in the shards' (fp32 under mixed precision:
        the buffer is then the unit's main grad, which the reduce-scatter sends)."""
        slot = self._slot(unit)
        if buffers[slot] is None:
            buffers[slot] = self.stats.allocate(kind, self.slot_numel[slot], unit.shard,
                                                self.compute_dtype if kind == "weight" else None)
        return buffers[slot][:unit.shard.numel() * unit.comm.size]

    def _gather_destination(self, unit: Unit) -> torch.Tensor:
        slot = self._slot(unit)
        previous = self.owners[slot]
        if previous is not None and previous is not unit:
            previous.full = previous.full_storage = None
        self.owners[slot] = unit
        return self._buffer(self.weight_buffers, "weight", unit)

    def _unflatten(self, unit: Unit, gathered: torch.Tensor, full: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The full parameters are views into the gathered buffer (no copy)."""
        out, offset = [], 0
        for shape in unit.shapes:
            out.append(gathered[offset:offset + shape.numel()].view(shape))
            offset += shape.numel()
        return out

    def _materialize(self, unit: Unit) -> None:
        unit.full_storage = self.weight_buffers[self._slot(unit)]
        unit.full, unit.gathered = self._unflatten(unit, unit.gathered), None

    def _release(self, unit: Unit, stale: bool = False) -> None:
        """The buffer keeps the unit until another unit takes it over, unless its shards changed."""
        if stale:
            unit.full = unit.full_storage = None
            if self.owners[self._slot(unit)] is unit:
                self.owners[self._slot(unit)] = None

    # -- gradients -------------------------------------------------------------------------------------
    def _prepare_grads(self, unit: Unit) -> None:
        """Reclaim and zero this unit's gradient buffer; point every full leaf's ``.grad`` into it (mixed
        precision: the buffer is the fp32 main grad, which each leaf's gradient is added into by its hook)."""
        buffer = self._buffer(self.grad_buffers, "grad", unit)
        for entry in list(self._pending_grads):  # the reduce-scatter still reading this buffer
            if entry[3].untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr():
                self._pending_grads.remove(entry)
                self._complete(entry)
        buffer.zero_()
        if self.mixed:
            unit.main_grad = buffer
            return
        for leaf, piece in zip(unit.leaves, self._pieces(unit, buffer)):
            leaf.grad = piece

    def _pieces(self, unit: Unit, buffer: torch.Tensor) -> list[torch.Tensor]:
        """``buffer`` (the unit's layout: its parameters back to back) as one view per parameter."""
        return [piece.view(shape) for piece, shape in
                zip(buffer[:sum(s.numel() for s in unit.shapes)].split([s.numel() for s in unit.shapes]), unit.shapes)]

    def _main_grad(self, unit: Unit) -> torch.Tensor:
        if not unit.grads_prepared:  # the first gradient of the unit (non-held: after its forward)
            unit.grads_prepared = True
            self._prepare_grads(unit)
        return unit.main_grad

    def _add_to_main_grad(self, unit: Unit, index: int, grad: torch.Tensor) -> None:
        self._pieces(unit, self._main_grad(unit))[index].add_(grad)

    def _grad_send_buffer(self, unit: Unit) -> torch.Tensor:
        if not unit.grads_prepared:  # no gradient reached this unit: send zeros
            self._prepare_grads(unit)
        if self.mixed:
            self._flush_main_grad(unit)
            unit.main_grad = None
        for leaf in unit.leaves:
            leaf.grad = None
        return self._buffer(self.grad_buffers, "grad", unit)

    def _grad_sent(self, send: torch.Tensor) -> None:
        """The gradient buffers are kept for the next units."""

    def persistent_bytes(self) -> dict[str, int]:
        report = super().persistent_bytes()
        report["buffers"] = sum(b.numel() * b.element_size() for b in self.weight_buffers + self.grad_buffers
                                if b is not None)
        return report
