"""Per-parameter sharding in the style of FSDP2 (PyTorch ``fully_shard``: every parameter a DTensor sharded
on dim 0; Zhao et al. 2023 for FSDP, the torch 2.4 per-parameter rewrite for FSDP2): the engine that gathers and
reduces the shards of :mod:`parallelisms.parallel.per_param_shards` around each unit's forward and backward.

Around a unit's forward:

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
Under mixed precision each leaf's gradient moves into the unit's fp32 main grad right after it accumulates.
:mod:`parallelisms.parallel.yafsdp` reuses this engine with a flat layout and two preallocated buffer pairs.

:meth:`PerParamSharding.hold_through_step` (a pipeline stage; torchtitan runs FSDP2 under PP this way) keeps
each unit gathered from its first forward of the step, its leaves accumulating every microbatch's gradients,
until :meth:`PerParamSharding.reduce_held` reduce-scatters them after the stage's last backward work.

Full recomputation swaps the unit's full weights in around the recomputed forward
(:meth:`PerParamSharding._swapped_in_for_recompute`).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
from torch import nn

from parallelisms.comm import Comms
from parallelisms.parallel.common import after_last_child_backward
from parallelisms.parallel.per_param_shards import PerParamShards
from parallelisms.parallel.recompute import register_recompute_context
from parallelisms.parallel.shard_units import Unit


class PerParamSharding(PerParamShards):
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
        super().__init__(model, comms, dim, compute_dtype)
        self.reshard_after_forward = reshard_after_forward
        self.hold = False  # a pipeline stage's engine: see hold_through_step
        self._pending_grads: list[tuple] = []  # (unit, pending reduce-scatter, its output, its input)
        self._callback_queued = False
        self._saved_hooks = None
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

    def after_step(self) -> None:
        """Nothing: the next forward gathers the updated shards."""

    def remove(self) -> None:
        for handle in self._hooks:
            handle.remove()
