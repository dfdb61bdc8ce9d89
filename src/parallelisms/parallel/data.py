"""Data parallelism written here: gradient buckets all-reduced from backward hooks while backward goes on.

Follows PyTorch DDP (Li et al., VLDB 2020): parameters are grouped into buckets under a byte cap in the
order their gradients become ready (first guessed as reverse registration order, then rebuilt once from
the order rank 0 observed in the first synchronised backward); every parameter's ``.grad`` is a view into
its bucket's flat buffer, so accumulation writes straight into the buffer that is communicated. When a bucket's last gradient arrives, its all-reduce is launched
asynchronously; buckets launch in index order so every rank issues the same collectives in the same order.
One wait at the end of backward, queued on the autograd engine, completes them all. Gradients are
pre-divided by N and summed, giving the average. Between ranks of one host, buckets of at least 1 MiB are
all-reduced through shared memory (:mod:`parallelisms.comm.shm`; 2 x N x the largest bucket of /dev/shm).
"""

from __future__ import annotations

import torch
from torch import nn

from parallelisms.comm import Comm, Comms
from parallelisms.parallel.common import sharded_over
from parallelisms.parallel.grad_sync import LocalGradients, syncing_off
from parallelisms.parallel.wrap import gradient_buckets


class Bucket:
    """A flat gradient buffer, the parameters whose gradients are views into it, and the group reducing it."""

    def __init__(self, params: list[nn.Parameter], names: list[str], comm: Comm):
        self.params, self.names, self.comm = params, names, comm
        dtype, device = params[0].dtype, params[0].device
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=device)
        self.views, offset = [], 0
        for p in params:
            self.views.append(self.buffer[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.ready: set[int] = set()
        self.pending = None
        self.needs_division = False  # some gradient was accumulated unscaled: divide the buffer before reducing

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


def _buckets_in_ready_order(ready_order: list[tuple[str, nn.Parameter]], cap_bytes: int, comm_of,
                            first_cap_bytes: int | None = None) -> list[Bucket]:
    """Parameters in the order backward produces their gradients, cut at ``cap_bytes`` (the first bucket at
    ``first_cap_bytes``, so communication starts early) by :func:`~parallelisms.parallel.wrap.gradient_buckets`; a
    bucket holds one dtype, one device and one reducing group (``comm_of(param)``)."""
    params = [p for _, p in ready_order]
    cut = gradient_buckets([p.numel() * p.element_size() for p in params], cap_bytes,
                           [(p.dtype, p.device, id(comm_of(p))) for p in params], first_cap_bytes)
    return [Bucket([params[i] for i in bucket], [ready_order[i][0] for i in bucket], comm_of(params[bucket[0]]))
            for bucket in cut]


class DataParallel(LocalGradients):
    """Synchronises gradients of ``module`` over ``comm`` (a data-parallel mesh dimension); a ``GradSync``.

    Use: ``ddp = DataParallel(model, comms, "dp")``; then ``loss.backward()`` leaves averaged gradients.
    ``with ddp.no_sync():`` accumulates locally for gradient accumulation. ``find_unused_parameters=True``
    treats parameters that got no gradient as zero instead of raising an error naming them.
    ``first_bucket_mb`` caps the first bucket so its all-reduce starts after the head's gradients instead of
    after a whole cap's worth. Off by default: torch DDP 2.13 also ends up with one bucket for the bench
    model here, and on two cores a 1 MB first bucket made backward 2.5 ms slower (its all-reduce takes
    CPU from backward rather than overlapping it). ``replica_comms`` maps a mesh dimension to the group of ranks holding the same shard, for parameters
    sharded over that dimension (expert weights: ``{"ep": comms["ep_replicate"]}``): they are broadcast and
    summed over that group only, and still divided by the full data-parallel size. ``zero_grad`` (inherited)
    drops the gradients: the first gradient of the next backward is copied into its bucket slot, cheaper than
    zeroing every bucket and accumulating into it; later ones accumulate in place.
    """

    def __init__(self, module: nn.Module, comms: Comms, dim: str = "dp", bucket_cap_mb: float = 25.0,
                 find_unused_parameters: bool = False, broadcast_parameters: bool = True,
                 replica_comms: dict[str, Comm] | None = None, first_bucket_mb: float | None = None):
        super().__init__(module, comms)
        comm = self.comm = comms[dim]
        replica_comms = replica_comms or {}

        def comm_of(param):
            return next((replica_comms[d] for d in sharded_over(param) if d in replica_comms), comm)
        self.find_unused_parameters = find_unused_parameters
        self.syncing, self.held = True, False
        self._callback_queued = False
        self._named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if broadcast_parameters:
            with torch.no_grad():
                for _, p in self._named:
                    comm_of(p).broadcast(p.data, src=0)
        first_cap = None if first_bucket_mb is None else int(first_bucket_mb * 2**20)
        self._bucketing = lambda order: _buckets_in_ready_order(order, int(bucket_cap_mb * 2**20), comm_of,
                                                                first_cap)
        self._hooks = []
        self._install(list(reversed(self._named)))  # first guess: reverse registration order
        # the first synchronised backward records the real order; the next forward rebuilds the buckets by it
        self._observed: list[int] | None = []
        self._rebuild = module.register_forward_pre_hook(lambda *_: self._rebuild_in_observed_order())

    def _install(self, ready_order: list[tuple[str, nn.Parameter]]) -> None:
        """Buckets in ``ready_order`` and one hook per parameter; gradients move into the new buckets. The old
        buckets are dropped first: without gradients (after ``zero_grad``, as the rebuild finds them) their
        buffers are freed before the new ones exist, so the rebuild never holds the gradients twice."""
        for handle in self._hooks:
            handle.remove()
        self.buckets = []
        self.buckets = self._bucketing(ready_order)
        self._next_to_launch = 0
        self._hooks = []
        for bucket in self.buckets:
            for p_index, (param, view) in enumerate(zip(bucket.params, bucket.views)):
                if param.grad is not None:
                    view.copy_(param.grad)
                param.grad = view
                self._hooks.append(param.register_post_accumulate_grad_hook(self._make_hook(bucket, p_index)))

    def _rebuild_in_observed_order(self) -> None:
        """Once, before the second synchronised step: rebuild buckets in the gradient order rank 0 observed
        (broadcast, so every rank issues the same collectives), as torch DDP does after its first iteration."""
        if not self._observed or any(b.pending is not None for b in self.buckets):
            return
        index = {id(p): i for i, (_, p) in enumerate(self._named)}
        seen = [index[id(p)] for p in self._observed]
        rest = [i for i in reversed(range(len(self._named))) if i not in set(seen)]  # unused: at the end
        order = torch.tensor(seen + rest, dtype=torch.long, device=self._named[0][1].device)
        with self.comm.ledger.in_phase("setup"):
            self.comm.broadcast(order, src=0)
        self._observed = None
        self._rebuild.remove()
        self._install([self._named[i] for i in order.tolist()])

    # -- hooks -------------------------------------------------------------------------------------------
    def _make_hook(self, bucket: Bucket, p_index: int):
        view, scale = bucket.views[p_index], 1.0 / self.comm.size

        def hook(param: nn.Parameter):
            if param.grad is not view:  # the step's first gradient (grads were dropped): into the bucket slot
                if self.syncing:  # copy and pre-divide by N in one pass, as torch DDP's reducer does
                    torch.mul(param.grad, scale, out=view)
                else:
                    view.copy_(param.grad)
                    bucket.needs_division = True
                param.grad = view
            elif self.syncing:  # accumulated in place over microbatches: divide the bucket at launch
                bucket.needs_division = True
            if not self.syncing:
                return
            if not self._callback_queued:
                self._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            if self._observed is not None:
                self._observed.append(param)
            bucket.ready.add(p_index)
            if len(bucket.ready) == len(bucket.params):
                self._launch_ready_buckets()
        return hook

    def _launch_ready_buckets(self) -> None:
        while self._next_to_launch < len(self.buckets):
            bucket = self.buckets[self._next_to_launch]
            if len(bucket.ready) < len(bucket.params):
                return
            if bucket.needs_division:
                bucket.buffer.div_(self.comm.size)
            bucket.pending = bucket.comm.all_reduce(bucket.buffer, async_op=True, shared_memory=True)
            self._next_to_launch += 1

    def _finish_backward(self) -> None:
        """Runs once at the end of backward: every bucket launched, then one wait for them all."""
        self._callback_queued = False
        missing = [bucket.names[i] for bucket in self.buckets for i in range(len(bucket.params))
                   if i not in bucket.ready]
        if missing and not self.find_unused_parameters:
            raise RuntimeError(f"parameter {missing[0]} received no gradient in backward ({len(missing)} such); "
                               f"pass find_unused_parameters=True to treat unused parameters as zero")
        for bucket in self.buckets:
            for i, (param, view) in enumerate(zip(bucket.params, bucket.views)):
                if i not in bucket.ready:  # unused this step: contributes zero
                    view.zero_()
                    param.grad = view
            bucket.ready = set(range(len(bucket.params)))
        self._launch_ready_buckets()
        for bucket in self.buckets:
            bucket.pending.wait()
            bucket.pending, bucket.ready, bucket.needs_division = None, set(), False
        self._next_to_launch = 0

    # -- user API ----------------------------------------------------------------------------------------
    def no_sync(self):
        """Accumulate gradients locally (no communication) inside this block."""
        return syncing_off(self)

    def hold_through_step(self) -> None:
        """A pipeline stage: every backward accumulates into the zeroed buckets (:meth:`zero_grad`), as if
        inside :meth:`no_sync`; :meth:`reduce_held` launches the buckets after the stage's last backward
        work, so a split backward's deferred weight gradients land first."""
        self.held, self.syncing = True, False

    def zero_grad(self) -> None:
        """Drop the gradients; held through the step, zero the buckets and point every ``.grad`` into them."""
        if not self.held:
            return super().zero_grad()
        for bucket in self.buckets:
            bucket.buffer.zero_()
            for param, view in zip(bucket.params, bucket.views):
                param.grad = view

    def reduce_held(self) -> None:
        """Average every bucket (pre-divided, all-reduced asynchronously, in index order); :meth:`finish`
        waits. A gradient put in place of its bucket view (by assignment rather than accumulation) is
        copied into the bucket first."""
        for bucket in self.buckets:
            for param, view in zip(bucket.params, bucket.views):
                if param.grad is not view:
                    view.copy_(param.grad) if param.grad is not None else view.zero_()
                    param.grad = view
            bucket.ready, bucket.needs_division = set(range(len(bucket.params))), True
        self._launch_ready_buckets()

    def finish(self) -> None:
        """Wait for the buckets :meth:`reduce_held` launched (otherwise the end of backward already has)."""
        for bucket in self.buckets:
            if bucket.pending is not None:
                bucket.pending.wait()
            bucket.pending, bucket.ready, bucket.needs_division = None, set(), False
        self._next_to_launch = 0

    def remove(self) -> None:
        for handle in self._hooks:
            handle.remove()
        if self._observed is not None:
            self._rebuild.remove()
