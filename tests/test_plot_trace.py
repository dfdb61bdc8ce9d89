"""plot-trace colours every action kind, a pipeline's ``F s0 mb0`` / ``B`` / ``W`` included, names in its legend
only the kinds drawn, and draws the steps ``--steps A:B`` picks."""

import json

import pytest

from parallelisms import plot_trace as pt
from parallelisms.cli import main

PIPELINE = (("F", 3.0), ("B", 4.0), ("W", 2.0))  # a zero-bubble schedule's actions, split backward


def _pipeline_trace(path, steps: int = 4):
    spans = []
    for rank in (0, 1):
        t = 0.0
        for _ in range(steps):
            for mb in range(2):
                for kind, dur in PIPELINE:
                    spans.append({"name": f"{kind} s{rank} mb{mb}", "cat": "compute", "ph": "X", "pid": rank,
                                  "tid": 0, "ts": t, "dur": dur})
                    t += dur
            spans.append({"name": "optimizer", "cat": "compute", "ph": "X", "pid": rank, "tid": 0, "ts": t, "dur": 1.0})
            t += 1.0
    path.write_text(json.dumps({"traceEvents": spans}))
    return path


def _rgb(hex_colour: str) -> tuple[int, int, int]:
    return tuple(int(hex_colour[i:i + 2], 16) for i in (1, 3, 5))


def test_pipeline_actions_are_drawn_in_their_kinds_colours(tmp_path):
    image = pytest.importorskip("matplotlib.image")
    trace = _pipeline_trace(tmp_path / "pipe.json")
    assert main(["plot-trace", str(trace), "--out", str(tmp_path / "p.png")]) == 0
    pixels = {tuple(round(c * 255) for c in px[:3]) for row in image.imread(tmp_path / "p.png") for px in row}
    for name in ("forward", "backward", "weight gradient", "optimizer"):
        assert _rgb(pt.COLOURS[name]) in pixels, name
    assert all(pt.kind(e) is not None for spans in pt.read_spans(trace).values() for e in spans)  # nothing grey
    assert {pt.kind({"name": n, "cat": "compute"}) for n in ("F s0 mb0", "B s1 mb3", "I s0 mb1", "W s0 mb0")} == {
        "forward", "backward", "backward (input)", "weight gradient"}


def test_steps_picks_a_window(tmp_path):
    spans = pt.read_spans(_pipeline_trace(tmp_path / "pipe.json", steps=10))
    step = 2 * sum(d for _, d in PIPELINE) + 1.0  # one step's time on every rank
    assert pt._window(spans, 1, (3, 4)) == (2 * step, 4 * step)
    assert pt._window(spans, 1, None) == (step, float("inf"))
    assert pt._window(spans, 1, (1, 2)) == (0.0, 2 * step)
    assert main(["plot-trace", str(tmp_path / "pipe.json"), "--out", str(tmp_path / "p.png"), "--steps", "3:4"]) == 0
    assert main(["plot-trace", str(tmp_path / "pipe.json"), "--out", str(tmp_path / "p.png"), "--steps", "4:3"]) == 2
    assert main(["plot-trace", str(tmp_path / "pipe.json"), "--out", str(tmp_path / "p.png"), "--steps", "11:12"]) == 2
