"""The command line of checkpoints: ``train --save DIR --save-every N [--async-save] --resume DIR|auto``,
checked before any process starts, and ``verify-resume``, which saves in one layout, resumes in another and
compares the continued run with the uninterrupted one. Imports no torch at module level (the CLI's start)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

from parallelisms.errors import require
from parallelisms.flags import Flag, add_flags, given_fields, integer, number
from parallelisms.options import Schedule

META = "parallelisms.json"  # written last into a complete checkpoint (parallelisms.checkpoint)


@dataclass(frozen=True)
class CheckpointOptions:
    """What the training loop saves and resumes (picklable, part of ``RunSpec``)."""

    save_dir: str | None = None
    save_every: int = 0
    async_save: bool = False
    resume: str | None = None      # a complete checkpoint directory, resolved before launch
    meta: dict = dataclasses.field(default_factory=dict)  # model shape and layout, written with every save


@dataclass(frozen=True)
class CheckpointFlags:
    """The checkpoint flags as given (:func:`checkpoint_options` resolves and checks them), and what a step whose
    loss or gradient is not finite does: skipped (``skip_nonfinite``), else the run stops naming it."""

    save: str | None = None        # DIR: checkpoints into DIR/step_N
    save_every: int | None = None  # None: at the end only
    async_save: bool = False
    resume: str | None = None      # DIR/step_N, a --save DIR (its newest complete step), or auto
    skip_nonfinite: bool = False


CHECKPOINT_FLAGS = (
    Flag("save", "save checkpoints into DIR/step_N", metavar="DIR"),
    Flag("save_every", "save every N steps (and at the end)", parse=integer(1, 10**9), metavar="N"),
    Flag("async_save", "write checkpoints in the background"),
    Flag("resume", "continue from a checkpoint DIR/step_N, or from the newest complete one in a --save DIR; auto: "
                   "in this run's --save DIR (none there: start from step 0)", metavar="DIR|auto"),
    Flag("skip_nonfinite", "skip a step whose loss or gradient is not finite (default: stop, naming step and rank)"),
)


def add_checkpoint_args(p: argparse.ArgumentParser) -> None:
    add_flags(p.add_argument_group("checkpoints (torch.distributed.checkpoint; any layout loads any other's)"),
              CHECKPOINT_FLAGS, CheckpointFlags)


def checkpoint_flags(args) -> CheckpointFlags:
    """The :class:`CheckpointFlags` ``args`` holds (:func:`parallelisms.flags.settings`)."""
    return CheckpointFlags(**given_fields(CHECKPOINT_FLAGS, args))


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root`` (``step_N`` holding its metadata file), or None."""
    done = [p for p in Path(root).glob("step_*") if p.is_dir() and p.name[5:].isdigit() and (p / META).is_file()]
    return max(done, key=lambda p: int(p.name[5:]), default=None)


def layout_meta(model, train, parallel) -> dict:
    """What a checkpoint records of its run: the model's shape and the layout that saved it."""
    dims = parallel.dims
    from parallelisms.checkpoint_files import FORMAT

    return {"format": FORMAT, "model": dataclasses.asdict(model), "layout": dims.describe(),
            "world_size": dims.world_size, "pipedream": dims.pp > 1 and parallel.schedule is Schedule.PIPEDREAM,
            "global_batch": train.global_batch, "seq_len": train.seq_len, "seed": train.seed,
            "optimizer": optimizer_settings(train)}


def optimizer_settings(train) -> dict:
    """AdamW's settings a checkpoint records and a resume must match (``parallelisms.optim``)."""
    return {"weight_decay": train.weight_decay, "betas": list(train.betas), "eps": train.eps,
            "decay_all": train.decay_all}


