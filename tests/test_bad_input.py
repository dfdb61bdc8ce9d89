"""Bad input, as a hostile user gives it: every invalid invocation of every verb ends with exit code 2 and one
line on stderr that names the flag, before any work starts (in bounded time, no traceback). The table runs the
CLI in-process with the work replaced by a tripwire; a few invocations run as processes to show the terminal
sees one line."""

import contextlib
import importlib
import json
import math
import os
import signal
import subprocess
import sys

import pytest

from parallelisms.cli import main
from parallelisms.flags import json_line

LAYOUT_VERBS = ("train", "verify", "estimate")

# Every numeric flag the layout verbs share, with values out of its range or not numbers at all.
SHARED_NUMERIC = {
    "--dp": ["0", "-1", "two", "70000"], "--tp": ["0", "1.5"], "--pp": ["0", "99999999"], "--cp": ["-2"],
    "--ep": ["0"], "--dp-shard": ["0"], "--dp-replicate": ["-1"], "--zero": ["4", "-1"],
    "--steps": ["0", "1e3", "99999999999999999999999"], "--global-batch": ["0", "-8"], "--grad-accum": ["0"],
    "--seq-len": ["1", "x"], "--lr": ["0", "-1", "nan", "inf", "1e999", "fast"], "--grad-clip": ["-1", "nan", "inf"],
    "--seed": ["-1", str(2**64), "1.5"], "--bucket-mb": ["0", "nan", "1e300"],
    "--timeout": ["0", "-5", "nan", "inf", "1e300"],
}

# Options given where they would be ignored, or values that cannot run together: (argv, the flag named).
LAYOUT_CASES = [
    (["--schedule", "gpipe"], "--schedule"), (["--microbatches", "4"], "--microbatches"),
    (["--chunks", "2"], "--chunks"),
    (["--pp-balance", "measured"], "--pp-balance"), (["--cp-attention", "ulysses"], "--cp-attention"),
    (["--dp", "4", "--dp-shard", "2", "--fsdp", "hybrid_shard"], "--dp"),
    (["--pp", "2", "--microbatches", "0"], "--microbatches"), (["--pp", "2", "--chunks", "0"], "--chunks"),
    (["--pp", "2000", "--microbatches", "2000"], "--microbatches"), (["--pp", "2", "--schedule", "nope"], "--schedule"),
    (["--pp", "2", "--chunks", "3"], "--chunks"), (["--pp", "2", "--pp-balance", "nope"], "--pp-balance"),
    (["--preset", "gigantic"], "--preset"), (["--tp", "3"], "--tp"), (["--ep", "2"], "--ep"), (["--sp"], "--sp"),
    (["--zero", "1", "--fsdp", "full_shard", "--dp", "2"], "--zero"), (["--fsdp", "nope"], "--fsdp"),
    (["--fsdp-style", "nope"], "--fsdp-style"), (["--mixed-precision", "fp16"], "--mixed-precision"),
    (["--recompute", "some"], "--recompute"), (["--dtype", "float16"], "--dtype"), (["--cp", "3"], "--cp"),
    (["--seq-len", "1"], "--seq-len"), (["--dp", "2", "--global-batch", "3"], "--global-batch"),
]

# Hugging Face config.json files given to --config: a field over a valid config (JSON's last key wins), or a whole
# file; with the name each message must give.
CONFIGS = {
    "fractional": ('"hidden_size": 64.5', "hidden_size"),
    "huge": ('"hidden_size": 1e12', "hidden_size"),
    "prime": ('"hidden_size": 2147483647', "n_heads"),
    "infinite": ('"hidden_size": 1e400', "hidden_size"),
    "nan": ('"rope_theta": NaN', "--config"),
    "theta": ('"rope_theta": -1', "rope_theta"),
    "eps": ('"rms_norm_eps": 0', "rms_norm_eps"),
    "string": ('"vocab_size": "256"', "vocab_size"),
    "bool": ('"num_hidden_layers": true', "num_hidden_layers"),
    "experts": ('"model_type": "mixtral", "num_local_experts": 1, "num_experts_per_tok": 1', "n_experts"),
    "list": ("[1, 2]", "--config"),
    "broken": ("{oops", "--config"),
}
BASE_CONFIG = ('"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128, '
               '"vocab_size": 256')

