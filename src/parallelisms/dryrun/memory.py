"""Memory per rank from the code: every storage the dry run's step creates, live bytes over time, the peak,
what was live at the peak, and when it came.

:class:`MemoryAccount` is a dispatch mode (as torch.distributed._tools.mem_tracker's MemTracker is) that sees
every operator's outputs. Each new storage is counted from its creation until it is freed (a weak reference's
callback) or resized (``UntypedStorage.resize_``, which the sharding engines use to free a gathered parameter).
At each new peak it keeps which storages were live, and the moment: the ledger phase (forward, backward,
optimizer) and the module whose forward last began (the layer). After the step, each storage live at the peak
is classed as parameters, gradients, optimizer state, buffers (module buffers) or activations (everything
else: activations, temporaries, communication buffers), by what holds it at the end of the step.
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

CATEGORIES = ("params", "grads", "optimizer", "buffers", "activations")


class MemoryAccount(TorchDispatchMode):
    """Live bytes and the peak over the storages created while it is entered (see the module docstring)."""

    def __init__(self, enabled: bool = True):
        super().__init__()
        self.enabled = enabled
        self.live: dict[int, int] = {}  # storage serial -> bytes
        self._serial: dict[int, int] = {}  # live storage's key (its C pointer, reused once freed) -> serial
        self._refs: dict[int, weakref.ref] = {}
        self._count = itertools.count()
        self.current = self.peak = 0
        self.at_peak: dict[int, int] = {}  # storage key -> bytes, at the peak
        self.moment = ("setup", "")
        self.step_start = 0          # live bytes as the step began (the persistent state)
        self._trainer = None
        self.module = ""             # the layer whose forward last began
        self._hook = self._resize = None
        self.window_peak, self.window_module = 0, ""  # the highest live bytes since :meth:`open_window`, and where

    # -- tracking ----------------------------------------------------------------------------------
    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._serial:
            return
        serial = self._serial[key] = next(self._count)
        self.live[serial] = storage.nbytes()
        self.current += self.live[serial]
        self._refs[serial] = weakref.ref(storage, lambda _, k=key, s=serial: self._free(k, s))
        self._maybe_peak()

    def _free(self, key: int, serial: int) -> None:
        self.current -= self.live.pop(serial, 0)
        self._refs.pop(serial, None)
        if self._serial.get(key) == serial:
            del self._serial[key]

    def _maybe_peak(self) -> None:
        if self.current > self.window_peak:
            self.window_peak, self.window_module = self.current, self.module
        if self.current > self.peak:
            self.peak = self.current
            self.at_peak = dict(self.live)
            self.moment = (self._phase(), self.module)

    def open_window(self) -> int:
        """Start watching the highest live bytes from now (:attr:`window_peak`); returns the live bytes now."""
        self.window_peak, self.window_module = self.current, self.module
        return self.current

    def offer_peak(self, delta: int, module: str) -> None:
        """A replayed action (:mod:`.replay`) reached ``delta`` bytes over the live bytes now, at ``module``: a
        peak if that is the highest yet (what it held over the live storages counts as activations)."""
        if self.current + delta > self.peak:
            self.peak = self.current + delta
            self.at_peak = {**self.live, -1: delta}
            self.moment = (self._phase(), module)

    def _phase(self) -> str:
        if self._trainer is None:
            return "setup"
        return self._trainer.comms.ledger.phase

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def __enter__(self):
        if not self.enabled:
            return self
        account = self
        original = torch.UntypedStorage.resize_

        def resize_(storage, size):
            serial = account._serial.get(storage._cdata)
            result = original(storage, size)
            if serial in account.live:
                account.current += size - account.live[serial]
                account.live[serial] = size
                account._maybe_peak()
            return result

        self._resize = original
        torch.UntypedStorage.resize_ = resize_
        self._hook = torch.nn.modules.module.register_module_forward_pre_hook(self._enter_module)
        return super().__enter__()

    def __exit__(self, *exc):
        if not self.enabled:
            return None
        torch.UntypedStorage.resize_ = self._resize
        self._hook.remove()
        return super().__exit__(*exc)

    def _enter_module(self, module, _inputs) -> None:
        self.module = getattr(module, "_dry_run_name", self.module)

    def start_step(self, trainer) -> None:
        """Called between ``parallelize`` and the step: names the modules (for the moment of the peak), takes the
        persistent bytes and starts the peak over (the steps' peak, not setup's)."""
        self._trainer = trainer
        self.step_start = self.current
        # the peak is the step's: the full model each rank builds before parallelize shards it is setup's
        self.peak, self.at_peak, self.moment = self.current, dict(self.live), ("setup", "")
        for stage in _modules_of(trainer):
            for name, module in stage.named_modules():
                if name.count(".") <= 1 and name.startswith("layers.") or name in ("tok_embeddings", "output", "loss"):
                    module._dry_run_name = name

    # -- report ------------------------------------------------------------------------------------
    def report(self) -> dict:
        """Peak bytes, its split by category, the persistent bytes before the step, and the moment of the peak."""
        if not self.enabled:
            return {}
        split = dict.fromkeys(CATEGORIES, 0)
        kinds = _storage_kinds(self._trainer, self._serial) if self._trainer is not None else {}
        for key, nbytes in self.at_peak.items():
            split[kinds.get(key, "activations")] += nbytes
        phase, module = self.moment
        return {"peak_bytes": self.peak, "split": split, "persistent_bytes": self.step_start,
                "peak_phase": phase, "peak_module": module}


def _modules_of(trainer) -> list:
    """The modules this rank trains (the pipeline's stages, or the one model)."""
    stages = getattr(trainer.forward_backward, "stages", None)
    if isinstance(stages, dict):
        return list(stages.values())
    return [trainer.forward_backward.model]


def _storage_kinds(trainer, serials: dict[int, int]) -> dict[int, str]:
    """Storage serial -> category, by what holds each storage at the end of the step."""
    kinds = {}

    def mark(tensors, kind):
        for t in tensors:
            if isinstance(t, torch.Tensor):
                kinds.setdefault(serials.get(t.untyped_storage()._cdata), kind)

    for optimizer in trainer.optimizers:
        mark((v for state in optimizer.state.values() for v in state.values()), "optimizer")
    params = list(trainer.grad_sync.parameters())
    modules = _modules_of(trainer)
    params += [p for m in modules for p in m.parameters()]
    mark((p.grad for p in params), "grads")
    mark(params, "params")
    mark((b for m in modules for b in m.buffers()), "buffers")
    return kinds
