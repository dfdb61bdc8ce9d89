"""The pipeline executor: runs any schedule of :mod:`.schedules` on real stages with batched
point-to-point communication, and the training runner built on it.

Each rank walks its action list in order. Consecutive communication actions form one batch: the sends
are posted together and never waited for until they are needed again (a stage output is freed when its
send completes), the receives are posted together and waited for. Point-to-point messages between two
ranks match in posting order, and some schedules (ZB-V, DualPipeV) receive in a different order than the
peer sends; so a receive first posts every earlier message of that peer, in the peer's order, into
buffers kept for later. That never deadlocks (sends do not block) and needs no tags (NCCL has none).
Each peer's next message is also posted ahead of its RECV, so the transfer overlaps computation.

Backward split (Qi et al., Zero Bubble Pipeline Parallelism, ICLR 2024): under a split schedule every
linear layer of a stage is swapped for one whose backward returns the input gradient at once and, while
the ``I`` action runs, leaves (weight, output gradient, input) in a :class:`WeightGradStore`; the ``W``
action of that (stage, microbatch) computes the weight gradients from it later, in the bubbles. The
tensor-parallel layers defer the same way (their regions are handed the store; the input gradient and its
communication stay in ``I``). Norm and embedding weights (a vector add), and weights computed in forward
(gathered replicated KV heads), are computed in ``I``. Activations are dropped right after the
backward that consumes them; the loss of a microbatch is scaled by 1/M so the gradient is the mean's.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from parallelisms.comm import Comm, Timeline
from parallelisms.parallel.pipeline.schedules import COMM, Action, Kind, Schedule, fuse_overlapped
from parallelisms.parallel.tensor import Region


class WeightGradStore:
    """Deferred weight-gradient work per (stage, microbatch): the Zero Bubble paper's W-store."""

    def __init__(self):
        self.key = None
        self.pending: dict[tuple[int, int], list] = {}

    @contextmanager
    def deferring(self, key: tuple[int, int]):
        self.key = key
        self.pending.setdefault(key, [])
        try:
            yield
        finally:
            self.key = None

    def can_defer(self, weight: torch.Tensor) -> bool:
        """Whether ``weight``'s gradient goes to the store now: inside :meth:`deferring`, for a weight whose
        gradient lands on a leaf (:func:`_grad_home`). A weight computed in forward is not: its gradient
        must flow on through autograd, so it is computed at once."""
        return self.key is not None and _grad_home(weight) is not None

    def put(self, weight: torch.Tensor, grad_out: torch.Tensor, inp: torch.Tensor) -> None:
        self.pending[self.key].append((weight, grad_out.detach(), inp.detach()))

    @torch.no_grad()
    def flush(self, key: tuple[int, int]) -> None:
        """The weight gradients deferred under ``key``, accumulated where autograd would have put them: the
        weight's ``.grad``, or for a view of a leaf buffer (a flat sharding unit's weight) the view's region
        of the buffer's ``.grad``."""
        for weight, grad_out, inp in self.pending.pop(key, []):
            grad = grad_out.flatten(0, -2).t().mm(inp.flatten(0, -2))
            home = _grad_home(weight)
            if home is weight:
                if weight.grad is None:
                    weight.grad = grad
                else:
                    weight.grad.add_(grad)
                continue
            if home.grad is None:
                home.grad = torch.zeros_like(home)
            assert home.grad.stride() == home.stride(), "the buffer's gradient has the buffer's layout"
            offset = home.grad.storage_offset() + weight.storage_offset() - home.storage_offset()
            home.grad.as_strided(weight.shape, weight.stride(), offset).add_(grad)


def _grad_home(weight: torch.Tensor) -> torch.Tensor | None:
    """The leaf whose ``.grad`` autograd accumulates ``weight``'s gradient into: the weight itself, or the
    leaf it is a view of; None for a weight computed from others."""
    if weight.is_leaf:
        return weight if weight.requires_grad else None
    base = weight._base
    return base if base is not None and base.is_leaf and base.requires_grad else None


