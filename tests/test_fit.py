"""Memory before launch (``parallelisms.fit``): a layout whose ranks need more memory than the machine has is
refused in one line before any process starts (by how much, and what fits), ``--force`` passes; a rank the
kernel's out-of-memory killer ends is reported as out of memory."""

import signal
import types

import pytest

from parallelisms import fit, launch
from parallelisms.cli import build_configs, build_parser, main, prepare
from parallelisms.errors import ConfigError


@pytest.mark.fast
def test_a_layout_that_does_not_fit_is_refused_before_launch(capsys, monkeypatch):
    monkeypatch.setattr(launch, "launch", lambda *a, **k: pytest.fail("launched"))
    assert main(["train", "--preset", "llama3-8b", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert err.startswith("error: dp2 of llama3-8b does not fit this machine: 2 rank(s) x ")
    assert " over " in err and "presets that fit this layout: tiny" in err and "--force" in err


def test_force_skips_the_check():
    args = build_parser().parse_args(["verify", "--preset", "llama3-8b", "--steps", "1", "--force"])
    model, train, parallel, placement = prepare(args)
    assert placement.device == "cpu" and parallel.dims.world_size == 2


@pytest.mark.fast
def test_the_check_counts_every_rank_of_the_machine_and_the_dtype():
    model, train, parallel = build_configs(build_parser().parse_args(["train", "--dp", "4"]))
    per_rank = fit.rank_bytes(model, train, parallel)
    assert per_rank > fit.PROCESS_BYTES
    assert fit.rank_bytes(model, train.replace(dtype="float64"), parallel) > per_rank
    fit.check_fits(model, train, parallel, "cpu", 4, "tiny", available=int(4 * per_rank))
    with pytest.raises(ConfigError, match=r"4 rank\(s\) x .* over .*--force"):
        fit.check_fits(model, train, parallel, "cpu", 4, "tiny", available=int(3 * per_rank))
    fit.check_fits(model, train, parallel, "cuda", 4, "tiny", available=int(per_rank))  # one rank per GPU


@pytest.mark.fast
def test_a_rank_killed_for_memory_is_named_out_of_memory(monkeypatch):
    killed = {1: types.SimpleNamespace(exitcode=-signal.SIGKILL, message="Signal 9 (SIGKILL) received by PID 7",
                                       timestamp=1)}
    monkeypatch.setattr(fit, "oom_signs", lambda: {"/proc/vmstat": 3})
    assert str(launch._launch_error(killed, {"/proc/vmstat": 3})).startswith("rank 1 failed (exit code -9)")
    assert str(launch._launch_error(killed, {"/proc/vmstat": 2})).startswith("rank 1 ran out of memory: the kernel's "
                                                                             "out-of-memory killer ended it")
