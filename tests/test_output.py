"""Output that tells the truth: the progress bar and the summary show the same loss (the mean over the
data-parallel ranks, and say so); the summary names the checkpoints written, the metrics file and the step a run
resumed from, and counts a resumed run's steps from there. The bar is drawn only on a terminal: stderr here is
a pseudo-terminal."""

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--dp", "2", "--global-batch", "4", "--seq-len", "32"]


def _train_on_a_terminal(*argv: str) -> tuple[str, str]:
    """stdout and the terminal's text (stderr) of ``parallelisms train`` run with stderr on a pseudo-terminal."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 200, 0, 0))  # a width the bar can use
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen([sys.executable, "-m", "parallelisms", "train", *SMALL, *argv], stdout=subprocess.PIPE,
                            stderr=follower, env=env, text=True)
    os.close(follower)
    terminal = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the terminal closed: every writer has exited
            break
        if not chunk:
            break
        terminal += chunk
    out = proc.stdout.read()
    assert proc.wait(timeout=600) == 0, terminal.decode(errors="replace")[-2000:]
    os.close(leader)
    return out, terminal.decode(errors="replace")


def _bar_loss(terminal: str) -> str:
    return re.findall(r"loss_rank_mean=([0-9.]+)", terminal)[-1]


def test_bar_and_summary_show_the_same_loss_and_name_what_was_written(tmp_path):
    out, terminal = _train_on_a_terminal("--steps", "3", "--save", str(tmp_path), "--save-every", "2")
    summary = re.search(r"loss: +[0-9.]+ -> ([0-9.]+) \(the mean over the data-parallel ranks", out)
    assert summary and _bar_loss(terminal) == summary[1]
    assert f"saved: 2 checkpoints: {tmp_path / 'step_2'}, {tmp_path / 'step_3'}" in out
    assert f"log:   {tmp_path / 'metrics.jsonl'}" in out
    assert "3/3" in terminal

    out, terminal = _train_on_a_terminal("--steps", "5", "--save", str(tmp_path), "--resume", "auto")
    assert f"2 steps (4 to 5, resumed from step 3 of {tmp_path / 'step_3'})" in out
    assert re.search(r"loss: +[0-9.]+ -> ([0-9.]+)", out)[1] == _bar_loss(terminal)
    assert f"saved: 1 checkpoint: {tmp_path / 'step_5'}" in out
    assert "5/5" in terminal
