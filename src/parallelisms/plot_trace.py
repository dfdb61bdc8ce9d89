"""``parallelisms plot-trace TRACE --out PNG``: draw a ``train --trace`` timeline as a picture.

After the first step (setup and warm-up; ``--skip-steps``), two rows per rank, as the Chrome trace holds them: compute (forward, backward, optimizer, and the waits on
communication the rank could not hide, in red) above communication (each collective from issue to completion).
What is red is the exposed communication the summary reports; communication under a compute bar is hidden.
Needs matplotlib (``pip install 'parallelisms[plot]'``).
"""

from __future__ import annotations

import json
from pathlib import Path

from parallelisms.errors import ConfigError, require

COLOURS = {"forward": "#4878d0", "backward": "#ee854a", "optimizer": "#6acc64", "wait": "#d65f5f",
           "comm": "#956cb4"}


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


def _colour(event: dict) -> str:
    if event.get("cat") in ("wait", "comm"):
        return COLOURS[event["cat"]]
    return COLOURS.get(event["name"].split()[0], "#8c8c8c")


def _start(spans: dict[int, list[dict]], skip_steps: int) -> float:
    """Where the picture starts: after the first ``skip_steps`` steps of every rank (a step ends with its
    optimizer span), else at the first forward. Setup and the warm-up step would squeeze the steady state."""
    ends = [sorted(e["ts"] + e["dur"] for e in rank if e["name"].startswith("optimizer")) for rank in spans.values()]
    if skip_steps and all(len(e) > skip_steps for e in ends):
        return max(e[skip_steps - 1] for e in ends)
    return min((e["ts"] for rank in spans.values() for e in rank if e["name"].startswith("forward")), default=0.0)


def plot_trace(path: str | Path, out: str | Path, title: str | None = None, skip_steps: int = 1) -> Path:
    """Draw the trace at ``path`` into ``out`` (.png or .svg), leaving out the first ``skip_steps`` steps;
    returns ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    spans = read_spans(path)
    ranks = sorted(spans)
    origin = _start(spans, skip_steps)
    fig, ax = plt.subplots(figsize=(12, 0.9 * len(ranks) + 1.2))
    labels, ticks = [], []
    for i, rank in enumerate(ranks):
        for tid, row in ((0, "compute"), (1, "comm")):
            y = -(2 * i + tid)
            bars = [e for e in spans[rank] if e.get("tid", 0) == tid and e["ts"] >= origin]
            ax.broken_barh([((e["ts"] - origin) / 1e3, e["dur"] / 1e3) for e in bars], (y - 0.4, 0.8),
                           facecolors=[_colour(e) for e in bars], linewidth=0)
            labels.append(f"rank {rank} {row}")
            ticks.append(y)
    ax.set_yticks(ticks, labels)
    ax.set_xlabel("time (ms)" + (f", from the end of step {skip_steps}" if skip_steps else ""))
    ax.set_title(title or f"timeline of {Path(path).name}")
    ax.legend(handles=[Patch(color=c, label=n if n != "wait" else "exposed comm (wait)") for n, c in COLOURS.items()],
              loc="upper center", bbox_to_anchor=(0.5, -0.25 if len(ranks) < 3 else -0.12), ncol=len(COLOURS),
              frameon=False)
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
    p.set_defaults(func=run)


def run(args) -> int:
    from parallelisms.flags import check_installed, check_writable

    require(Path(args.trace).is_file(), f"trace {args.trace!r} is not a trace written by train --trace: no such file")
    require(args.out.lower().endswith((".png", ".svg")), f"--out must name a .png or .svg file, got {args.out!r}")
    check_installed("--out", "matplotlib", extra="plot")
    check_writable("--out", args.out)
    print(f"timeline written to {plot_trace(args.trace, args.out, args.title, args.skip_steps)}")
    return 0
