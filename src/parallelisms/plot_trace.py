"""``parallelisms plot-trace TRACE --out PNG``: draw a ``train --trace`` timeline as a picture.

After the first step (setup and warm-up; ``--skip-steps``), or the steps ``--steps A:B`` name, two rows per rank,
as the Chrome trace holds them: compute (forward, backward, optimizer, and the waits on communication the rank
could not hide, in red) above communication (each collective from issue to completion), and a third where the rank
waited for a straggler (the straggler report's waits, each with an arrow to the late rank's compute row). A
pipeline's actions (``F s0 mb0``, ``B``, and the zero-bubble schedules' split ``I`` and ``W``) take the colour of
their kind.
What is red is the exposed communication the summary reports; communication under a compute bar is hidden.
The legend names the kinds the picture holds.
Needs matplotlib (``pip install 'parallelisms[plot]'``).
"""

from __future__ import annotations

import json
from pathlib import Path

from parallelisms.errors import ConfigError, require

COLOURS = {"forward": "#4878d0", "backward": "#ee854a", "backward (input)": "#dc7ec0",
           "weight gradient": "#d5bb67", "optimizer": "#6acc64", "wait": "#d65f5f", "comm": "#956cb4",
           "straggler": "#c9a100"}
NAMES = {"wait": "exposed comm (wait)", "straggler": "waiting for a straggler (arrow: to it)"}
# a compute span's first word -> its kind: the training loop's names, and the pipeline's actions (``F s0 mb0``)
KINDS = {"forward": "forward", "backward": "backward", "optimizer": "optimizer", "F": "forward", "B": "backward",
         "I": "backward (input)", "W": "weight gradient"}
OTHER = "#8c8c8c"


