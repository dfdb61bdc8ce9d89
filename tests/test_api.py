"""The Python API: each verb returns what its command-line twin prints with ``--json``; the examples of
docs/api.md run; examples/train_with_api.py trains under torchrun; ``import parallelisms`` stays light."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import parallelisms
from parallelisms.cli import main
from parallelisms.errors import ConfigError
from parallelisms.flags import json_line

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(global_batch=4, seq_len=32)  # a few milliseconds a step
TIMING = {"step_time_s", "tokens_per_s", "exposed_comm_fraction", "overlap_per_rank", "memory", "memory_per_rank",
          "stragglers", "loop_time_s"}


def _cli_json(capsys, verb: str, options: dict) -> dict:
    argv = [verb]
    for name, value in options.items():
        argv += [f"--{name.replace('_', '-')}"] + ([] if value is True else [str(value)])
    capsys.readouterr()
    assert main([*argv, "--json"]) in (0, 1)
    return json.loads(capsys.readouterr().out.splitlines()[-1])


def _same(api: dict, cli: dict, skip=frozenset()) -> None:
    api = json.loads(json_line(api))  # what --json would print of it
    assert set(api) == set(cli)
    assert {k: v for k, v in api.items() if k not in skip} == {k: v for k, v in cli.items() if k not in skip}


def test_train_as_its_cli_twin(capsys):
    options = dict(dp=1, steps=3, **SMALL)
    _same(parallelisms.train(**options), _cli_json(capsys, "train", options), skip=TIMING)


def test_verify_as_its_cli_twin(capsys):
    options = dict(dp=2, steps=2, zero=1, **SMALL)
    api = parallelisms.verify(**options)
    assert api["ok"] and api["layout"] == "dpshard2 zero1" and api["backend"] == "gloo"
    _same(api, _cli_json(capsys, "verify", options))


@pytest.mark.parametrize("verb, options", [
    ("estimate", dict(preset="llama3-8b", dp=8, tp=2, sp=True, global_batch=16)),
    ("estimate", dict(pp=2, dp=2, schedule="pipedream", zero=1)),  # estimated although the runtime refuses it
    ("simulate", dict(schedule="zb-v", pp=4, microbatches=8)),
    ("plan", dict(gpus=8, preset="small", global_batch=16, top=3)),
])
def test_estimate_plan_and_simulate_as_their_cli_twins(capsys, verb, options):
    _same(getattr(parallelisms, verb)(**options), _cli_json(capsys, verb, options))


def test_bad_options_raise_the_cli_line():
    with pytest.raises(ConfigError, match="argument --dp: must be an integer from 1"):
        parallelisms.train(dp=0)
    with pytest.raises(ConfigError, match="unknown keyword .frobnicate. for parallelisms.verify"):
        parallelisms.verify(frobnicate=1)


def test_docs_examples_run(capsys):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "api.md").read_text(), re.S)
    assert len(blocks) >= 2
    for block in blocks:
        exec(compile(block, "docs/api.md", "exec"), {})
    assert "single" in capsys.readouterr().out


def test_example_script_under_torchrun():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           str(ROOT / "examples" / "train_with_api.py"), "--steps", "6", "--global-batch", "4",
                           "--seq-len", "32"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    losses = [float(x) for x in re.findall(r"^dp2 step +\d+: loss ([\d.]+)", done.stdout, re.M)]
    assert len(losses) == 2 and losses[-1] < losses[0], done.stdout


def test_import_is_light_and_names_resolve():
    code = ("import sys, parallelisms; assert 'torch' not in sys.modules, 'torch imported'; "
            "from parallelisms.training import RunSpec; import parallelisms.equivalence, parallelisms.training; "
            "assert callable(parallelisms.train) and callable(parallelisms.verify), 'submodule shadowed the API'; "
            "print(sorted(set(parallelisms.__all__) - set(dir(parallelisms))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={
        **os.environ, "PYTHONPATH": str(ROOT / "src")}, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr


def test_readme_snippet_as_a_script_without_a_main_guard(tmp_path):
    """README's Python snippet, pasted into a script with no ``if __name__ == "__main__"`` guard, runs its
    multi-rank calls: the ranks run the package's ``__main__.py``, never the caller's script. Its steps and
    batch are cut to a test's budget; the script is otherwise the README's."""
    snippet = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)[1]
    assert "__main__" not in snippet and "steps=50" in snippet and "zero=3)" in snippet
    small = "steps=2, global_batch=4, seq_len=32"
    script = tmp_path / "snippet.py"
    script.write_text(snippet.replace("steps=50", small).replace("zero=3)", f"zero=3, {small})")
                      + "\nprint('ranks', report['world_size'], 'ok', parallelisms.verify(dp=2, steps=1, "
                        "global_batch=4, seq_len=32)['ok'])\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "ranks 4 ok True"
    assert "bootstrapping" not in done.stderr
