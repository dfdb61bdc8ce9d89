"""The step model's outputs pinned: ``estimate`` (memory per rank, bytes per collective, step time and its
breakdown) and the bytes per collective kind of a train report's ``predicted_comm``, for a broad set of layouts
(every data-parallel engine and FSDP style, tp and sp, each context-parallel mode, expert parallelism with and
without EPLB, every pipeline schedule, recomputation, bf16, float64) on the cpu, h100 and a100 presets, against
``tests/data/estimates_snapshot.json``. A refactor of perf/ leaves every number where it was (1e-12 relative);
a change of the model rewrites the file on purpose: ``PYTHONPATH=src python3 tests/test_perf_snapshot.py --write``.
"""

import dataclasses
import json
import math
import pathlib
import sys

import pytest

from parallelisms.config import ParallelConfig, TrainConfig, preset
from parallelisms.errors import ConfigError
from parallelisms.mesh import ParallelDims
from parallelisms.options import FsdpStrategy, FsdpStyle, Schedule
from parallelisms.parallel.cp_modes import MODES
from parallelisms.perf.estimate import estimate
from parallelisms.perf.hardware import PRESETS as HARDWARE
from parallelisms.perf.model import predicted_comm_by_kind
from parallelisms.support import validate_layout

pytestmark = pytest.mark.fast

SNAPSHOT = pathlib.Path(__file__).parent / "data" / "estimates_snapshot.json"
TRAIN = {"small": TrainConfig(global_batch=32, seq_len=256), "tiny-moe": TrainConfig(global_batch=32, seq_len=128),
         "llama3-8b": TrainConfig(global_batch=64, seq_len=4096), "llama3-70b": TrainConfig(global_batch=64, seq_len=4096),
         "mixtral-8x7b": TrainConfig(global_batch=64, seq_len=4096)}


def _layouts(moe: bool) -> list[tuple[dict, dict, dict]]:
    """(dims, options, train changes) of the dense or the mixture-of-experts models."""
    out = []
    if moe:
        for ep in (2, 4):
            out += [({"dp_replicate": 4, "ep": ep}, {}, {}), ({"dp_shard": 4, "ep": ep}, {"zero": 1}, {}),
                    ({"dp_shard": 4, "ep": ep}, {"zero": 3, "mixed_precision": "bf16"}, {}),
                    ({"dp_shard": 4, "ep": ep}, {"fsdp": "full_shard", "fsdp_style": "per_param"}, {}),
                    ({"dp_replicate": 4, "ep": ep}, {"ep_balance": "measured", "ep_redundant": 1}, {}),
                    ({"dp_shard": 4, "ep": ep}, {"zero": 2, "ep_balance": "measured", "ep_redundant": 2}, {}),
                    ({"dp_replicate": 2, "tp": 2, "ep": 2}, {"sequence_parallel": True}, {}),
                    ({"dp_replicate": 2, "pp": 2, "ep": 2}, {"schedule": "1f1b", "recompute": "full"}, {})]
        for mode in MODES:  # the experts' all-to-alls beside context parallelism's
            out += [({"dp_replicate": 2, "cp": 2, "ep": 2}, {"cp_attention": mode, "zero": 1}, {}),
                    ({"cp": 2, "tp": 2, "ep": 2}, {"cp_attention": mode, "sequence_parallel": True}, {})]
        return out
    out += [({"dp_replicate": 8}, {}, {}), ({"dp_replicate": 4}, {}, {"grad_accum": 2}),
            ({"dp_replicate": 4}, {"mixed_precision": "bf16"}, {}), ({"dp_replicate": 2}, {}, {"dtype": "float64"})]
    out += [({"dp_shard": 8}, {"zero": z}, {}) for z in (1, 2, 3)]
    out += [({"dp_shard": 4}, {"zero": z, "mixed_precision": "bf16"}, {"grad_accum": 2}) for z in (1, 2, 3)]
    for strategy in FsdpStrategy:
        dims = {"dp_replicate": 2, "dp_shard": 4} if strategy.hybrid else {"dp_shard": 8}
        for style in FsdpStyle:
            out.append((dims, {"fsdp": strategy, "fsdp_style": style}, {}))
        out.append((dims, {"fsdp": strategy, "mixed_precision": "bf16", "fsdp_prefetch": 2}, {}))
    out += [({"tp": 4}, {}, {}), ({"tp": 4}, {"sequence_parallel": True}, {}),
            ({"dp_replicate": 2, "tp": 4}, {"sequence_parallel": True, "mixed_precision": "bf16"}, {}),
            ({"dp_replicate": 2, "tp": 2}, {"tp_overlap": True}, {})]
    for mode in MODES:
        out.append(({"dp_replicate": 2, "cp": 4}, {"cp_attention": mode, "cp_ulysses_size": 2 if mode == "hierarchical"
                                                   else 0}, {}))
        out.append(({"cp": 2, "tp": 2, "dp_shard": 2}, {"cp_attention": "ring" if mode == "hierarchical" else mode,
                                                         "zero": 1, "recompute": "full"}, {}))
    for schedule in Schedule:
        chunks = 2 if schedule is Schedule.INTERLEAVED else 1
        out.append(({"pp": 4, "dp_replicate": 2}, {"schedule": schedule, "chunks": chunks}, {}))
        out.append(({"pp": 2, "tp": 2, "dp_shard": 2}, {"schedule": schedule, "chunks": chunks, "zero": 1,
                                                        "mixed_precision": "bf16", "microbatches": 8}, {}))
    for recompute in ("selective", "full"):
        out += [({"dp_replicate": 2, "tp": 2}, {"recompute": recompute}, {}),
                ({"dp_shard": 4}, {"recompute": recompute, "fsdp": "full_shard", "fsdp_style": "reuse"}, {})]
    return out


