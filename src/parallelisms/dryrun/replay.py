"""Identical microbatches run once: the dry run's pipeline executor replays a stage's forward or backward of a
middle microbatch from the first middle one it ran, instead of dispatching every operator again.

A pipeline stage's forward (or full backward) of microbatch m runs the same operators on the same shapes, issues
the same collectives in the same order and allocates and frees the same bytes for every m, except where the
step's state changes: the first microbatch creates the gradients (and mixed precision's fp32 main gradients),
the last one is where gradient sync may begin. So for each (step, action kind, stage), microbatch 0 and the last
microbatch run for real, the first middle microbatch runs for real and is recorded, and every later middle one
is replayed from that recording:

* the ledger gets the recorded calls again (same records, same events, same phase);
* the executor's state changes as the real action changes it: a forward pops its input, leaves its output
  where the schedule sends it (or its loss) and holds its saved activations until its backward; a backward
  drops them, takes the incoming gradient and leaves its input's gradient to send;
* memory (:class:`.memory.MemoryAccount`): the action's peak over its start (at the layer where it came) is
  offered as a peak, and what the forward kept besides its output (the autograd graph's saved tensors) is one
  storage that lives until its backward, so live bytes after each action equal the real run's.

Only forward and full backward are replayed, as a pair; a split backward (``I``/``W``: the weight-gradient store
holds tensors across actions), DualPipe's fused F&B chunk, PipeDream's weight stashing and MoE models (a layer
keeps its last routing's statistics on itself) run for real.
``tests/test_dryrun_replay.py`` proves the shortcut: ledger, events and memory equal the full run's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from parallelisms.parallel.pipeline.schedules import Action, Kind


@dataclass
class Recording:
    """What one real run of a (kind, stage) action did."""

    records: list              # the ledger's CommRecords it added
    events: list               # and their events
    peak_delta: int            # its peak live bytes over its start
    peak_module: str           # the layer whose forward last began at that peak
    end_delta: int             # live bytes after it, over its start
    end_module: str            # the layer whose forward last began, after it
    outputs: dict = field(default_factory=dict)  # the shapes it left for the executor


def _shape_of(t: torch.Tensor | None):
    return None if t is None else (tuple(t.shape), t.stride(), t.dtype)


def _empty(shape) -> torch.Tensor | None:
    return None if shape is None else torch.empty_strided(shape[0], shape[1], dtype=shape[2])


class MicrobatchReplay:
    """Installs itself on ``executor`` (its ``run``, ``_forward`` and ``_backward``); ``account`` is the rank's
    memory account (disabled: no memory is replayed) and ``ledger`` its recording ledger."""

    def __init__(self, executor, ledger, account):
        self.executor, self.ledger, self.account = executor, ledger, account
        self.last = executor.schedule.microbatches - 1
        self.eligible = self._eligible()
        self.recordings: dict = {}  # (kind, stage) -> Recording, this step's
        self.replaying: set = set()  # (stage, microbatch) whose forward was replayed: so is its backward
        self.replayed = 0  # actions replayed, over all steps
        self._run, self._real = executor.run, {Kind.FORWARD: executor._forward, Kind.BACKWARD: executor._backward}
        executor.run = self.run
        executor._forward = self.forward
        executor._backward = self.backward

    def run(self, *args, **kwargs):
        self.recordings = {}  # a step's state differs from the last one's (the optimizer's state, the grads)
        return self._run(*args, **kwargs)

    def _eligible(self) -> set:
        """The (stage, microbatch) pairs whose forward and backward may both be replayed: middle microbatches
        whose forward is not fused with a backward and whose backward is a full one, not in a fused chunk."""
        actions, forwards, backwards = self.executor.actions, set(), set()
        for i, a in enumerate(actions):
            fused = i > 0 and actions[i - 1].kind is Kind.FORWARD and actions[i - 1].overlap
            if a.kind is Kind.FORWARD and not a.overlap:
                forwards.add((a.stage, a.mb))
            elif a.kind is Kind.BACKWARD and not fused:
                backwards.add((a.stage, a.mb))
        return {(s, m) for s, m in forwards & backwards if 0 < m < self.last}

    def forward(self, a: Action) -> None:
        key = (a.stage, a.mb)
        if key not in self.eligible:
            return self._real[Kind.FORWARD](a)
        if (Kind.FORWARD, a.stage) not in self.recordings:
            self.recordings[Kind.FORWARD, a.stage] = self._record(a, self._real[Kind.FORWARD])
            return None
        self.replaying.add(key)
        return self._replay_forward(a, self.recordings[Kind.FORWARD, a.stage])

    def backward(self, a: Action) -> None:  # a full backward, or a split one's input part (never replayed)
        key = (a.stage, a.mb)
        if key not in self.replaying:
            if key in self.eligible and (Kind.BACKWARD, a.stage) not in self.recordings:
                self.recordings[Kind.BACKWARD, a.stage] = self._record(a, self._real[Kind.BACKWARD])
                return None
            return self._real[Kind.BACKWARD](a)
        self.replaying.remove(key)
        self.replayed += 2
        return self._replay_backward(a, self.recordings[Kind.BACKWARD, a.stage])

    # -- the real run, recorded ---------------------------------------------------------------------------
    def _record(self, a: Action, real) -> Recording:
        ex, ledger, account = self.executor, self.ledger, self.account
        n_records, n_events, start = len(ledger.records), len(ledger.events), account.open_window()
        real(a)
        key = (a.stage, a.mb)
        outputs = {}
        if a.kind is Kind.FORWARD:
            _, out, aux = ex.saved[key]
            outputs = {"out": _shape_of(out), "aux": _shape_of(aux)}
        elif a.stage > 0:
            outputs = {"grad": _shape_of(ex.grads[key])}
        return Recording(ledger.records[n_records:], ledger.events[n_events:], account.window_peak - start,
                         account.window_module, account.current - start, account.module, outputs)

    def _replay_ledger(self, rec: Recording) -> None:
        for r in rec.records:
            self.ledger.add(r.kind, r.dim, r.group_size, r.dtype, r.numel, r.bytes_per_rank)
        self.ledger.events.extend(rec.events)
        self.account.module = rec.end_module

    # -- replays ------------------------------------------------------------------------------------------
    def _replay_forward(self, a: Action, rec: Recording) -> None:
        """As :meth:`Executor._forward`: input popped, output (or loss) left, saved activations held."""
        ex, account = self.executor, self.account
        start = account.current
        account.offer_peak(rec.peak_delta, rec.peak_module)
        self._replay_ledger(rec)
        key, module = (a.stage, a.mb), ex.stages[a.stage]
        x = ex.tokens[a.mb] if a.stage == 0 else ex.acts.pop((a.stage - 1, a.mb)).detach().requires_grad_()
        out, aux = _empty(rec.outputs["out"]), _empty(rec.outputs["aux"])
        graph = rec.end_delta - (account.current - start)  # the saved tensors: freed with ``out`` at backward
        if graph < 0:
            raise RuntimeError(f"dry-run replay of {a}: the recorded forward kept {rec.end_delta} bytes, less than its "
                               f"output's {account.current - start} (run with replay=False)")
        if graph:
            out._dry_run_graph = torch.empty(graph, dtype=torch.uint8)
        ex.keep_forward(key, module, x, out, aux)

    def _replay_backward(self, a: Action, rec: Recording) -> None:
        """As :meth:`Executor._backward`: saved activations and incoming gradient dropped, input gradient left."""
        ex, account = self.executor, self.account
        start = account.current
        account.offer_peak(rec.peak_delta, rec.peak_module)
        self._replay_ledger(rec)
        key = (a.stage, a.mb)
        ex.saved.pop(key)
        if ex.stages[a.stage].output is None:
            ex.grads.pop((a.stage + 1, a.mb))
        if a.stage > 0:
            ex.grads[key] = _empty(rec.outputs["grad"])
        if account.current - start != rec.end_delta:
            raise RuntimeError(f"dry-run replay of {a}: live bytes change by {account.current - start}, the recorded "
                               f"backward changed them by {rec.end_delta} (run with replay=False)")
