"""The real run's side of the dry run's memory check: the peak of the bytes the C allocator has handed out, over
a real setup and training step, above what it held before the model was built.

Tensors on the CPU come from the C allocator (glibc's malloc: small blocks from its arenas, large ones mmapped),
so glibc's ``mallinfo2`` (in-use arena bytes ``uordblks`` plus mmapped bytes ``hblkhd``) follows live tensor
bytes, as torch's memory tracker does on a GPU's caching allocator; unlike the resident set it leaves out the
interpreter, the libraries' code and the allocator's free but unreturned pages. :class:`HeapPeak` samples it
after every operator (a dispatch mode: where tensors are made), which is where the dry run's account
(:mod:`.memory`) counts too; what the heap holds besides tensors (communication buffers, Python objects of more
than 512 bytes) is in the measurement and not in the dry run.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

from torch.utils._python_dispatch import TorchDispatchMode


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.cache
def _mallinfo2():
    mallinfo2 = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2
    mallinfo2.restype = _MallInfo2
    return mallinfo2


def heap_in_use() -> int:
    """Bytes the C allocator has handed out and not taken back (glibc's mallinfo2)."""
    info = _mallinfo2()()
    return info.uordblks + info.hblkhd


class HeapPeak(TorchDispatchMode):
    """The highest :func:`heap_in_use` after any operator while entered, over its value at entry."""

    def __init__(self):
        super().__init__()
        self.baseline = self.highest = 0

    def _sample(self) -> None:
        self.highest = max(self.highest, heap_in_use())

    @property
    def peak_bytes(self) -> int:
        return self.highest - self.baseline

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._sample()
        return out

    def __enter__(self):
        self.baseline = self.highest = heap_in_use()
        return super().__enter__()

    def __exit__(self, *exc):
        self._sample()
        return super().__exit__(*exc)


def real_run_peak(info, model_cfg, train, parallel, steps: int = 2) -> int:
    """In a rank process of :func:`parallelisms.launch.launch`: the real model, ``parallelize`` and ``steps``
    training steps on gloo (MoE routing balanced as in the dry run); returns this rank's :class:`HeapPeak` over
    them, from just before the model is built. The whole run goes once first and is dropped: torch's and the
    math libraries' first operators set up tables and workspaces they keep for the process's life (some 25 MiB
    here), which are the process's, not the run's."""
    import gc

    from parallelisms.comm import CommLedger, Comms, Timeline

    def comms():  # closing a trainer destroys its meshes' groups: each run makes its own
        return Comms(parallel.dims.build_meshes("cpu"), CommLedger(), Timeline(info.rank, enabled=False))

    _train(model_cfg, train, parallel, comms(), steps).close()
    gc.collect()
    measured_comms = comms()
    with HeapPeak() as heap:
        trainer = _train(model_cfg, train, parallel, measured_comms, steps)
    trainer.close()
    return heap.peak_bytes


def _train(model_cfg, train, parallel, comms, steps: int):
    from parallelisms.api import batches
    from parallelisms.dryrun.fake import balance_routing
    from parallelisms.model import build_model
    from parallelisms.train_setup import parallelize

    model = build_model(model_cfg, train.seed, "cpu", train.torch_dtype)
    balance_routing(model)
    trainer = parallelize(model, parallel, train, comms)
    for inputs, targets in batches(train, parallel, steps=steps, device="cpu"):
        trainer.train_step(inputs, targets)
    return trainer


def measured_peaks(model_cfg, train, parallel) -> list[int]:
    """:func:`real_run_peak` of every rank of the layout, in real processes (one thread each)."""
    from parallelisms.launch import launch

    return launch(real_run_peak, parallel.dims.world_size, model_cfg, train, parallel, threads=1)