class _SplitLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, store):
        ctx.save_for_backward(x, weight)
        # the parameter itself: under recomputation the saved weight unpacks as an alias of it, and the
        # deferred gradient must land on the parameter's .grad
        ctx.store, ctx.param = store, weight
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_in = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        if ctx.store.can_defer(ctx.param):
            ctx.store.put(ctx.param, grad_out, x)
            return grad_in, None, None
        return grad_in, grad_out.flatten(0, -2).t().mm(x.flatten(0, -2)), None


class SplitLinear(nn.Module):
    """A linear layer (same ``weight`` and ``bias`` parameters) whose weight gradient can be deferred; a bias's
    gradient (a sum over tokens) is computed in backward as usual."""

    def __init__(self, linear: nn.Linear, store: WeightGradStore):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.store = store

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _SplitLinearFn.apply(x, self.weight, self.store)
        return out if self.bias is None else out + self.bias


def split_linears(module: nn.Module, store: WeightGradStore) -> None:
    """Swap every ``nn.Linear`` inside ``module`` for a :class:`SplitLinear` (parameter names unchanged),
    and hand ``store`` to the tensor-parallel regions (their layers defer through ``region.store``)."""
    for parent in list(module.modules()):
        if isinstance(getattr(parent, "region", None), Region):
            parent.region.store = store
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, SplitLinear(child, store))


PREFETCH = 1  # receives posted ahead per peer
_TAG = {Kind.SEND_F: "F", Kind.RECV_F: "F", Kind.SEND_B: "B", Kind.RECV_B: "B"}


