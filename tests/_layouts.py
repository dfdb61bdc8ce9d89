"""A small layout switching on given support-table features (shared by the support and transform tests)."""

import dataclasses

from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig
from parallelisms.mesh import ParallelDims
from parallelisms.parallel.cp_modes import MODES

DEEP = ModelConfig(vocab_size=256, dim=32, n_layers=8, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64)
DEEP_MOE = dataclasses.replace(DEEP, n_experts=4, top_k=2)
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "dualpipe", "dualpipev", "pipedream")


def layout_with(names) -> tuple[ModelConfig, TrainConfig, ParallelConfig]:
    """A small layout switching on the features ``names`` (and only what they imply)."""
    dims, opts, model, train = {}, {}, DEEP, TrainConfig(global_batch=16, seq_len=32)
    for name in names:
        if name == "ddp":
            dims["dp_replicate"] = 2
        elif name.startswith("zero"):
            opts["zero"], dims["dp_shard"] = int(name[-1]), 2
        elif name.startswith("fsdp-"):
            opts["fsdp"] = name[5:]
            dims.update(dp_replicate=2, dp_shard=2) if "hybrid" in name else dims.update(dp_shard=2)
        elif name in ("per_param", "reuse"):
            opts.update(fsdp="full_shard", fsdp_style=name)
            dims["dp_shard"] = 2
        elif name in ("tp", "sp", "tp-overlap"):
            dims["tp"] = 2
            opts.update({"sp": {"sequence_parallel": True}, "tp-overlap": {"tp_overlap": True}}.get(name, {}))
        elif name in MODES:  # a context-parallel mode (hierarchical: Ulysses 2 x ring 2)
            dims["cp"], opts["cp_attention"] = 4 if name == "hierarchical" else 2, name
            opts["cp_ulysses_size"] = 2 if name == "hierarchical" else 0
        elif name in ("moe", "ep"):
            model = DEEP_MOE
            if name == "ep":  # carved out of the data-parallel ranks (added below if no feature brings them)
                dims["ep"] = 2
        elif name == "pp" or name in SCHEDULES:
            dims["pp"] = 2
            if name in SCHEDULES:
                opts.update(schedule=name, chunks=2 if name == "interleaved" else 1)
        elif name.startswith("recompute-"):
            opts["recompute"] = name[len("recompute-"):]
        elif name == "bf16":
            opts["mixed_precision"] = "bf16"
        elif name == "float64":
            train = train.replace(dtype="float64")
    if dims.get("ep") and dims.get("dp_replicate", 1) * dims.get("dp_shard", 1) * dims.get("cp", 1) < 2:
        dims["dp_shard" if (opts.get("zero") or opts.get("fsdp")) else "dp_replicate"] = 2
    return model, train, ParallelConfig(ParallelDims(**dims), **opts)


def assert_same_dry_runs(expected: dict, got: dict) -> None:
    """Two dry runs of one layout agree: the precheck (passing), and per rank class the ledger, events and memory."""
    assert got["precheck"] == expected["precheck"] and expected["precheck"]["ok"], expected["precheck"]
    for rank, run in expected["runs"].items():
        assert got["runs"][rank].records == run.records, rank
        assert got["runs"][rank].events == run.events, rank
        assert got["runs"][rank].memory == run.memory, rank
