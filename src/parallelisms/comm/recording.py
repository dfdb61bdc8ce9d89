"""The recording transport: the comm layer with shapes in, shapes out and no data (the dry run's transport).

:class:`RecordingComm` is a :class:`~parallelisms.comm.ops.Comm` whose collectives allocate their results as the
real ones do (on fake tensors under ``FakeTensorMode``, so nothing at all) but move nothing: every call is recorded
in the :class:`~parallelisms.comm.ledger.CommLedger` exactly as a real run records it, and in
:attr:`RecordingLedger.events` with what the collective-order proof needs besides (the group's global member
ranks, the reduction, an all-to-all's splits, a point-to-point message's peer). The process group is torch's fake
one (``init_process_group("fake", ...)``, torch.testing's FakeProcessGroup) so that ``DeviceMesh`` and group
queries behave as on rank r of an N-rank world; no collective of it is ever issued.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallelisms.comm.ledger import CommLedger, ring_bytes_per_rank
from parallelisms.comm.ops import Comm, Comms, Pending

_REDUCTIONS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.MAX: "max", dist.ReduceOp.MIN: "min",
               dist.ReduceOp.AVG: "avg", dist.ReduceOp.PRODUCT: "product"}


@dataclass(frozen=True)
class Event:
    """One recorded collective or point-to-point message of one rank."""

    kind: str               # all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, send, recv, ...
    dim: str                # the mesh dimension (the Comm's name)
    ranks: tuple[int, ...]  # the group's members, global ranks in group order
    dtype: str
    numel: int              # as the ledger counts it (the full tensor of a gather/scatter)
    bytes_per_rank: float
    phase: str
    op: str = ""            # the reduction, for all-reduce and reduce-scatter
    splits: tuple = ()      # an all-to-all's (input splits, output splits) in rows; a broadcast's source
    peer: int = -1          # a point-to-point message's peer, a global rank
    shape: tuple = ()       # a point-to-point message's shape

    def signature(self) -> tuple:
        """What every member of the group must agree on (the collective-order proof)."""
        return self.kind, self.dtype, self.numel, self.op

    def describe(self) -> str:
        extra = f" {self.op}" if self.op else ""
        return f"{self.kind}{extra} {self.numel}x{self.dtype} ({self.phase})"


def _is_fake(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


class RecordingLedger(CommLedger):
    """A ledger that also keeps :class:`Event` records (global ranks, reductions, splits, peers)."""

    def __init__(self):
        super().__init__()
        self.events: list[Event] = []


class RecordingComm(Comm):
    """A Comm that records and never transports (see the module docstring). Results are allocated as the real
    collectives allocate them; their contents are whatever the allocation holds."""

    def __init__(self, name: str, group=None, ledger: RecordingLedger | None = None, timeline=None):
        super().__init__(name, group, ledger if ledger is not None else RecordingLedger(), timeline)
        self.members = tuple(dist.get_process_group_ranks(group)) if group is not None else (
            dist.get_rank() if dist.is_initialized() else 0,)
        self._op, self._splits = "", ()

    def _collectives(self, *args, **kwargs):  # never shared memory
        return None

    def _shared_memory_p2p(self):
        return False

    def _event(self, kind: str, dtype, numel: int, sent: float, **extra) -> None:
        self.ledger.events.append(Event(kind, self.name, self.members, str(dtype).removeprefix("torch."), numel,
                                        sent, self.ledger.phase, **extra))

    def _run(self, kind, tensor, full_numel, launch, async_op, result=None, sent_bytes=None, then=None):
        """Record as :meth:`Comm._run` does; launch nothing (``then`` still runs: it places a slice of the result)."""
        nbytes = full_numel * tensor.element_size()
        sent = ring_bytes_per_rank(kind, nbytes, self.size) if sent_bytes is None else sent_bytes
        self.ledger.add(kind, self.name, self.size, tensor.dtype, full_numel, sent)
        op, splits, self._op, self._splits = self._op, self._splits, "", ()
        self._event(kind, tensor.dtype, full_numel, sent, op=op, splits=splits)
        if async_op:
            return Pending(self, [], result, kind, None, then)
        if then is not None:
            then()
        return result

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, async_op=False, shared_memory=False):
        self._op = _REDUCTIONS.get(op, str(op))
        return super().all_reduce(tensor, op, async_op, shared_memory)

    def reduce_scatter(self, tensor, dim=0, async_op=False, out=None, op=dist.ReduceOp.SUM, scratch=False):
        self._op = _REDUCTIONS.get(op, str(op))
        return super().reduce_scatter(tensor, dim, async_op, out, op, scratch)

    def all_to_all(self, tensor, output_splits=None, input_splits=None, async_op=False):
        """Recorded with its splits. A real (not fake) tensor is a small integer exchange that decides shapes (an
        expert layer's token counts): answered as if every member sent what this rank sends (the dry run's
        balanced routing makes it so)."""
        if self.size == 1:
            return super().all_to_all(tensor, output_splits, input_splits, async_op)
        rows = tensor.shape[0]
        even = [rows // self.size] * self.size
        self._splits = (tuple(input_splits or even), tuple(output_splits or even))
        result = super().all_to_all(tensor, output_splits, input_splits, async_op)
        out = result.result if async_op else result
        if not _is_fake(tensor) and output_splits is None and input_splits is None:
            out.copy_(tensor.view(self.size, -1)[self.rank].repeat(self.size).view_as(out))
        return result

    def broadcast(self, tensor, src=0, async_op=False):
        self._splits = (src,)
        return super().broadcast(tensor, src, async_op)

    def all_gather_object(self, obj) -> list:
        """Every rank's object cannot be known from one rank: this rank's, repeated (reports only)."""
        if self.size > 1:
            self.ledger.add("all_gather_object", self.name, self.size, "object", 0, 0.0)
            self._event("all_gather_object", "object", 0, 0.0)
        return [obj] * self.size

    def send_recv(self, sends=(), recvs=()) -> Pending:
        for kind, items in (("send", sends), ("recv", recvs)):
            for t, peer in items:
                sent = ring_bytes_per_rank(kind, t.numel() * t.element_size(), self.size)
                self.ledger.add(kind, self.name, self.size, t.dtype, t.numel(), sent)
                self._event(kind, t.dtype, t.numel(), sent, peer=self.members[peer], shape=tuple(t.shape))
        return Pending(self, [], None, "p2p")


class RecordingComms(Comms):
    """:class:`~parallelisms.comm.ops.Comms` whose every dimension is a :class:`RecordingComm`."""

    comm_type = RecordingComm

    def __init__(self, meshes: dict | None = None, ledger: RecordingLedger | None = None, timeline=None):
        super().__init__(meshes, ledger if ledger is not None else RecordingLedger(), timeline)

    def close(self) -> None:
        self._comms, self.meshes = {}, {}
