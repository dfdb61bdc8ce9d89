"""Benchmark entries beyond DDP, one module per parallelism; importing them registers them in ``BENCHES``."""

import importlib

for _name in ("tp", "zero", "pipeline", "cp", "ep", "predict", "straggler", "ep_balance"):
    try:
        importlib.import_module(f"parallelisms.benches.{_name}")
    except ModuleNotFoundError as exc:  # an entry not written yet
        if exc.name != f"parallelisms.benches.{_name}":
            raise
