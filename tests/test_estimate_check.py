"""``estimate`` against the dry run (``estimate --check``): memory per rank within 5% and bytes per collective per
step equal, on a small model with the mechanisms of the real presets at 8 to 64 fake ranks; the memory closed
forms against Korthikanti et al. (MLSys'23) Table 2 and against the tensors this runtime's block keeps."""

import functools
import json

import pytest

from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig
from parallelisms.mesh import ParallelDims
from parallelisms.perf.memory import block_activation_bytes, head_bytes
from parallelisms.perf.model import activation_bytes_per_layer

# a Llama-shaped model small enough to dry-run in a second: GQA, SwiGLU of 3.5h, a vocabulary 32x the hidden size,
# sequences 8x the hidden size (activations, not model states, fill memory, as at 8K tokens on the real presets)
SHAPE = ["--hidden", "128", "--heads", "8", "--kv-heads", "2", "--ffn", "448", "--vocab", "4096", "--layers", "4",
         "--seq-len", "1024"]

LAYOUTS = {  # name: flags (each layout's world size in the name)
    "dp8 zero1 bf16": "--dp 8 --zero 1 --mixed-precision bf16 --global-batch 8",
    "dp8 zero2 grad-accum": "--dp 8 --zero 2 --grad-accum 2 --global-batch 16",
    "dp8 fsdp per_param bf16 full recompute": "--dp 8 --fsdp full_shard --fsdp-style per_param --mixed-precision bf16 "
                                              "--recompute full --global-batch 8",
    "dp8 fsdp reuse": "--dp 8 --fsdp full_shard --fsdp-style reuse --global-batch 8",
    "hsdp 2x4 bf16": "--dp-replicate 2 --dp-shard 4 --fsdp hybrid_shard --mixed-precision bf16 --global-batch 8",
    "dp4 tp2 sp full recompute bf16": "--dp 4 --tp 2 --sp --recompute full --mixed-precision bf16 --global-batch 4",
    "dp2 cp2 ulysses tp2 selective": "--dp 2 --cp 2 --cp-attention ulysses --tp 2 --recompute selective "
                                     "--global-batch 2",
    "dp4 cp2 ring zero3": "--dp 4 --cp 2 --zero 3 --global-batch 4",
    "dp4 cp2 allgather zero1": "--dp 4 --cp 2 --cp-attention allgather --zero 1 --global-batch 4",
    "dp2 cp4 hierarchical": "--dp 2 --cp 4 --cp-attention hierarchical --cp-ulysses-size 2 --global-batch 2",
    "dp4 pp2 tp2 sp zb-h1 zero1 (16)": "--dp 4 --pp 2 --tp 2 --sp --schedule zb-h1 --zero 1 --global-batch 16",
    "dp8 pp2 interleaved tp4 sp (64)": "--dp 8 --pp 2 --tp 4 --sp --schedule interleaved --chunks 2 "
                                       "--mixed-precision bf16 --global-batch 32",
}


def _checked(argv: list[str]) -> dict:
    """``estimate --check``'s object for a layout's command-line flags (a layout two tests check is dry-run once)."""
    from parallelisms.api import configure

    cfg = configure(argv)
    return _check(cfg.model, cfg.layout, cfg.train)


@functools.lru_cache(maxsize=None)
def _check(model: ModelConfig, layout: ParallelConfig, train: TrainConfig) -> dict:
    from parallelisms.estimate_check import check
    from parallelisms.perf.estimate import estimate
    from parallelisms.perf.hardware import load_hardware

    return check(model, layout, train, estimate(model, layout, train, load_hardware("h100"))["memory_per_rank"])


@pytest.mark.parametrize("name", LAYOUTS)
def test_estimate_agrees_with_the_dry_run(name):
    out = _checked(SHAPE + LAYOUTS[name].split())
    assert abs(out["memory"]["total"]["relative"]) <= 0.05, out["memory"]
    assert out["collectives"] and out["collectives_ok"], {k: v for k, v in out["collectives"].items() if v["difference"]}
    for kind in ("params", "optimizer"):  # the model states are exact
        assert out["memory"][kind]["difference"] == pytest.approx(0, abs=1024), kind
    assert out["ok"]


# short sequences: the model states, not the activations, fill memory, so the peak comes after the loss
LATE_PEAKS = {  # name: (flags, the estimate's grads at the peak: the fp32 shards' or the full fp32 gradient)
    "dp4 tp2 sp zero1 bf16 full recompute: end of backward, the last unit's fp32 copy in flight":
        "--dp 4 --tp 2 --sp --zero 1 --recompute full --mixed-precision bf16 --global-batch 4",
    "dp4 tp2 sp zero1 fp32 full recompute: end of backward, the last unit's gradients concatenated":
        "--dp 4 --tp 2 --sp --zero 1 --recompute full --global-batch 4",
    "dp4 tp2 sp no_shard bf16 full recompute: the optimizer's temporaries":
        "--dp 4 --tp 2 --sp --recompute full --mixed-precision bf16 --global-batch 4",
    "dp4 tp2 sp zero2 bf16 full recompute: end of backward, the first unit's gradient and its fp32 copy":
        "--dp 4 --tp 2 --sp --zero 2 --recompute full --mixed-precision bf16 --global-batch 4",
    "dp4 tp2 sp zero2 fp32 full recompute: end of backward, the first unit's gradient being reduced":
        "--dp 4 --tp 2 --sp --zero 2 --recompute full --global-batch 4",
}


@pytest.mark.parametrize("name", LATE_PEAKS)
def test_engines_holding_the_full_gradient_peak_after_the_loss(name):
    """ZeRO-1 and NO_SHARD keep every unit's full gradient until the optimizer, ZeRO-2 the first unit's as it is
    reduced: with few activations their peak is at the end of backward or in the optimizer, not at the loss
    (perf/memory.py: end_of_backward)."""
    shape = SHAPE[:SHAPE.index("--seq-len")] + ["--seq-len", "128"]
    out = _checked(shape + LATE_PEAKS[name].split())
    assert out["peak_phase"] in ("backward", "optimizer"), out["peak_phase"]
    assert abs(out["memory"]["total"]["relative"]) <= 0.05, out["memory"]
    for kind in ("params", "optimizer"):
        assert out["memory"][kind]["difference"] == pytest.approx(0, abs=1024), kind
    if "zero1" in name:  # the gradients the peak holds: the fp32 shards' (bf16) or the full fp32 gradient
        assert out["memory"]["grads"]["difference"] == pytest.approx(0, abs=1024), out["memory"]["grads"]
    assert out["ok"]


