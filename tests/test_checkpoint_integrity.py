"""Checkpoints are verified and exclusive: each save's manifest (size and CRC-32 per file) is checked before a
resume or an export, ``--resume auto`` falls back to the newest step that verifies and says what it skipped, one
run at a time per ``--save`` directory, a fresh run does not write over another's steps, and a save that fails
(disk full, the directory removed) is one line naming the path and the OS error, the previous step intact and no
``.tmp`` left."""

import json
import os
import shutil

import pytest

from parallelisms.checkpoint_files import damage, lock_directory
from parallelisms.cli import main

TINY = ["--preset", "tiny", "--hidden", "32", "--layers", "2", "--heads", "4", "--vocab", "256", "--seq-len", "16",
        "--global-batch", "4", "--json"]


def _train(*extra) -> list[str]:
    return ["train", "--dp", "1", *TINY, *extra]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A one-process run of 4 steps saved at steps 2 and 4."""
    root = tmp_path_factory.mktemp("saved") / "run"
    assert main(_train("--steps", "4", "--save", str(root), "--save-every", "2")) == 0
    return root


def _copy(saved, tmp_path):
    root = tmp_path / "run"
    shutil.copytree(saved, root, ignore=shutil.ignore_patterns(".parallelisms.lock"))
    return root


def _errors(capsys) -> list[str]:
    return [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error: ")]


def _report(capsys) -> dict:
    return json.loads([ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")][-1])


def test_every_save_has_a_manifest_that_verifies(saved):
    manifest = json.loads((saved / "step_4" / "manifest.json").read_text())["files"]
    assert {".metadata", "__0_0.distcp"} <= manifest.keys() and damage(saved / "step_4", "parallelisms.json") is None


def test_flipped_bytes_are_refused_and_resume_auto_falls_back(saved, tmp_path, capsys):
    root = _copy(saved, tmp_path)
    shard = root / "step_4" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[1000:1400] = bytes(b ^ 0xFF for b in data[1000:1400])
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(_train("--steps", "6", "--resume", str(root / "step_4"))) == 2
    (line,) = _errors(capsys)
    assert "__0_0.distcp differs from its manifest" in line, line
    assert main(_train("--steps", "6", "--save", str(root), "--resume", "auto")) == 0
    captured = capsys.readouterr()
    assert "--resume auto skips step_4: __0_0.distcp differs from its manifest" in captured.err
    report = json.loads([ln for ln in captured.out.splitlines() if ln.startswith("{")][-1])
    assert report["first_step"] == 3


def test_resume_auto_skips_a_step_without_its_metadata(saved, tmp_path, capsys):
    root = _copy(saved, tmp_path)
    (root / "step_4" / ".metadata").unlink()
    assert main(_train("--steps", "5", "--save", str(root), "--resume", "auto")) == 0
    captured = capsys.readouterr()
    assert "--resume auto skips step_4: no .metadata" in captured.err and '"first_step": 3' in captured.out


def test_a_second_run_on_a_save_directory_is_refused(saved, tmp_path, capsys):
    root = _copy(saved, tmp_path)
    held = lock_directory(root)  # a run in progress
    try:
        assert main(_train("--steps", "6", "--save", str(root), "--resume", "auto")) == 2
        (line,) = _errors(capsys)
        assert "is in use by another run (pid" in line, line
    finally:
        held.close()


def test_a_fresh_run_does_not_write_over_another_runs_steps(saved, tmp_path, capsys):
    root = _copy(saved, tmp_path)
    before = {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.name != ".parallelisms.lock"}
    assert main(_train("--steps", "2", "--save", str(root), "--save-every", "1")) == 2
    (line,) = _errors(capsys)
    assert "holds checkpoints of another run (step_4); add --resume auto to continue it" in line, line
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.name != ".parallelisms.lock"} == before


def test_a_removed_save_directory_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    from parallelisms.checkpoint import Saver

    root = tmp_path / "run"
    save = Saver.save

    def remove_before_the_second(self, trainer, step, data_state=None):
        if step == 2:
            shutil.rmtree(root)
        return save(self, trainer, step, data_state)
    monkeypatch.setattr(Saver, "save", remove_before_the_second)
    assert main(_train("--steps", "3", "--save", str(root), "--save-every", "1")) == 1
    (line,) = _errors(capsys)
    assert f"{root}/step_2.tmp" in line and "No such file or directory" in line, line
    assert not root.exists()


def test_a_full_disk_is_one_line_and_keeps_the_previous_step(small_disk, capsys):
    disk = small_disk("1m")  # room for one checkpoint of TINY, not two
    root = disk / "run"
    assert main(_train("--steps", "3", "--save", str(root), "--save-every", "1")) == 1
    (line,) = _errors(capsys)
    assert str(root / "step_2.tmp") in line and "No space left on device" in line, line
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == ["step_1"]
    assert damage(root / "step_1", "parallelisms.json") is None
    assert os.listdir(disk) == ["run"]