class Executor:
    """Runs rank ``rank``'s actions of ``schedule`` on its ``stages`` (stage index -> module).

    ``dtype``: of the activations exchanged. Hooks: ``forward_fn(action, module, x, targets)`` runs a stage forward (PipeDream swaps the weights),
    ``on_optimizer(action)`` runs an OPT action (PipeDream's update), ``on_stage_done(stage)`` follows the stage's
    last weight-gradient work before an OPT action of the stage or the end of the step (the data-parallel
    gradient sync starts there: once a step, or before each of PipeDream's updates). Messages hold 1/seq_shards
    of the sequence where the stages' residual stream is sequence-sharded (tensor parallelism's SP).
    """

    def __init__(self, schedule: Schedule, rank: int, stages: dict[int, nn.Module], comm: Comm,
                 timeline: Timeline, store: WeightGradStore | None = None,
                 forward_fn=None, on_optimizer=None, on_stage_done=None, dtype: torch.dtype | None = None):
        schedule = fuse_overlapped(schedule)  # DualPipe's F&B chunks adjacent (a no-op for other schedules)
        self.schedule, self.rank, self.stages, self.comm, self.timeline = schedule, rank, stages, comm, timeline
        self.seq_shards = next(iter(stages.values())).seq_shards
        # the activations' dtype: ``dtype`` (mixed precision's compute dtype), else the model's (its rotary
        # tables'; a sharding engine may own the parameters)
        self.dtype = dtype or next(iter(stages.values())).rope_cos.dtype
        self.actions = schedule.ranks[rank]
        self.store = store or WeightGradStore()
        self.forward_fn = forward_fn or (lambda a, module, x, y, **kwargs: module(x, y, **kwargs))
        self.on_optimizer = on_optimizer or (lambda a: None)
        self.on_stage_done = on_stage_done or (lambda stage: None)
        # the order in which each peer sends to this rank: receives are posted in that order
        self.send_order = {peer: [(_TAG[a.kind], a.stage, a.mb) for a in schedule.ranks[peer]
                                  if a.kind in (Kind.SEND_F, Kind.SEND_B) and a.peer == rank]
                           for peer in range(schedule.pp)}
        last, self.stage_done_at = {}, {}  # action index -> the stage whose gradients are complete there
        for i, a in enumerate(self.actions):
            if a.kind in (Kind.BACKWARD, Kind.BACKWARD_WEIGHT):
                last[a.stage] = i
            elif a.kind is Kind.OPTIMIZER and a.stage in last:
                self.stage_done_at[last.pop(a.stage)] = a.stage
        self.stage_done_at.update({i: s for s, i in last.items()})
        self.records: list[tuple[str, int, int, int, int]] = []  # (kind, stage, mb, start ns, end ns)
        self.peak_held = 0  # most (stage, microbatch) activations held at once in a step (until B, or W)

    # -- one step ------------------------------------------------------------------------------------
    def run(self, tokens: list[torch.Tensor], targets: list[torch.Tensor], hidden_dim: int,
            scale: float) -> list[torch.Tensor]:
        """Run the schedule once over microbatches ``tokens``/``targets``; the losses computed here."""
        rows, seq = tokens[0].shape
        self.shape, self.scale = (rows, seq // self.seq_shards, hidden_dim), scale
        self.tokens, self.targets = tokens, targets
        self.acts: dict = {}      # (stage, mb) -> output of stage, waiting for stage + 1
        self.grads: dict = {}     # (stage, mb) -> gradient of stage's input, waiting for stage - 1
        self.saved: dict = {}     # (stage, mb) -> (input, output, MoE term or None) until its backward
        self.posted: dict = {}    # (tag, stage, mb) -> (buffer, batch handle, peer) of posted receives
        self.cursor = {peer: 0 for peer in self.send_order}
        self.ahead = {peer: 0 for peer in self.send_order}  # posted receives not yet consumed, per peer
        self.sends: list = []     # posted send batches (their tensors stay alive until complete)
        self.losses: list[torch.Tensor] = []
        self.records = []
        self.peak_held = 0
        i = 0
        try:
            self._prefetch()
            while i < len(self.actions):
                j = i + 1
                if self.actions[i].kind in COMM:
                    while j < len(self.actions) and self.actions[j].kind in COMM:
                        j += 1
                    self._communicate(self.actions[i:j])
                elif self._overlapped(i):
                    self._compute_pair(i)
                    j = i + 2
                else:
                    self._compute(self.actions[i], i)
                i = j
            for pending, _ in self.sends:
                pending.wait()
        finally:
            self.sends, self.saved, self.acts, self.grads, self.posted = [], {}, {}, {}, {}
        return self.losses

    # -- communication ---------------------------------------------------------------------------------
    def _communicate(self, group: tuple[Action, ...]) -> None:
        sends = [(self.acts.pop((a.stage, a.mb)) if a.kind is Kind.SEND_F else self.grads.pop((a.stage, a.mb)),
                  a.peer) for a in group if a.kind in (Kind.SEND_F, Kind.SEND_B)]
        if sends:
            self.sends = [s for s in self.sends if not all(w.is_completed() for w in s[0].works)]
            self.sends.append((self.comm.send_recv(sends=sends), sends))
        recvs = [a for a in group if a.kind in (Kind.RECV_F, Kind.RECV_B)]
        batch: list = []
        for a in recvs:  # post, in the peer's send order, everything up to each wanted message
            key = (_TAG[a.kind], a.stage, a.mb)
            while key not in self.posted and all(k != key for k, _, _ in batch):
                batch.append(self._next_message(a.peer))
        self._post(batch)
        for a in recvs:
            buf, handle, peer = self.posted.pop((_TAG[a.kind], a.stage, a.mb))
            self.ahead[peer] -= 1
            if not handle["done"]:
                handle["pending"].wait()
                handle["done"] = True
            (self.acts if a.kind is Kind.RECV_F else self.grads)[(a.stage, a.mb)] = buf
        self._prefetch()

    def _next_message(self, peer: int) -> tuple:
        key = self.send_order[peer][self.cursor[peer]]
        self.cursor[peer] += 1
        return key, torch.empty(self.shape, dtype=self.dtype), peer

    def _post(self, batch: list) -> None:
        if batch:
            handle = {"pending": self.comm.send_recv(recvs=[(buf, peer) for _, buf, peer in batch]), "done": False}
            for key, buf, peer in batch:
                self.posted[key] = (buf, handle, peer)
                self.ahead[peer] += 1

    def _prefetch(self) -> None:
        """Keep each peer's next message posted, so that it lands while this rank computes (gloo moves the
        data only once the receive is posted; waiting is still where the schedule's RECV is). One batch
        per peer: a wait covers its whole batch, and another peer's message may come much later."""
        for peer, order in self.send_order.items():
            while self.ahead[peer] < PREFETCH and self.cursor[peer] < len(order):
                self._post([self._next_message(peer)])

    # -- computation -----------------------------------------------------------------------------------
    def _overlapped(self, i: int) -> bool:
        """A DualPipe F&B chunk starts at ``i``: an overlapped forward right before a backward."""
        a = self.actions[i]
        return (a.kind is Kind.FORWARD and a.overlap and i + 1 < len(self.actions)
                and self.actions[i + 1].kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT))

    def _compute_pair(self, i: int) -> None:
        """DualPipe's F&B chunk (DeepSeek-V3 report): the backward runs inside the forward, while the forward's
        first expert dispatch all-to-all is in flight (``ExpertParallelExperts.between``), so that
        communication hides behind the backward's computation; without expert parallelism, one after the
        other. The forward's record excludes the backward's time."""
        f, b = self.actions[i], self.actions[i + 1]
        ran = []

        def backward() -> None:
            if not ran:
                ran.append(Timeline.now())
                self._compute(b, i + 1)
                ran.append(Timeline.now())
        experts = [m for m in self.stages[f.stage].modules() if hasattr(m, "between")]
        for m in experts:
            m.between = backward
        try:
            self._compute(f, i)
        finally:
            for m in experts:
                m.between = None
        if ran:  # the forward's record spans the backward: take its time out
            kind, stage, mb, start, end = self.records.pop(-1)
            self.records.append((kind, stage, mb, start, end - (ran[1] - ran[0])))
        backward()

    def _compute(self, a: Action, index: int) -> None:
        start = Timeline.now()
        with self.timeline.span(f"{a.kind.value} s{a.stage} mb{a.mb}", "compute"):
            if a.kind is Kind.FORWARD:
                self._forward(a)
            elif a.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT):
                self._backward(a)
            elif a.kind is Kind.BACKWARD_WEIGHT:
                self.store.flush((a.stage, a.mb))
            elif a.kind is Kind.OPTIMIZER:
                self.on_optimizer(a)
        self.records.append((a.kind.value, a.stage, a.mb, start, Timeline.now()))
        if index in self.stage_done_at:
            self.on_stage_done(self.stage_done_at[index])

    def _forward(self, a: Action) -> None:
        key, module = (a.stage, a.mb), self.stages[a.stage]
        if a.stage == 0:
            x = self.tokens[a.mb]
        else:
            x = self.acts.pop((a.stage - 1, a.mb)).detach().requires_grad_()
        out = self.forward_fn(a, module, x, self.targets[a.mb] if module.output is not None else None)
        # a stage without the head carries its layers' MoE load-balancing term itself (into its backward
        # and the reported loss); the last stage's loss already holds its own
        aux = module.aux_loss_term() if module.output is None else None
        self.keep_forward(key, module, x, out, aux)

    def keep_forward(self, key: tuple[int, int], module, x, out, aux) -> None:
        """A forward's results kept: its saved activations held for backward, its loss (last stage) or its output
        for the next stage, and a stage's own MoE term among the losses."""
        self.saved[key] = (x, out, aux)
        self.peak_held = max(self.peak_held, len(self.saved) + len(self.store.pending))
        if module.output is not None:
            self.losses.append(out.detach())
        else:
            self.acts[key] = out.detach()
            if aux is not None:
                self.losses.append(aux.detach())

    def _backward(self, a: Action) -> None:
        key, module = (a.stage, a.mb), self.stages[a.stage]
        x, out, aux = self.saved.pop(key)
        grad = torch.full_like(out, self.scale) if module.output is not None else self.grads.pop((a.stage + 1, a.mb))
        outs, grads = ([out, aux], [grad, torch.full_like(aux, self.scale)]) if aux is not None else ([out], [grad])
        if a.kind is Kind.BACKWARD_INPUT:
            with self.store.deferring(key):
                torch.autograd.backward(outs, grads)
        else:
            torch.autograd.backward(outs, grads)
        if a.stage > 0:
            self.grads[key] = x.grad