def read_spans(path: str | Path) -> dict[int, list[dict]]:
    """Rank -> the complete events (``ph`` X) of a Chrome trace written by ``train --trace``."""
    try:
        events = json.loads(Path(path).read_text())["traceEvents"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise ConfigError(f"plot-trace {str(path)!r} is not a trace written by train --trace ({exc.__class__.__name__}"
                          f"); write one with parallelisms train --trace FILE") from None
    spans: dict[int, list[dict]] = {}
    for e in events:
        if e.get("ph") == "X":
            spans.setdefault(int(e["pid"]), []).append(e)
    require(spans, f"plot-trace {str(path)!r} holds no spans; write one with parallelisms train --trace FILE")
    return spans


def kind(event: dict) -> str | None:
    """The legend's name for a span: its category for waits and communication, else its name's kind (None: none
    of them, drawn grey)."""
    if event.get("cat") in ("wait", "comm", "straggler"):
        return event["cat"]
    words = event["name"].split()
    return KINDS.get(words[0]) if words else None


def _colour(event: dict) -> str:
    return COLOURS.get(kind(event), OTHER)


def _window(spans: dict[int, list[dict]], skip_steps: int, steps: tuple[int, int] | None) -> tuple[float, float]:
    """The time the picture shows: steps ``steps`` (first, last; 1-based, inclusive), else those after the first
    ``skip_steps``. A step ends with its optimizer span on every rank; setup and the warm-up step would squeeze
    the steady state. Where the trace holds fewer steps, from the first forward."""
    ends = [sorted(e["ts"] + e["dur"] for e in rank if e["name"].startswith("optimizer")) for rank in spans.values()]
    first, last = steps if steps else (skip_steps + 1, None)
    counted = min(len(e) for e in ends)
    require(steps is None or first <= counted, f"--steps {first}:{last}: the trace holds {counted} step(s)")
    end = max(e[min(last, counted) - 1] for e in ends) if last and counted else float("inf")
    if first > 1 and first - 1 <= counted:
        return max(e[first - 2] for e in ends), end
    return min((e["ts"] for rank in spans.values() for e in rank if kind(e) == "forward"), default=0.0), end


def plot_trace(path: str | Path, out: str | Path, title: str | None = None, skip_steps: int = 1,
               steps: tuple[int, int] | None = None) -> Path:
    """Draw the trace at ``path`` into ``out`` (.png or .svg): steps ``steps`` (first, last), else all but the
    first ``skip_steps``; returns ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    spans = read_spans(path)
    ranks = sorted(spans)
    origin, end = _window(spans, skip_steps, steps)
    shown = set()
    fig, ax = plt.subplots(figsize=(12, 0.9 * len(ranks) + 1.2))
    labels, ticks, row_of = [], [], {}
    for rank in ranks:
        for tid, row in ((0, "compute"), (1, "comm"), (3, "waits")):
            bars = [e for e in spans[rank] if e.get("tid", 0) == tid and origin <= e["ts"] < end]
            if tid == 3 and not any(e.get("cat") == "straggler" for e in spans[rank]):
                continue  # a rank that never waited for a straggler (or a trace without the report)
            shown |= {kind(e) for e in bars}
            y = row_of[rank, tid] = -len(ticks)
            ax.broken_barh([((e["ts"] - origin) / 1e3, e["dur"] / 1e3) for e in bars], (y - 0.4, 0.8),
                           facecolors=[_colour(e) for e in bars], linewidth=0)
            labels.append(f"rank {rank} {row}")
            ticks.append(y)
    for rank in ranks:  # each wait for a straggler: an arrow from its end to the late rank's compute row
        for e in spans[rank]:
            late = e.get("args", {}).get("late_rank")
            if late is not None and (rank, 3) in row_of and (late, 0) in row_of and origin <= e["ts"] < end:
                x = (e["ts"] + e["dur"] - origin) / 1e3
                ax.annotate("", xy=(x, row_of[late, 0]), xytext=(x, row_of[rank, 3]),
                            arrowprops={"arrowstyle": "->", "color": COLOURS["straggler"], "lw": 0.8})
    fig.set_size_inches(12, 0.45 * len(ticks) + 1.2)
    ax.set_yticks(ticks, labels)
    start = steps[0] - 1 if steps else skip_steps
    ax.set_xlabel("time (ms)" + (f", from the end of step {start}" if start else ""))
    ax.set_title(title or f"timeline of {Path(path).name}" + (f", steps {steps[0]} to {steps[1]}" if steps else ""))
    legend = [Patch(color=c, label=NAMES.get(n, n)) for n, c in COLOURS.items() if n in shown]
    legend += [Patch(color=OTHER, label="other")] if None in shown else []
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.25 if len(ranks) < 3 else -0.12),
              ncol=len(legend), frameon=False)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return Path(out)


def add_parser(sub) -> None:
    from parallelisms.flags import integer

    p = sub.add_parser("plot-trace", help="draw a train --trace timeline as a picture (needs matplotlib)",
                       description=__doc__.splitlines()[0])
    p.add_argument("trace", metavar="TRACE", help="Chrome-trace JSON written by parallelisms train --trace")
    p.add_argument("--out", metavar="FILE.png|.svg", required=True, help="picture to write")
    p.add_argument("--title", help="title above the picture (default: the trace's file name)")
    p.add_argument("--skip-steps", type=integer(0, 10**9), default=1,
                   help="steps left out at the start (the first warms up); when the trace has fewer, from the first "
                        "forward")
    p.add_argument("--steps", type=_step_range, metavar="A:B",
                   help="draw steps A to B (1-based, inclusive; overrides --skip-steps): a long trace's few steps")
    p.set_defaults(func=run)


def _step_range(text: str) -> tuple[int, int]:
    first, _, last = text.partition(":")
    if not (first.isdigit() and last.isdigit() and 1 <= int(first) <= int(last)):
        raise ConfigError(f"--steps must be A:B with 1 <= A <= B (steps to draw, inclusive), got {text!r}")
    return int(first), int(last)


def run(args) -> int:
    from parallelisms.flags import check_installed, check_writable

    require(Path(args.trace).is_file(), f"trace {args.trace!r} is not a trace written by train --trace: no such file")
    require(args.out.lower().endswith((".png", ".svg")), f"--out must name a .png or .svg file, got {args.out!r}")
    check_installed("--out", "matplotlib", extra="plot")
    check_writable("--out", args.out)
    print(f"timeline written to {plot_trace(args.trace, args.out, args.title, args.skip_steps, args.steps)}")
    return 0