SIMULATE = ["simulate", "--schedule", "1f1b", "--pp", "2", "--microbatches", "4"]
SIMULATE_CASES = [
    *((SIMULATE + [flag, value], flag) for flag in ("--tf", "--tb", "--tw", "--tcomm")
      for value in ("nan", "inf", "-1", "1e300")),
    (["simulate", "--schedule", "1f1b", "--pp", "0", "--microbatches", "4"], "--pp"),
    (["simulate", "--schedule", "1f1b", "--pp", "2", "--microbatches", "0"], "--microbatches"),
    (["simulate", "--schedule", "interleaved", "--pp", "2", "--microbatches", "4", "--chunks", "0"], "--chunks"),
    (["simulate", "--schedule", "1f1b", "--pp", "2000", "--microbatches", "2000"], "--microbatches"),
    (["simulate", "--schedule", "interleaved", "--pp", "64", "--microbatches", "1024", "--chunks", "8"], "--chunks"),
    (["simulate", "--schedule", "nope", "--pp", "2", "--microbatches", "4"], "--schedule"),
    (["simulate", "--pp", "2", "--microbatches", "4"], "--schedule"),
    (SIMULATE + ["--plot", "out.txt"], "--plot"),
    (SIMULATE + ["--plot", "/nonexistent/dir/out.png"], "--plot"),
    (SIMULATE + ["--plot", "@dir.png"], "--plot"),
]

BENCH_CASES = [
    (["bench", "nothing"], "benchmark"), (["bench", "ddp", "--preset", "nope"], "--preset"),
    *((["bench", "ddp", flag, value], flag) for flag, values in {
        "--world": ["0", "99999999"], "--global-batch": ["0"], "--seq-len": ["1"], "--steps": ["0", "inf"],
        "--rounds": ["0"], "--bucket-mb": ["nan", "0"]}.items() for value in values),
    (["bench", "ddp", "--schedule", "gpipe"], "--schedule"),
    (["bench", "zero1", "--microbatches", "4"], "--microbatches"),
    (["bench", "ddp", "--sp"], "--sp"), (["bench", "fsdp", "--target", "mlp"], "--target"),
    (["bench", "tp", "--target", "all"], "--target"), (["bench", "tp", "--world", "1"], "--world"),
    (["bench", "pipeline", "--microbatches", "0"], "--microbatches"),
    (["bench", "pipeline", "--schedule", "zb-h2"], "--schedule"),
    (["bench", "ddp", "--world", "3"], "--global-batch"),
]

# The verbs around a run (plan, calibrate, verify-resume, export, plot-trace) and train's flags for data,
# schedules, checkpoints, devices and model shapes.
RUN_CASES = [
    (["plan"], "--gpus"), (["plan", "--gpus", "0"], "--gpus"), (["plan", "--gpus", "x"], "--gpus"),
    (["plan", "--gpus", "8", "--top", "0"], "--top"), (["plan", "--gpus", "8", "--hardware", "tpu"], "--hardware"),
    (["plan", "--gpus", "8", "--hardware", "@list.json"], "--hardware"),
    (["plan", "--gpus", "8", "--hardware", "@broken.json"], "--hardware"),
    (["plan", "--gpus", "6", "--dp", "4"], "--gpus"), (["plan", "--gpus", "8", "--fsdp", "full_shard"], "--fsdp"),
    (["plan", "--gpus", "8", "--layers", "0"], "--layers"), (["plan", "--gpus", "8", "--preset", "nope"], "--preset"),
    (["calibrate"], "--out"), (["calibrate", "--out", "/nonexistent/dir/hw.json"], "--out"),
    (["calibrate", "--out", "@dir"], "--out"),
    (["verify-resume"], "--save-layout"), (["verify-resume", "--save-layout", "--dp 2"], "--resume-layout"),
    (["verify-resume", "--save-layout", "--dp 0", "--resume-layout", "--dp 2"], "--save-layout"),
    (["verify-resume", "--save-layout", "--dp 2", "--resume-layout", "--tp 3"], "--resume-layout"),
    (["verify-resume", "--save-layout", "--dp 2", "--resume-layout", "--dp 1", "--save-at", "0"], "--save-at"),
    (["verify-resume", "--save-layout", "--dp 2", "--resume-layout", "--dp 1", "--save-at", "99"], "--save-at"),
    (["verify-resume", "--save-layout", "--dp 2", "--resume-layout", "--dp 1", "--tolerance", "nan"], "--tolerance"),
    (["export", "@dir", "--out", "@hf"], "checkpoint"), (["export", "/nonexistent", "--out", "@hf"], "checkpoint"),
    (["export", "@dir"], "--out"),
    (["plot-trace", "/nonexistent/trace.json", "--out", "@t.png"], "trace"),
    (["plot-trace", "@list.json", "--out", "out.txt"], "--out"),
    (["plot-trace", "@list.json", "--out", "@t.png", "--skip-steps", "-1"], "--skip-steps"),
    *((["train", flag, value], flag) for flag, values in {
        "--device": ["tpu"], "--save-every": ["0", "2"], "--resume": ["/nonexistent/ckpt", "auto", "@dir"],
        "--data": ["/nonexistent/corpus.txt", "@dir"], "--tokenizer": ["/nonexistent/tokenizer.json", "@list.json"],
        "--eval-every": ["-1", "5"], "--eval-split": ["1.5", "nan"], "--warmup": ["-1"], "--lr-schedule": ["step"],
        "--min-lr": ["-1", "inf"], "--init-from": ["/nonexistent/hf", "@dir"], "--export-hf": ["@list.json"],
        "--predict": ["tpu"], "--layers": ["0"], "--hidden": ["7"], "--heads": ["0", "3"], "--kv-heads": ["3"],
        "--mlp": ["relu"], "--experts": ["1"], "--topk": ["0"], "--vocab": ["0"], "--ffn": ["-4"],
        "--betas": ["0.9", "0.9,1"], "--eps": ["0"], "--weight-decay": ["-1", "nan"],
        "--export-dtype": ["float16", "same"]}.items()
      for value in values),
    (["train", "--async-save"], "--async-save"), (["verify", "--device", "tpu"], "--device"),
    (["verify", "--layers", "0"], "--layers"), (["estimate", "--experts", "8", "--topk", "9"], "--topk"),
]

