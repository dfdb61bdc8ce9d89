"""The process groups of a layout, computed from its degrees alone (as :meth:`ParallelDims.build_meshes` makes
them), and the rank classes of the dry run.

Rank classes: the program a rank runs depends on its pipeline coordinate (which layers, first or last stage, its
place in the schedule) and its context-parallel coordinate (which sequence chunks, hence its ring attention's
block plan). Along data parallelism, tensor parallelism and expert parallelism every rank holds an equal shard
and runs the same operators on the same shapes (the layout's checks require the degrees to divide heads, FFN
width, vocabulary, batch and experts), so two ranks with the same (pp, cp) coordinates issue the same collectives
with the same shapes over groups in the same positions, and hold the same memory. A class is run once, by its
lowest rank; ``tests/test_dryrun.py`` runs every rank of small layouts and checks that the classes hold.
"""

from __future__ import annotations

import torch

from parallelisms.mesh import MESH_ORDER, ParallelDims


def class_key(dims: ParallelDims, rank: int) -> tuple[int, int]:
    coords = dims.coordinates(rank)
    return coords["pp"], coords["cp"]


def rank_classes(dims: ParallelDims) -> dict[tuple[int, int], list[int]]:
    """Class key -> its ranks, lowest first."""
    classes: dict[tuple[int, int], list[int]] = {}
    for rank in range(dims.world_size):
        classes.setdefault(class_key(dims, rank), []).append(rank)
    return classes


def groups_of(dims: ParallelDims, dim: str, cp_ulysses: int = 0) -> list[tuple[int, ...]]:
    """Every group of mesh dimension ``dim`` (as the Comm names it), each as its global ranks in group order;
    ``cp_ulysses``: hierarchical context parallelism's groups of neighbouring cp ranks (cp_inner) and the
    rings across them (cp_outer)."""
    grid = torch.arange(dims.world_size).view(*(getattr(dims, name) for name in MESH_ORDER))
    flattened = {"dp": ("dp_replicate", "dp_shard"), "dp_cp": ("dp_replicate", "dp_shard", "cp"),
                 "dp_shard_cp": ("dp_shard", "cp"), "world": MESH_ORDER}
    if dim in MESH_ORDER or dim in flattened:
        inner = flattened.get(dim, (dim,))
        axes = [MESH_ORDER.index(name) for name in inner]
        rest = [i for i in range(len(MESH_ORDER)) if i not in axes]
        size = 1
        for name in inner:
            size *= getattr(dims, name)
        return [tuple(g) for g in grid.permute(*rest, *axes).reshape(-1, size).tolist()]
    if dim in ("ep", "ep_bwd", "ep_replicate"):
        dp_cp = grid.permute(0, 4, 1, 2, 3).reshape(dims.pp * dims.tp, -1, dims.ep)  # [pp x tp, dp_cp / ep, ep]
        if dim == "ep_replicate":
            dp_cp = dp_cp.transpose(1, 2)
        return [tuple(g) for g in dp_cp.reshape(-1, dp_cp.shape[-1]).tolist()]
    if dim in ("cp_inner", "cp_outer") and cp_ulysses > 1:  # cp rank o * u + i: rank i inside, rank o across
        cp = torch.tensor(groups_of(dims, "cp"))
        split = cp.view(cp.shape[0], -1, cp_ulysses)
        split = split.transpose(1, 2) if dim == "cp_outer" else split
        return [tuple(g) for g in split.reshape(-1, split.shape[-1]).tolist()]
    raise KeyError(f"unknown mesh dimension {dim!r}")
