"""The verbs that train nothing import no torch (``parallelisms.cli_verbs`` states the rule): ``--help``,
``--version``, ``estimate``, ``plan`` and ``simulate`` are checked in a fresh interpreter, by the modules it loaded
(a property a busy machine cannot break) and by the CPU time it spent (``--help`` under 0.5 s; CPU time, not
wall-clock time, which other work on the machine stretches)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "numpy")
# runs a verb, then prints the heavy modules it loaded and the CPU seconds it used, as JSON on the last line
PROBE = """
import json, os, sys
from parallelisms.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:  # --help and --version exit through argparse
    code = exc.code
cpu = sum(os.times()[:2])
print(json.dumps({"code": code, "loaded": [m for m in %r if m in sys.modules], "cpu_s": cpu}))
""" % (HEAVY,)


def _probe(*argv: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("argv", [
    ["--help"], ["--version"], ["train", "--help"], ["verify", "--help"], ["bench", "--help"],
    ["calibrate", "--help"], ["estimate", "--preset", "llama3-8b", "--dp", "8", "--tp", "2", "--sp", "--json"],
    ["plan", "--gpus", "8", "--preset", "small", "--top", "2"],
    ["simulate", "--schedule", "zb-v", "--pp", "4", "--microbatches", "8"],
])
def test_verbs_that_train_nothing_import_no_torch(argv):
    result = _probe(*argv)
    assert result["code"] in (0, None)
    assert result["loaded"] == [], f"{' '.join(argv)} imported {result['loaded']}: import it inside the verb's function"


def test_help_takes_under_half_a_second_of_cpu():
    assert _probe("--help")["cpu_s"] < 0.5


def test_calibrate_warns_when_the_machine_is_busy(capsys):
    from parallelisms.cli_verbs import BUSY_LOAD_PER_CORE, _warn_if_busy

    assert _warn_if_busy(BUSY_LOAD_PER_CORE * 2 + 0.1, 2, "before calibrating")
    assert "busy before calibrating (load average 1.1 on 2 cores)" in capsys.readouterr().err
    assert not _warn_if_busy(BUSY_LOAD_PER_CORE * 2, 2, "before calibrating") and not capsys.readouterr().err
    assert not _warn_if_busy(None, 2, "while calibrating")
