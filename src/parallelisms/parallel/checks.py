"""The rules of the parallelisms that are checked before any process starts, in a module without torch: the
command line validates a layout (``parallelisms.support``) and ``estimate``, ``plan`` and ``--help`` run without
importing torch. The engines that follow these rules import them from here; context parallelism's modes carry
their own (:mod:`parallelisms.parallel.cp_modes`).
"""

from __future__ import annotations

from parallelisms.options import FsdpStrategy

# FSDP1's sharding strategies (:mod:`parallelisms.parallel.fsdp`), and the ones that need a 2-D
# ``dp_replicate x dp_shard`` mesh
STRATEGIES = tuple(FsdpStrategy)
HYBRID = tuple(s for s in FsdpStrategy if s.hybrid)