CASES = [
    *(([verb, flag, value], flag) for verb in LAYOUT_VERBS for flag, values in SHARED_NUMERIC.items()
      for value in values),
    *(([verb, *argv], flag) for verb in LAYOUT_VERBS for argv, flag in LAYOUT_CASES),
    *((["train", "--config", f"@{name}.json"], field) for name, (_, field) in CONFIGS.items()),
    (["estimate", "--config", "@prime.json"], "n_heads"),
    (["train", "--config", "/nonexistent/config.json"], "--config"), (["verify", "--config", "@dir"], "--config"),
    (["train", "--trace", "/nonexistent/dir/trace.json"], "--trace"), (["train", "--trace", "@dir"], "--trace"),
    (["verify", "--tolerance", "-1"], "--tolerance"), (["verify", "--tolerance", "nan"], "--tolerance"),
    (["verify", "--tolerance", "inf"], "--tolerance"), (["verify", "--tolerance", "2"], "--tolerance"),
    (["estimate", "--attention", "naive"], "--attention"), (["estimate", "--hardware", "no.json"], "--hardware"),
    (["estimate", "--mlp", "relu"], "--mlp"),
    (["estimate", "--hardware", "tpu"], "--hardware"),
    (["train", "--frobnicate"], "--frobnicate"), (["train", "--steps"], "--steps"), (["train", "--lr=-inf"], "--lr"),
    (["train", "--tolerance", "1e-3"], "--tolerance"), (["estimate", "--trace", "t.json"], "--trace"),
    *SIMULATE_CASES,
    *BENCH_CASES,
    *RUN_CASES,
]


@pytest.fixture
def tripwire(monkeypatch):
    """Any work (a launch, an in-process training run, the verifier's reference, a simulation) fails the test."""
    def started(*args, **kwargs):
        raise AssertionError("the work started: the input was accepted")
    import torch.distributed.launcher.api

    import parallelisms.parallel.pipeline.cli
    monkeypatch.setattr(torch.distributed.launcher.api, "elastic_launch", started)
    monkeypatch.setattr(parallelisms.parallel.pipeline.cli, "simulate", started)
    for module, work in (("parallelisms.training", "train_rank"), ("parallelisms.equivalence", "check_reference"),
                         ("parallelisms.perf.plan", "plan"), ("parallelisms.perf.calibrate", "calibrate"),
                         ("parallelisms.checkpoint", "load_full_state"), ("parallelisms.plot_trace", "plot_trace")):
        monkeypatch.setattr(importlib.import_module(module), work, started)