@pytest.mark.parametrize("flags", [
    "--schedule 1f1b --global-batch 8 --microbatches 4",  # the first backward's gradients beside 1 microbatch
    "--schedule gpipe --global-batch 4 --microbatches 2",  # the peak before any gradient
])
def test_pipeline_gradients_exist_from_the_first_backward(flags):
    """A bf16 pipeline stage's gradients (its fp32 main gradient, once) appear at its first backward, which the
    estimate walks with the schedule: on short sequences, where they weigh as much as the activations, the estimate
    holds within 5% (counting them at every moment, twice, put it 36% over)."""
    shape = SHAPE[:SHAPE.index("--seq-len")] + ["--seq-len", "128"]
    out = _checked(shape + "--dp 2 --pp 2 --tp 2 --sp --zero 1 --mixed-precision bf16".split() + flags.split())
    assert abs(out["memory"]["total"]["relative"]) <= 0.05, out["memory"]
    assert out["ok"], out


def _rank0(cfg):
    """Rank 0's dry run without memory (its ledger: one step)."""
    from parallelisms.dryrun import dry_run_rank

    return dry_run_rank(cfg.model, cfg.train, cfg.layout, 0, memory=False)


def _bytes(argv: list[str]) -> tuple[dict, bool]:
    """The estimate's and the dry run's bytes per collective per step of rank 0, side by side, and whether equal."""
    from parallelisms.api import configure
    from parallelisms.estimate_check import compare_collectives, estimated_collectives, recorded_collectives

    cfg = configure(argv)
    estimated = estimated_collectives(cfg.model, cfg.layout, cfg.train)
    return compare_collectives(estimated, recorded_collectives(_rank0(cfg)))


@pytest.mark.parametrize("flags", [
    "--zero 2 --mixed-precision bf16",  # a block's gradient made while the head's is reduced
    "--zero 2 --mixed-precision bf16 --recompute full",
    "--zero 2",  # fp32: the head's gradient made beside every block's activations
    "--zero 2 --recompute full",  # fp32: the embedding's gradient made beside the first block's in flight
    "--zero 2 --mixed-precision bf16 --grad-accum 2 --global-batch 16",  # every unit's shard from the first microbatch
    "",  # DDP: its buckets, rebuilt once after the first step (the old ones dropped first)
    "--recompute full",  # DDP: the optimizer's temporaries of the largest parameter beside the buckets
])
def test_small_gradient_buckets(flags):
    """0.5 MB buckets at 64 positions, where the model states weigh as much as the activations: ZeRO-2's every unit
    (a block: 0.8 MB in fp32) is a bucket of its own, reduced one at a time in backward, one in flight, and the peak
    comes as a unit's gradient is made or launched (perf/memory.py: reduced_unit_by_unit); DDP holds its buckets."""
    batch = [] if "--global-batch" in flags else ["--global-batch", "8"]
    out = _checked(SHAPE[:SHAPE.index("--seq-len")] + f"--seq-len 64 --dp 8 --bucket-mb 0.5 {flags}".split() + batch)
    assert abs(out["memory"]["total"]["relative"]) <= 0.02, out["memory"]
    assert out["ok"], out


@pytest.mark.parametrize("flags", [
    "--schedule zb-v --mixed-precision bf16",  # the weight passes' deposited bf16 gradients
    "--schedule zb-v --mixed-precision bf16 --zero 1",  # units merged: the whole stage deposits
    "--schedule dualpipev --mixed-precision bf16",  # the second stage's main gradient only after its backward
    "--schedule zb-h1 --mixed-precision bf16 --zero 1",  # the last rank's weight passes after all its input passes
    "--schedule 1f1b --zero 1",  # fp32: the flat gradient held once
    "--schedule zb-h1 --zero 1",  # fp32: the input pass forms the merged unit's gradient beside the loss's tensors
    "--schedule dualpipev --zero 1",  # fp32: its loss's backward is mostly a full one, which does not
    "--schedule 1f1b --zero 3 --mixed-precision bf16",  # full sharding holds one fp32 main gradient, as ZeRO-1
    "--schedule zb-h1 --fsdp full_shard --fsdp-style per_param --mixed-precision bf16",  # and the deposits
    "--schedule interleaved --chunks 2 --zero 3",  # fp32 full sharding: the stages' accumulated gradients
    "--schedule gpipe --fsdp full_shard --fsdp-style reuse --mixed-precision bf16",  # buffer reuse: every unit's
    "--schedule dualpipe --fsdp full_shard --fsdp-style reuse",  # fp32 gradient buffer, from the first forward on
])
def test_pipeline_gradients_by_stage(flags):
    """A pipeline rank's gradients stage by stage, from the walk of its actions (perf/memory.py: StageGradients):
    a stage's (fp32 main or flat) gradient from its own first backward; under a split backward in bf16 the
    weight passes' deposited bf16 gradients (each unit's size) from a weight pass to the stage's next backward,
    and a weight pass that begins while its remainder is held; a backward forms one flat unit's gradient."""
    shape = SHAPE[:SHAPE.index("--seq-len")] + ["--seq-len", "128"]
    out = _checked(shape + f"--dp 2 --pp 2 --global-batch 8 --microbatches 4 {flags}".split())
    assert abs(out["memory"]["total"]["relative"]) <= 0.05, out["memory"]
    assert out["ok"], out