def checkpoint_options(flags: CheckpointFlags, model, train, parallel) -> CheckpointOptions | None:
    """The checkpoint ``flags``, validated (one line each, before launch); None without any."""
    save, resume, save_every, async_save = flags.save, flags.resume, flags.save_every, flags.async_save
    require(save is not None or (save_every is None and not async_save),
            "--save-every/--async-save need --save DIR; add --save DIR")
    require(resume != "auto" or save is not None, "--resume auto looks in --save DIR; add --save DIR")
    if save is None and resume is None:
        return None
    meta = layout_meta(model, train, parallel)
    if save is not None:
        root = Path(save)
        require(not root.exists() or root.is_dir(), f"--save {save!r} is a file; name a directory")
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            require(False, f"--save {save!r} cannot be created ({exc.strerror}); choose a directory you can write")
        from parallelisms.checkpoint_files import check_save_directory
        check_save_directory(root, resume is not None, META)
    path = None
    if resume == "auto":
        from parallelisms.checkpoint_files import newest_verified
        path, skipped = newest_verified(Path(save), META)
        for line in skipped:
            print(f"warning: {line}", file=sys.stderr)
    elif resume is not None:
        path = Path(resume)
        require(path.is_dir(), f"--resume {resume!r} does not exist; give a checkpoint directory (DIR/step_N) "
                               f"or --resume auto")
        if not (path / META).is_file() and latest(path) is not None:  # a --save directory: its newest step
            path = latest(path)
    if path is not None and path != Path(resume or ""):
        _announce(f"resuming from {path} (the newest complete checkpoint in {resume if resume != 'auto' else save})")
    if resume not in (None, "auto"):
        require((path / META).is_file() and (path / ".metadata").is_file(),
                f"--resume {resume!r} is not a complete checkpoint (no {META}"
                f"{'' if (path / '.metadata').is_file() else ' nor .metadata'}: a save that did not finish, or not a "
                f"checkpoint); choose a step_N directory, or a --save directory holding a complete one")
    if path is not None:
        from parallelisms.checkpoint_files import verified
        saved = verified(path, META, "--resume")
        fields = {**dataclasses.asdict(type(model)()), **saved["model"]}  # a field newer than the save: its default
        diff = [k for k, v in meta["model"].items() if fields.get(k) != v]
        require(not diff, lambda: f"--resume {str(path)!r} holds a model with {diff[0]} {fields.get(diff[0])}, "
                                  f"this run's has {meta['model'][diff[0]]} ({len(diff)} field(s) differ); use the "
                                  f"same --preset/--config")
        require(saved["step"] < train.steps, f"--resume {str(path)!r} is at step {saved['step']}, not before --steps "
                                             f"{train.steps}; --steps counts the run's total steps: raise it")
        diff = [k for k, v in meta["optimizer"].items() if k in saved.get("optimizer", {}) and
                saved["optimizer"][k] != v]
        require(not diff, lambda: f"--resume {str(path)!r} was trained with {diff[0]} {saved['optimizer'][diff[0]]}, "
                                  f"this run has {meta['optimizer'][diff[0]]}; resume with the same optimizer flags "
                                  f"(--weight-decay, --betas, --eps, --decay-all)")
        require(saved["pipedream"] == meta["pipedream"],
                f"--resume {str(path)!r} was saved {'with' if saved['pipedream'] else 'without'} --schedule pipedream "
                f"and this run is {'with' if meta['pipedream'] else 'without'}: its per-microbatch Adam steps do not "
                f"carry over; resume with{'' if saved['pipedream'] else 'out'} pipedream")
    return CheckpointOptions(save, save_every or 0, async_save, str(path) if path else None, meta)


def _announce(line: str) -> None:
    """Print ``line`` once (rank 0 under torchrun)."""
    import os

    if os.environ.get("RANK", "0") == "0":
        print(line, flush=True)


# -- verify-resume -----------------------------------------------------------------------------------------------
def add_verify_resume_parser(sub) -> None:
    p = sub.add_parser("verify-resume", help="save in one layout, resume in another, compare with an uninterrupted run")
    p.add_argument("--save-layout", required=True, help='layout flags of the saving run, e.g. "--dp 2 --zero 3"')
    p.add_argument("--resume-layout", required=True, help='layout flags of the resumed run, e.g. "--tp 2 --pp 2"')
    p.add_argument("--save-at", type=integer(1, 10**9), help="the step to save at (default: half of --steps)")
    p.add_argument("--run", default="--preset tiny --steps 4 --global-batch 8 --seq-len 32",
                   help="model and training flags of both runs (default %(default)s)")
    p.add_argument("--tolerance", type=number(0, 1), help="relative tolerance (default verify's: 1e-5, float64 1e-10)")
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
