"""Communication: the accounted collectives, the ledger, and the timeline.

Each name is imported from its module on first use (PEP 562), so that ``parallelisms.comm.ledger``, which the
performance model reads, loads without torch.
"""

import importlib

_MODULES = {
    "CommLedger": "ledger", "CommRecord": "ledger", "ring_bytes_per_rank": "ledger",
    **dict.fromkeys(("all_to_all", "copy_to_group", "gather_along", "reduce_from_group", "reduce_scatter_along",
                     "split_along"), "autograd"),
    "Comm": "ops", "CommError": "ops", "Comms": "ops", "Pending": "ops",
    "Timeline": "trace", "write_chrome_trace": "trace",
}
__all__ = sorted(_MODULES)


def __getattr__(name: str):
    if name in _MODULES:
        return getattr(importlib.import_module(f"parallelisms.comm.{_MODULES[name]}"), name)
    raise AttributeError(f"module 'parallelisms.comm' has no attribute {name!r}")