@pytest.mark.parametrize("vocab, flags", [
    # a block's backward, not the loss, is the peak: two gathered blocks and two fp32 main gradients
    (512, "--dp 4 --fsdp-style per_param --global-batch 4"),
    # the flat engine: two gathered blocks, the block's bf16 gradient, the previous one's and its fp32 copy
    (512, "--dp 4 --global-batch 4"),
    # rows that do not divide over 6 ranks: every parameter padded to a multiple of them, gathered and reduced
    (4100, "--dp 6 --fsdp-style per_param --global-batch 6"),
])
def test_fully_sharded_in_a_blocks_backward(vocab, flags):
    """FULL_SHARD in bf16 with full recompute (perf/sharded_backward.py; perf/model.py: per_param_padding),
    as Llama 3 405B on FSDP 128 x tp 8 runs it (its 16,032-row vocabulary shards pad to 16,128 per parameter)."""
    shape = SHAPE[:SHAPE.index("--vocab")] + ["--vocab", str(vocab), "--layers", "4", "--seq-len", "128"]
    out = _checked(shape + f"--fsdp full_shard --mixed-precision bf16 --recompute full {flags}".split())
    assert out["collectives"]["all_gather/dp"]["dry_run"] > 0
    assert out["collectives_ok"], {k: v for k, v in out["collectives"].items() if v["difference"]}
    assert abs(out["memory"]["total"]["relative"]) <= 0.05, out["memory"]


@pytest.mark.parametrize("flags", ["--dp 2 --tp 4 --global-batch 2",
                                   "--dp 2 --tp 4 --sp --zero 1 --mixed-precision bf16 --global-batch 2"])
def test_a_vocabulary_tensor_parallelism_does_not_divide(flags):
    """4,099 rows over tp 4: the runtime pads the embedding and the head to 1,025 rows a rank
    (parallel/row_split.py), and the estimate prices those rows (perf/model.py: vocab_rows) in the model states and
    in the data-parallel traffic of the padded tables."""
    shape = SHAPE[:SHAPE.index("--vocab")] + ["--vocab", "4099", "--layers", "2", "--seq-len", "128"]
    out = _checked(shape + flags.split())
    assert out["collectives_ok"], {k: v for k, v in out["collectives"].items() if v["difference"]}
    assert any(k.endswith("/dp") and v["dry_run"] > 0 for k, v in out["collectives"].items())
    for kind in ("params", "grads"):
        assert out["memory"][kind]["difference"] == 0, kind
    assert out["memory"]["optimizer"]["difference"] == pytest.approx(0, abs=1024)
    assert abs(out["memory"]["total"]["relative"]) <= 0.05, out["memory"]
    assert out["ok"], out


@pytest.mark.parametrize("flags", ["--dp 2 --cp 2 --pp 2 --zero 1 --global-batch 8 --microbatches 4",
                                   "--dp 2 --cp 2 --fsdp full_shard --fsdp-style per_param --global-batch 4"])
def test_the_gradient_norm_runs_over_the_engines_shard_group(flags):
    """With context parallelism every sharding engine shards over its data-parallel ranks x cp, under a pipeline
    too and in the per-parameter styles (``parallel/shard_group.py``, which the step model reads): the gradient
    norm's all-reduces run over that group."""
    collectives, equal = _bytes(SHAPE[:SHAPE.index("--seq-len")] + ["--seq-len", "128"] + flags.split())
    assert collectives["all_reduce/dp"]["dry_run"] > 0
    assert equal, {k: v for k, v in collectives.items() if v["difference"]}


# The data-parallel engines' calls per step: the step model prices each call's latency, counting them over the
# runtime's own cuts as the engines' hooks issue them, held here against the dry run's ledger, engine by engine: the
# sharding engines' wrapped units (parallel/wrap.py's merged_units; perf/step.py: _engine_calls) and DDP's buckets,
# its parameters cut in backward's order by the runtime's gradient_buckets (perf/buckets.py: ddp_buckets).
MOE = "--experts 16 --ffn 64 --topk 4"
ENGINE_CALLS = {
    "ddp, grad-accum 2": "--dp 4 --grad-accum 2 --global-batch 16",
    "ddp, 0.1 MB buckets": "--dp 4 --global-batch 8 --bucket-mb 0.1",
    "ddp, 0.5 MB buckets": "--dp 4 --global-batch 8 --bucket-mb 0.5",
    "ddp tp2, 0.5 MB buckets": "--dp 4 --tp 2 --global-batch 8 --bucket-mb 0.5",
    "ddp pp2, 0.5 MB buckets": "--dp 4 --pp 2 --global-batch 16 --bucket-mb 0.5",
    "ddp dualpipe, 0.5 MB buckets": "--dp 2 --pp 2 --schedule dualpipe --global-batch 8 --bucket-mb 0.5",
    "ddp cp2, 0.5 MB buckets": "--dp 2 --cp 2 --global-batch 4 --bucket-mb 0.5",
    "ddp grad-accum 2, 0.5 MB buckets": "--dp 4 --grad-accum 2 --global-batch 16 --bucket-mb 0.5",
    "zero1": "--dp 4 --zero 1 --global-batch 8",
    "zero1, 0.5 MB buckets": "--dp 4 --zero 1 --global-batch 8 --bucket-mb 0.5",
    "zero2, grad-accum 2": "--dp 4 --zero 2 --grad-accum 2 --global-batch 16",
    "zero2, grad-accum 2, 0.5 MB buckets": "--dp 4 --zero 2 --grad-accum 2 --global-batch 16 --bucket-mb 0.5",
    "zero3": "--dp 4 --zero 3 --global-batch 8",
    "fsdp full_shard flat": "--dp 4 --fsdp full_shard --global-batch 8",
    "fsdp shard_grad_op": "--dp 4 --fsdp shard_grad_op --global-batch 8",
    "fsdp per_param": "--dp 4 --fsdp full_shard --fsdp-style per_param --global-batch 8",
    "fsdp reuse": "--dp 4 --fsdp full_shard --fsdp-style reuse --global-batch 8",
    "hsdp": "--dp-replicate 2 --dp-shard 2 --fsdp hybrid_shard --global-batch 8",
    "bf16 ddp (the flat engine's NO_SHARD plan)": "--dp 4 --mixed-precision bf16 --global-batch 8",
    "bf16 ddp, 0.5 MB buckets (units: no cap)": "--dp 4 --mixed-precision bf16 --global-batch 8 --bucket-mb 0.5",
    "fsdp no_shard": "--dp 4 --fsdp no_shard --global-batch 8",
    # expert weights, a shard of their own per block, over ep_replicate
    "ep2 zero2, grad-accum 2": f"--dp 4 --ep 2 {MOE} --zero 2 --grad-accum 2 --global-batch 16",
    "ep2 zero3": f"--dp 4 --ep 2 {MOE} --zero 3 --global-batch 8",
    "ep2 fsdp per_param": f"--dp 4 --ep 2 {MOE} --fsdp full_shard --fsdp-style per_param --global-batch 8",
    "ep2 fsdp reuse": f"--dp 4 --ep 2 {MOE} --fsdp full_shard --fsdp-style reuse --global-batch 8",
    "ep2 hsdp": f"--dp-replicate 2 --dp-shard 2 --ep 2 {MOE} --fsdp hybrid_shard --global-batch 8",
    "ep2 bf16 ddp": f"--dp 4 --ep 2 {MOE} --mixed-precision bf16 --global-batch 8",
}


