"""Checkpoints run nothing from their files: a crafted ``.metadata`` (a pickle that would run a command) and a
non-tensor entry (which DCP would unpickle) are refused with one line by ``export``, ``--resume`` and
``load_full_state``, and nothing runs."""

import json
import os
import pickle
import shutil

import pytest
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from parallelisms.checkpoint_files import MANIFEST, read_metadata, write_manifest
from parallelisms.cli import main
from parallelisms.errors import ConfigError

TINY = ["--preset", "tiny", "--hidden", "32", "--layers", "2", "--heads", "4", "--vocab", "256", "--seq-len", "16",
        "--global-batch", "4"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A complete checkpoint of a one-process run (step_2)."""
    root = tmp_path_factory.mktemp("saved")
    assert main(["train", "--dp", "1", "--steps", "2", *TINY, "--save", str(root / "run"), "--save-every", "2"]) == 0
    return root / "run" / "step_2"


class _RunsACommand:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _crafted(saved, tmp_path, payload) -> tuple:
    step = tmp_path / "run" / "step_2"
    shutil.copytree(saved, step)
    (step / ".metadata").write_bytes(pickle.dumps(payload))
    if payload is not None:  # whoever can write the checkpoint can rewrite its manifest: the reading must hold alone
        (step / MANIFEST).unlink()
        write_manifest(step)
    return step


def _one_error_line(capsys) -> str:
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_a_crafted_metadata_runs_nothing_in_export_resume_or_load(saved, tmp_path, capsys):
    marker = tmp_path / "ran"
    step = _crafted(saved, tmp_path, _RunsACommand(marker))
    assert main(["export", str(step), "--out", str(tmp_path / "hf")]) == 2
    assert "system, which is not part of a checkpoint's metadata" in _one_error_line(capsys)
    assert main(["train", "--dp", "1", "--steps", "4", *TINY, "--resume", str(step)]) == 2
    assert "nothing in it was run" in _one_error_line(capsys)
    # --resume auto skips the crafted step, saying why, and starts from what verifies (here nothing: step 0)
    assert main(["train", "--dp", "1", "--steps", "4", *TINY, "--save", str(step.parent), "--resume", "auto"]) == 0
    assert "--resume auto skips step_2" in capsys.readouterr().err
    from parallelisms.checkpoint import load_full_state
    with pytest.raises(ConfigError, match="system"):
        load_full_state(step)
    assert not marker.exists()


def test_a_pickled_entry_is_refused(saved, tmp_path, capsys):
    """A well-formed metadata whose training state is a pickled object (what DCP unpickles without restriction)."""
    metadata = read_metadata(saved / ".metadata")
    metadata.state_dict_metadata["train.json"] = BytesStorageMetadata()
    step = _crafted(saved, tmp_path, metadata)
    assert main(["train", "--dp", "1", "--steps", "4", *TINY, "--resume", str(step)]) == 2
    assert "train.json as a pickled object" in _one_error_line(capsys)


def test_damaged_metadata_files_are_one_line(saved, tmp_path, capsys):
    step = _crafted(saved, tmp_path, None)
    (step / ".metadata").write_bytes((saved / ".metadata").read_bytes()[:100])
    assert main(["export", str(step), "--out", str(tmp_path / "hf")]) == 2
    assert ".metadata" in _one_error_line(capsys)
    shutil.copy(saved / ".metadata", step / ".metadata")
    (step / "parallelisms.json").write_text('{"model": ')
    assert main(["export", str(step), "--out", str(tmp_path / "hf")]) == 2
    line = _one_error_line(capsys)
    assert "parallelisms.json" in line and "damaged" in line
    (step / "parallelisms.json").write_text("[" * 100_000)
    assert main(["train", "--dp", "1", "--steps", "4", *TINY, "--resume", str(step)]) == 2
    assert "damaged" in _one_error_line(capsys)


def test_a_storage_entry_outside_the_directory_is_refused(saved, tmp_path):
    metadata = read_metadata(saved / ".metadata")
    info = next(iter(metadata.storage_data.values()))
    info.relative_path = "../../etc/passwd"
    step = _crafted(saved, tmp_path, metadata)
    with pytest.raises(ConfigError, match="not at a data file"):
        read_metadata(step / ".metadata")


def test_the_saved_training_state_is_json(saved):
    from parallelisms.checkpoint_files import tensor_json
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_metadata(saved / ".metadata")
    assert all(isinstance(md, TensorStorageMetadata) for md in metadata.state_dict_metadata.values())
    assert json.loads((saved / "parallelisms.json").read_text())["format"] == 2
    assert "train.json" in metadata.state_dict_metadata and "rng.0.torch" in metadata.state_dict_metadata
    assert tensor_json  # the round trip is exercised by every resume test
