"""The pipeline runtime under data parallelism reproduces single-process training for every schedule (pp 2 x dp 2;
each schedule alone at pp 2 and pp 4 is in test_verify_matrix, in float64), PipeDream's replicas reproduce
their delayed-update reference, activations are freed as the simulator says, the trace shows per-action
spans, balancing by cost beats equal layer counts, and bad input is one line before launch.
"""

import json

import pytest

from parallelisms.support import validate_layout
from parallelisms.cli import main
from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig
from parallelisms.launch import launch
from parallelisms.mesh import ParallelDims
from parallelisms.parallel.pipeline.partition import balanced_bounds, equal_bounds, stage_costs
from parallelisms.parallel.pipeline.pipedream import pipedream_reference
from parallelisms.parallel.pipeline.schedules import SCHEDULES
from parallelisms.training import RunSpec, train_rank
from parallelisms.equivalence import Run, compare, reference_train

from _launching import assert_pipeline_report, settled

# a layer per virtual stage of the two-stage schedules (interleaved 2 chunks, DualPipe's two directions, V shapes);
# two steps: the second runs on the first's update and optimizer state
MODEL = ModelConfig(vocab_size=256, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64)
TRAIN = TrainConfig(steps=2, global_batch=8, seq_len=16)
M = 8  # microbatches of one row (pp 2 x dp 2: four of one row per data-parallel rank)


def _layouts(pp: int, dp: int) -> list[ParallelConfig]:
    m = M // dp
    return [ParallelConfig(ParallelDims(pp=pp, dp_replicate=dp), schedule=name, microbatches=m,
                           chunks=2 if name == "interleaved" else 1)
            for name in SCHEDULES]


def _run(info, layouts):
    out = {}
    for parallel in layouts:
        report = train_rank(info, RunSpec(MODEL, TRAIN, validate_layout(MODEL, TRAIN, parallel), collect_state=True))
        if report is not None:
            out[(parallel.schedule, parallel.dims.pp, parallel.dims.dp)] = report
    return out


@pytest.fixture(scope="module")
def reference():
    return reference_train(MODEL, TRAIN)


def _check(results, reference):
    for (name, pp, dp), report in results.items():
        if name == "pipedream":  # replicas average each update: the reference sums rows in another order
            exact = compare(report, Run(*pipedream_reference(MODEL, TRAIN, pp, M // dp, dp)))
            assert exact["ok"], (name, pp, dp, exact)
            synchronous = compare(report, reference)
            assert synchronous["max_param_rel_diff"] > 1e-3  # and it really is asynchronous
            continue
        result = settled(report, MODEL, TRAIN, reference)
        assert result["ok"], (name, pp, dp, result)
        assert_pipeline_report(report, pp)


def test_every_schedule_pp2_dp2(reference):
    results = launch(_run, 4, _layouts(2, 2), backend="gloo", threads=1)[0]
    assert len(results) == len(SCHEDULES)
    _check(results, reference)


def test_train_trace_shows_every_action(tmp_path, capsys):
    trace = tmp_path / "trace.json"
    argv = ["train", "--pp", "2", "--dp", "1", "--schedule", "zb-h1", "--microbatches", "4", "--steps", "2",
            "--global-batch", "4", "--seq-len", "16", "--trace", str(trace), "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    names = {e["name"] for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "compute"}
    for kind in "FIW":
        for stage in (0, 1):
            assert {f"{kind} s{stage} mb{mb}" for mb in range(4)} <= names
    assert 0.0 <= report["pipeline"]["simulated_bubble_rate"] < 1.0


@pytest.mark.fast
def test_balancing_by_cost_beats_equal_layer_counts():
    layers, embed, head = [1.0] * 8, 0.2, 3.0  # a large vocabulary head
    equal = equal_bounds(8, 4)
    balanced = balanced_bounds(layers, embed, head, 4)
    assert equal == [0, 2, 4, 6, 8] and max(stage_costs(equal, layers, embed, head)) == 5.0
    assert max(stage_costs(balanced, layers, embed, head)) == 4.0  # the head's stage keeps one layer
    assert all(b - a >= 1 for a, b in zip(balanced, balanced[1:]))
    brute = min(max(stage_costs([0, a, b, c, 8], layers, embed, head))
                for a in range(1, 8) for b in range(a + 1, 8) for c in range(b + 1, 8))
    assert max(stage_costs(balanced, layers, embed, head)) == brute


@pytest.mark.parametrize("args,needle", [
    (["--pp", "2", "--schedule", "zb-v", "--microbatches", "2"], "needs at least 3 microbatches"),
    (["--pp", "4", "--schedule", "interleaved", "--chunks", "2", "--microbatches", "8"], "layers cannot fill 8"),
    (["--pp", "2", "--schedule", "interleaved", "--chunks", "2", "--microbatches", "3"], "divisible by pp"),
    (["--pp", "2", "--schedule", "1f1b", "--chunks", "2"], "--chunks 2 applies to --schedule interleaved only"),
    (["--pp", "3", "--schedule", "dualpipe", "--microbatches", "6"], "even pp"),
    (["--pp", "2", "--schedule", "dualpipe", "--microbatches", "5"], "even microbatch count"),
    (["--pp", "2", "--schedule", "1f1b", "--microbatches", "3"], "must split into dp x microbatches"),
    (["--pp", "2", "--schedule", "nope"], "unknown --schedule 'nope'; choose one of gpipe, 1f1b"),
])
def test_bad_pipeline_input_is_one_line(args, needle, capsys):
    argv = ["verify", "--preset", "tiny", "--global-batch", "8", *args]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and needle in err, err


def test_balance_by_measured_runtime_moves_layers_off_the_heavy_head(capsys, tmp_path):
    """An 8k-vocabulary head outweighs several blocks: the measured cut gives the last stage fewer layers
    than equal counts would, and training still matches single-process training."""

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 8192,
                                  "max_position_embeddings": 128}))
    argv = ["--config", str(config), "--dp", "1", "--pp", "2", "--pp-balance", "measured", "--steps", "2",
            "--global-batch", "32", "--seq-len", "64"]
    assert main(["train", *argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    bounds = report["pipeline"]["stage_bounds"]
    assert bounds[0] == 0 and bounds[-1] == 6 and bounds[1] > 3, bounds
    assert main(["verify", *argv]) == 0
    assert capsys.readouterr().out.strip().endswith("ok")
