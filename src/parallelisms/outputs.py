"""Results survive their outputs: a run's report is complete before any file is written from it, and a file
that cannot be written (the ``--trace`` directory removed, a full disk) is one line in the report's
``output_errors`` rather than the end of the run. An ``--export-hf`` that fails keeps the weights: in the run's
last checkpoint where it saved one (named, with the command that exports it), else in a directory of their own
that the line names."""

from __future__ import annotations

import tempfile
from pathlib import Path


def failed_write(what: str, exc: BaseException) -> str:
    """One line: what could not be written, where, and the operating system's reason."""
    if isinstance(exc, OSError):
        where = f" {exc.filename!r}" if exc.filename else ""
        return f"{what}: writing{where} failed ({exc.strerror or exc})"
    return f"{what}: writing failed ({exc.__class__.__name__}: {str(exc).strip().splitlines()[-1][:200] if str(exc).strip() else ''})"


def attempt(report: dict, what: str, write):
    """``write()``; where it fails, its line goes into ``report["output_errors"]`` and None is returned."""
    try:
        return write()
    except Exception as exc:  # noqa: BLE001 (every output's failure is one line, whatever raised it)
        report.setdefault("output_errors", []).append(failed_write(what, exc))
        return None


def export_or_keep(report: dict, state: dict, model, out: str, checkpoint_dir: str | None, dtype) -> None:
    """``--export-hf OUT`` of the final weights in ``dtype``; where it fails, the weights stay in the last checkpoint (when the
    run saved one) or are written into a new temporary directory, and the line names where they are."""
    from parallelisms.hf import export_hf

    try:
        report["exported_hf"] = str(export_hf(state, model, out, dtype))
        return
    except Exception as exc:  # noqa: BLE001
        line = failed_write(f"--export-hf {out!r}", exc)
    if checkpoint_dir is not None:
        line += (f"; the weights are in the checkpoint {checkpoint_dir}: parallelisms export {checkpoint_dir} "
                 f"--out DIR writes them")
    else:
        try:
            kept = export_hf(state, model, tempfile.mkdtemp(prefix="parallelisms-export-"), dtype)
            report["exported_hf"] = str(kept)
            line += f"; the weights are written to {kept} instead"
        except Exception as again:  # noqa: BLE001
            line += f"; and writing them to a temporary directory failed too ({failed_write('', again)[2:]})"
    report.setdefault("output_errors", []).append(line)


def last_checkpoint(save_dir: str | None, step: int) -> str | None:
    """The complete checkpoint the run wrote at its last step, if any."""
    if save_dir is None:
        return None
    path = Path(save_dir) / f"step_{step}"
    return str(path) if path.is_dir() else None
