"""Per-parameter sharding in the style of FSDP2 (PyTorch ``fully_shard``: every parameter a DTensor sharded
on dim 0; Zhao et al. 2023 for FSDP, the torch 2.4 per-parameter rewrite for FSDP2).

Each parameter keeps its identity: the ``nn.Parameter`` object the user's optimizer and ``state_dict``
hold stays registered in its module, and its ``.data`` becomes this rank's dim-0 rows (``ceil(d0 / N)``,
zero-padded on the last ranks), a view into one flat per-unit shard buffer so a unit is all-gathered by
one collective without a copy-in. A unit is a transformer block, the embedding, or the final norm plus
output head (:func:`parallelisms.parallel.wrap.module_units`). Around a unit's forward:

* pre-hook: wait for (or issue) the unit's all-gather, copy the rank-major result out into full parameters
  (FSDP2's copy-out), swap them in as fresh leaf tensors, and prefetch the next unit's all-gather asynchronously;
* post-hook: restore the sharded parameters and free the full ones (FULL_SHARD; SHARD_GRAD_OP keeps them to
  backward). The last unit stays gathered, its backward comes next.

Autograd keeps no full weight alive between forward and backward: a ``saved_tensors_hooks`` pair stores a
reference (unit, size, stride, offset) for any saved tensor living in a gathered unit's storage and, in
backward, re-gathers the unit on first use and prefetches the previous unit (if its forward saved
weights: the embedding's backward needs none) once a block's MLP has run its backward
(``after_last_child_backward``). When every full leaf of a unit has accumulated its gradient, the gradients are
copied in rank-major order (copy-in), divided by N and reduce-scattered asynchronously into the unit's flat
shard-gradient buffer (``param.grad`` views), one in flight as in FSDP2; the end of backward waits for the last.
:mod:`parallelisms.parallel.yafsdp` reuses this engine with a flat layout and two preallocated buffer pairs.

:meth:`PerParamSharding.hold_through_step` (a pipeline stage; torchtitan runs FSDP2 under PP this way) keeps
each unit gathered from its first forward of the step, its leaves accumulating every microbatch's gradients,
until :meth:`PerParamSharding.reduce_held` reduce-scatters them after the stage's last backward work.

Mixed precision (``compute_dtype=bf16``, FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``): the shards stay fp32 (the optimizer's master weights), each is cast to bf16 before its
all-gather, so the full weights and the compute are bf16; every microbatch's bf16 gradient is added, right
after autograd accumulates it into the leaf, into an fp32 main grad of the unit (Megatron's ``main_grad``;
here the rank-major reduce-scatter input itself, reuse's gradient buffer), which is divided by the
data-parallel size and reduce-scattered in fp32 into the fp32 gradient shards, held through the step or not.

Full recomputation swaps the unit's full weights in around the recomputed forward
(:meth:`PerParamSharding._swapped_in_for_recompute`); a block holding expert weights is two units, its experts
sharded over ``ep_replicate`` (:func:`parallelisms.parallel.wrap.split_expert_units`).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
from torch import nn

from parallelisms.comm import Comms
from parallelisms.parallel.common import (SHARD_ATTR, after_last_child_backward, gather_full, mark_sharded,
                                          norm_dims, norm_of_groups, norm_pieces, squared_norms_of_pieces)
from parallelisms.parallel.wrap import module_units, split_expert_units
from parallelisms.parallel.memory import engines_memory
from parallelisms.parallel.placement import tensor_pieces
from parallelisms.parallel.recompute import register_recompute_context
from parallelisms.parallel.row_split import rows_per_rank
from parallelisms.parallel.shard_units import BufferStats, Unit, copy_rows, unit_offsets
from parallelisms.parallel.tied import shared_uses


class PerParamSharding:
    """FSDP2-style sharding of ``model`` over mesh dimension ``dim`` of ``comms`` (data-parallel; expert
    weights over ``ep_replicate``); a ``GradSync`` whose optimizer parameters are the model's own (sharded)
    parameters.

    ``reshard_after_forward=False`` gives SHARD_GRAD_OP (no all-gather in backward). ``compute_dtype``
    (bf16) gathers and computes in it over shards in the parameters' dtype (mixed precision, see the module
    docstring). Use ``zero_grad`` before each step; gradients are averaged over the ranks when backward
    returns, or, held through the step (:meth:`hold_through_step`), after :meth:`reduce_held` and :meth:`finish`.
    """

    def __init__(self, model: nn.Module, comms: Comms, dim: str = "dp_shard", reshard_after_forward: bool = True,
                 compute_dtype: torch.dtype | None = None):
        self.model, self.comms, self.reshard_after_forward = model, comms, reshard_after_forward
        self.hold = False  # a pipeline stage's engine: see hold_through_step
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
        self._pending_grads: list[tuple] = []  # (unit, pending reduce-scatter, its output, its input)
        self._callback_queued = False
        self._saved_hooks = None
        with torch.no_grad():
            for unit in self.units:
                self._shard(unit)
                params = [p for _, _, p in unit.entries]  # their data are this rank's pieces, back to back
                unit.norm_keys = {norm_dims(p) for p in params}
                unit.norm_pieces = norm_pieces(params, 0, unit.shard.numel(), ())
        self._hooks = [model.register_forward_pre_hook(self._root_pre_forward),
                       model.register_forward_hook(self._root_post_forward)]
        for unit in self.units:
            self._hooks.append(unit.modules[0].register_forward_pre_hook(lambda *_, u=unit: self._pre_forward(u)))
            self._hooks.append(unit.modules[-1].register_forward_hook(lambda *_, u=unit: self._post_forward(u)))
            late = (after_last_child_backward(unit.modules, lambda u=unit: self._prefetch(u.index - 1, True))
                    if unit.index > 0 else None)
            if late is not None:
                self._hooks.append(late)
                unit.late_prefetch = True
            self._hooks.append(register_recompute_context(unit.modules[0], lambda u=unit: self._recomputing(u)))
            for user in {id(module): module for module, _, _ in unit.aliases}.values():  # a tied head
                self._hooks.append(user.register_forward_pre_hook(lambda *_, u=unit: self._swap_in_aliases(u, True)))
                self._hooks.append(user.register_forward_hook(lambda *_, u=unit: self._swap_in_aliases(u, False)))
        self.zero_grad()

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

    # -- forward hooks -----------------------------------------------------------------------------------
    def _root_pre_forward(self, *_):
        if self.hold:  # held units stay gathered and current until reduce_held: saved weights are their own
            return
        for unit in self.units:  # parameters may have changed since the last gather (optimizer step)
            if unit.pending is not None:
                self._ensure_full(unit)
            self._release(unit, stale=True)
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._saved_hooks.__enter__()

    def _root_post_forward(self, *_):
        if self._saved_hooks is not None:
            self._saved_hooks.__exit__(None, None, None)
            self._saved_hooks = None

    def _pre_forward(self, unit: Unit) -> None:
        if self.hold and unit.leaves is not None:  # a later microbatch: the same leaves, their .grad accumulates
            self._swap_in(unit, unit.leaves)
            return
        full = self._ensure_full(unit)
        self._prefetch(unit.index + 1, backward=False)
        unit.saves_weights, unit.accumulated = False, 0
        unit.leaves = [t.detach().requires_grad_(torch.is_grad_enabled()) for t in full]
        self._swap_in(unit, unit.leaves)
        if self.hold:  # reduced by reduce_held, not per microbatch; the gradient buffers are set now
            unit.grads_prepared = True
            self._prepare_grads(unit)
        for index, leaf in enumerate(unit.leaves):
            if not leaf.requires_grad:
                continue
            if self.mixed:  # first of the post-accumulate hooks: the main grad holds it before a reduction
                leaf.register_post_accumulate_grad_hook(lambda leaf, u=unit, i=index: self._to_main_grad(u, i, leaf))
            if not self.hold:
                leaf.register_hook(lambda grad, u=unit: self._before_accumulate(u, grad))
                leaf.register_post_accumulate_grad_hook(lambda _, u=unit: self._after_accumulate(u))

    @staticmethod
    def _swap_in(unit: Unit, tensors: list[torch.Tensor]) -> None:
        for (module, name, _), tensor in zip(unit.entries, tensors):
            module._parameters[name] = tensor

    def _post_forward(self, unit: Unit) -> None:
        self._swap_in(unit, [param for _, _, param in unit.entries])
        # a unit another module uses later (a tied head's embedding) stays gathered: that forward uses its leaves
        if self.reshard_after_forward and not self.hold and unit.index != len(self.units) - 1 and not unit.aliases:
            self._release(unit)

    @staticmethod
    def _swap_in_aliases(unit: Unit, leaves: bool) -> None:
        """Around the forward of a module that uses the unit's parameters (a tied head): the unit's forward
        leaves (``leaves``), so autograd sums both uses' gradients into one leaf, else the parameters."""
        for module, attr, index in unit.aliases:
            module._parameters[attr] = unit.leaves[index] if leaves else unit.entries[index][2]

    # -- full recomputation: the unit's weights swapped in again around the recomputed forward ----------
    def _recomputing(self, unit: Unit):
        """Called in the unit's checkpointed forward (:func:`register_recompute_context`): the recomputation
        in backward will need its weights, so backward prefetches them; the context to enter around it."""
        unit.saves_weights = True
        return self._swapped_in_for_recompute(unit)

    @contextmanager
    def _swapped_in_for_recompute(self, unit: Unit):
        """Held: the forward's own leaves (deferred weight gradients go to the leaf a split linear captured).
        Otherwise the unit re-gathered (the shards did not change within the step: the same values) as fresh
        leaves; the gradients still land on the forward's leaves, whose graph non-reentrant checkpointing
        keeps, and only the saved tensors come from the recomputation."""
        if self.hold:
            tensors = unit.leaves
        else:
            full = self._ensure_full(unit)
            if not unit.late_prefetch:
                self._prefetch(unit.index - 1, backward=True)
            tensors = [t.detach().requires_grad_(leaf.requires_grad) for t, leaf in zip(full, unit.leaves)]
        self._swap_in(unit, tensors)
        try:
            yield
        finally:
            self._swap_in(unit, [param for _, _, param in unit.entries])

    # -- saved tensors: references instead of full weights -----------------------------------------------
    def _pack(self, tensor: torch.Tensor):
        if tensor.numel():
            storage = tensor.untyped_storage()._cdata  # the storage itself (a fake tensor has no data pointer)
            for unit in self.units:
                if unit.full_storage is not None and unit.full_storage.untyped_storage()._cdata == storage:
                    unit.saves_weights = True
                    return unit, tuple(tensor.shape), tensor.stride(), tensor.storage_offset()
        return tensor

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        unit, size, stride, offset = packed
        if unit.full is None:
            self._ensure_full(unit)
            if not unit.late_prefetch:
                self._prefetch(unit.index - 1, backward=True)
        return unit.full_storage.as_strided(size, stride, offset)

    # -- gradients ---------------------------------------------------------------------------------------
    def _before_accumulate(self, unit: Unit, grad: torch.Tensor) -> torch.Tensor:
        if not unit.grads_prepared:
            unit.grads_prepared = True
            self._prepare_grads(unit)
        return grad

    def _after_accumulate(self, unit: Unit) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        unit.accumulated += 1
        if unit.accumulated == len(unit.leaves):
            self._reduce_scatter(unit)

    def _reduce_scatter(self, unit: Unit) -> None:
        """Average the unit's gradients into its shard: asynchronous, waited at the end of backward."""
        with torch.no_grad():
            send = self._grad_send_buffer(unit).div_(self.dp_size)
        if unit.grad is None:  # the first microbatch writes the shard gradient directly
            unit.grad = out = torch.empty_like(unit.shard)
            self._attach_grads(unit)
        else:
            out = torch.empty_like(unit.grad)
        if unit.comm.size == 1:
            out.copy_(send)
        if self._pending_grads:  # one reduce-scatter in flight (as FSDP2): bounds the send buffers to two
            self._complete(self._pending_grads.pop(0))
        pending = unit.comm.reduce_scatter(send, out=out, async_op=True, scratch=True)
        self._pending_grads.append((unit, pending, out, send))
        unit.grads_prepared, unit.leaves, unit.accumulated = False, None, 0
        self._release(unit, stale=self.hold)  # held: the optimizer step comes before the next gather

    @torch.no_grad()
    def _complete(self, entry) -> None:
        unit, pending, out, send = entry
        pending.wait()
        self._grad_sent(send)
        if out is not unit.grad:
            unit.grad.add_(out)

    def _finish_backward(self) -> None:
        """End of backward: units with some unused parameters are reduced too, then every wait."""
        self._callback_queued = False
        for unit in reversed(self.units):
            if unit.leaves is not None and unit.accumulated:
                self._reduce_scatter(unit)
        for entry in self._pending_grads:
            self._complete(entry)
        self._pending_grads = []
        for unit in self.units:
            unit.accumulated, unit.leaves = 0, None

    def hold_through_step(self) -> None:
        """A pipeline stage: from now on a unit stays gathered from its first forward of the step and its full
        leaves stay the same objects, so their ``.grad`` accumulates the whole step (autograd's, and the deferred
        weight gradients a split backward's W action adds); only :meth:`reduce_held` reduces them."""
        self.hold = True

    def reduce_held(self) -> None:
        """Held through the step: the stage's last backward work of the step is done; reduce-scatter every
        unit's accumulated full gradients (last unit first, one in flight) and free its full parameters."""
        held = [unit for unit in self.units if unit.leaves is not None]
        self.stats.observe("grad", sum(self._held_grad_bytes(unit) for unit in held))
        for unit in reversed(held):
            self._reduce_scatter(unit)

    def _held_grad_bytes(self, unit: Unit) -> int:
        """Bytes of the unit's full gradients that autograd allocated (outside the engine's buffers)."""
        return sum(leaf.grad.numel() * leaf.grad.element_size() for leaf in unit.leaves if leaf.grad is not None)

    # -- user API ----------------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Drop the gradient shards (``set_to_none``, as torch's default): no gradient memory is held
        through forward; the next backward's first reduce-scatter allocates them."""
        for unit in self.units:
            unit.grad = None
            self._attach_grads(unit)

    def _attach_grads(self, unit: Unit) -> None:
        """Point every ``param.grad`` at its piece of the unit's gradient shard (or None)."""
        views = self._param_grad_views(unit) if unit.grad is not None else [None] * len(unit.entries)
        for (_, _, p), view in zip(unit.entries, views):
            p.grad = view

    def parameters(self) -> list[nn.Parameter]:
        """What the optimizer updates: the model's own parameters (their data are the shards)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def no_sync(self):
        """Gradients are reduce-scattered every microbatch and accumulate in the shards: nothing to defer."""
        return nullcontext()

    def finish(self) -> None:
        """Wait for the reduce-scatters still in flight: those :meth:`reduce_held` launched (otherwise the
        end-of-backward callback already has)."""
        for entry in self._pending_grads:
            self._complete(entry)
        self._pending_grads = []

    def grad_norm(self) -> torch.Tensor:
        return norm_of_groups(self.squared_grad_norms(), self.comms)

    def squared_grad_norms(self) -> dict:
        """The gradient shards' squared norms grouped by the mesh dimensions their parameters are sharded
        over (this engine's, tensor parallelism's, the pipeline's): runs of each unit's flat gradient, so the
        buffer-reuse layout's flat shards, which mix tensor-parallel and replicated weights, are split right."""
        return squared_norms_of_pieces({dims for unit in self.units for dims in unit.norm_keys},
                                       ((unit.grad, unit.norm_pieces) for unit in self.units),
                                       self.units[0].shard.dtype)

    def after_step(self) -> None:
        """Nothing: the next forward gathers the updated shards."""

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

    def remove(self) -> None:
        for handle in self._hooks:
            handle.remove()
