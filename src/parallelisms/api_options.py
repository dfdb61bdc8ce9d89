"""The Python API's keyword arguments as a verb's settings (a mapping of each option's value by its Python name),
with no command line written or parsed and no Namespace: each keyword is one of the verb's options by its Python
name (``dp_shard=2`` is ``--dp-shard 2``, ``sp=True`` is ``--sp``), checked
by that option's own parser and choices, so a bad value is the command line's one-line message; an option not
given takes the verb's default. The verb's typed configuration is then built and validated by the one path the
command line also takes (:mod:`parallelisms.cli_results`' ``train_run``, ``verify_run``, ``estimate_run``, through
:func:`parallelisms.cli_configs.build_configs`: the registry's ``parallel_config``, the TrainConfig and
ModelConfig fields, ``validate_layout``).

The options' table is the verb's parser (:mod:`parallelisms.cli_args`, generated from the registry and the
configs): its actions name each option, its parser, choices and default. Torch-free.
"""

from __future__ import annotations

import argparse
import difflib

from parallelisms.config_file import CONFIG_FILE, CONFIG_FLAG, file_options
from parallelisms.errors import ConfigError


def verb_parser(verb: str) -> argparse.ArgumentParser:
    """The parser of ``parallelisms VERB`` (its options' table)."""
    from parallelisms.cli import build_parser

    return build_parser()._subparsers._group_actions[0].choices[verb]


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}


def _defaults(parser: argparse.ArgumentParser, verb: str) -> dict:
    """Every option's default, as the parser leaves it when the option is not given."""
    values = {"command": verb, **parser._defaults}
    for action in parser._actions:
        if action.dest != "help" and action.dest not in values:
            default = action.default
            if isinstance(default, str) and action.type is not None:  # argparse parses a default given as text
                default = parser._get_value(action, default)
            values[action.dest] = default
    return values


def _text(value) -> str:
    """A keyword's value as its flag's text: a tuple or list comma-joined (``betas=(0.9, 0.95)``)."""
    return ",".join(map(str, value)) if isinstance(value, (tuple, list)) else str(value)


def _value(parser: argparse.ArgumentParser, action: argparse.Action, value):
    """``value`` checked as the option's flag is checked (its parser, its choices)."""
    flag = action.option_strings[-1]
    if action.nargs == 0:  # a switch
        if not isinstance(value, bool):
            parser.error(f"argument {flag}: a switch; give True or False, got {value!r}")
        return value
    if value is True and action.const is not None:  # an optional value given alone (--predict)
        return action.const
    try:
        return parser._get_values(action, [_text(value)])
    except argparse.ArgumentError as exc:
        parser.error(str(exc))


def unknown_keyword(name: str, known, verb: str) -> str:
    """One line naming the keyword and the options closest to it."""
    close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(close)}?" if close else f"see parallelisms {verb} --help for its options"
    return (f"unknown keyword {name!r} for parallelisms.{verb}: {hint} (a keyword is a flag by its Python name: "
            f"--dp-shard 2 is dp_shard=2)")


def settings(verb: str, options: dict, parser: argparse.ArgumentParser | None = None) -> dict:
    """The settings of ``verb`` with ``options`` (keyword arguments; None, or False for an option that takes a
    value, leaves the default), by Python name, each checked by its option's parser: ConfigError, one line, on an
    unknown keyword or a bad value. ``config_file`` reads a run's TOML file first (:mod:`parallelisms.config_file`),
    the other keywords overriding it."""
    parser = parser or verb_parser(verb)
    known = _options(parser)
    options = dict(options)
    path = options.pop(CONFIG_FILE, None)
    if path is not None:
        from_file = file_options(path, parser)
        try:  # the file's values alone first: a bad one is named as the file's
            settings(verb, from_file, parser)
        except ConfigError as exc:
            raise ConfigError(f"{CONFIG_FLAG} {path!r}: {exc}") from None
        options = {**from_file, **options}
    args = _defaults(parser, verb)
    for name, value in options.items():
        if name not in known:
            raise ConfigError(unknown_keyword(name, known, verb))
        if value is None or (value is False and known[name].nargs != 0):
            continue
        args[name] = _value(parser, known[name], value)
    missing = [a.option_strings[-1] for a in parser._actions if a.required and options.get(a.dest) is None]
    if missing:
        parser.error(f"the following arguments are required: {', '.join(missing)}")
    if path is not None:
        args[CONFIG_FILE] = path
    return args