def _engine_calls(flags: str, shape: list[str] = SHAPE) -> tuple[dict, dict]:
    """(the step model's, the dry run's) data-parallel calls per step, per ``kind/dp`` (and ``kind/ep_replicate``:
    the expert weights' over the ranks holding the same experts)."""
    from collections import Counter

    from parallelisms.api import configure
    from parallelisms.estimate_check import NOT_THE_STEP, dim_family
    from parallelisms.perf.hardware import load_hardware
    from parallelisms.perf.step import _data_parallel_traffic

    shape = shape[:shape.index("--seq-len")] + ["--seq-len", "128"]
    cfg = configure(shape + flags.split())
    ours = Counter()
    for name, _, _, calls in _data_parallel_traffic(cfg.model, cfg.layout, cfg.train, load_hardware("h100")):
        kind, dim = name.split("/")
        ours[f"{kind}/{dim_family(dim)}"] += calls
    events = [e for e in _rank0(cfg).events
              if e.phase not in NOT_THE_STEP and e.kind != "recv" and e.bytes_per_rank and e.dim.startswith(("dp", "ep_replicate"))]
    theirs = Counter(f"{e.kind}/{dim_family(e.dim)}" for e in events)
    return dict(ours), dict(theirs)


@pytest.mark.parametrize("name", ENGINE_CALLS)
def test_data_parallel_calls_per_step_agree_with_the_dry_run(name):
    ours, theirs = _engine_calls(ENGINE_CALLS[name])
    assert theirs and ours == theirs


@pytest.mark.parametrize("style", ["per_param", "flat"])
def test_fully_sharded_fp32_in_a_blocks_backward(style):
    """FULL_SHARD in fp32 with full recompute at a vocabulary small enough that a block's backward is the peak:
    the two gathered blocks, the block's gradients and two send buffers once its backward is done, in the
    parameters' dtype (perf/sharded_backward.py)."""
    shape = SHAPE[:SHAPE.index("--vocab")] + ["--vocab", "256", "--layers", "4", "--seq-len", "128"]
    out = _checked(shape + f"--dp 8 --fsdp full_shard --fsdp-style {style} --recompute full --global-batch 8".split())
    assert out["peak_phase"] == "backward", out["peak_phase"]
    assert abs(out["memory"]["total"]["relative"]) <= 0.05, out["memory"]
    assert out["ok"], out


# 64 positions: model states outweigh activations, and a fully sharded engine (ZeRO-3, FSDP FULL_SHARD, flat or
# per-parameter) peaks in backward, after the loss: name (the moment at the peak): flags
SHARDED_BACKWARD = {
    "zero3 bf16: the last block's gradient beside the head's reduction in flight":
        "--zero 3 --mixed-precision bf16",
    "zero3 bf16 full recompute: the same, the blocks keeping their inputs only":
        "--zero 3 --mixed-precision bf16 --recompute full",
    "flat full_shard bf16 full recompute": "--fsdp full_shard --mixed-precision bf16 --recompute full",
    "flat full_shard bf16 prefetch 2: two units gathered ahead": "--fsdp full_shard --fsdp-prefetch 2 "
                                                                  "--mixed-precision bf16 --recompute full",
    "zero3 fp32: the head's gradient beside the gathered head and last block": "--zero 3",
    "per_param bf16 full recompute: the embedding's gradient and fp32 main gradient, the shards so far":
        "--fsdp full_shard --fsdp-style per_param --mixed-precision bf16 --recompute full",
    "zero3 bf16 grad-accum 2: the shards' gradients from the first microbatch on":
        "--zero 3 --mixed-precision bf16 --grad-accum 2",
    "hsdp 2x4 bf16 full recompute": "--dp-replicate 2 --dp-shard 4 --fsdp hybrid_shard --mixed-precision bf16 "
                                    "--recompute full",
    "zero3 tied: the table gathered from the head's backward on, beside the head's gradient of it":
        "--zero 3 --tie-embeddings",
    "flat full_shard bf16 tied full recompute": "--fsdp full_shard --tie-embeddings --mixed-precision bf16 "
                                                "--recompute full",
    "per_param tied": "--fsdp full_shard --fsdp-style per_param --tie-embeddings",
    "per_param bf16 tied": "--fsdp full_shard --fsdp-style per_param --tie-embeddings --mixed-precision bf16",
}
EXPERTS = "--experts 16 --ffn 64 --topk 4"
SHARDED_EXPERTS = {  # ep over every data-parallel rank: the experts unsharded, their fp32 gradients whole
    "zero3 ep8": "--ep 8 --zero 3",
    "flat full_shard ep8": "--ep 8 --fsdp full_shard",
    "per_param ep8": "--ep 8 --fsdp full_shard --fsdp-style per_param",
    "flat full_shard ep4 (experts over 2 replicas)": "--ep 4 --fsdp full_shard",
    "per_param ep8 grad-accum 2": "--ep 8 --fsdp full_shard --fsdp-style per_param --grad-accum 2",
}


