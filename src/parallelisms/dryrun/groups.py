"""The rank classes of the dry run (the layout's process groups are the mesh's own plan,
:meth:`ParallelDims.groups`, computed from its degrees alone as :meth:`ParallelDims.build_meshes` makes them).

Rank classes: the program a rank runs depends on its pipeline coordinate (which layers, first or last stage, its
place in the schedule) and its context-parallel coordinate (which sequence chunks, hence its ring attention's
block plan). Along data parallelism, tensor parallelism and expert parallelism every rank holds an equal shard
and runs the same operators on the same shapes (the layout's checks require the degrees to divide heads, FFN
width, vocabulary, batch and experts), so two ranks with the same (pp, cp) coordinates issue the same collectives
with the same shapes over groups in the same positions, and hold the same memory. A class is run once, by its
lowest rank; ``tests/test_dryrun.py`` runs every rank of small layouts and checks that the classes hold.
"""

from __future__ import annotations

from parallelisms.mesh import ParallelDims


def class_key(dims: ParallelDims, rank: int) -> tuple[int, int]:
    coords = dims.coordinates(rank)
    return coords["pp"], coords["cp"]


def rank_classes(dims: ParallelDims) -> dict[tuple[int, int], list[int]]:
    """Class key -> its ranks, lowest first."""
    classes: dict[tuple[int, int], list[int]] = {}
    for rank in range(dims.world_size):
        classes.setdefault(class_key(dims, rank), []).append(rank)
    return classes
