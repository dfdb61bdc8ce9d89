"""Numerics shared by the model and the parallel layers: the precision that reductions run in."""

from __future__ import annotations

import torch


def upcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in at least float32: bf16 activations are normalised, soft-maxed and reduced in fp32, while
    float64 (``verify --dtype float64``) stays float64 (``x.float()`` would round it to fp32)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))
