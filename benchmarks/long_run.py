"""A long training run's memory and report time: does either grow with the step count?

Runs ``parallelisms train`` (the tiny preset, a small batch) for ``--steps`` steps with ``--metrics``, follows
the metrics file as it is written, and reads the resident memory (VmRSS) of the run's processes (the command and
its rank processes) when the records of the chosen steps appear. The report time is from the last step's record
to the report's first line on stdout (``report_s``: the end-of-run report's collectives and assembly); ``exit_s``
adds the teardown, to the command's exit. Prints one JSON object.

    slot env PYTHONPATH=$PWD/src python3 benchmarks/long_run.py --steps 20000 --at 1000,20000
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            continue
    return kids


def tree_rss(pid: int) -> dict[int, int]:
    """Resident bytes of ``pid`` and every descendant (pid: bytes)."""
    out, todo = {}, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    out[p] = int(line.split()[1]) * 1024
        except OSError:
            continue
        todo += _children(p)
    return out


def rank_rss(rss: dict[int, int]) -> list[int]:
    """The resident bytes of :func:`tree_rss` that belong to rank processes (multiprocessing-spawned), in start
    order, which is rank order: the launcher starts rank 0 first."""
    def is_rank(p: int) -> bool:
        try:
            return b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()
        except OSError:
            return False
    return [rss[p] for p in sorted(rss) if is_rank(p)]


def run(steps: int, at: list[int], extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        cmd = [sys.executable, "-m", "parallelisms", "train", "--preset", "tiny", "--steps", str(steps),
               "--metrics", str(metrics), "--no-precheck", *extra]
        began = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})  # each line when printed
        output, printed = [], []  # the command's lines; when the report's first line ("ran:") came
        reader = threading.Thread(target=_read, args=(proc.stdout, output, printed))
        reader.start()
        seen, offset, samples, last_step_at, pending = 0, 0, {}, None, ""
        while proc.poll() is None:
            time.sleep(0.02)
            if not metrics.exists():
                continue
            with open(metrics) as f:
                f.seek(offset)
                chunk = f.read()
                offset = f.tell()
            pending += chunk
            *lines, pending = pending.split("\n")
            for line in lines:
                record = json.loads(line)
                seen = record["step"]
                if seen in at:
                    rss = tree_rss(proc.pid)
                    samples[seen] = {"rss_bytes": rss, "rank_rss_max": max(rss.values()),
                                     "rank_rss_mb": [round(b / 2**20, 1) for b in rank_rss(rss)],
                                     "peak_memory_bytes": record["peak_memory_bytes"],
                                     "elapsed_s": round(time.monotonic() - began, 1)}
                if seen == steps:
                    last_step_at = time.monotonic()
        ended = time.monotonic()
        reader.join()
    if proc.returncode:
        raise SystemExit(f"the run failed ({proc.returncode}):\n{''.join(output)[-2000:]}")
    since_last = (lambda t: round(t - last_step_at, 2) if last_step_at and t else None)
    return {"steps": steps, "command": " ".join(cmd[1:]), "wall_s": round(ended - began, 1),
            "report_s": since_last(printed[0] if printed else None), "exit_s": since_last(ended), "at": samples,
            "summary": [ln.rstrip() for ln in output if ln.startswith(("speed", "loss", "comm"))]}


def _read(stream, lines: list[str], printed: list[float]) -> None:
    """The command's output, line by line; the time its report's first line came."""
    for line in stream:
        if line.startswith("ran:") and not printed:
            printed.append(time.monotonic())
        lines.append(line)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20000)
    p.add_argument("--at", default="1000,20000", help="steps at which memory is read (comma separated)")
    p.add_argument("extra", nargs="*", help="more train flags (after --)")
    args = p.parse_args()
    extra = args.extra or ["--global-batch", "2", "--seq-len", "16", "--dp", "2"]
    print(json.dumps(run(args.steps, [int(s) for s in args.at.split(",")], extra), indent=1))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
