"""Training metrics a dashboard can read: one JSON object per line (step, loss, eval loss, learning rate,
gradient norm, tokens/s, exposed communication, peak memory), and the same scalars as TensorBoard events
through torch's ``SummaryWriter`` (the ``tensorboard`` package, an optional extra).

Rank 0 writes both, after each step (flushed, so a run that dies keeps what it logged). ``--metrics FILE``
names the file; a run that saves checkpoints writes ``metrics.jsonl`` next to them (:func:`default_metrics_path`).
A metrics file or TensorBoard directory removed during the run is made anew (from the next record on); a write
that fails (a full disk, no permission) is one warning line, and training goes on without that output.
"""

from __future__ import annotations

import os
import sys

from parallelisms.flags import json_line

METRICS_FILE = "metrics.jsonl"


def default_metrics_path(save_dir: str) -> str:
    """Where a run saving checkpoints to ``save_dir`` writes its metrics."""
    return os.path.join(save_dir, METRICS_FILE)


class MetricsWriter:
    """Appends a record per step to ``path`` (JSON lines; non-finite numbers are null) and logs its numbers
    as TensorBoard scalars under ``tensorboard_dir`` (``train/loss``, ``train/lr``, ``eval/loss``...)."""

    def __init__(self, path: str | None = None, tensorboard_dir: str | None = None, keep_until: int | None = None):
        """A fresh run starts the file anew; a resumed one passes ``keep_until`` (the step it resumes after): the
        records up to it stay and the rest (steps the interrupted run logged past its checkpoint) go."""
        self.file, self.path, self.tensorboard_dir = None, path, tensorboard_dir
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            kept = ([r for r in read_metrics(path) if r["step"] <= keep_until]
                    if keep_until is not None and os.path.exists(path) else [])
            self.file = open(path, "w", encoding="utf-8")
            for record in kept:
                self.file.write(json_line(record) + "\n")
        self.board = None
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            self.board = SummaryWriter(tensorboard_dir)

    def write(self, record: dict) -> None:
        """One step's record: ``step`` (1-based) and any of the named figures (None: not measured)."""
        if self.file is not None:
            try:
                if os.fstat(self.file.fileno()).st_nlink == 0:  # removed: a new file under the name
                    self.file.close()
                    self.file = open(self.path, "a", encoding="utf-8")
                self.file.write(json_line(record) + "\n")
                self.file.flush()
            except OSError as exc:
                self.file = self._give_up("--metrics", self.path, exc, self.file)
        if self.board is not None:
            try:
                os.makedirs(self.tensorboard_dir, exist_ok=True)  # removed: its writer's thread would fail on it
                for key, value in record.items():
                    if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                        group = "eval" if key.startswith("eval_") else "train"
                        self.board.add_scalar(f"{group}/{key.removeprefix('eval_')}", value, record["step"])
                self.board.flush()
            except Exception as exc:  # noqa: BLE001 (TensorBoard's writer raises what its file system raised)
                self.board = self._give_up("--tensorboard", self.tensorboard_dir, exc, self.board)

    @staticmethod
    def _give_up(flag: str, path: str, exc: BaseException, output) -> None:
        """One warning line; the output is closed (quietly) and no longer written."""
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else f"{exc.__class__.__name__}: {exc}"
        print(f"warning: {flag} {path!r}: writing failed ({reason}); training goes on without it", file=sys.stderr)
        try:
            output.close()
        except Exception:  # noqa: BLE001
            pass
        return None

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.board is not None:
            try:
                self.board.close()
            except Exception as exc:  # noqa: BLE001
                self._give_up("--tensorboard", self.tensorboard_dir, exc, None)


def read_metrics(path: str) -> list[dict]:
    """The records of a metrics file, in order."""
    import json
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
