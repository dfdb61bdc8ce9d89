"""Learning-rate schedules and the metrics file: warmup then cosine or linear decay to --min-lr, stepped in the
training loop and in the single-process reference alike (a scheduled two-rank ZeRO run still reproduces it);
the default schedule changes nothing; the metrics file holds a record per step with the figures a dashboard
reads, and TensorBoard gets the same scalars."""

import math

import pytest

from parallelisms.cli import main
from parallelisms.config import DataConfig, ParallelConfig, TrainConfig, preset
from parallelisms.lr_schedule import lr_factor
from parallelisms.mesh import ParallelDims
from parallelisms.metrics import default_metrics_path, read_metrics
from parallelisms.training import RunSpec

from _launching import assert_reproduces, launch_reports, one_thread

TINY = preset("tiny")


def test_warmup_then_decay_to_the_floor():
    cfg = TrainConfig(steps=10, lr=1e-3, warmup=2, lr_schedule="cosine", min_lr=1e-4)
    factors = [lr_factor(cfg, s) for s in range(10)]
    assert factors[:3] == [0.5, 1.0, 1.0]  # warmup, then the decay starts at the full rate
    assert math.isclose(factors[-1], 0.1) and all(a >= b for a, b in zip(factors[1:], factors[2:]))
    assert math.isclose(lr_factor(cfg.replace(warmup=0), 5), 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 5 / 9)))
    linear = cfg.replace(lr_schedule="linear")
    assert math.isclose(lr_factor(linear, 2 + 4), 0.1 + 0.9 * (1 - 4 / 7))
    assert {lr_factor(TrainConfig(steps=10), s) for s in range(10)} == {1.0}


SCHEDULED = TrainConfig(steps=4, global_batch=4, seq_len=16, warmup=2, lr_schedule="cosine", min_lr=3e-4,
                        data=DataConfig(eval_split=0.1, eval_every=2, eval_batches=1))


def test_a_scheduled_zero_run_reproduces_single_process_and_logs_every_step(tmp_path):
    metrics = default_metrics_path(str(tmp_path / "ckpt"))
    spec = RunSpec(TINY, SCHEDULED, ParallelConfig(dims=ParallelDims(dp_shard=2), zero=1), collect_state=True,
                   metrics_path=metrics)
    report = launch_reports({"zero1": spec})("zero1")
    with one_thread():
        assert_reproduces(report, TINY, SCHEDULED, splits=2)
    records = read_metrics(metrics)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["lr"] for r in records] == pytest.approx([SCHEDULED.lr * lr_factor(SCHEDULED, s) for s in range(4)])
    assert records[-1]["lr"] == pytest.approx(3e-4) and report["lr_last"] == pytest.approx(3e-4)
    assert [r["loss"] for r in records] == pytest.approx(report["losses"], rel=1e-6)  # the dp mean, every step
    assert [r["grad_norm"] for r in records] == pytest.approx(report["grad_norms"])
    assert [r["eval_loss"] is not None for r in records] == [False, True, False, True]
    for r in records:
        assert r["tokens_per_s"] > 0 and r["peak_memory_bytes"] > 0 and "exposed_comm_s" in r


def test_tensorboard_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = tmp_path / "tb"
    assert main(["train", "--dp", "1", "--steps", "3", "--global-batch", "2", "--seq-len", "16", "--warmup", "1",
                 "--lr-schedule", "linear", "--eval-split", "0.1", "--tensorboard", str(board),
                 "--metrics", str(tmp_path / "m.jsonl")]) == 0
    events = EventAccumulator(str(board))
    events.Reload()
    assert {"train/loss", "train/lr", "train/grad_norm", "eval/loss"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3]
    assert len(read_metrics(str(tmp_path / "m.jsonl"))) == 3


def test_tensorboard_missing_is_one_line(capsys, monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    assert main(["train", "--steps", "1", "--tensorboard", "tb"]) == 2
    assert "--tensorboard needs tensorboard, which is not installed" in capsys.readouterr().err


def test_a_resumed_run_keeps_the_records_up_to_its_checkpoint(tmp_path):
    from parallelisms.metrics import MetricsWriter

    path = str(tmp_path / "m.jsonl")
    first = MetricsWriter(path)
    for step in (1, 2, 3):
        first.write({"step": step, "loss": 1.0 / step})
    first.close()
    resumed = MetricsWriter(path, keep_until=2)
    resumed.write({"step": 3, "loss": 0.25})
    resumed.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(path)] == [(1, 1.0), (2, 0.5), (3, 0.25)]
    MetricsWriter(path).close()  # a fresh run starts anew
    assert read_metrics(path) == []
