"""The shards of per-parameter sharding in the style of FSDP2 (PyTorch ``fully_shard``: every parameter a DTensor
sharded on dim 0; Zhao et al. 2023 for FSDP, the torch 2.4 per-parameter rewrite for FSDP2): their layout, the
all-gather of a unit and the copies around its collectives, which :mod:`parallelisms.parallel.fsdp2` drives.

Each parameter keeps its identity: the ``nn.Parameter`` object the user's optimizer and ``state_dict``
hold stays registered in its module, and its ``.data`` becomes this rank's dim-0 rows (``ceil(d0 / N)``,
zero-padded on the last ranks), a view into one flat per-unit shard buffer so a unit is all-gathered by
one collective without a copy-in. A unit is a transformer block, the embedding, or the final norm plus
output head (:func:`parallelisms.parallel.wrap.module_units`); a block holding expert weights is two units, its
experts sharded over ``ep_replicate`` (:func:`parallelisms.parallel.wrap.split_expert_units`). A gathered unit is
copied out of the rank-major result into full parameters (FSDP2's copy-out); its full gradients are copied in
rank-major order (copy-in) for the reduce-scatter into the unit's flat shard-gradient buffer (``param.grad``
views). :mod:`parallelisms.parallel.yafsdp` overrides this layout with a flat one and two preallocated buffer pairs.

Mixed precision (``compute_dtype=bf16``, FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``): the shards stay fp32 (the optimizer's master weights), each is cast to bf16 before its
all-gather, so the full weights and the compute are bf16; every microbatch's bf16 gradient is added, right
after autograd accumulates it into the leaf, into an fp32 main grad of the unit (Megatron's ``main_grad``;
here the rank-major reduce-scatter input itself, reuse's gradient buffer), which is divided by the
data-parallel size and reduce-scattered in fp32 into the fp32 gradient shards, held through the step or not.
"""

from __future__ import annotations

import torch
from torch import nn

from parallelisms.comm import Comms
from parallelisms.parallel.common import (SHARD_ATTR, gather_full, mark_sharded, norm_dims, norm_of_groups,
                                          norm_pieces, squared_norms_of_pieces)
from parallelisms.parallel.wrap import module_units, split_expert_units
from parallelisms.parallel.memory import engines_memory
from parallelisms.parallel.placement import tensor_pieces
from parallelisms.parallel.row_split import rows_per_rank
from parallelisms.parallel.shard_units import BufferStats, Unit, copy_rows, unit_offsets
from parallelisms.parallel.tied import shared_uses


