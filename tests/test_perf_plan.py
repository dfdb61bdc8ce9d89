"""``parallelisms plan``: the fastest fitting layouts of N GPUs, best first, each one the support table accepts;
fixed flags stay fixed; bad input (a layout whose product is not --gpus, a model that fits nowhere, unknown or
malformed hardware) is one line. The 1,024-GPU search just runs here (its speed is a benchmark, not a test)."""

import json

import pytest

from parallelisms.cli import main
from parallelisms.config import PRESETS, TrainConfig
from parallelisms.mesh import ParallelDims
from parallelisms.config import ParallelConfig
from parallelisms.support import validate_layout

GPT3 = ["--preset", "gpt3-175b", "--global-batch", "1536", "--seq-len", "2048", "--hardware", "a100"]


def _plans(capsys, *argv):
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["plans"]


def test_1024_gpus_best_first_fitting_and_supported(capsys):
    plans = _plans(capsys, "--gpus", "1024", *GPT3, "--top", "5")
    assert len(plans) == 5
    assert [p["step_s"] for p in plans] == sorted(p["step_s"] for p in plans)
    for p in plans:
        assert p["fits"] and p["dp"] * p["tp"] * p["pp"] * p["cp"] == 1024
        assert {"step_s", "mfu", "hfu", "bubble_fraction", "memory_per_rank", "time_breakdown"} <= p.keys()
        sharded = p["zero"] > 0
        dims = ParallelDims(dp_replicate=1 if sharded else p["dp"], dp_shard=p["dp"] if sharded else 1, tp=p["tp"],
                            pp=p["pp"], cp=p["cp"], ep=p["ep"])
        options = dict(schedule=p["schedule"], chunks=p["chunks"], microbatches=p["microbatches"]) if p["pp"] > 1 else {}
        validate_layout(PRESETS["gpt3-175b"], TrainConfig(global_batch=1536, seq_len=2048, grad_accum=p["grad_accum"]),
                        ParallelConfig(dims, sequence_parallel=p["sp"], zero=p["zero"], recompute=p["recompute"],
                                       mixed_precision="bf16", **options))


def test_given_flags_stay_fixed(capsys):
    # 128 GPUs: this runtime's pipeline stage holds bf16 weights, fp32 master and main gradients and a microbatch's
    # fresh gradients beside Adam's state (perf/memory.py), which 64 A100s do not fit for GPT-3 with dp 1
    plans = _plans(capsys, "--gpus", "128", *GPT3, "--tp", "8", "--pp", "8", "--recompute", "selective", "--top", "3")
    assert plans and all((p["tp"], p["pp"], p["dp"], p["recompute"]) == (8, 8, 2, "selective") for p in plans)
    assert all(p["schedule"] in ("1f1b", "interleaved", "zb-h1", "zb-h2") for p in plans)


def _one_line_error(capsys, argv, *needles):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error:"), err
    for needle in needles:
        assert needle in err, err


def test_bad_input_is_one_line(capsys, tmp_path):
    _one_line_error(capsys, ["plan", "--gpus", "64", *GPT3, "--dp", "2", "--tp", "8", "--pp", "2", "--cp", "1"],
                    "= 32", "--gpus 64")
    _one_line_error(capsys, ["plan", "--gpus", "64", *GPT3, "--tp", "3"], "--tp 3", "does not divide --gpus 64")
    _one_line_error(capsys, ["plan", "--gpus", "8", *GPT3], "no layout of 8 GPUs fits", "GiB more than")
    _one_line_error(capsys, ["plan", "--gpus", "8", "--hardware", "tpu"], "unknown --hardware 'tpu'")
    _one_line_error(capsys, ["plan", "--gpus", "8", "--preset", "gpt5"], "unknown --preset 'gpt5'")
    bad = tmp_path / "hw.json"
    for text, needle in (("{oops", "not a readable JSON"), ('{"name": "x"}', "lacks peak_tflops"),
                         (json.dumps({"name": "x", "peak_tflops": -1, "hbm_gb": 80, "hbm_tbps": 2, "gpus_per_node": 8,
                                      "intra_node_gbps": 300, "inter_node_gbps": 25, "intra_latency_us": 5,
                                      "inter_latency_us": 10}), "peak_tflops must be a positive")):
        bad.write_text(text)
        _one_line_error(capsys, ["estimate", "--hardware", str(bad)], needle)


def test_five_plans_by_default_each_with_its_bound(capsys):
    plans = _plans(capsys, "--gpus", "8", "--preset", "small", "--global-batch", "16", "--hardware", "a100")
    assert len(plans) == 5
    for p in plans:
        bound = p["reason"].split(";")[0].rsplit(" ", 1)
        assert bound[1].endswith("%") and bound[0] in ("compute", "pipeline bubble", "optimizer") or \
            bound[0].startswith("exposed "), p["reason"]


@pytest.mark.parametrize("search", [["--tp", "2", "--tp-overlap", "--tp-overlap-chunks", "4"], ["--pp", "2"]])
def test_the_printed_flags_reproduce_the_priced_step(capsys, search):
    """Each plan's flags, beside the model, batch and hardware flags plan was given, make ``estimate`` price the
    very step plan priced: --tp-overlap and --tp-overlap-chunks where the layout has tp, bf16, the schedule."""
    given = ["--preset", "small", "--global-batch", "16", "--hardware", "a100"]
    plans = _plans(capsys, "--gpus", "8", *given, *search, "--top", "3")
    assert plans
    for p in plans:
        assert ("--tp-overlap --tp-overlap-chunks 4" in p["flags"]) == ("--tp-overlap" in search), p["flags"]
        assert main(["estimate", *given, *p["flags"].split(), "--json"]) == 0
        estimated = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert estimated["step_s"] == pytest.approx(p["step_s"], rel=1e-12), p["flags"]
