"""The typed values of a run's options: one ``StrEnum`` per option of :class:`~parallelisms.config.ParallelConfig`
and :class:`~parallelisms.config.TrainConfig` whose values are a fixed set.

A member is its string (``Recompute.FULL == "full"``, ``f"{Recompute.FULL}"`` is ``full``, JSON writes
``"full"``), so flags, TOML files and ``--json`` reports read and write the same words; the configs turn a
valid string into its member (:func:`coerce`) and leave any other string for their checks to refuse in one line.
Options whose values are a registry's keys stay strings checked against it: ``cp_attention``
(:data:`parallelisms.parallel.cp_modes.MODES`). Torch-free, at the bottom of the layers.
"""

from __future__ import annotations

import functools
import typing
from enum import StrEnum


class FsdpStrategy(StrEnum):
    """FSDP1's sharding strategies (:mod:`parallelisms.parallel.fsdp`)."""
    FULL_SHARD = "full_shard"
    SHARD_GRAD_OP = "shard_grad_op"
    NO_SHARD = "no_shard"
    HYBRID_SHARD = "hybrid_shard"            # shard within dp_shard, replicate across dp_replicate
    HYBRID_SHARD_ZERO2 = "hybrid_shard_zero2"

    @property
    def hybrid(self) -> bool:
        """Whether it needs a 2-D ``dp_replicate x dp_shard`` mesh."""
        return self in (FsdpStrategy.HYBRID_SHARD, FsdpStrategy.HYBRID_SHARD_ZERO2)

    @property
    def stage(self) -> int:
        """The ZeRO stage whose states it shards (Rajbhandari et al. SC'20): 3 the parameters too, 2 the gradients
        and optimizer state, 0 nothing."""
        full = (FsdpStrategy.FULL_SHARD, FsdpStrategy.HYBRID_SHARD)
        return 3 if self in full else 0 if self is FsdpStrategy.NO_SHARD else 2


class FsdpStyle(StrEnum):
    """The FSDP engine: flat parameters (FSDP1), per-parameter shards (FSDP2) or reused buffers (YaFSDP)."""
    FLAT = "flat"
    PER_PARAM = "per_param"
    REUSE = "reuse"


class Precision(StrEnum):
    """``--mixed-precision``: fp32 throughout, or bf16 compute with fp32 master weights."""
    FP32 = "fp32"
    BF16 = "bf16"

    @property
    def compute_bytes(self) -> int:
        """Bytes of a compute-dtype element over fp32 parameters (activations, gathered weights)."""
        return 2 if self is Precision.BF16 else 4


class Schedule(StrEnum):
    """The pipeline schedules (:data:`parallelisms.parallel.pipeline.schedules.GENERATORS`)."""
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    ZB_H1 = "zb-h1"
    ZB_H2 = "zb-h2"
    ZB_V = "zb-v"
    DUALPIPE = "dualpipe"
    DUALPIPEV = "dualpipev"
    PIPEDREAM = "pipedream"

    @property
    def dual(self) -> bool:
        """DualPipe's two-direction schedules, whose F&B chunks run one microbatch's forward beside another's
        backward (DeepSeek-V3 report, Sec. 3.2.1)."""
        return self in (Schedule.DUALPIPE, Schedule.DUALPIPEV)


class PpBalance(StrEnum):
    """How the pipeline cuts its stages: equal layer counts, or measured per-layer time."""
    LAYERS = "layers"
    MEASURED = "measured"


class Balance(StrEnum):
    """``--dp-balance`` and ``--ep-balance``: an even split, or one by measured speed or load."""
    EVEN = "even"
    MEASURED = "measured"


class Recompute(StrEnum):
    """Activation recomputation: none, the attention core (selective) or the whole block (full)."""
    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


class Dtype(StrEnum):
    """The parameters' dtype (float64: verify's tight contract)."""
    FLOAT32 = "float32"
    FLOAT64 = "float64"

    @property
    def bytes(self) -> int:
        return 8 if self is Dtype.FLOAT64 else 4


class NonFinite(StrEnum):
    """What a non-finite loss or gradient does: continue (verify finds where), stop, or skip the update."""
    CONTINUE = "continue"
    STOP = "stop"
    SKIP = "skip"


class LrSchedule(StrEnum):
    """The learning rate after warmup: constant, or a cosine or linear decay to ``min_lr``."""
    CONSTANT = "constant"
    COSINE = "cosine"
    LINEAR = "linear"


def choices(kind: type[StrEnum], last: str = "or") -> str:
    """``a, b or c``: the values of ``kind`` as an error line or ``--help`` lists them."""
    values = [str(v) for v in kind]
    return values[0] if len(values) == 1 else f"{', '.join(values[:-1])} {last} {values[-1]}"


def coerce(config) -> None:
    """Turn each enum-typed field of the frozen dataclass ``config`` from a valid string into its member (another
    value stays as given, for the config's checks to refuse with the flag's name)."""
    for name, kind in enum_fields(type(config)).items():
        value = getattr(config, name)
        if isinstance(value, str) and not isinstance(value, kind) and value in kind._value2member_map_:
            object.__setattr__(config, name, kind(value))


@functools.cache
def enum_fields(cls: type) -> dict[str, type[StrEnum]]:
    """The fields of dataclass ``cls`` typed by an enum (optional ones included), by name."""
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
        kind = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
        if isinstance(kind, type) and issubclass(kind, StrEnum):
            out[name] = kind
    return out