class PerParamShards:
    """``model``'s units sharded over mesh dimension ``dim`` of ``comms`` (data-parallel; expert weights over
    ``ep_replicate``), each parameter's data its dim-0 rows of the unit's flat shard; gathered in
    ``compute_dtype`` (mixed precision when it differs from the parameters' dtype)."""

    def __init__(self, model: nn.Module, comms: Comms, dim: str, compute_dtype: torch.dtype | None):
        self.model, self.comms = model, comms
        self.comm = comms[dim]
        self.dp_size = self.comm.size  # every gradient is averaged over all data-parallel ranks, experts' too
        param_dtype = next(p for p in model.parameters() if p.requires_grad).dtype
        self.compute_dtype = compute_dtype or param_dtype
        self.mixed = self.compute_dtype != param_dtype
        self.stats = BufferStats()
        self.units = [Unit(i, modules, comms["ep_replicate"] if experts else self.comm, owned,
                           shared_uses(model, modules, owned))
                      for i, (_, modules, owned, experts) in enumerate(split_expert_units(module_units(model)))]
        covered = {id(p) for u in self.units for _, _, p in u.entries}
        missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in covered]
        if missing:
            raise ValueError(f"parameter {missing[0]} is outside every sharding unit ({len(missing)} such)")
        with torch.no_grad():
            for unit in self.units:
                self._shard(unit)
                params = [p for _, _, p in unit.entries]  # their data are this rank's pieces, back to back
                unit.norm_keys = {norm_dims(p) for p in params}
                unit.norm_pieces = norm_pieces(params, 0, unit.shard.numel(), ())

    # -- layout (overridden by the flat, buffer-reusing layout) ------------------------------------------
    @staticmethod
    def _rows(unit: Unit, shape: torch.Size) -> tuple[int, int]:
        """Rows per rank (dim-0 chunk, padded) and elements per row of a parameter of ``shape``."""
        return rows_per_rank(shape[0], unit.comm.size), shape[1:].numel()

    def _shard(self, unit: Unit) -> None:
        """Replace each parameter's data by its dim-0 rows, a view into one flat shard per unit."""
        if any(len(shape) == 0 for shape in unit.shapes):
            raise ValueError("per-parameter sharding needs parameters with at least one dimension")
        sizes = [rows * width for rows, width in (self._rows(unit, shape) for shape in unit.shapes)]
        unit.shard = torch.zeros(sum(sizes), dtype=unit.entries[0][2].dtype, device=unit.entries[0][2].device)
        offset, rank = 0, unit.comm.rank
        for (_, _, p), shape, size in zip(unit.entries, unit.shapes, sizes):
            mine = p.detach().reshape(-1)[rank * size:(rank + 1) * size]
            view = unit.shard[offset:offset + size]
            view[:mine.numel()].copy_(mine)
            p.data = view.view(-1, *shape[1:])
            mark_sharded(p, unit.comm.name, 0, shape[0])
            offset += size

    def _gather_destination(self, unit: Unit) -> torch.Tensor:
        return self.stats.allocate("weight", unit.shard.numel() * unit.comm.size, unit.shard, self.compute_dtype)

    def _unflatten(self, unit: Unit, gathered: torch.Tensor, full: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Copy-out: rank-major gathered rows into ``full``, param-major; the full parameters as views."""
        if full is None:
            full = torch.empty(sum(s.numel() for s in unit.shapes), dtype=gathered.dtype, device=gathered.device)
        ranks = gathered.view(unit.comm.size, -1)
        out, offset = [], 0
        for shard_offset, shape, (_, _, p) in zip(unit_offsets(unit), unit.shapes, unit.entries):
            dst = full[offset:offset + shape.numel()]
            copy_rows(ranks[:, shard_offset:shard_offset + p.numel()], dst, into_ranks=False)
            out.append(dst.view(shape))
            offset += shape.numel()
        return out

    def _materialize(self, unit: Unit) -> None:
        """Gathered shards -> ``unit.full`` (views into ``unit.full_storage``); frees the gather buffer."""
        unit.full_storage = self.stats.allocate("weight", sum(s.numel() for s in unit.shapes), unit.gathered)
        unit.full = self._unflatten(unit, unit.gathered, unit.full_storage)
        self.stats.release("weight", unit.gathered)
        unit.gathered = None

    def _release(self, unit: Unit, stale: bool = False) -> None:
        """Reshard: free the full parameters (the forward leaves are views of them and keep no memory).
        ``stale``: the shards changed since the gather."""
        self.stats.release("weight", unit.full_storage)
        unit.full = unit.full_storage = None

    def _prepare_grads(self, unit: Unit) -> None:
        """Before the unit's first gradient accumulates (the flat layout points grads into its buffer)."""

    def _grad_send_buffer(self, unit: Unit) -> torch.Tensor:
        """Copy-in: the unit's full gradients laid out rank-major for the reduce-scatter (mixed precision:
        the fp32 main grad, which is laid out so)."""
        if self.mixed:
            self._flush_main_grad(unit)  # deferred weight gradients added to a leaf since its hook
            send = self._main_grad(unit)
            unit.main_grad = None
            return send
        send = self.stats.allocate("grad", unit.shard.numel() * unit.comm.size, unit.shard)
        ranks = send.view(unit.comm.size, -1)
        for shard_offset, leaf, (_, _, p) in zip(unit_offsets(unit), unit.leaves, unit.entries):
            dst = ranks[:, shard_offset:shard_offset + p.numel()]
            if leaf.grad is None:
                dst.zero_()
            else:
                copy_rows(dst, leaf.grad.reshape(-1), into_ranks=True)
            leaf.grad = None
        return send

    # -- mixed precision: fp32 main grads (Megatron's main_grad) -----------------------------------------
    def _main_grad(self, unit: Unit) -> torch.Tensor:
        """The unit's fp32 gradient sum, allocated zeroed at first use: here the rank-major send buffer."""
        if unit.main_grad is None:
            unit.main_grad = self.stats.allocate("grad", unit.shard.numel() * unit.comm.size, unit.shard).zero_()
        return unit.main_grad

    def _add_to_main_grad(self, unit: Unit, index: int, grad: torch.Tensor) -> None:
        """Add leaf ``index``'s compute-dtype gradient into its rows of the main grad, in fp32."""
        shard_offset, numel = unit_offsets(unit)[index], unit.entries[index][2].numel()
        ranks = self._main_grad(unit).view(unit.comm.size, -1)[:, shard_offset:shard_offset + numel]
        copy_rows(ranks, grad.reshape(-1), into_ranks=True, add=True)

    @torch.no_grad()
    def _to_main_grad(self, unit: Unit, index: int, leaf: torch.Tensor) -> None:
        """Right after autograd accumulated a microbatch's gradient into ``leaf`` (compute dtype), move it
        into the fp32 main grad, so that microbatches sum in fp32 as single-process mixed precision does."""
        if leaf.grad is not None:
            self._add_to_main_grad(unit, index, leaf.grad)
            leaf.grad = None

    def _flush_main_grad(self, unit: Unit) -> None:
        for index, leaf in enumerate(unit.leaves):
            self._to_main_grad(unit, index, leaf)

    def _grad_sent(self, send: torch.Tensor) -> None:
        """The reduce-scatter reading ``send`` completed."""
        self.stats.release("grad", send)

    def _param_grad_views(self, unit: Unit) -> list[torch.Tensor]:
        return [unit.grad[o:o + p.numel()].view_as(p) for o, (_, _, p) in zip(unit_offsets(unit), unit.entries)]

    # -- gathering ---------------------------------------------------------------------------------------
    def _issue_gather(self, unit: Unit) -> None:
        """All-gather the shard in the compute dtype (mixed precision casts it first, as FSDP2's
        MixedPrecisionPolicy(param_dtype=bf16) does)."""
        unit.gathered = self._gather_destination(unit)
        unit.gather_source = unit.shard.to(self.compute_dtype)
        if unit.comm.size == 1:  # a one-rank Comm returns its input instead of filling ``out``
            unit.gathered.copy_(unit.gather_source)
        unit.pending = unit.comm.all_gather(unit.gather_source, out=unit.gathered, async_op=True)

    def _ensure_full(self, unit: Unit) -> list[torch.Tensor]:
        if unit.full is None:
            if unit.pending is None:
                self._issue_gather(unit)
            unit.pending.wait()
            unit.pending = unit.gather_source = None
            with torch.no_grad():
                self._materialize(unit)
        return unit.full

    def _prefetch(self, index: int, backward: bool) -> None:
        if 0 <= index < len(self.units):
            unit = self.units[index]
            if unit.full is None and unit.pending is None and (unit.saves_weights or not backward):
                self._issue_gather(unit)

    # -- what the shards hold -----------------------------------------------------------------------------
    def _attach_grads(self, unit: Unit) -> None:
        """Point every ``param.grad`` at its piece of the unit's gradient shard (or None)."""
        views = self._param_grad_views(unit) if unit.grad is not None else [None] * len(unit.entries)
        for (_, _, p), view in zip(unit.entries, views):
            p.grad = view

    def grad_norm(self) -> torch.Tensor:
        return norm_of_groups(self.squared_grad_norms(), self.comms)

    def squared_grad_norms(self) -> dict:
        """The gradient shards' squared norms grouped by the mesh dimensions their parameters are sharded
        over (this engine's, tensor parallelism's, the pipeline's): runs of each unit's flat gradient, so the
        buffer-reuse layout's flat shards, which mix tensor-parallel and replicated weights, are split right."""
        return squared_norms_of_pieces({dims for unit in self.units for dims in unit.norm_keys},
                                       ((unit.grad, unit.norm_pieces) for unit in self.units),
                                       self.units[0].shard.dtype)

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full parameters by the plain model's names (every rank takes part): gathered over the
        sharding dimension by units, then over the other dimensions a parameter is marked sharded on
        (tensor parallelism's, expert parallelism's)."""
        by_id, comm_of = {}, {}
        for unit in self.units:
            gathered = unit.comm.all_gather(unit.shard)
            for (_, _, p), tensor in zip(unit.entries, self._unflatten(unit, gathered)):
                by_id[id(p)], comm_of[id(p)] = tensor, unit.comm.name
        return {name: gather_full(by_id[id(p)], self.comms,
                                  [m for m in getattr(p, SHARD_ATTR, ()) if m[0] != comm_of[id(p)]]).cpu().clone()
                for name, p in self.model.named_parameters()}

    def placements(self) -> list:
        """Each parameter's dim-0 shard, placed by its marks (this engine's, tensor and expert parallelism's)."""
        return [(p, tensor_pieces(name, p, self.comms)) for name, p in self.model.named_parameters()
                if p.requires_grad]

    def memory(self, optimizers) -> dict:
        """Persistent bytes of parameter and gradient shards and optimizer state; the peaks of the
        engine's temporary buffers (the reused ones count as persistent) and the buffer counts."""
        return engines_memory([self], optimizers)

    def held_bytes(self) -> dict[str, int]:
        """Persistent bytes (shards; no separate master copy) and the transient peaks, for
        :func:`parallelisms.parallel.memory.engines_memory`."""
        held, stats = self.persistent_bytes(), self.stats
        transient = ({"reused_buffers": held["buffers"]} if "buffers" in held else
                     {"gathered_params_peak": stats.peak_bytes["weight"], "grad_buffers_peak": stats.peak_bytes["grad"]})
        return {"params": held["params"], "grads": held["grads"], "master": 0, **transient}

    def counts(self) -> dict:
        """Buffers allocated so far and still live, by kind (weight, grad)."""
        return {"buffer_allocations": dict(self.stats.allocations), "live_buffers": dict(self.stats.live)}

    def persistent_bytes(self) -> dict[str, int]:
        """Bytes this rank keeps: parameter shards, gradient shards (held from backward to the optimizer
        step), and the reused buffers (buffer-reuse layout)."""
        params = sum(u.shard.numel() * u.shard.element_size() for u in self.units)
        return {"params": params, "grads": params}