def _cases() -> list[tuple[str, str, ParallelConfig, TrainConfig]]:
    """(label, model, layout, train) of every layout the checks accept for an estimate."""
    cases = []
    for model in TRAIN:
        cfg = preset(model)
        for dims, options, train_changes in _layouts(cfg.n_experts > 0):
            parallel = ParallelConfig(ParallelDims(**dims), **options)
            train = dataclasses.replace(TRAIN[model], **train_changes)
            try:
                validate_layout(cfg, train, parallel, runtime=False)
            except ConfigError:
                continue
            label = f"{model} {parallel.label()} {json.dumps(options, sort_keys=True)} {json.dumps(train_changes)}"
            cases.append((label, model, parallel, train))
    return cases


def compute() -> dict[str, dict]:
    """Every case's estimate and predicted bytes per kind, on each hardware preset, by label."""
    out = {}
    for label, model, parallel, train in _cases():
        cfg = preset(model)
        dtype_bytes = 2 if parallel.mixed_precision == "bf16" else 4
        for hw in ("cpu", "h100", "a100"):
            result = estimate(cfg, parallel, train, HARDWARE[hw])
            result["predicted_comm"] = predicted_comm_by_kind(cfg, parallel, train, dtype_bytes)
            out[f"{label} @{hw}"] = json.loads(json.dumps(result))
    return out


def _differences(old, new, path: str = "") -> list[str]:
    """Where ``new`` departs from ``old``: a key missing or added, or a number off by more than 1e-12 relative."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = [f"{path}/{k}: missing" for k in old.keys() - new.keys()]
        out += [f"{path}/{k}: added" for k in new.keys() - old.keys()]
        for k in old.keys() & new.keys():
            out += _differences(old[k], new[k], f"{path}/{k}")
        return out
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [d for i, (a, b) in enumerate(zip(old, new)) for d in _differences(a, b, f"{path}[{i}]")]
    if isinstance(old, float) and isinstance(new, (int, float)) and not isinstance(new, bool):
        return [] if math.isclose(old, new, rel_tol=1e-12, abs_tol=0.0) else [f"{path}: {old!r} -> {new!r}"]
    return [] if old == new else [f"{path}: {old!r} -> {new!r}"]


def test_estimates_match_the_snapshot():
    old = json.loads(SNAPSHOT.read_text())
    new = compute()
    assert len(old) >= 300 and old.keys() == new.keys()
    differences = _differences(old, new)
    assert not differences, f"{len(differences)} differences, e.g. " + "; ".join(differences[:5])


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    SNAPSHOT.write_text(json.dumps(compute(), sort_keys=True, separators=(",", ":")) + "\n")
    print(f"{len(json.loads(SNAPSHOT.read_text()))} estimates written to {SNAPSHOT}")
