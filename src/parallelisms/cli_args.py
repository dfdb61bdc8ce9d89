"""The command line's shared flags: the model, layout, training and device arguments of ``train``, ``verify``,
``dryrun``, ``estimate`` and ``plan``, and the parser that reports bad input in one line.

Torch-free, as :mod:`parallelisms.cli` and everything it imports at load (``tests/test_cli_light.py``).
"""

from __future__ import annotations

import argparse
import dataclasses

from parallelisms.cli_configs import (DP_FLAGS, LAUNCH_FLAGS, MODEL_SOURCE_FLAGS, DataParallelDegrees, Launch,
                                      ModelSource)
from parallelisms.config import COUNT, MODEL_FLAGS, TRAIN_FLAGS, ModelConfig, TrainConfig
from parallelisms.config_file import CONFIG_FILE, CONFIG_FLAG, expand
from parallelisms.errors import ConfigError
from parallelisms.flags import DEGREE, add_flags
from parallelisms.parallel.registry import LAYOUT, PARALLELISMS

DEFAULT_TRAIN = dict(dp=2, steps=300, global_batch=16, seq_len=64)


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in ``--help``, except where there is none to show (switches, unset options)."""

    def _get_help_string(self, action):
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """One-line errors; ``--help`` shows every option's default; a verb with ``--config-file`` reads its flags
    from the TOML file first (:mod:`parallelisms.config_file`)."""

    def __init__(self, *args, formatter_class=_Formatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        if args is None or not any(a.startswith(CONFIG_FLAG) for a in args) or not self._has(CONFIG_FILE):
            return super().parse_known_args(args, namespace)
        flags, own, path = expand(list(args), self)
        try:  # the file's values alone first: a bad one is named as the file's
            super().parse_known_args(flags, argparse.Namespace())
        except ConfigError as exc:
            raise ConfigError(f"{CONFIG_FLAG} {path!r}: {exc}") from None
        parsed, extra = super().parse_known_args(flags + own, namespace)
        setattr(parsed, CONFIG_FILE, path)
        return parsed, extra

    def _has(self, dest: str) -> bool:
        return any(a.dest == dest for a in self._actions)

    def error(self, message):  # one line, no usage block
        raise ConfigError(f"{message} (see {self.prog} --help)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model's flags, and ``--config-file`` (every verb that takes a model takes a whole run from a file)."""
    p.add_argument(CONFIG_FLAG, metavar="RUN_TOML", help="the run's flags from a TOML file, by section ([model], "
                                                         "[layout], [training], [optimizer], [data], [outputs], "
                                                         "[run]); flags given here override it")
    g = p.add_argument_group("model")
    add_flags(g, MODEL_SOURCE_FLAGS, ModelSource)
    add_flags(g, MODEL_FLAGS, ModelConfig)


def add_layout_args(p: argparse.ArgumentParser, dp_default: int = 1) -> None:
    """The degrees, then every parallelism's options (:mod:`parallelisms.parallel.registry`), in its ``--help``
    group: flags, parsers, defaults and choices from the descriptors and the config's fields."""
    g = p.add_argument_group(LAYOUT)
    when = f"{dp_default} when --tp, --pp and --cp are 1, else 1" if dp_default > 1 else str(dp_default)
    dp, *sides = DP_FLAGS
    add_flags(g, (dataclasses.replace(dp, help=f"{dp.help}; default {when}"), *sides), DataParallelDegrees)
    p.set_defaults(dp_default=dp_default)
    for par in PARALLELISMS.values():
        if par.degree:
            g.add_argument(f"--{par.dim}", type=DEGREE, default=1, help=f"{par.degree}-parallel degree")
    groups = {LAYOUT: g}
    for par in PARALLELISMS.values():
        for option in par.options:
            title = option.group or par.title
            group = groups.get(title) or groups.setdefault(title, p.add_argument_group(title))
            group.add_argument(option.name, **option.arguments())


def add_train_args(p: argparse.ArgumentParser, steps: int) -> None:
    """The training flags, from :data:`parallelisms.config.TRAIN_FLAGS` (defaults TrainConfig's, except the
    verb's ``steps`` and the command line's batch), and ``--json``."""
    defaults = dict(steps=steps, global_batch=DEFAULT_TRAIN["global_batch"], seq_len=DEFAULT_TRAIN["seq_len"])
    add_flags(p.add_argument_group("training"), TRAIN_FLAGS, TrainConfig, defaults)
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON object")


def add_device_args(p: argparse.ArgumentParser) -> None:
    """Where a run starts, from :class:`~parallelisms.cli_configs.Launch`'s fields."""
    add_flags(p, LAUNCH_FLAGS, Launch)
