"""Where each optimizer parameter's elements sit in the full tensors of the plain model: what a checkpoint
needs to save one layout and load it into any other.

A :class:`Piece` is a box (offsets and sizes) of one full parameter, held by an optimizer parameter as a
contiguous run of its flat elements viewed as ``box_shape`` (then cut to ``sizes`` where padding, such as a
vocabulary TP does not divide or a dim-0 shard past the end, must be dropped). Every sharding engine reduces
to two cases: a tensor holding a parameter's whole local slice, marked with
:func:`parallelisms.parallel.common.mark_sharded` (DDP, plain gradients, per-parameter FSDP2, pipeline
stages): :func:`tensor_pieces`; and a flat buffer of several parameters of which a rank keeps the range
``[lo, hi)`` (the flat ZeRO/FSDP1 engine, buffer reuse): :func:`flat_pieces`. torch's FSDP1 ``_flat_param``
and DCP's chunk metadata describe the same thing; a contiguous range of a row-major tensor is cut into at
most 2 x ndim - 1 boxes, each contiguous.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from parallelisms.comm import Comms
from parallelisms.parallel.common import SHARD_ATTR


@dataclass(frozen=True)
class Piece:
    """Box ``offsets``/``sizes`` of full parameter ``name`` (shape ``full_shape``): elements ``[flat_lo,
    flat_lo + prod(box_shape))`` of the optimizer parameter, viewed as ``box_shape`` and cut to ``sizes``."""

    name: str
    full_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    flat_lo: int
    box_shape: tuple[int, ...]

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        """The box in ``tensor`` (the optimizer parameter, or optimizer state shaped like it)."""
        flat = tensor.reshape(-1)
        box = flat[self.flat_lo:self.flat_lo + math.prod(self.box_shape)].view(self.box_shape)
        return box[tuple(slice(0, s) for s in self.sizes)]


def _local_place(shape, marks, comms: Comms):
    """Offsets of a local slice in the full tensor, the sizes of it that lie inside (padding dropped) and the
    full shape, from its marks (innermost last, as :func:`parallelisms.parallel.common.gather_full` reads)."""
    offsets, extent, keep = [0] * len(shape), list(shape), list(shape)
    for mesh_dim, tensor_dim, full_size in reversed(marks):
        if tensor_dim is None:
            continue
        comm = comms[mesh_dim]
        offsets[tensor_dim] += comm.rank * extent[tensor_dim]
        extent[tensor_dim] *= comm.size
        if full_size is not None:
            extent[tensor_dim] = full_size
            keep[tensor_dim] = max(0, min(keep[tensor_dim], full_size - offsets[tensor_dim]))
    return offsets, keep, tuple(extent)


def range_boxes(shape, lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """The contiguous elements ``[lo, hi)`` of a row-major tensor of ``shape`` as boxes (offsets, box shape,
    flat start), each contiguous: a partial first row, whole rows, a partial last row, recursively."""
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [(tuple(shape and (lo,)), tuple(shape and (hi - lo,)), lo)]
    row = math.prod(shape[1:])
    first, last = lo // row, (hi - 1) // row

    def inner(r: int, a: int, b: int) -> list:  # a range inside row r
        return [((r, *o), (1, *s), start + r * row) for o, s, start in range_boxes(shape[1:], a, b)]
    if first == last:
        return inner(first, lo - first * row, hi - first * row)
    boxes = []
    if lo % row:
        boxes += inner(first, lo % row, row)
        first += 1
    end = hi // row
    if end > first:
        boxes.append(((first,) + (0,) * (len(shape) - 1), (end - first, *shape[1:]), first * row))
    if hi % row:
        boxes += inner(end, 0, hi % row)
    return boxes


def _pieces(name: str, shape, marks, comms: Comms, lo: int, hi: int, at: int) -> list[Piece]:
    """Pieces of parameter ``name`` (local shape ``shape``, ``marks``) whose flat local elements ``[lo, hi)``
    the optimizer parameter holds from its element ``at`` on."""
    offsets, keep, full = _local_place(tuple(shape), marks, comms)
    pieces = []
    for box_off, box_shape, start in range_boxes(tuple(shape), lo, hi):
        sizes = tuple(max(0, min(b, k - o)) for b, k, o in zip(box_shape, keep, box_off))
        if all(sizes) or not sizes:
            pieces.append(Piece(name, full, tuple(o + b for o, b in zip(offsets, box_off)), sizes,
                                start - lo + at, tuple(box_shape)))
    return pieces


def tensor_pieces(name: str, param: torch.Tensor, comms: Comms) -> list[Piece]:
    """A parameter holding its whole local slice, placed by its marks (tensor, expert, per-parameter FSDP
    sharding; padding dropped)."""
    return _pieces(name, param.shape, getattr(param, SHARD_ATTR, ()), comms, 0, param.numel(), 0)


def flat_pieces(names, shapes, marks, comms: Comms, lo: int, hi: int) -> list[Piece]:
    """A flat shard holding elements ``[lo, hi)`` of the concatenation of parameters ``names`` (local
    ``shapes``, tensor-parallel ``marks`` each), the flat ZeRO/FSDP1 and buffer-reuse layout."""
    pieces, offset = [], 0
    for name, shape, mark in zip(names, shapes, marks):
        numel = math.prod(shape)
        a, b = max(lo, offset), min(hi, offset + numel)
        if a < b:
            pieces += _pieces(name, shape, mark, comms, a - offset, b - offset, a - lo)
        offset += numel
    return pieces
