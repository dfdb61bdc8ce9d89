"""A whole run in one TOML file (``--config-file run.toml``), as torchtitan's job configs hold one: sections
``[model]``, ``[layout]``, ``[training]``, ``[optimizer]``, ``[data]``, ``[outputs]`` and ``[run]``, each key a
flag of the verb by its Python name (``global_batch = 16`` is ``--global-batch 16``).

The file's keys become flags placed before the command line's own, so a flag given on the command line overrides
the file, and every value goes through the same parsing and checks as the flag. A key or section the verb does
not have is refused in one line that names it and lists the valid ones. Torch-free (``tests/test_cli_light.py``).
"""

from __future__ import annotations

import argparse
import tomllib

from parallelisms.errors import ConfigError, path_kind, require

SECTIONS = ("model", "layout", "training", "optimizer", "data", "outputs", "run")
# The argument groups of the shared flags (parallelisms.cli_args and the verbs' own) gathered into the file's sections
SECTION_OF_GROUP = {
    "model": "model",
    "layout (world size = pp x dp x cp x tp)": "layout", "tensor parallelism": "layout",
    "sharded data parallelism": "layout", "data-parallel balance": "layout", "expert-parallel balance": "layout",
    "activation memory": "layout", "context parallelism": "layout", "pipeline parallelism": "layout",
    "training": "training", "learning-rate schedule": "optimizer", "data": "data",
    "metrics and Hugging Face weights": "outputs",
}
OPTIMIZER = ("lr", "grad_clip", "weight_decay", "betas", "eps", "decay_all")  # flags of the training group
OUTPUTS = ("json", "trace", "predict")  # flags of the verbs' own options that write results
CONFIG_FILE, CONFIG_FLAG = "config_file", "--config-file"
NOT_IN_A_FILE = ("help", "version", CONFIG_FILE)


def _section(group_title: str, dest: str) -> str:
    if dest in OPTIMIZER:
        return "optimizer"
    if dest in OUTPUTS or group_title.startswith("checkpoints"):
        return "outputs"
    return SECTION_OF_GROUP.get(group_title, "run")


def sections(parser: argparse.ArgumentParser) -> dict[str, dict[str, argparse.Action]]:
    """section -> {key: the flag's action} of every option a verb's parser has."""
    found: dict[str, dict[str, argparse.Action]] = {}
    for group in parser._action_groups:
        for action in group._group_actions:
            if action.option_strings and action.dest not in NOT_IN_A_FILE:
                found.setdefault(_section(group.title, action.dest), {})[action.dest] = action
    return {name: found[name] for name in SECTIONS if name in found}


def option_flags(options: dict) -> list[str]:
    """Keyword options as the command line's flags: ``dp=2`` is ``--dp 2``, ``sp=True`` is ``--sp``, a
    tuple or list is comma-joined (``betas=(0.9, 0.95)`` is ``--betas 0.9,0.95``), None and False give none."""
    flags = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif isinstance(value, (tuple, list)):
            flags += [flag, ",".join(map(str, value))]
        elif value is not None and value is not False:
            flags += [flag, str(value)]
    return flags


def _read(path: str) -> dict:
    kind = path_kind(path)
    require(kind == "is a regular file", f"{CONFIG_FLAG} {path!r} {kind}; give a TOML file of the run")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{CONFIG_FLAG} {path!r} cannot be read: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{CONFIG_FLAG} {path!r} is not valid TOML: {exc}") from None


def file_options(path: str, parser: argparse.ArgumentParser) -> dict:
    """The options the TOML file at ``path`` holds for this verb's ``parser``, by Python name; ConfigError (one
    line) on a key or section the verb lacks, or a value a switch cannot take."""
    valid, verb = sections(parser), parser.prog
    options = {}
    for name, table in _read(path).items():
        require(isinstance(table, dict), lambda: f"{CONFIG_FLAG} {path!r}: {name} = {table!r} is outside a section; "
                                                 f"put it under its section, one of {', '.join(valid)}")
        require(name in valid,
                lambda: f"{CONFIG_FLAG} {path!r}: {verb} has no section [{name}]; valid sections: "
                        f"{', '.join(f'[{s}]' for s in valid)}")
        for key, value in table.items():
            require(key in valid[name], lambda: f"{CONFIG_FLAG} {path!r}: [{name}] has no key {key!r} for {verb}; "
                                                f"valid keys: {', '.join(valid[name])}")
            switch = valid[name][key].nargs == 0
            require(not switch or isinstance(value, bool),
                    lambda: f"{CONFIG_FLAG} {path!r}: [{name}] {key} is a switch; give true or false, got {value!r}")
            require(switch or not isinstance(value, (bool, dict)),
                    lambda: f"{CONFIG_FLAG} {path!r}: [{name}] {key} takes a value like its flag "
                            f"--{key.replace('_', '-')}, got {value!r}")
            options[key] = value
    return options


def file_flags(path: str, parser: argparse.ArgumentParser) -> list[str]:
    """The flags of the TOML file at ``path`` for this verb's ``parser`` (:func:`file_options` as flags)."""
    return option_flags(file_options(path, parser))


def expand(args: list[str], parser: argparse.ArgumentParser) -> tuple[list[str], list[str], str | None]:
    """The flags of each ``--config-file FILE`` in ``args`` (to be placed first: the command line's own flags
    override them), the rest of ``args``, and the last file's path (None when none was given)."""
    rest, files, i = [], [], 0
    while i < len(args):
        arg = args[i]
        if arg == CONFIG_FLAG:
            require(i + 1 < len(args), f"{CONFIG_FLAG} needs a TOML file of the run")
            files.append(args[i + 1])
            i += 2
            continue
        if arg.startswith(CONFIG_FLAG + "="):
            files.append(arg.partition("=")[2])
        else:
            rest.append(arg)
        i += 1
    flags = []
    for path in files:
        flags += file_flags(path, parser)
    return flags, rest, (files[-1] if files else None)
