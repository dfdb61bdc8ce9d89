"""The support table is the one place that says which features cannot run together: validation reads it
(every listed pair fails before launch with one line naming both flags and the reason), and the README's
list is generated from it."""

import pathlib

import pytest

from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig, preset
from parallelisms.errors import ConfigError
from parallelisms.mesh import ParallelDims
from parallelisms.support import UNSUPPORTED, check_pairs, features, not_supported_markdown, validate_layout

DEEP = ModelConfig(vocab_size=256, dim=32, n_layers=8, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64)
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "dualpipe", "dualpipev", "pipedream")


def _layout_with(names) -> tuple[ModelConfig, TrainConfig, ParallelConfig]:
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
        elif name in ("ring", "ulysses"):
            dims["cp"], opts["cp_attention"] = 2, name
        elif name in ("moe", "ep"):
            model = preset("tiny-moe")
            if name == "ep":
                dims["ep"], dims["dp_replicate"] = 2, max(2, dims.get("dp_replicate", 1))
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
    return model, train, ParallelConfig(ParallelDims(**dims), **opts)


@pytest.mark.parametrize("pair", sorted(sorted(p) for p in UNSUPPORTED), ids="+".join)
def test_every_unsupported_pair_fails_before_launch_with_its_reason(pair):
    with pytest.raises(ConfigError) as exc:
        check_pairs(pair)
    assert UNSUPPORTED[frozenset(pair)] in str(exc.value) and "\n" not in str(exc.value)
    model, train, parallel = _layout_with(pair)
    assert set(pair) <= set(features(model, train, parallel))
    with pytest.raises(ConfigError):
        validate_layout(model, train, parallel)


def test_supported_pairs_pass_the_table():
    """A few pairs the runtime verifies (see the equivalence tests) are not in the table."""
    for pair in (("tp", "interleaved"), ("zero1", "pp"), ("recompute-full", "zb-v"), ("ring", "zero3"),
                 ("moe", "zero3"), ("sp", "1f1b"), ("fsdp-hybrid_shard", "tp"), ("sp", "ring"), ("sp", "ulysses"),
                 ("moe", "sp"), ("moe", "ring"), ("moe", "ulysses")):
        check_pairs(list(pair))


def test_readme_lists_exactly_the_table():
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    start = readme.index("<!-- support table: generated")
    block = readme[readme.index("\n", start) + 1:readme.index("<!-- end of support table -->")].strip()
    assert block == not_supported_markdown(), "regenerate README's list from parallelisms.support.not_supported_markdown()"
