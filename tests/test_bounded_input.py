"""Bounded input: JSON nested 100,000 deep (config, hardware, trace) and a config path that is a FIFO, a
symbolic-link loop or a device are one line naming what they are, before any process starts."""

import os

import pytest

from parallelisms.cli import main

DEEP = "[" * 100_000


def _one_error(capsys) -> str:
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_deep_json_is_one_line(tmp_path, capsys):
    deep = tmp_path / "deep.json"
    deep.write_text(DEEP)
    assert main(["train", "--config", str(deep), "--steps", "1"]) == 2
    assert "is not valid JSON (RecursionError" in _one_error(capsys)
    assert main(["estimate", "--preset", "tiny", "--hardware", str(deep)]) == 2
    assert "not a readable JSON file (RecursionError)" in _one_error(capsys)
    assert main(["plot-trace", str(deep), "--out", str(tmp_path / "t.png")]) == 2
    assert "RecursionError" in _one_error(capsys)


@pytest.mark.parametrize("kind, needle", [("fifo", "is a FIFO"), ("loop", "symbolic link loop"),
                                          ("device", "is a character device"), ("dangling", "dangling symbolic")])
def test_a_config_that_is_not_a_file_is_named_as_what_it_is(kind, needle, tmp_path, capsys):
    path = tmp_path / "config.json"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "loop":
        os.symlink(path, path)
    elif kind == "dangling":
        os.symlink(tmp_path / "nowhere", path)
    else:
        path = "/dev/null"
    assert main(["train", "--config", str(path), "--steps", "1"]) == 2
    assert needle in _one_error(capsys)
