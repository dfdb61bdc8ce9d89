"""The Python API (``docs/api.md``): the command line's verbs as functions, and the pieces of a training loop
for a ``torchrun`` script of your own.

``train``, ``verify``, ``estimate``, ``plan`` and ``simulate`` take the command line's options as keyword arguments
(``--dp-shard 2`` is ``dp_shard=2``, a switch such as ``--sp`` is ``sp=True``), check each value with its option's
parser, build the configs by the command line's path, run the same code and return the dict that ``--json``
prints; bad input raises :class:`parallelisms.errors.ConfigError` with the command line's one-line message (an
unknown keyword: one line naming it and the options closest to it), before any process starts.

For a loop of your own: ``configure(**options)`` gives the validated configs, ``build_model`` the full seeded
model, ``parallelize(model, layout, train)`` applies the layout (process group and meshes included) and returns
the :class:`~parallelisms.trainer.Trainer` whose ``train_step(inputs, targets)`` is one optimizer step (and whose
``close()``, on every rank, releases the layout's process groups and hooks when a process trains again), and
``batches(train, layout)`` yields this rank's share of each global batch.
"""

from __future__ import annotations

import os
from typing import Iterator, NamedTuple

from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig
from parallelisms.model import build_model

__all__ = ["train", "verify", "estimate", "plan", "simulate", "configure", "build_model", "parallelize", "batches"]


def _settings(verb: str, options: dict) -> dict:
    """The settings of ``verb`` with these keyword options, each checked by its option's parser, the rest the
    verb's defaults (:mod:`parallelisms.api_options`): no command line is written or parsed."""
    from parallelisms.api_options import settings

    return settings(verb, options)


def train(**options) -> dict:
    """Train as ``parallelisms train`` does (options: its flags, e.g. ``dp=2, steps=50, trace="t.json"``); the
    report ``--json`` prints (losses, speed, communication, ``device``, ``backend``). Under ``torchrun``, ranks
    other than 0 return None."""
    from parallelisms.cli_results import train_report, train_run

    return train_report(train_run(_settings("train", options)))


def verify(**options) -> dict:
    """Compare a layout with single-process training as ``parallelisms verify`` does; its ``--json`` result
    (``ok``, the largest relative differences, the tolerance)."""
    from parallelisms.cli_results import verify_result, verify_run

    return verify_result(verify_run(_settings("verify", options)))


def estimate(**options) -> dict:
    """Memory per rank, communication per step and step time of a layout, as ``parallelisms estimate``."""
    from parallelisms.cli_results import estimate_result, estimate_run

    return estimate_result(estimate_run(_settings("estimate", options)))


def plan(**options) -> dict:
    """The fastest layouts of ``gpus=N`` GPUs that fit, best first, as ``parallelisms plan`` (the layout options
    given stay fixed): ``{"plans": [...]}``."""
    from parallelisms.cli_results import plan_result, plan_run

    return plan_result(plan_run(_settings("plan", options)))


def simulate(**options) -> dict:
    """Simulate a pipeline schedule as ``parallelisms simulate`` (``schedule="zb-v", pp=4, microbatches=8``)."""
    from parallelisms.parallel.pipeline.cli import simulate_result, simulate_run

    return simulate_result(simulate_run(_settings("simulate", options)))


class Configs(NamedTuple):
    """What ``configure`` returns: the model's shape, the training settings and the layout."""

    model: ModelConfig
    train: TrainConfig
    layout: ParallelConfig


def configure(argv: list[str] = (), **options) -> Configs:
    """The model, training and layout configs of ``parallelisms train`` with these keyword options and then the
    flags in ``argv`` (``sys.argv[1:]`` of a script, say), validated as the command line validates them (under
    ``torchrun``: against the world size too)."""
    from argparse import Namespace

    from parallelisms.api_options import settings, verb_parser
    from parallelisms.cli_configs import build_configs

    parser = verb_parser("train")
    values = settings("train", options, parser)
    if argv:  # a command line of the script's: its flags override the keywords
        values = vars(parser.parse_args(list(argv), namespace=Namespace(**values)))
    return Configs(*build_configs(values))


def parallelize(model, layout: ParallelConfig, train: TrainConfig, device: str = "auto"):
    """Apply ``layout`` to the full seeded ``model`` (from :func:`build_model`) on this rank and return its
    :class:`~parallelisms.trainer.Trainer`. Starts the process group if none is (NCCL on CUDA, gloo on the CPU;
    ``device`` as ``--device``) and moves the model to this rank's device. One process without ``torchrun``
    runs the single-process layout."""
    from datetime import timedelta

    import torch.distributed as dist

    from parallelisms.comm import CommLedger, Comms, Timeline
    from parallelisms.train_setup import parallelize as apply_layout

    world = int(os.environ.get("WORLD_SIZE", "1"))
    dims = layout.dims.check_world_size(world)
    placement, target = _placement(device)
    if target.type == "cuda":
        import torch

        torch.cuda.set_device(target)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(placement.backend, timeout=timedelta(seconds=train.timeout_s),
                                device_id=target if target.type == "cuda" else None)
    rank = dist.get_rank() if world > 1 else 0
    if world > 1:
        from parallelisms.comm.liveness import publish_host

        publish_host(rank)  # peers on this host then exchange point-to-point messages through shared memory
    meshes = dims.build_meshes(placement.device) if world > 1 else {}
    return apply_layout(model.to(target), layout, train, Comms(meshes, CommLedger(), Timeline(rank, enabled=False)))


def _placement(device: str):
    """This process's placement (``--device``'s rule) and its torch device (``cuda:LOCAL_RANK`` or cpu)."""
    import torch

    from parallelisms.device import choose

    placement = choose(device, int(os.environ.get("WORLD_SIZE", "1")))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    return placement, torch.device("cuda", local) if placement.device == "cuda" else torch.device("cpu")


def batches(train: TrainConfig, layout: ParallelConfig, steps: int | None = None,
            device: str = "auto") -> Iterator[tuple]:
    """This rank's (inputs, targets) for each step (``train.steps`` unless ``steps``): the rows of the run's
    data's global batch that its data-parallel coordinate owns, as ``parallelisms train`` feeds them, on the
    device :func:`parallelize` puts the model on (``device`` as there)."""
    import torch.distributed as dist

    from parallelisms.data.sources import training_loader

    dims = layout.dims
    coords = dims.coordinates(dist.get_rank() if dist.is_initialized() else 0)
    dp_rank = coords["dp_replicate"] * dims.dp_shard + coords["dp_shard"]
    loader = training_loader(train)  # the built-in corpus, or the data of ``data=`` (``--data``)
    target = _placement(device)[1]
    for step in range(train.steps if steps is None else steps):
        yield tuple(t.to(target) for t in loader.shard(step, dp_rank, dims.dp))
