"""Model-shape flags every verb shares (``--layers --hidden --heads ...``), applied on top of ``--preset`` or
``--config``: a GPT-3 or Megatron shape can be trained, verified, estimated and planned without a file; and
the hardware flags of the verbs that predict."""

from __future__ import annotations

import argparse
import dataclasses
import re

from parallelisms.config import MODEL_FLAGS, ModelConfig, with_shape
from parallelisms.errors import ConfigError
from parallelisms.flags import Flag, add_flags, given_fields, settings
from parallelisms.perf.hardware import ATTENTION_KERNELS, KERNELS, PRESETS

# the model's field names, as a message about them says them, and the flag that sets each
_FIELD_FLAGS = {"model dim": "--hidden", "head_dim": "--head-dim",
                **{f.field: f.name for f in MODEL_FLAGS if f.parse}}  # the integer ones: no --mlp in --mlp's text
_FIELDS = re.compile(r"\b(" + "|".join(map(re.escape, _FIELD_FLAGS)) + r")\b")


def shape_from_args(base: ModelConfig, args) -> ModelConfig:
    """``base`` with the shape flags ``args`` holds (:func:`parallelisms.flags.settings`), validated: a bad shape is
    one line naming the flags that would fix it."""
    given = given_fields(MODEL_FLAGS, args)
    tie = given.pop("tie_embeddings", False)
    try:
        shaped = with_shape(base, settings(args).get("seq_len", 0), **given)
    except ConfigError as exc:
        raise ConfigError(_FIELDS.sub(lambda m: _FIELD_FLAGS[m[1]], str(exc))) from None
    return dataclasses.replace(shaped, tie_embeddings=True) if tie else shaped


@dataclasses.dataclass(frozen=True)
class Pricing:
    """What a prediction prices a layout on (``estimate``, ``plan``, ``dryrun``): the ``hardware`` (a preset or
    a calibrate file, :func:`~parallelisms.perf.hardware.load_hardware`), the attention kernel, how the non-GEMM work runs (``kernels``) and
    whether the blocks' linear layers run in FP8."""

    hardware: str = "h100"
    attention: str = "flash"
    kernels: str = "eager"
    fp8: bool = False


PRICING_FLAGS = (
    Flag("hardware", f"{', '.join(PRESETS)} (this machine, calibrated) or a JSON file with the keys of "
                     f"`parallelisms calibrate`'s output"),
    Flag("attention", "attention kernel: flash, or fused-softmax (scores materialised: Megatron-LM 2021-22)",
         choices=ATTENTION_KERNELS),
    Flag("kernels", "how a GPU runs the non-GEMM work (norms, rotary, activation, loss, optimizer): eager, one "
                    "kernel per operator as this runtime runs it, or fused as Megatron-LM and Transformer Engine run "
                    "it", choices=KERNELS),
    Flag("fp8", "price the blocks' linear layers in FP8 (Transformer Engine's recipe; Hopper or later): predicted "
                "only, this runtime does not train in FP8"),
)


def add_hardware_args(p: argparse.ArgumentParser) -> None:
    """--hardware, --attention, --kernels and --fp8, for estimate, plan and dryrun: :class:`Pricing`'s fields."""
    add_flags(p, PRICING_FLAGS, Pricing)
