"""The layout: named parallel degrees, validated before launch, and the torch ``DeviceMesh`` they build.

Rank order, outermost to innermost: ``pp, dp_replicate, dp_shard, cp, tp``. Rank
``r = ((((pp_i * R + dr_i) * S + ds_i) * C + cp_i) * T + tp_i)``, so tensor-parallel peers are adjacent
ranks (the fastest links on a node) and pipeline stages are farthest apart. Expert parallelism does not
add ranks: the ``ep`` degree is carved out of the data-parallel x context-parallel ranks (the innermost
``ep`` of them form an expert group), so it must divide their product.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from datetime import timedelta

from parallelisms.errors import divisors, require

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# the flattened dimensions :meth:`ParallelDims.build_meshes` makes, each from adjacent axes of the rank order
FLATTENED = {"dp": ("dp_replicate", "dp_shard"), "dp_cp": ("dp_replicate", "dp_shard", "cp"),
             "dp_shard_cp": ("dp_shard", "cp"), "world": MESH_ORDER}


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            require(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                    f"parallel degree {f.name} must be a positive integer, got {value!r}")
        ranks = self.dp_replicate * self.dp_shard * self.cp
        require(ranks % self.ep == 0,
                lambda: f"--ep {self.ep} must divide the data-parallel x context-parallel ranks "
                f"({self.dp_replicate} x {self.dp_shard} x {self.cp} = {ranks}); "
                f"try --ep in {divisors(ranks)}")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that see different samples."""
        return self.dp_replicate * self.dp_shard

    def shape(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_ORDER}

    def describe(self, sep: str = "x") -> str:
        short = {"dp_replicate": "dp", "dp_shard": "dpshard"}
        parts = [f"{short.get(name, name)}{getattr(self, name)}" for name in (*MESH_ORDER, "ep") if getattr(self, name) > 1]
        return sep.join(parts) if parts else "single"

    def check_world_size(self, world_size: int) -> "ParallelDims":
        require(self.world_size == world_size,
                f"layout {self.describe()} needs pp x dp_replicate x dp_shard x cp x tp = {self.world_size} ranks, "
                f"but the world size is {world_size}; launch {self.world_size} processes or change the degrees")
        return self

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along every mesh dimension (the documented rank order)."""
        coords = {}
        for name in reversed(MESH_ORDER):
            rank, coords[name] = divmod(rank, getattr(self, name))
        return coords

    def span(self, dim: str, cp_ulysses: int = 0) -> tuple[int, int]:
        """(ranks, stride) of mesh dimension ``dim`` (as the Comm names it): each of its groups in
        :meth:`build_meshes` is ``ranks`` ranks ``stride`` apart, a dimension being a run of adjacent axes of the
        rank order (or of dp x cp: ``ep`` its innermost ``ep`` ranks, ``ep_replicate`` every ``ep``-th; with
        ``cp_ulysses``, hierarchical context parallelism's ``cp_inner``, neighbouring cp ranks, and ``cp_outer``,
        every ``cp_ulysses``-th). The stride is the product of the degrees inside the dimension's innermost axis."""
        if dim in ("ep", "ep_bwd", "ep_replicate"):
            inner = (self.ep, self.tp)
            return (self.dp * self.cp // self.ep, self.ep * self.tp) if dim == "ep_replicate" else inner
        if dim in ("cp_inner", "cp_outer") and cp_ulysses > 1:
            return (cp_ulysses, self.tp) if dim == "cp_inner" else (self.cp // cp_ulysses, cp_ulysses * self.tp)
        if dim not in MESH_ORDER and dim not in FLATTENED:
            raise KeyError(f"unknown mesh dimension {dim!r}")
        axes = FLATTENED.get(dim, (dim,))
        inside = MESH_ORDER[MESH_ORDER.index(axes[-1]) + 1:]
        return math.prod(getattr(self, a) for a in axes), math.prod(getattr(self, a) for a in inside)

    def group(self, dim: str, rank: int, cp_ulysses: int = 0) -> tuple[int, ...]:
        """The global ranks, in group order, of ``rank``'s group of mesh dimension ``dim`` (:meth:`span`)."""
        size, stride = self.span(dim, cp_ulysses)
        first = rank - (rank // stride) % size * stride
        return tuple(first + i * stride for i in range(size))

    def groups(self, dim: str, cp_ulysses: int = 0) -> list[tuple[int, ...]]:
        """Every group of mesh dimension ``dim`` (:meth:`group`), by their first ranks."""
        return sorted({self.group(dim, rank, cp_ulysses) for rank in range(self.world_size)})

    def build_meshes(self, device_type: str = "cpu") -> dict:
        """The 5-D ``DeviceMesh`` in ``MESH_ORDER`` (key ``"world"``), its 1-D sub-meshes by name, and the
        flattened ``dp`` (dp_replicate x dp_shard) and ``dp_cp`` (dp x cp) dimensions, and with context
        parallelism ``dp_shard_cp`` (dp_shard x cp: context-parallel ranks hold different tokens of the same
        model, so the sharded engines shard over them too; a hybrid layout replicates over dp_replicate)."""
        from torch.distributed.device_mesh import init_device_mesh

        world = init_device_mesh(device_type, tuple(self.shape().values()), mesh_dim_names=MESH_ORDER)
        meshes = {name: world[name] for name in MESH_ORDER}
        meshes["dp"] = world["dp_replicate", "dp_shard"]._flatten("dp")
        meshes["dp_cp"] = world["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        if self.cp > 1:  # sharded data parallelism shards over dp_shard x cp (torchtitan's FSDP mesh)
            meshes["dp_shard_cp"] = world["dp_shard", "cp"]._flatten("dp_shard_cp")
        if self.ep > 1:  # ep: the innermost ep ranks of dp x cp; ep_replicate: the ranks holding the same experts
            dp_cp = world["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp_for_ep")
            experts = dp_cp._unflatten(0, (self.dp * self.cp // self.ep, self.ep), ("ep_replicate", "ep"))
            meshes["ep"], meshes["ep_replicate"] = experts["ep"], experts["ep_replicate"]
            # the same expert groups again, for the backward all-to-alls: gloo runs one group's collectives in
            # order, so a backward overlapped with a forward's dispatch (DualPipe's F&B) needs its own group
            twin = dp_cp._unflatten(0, (self.dp * self.cp // self.ep, self.ep), ("ep_replicate_bwd", "ep_bwd"))
            meshes["ep_bwd"] = twin["ep_bwd"]
        meshes["world"] = world
        _inherit_timeout(meshes)
        return meshes


def _inherit_timeout(meshes: dict) -> None:
    """Give every mesh group the default group's collective timeout (the run's ``--timeout``): torch creates
    the groups of a multi-dimensional mesh with its own default (30 minutes for gloo)."""
    import torch.distributed as dist

    from parallelisms.comm.ops import group_timeout_s

    timeout = timedelta(seconds=group_timeout_s(dist.group.WORLD))
    for mesh in meshes.values():
        for group in mesh.get_all_groups():
            if group is not dist.group.WORLD and group_timeout_s(group) != timeout.total_seconds():
                dist.distributed_c10d._set_pg_timeout(timeout, group)
