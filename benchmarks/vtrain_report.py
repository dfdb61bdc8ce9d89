"""The step model against vTrain's measured A100 runs (tests/data): the error tables of docs/performance-model.md
and its scatter plot of predicted against measured (docs/performance-model-vtrain.png)."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from parallelisms.perf.hardware import PRESETS  # noqa: E402
from parallelisms.perf.vtrain import errors, load_runs, summary  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    results = errors(load_runs(ROOT / "tests/data/vtrain_single_node_a100.csv"), PRESETS["a100"])
    s = summary(results)
    print(f"{len(results)} runs: mean absolute error {s['mean_abs_error']:.1%}, max {s['max_abs_error']:.1%}, "
          f"mean signed {s['mean_signed_error']:+.1%}")
    for key, groups in s["by"].items():
        print(f"\n| {key} | runs | mean abs | max abs | mean signed |\n|---|---|---|---|---|")
        for value, g in groups.items():
            print(f"| {value} | {g['runs']} | {g['mean_abs_error']:.1%} | {g['max_abs_error']:.1%} | "
                  f"{g['mean_signed_error']:+.1%} |")
    fig, ax = plt.subplots(figsize=(6, 6))
    for tp, color in zip((1, 2, 4, 8), ("tab:blue", "tab:orange", "tab:green", "tab:red")):
        points = [(r.measured_ms, p) for r, p, _ in results if r.tp == tp]
        ax.scatter(*zip(*points), s=6, alpha=0.6, color=color, label=f"tp {tp}")
    top = max(max(r.measured_ms, p) for r, p, _ in results) * 1.1
    ax.plot([0, top], [0, top], "k-", lw=0.8)
    for band in (0.9, 1.1):
        ax.plot([0, top], [0, top * band], "k:", lw=0.6)
    ax.set(xscale="log", yscale="log", xlabel="measured iteration (ms)", ylabel="predicted iteration (ms)",
           title=f"vTrain's 1,440 A100 runs: MAE {s['mean_abs_error']:.1%}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(ROOT / "docs/performance-model-vtrain.png", dpi=110)


if __name__ == "__main__":
    main()
