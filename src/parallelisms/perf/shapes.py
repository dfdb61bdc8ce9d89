"""Model-shape flags every verb shares (``--layers --hidden --heads ...``), applied on top of ``--preset`` or
``--config``: a GPT-3 or Megatron shape can be trained, verified, estimated and planned without a file; and
the hardware flags of the verbs that predict."""

from __future__ import annotations

import argparse

from parallelisms.config import MAX_MODEL_INT, MLPS, ModelConfig, with_shape
from parallelisms.flags import integer

SHAPE_FLAGS = {  # flag: (with_shape keyword, help)
    "--layers": ("layers", "transformer blocks"),
    "--hidden": ("hidden", "hidden size h"),
    "--heads": ("heads", "attention heads"),
    "--kv-heads": ("kv_heads", "key/value heads (default: --heads)"),
    "--ffn": ("ffn", "MLP width (default 4h for gelu, 8h/3 for swiglu)"),
    "--vocab": ("vocab", "vocabulary size"),
    "--experts": ("experts", "experts per MoE layer (0: dense)"),
    "--topk": ("topk", "experts per token"),
}


def add_shape_args(group: argparse._ArgumentGroup) -> None:
    for flag, (_, text) in SHAPE_FLAGS.items():
        low = 0 if flag == "--experts" else 1
        group.add_argument(flag, type=integer(low, MAX_MODEL_INT), help=f"{text}; overrides the preset/config")
    group.add_argument("--mlp", choices=MLPS, help="MLP: swiglu (Llama) or gelu (GPT, two matrices)")


def shape_from_args(base: ModelConfig, args) -> ModelConfig:
    """``base`` with the shape flags given on the command line (validated: bad shapes are one line)."""
    given = {key: getattr(args, key) for key, _ in SHAPE_FLAGS.values()}
    return with_shape(base, getattr(args, "seq_len", 0), mlp=args.mlp, **given)


def add_hardware_args(p: argparse.ArgumentParser) -> None:
    """--hardware and --attention, for estimate and plan."""
    from parallelisms.perf.compute import ATTENTION_KERNELS
    from parallelisms.perf.hardware import PRESETS

    p.add_argument("--hardware", default="h100", help=f"{', '.join(PRESETS)} (this machine, calibrated) or a JSON "
                                                      f"file with the keys of `parallelisms calibrate`'s output")
    p.add_argument("--attention", choices=ATTENTION_KERNELS, default="flash",
                   help="attention kernel: flash, or fused-softmax (scores materialised: Megatron-LM 2021-22)")