@pytest.mark.parametrize("name", [*SHARDED_BACKWARD, *SHARDED_EXPERTS])
def test_fully_sharded_engines_peak_unit_by_unit_in_backward(name):
    """The backward of a fully sharded engine unit by unit (perf/sharded_backward.py): each unit's gradient forms
    beside its gathered weights and the previous unit's in flight, and the reduced shards' gradients accumulate
    to the optimizer; with expert parallelism over every data-parallel rank the experts' whole, so that the end of
    backward (the embedding's) or the first block's backward is the peak (DeepSeek-V3's shape on FSDP)."""
    flags = SHARDED_BACKWARD.get(name) or f"{EXPERTS} {SHARDED_EXPERTS[name]} --mixed-precision bf16 --recompute full"
    accumulation = 2 if "--grad-accum" in flags else 1
    if "--dp-replicate" not in flags:
        flags += " --dp 8"
    shape = SHAPE[:SHAPE.index("--seq-len")] + ["--seq-len", "64", "--global-batch", str(8 * accumulation)]
    out = _checked(shape + flags.split())
    assert out["peak_phase"] == "backward", out["peak_phase"]
    assert abs(out["memory"]["total"]["relative"]) <= 0.05, out["memory"]
    assert out["ok"], out


def test_recomputed_moe_layers_peak_at_their_combine():
    """A full-recompute MoE block's recomputation in backward peaks as its combine's all-to-all returns: the rows
    gathered for the dispatch, received and put back in arrival order beside what the layer keeps (perf/memory.py:
    moe_combine_bytes), here the peak of ZeRO-3's backward in fp32 with a 512 vocabulary."""
    shape = SHAPE[:SHAPE.index("--vocab")] + ["--vocab", "512", "--layers", "4", "--seq-len", "64"]
    out = _checked(shape + f"{EXPERTS} --dp 8 --ep 8 --zero 3 --recompute full --global-batch 8".split())
    assert out["peak_phase"] == "backward", out["peak_phase"]
    assert abs(out["memory"]["total"]["relative"]) <= 0.05, out["memory"]
    assert out["ok"], out


MOE_SHAPE = ["--hidden", "128", "--heads", "8", "--kv-heads", "8", "--ffn", "64", "--vocab", "4096", "--layers", "2",
             "--seq-len", "256", "--experts", "16", "--topk", "4"]


@pytest.mark.parametrize("flags", ["--dp 8 --ep 4 --global-batch 8 --bucket-mb 0.5", "--dp 4 --global-batch 4 --bucket-mb 0.2"])
def test_ddp_buckets_of_expert_layouts_agree_with_the_dry_run(flags):
    """DDP closes a bucket where the reducing group changes: under expert parallelism the expert weights are summed
    over the ranks holding the same experts (``ep_replicate``), the others over dp (perf/buckets.py)."""
    seq = MOE_SHAPE.index("--seq-len")
    ours, theirs = _engine_calls(flags, MOE_SHAPE[:seq] + MOE_SHAPE[seq + 2:] + MOE_SHAPE[seq:seq + 2])
    assert theirs["all_reduce/dp"] > 1 and ours == theirs
    assert "--ep" not in flags or theirs["all_reduce/ep_replicate"] > 1


@pytest.mark.parametrize("flags", [
    "--dp 4 --global-batch 4",  # experts whole on every rank
    "--dp 4 --ep 4 --tp 2 --global-batch 4",  # fp32, DDP: the counts' all-to-all; no tp collective in the MoE layer
    "--dp 4 --ep 2 --tp 2 --sp --zero 1 --mixed-precision bf16 --global-batch 4",  # bf16 both ways; SP's gathers
    "--dp 4 --ep 4 --pp 2 --schedule 1f1b --recompute full --global-batch 8 --microbatches 2",  # recomputed dispatch
])
def test_expert_layouts_agree_with_the_dry_run(flags):
    """Per MoE layer and forward run, the tokens per expert (int64) and the dispatch and combine in the compute dtype,
    their reverse in backward; under SP the layer gathers its input and its output's gradient over tp and
    reduce-scatters nothing; the gradient norm sums the expert weights over ep and their replicas, not over dp.
    Memory: what an MoE layer keeps per routed row (perf/memory.py: mlp_activation_bytes)."""
    out = _checked(MOE_SHAPE + flags.split())
    assert "--ep" not in flags or out["collectives"]["all_to_all/ep"]["dry_run"] > 0
    assert out["collectives_ok"], {k: v for k, v in out["collectives"].items() if v["difference"]}
    assert abs(out["memory"]["total"]["relative"]) <= 0.05, out["memory"]


def test_recomputed_moe_layers_keep_only_their_input():
    """Full recompute of MoE blocks: each block keeps only its input through backward (the recomputation's own
    load-balancing loss is not kept: model/moe.py; keeping it kept each recomputed block's graph until the next
    step, every layer's norms, gathers and attention tensors at once), so the estimate holds within 5%."""
    shape = MOE_SHAPE[:MOE_SHAPE.index("--layers")] + ["--layers", "6"] + MOE_SHAPE[MOE_SHAPE.index("--seq-len"):]
    out = _checked(shape + "--dp 8 --ep 8 --tp 2 --sp --zero 1 --recompute full --mixed-precision bf16 "
                           "--global-batch 8".split())
    assert abs(out["memory"]["total"]["relative"]) <= 0.05, out["memory"]
    assert out["ok"], out


@pytest.mark.parametrize("schedule", ["dualpipe", "dualpipev"])
def test_dualpipe_redundant_experts_bytes_agree(schedule):
    """EPLB's copies under DualPipe: a rank holds two stages (both copies of one), so its gradient syncs, the copies'
    exchange and the replicated experts' all-reduce over ep move both stages' weights (``perf/stages.py:
    rank0_held``); the experts' counts are per slot, redundant ones included. DualPipeV's two chunks hold as many
    layers as one path's."""
    shape = MOE_SHAPE[:MOE_SHAPE.index("--layers")] + ["--layers", "4"] + MOE_SHAPE[MOE_SHAPE.index("--seq-len"):]
    out = _checked(shape + f"--dp 4 --ep 4 --pp 2 --schedule {schedule} --ep-balance measured --ep-redundant 1 "
                            "--global-batch 16 --microbatches 4".split())
    assert out["collectives"]["all_reduce/ep"]["dry_run"] > 0 and out["collectives"]["send/pp"]["dry_run"] > 0
    assert out["collectives_ok"], {k: v for k, v in out["collectives"].items() if v["difference"]}
    # memory: the grouped GEMM pads the redundant slots as full as an uncopied expert's (perf/memory.py:
    # padded_slots); the slots' outputs go back to routing order by a gather that keeps no copy of them
    assert abs(out["memory"]["total"]["relative"]) <= 0.05, out["memory"]


