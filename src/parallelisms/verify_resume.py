"""``parallelisms verify-resume``: train in one layout saving half-way, resume that checkpoint in another layout,
and compare the continued run with the uninterrupted one (losses and final parameters, verify's tolerance;
bit-identical expected in the same layout)."""

from __future__ import annotations

import shlex
import tempfile
from pathlib import Path

from parallelisms.errors import require
from parallelisms.flags import json_line
from parallelisms.resume import CheckpointOptions, layout_meta
from parallelisms.options import Dtype


def verify_resume(args, configs, run_layout) -> int:
    """``verify-resume``: ``configs(argv)`` parses verify's flags into validated configs and a device placement,
    ``run_layout(spec, placement)`` trains (the CLI's own, passed in: this module sits below it)."""
    import torch

    from parallelisms.errors import ConfigError
    from parallelisms.training import RunSpec
    from parallelisms.equivalence import TOLERANCE, TOLERANCE_FLOAT64

    def parse(layout: str, flag: str):
        try:
            return configs([*shlex.split(args.run), *shlex.split(layout)])
        except ConfigError as exc:
            raise ConfigError(f"{flag}: {exc}") from None
    model, train, save_par, save_place = parse(args.save_layout, "--save-layout")
    _, train2, resume_par, resume_place = parse(args.resume_layout, "--resume-layout")
    save_at = args.save_at or max(1, train.steps // 2)
    require(save_at < train.steps, f"--save-at {save_at} must be before the run's --steps {train.steps}")
    tolerance = args.tolerance or (TOLERANCE_FLOAT64 if train.dtype is Dtype.FLOAT64 else TOLERANCE)
    with tempfile.TemporaryDirectory(prefix="verify-resume-") as tmp:
        meta = layout_meta(model, train, save_par)
        full = run_layout(RunSpec(model, train, save_par, collect_state=True,
                                  checkpoint=CheckpointOptions(tmp, save_at, meta=meta)), save_place)
        resume_from = str(Path(tmp) / f"step_{save_at}")
        resumed = run_layout(RunSpec(model, train2, resume_par, collect_state=True,
                                     checkpoint=CheckpointOptions(resume=resume_from, meta=meta)), resume_place)
    losses = [(a - b) / max(abs(a), 1e-30) for a, b in zip(full["losses"][save_at:], resumed["losses"])]
    params = {name: ((resumed["state"][name].double() - t.double()).norm() / t.double().norm().clamp_min(1e-30)).item()
              for name, t in full["state"].items()}
    worst = max(params, key=params.get)
    loss_diff = max((abs(d) for d in losses), default=0.0)
    exact = loss_diff == 0 and all(torch.equal(resumed["state"][n], t) for n, t in full["state"].items())
    ok = len(resumed["losses"]) == train.steps - save_at and loss_diff <= tolerance and params[worst] <= tolerance
    result = {"save_layout": full["layout"], "resume_layout": resumed["layout"], "save_at": save_at,
              "steps": train.steps, "max_loss_rel_diff": loss_diff, "max_param_rel_diff": params[worst],
              "worst_param": worst, "bit_identical": exact, "tolerance": tolerance, "ok": ok}
    print(f"saved at step {save_at} by {result['save_layout']}, resumed by {result['resume_layout']} to step "
          f"{train.steps}: max loss rel diff {loss_diff:.2e}, max param rel diff {params[worst]:.2e} ({worst})"
          f"{', bit-identical' if exact else ''}, tolerance {tolerance:.0e}: {'ok' if ok else 'MISMATCH'}")
    if args.json:
        print(json_line(result))
    return 0 if ok else 1
