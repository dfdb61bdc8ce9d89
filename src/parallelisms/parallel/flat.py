"""The flat-parameter sharding engine behind ZeRO-1/2/3 and the FSDP1 strategies.

ZeRO (Rajbhandari et al., SC'20) partitions optimizer state (stage 1), gradients (stage 2) and
parameters (stage 3) over the N data-parallel ranks; FSDP (Zhao et al., VLDB'23) does the same with one
*flat parameter* per wrapped unit. Here both are configurations of one engine:

* a :class:`FlatUnit` concatenates the parameters of a wrapping unit (the embedding, one transformer
  block, the head = final norm + output; for ZeRO-1/2 consecutive ones merged up to the gradient bucket
  cap) into one flat buffer ``full`` (padded to a multiple of N) that the modules' weights view, and
  keeps this rank's 1/N slice ``shard`` as an fp32 ``nn.Parameter`` (the master weights the optimizer
  updates; a view of ``full`` when nothing more is needed). The model's modules lose their registered
  parameters: the engine's ``parameters()`` and ``full_state_dict()`` stand for them;
* a :class:`ShardingPlan` says which states are sharded and when parameters are resharded.

API (used by ``zero.py``, ``fsdp.py`` and the per-parameter / buffer-reuse variants)::

    plan = ShardingPlan(shard_params=True, shard_grads=True, reshard_after_forward=True,
                        shard_dim="dp", replicate_dim=None, compute_dtype=torch.float32)
    engine = ShardedEngine(model, wrap.module_units(model, cap_bytes=None), plan, comms)
    engine.parameters()       # the fp32 shards (nn.Parameter, .grad = reduced gradient shard): optimizer input
    with engine.no_sync(): ...  # local accumulation (only while gradients are not sharded)
    engine.zero_grad(); loss.backward()   # hooks gather, prefetch, reshard and reduce-scatter
    engine.after_step()       # all-gather updated shards into persistent full buffers (stages 1-2; with
                              # overlap_param_gather launched here and completed in each unit's next forward)
    engine.full_state_dict()  # {name: full fp32 tensor}, a collective
    engine.memory(optimizer)  # persistent bytes by kind, transient peaks, all-gather counts
    engine.gathers            # {"prefetched": n, "on_demand": m} all-gathers so far

Communication per unit and step (fp32, N ranks, ring): stages 1-2 reduce-scatter the gradient in
backward and all-gather the updated parameters after the step, 2(N-1)/N x G like DDP's all-reduce;
stage 3 / FULL_SHARD all-gathers before forward and again before backward (the parameters were freed
after forward) and reduce-scatters, 1.5x that. Gradients are divided by the data-parallel size and
reduced in fp32; with a replicate dimension (HYBRID_SHARD) the reduced shard is all-reduced over it.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from parallelisms.comm import Comm, Comms
from parallelisms.parallel.common import (SHARD_ATTR, after_last_child_backward, gather_full, mark_sharded,
                                          norm_dims, norm_of_groups, norm_pieces,
                                          squared_norms_of_pieces)
from parallelisms.parallel.grad_sync import syncing_off
from parallelisms.parallel.memory import engines_memory
from parallelisms.parallel.placement import flat_pieces
from parallelisms.parallel.tied import shared_uses
from parallelisms.parallel.wrap import split_expert_units


@dataclass(frozen=True)
class ShardingPlan:
    """Which states are sharded over ``shard_dim`` and when parameters are resharded.

    ``shard_params``: parameters are freed between uses and gathered for forward and backward (ZeRO-3,
    FULL_SHARD, SHARD_GRAD_OP). ``reshard_after_forward``: free them again after forward (FULL_SHARD) or
    keep them until after backward (SHARD_GRAD_OP). ``shard_grads``: only the reduced gradient shard
    persists, reduced once per microbatch (ZeRO-2/3); otherwise the full gradient persists and is reduced
    once per step (ZeRO-1, NO_SHARD). Optimizer state is always per shard (NO_SHARD: a shard of one).
    """

    shard_params: bool = False
    shard_grads: bool = False
    reshard_after_forward: bool = True
    shard_dim: str | None = "dp"       # None: no sharding (NO_SHARD)
    replicate_dim: str | None = None   # all-reduce of reduced shards (HYBRID_SHARD, NO_SHARD)
    compute_dtype: torch.dtype = torch.float32


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _gather_into(comm: Comm, shard: torch.Tensor, out: torch.Tensor, async_op: bool = False):
    """All-gather ``shard`` into ``out`` (a plain copy on one rank)."""
    if comm.size > 1:
        return comm.all_gather(shard, out=out, async_op=async_op)
    if shard.data_ptr() != out.data_ptr():
        out.copy_(shard)
    return None


class FlatUnit:
    """The parameters of ``modules`` (those ``owned`` says are this unit's) as one flat buffer ``full`` plus
    this rank's fp32 ``shard`` of it over ``shard_comm``; reduced shards are all-reduced over ``replicate``."""

    def __init__(self, name: str, modules: list[nn.Module], plan: ShardingPlan, shard_comm: Comm,
                 replicate: Comm, owned=lambda param: True, users=()):
        self.name, self.modules, self.comm, self.replicate = name, modules, shard_comm, replicate
        self.slots = []  # (wrapped module, owning submodule, attribute, qualified name inside the wrapped module)
        for mod in modules:
            for qual, param in mod.named_parameters():
                if owned(param):
                    *path, attr = qual.split(".")
                    self.slots.append((mod, mod.get_submodule(".".join(path)), attr, qual))
        params = [owner._parameters[attr] for _, owner, attr, _ in self.slots]
        # modules outside the unit holding one of its parameters (a tied head): they view the same piece of ``full``
        self.aliases = [(owner, attr, [id(p) for p in params].index(id(param))) for owner, attr, param in users]
        self.marks = [getattr(p, SHARD_ATTR, ()) for p in params]  # tensor parallelism's shards, kept
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.numel = sum(self.numels)
        n, rank = shard_comm.size, shard_comm.rank
        self.shard_numel = math.ceil(self.numel / n)
        self.padded = self.shard_numel * n
        # master weights in the parameters' precision, at least fp32 (float64 stays float64)
        self.master_dtype = torch.promote_types(params[0].dtype, torch.float32)
        master = torch.zeros(self.padded, dtype=self.master_dtype, device=params[0].device)
        torch.cat([p.detach().reshape(-1).to(self.master_dtype) for p in params], out=master[:self.numel])
        self.full = master.to(plan.compute_dtype, copy=True).requires_grad_(True)
        lo, hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        # the master slice: a view of ``full`` when that is in the master dtype and persistent, else its own storage
        self.shard_is_view = not plan.shard_params and plan.compute_dtype == self.master_dtype
        self.shard = nn.Parameter(self.full.data[lo:hi] if self.shard_is_view else master[lo:hi].clone())
        if n > 1:
            mark_sharded(self.shard, shard_comm.name, tensor_dim=None)
        shard_dims = (shard_comm.name,) if n > 1 else ()
        # gradient-norm groups: tensor-parallel shards are summed over tp too, replicated weights are not
        self.norm_keys = {norm_dims(p, shard_dims) for p in params}
        self.norm_segments = norm_pieces(params, lo, hi, shard_dims)
        for owner, attr in [(owner, attr) for _, owner, attr, _ in self.slots] + [a[:2] for a in self.aliases]:
            del owner._parameters[attr]
        self.gathered = True
        self.pending_gather = None
        self.main_grad = None  # held through the step in mixed precision: the fp32 sum of the microbatches' grads

    def qualified_names(self, model: nn.Module) -> list[str]:
        """The parameters' names in ``model`` (the plain model's ``named_parameters`` names)."""
        prefix = {id(m): n for n, m in model.named_modules()}
        return [f"{prefix[id(mod)]}.{qual}" if prefix[id(mod)] else qual for mod, _, _, qual in self.slots]

    def attach(self) -> None:
        """Point the modules' weights at views of ``full`` (called before each forward)."""
        # one split of the whole buffer, padding included: its backward is one concatenation of the gradients
        # (a slice before it would add a zero-filled padded copy of the unit's gradient)
        views = self.full.split(self.numels + [self.padded - self.numel])
        for (_, owner, attr, _), view, shape in zip(self.slots, views, self.shapes):
            setattr(owner, attr, view.view(shape))
        for owner, attr, index in self.aliases:
            setattr(owner, attr, getattr(self.slots[index][1], self.slots[index][2]))

    def free(self) -> None:
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def allocate(self) -> None:
        self.full.untyped_storage().resize_(self.padded * self.full.element_size())


class ShardedEngine:
    """Applies ``plan`` to ``units`` of ``model`` over the mesh dimensions in ``comms`` (see module doc); a
    ``GradSync`` whose optimizer parameters are the flat fp32 shards."""

    def __init__(self, model: nn.Module, units: list[tuple[str, list[nn.Module]]], plan: ShardingPlan,
                 comms: Comms, overlap_param_gather: bool = False, prefetch: int = 1):
        self.model, self.plan, self.comms = model, plan, comms
        self.prefetch = prefetch          # units gathered ahead of the one running (FSDP's forward/backward prefetch)
        self.overlap_param_gather = overlap_param_gather and not plan.shard_params
        self._updates = {}                # unit index: (Pending, source) of an overlapped after-step gather
        alone = Comm("none", None, comms.ledger, comms.timeline)
        shard_comm = comms[plan.shard_dim] if plan.shard_dim else alone
        replicate_comm = comms[plan.replicate_dim] if plan.replicate_dim else alone
        self.dp_size = shard_comm.size * replicate_comm.size
        # expert weights shard (or, without sharding, replicate) over the ranks holding the same experts
        expert_comms = (comms["ep_replicate"], alone) if plan.shard_dim else (alone, comms["ep_replicate"])
        self.units = [FlatUnit(name, modules, plan, *(expert_comms if experts else (shard_comm, replicate_comm)),
                               owned, shared_uses(model, modules, owned))
                      for name, modules, owned, experts in split_expert_units(units)]
        self.names = [unit.qualified_names(model) for unit in self.units]
        self.hold = False                 # a pipeline stage's engine: see hold_through_step
        self.syncing = True
        self._callback_queued = False
        self._in_flight = None            # (unit, Pending, gradient, its fp32 copy being reduced)
        self.gathers = {"prefetched": 0, "on_demand": 0}  # all-gathers issued ahead of need, or when needed
        self.live = {"params": 0, "grads": 0}
        self.peak = {"params": 0, "grads": 0}
        self._hooks = []
        self._late_prefetch = set()       # units whose backward prefetch waits for their last child's backward
        for index, unit in enumerate(self.units):
            if plan.shard_params:
                unit.free()
            else:
                unit.attach()
            self._hooks.append(unit.modules[0].register_forward_pre_hook(self._pre_forward_hook(index)))
            self._hooks.append(unit.modules[-1].register_forward_hook(self._post_forward_hook(index)))
            self._hooks.append(unit.full.register_post_accumulate_grad_hook(self._post_backward_hook(index)))
            late = (after_last_child_backward(unit.modules, lambda i=index: self._prefetch(i, -1))
                    if plan.shard_params and index > 0 else None)
            if late is not None:
                self._hooks.append(late)
                self._late_prefetch.add(index)
            for user in {id(owner): owner for owner, _, _ in unit.aliases}.values():  # a tied head
                self._hooks.append(user.register_forward_pre_hook(self._user_pre_forward_hook(index)))
                self._hooks.append(user.register_forward_hook(self._user_post_forward_hook(index)))

    # -- transient memory bookkeeping ------------------------------------------------------------------------
    def _track(self, kind: str, delta: int) -> None:
        self.live[kind] += delta
        self.peak[kind] = max(self.peak[kind], self.live[kind])

    # -- parameters: gather, prefetch, reshard ------------------------------------------------------------------
    def _unshard(self, unit: FlatUnit) -> None:
        """Launch the all-gather of ``unit`` (asynchronous; :meth:`_wait_unshard` completes it)."""
        if unit.gathered or unit.pending_gather is not None:
            return
        unit.allocate()
        self._track("params", _nbytes(unit.full))
        src = unit.shard.detach().to(self.plan.compute_dtype)
        unit.pending_gather = (_gather_into(unit.comm, src, unit.full.data, async_op=True), src)

    def _prefetch(self, index: int, direction: int) -> None:
        """Launch the gathers of the ``prefetch`` units after unit ``index`` in the pass's order (``direction``
        +1 forward, -1 backward); those already gathered or in flight are left as they are."""
        for k in range(1, self.prefetch + 1):
            if 0 <= index + direction * k < len(self.units):
                self._unshard(self.units[index + direction * k])

    def _wait_unshard(self, unit: FlatUnit) -> None:
        if not unit.gathered:
            self.gathers["prefetched" if unit.pending_gather is not None else "on_demand"] += 1
        self._unshard(unit)
        if unit.pending_gather is not None:
            pending, _ = unit.pending_gather
            if pending is not None:
                pending.wait()
            unit.pending_gather = None
            unit.gathered = True

    def _reshard(self, unit: FlatUnit) -> None:
        if self.plan.shard_params and unit.gathered:
            unit.free()
            self._track("params", -_nbytes(unit.full))

    # -- hooks ----------------------------------------------------------------------------------------------
    def _finish_update(self, index: int) -> None:
        """Complete the overlapped all-gather of unit ``index``'s updated parameters, if one is in flight."""
        if index in self._updates:
            pending, _ = self._updates.pop(index)
            if pending is not None:
                pending.wait()

    def _finish_updates(self) -> None:
        for index in list(self._updates):
            self._finish_update(index)

    def _pre_forward_hook(self, index: int):
        def hook(module, args):
            unit = self.units[index]
            self._finish_update(index)                        # overlap_param_gather: its update has landed
            self._wait_unshard(unit)
            unit.attach()
            if self.plan.shard_params:
                self._prefetch(index, +1)                     # overlaps this unit's forward
        return hook

    def _post_forward_hook(self, index: int):
        def hook(module, args, output):
            unit = self.units[index]
            if self.plan.reshard_after_forward and not self.hold:
                self._reshard(unit)
            if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(lambda grad: self._pre_backward(index))
            elif not torch.is_grad_enabled():
                self._reshard(unit)
            return output
        return hook

    def _user_pre_forward_hook(self, index: int):
        """A module outside unit ``index`` that uses its weights (a tied head): gather the unit again."""
        def hook(module, args):
            self._finish_update(index)
            self._wait_unshard(self.units[index])
            self.units[index].attach()
        return hook

    def _user_post_forward_hook(self, index: int):
        """The unit stays gathered for the user's backward, which comes before its own (a tied head's); its
        gradient is complete, the two uses' summed by autograd, after its own backward."""
        def hook(module, args, output):
            if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(lambda grad: self._pre_backward(index))
            elif not torch.is_grad_enabled():
                self._reshard(self.units[index])
            return output
        return hook

    def _pre_backward(self, index: int) -> None:
        """The gradient of the unit's output arrived: gather its parameters and prefetch the previous unit's
        (here, or later: :func:`after_last_child_backward`)."""
        self._queue_final_callback()
        if self.plan.shard_params:
            self._wait_unshard(self.units[index])
            if index not in self._late_prefetch:
                self._prefetch(index, -1)                     # overlaps this unit's backward

    def _post_backward_hook(self, index: int):
        def hook(full: torch.Tensor):
            unit = self.units[index]
            self._queue_final_callback()
            if not self.hold:
                self._reshard(unit)
            elif unit.full.dtype != unit.master_dtype:
                self._accumulate_main_grad(unit)
            if self.syncing:
                self._launch_reduce(unit)
        return hook

    @torch.no_grad()
    def _accumulate_main_grad(self, unit: FlatUnit) -> None:
        """Mixed precision held through the step: each microbatch's low-precision gradient is added into an
        fp32 ``main_grad`` (Megatron's main_grad), so microbatches accumulate in fp32 as the reference does."""
        if unit.full.grad is not None:
            grad, unit.full.grad = unit.full.grad, None
            unit.main_grad = grad.to(unit.master_dtype) if unit.main_grad is None else unit.main_grad.add_(grad)

    # -- gradients: reduce-scatter to owners ---------------------------------------------------------------------
    def _launch_reduce(self, unit: FlatUnit, grad: torch.Tensor | None = None) -> None:
        """Reduce-scatter ``unit``'s gradient (``grad``, else ``full.grad``; in fp32, pre-divided by the
        data-parallel size), one in flight: the previous unit's reduction completes first, while this gradient
        already exists (counted)."""
        grad = unit.full.grad if grad is None else grad
        if self.plan.shard_grads:
            self._track("grads", _nbytes(grad))
        self._finish_reduce()
        grad32 = grad.to(unit.master_dtype)
        grad32.div_(self.dp_size)
        if self.plan.shard_grads:
            unit.full.grad = None
            self._track("grads", _nbytes(grad32) if grad32 is not grad else 0)
        pending = unit.comm.reduce_scatter(grad32, async_op=True, scratch=True)
        self._in_flight = (unit, pending, grad, grad32)

    def _finish_reduce(self) -> None:
        if self._in_flight is None:
            return
        unit, pending, grad, grad32 = self._in_flight
        self._in_flight = None
        reduced = pending.wait()
        unit.replicate.all_reduce(reduced)
        if self.plan.shard_grads:
            self._track("grads", -(_nbytes(grad) + (_nbytes(grad32) if grad32 is not grad else 0)))
            if unit.shard.grad is None:  # the first microbatch's reduced shard becomes the gradient
                unit.shard.grad = reduced
            else:
                unit.shard.grad.add_(reduced)
        else:  # ZeRO-1 / NO_SHARD: the shard's gradient is a slice of the persistent full gradient if dtypes agree
            if unit.shard_is_view:
                lo = unit.comm.rank * unit.shard_numel
                unit.shard.grad = grad[lo:lo + unit.shard_numel]
            elif unit.shard.grad is None:
                unit.shard.grad = torch.zeros_like(unit.shard)
            if unit.shard.grad.data_ptr() != reduced.data_ptr():
                unit.shard.grad.copy_(reduced)

    def _queue_final_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _finish_backward(self) -> None:
        """End of backward: complete the last reduction, free whatever is still gathered."""
        self._callback_queued = False
        self._finish_reduce()
        if not self.hold:
            for unit in self.units:
                if unit.pending_gather is not None:
                    self._wait_unshard(unit)
                self._reshard(unit)

    def hold_through_step(self) -> None:
        """A pipeline stage, whose schedule interleaves the forwards and backwards of many microbatches: from
        now on a unit is gathered at its first forward of the step and stays gathered, its gradient accumulates
        in full, and :meth:`reduce_held` reduces (and frees) every unit once, after the stage's last backward
        of the step. That is torchtitan's choice for FSDP under PP (one all-gather and one reduce-scatter per
        unit and step instead of 2M and M for M microbatches), and it lets a split backward's deferred weight
        gradients (Zero Bubble's W) land before the reduction."""
        self.hold, self.syncing = True, False  # held units are reduced by reduce_held only

    def reduce_held(self) -> None:
        """Held through the step: the stage's last backward work of the step is done; reduce each unit's
        accumulated gradient (last unit first, one reduction in flight) and free the gathered parameters."""
        for unit in reversed(self.units):
            if unit.pending_gather is not None:
                self._wait_unshard(unit)
            self._reshard(unit)
            grad = None
            if unit.full.dtype != unit.master_dtype:  # deferred weight gradients may have landed since the hook
                self._accumulate_main_grad(unit)
                grad, unit.main_grad = unit.main_grad, None
            self._launch_reduce(unit, grad)

    # -- user API ------------------------------------------------------------------------------------------------
    def parameters(self) -> list[nn.Parameter]:
        """The fp32 shards, one per unit, for the optimizer (``.grad`` holds the reduced gradient shard)."""
        return [unit.shard for unit in self.units]

    def no_sync(self):
        """Accumulate locally without communication; a no-op when gradients are sharded (reduced per microbatch)."""
        return nullcontext() if self.plan.shard_grads else syncing_off(self)

    def zero_grad(self) -> None:
        """Gradients are dropped, as ``zero_grad(set_to_none=True)`` does for torch DDP and FSDP: no gradient
        memory through the next forward; backward allocates them again (ZeRO-1 and NO_SHARD: the full
        gradient, persistent from then until the step)."""
        for unit in self.units:
            unit.shard.grad = unit.full.grad = unit.main_grad = None

    @torch.no_grad()
    def after_step(self) -> None:
        """Refresh the persistent full parameters from the updated shards (all-gather; stages 1-2). With
        ``overlap_param_gather`` (Megatron-LM's distributed optimizer's ``--overlap-param-gather``) every unit's
        gather is launched here, in forward order, and completed by that unit's next forward pre-hook, so the
        gathers of later units run under the forward of earlier ones."""
        if self.plan.shard_params:
            return
        for index, unit in enumerate(self.units):
            src = unit.shard.detach().to(self.plan.compute_dtype)
            if self.overlap_param_gather:
                self._updates[index] = (_gather_into(unit.comm, src, unit.full.data, async_op=True), src)
            else:
                _gather_into(unit.comm, src, unit.full.data)

    def finish(self) -> None:
        """Complete the last reduction (after backward the end-of-backward callback already has, unless the
        units are held through the step)."""
        self._finish_reduce()

    def grad_norm(self) -> torch.Tensor:
        """The norm of each shard's runs summed over their own mesh dimensions (squared norms all-reduced)."""
        return norm_of_groups(self.squared_grad_norms(), self.comms)

    def squared_grad_norms(self) -> dict:
        """The shards' squared gradient norms grouped by the mesh dimensions to sum them over
        (:func:`parallelisms.parallel.common.norm_of_groups` makes the global norm of them)."""
        return squared_norms_of_pieces({dims for unit in self.units for dims in unit.norm_keys},
                                       ((unit.shard.grad, unit.norm_segments) for unit in self.units),
                                       self.units[0].master_dtype)

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter, full and fp32, by the plain model's names (all ranks call it); tensor-parallel
        shards are gathered too."""
        self._finish_updates()
        state = {}
        for unit, names in zip(self.units, self.names):
            flat = unit.comm.all_gather(unit.shard.detach().clone())
            pieces = flat[:unit.numel].split(unit.numels)
            for name, piece, shape, marks in zip(names, pieces, unit.shapes, unit.marks):
                state[name] = gather_full(piece.view(shape), self.comms, marks).cpu().clone()
        return state

    def memory(self, optimizers) -> dict:
        """:func:`parallelisms.parallel.memory.engines_memory` of this engine."""
        return engines_memory([self], optimizers)

    def placements(self) -> list:
        """Each unit's flat shard with the boxes of the parameters its range covers."""
        return [(unit.shard, flat_pieces(names, unit.shapes, unit.marks, self.comms,
                                         unit.comm.rank * unit.shard_numel, (unit.comm.rank + 1) * unit.shard_numel))
                for unit, names in zip(self.units, self.names)]

    def counts(self) -> dict[str, int]:
        """The all-gathers that explain the gathered-parameter peak (prefetched ones hold two units at once)."""
        return {f"{kind}_gathers": count for kind, count in self.gathers.items()}

    def held_bytes(self) -> dict[str, int]:
        """Persistent bytes held by the engine: compute-dtype parameters, gradients, fp32 master copies."""
        params = sum(_nbytes(u.full) for u in self.units if not self.plan.shard_params)
        params += sum(_nbytes(u.shard) for u in self.units if self.plan.shard_params
                      and self.plan.compute_dtype == u.master_dtype)
        master = sum(_nbytes(u.shard) for u in self.units if self.plan.compute_dtype != u.master_dtype)
        grads = sum(_nbytes(u.full.grad) for u in self.units if not self.plan.shard_grads)
        grads += sum(_nbytes(u.shard.grad) for u in self.units
                     if u.shard.grad is not None and (self.plan.shard_grads or not u.shard_is_view))
        return {"params": params, "grads": grads, "master": master,
                "gathered_params_peak": self.peak["params"], "grad_buffers_peak": self.peak["grads"]}

    def remove(self) -> None:
        self._finish_updates()
        for handle in self._hooks:
            handle.remove()