@pytest.mark.parametrize("flags", [
    "--dp 2 --pp 2 --global-batch 8 --microbatches 4",  # fp32 DDP
    "--dp 2 --pp 2 --mixed-precision bf16 --global-batch 8 --microbatches 4 --bucket-mb 0.5",  # DDP in bf16 too
    f"--dp 2 --pp 2 --ep 2 {MOE} --global-batch 8 --microbatches 4",  # each stage's norm over ep (as over tp)
    "--pp 4 --global-batch 8 --microbatches 8",  # no data parallelism: the gradients dropped at each update
])
def test_pipedream_updates_per_microbatch(flags):
    """PipeDream steps every stage after each microbatch: DDP all-reduces the stage's gradient (its buckets, fp32,
    in bf16 too) and the stage clips its own gradient norm (over tp and ep, not pp) at each of the M updates
    (perf/model.py: pipedream_updates), bytes and calls. Memory: the microbatches in flight hold the stashed
    versions of the stage's weights their forwards ran on (perf/pipeline_walk.py counts the versions alive)."""
    shape = SHAPE[:SHAPE.index("--seq-len")] + ["--seq-len", "128"]
    out = _checked(shape + f"--schedule pipedream {flags}".split())
    assert out["collectives_ok"], {k: v for k, v in out["collectives"].items() if v["difference"]}
    assert abs(out["memory"]["total"]["relative"]) <= 0.05, out["memory"]
    if "--dp" in flags:
        ours, theirs = _engine_calls(f"--schedule pipedream {flags}")
        assert theirs and ours == theirs


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_pipedream_updates_beside_the_microbatches_in_flight(precision):
    """PipeDream's update after each backward holds the stage's gradient (dropped there without data parallelism)
    and per-tensor AdamW's two temporaries of its largest tensor, the embedding's on the first stage, while the other
    microbatches are in flight: with as many microbatches as stages at 64 positions, where the model states weigh as
    much as the activations, that is the peak (perf/pipeline_walk.py: the update moment)."""
    shape = SHAPE[:SHAPE.index("--seq-len")] + ["--seq-len", "64", "--mixed-precision", precision]
    out = _checked(shape + "--pp 4 --schedule pipedream --global-batch 8 --microbatches 4".split())
    assert abs(out["memory"]["total"]["relative"]) <= 0.03, out["memory"]
    assert out["ok"], out


@pytest.mark.parametrize("engine", ["", "--zero 1", "--fsdp full_shard --fsdp-style per_param",
                                    "--dp-replicate 2 --dp-shard 2 --fsdp hybrid_shard"])
def test_dualpipe_bytes_agree(engine):
    """DualPipe's rank 0 runs the forward direction's first stage (the embedding) and the reverse direction's last
    (the head), half the microbatches each, so half the ends' tensor-parallel collectives each (perf/model.py:
    rank0_end_shares); the two copies of a stage exchange the fp32 gradients their engine holds: the shard under a
    sharded engine."""
    shape = SHAPE[:SHAPE.index("--seq-len")] + ["--seq-len", "128"]
    dp, batch = ("", 32) if "--dp-shard" in engine else ("--dp 2", 16)
    collectives, equal = _bytes(shape + f"{dp} {engine} --pp 4 --tp 2 --sp --schedule dualpipe --mixed-precision bf16 "
                                        f"--global-batch {batch} --microbatches 8".split())
    assert collectives["send/pp"]["dry_run"] > 0 and collectives["all_gather/tp"]["dry_run"] > 0
    assert equal, {k: v for k, v in collectives.items() if v["difference"]}


@pytest.mark.parametrize("balance", ["", "--ep-balance measured --ep-redundant 1"])
def test_dualpipev_backward_runs_inside_a_paused_forward(balance):
    """DualPipeV's F&B chunk runs the other chunk's backward while the forward's first expert dispatch is in flight
    (``executor._compute_pair``): the forward holds only its first block up to the dispatch (the rows sent and the
    receive buffer) while the backward, the loss's on the last stage, runs; the forward's whole stage-microbatch
    only once the backward has freed its own (perf/memory.py: dispatch_bytes); experts as wide as the dense MLP."""
    shape = MOE_SHAPE[:MOE_SHAPE.index("--ffn")] + ["--ffn", "448", "--vocab", "4096", "--layers", "4"]
    shape += MOE_SHAPE[MOE_SHAPE.index("--seq-len"):]
    out = _checked(shape + f"--dp 4 --ep 4 --pp 2 --schedule dualpipev --global-batch 16 --microbatches 4 "
                           f"{balance}".split())
    assert abs(out["memory"]["total"]["relative"]) <= 0.02, out["memory"]
    assert out["ok"], out


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zb-v", "dualpipev"])
def test_fp32_ddp_pipeline_holds_its_gradients_once(schedule):
    """DDP in fp32 under a pipeline: the parameters' own gradients are the stage's gradient buffers, every stage's
    from the rank's first backward, priced once (not again as the fresh gradients mixed precision accumulates)."""
    shape = SHAPE[:SHAPE.index("--seq-len")] + ["--seq-len", "128"]
    out = _checked(shape + f"--dp 2 --pp 2 --schedule {schedule} --global-batch 8 --microbatches 4".split())
    assert abs(out["memory"]["total"]["relative"]) <= 0.05, out["memory"]
    assert out["ok"], out


@pytest.mark.parametrize("engine", ["--dp 8 --zero 3", "--dp 8 --fsdp full_shard --fsdp-style per_param",
                                    "--dp-replicate 2 --dp-shard 4 --fsdp hybrid_shard"])
def test_fully_sharded_experts_gather_over_their_replicas(engine):
    """A fully sharded engine with expert parallelism gathers the dense weights over dp and the experts over the
    ranks holding the same experts (one here: none), not the experts over dp as well."""
    out = _checked(MOE_SHAPE + f"{engine} --ep 8 --tp 2 --sp --recompute full --mixed-precision bf16 "
                               "--global-batch 8".split())
    assert out["collectives"]["all_gather/dp"]["dry_run"] > 0
    assert out["collectives_ok"], {k: v for k, v in out["collectives"].items() if v["difference"]}
    assert abs(out["memory"]["total"]["relative"]) <= 0.05, out["memory"]


