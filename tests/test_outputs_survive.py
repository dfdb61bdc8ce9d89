"""Results survive their outputs: the report (and ``--json``) is printed whatever output fails; a removed
``--trace`` directory or a full disk under ``--export-hf`` is one line (the weights kept and named), a removed
``--tensorboard`` directory does not end the run, and a removed ``--metrics`` file is made anew."""

import json
import shutil

import pytest

from parallelisms.cli import main
from parallelisms.metrics import read_metrics

TINY = ["--preset", "tiny", "--hidden", "32", "--layers", "2", "--heads", "4", "--vocab", "256", "--seq-len", "16",
        "--global-batch", "4", "--json"]


def _at_step(monkeypatch, step: int, action) -> None:
    """``action()`` once the ``step``-th training step has run (in this process: --dp 1)."""
    from parallelisms.trainer import MicrobatchLoop

    original, calls = MicrobatchLoop.__call__, []

    def then_act(self, inputs, targets, grad_sync):
        loss = original(self, inputs, targets, grad_sync)
        calls.append(1)
        if len(calls) == step:
            action()
        return loss
    monkeypatch.setattr(MicrobatchLoop, "__call__", then_act)


def _run(capsys, *extra) -> tuple[int, dict | None, list[str], str]:
    code = main(["train", "--dp", "1", "--steps", "3", *TINY, *extra])
    captured = capsys.readouterr()
    reports = [json.loads(ln) for ln in captured.out.splitlines() if ln.startswith("{")]
    return code, reports[-1] if reports else None, [ln for ln in captured.err.splitlines() if ln.startswith("error")], \
        captured.err


def test_a_removed_trace_directory_is_one_line_after_the_report(tmp_path, capsys, monkeypatch):
    where = tmp_path / "traces"
    where.mkdir()
    _at_step(monkeypatch, 2, lambda: shutil.rmtree(where))
    code, report, errors, _ = _run(capsys, "--trace", str(where / "t.json"))
    assert code == 1 and report is not None and len(report["losses"]) == 3
    assert len(errors) == 1 and f"--trace '{where / 't.json'}': writing" in errors[0] and "No such file" in errors[0]


def test_removed_metrics_and_tensorboard_outputs_do_not_end_the_run(tmp_path, capsys, monkeypatch):
    pytest.importorskip("tensorboard")
    metrics, board = tmp_path / "m" / "metrics.jsonl", tmp_path / "tb"

    def remove():
        metrics.unlink()
        shutil.rmtree(board)
    _at_step(monkeypatch, 2, remove)  # during step 2, before its record
    code, report, errors, err = _run(capsys, "--metrics", str(metrics), "--tensorboard", str(board))
    assert code == 0 and report is not None and not errors and "Traceback" not in err
    assert [r["step"] for r in read_metrics(str(metrics))] == [2, 3]  # made anew from the next record on
    assert list(board.iterdir())


def test_an_export_onto_a_full_disk_keeps_the_weights_and_names_them(tmp_path, small_disk, capsys):
    small_disk = small_disk("64k")
    code, report, errors, _ = _run(capsys, "--export-hf", str(small_disk / "hf"), "--save", str(tmp_path / "ck"))
    assert code == 1 and report is not None
    assert len(errors) == 1 and "No space left on device" in errors[0], errors
    assert f"the weights are in the checkpoint {tmp_path / 'ck' / 'step_3'}" in errors[0]
    code, report, errors, _ = _run(capsys, "--export-hf", str(small_disk / "hf2"))
    assert code == 1 and len(errors) == 1 and "the weights are written to" in errors[0], errors
    assert (tmp_path.parent / report["exported_hf"]).joinpath("model.safetensors").is_file()
    shutil.rmtree(report["exported_hf"])
