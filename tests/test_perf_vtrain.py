"""The step model against vTrain's 1,440 measured Megatron-DeepSpeed runs on one 8-GPU A100 node (Bang et al.,
MICRO'24, arXiv 2312.12391; tests/data/README.md): the mean absolute error at most vTrain's own 8.4%, and no
group of tp, pp or model size far off. perf/ is fitted to none of the rows (a pure function: fast)."""

from pathlib import Path

import pytest

from parallelisms.perf.hardware import PRESETS
from parallelisms.perf.vtrain import configs, errors, load_runs, padded_vocab, summary

pytestmark = pytest.mark.fast  # pure functions: no process starts (tests/conftest.py)

DATA = Path(__file__).parent / "data" / "vtrain_single_node_a100.csv"


@pytest.fixture(scope="module")
def result():
    runs = load_runs(DATA)
    assert len(runs) == 1440
    return summary(errors(runs, PRESETS["a100"]))


def test_mean_absolute_error_within_vtrains_own(result):
    assert result["mean_abs_error"] <= 0.084
    assert abs(result["mean_signed_error"]) <= 0.03  # no overall bias hiding behind the mean


def test_every_tp_pp_and_size_group_within_15_percent(result):
    for key in ("tp", "pp", "dp", "micro_batch", "params_M"):
        for value, group in result["by"][key].items():
            assert group["mean_abs_error"] <= 0.15, (key, value, group)


def test_rows_are_set_as_the_runs_ran():
    """Megatron pads the vocabulary to 128 x tp; without a pipeline the micro batches are accumulated."""
    assert padded_vocab(1) == 50304 and padded_vocab(8) == 51200
    run = load_runs(DATA)[6]  # 4 GPUs, global batch 32, micro batch 2, dp 4, pp 1
    cfg, parallel, train = configs(run)
    assert (run.dp, run.pp, train.grad_accum, parallel.recompute) == (4, 1, 4, "full")
    assert cfg.ffn_dim == 4 * cfg.dim and cfg.mlp == "gelu"