def test_expert_weights_are_sharded_over_their_replicas():
    """ZeRO-1 with expert parallelism: the expert weights' master, optimizer state, reduce-scatter and all-gather are
    over the ranks holding the same experts (ep_replicate, here one rank), the other weights' over dp; the router
    is whole on every tensor-parallel rank."""
    out = _checked(MOE_SHAPE + "--dp 8 --ep 8 --tp 2 --sp --zero 1 --recompute full --mixed-precision bf16 "
                            "--global-batch 8".split())
    assert abs(out["memory"]["total"]["relative"]) <= 0.05, out["memory"]
    for kind in ("params", "optimizer"):
        assert out["memory"][kind]["difference"] == pytest.approx(0, abs=1024), kind
    for key in ("reduce_scatter/dp", "all_gather/dp"):
        assert out["collectives"][key]["dry_run"] > 0 and out["collectives"][key]["difference"] == 0, key
    assert out["ok"], out


def test_estimate_check_command(capsys):
    from parallelisms.cli import main

    argv = ["estimate", "--preset", "small", "--dp", "2", "--tp", "2", "--sp", "--global-batch", "4", "--seq-len",
            "128", "--check", "--json"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith("verdict: agree") for line in lines)
    check = json.loads(lines[-1])["check"]
    assert set(check["memory"]) == {"params", "grads", "optimizer", "buffers", "activations", "total"}
    assert {"estimate", "dry_run", "difference"} <= set(check["memory"]["activations"])
    assert check["collectives"]["reduce_scatter/tp"]["difference"] == 0
    assert check["ok"]


MIB = 2**20


@pytest.mark.parametrize("kwargs, closed_form", [
    ({}, lambda s, b, h, a, t: s * b * h * 34 + 5 * a * s * s * b),
    ({"recompute": "full"}, lambda s, b, h, a, t: 2 * s * b * h),
    ({"tp": 8, "sequence_parallel": True}, lambda s, b, h, a, t: s * b * h * 34 / t + 5 * a * s * s * b / t),
    ({"tp": 8, "sequence_parallel": True, "recompute": "full"}, lambda s, b, h, a, t: 2 * s * b * h / t),
    ({"tp": 8, "recompute": "full"}, lambda s, b, h, a, t: 2 * s * b * h),
])
def test_korthikanti_activation_closed_forms(kwargs, closed_form):
    """Table 2: 34sbh + 5as^2b without recompute, 2sbh with full recompute, divided by t under sequence parallelism
    (the layer input full recompute keeps is the sequence-sharded residual stream)."""
    s, b, h, a = 2048, 1, 12288, 96
    t = kwargs.get("tp", 1)
    assert activation_bytes_per_layer(s, b, h, a, **kwargs) == pytest.approx(closed_form(s, b, h, a, t))


def _layout(tp=1, sp=False, recompute="none", cp=1, attention="ring"):
    return ParallelConfig(ParallelDims(tp=tp, cp=cp), sequence_parallel=sp, recompute=recompute, cp_attention=attention)


def test_runtime_block_closed_forms():
    """The tensors this runtime's block keeps (bf16, per token): two RMSNorms at 4h + 2h + 2h, SDPA's q, repeated k and
    v and output at 2q each with the fp32 log-sum-exp, SwiGLU's four f-wide tensors; 2h with full recompute (Korthikanti's
    2sbh), 2h/t with sequence parallelism; selective recompute keeps the core's unrepeated inputs and output."""
    cfg = ModelConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336)
    s, b, h, q, kv, f, a = 8192, 1, 4096, 4096, 1024, 14336, 32
    tokens = s * b
    assert block_activation_bytes(cfg, tokens, _layout(), 2) == tokens * (16 * h + 8 * q + 4 * a + 8 * f)
    assert block_activation_bytes(cfg, tokens, _layout(recompute="full"), 2) == 2 * s * b * h
    assert block_activation_bytes(cfg, tokens, _layout(tp=8, sp=True, recompute="full"), 2) == 2 * s * b * h / 8
    assert block_activation_bytes(cfg, tokens, _layout(tp=8, sp=True), 2) == pytest.approx(
        tokens * (16 * h + 8 * q + 4 * a + 8 * f) / 8)
    assert block_activation_bytes(cfg, tokens, _layout(recompute="selective"), 2) == tokens * (
        16 * h + 2 * (2 * q + 2 * kv) + 8 * f)
    # fp32: the norms' input is the block's own fp32 input (4h), so 12h per norm, everything else at 4 bytes
    assert block_activation_bytes(cfg, tokens, _layout(), 4) == tokens * (24 * h + 16 * q + 4 * a + 16 * f)
    # the loss: 12 bytes a logit (fp32 log-probabilities, their gradient, the log-softmax's), the final norm kept
    assert head_bytes(cfg, tokens, _layout(), 2) == tokens * (12 * 128256 + 8 * h)
    # a GiB figure for Llama 3 8B's block at 8K tokens, bf16: 1.63 GiB without recompute, 64 MiB with full recompute
    assert block_activation_bytes(cfg, tokens, _layout(), 2) / 2**30 == pytest.approx(1.626, abs=0.01)
    assert block_activation_bytes(cfg, tokens, _layout(recompute="full"), 2) / MIB == 64


def test_torchtitan_70b_fsdp_tp_fits():
    """Llama 3 70B, FSDP 32 x TP 8 with SP and full recompute, 8 sequences of 8K tokens a data-parallel rank
    (torchtitan's 70B layout, which ran in about 72 GiB on H100s): full recompute keeps 2sbh/t a layer, so the
    estimate fits 80 GB, below the run's reserved peak."""
    from parallelisms.config import preset
    from parallelisms.perf.estimate import estimate
    from parallelisms.perf.hardware import load_hardware

    parallel = ParallelConfig(ParallelDims(dp_shard=32, tp=8), fsdp="full_shard", fsdp_style="per_param",
                              sequence_parallel=True, recompute="full", mixed_precision="bf16")
    result = estimate(preset("llama3-70b"), parallel, TrainConfig(global_batch=256, seq_len=8192),
                      load_hardware("h100"))
    assert result["fits"], result["memory_per_rank"]
    assert result["memory_per_rank"]["total"] / 2**30 < 72


