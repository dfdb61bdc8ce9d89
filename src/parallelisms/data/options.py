"""The command-line flags of a real run: data (``--data``, ``--tokenizer``, the held-out split), the
learning-rate schedule, metrics, and Hugging Face weights in and out; parsed into ``DataConfig`` and
``TrainConfig`` fields and checked before launch, each problem one line naming the flag."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from parallelisms.config import LR_SCHEDULES, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from parallelisms.errors import require
from parallelisms.flags import check_installed, integer, number
from parallelisms.options import FsdpStyle, LrSchedule, Precision, Schedule


def add_data_args(p: argparse.ArgumentParser, evaluation: bool = True) -> None:
    """Data and learning-rate schedule flags (train and verify: the references follow both); ``evaluation``:
    the held-out split's flags too (train: verify compares training, not validation)."""
    d, t = DataConfig(), TrainConfig()
    g = p.add_argument_group("data")
    g.add_argument("--data", metavar="PATH", help="a text file, a directory of .txt files, or a pre-tokenized .bin "
                                                  "of token ids (default: the built-in corpus)")
    g.add_argument("--data-dtype", default=d.bin_dtype, help="element type of a .bin: uint16 or uint32")
    g.add_argument("--tokenizer", metavar="TOKENIZER_JSON", help="a Hugging Face tokenizer.json (default: UTF-8 bytes)")
    if evaluation:
        g.add_argument("--eval-split", type=number(0, 0.5), default=d.eval_split,
                       help="fraction of the tokens held out for validation (the last ones)")
        g.add_argument("--eval-every", type=integer(0, 10**9), default=d.eval_every,
                       help="steps between validation losses (0: at the last step only, with --eval-split)")
        g.add_argument("--eval-batches", type=integer(1, 10**6), default=d.eval_batches,
                       help="global batches each validation averages over")
    g = p.add_argument_group("learning-rate schedule")
    g.add_argument("--warmup", type=integer(0, 10**9), default=t.warmup, help="linear warmup steps")
    g.add_argument("--lr-schedule", default=t.lr_schedule, help=f"after warmup: {', '.join(LR_SCHEDULES)}")
    g.add_argument("--min-lr", type=number(0), default=t.min_lr, help="the decay's floor at the last step")


def add_output_args(p: argparse.ArgumentParser) -> None:
    """Train-only flags: metrics, TensorBoard, and Hugging Face weights in and out."""
    g = p.add_argument_group("metrics and Hugging Face weights")
    g.add_argument("--metrics", metavar="FILE", help="JSON lines per step: loss, eval loss, lr, grad norm, tokens/s, "
                                                     "exposed communication, peak memory")
    g.add_argument("--tensorboard", metavar="DIR", help="TensorBoard scalars (needs the tensorboard package)")
    g.add_argument("--init-from", metavar="HF_DIR", help="start from a Hugging Face Llama checkpoint (config.json + "
                                                         "model.safetensors); sets the model")
    g.add_argument("--export-hf", metavar="HF_DIR", help="write the trained model as a Hugging Face Llama checkpoint")
    g.add_argument("--export-dtype", choices=("float32", "bfloat16", "same"),
                   help="dtype of --export-hf's weights; same: the trained parameters' (float64 under --dtype "
                        "float64); default: bfloat16 under --mixed-precision bf16, else float32")


def data_settings(args) -> dict:
    """``TrainConfig`` fields of the data and schedule flags."""
    held_out = {k: getattr(args, k) for k in ("eval_split", "eval_every", "eval_batches") if hasattr(args, k)}
    data = DataConfig(path=args.data, bin_dtype=args.data_dtype, tokenizer=args.tokenizer, **held_out)
    return {"data": data, "warmup": args.warmup, "lr_schedule": args.lr_schedule, "min_lr": args.min_lr}


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


def check_output_args(args) -> None:
    """Before launch: output paths are writable, TensorBoard is installed, the Hugging Face directory reads."""
    if args.metrics:  # its directory is created, as a checkpoint directory would be
        require(not Path(args.metrics).is_dir(), f"--metrics {args.metrics!r} is a directory; name a file in it")
        _check_dir("--metrics", str(Path(args.metrics).parent))
    if args.tensorboard:
        check_installed("--tensorboard", "tensorboard")
        _check_dir("--tensorboard", args.tensorboard)
    if args.export_hf:
        check_installed("--export-hf", "safetensors")
        _check_dir("--export-hf", args.export_hf)
    require(args.export_dtype is None or args.export_hf, f"--export-dtype {args.export_dtype} applies to "
                                                         f"--export-hf; add --export-hf HF_DIR or drop it")


def _check_dir(flag: str, path: str) -> None:
    target = Path(path)
    require(not target.is_file(), f"{flag} {path!r} is a file; name a directory")
    existing = next((p for p in (target, *target.parents) if p.exists()), Path("."))
    require(existing.is_dir(), f"{flag} {path!r}: {str(existing)!r} is not a directory; choose another path")
    require(os.access(existing, os.W_OK), f"{flag} {path!r}: {str(existing)!r} is not writable here; choose a path "
                                          f"you can write")
