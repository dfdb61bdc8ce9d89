"""The command-line flags of a real run: data (``--data``, ``--tokenizer``, the held-out split), the
learning-rate schedule, metrics, and Hugging Face weights in and out; parsed into ``DataConfig`` and
``TrainConfig`` fields and checked before launch, each problem one line naming the flag."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from parallelisms.config import LR_SCHEDULES, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from parallelisms.errors import require
from parallelisms.flags import Flag, add_flags, check_installed, given_fields, integer, number
from parallelisms.options import FsdpStyle, LrSchedule, Precision, Schedule


DATA_FLAGS = (  # DataConfig's fields as flags (vocab_sweep is verify's own, with none)
    Flag("path", "a text file, a directory of .txt files, or a pre-tokenized .bin of token ids (default: the built-in "
                 "corpus)", flag="--data", metavar="PATH"),
    Flag("bin_dtype", "element type of a .bin: uint16 or uint32", flag="--data-dtype"),
    Flag("tokenizer", "a Hugging Face tokenizer.json (default: UTF-8 bytes)", metavar="TOKENIZER_JSON"),
)
EVAL_FLAGS = (  # the held-out split's (train only: verify compares training, not validation)
    Flag("eval_split", "fraction of the tokens held out for validation (the last ones)", parse=number(0, 0.5)),
    Flag("eval_every", "steps between validation losses (0: at the last step only, with --eval-split)",
         parse=integer(0, 10**9)),
    Flag("eval_batches", "global batches each validation averages over", parse=integer(1, 10**6)),
)
SCHEDULE_FLAGS = (  # TrainConfig's learning-rate schedule
    Flag("warmup", "linear warmup steps", parse=integer(0, 10**9)),
    Flag("lr_schedule", f"after warmup: {', '.join(LR_SCHEDULES)}"),
    Flag("min_lr", "the decay's floor at the last step", parse=number(0)),
)


@dataclass(frozen=True)
class RunFiles:
    """The files a training run writes beside its checkpoints (metrics, TensorBoard, a Hugging Face export)
    and the Hugging Face checkpoint it may start from; checked before launch by :func:`check_run_files`."""

    metrics: str | None = None       # JSON lines per step
    tensorboard: str | None = None   # a TensorBoard log directory
    init_from: str | None = None     # a Hugging Face checkpoint directory: the model and its weights
    export_hf: str | None = None     # a directory the trained model is exported to
    export_dtype: str | None = None  # float32, bfloat16 or same; None: bfloat16 under bf16, else float32


RUN_FILE_FLAGS = (
    Flag("metrics", "JSON lines per step: loss, eval loss, lr, grad norm, tokens/s, exposed communication, peak "
                    "memory", metavar="FILE"),
    Flag("tensorboard", "TensorBoard scalars (needs the tensorboard package)", metavar="DIR"),
    Flag("init_from", "start from a Hugging Face Llama checkpoint (config.json + model.safetensors); sets the model",
         metavar="HF_DIR"),
    Flag("export_hf", "write the trained model as a Hugging Face Llama checkpoint", metavar="HF_DIR"),
    Flag("export_dtype", "dtype of --export-hf's weights; same: the trained parameters' (float64 under --dtype "
                         "float64); default: bfloat16 under --mixed-precision bf16, else float32",
         choices=("float32", "bfloat16", "same")),
)


def add_data_args(p: argparse.ArgumentParser, evaluation: bool = True) -> None:
    """Data and learning-rate schedule flags (train and verify: the references follow both); ``evaluation``:
    the held-out split's flags too (train: verify compares training, not validation)."""
    add_flags(p.add_argument_group("data"), DATA_FLAGS + (EVAL_FLAGS if evaluation else ()), DataConfig)
    add_flags(p.add_argument_group("learning-rate schedule"), SCHEDULE_FLAGS, TrainConfig)


def add_output_args(p: argparse.ArgumentParser) -> None:
    """Train-only flags: metrics, TensorBoard, and Hugging Face weights in and out (:class:`RunFiles`)."""
    add_flags(p.add_argument_group("metrics and Hugging Face weights"), RUN_FILE_FLAGS, RunFiles)


