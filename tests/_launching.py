"""Shared by the multi-process tests: launch an entry once per world size, on first use."""

from parallelisms.launch import launch


def launch_once_per_world(entry, threads: int = 1):
    """world size -> rank 0's result of ``entry(info, world)``; each world size is launched at most once."""
    cache = {}

    def get(world: int):
        if world not in cache:
            cache[world] = launch(entry, world, world, threads=threads)[0]
        return cache[world]
    return get