def test_a_context_mode_is_priced_by_its_descriptor(monkeypatch):
    """perf/memory.py reads what a cp mode's core keeps from its descriptor (``parallel/cp_modes.py``: ``kept``,
    ``kept_per_layer``), so a new mode is priced by its entry in MODES, with no branch in the memory model."""
    import dataclasses

    from parallelisms.parallel import cp_modes

    cfg = ModelConfig(dim=128, n_layers=4, n_heads=8, n_kv_heads=2, vocab_size=256, ffn_dim=448, max_seq_len=128)
    parallel = ParallelConfig(ParallelDims(dp_shard=2, cp=2), cp_attention="ring")
    before = block_activation_bytes(cfg, 64, parallel, 4, seq=64)
    mode = dataclasses.replace(cp_modes.MODES["ring"], kept=lambda e, q, kv, heads, cp: 1000.0,
                               kept_per_layer=lambda seq, cp, e: 7.0)
    monkeypatch.setitem(cp_modes.MODES, "ring", mode)
    after = block_activation_bytes(cfg, 64, parallel, 4, seq=64)
    ring = cp_modes.unrepeated(4, cfg.q_dim, cfg.n_kv_heads * cfg.head_dim, cfg.n_heads, 2)
    assert after - before == pytest.approx(64 * (1000.0 - ring) + 7.0)


@pytest.mark.parametrize("flags", ["--schedule interleaved --chunks 2", "--schedule dualpipev",
                                   "--schedule dualpipe --mixed-precision bf16"])
def test_a_ranks_stages_share_their_models_rotary_tables(flags):
    """A pipeline rank's stages are cut from one model and share its rotary tables (``Transformer.stage``); only
    DualPipe's second direction, a copy of the model, holds its own (``parallel/pipeline/stage.py``)."""
    shape = SHAPE[:SHAPE.index("--seq-len")] + ["--seq-len", "128"]
    out = _checked(shape + f"--dp 2 --pp 2 --cp 2 --global-batch 8 --microbatches 4 {flags}".split())
    assert out["memory"]["buffers"]["difference"] == 0, out["memory"]["buffers"]
    assert out["ok"], out


@pytest.mark.parametrize("flags", [
    "--dp 8 --zero 1 --mixed-precision bf16 --global-batch 8",  # one stage: one parameter, one unit
    "--dp 2 --pp 2 --global-batch 8 --microbatches 4",  # the first and last stages exchange the fp32 gradient
    "--dp 2 --pp 2 --tp 2 --zero 3 --global-batch 8 --microbatches 4",  # the flat engine's shard of it
    "--dp 4 --pp 2 --fsdp full_shard --fsdp-style per_param --vocab 4099 --mixed-precision bf16 --global-batch 16 "
    "--microbatches 4",  # per-parameter FSDP's padded rows, gathered and exchanged
    "--dp 2 --pp 2 --schedule zb-v --global-batch 8 --microbatches 4",  # both ends on rank 0: one stepped copy
    "--dp 2 --pp 2 --schedule dualpipe --mixed-precision bf16 --global-batch 8 --microbatches 4",
])
def test_tied_embeddings_agree_with_the_dry_run(flags):
    """A tied embedding and head (``parallel/tied.py``): one parameter on one stage (counted once in the model
    states); under a pipeline the last stage's copy, whose fp32 gradient (the engine's shard of it) the first and
    last stages' ranks exchange over pp after the step's reductions (perf/model.py: tied_gradient_bytes), and on a
    rank holding both ends (V-shaped schedules, DualPipe) a copy the optimizer leaves out."""
    shape = SHAPE[:SHAPE.index("--seq-len")] + ["--seq-len", "128", "--tie-embeddings"]
    out = _checked(shape + flags.split())
    assert out["collectives_ok"], {k: v for k, v in out["collectives"].items() if v["difference"]}
    for kind in ("params", "optimizer"):
        assert out["memory"][kind]["difference"] == pytest.approx(0, abs=1024), kind
    assert abs(out["memory"]["total"]["relative"]) <= 0.05, out["memory"]
    assert out["ok"], out


@pytest.mark.parametrize("flags", ["--cp 2 --mixed-precision bf16", "--cp 2 --zero 1 --mixed-precision bf16",
                                   "--seq-len 64 --mixed-precision bf16"])
def test_dualpipe_copies_exchange_their_gradients_after_the_activations(flags):
    """DualPipe's two copies of a stage exchange their fp32 gradients after the step's reductions in one batched
    send and receive (``parallel/pipeline/stage.py: add_mirror_copies``): with few activations per rank (context
    parallelism, short sequences) that is the peak, every stage's gradients beside a receive buffer of what the
    engine holds (perf/memory.py: mirror_exchange)."""
    shape = SHAPE[:SHAPE.index("--seq-len")] + ["--seq-len", "128"]
    out = _checked(shape + f"--dp 2 --pp 2 --schedule dualpipe --global-batch 8 --microbatches 4 {flags}".split())
    assert abs(out["memory"]["total"]["relative"]) <= 0.05, out["memory"]
    assert out["ok"], out


@pytest.mark.parametrize("flags", ["--cp 2 --cp-attention ulysses --zero 1 --mixed-precision bf16",
                                   "--cp 2 --schedule dualpipe --zero 1 --mixed-precision bf16"])
def test_a_merged_stage_unit_forms_its_gradient_at_the_backwards_end(flags):
    """A pipeline stage whose units merge into one flat unit (ZeRO-1, a stage under the gradient bucket) forms its
    gradient at the end of each backward, its microbatch freed: its parameters' gradients and their concatenation
    beside the held fp32 main gradient (at the stage's first backward, the concatenation and its fp32 copy), which
    with few activations per rank (cp 2, 128 positions) is the peak (perf/pipeline_walk.py: a backward's end)."""
    shape = SHAPE[:SHAPE.index("--seq-len")] + ["--seq-len", "128"]
    out = _checked(shape + f"--dp 2 --pp 2 --global-batch 8 --microbatches 4 {flags}".split())
    assert abs(out["memory"]["total"]["relative"]) <= 0.05, out["memory"]
    assert out["ok"], out