def data_settings(args) -> dict:
    """``TrainConfig`` fields of the data and schedule flags."""
    return {"data": DataConfig(**given_fields(DATA_FLAGS + EVAL_FLAGS, args)), **given_fields(SCHEDULE_FLAGS, args)}


def run_files(args) -> RunFiles:
    """The :class:`RunFiles` of the flags ``args`` holds."""
    return RunFiles(**given_fields(RUN_FILE_FLAGS, args))


def check_data_args(model: ModelConfig, train: TrainConfig, parallel: ParallelConfig) -> None:
    """Before launch: the data reads and fits the model, and the evaluation flags make sense together."""
    from parallelisms.data.sources import check_data, check_data_size

    data = train.data
    require(not data.eval_every or data.eval_split > 0, f"--eval-every {data.eval_every} needs held-out data; add "
                                                        f"--eval-split 0.1, or drop --eval-every")
    require(not data.eval_every or parallel.dims.pp == 1 or not parallel.fsdp or parallel.fsdp_style is FsdpStyle.FLAT,
            f"--eval-every {data.eval_every} with --pp {parallel.dims.pp} and --fsdp-style {parallel.fsdp_style}: "
            f"a stage's per-parameter engine keeps its gathered weights from the first forward of a step to the "
            f"step's reduction, so a validation between steps is not written for it; use --fsdp-style flat, or drop "
            f"--eval-every (--eval-split alone validates after the last step)")
    require(data.eval_split == 0 or parallel.dims.pp == 1 or parallel.schedule is not Schedule.PIPEDREAM
            or parallel.mixed_precision is not Precision.BF16,
            f"--eval-split {data.eval_split:g} with --schedule pipedream and --mixed-precision bf16: its bf16 weights "
            f"exist only as stashed versions inside a step; validate in fp32, or drop --eval-split")
    require(data.bin_dtype == DataConfig.bin_dtype or str(data.path).endswith(".bin"),
            f"--data-dtype {data.bin_dtype} applies only to a pre-tokenized .bin --data, got "
            f"{'--data ' + repr(data.path) if data.path else 'no --data'}; drop --data-dtype")
    require(train.min_lr == 0 or train.lr_schedule is not LrSchedule.CONSTANT, f"--min-lr {train.min_lr:g} with --lr-schedule "
                                                                  f"constant would be ignored; add --lr-schedule cosine "
                                                                  f"or linear, or drop --min-lr")
    if data != DataConfig():
        check_data_size(data, parallel.dims.world_size)  # before reading it whole
        check_data(data, model, train.seq_len)  # own data, a tokenizer or a held-out split: read it once here


def check_run_files(files: RunFiles) -> None:
    """Before launch: output paths are writable, TensorBoard is installed, the Hugging Face directory reads."""
    if files.metrics:  # its directory is created, as a checkpoint directory would be
        require(not Path(files.metrics).is_dir(), f"--metrics {files.metrics!r} is a directory; name a file in it")
        _check_dir("--metrics", str(Path(files.metrics).parent))
    if files.tensorboard:
        check_installed("--tensorboard", "tensorboard")
        _check_dir("--tensorboard", files.tensorboard)
    if files.export_hf:
        check_installed("--export-hf", "safetensors")
        _check_dir("--export-hf", files.export_hf)
    require(files.export_dtype is None or files.export_hf, f"--export-dtype {files.export_dtype} applies to "
                                                         f"--export-hf; add --export-hf HF_DIR or drop it")


def _check_dir(flag: str, path: str) -> None:
    target = Path(path)
    require(not target.is_file(), f"{flag} {path!r} is a file; name a directory")
    existing = next((p for p in (target, *target.parents) if p.exists()), Path("."))
    require(existing.is_dir(), f"{flag} {path!r}: {str(existing)!r} is not a directory; choose another path")
    require(os.access(existing, os.W_OK), f"{flag} {path!r}: {str(existing)!r} is not writable here; choose a path "
                                          f"you can write")