@pytest.fixture
def paths(tmp_path):
    """``@NAME`` in an argv: ``@dir`` a directory, ``@NAME.json`` a config file from CONFIGS, else a path in it."""
    for name, (content, _) in CONFIGS.items():
        (tmp_path / f"{name}.json").write_text(f"{{{BASE_CONFIG}, {content}}}" if content.startswith('"') else content)
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir.png").mkdir()
    return lambda argv: [str(tmp_path / a[1:]) if a.startswith("@") else a for a in argv]


class _Hang(Exception):
    pass


@contextlib.contextmanager
def _within(seconds: float):
    """Raise _Hang in the block after ``seconds`` (validation does not scale with the values)."""
    def hang(signum, frame):
        raise _Hang(f"no answer within {seconds} s")
    previous = signal.signal(signal.SIGALRM, hang)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _one_line(capsys, argv, flag):
    with _within(10):
        code = main(argv)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2, (code, captured.err[-500:])
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert "Traceback" not in captured.err + captured.out
    assert flag in lines[0], lines[0]
    return lines[0]


def test_the_table_is_large():
    verbs = {"train", "verify", "estimate", "simulate", "bench", "plan", "calibrate", "verify-resume", "export",
             "plot-trace"}
    assert len(CASES) >= 120 and {argv[0] for argv, _ in CASES} == verbs


@pytest.mark.parametrize("argv, flag", CASES, ids=[" ".join(argv) for argv, _ in CASES])
def test_bad_input_is_one_line_naming_the_flag(capsys, tripwire, paths, argv, flag):
    _one_line(capsys, paths(argv), flag)


def test_plot_without_matplotlib_fails_before_the_simulation(capsys, tripwire, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what find_spec reports for a module that is absent
    line = _one_line(capsys, SIMULATE + ["--plot", str(tmp_path / "s.png")], "--plot")
    assert "matplotlib" in line


def test_many_ranks_on_few_cores_warn_once_before_launch(capsys, monkeypatch):
    import torch.distributed.launcher.api

    from parallelisms.launch import launch
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(torch.distributed.launcher.api, "elastic_launch",
                        lambda config, fn: lambda *args: dict.fromkeys(range(config.nproc_per_node)))
    assert launch(print, 64, backend="gloo") == [None] * 64
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: 64 ranks on 2 CPU cores"), lines


def test_json_is_strict():
    line = json_line({"loss": math.nan, "losses": [1.0, math.inf], "nested": {"x": -math.inf}, "ok": 1})

    def refuse(constant):
        raise ValueError(constant)
    parsed = json.loads(line, parse_constant=refuse)
    assert parsed["loss"] is None and parsed["losses"] == [1.0, None] and parsed["nested"]["x"] is None
    assert parsed["nonfinite_fields"] == ["loss", "losses[1]", "nested.x"]


@pytest.mark.parametrize("argv, flag", [
    (["train", "--steps", "99999999999999999999999"], "--steps"),
    (["simulate", "--schedule", "1f1b", "--pp", "2000", "--microbatches", "2000"], "--microbatches"),
    (["verify", "--schedule", "zb-v"], "--schedule"),
])
def test_the_terminal_sees_one_line(argv, flag):
    """As a process: one line on stderr, nothing else, exit code 2."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, "-m", "parallelisms", *argv], capture_output=True, text=True, env=env,
                          timeout=60)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and done.stdout == "" and len(lines) == 1, done.stderr
    assert lines[0].startswith("error: ") and flag in lines[0], done.stderr


def test_a_diverged_run_prints_strict_json_and_exits_1_naming_the_step(capsys):
    # --decay-all: decay of every weight at lr 1e6 makes the loss NaN by step 3 (decay of the matrices alone does not)
    argv = ["train", "--dp", "1", "--steps", "3", "--lr", "1e6", "--global-batch", "2", "--seq-len", "16", "--json",
            "--decay-all"]
    assert main(argv) == 1
    captured = capsys.readouterr()
    report = json.loads(captured.out.strip().splitlines()[-1], parse_constant=lambda c: pytest.fail(f"bare {c}"))
    assert report["loss_last"] is None and "loss_last" in report["nonfinite_fields"]
    errors = [ln for ln in captured.err.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "training diverged" in errors[0] and "at step" in errors[0] and "--lr" in errors[0]
