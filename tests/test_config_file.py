"""``--config-file run.toml``: a run from a file resolves to the same configs as the same run given as flags,
flags override the file, a key or section the verb lacks is one line naming it, ``verify`` runs from a file, and
docs/config-file.md's ``run.toml`` trains."""

import json
import re
from pathlib import Path

import pytest

from parallelisms.cli import build_configs, build_parser, main
from parallelisms.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = "dpshard2 zero1"  # docs/config-file.md's run.toml
RUN = """
[model]
preset = "tiny"
layers = 4

[layout]
dp = 2
tp = 2
sp = true
zero = 1
recompute = "selective"

[training]
steps = 3
global_batch = 8
seq_len = 32
seed = 11

[optimizer]
lr = 2e-3
betas = [0.8, 0.9]
decay_all = true
"""
SAME_AS_FLAGS = ["--preset", "tiny", "--layers", "4", "--dp", "2", "--tp", "2", "--sp", "--zero", "1",
                 "--recompute", "selective", "--steps", "3", "--global-batch", "8", "--seq-len", "32", "--seed", "11",
                 "--lr", "2e-3", "--betas", "0.8,0.9", "--decay-all"]


def _configs(argv):
    return build_configs(build_parser().parse_args(argv))


def _write(tmp_path, text: str, name: str = "run.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.fast
@pytest.mark.parametrize("verb", ["train", "verify", "estimate"])
def test_a_file_run_resolves_to_the_same_configs_as_its_flags(tmp_path, verb):
    run = _write(tmp_path, RUN)
    from_file = _configs([verb, "--config-file", run])
    assert from_file == _configs([verb, *SAME_AS_FLAGS])
    assert from_file[2].dims.tp == 2 and from_file[1].betas == (0.8, 0.9)  # the file was read, not the defaults


@pytest.mark.fast
def test_flags_override_the_file(tmp_path):
    run = _write(tmp_path, RUN)
    model, train, parallel = _configs(["train", f"--config-file={run}", "--dp", "4", "--lr", "1e-4"])
    assert (parallel.dims.dp, parallel.dims.tp, train.lr, train.steps) == (4, 2, 1e-4, 3)
    model, train, parallel = _configs(["train", "--steps", "7", "--config-file", run])
    assert (train.steps, train.lr, parallel.dims.dp) == (7, 2e-3, 2)


@pytest.mark.fast
@pytest.mark.parametrize("verb, text, message", [
    ("train", "[layout]\ndpp = 2\n", "[layout] has no key 'dpp' for parallelisms train; valid keys: dp, dp_replicate"),
    ("train", "[layot]\ndp = 2\n", "has no section [layot]; valid sections: [model], [layout], [training], [optimizer]"),
    ("verify", "[outputs]\ntrace = 't.json'\n", "[outputs] has no key 'trace' for parallelisms verify; valid keys: json"),
    ("train", "dp = 2\n", "dp = 2 is outside a section"),
    ("train", "[layout]\nsp = 1\n", "[layout] sp is a switch; give true or false, got 1"),
    ("train", "[layout]\ndp = 0\n", "argument --dp: must be an integer from 1"),
    ("train", "[layout\n", "is not valid TOML"),
    ("estimate", "[training]\nsteps = true\n", "[training] steps takes a value like its flag --steps, got True"),
])
def test_a_bad_file_is_one_line_naming_the_file(tmp_path, capsys, verb, text, message):
    run = _write(tmp_path, text)
    assert main([verb, "--config-file", run]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--config-file {run!r}" in err and message in err, err


@pytest.mark.fast
def test_a_missing_file_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="does not exist; give a TOML file"):
        build_parser().parse_args(["train", "--config-file", str(tmp_path / "none.toml")])


def test_verify_from_a_file(tmp_path, capsys):
    run = _write(tmp_path, '[layout]\ndp = 2\n[training]\nsteps = 2\nglobal_batch = 4\nseq_len = 16\n'
                           '[run]\ndevice = "cpu"\n[outputs]\njson = true\n')
    assert main(["verify", "--config-file", run]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["ok"] and result["layout"] == "dp2" and result["steps"] == 2


def test_the_docs_example_trains(tmp_path, capsys, monkeypatch):
    page = (ROOT / "docs" / "config-file.md").read_text()
    example = re.search(r"^```toml\n(.*?)^```", page, re.S | re.M).group(1)
    monkeypatch.chdir(tmp_path)
    _write(tmp_path, example)
    (tmp_path / "corpus.txt").write_text("the run is one file; flags override it. " * 200)
    assert main(["train", "--config-file", "run.toml", "--steps", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert report["layout"] == LAYOUT, report["layout"]
    assert len(report["losses"]) == 2 and report["eval_losses"]
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 2
