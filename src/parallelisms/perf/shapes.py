"""Model-shape flags every verb shares (``--layers --hidden --heads ...``), applied on top of ``--preset`` or
``--config``: a GPT-3 or Megatron shape can be trained, verified, estimated and planned without a file; and
the hardware flags of the verbs that predict."""

from __future__ import annotations

import argparse
import dataclasses
import re

from parallelisms.config import MAX_MODEL_INT, MLPS, ModelConfig, with_shape
from parallelisms.errors import ConfigError
from parallelisms.flags import integer

SHAPE_FLAGS = {  # flag: (with_shape keyword, help)
    "--layers": ("layers", "transformer blocks"),
    "--hidden": ("hidden", "hidden size h"),
    "--heads": ("heads", "attention heads"),
    "--kv-heads": ("kv_heads", "key/value heads (default: --heads)"),
    "--head-dim": ("head_dim", "size of each attention head (default: hidden / heads; Qwen3 and Mistral set it)"),
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
    group.add_argument("--tie-embeddings", action="store_true",
                       help="the output head is the embedding table (Hugging Face's tie_word_embeddings)")


# the model's field names, as a message about them says them, and the flag that sets each
_FIELD_FLAGS = {"model dim": "--hidden", "dim": "--hidden", "n_heads": "--heads", "n_kv_heads": "--kv-heads",
                "head_dim": "--head-dim",
                "n_layers": "--layers", "ffn_dim": "--ffn", "vocab_size": "--vocab", "n_experts": "--experts",
                "top_k": "--topk"}
_FIELDS = re.compile(r"\b(" + "|".join(map(re.escape, _FIELD_FLAGS)) + r")\b")


def shape_from_args(base: ModelConfig, args) -> ModelConfig:
    """``base`` with the shape flags given on the command line (validated: a bad shape is one line naming the
    flags that would fix it)."""
    given = {key: getattr(args, key) for key, _ in SHAPE_FLAGS.values()}
    try:
        shaped = with_shape(base, getattr(args, "seq_len", 0), mlp=args.mlp, **given)
    except ConfigError as exc:
        raise ConfigError(_FIELDS.sub(lambda m: _FIELD_FLAGS[m[1]], str(exc))) from None
    return dataclasses.replace(shaped, tie_embeddings=True) if getattr(args, "tie_embeddings", False) else shaped


def add_hardware_args(p: argparse.ArgumentParser) -> None:
    """--hardware, --attention, --kernels and --fp8, for estimate and plan."""
    from parallelisms.perf.compute import ATTENTION_KERNELS, KERNELS
    from parallelisms.perf.hardware import PRESETS

    p.add_argument("--hardware", default="h100", help=f"{', '.join(PRESETS)} (this machine, calibrated) or a JSON "
                                                      f"file with the keys of `parallelisms calibrate`'s output")
    p.add_argument("--attention", choices=ATTENTION_KERNELS, default="flash",
                   help="attention kernel: flash, or fused-softmax (scores materialised: Megatron-LM 2021-22)")
    p.add_argument("--kernels", choices=KERNELS, default="eager",
                   help="how a GPU runs the non-GEMM work (norms, rotary, activation, loss, optimizer): eager, one "
                        "kernel per operator as this runtime runs it, or fused as Megatron-LM and Transformer "
                        "Engine run it (default: eager)")
    p.add_argument("--fp8", action="store_true",
                   help="price the blocks' linear layers in FP8 (Transformer Engine's recipe; Hopper or later): "
                        "predicted only, this runtime does not train in FP8")
