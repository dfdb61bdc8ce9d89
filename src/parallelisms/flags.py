"""Command-line values in and out: bounded flag parsers every verb shares, output paths checked before the
work that fills them, and JSON that strict parsers accept.

A parser raises ``argparse.ArgumentTypeError`` with the range that works and the value given; argparse
prefixes the flag (``argument --lr: ...``) and the CLI prints the whole as one line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from parallelisms.errors import require


def shown(text: str, parsed: bool, limit: int = 40) -> str:
    """``text`` as given, cut to ``limit`` characters (a value echoed in a message stays short); quoted unless
    it ``parsed`` as a number."""
    cut = text if len(text) <= limit else text[:limit - 3] + "..."
    return cut if parsed else repr(cut)


def integer(low: int, high: int):
    """A flag parser for integers in [low, high]."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be an integer from {low} to {high:,}, got "
                                             f"{shown(text, value is not None)}")
        return value
    return parse


DEGREE = integer(1, 2**16)  # a parallel degree (--dp, --tp, --pp, ..., bench --world)


def integer_list(low: int, high: int):
    """A flag parser for comma-separated integers, each in [low, high] (``1024,2048``)."""
    one = integer(low, high)

    def parse(text: str) -> list[int]:
        parts = text.split(",")
        if not all(p.strip() for p in parts):
            raise argparse.ArgumentTypeError(f"must be comma-separated integers from {low} to {high:,}, got "
                                             f"{shown(text, False)}")
        return [one(p.strip()) for p in parts]
    return parse


def slow_rank(text: str) -> tuple[int, float]:
    """``--slow-rank R:F``: rank R (an integer from 0) and its slowdown factor F (a finite number above 1, at
    most 100)."""
    rank, _, factor = text.partition(":")
    try:
        parsed = (int(rank), float(factor))
    except ValueError:
        parsed = None
    if parsed is None or parsed[0] < 0 or not (math.isfinite(parsed[1]) and 1 < parsed[1] <= 100):
        raise argparse.ArgumentTypeError(f"must be RANK:FACTOR, a rank from 0 and a factor above 1 and at most 100 "
                                         f"(e.g. 1:1.5), got {shown(text, False)}")
    return parsed


def _num(x: float) -> str:
    return f"{int(x):,}" if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def number(low: float, high: float = math.inf, above: bool = False):
    """A flag parser for finite numbers in [low, high] (``above``: in (low, high])."""
    if high == math.inf:
        wanted = f"{'above' if above else 'at least'} {_num(low)}"
    else:
        wanted = f"in {'(' if above else '['}{_num(low)}, {_num(high)}]"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and (value > low if above else value >= low) and value <= high):
            raise argparse.ArgumentTypeError(f"must be a finite number {wanted}, got {shown(text, value == value)}")
        return value
    return parse


def number_pair(low: float, high: float):
    """A flag parser for two comma-separated numbers in [low, high) (AdamW's betas: ``0.9,0.95``)."""
    def parse(text: str) -> tuple[float, float]:
        parts = text.split(",")
        try:
            values = tuple(float(x) for x in parts)
        except ValueError:
            values = ()
        if len(values) != 2 or not all(low <= v < high for v in values):
            raise argparse.ArgumentTypeError(f"must be two numbers in [{_num(low)}, {_num(high)}) separated by a "
                                             f"comma, e.g. 0.9,0.95; got {shown(text, False)}")
        return values
    return parse


def check_writable(flag: str, path: str) -> None:
    """One line unless a file can be written at ``path`` (checked before the work whose result it holds)."""
    target = Path(path)
    parent = target.parent
    require(not target.is_dir(), f"{flag} {path!r} is a directory; name a file in it")
    require(parent.is_dir(), f"{flag} {path!r}: directory {str(parent)!r} does not exist; create it or choose another")
    require(os.access(target if target.exists() else parent, os.W_OK), f"{flag} {path!r} is not writable here; "
                                                                       f"choose a path you can write")


def check_installed(flag: str, module: str, extra: str | None = None) -> None:
    """One line unless the optional ``module`` that ``flag`` needs can be imported, naming the package extra
    that installs it."""
    package = f"'parallelisms[{extra}]'" if extra else module
    require(importlib.util.find_spec(module) is not None, f"{flag} needs {module}, which is not installed; "
                                                          f"pip install {package}, or drop {flag}")


def json_line(result: dict) -> str:
    """``result`` as one JSON object strict parsers accept: each non-finite number becomes null and its key
    is listed under ``nonfinite_fields``."""
    nulled = []

    def clean(value, key):
        if isinstance(value, float) and not math.isfinite(value):
            nulled.append(key)
            return None
        if isinstance(value, dict):
            return {k: clean(v, f"{key}.{k}" if key else str(k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v, f"{key}[{i}]") for i, v in enumerate(value)]
        return value
    out = clean(result, "")
    if nulled:
        out["nonfinite_fields"] = nulled
    return json.dumps(out, allow_nan=False)


class FlagName:
    """A config field's flag name (``flag``, default ``--the-field-name``) and its argparse ``dest``."""
    field: str
    flag: str

    @property
    def name(self) -> str:
        return self.flag or "--" + self.field.replace("_", "-")

    @property
    def dest(self) -> str:
        return self.name[2:].replace("-", "_")


@dataclass(frozen=True)
class Flag(FlagName):
    """A config dataclass's field as a command-line flag (``TrainConfig``'s and ``ModelConfig``'s tables in
    :mod:`parallelisms.config`): its name (default ``--the-field-name``), help, parser, metavar and choices;
    ``unset``: the flag's default is None, so whether it was given is known (a shape flag over a preset);
    ``alone``: the value of the flag given without one (its value is then optional: ``--predict``);
    ``required``: the flag must be given (its field has no default: ``plan --gpus``)."""
    field: str
    help: str
    flag: str = ""
    parse: Callable | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    unset: bool = False
    alone: str | None = None
    required: bool = False


def add_flags(group, flags: tuple[Flag, ...], config: type, defaults: dict | None = None) -> None:
    """Each flag's argument: a switch for a bool field, else its parser and default (the verb's in
    ``defaults``, else None where ``unset`` or ``required``, else ``config``'s field's), its value optional where
    ``alone``."""
    fields = config.__dataclass_fields__
    for flag in flags:
        default = (defaults or {}).get(flag.field, None if flag.unset or flag.required else fields[flag.field].default)
        optional = {} if flag.alone is None else {"nargs": "?", "const": flag.alone}
        if isinstance(default, bool):
            group.add_argument(flag.name, action="store_true", help=flag.help)
        else:
            group.add_argument(flag.name, type=flag.parse, default=default, help=flag.help, metavar=flag.metavar,
                               choices=flag.choices, required=flag.required, **optional)


def settings(args) -> Mapping:
    """A verb's option values by Python name: the command line's parsed ``args`` (a Namespace), or the mapping
    the Python API builds from its keywords (:mod:`parallelisms.api_options`)."""
    return args if isinstance(args, Mapping) else vars(args)


def given_fields(flags: tuple[Flag, ...], args) -> dict:
    """The config fields of the flags ``args`` (:func:`settings`) holds, by field name (None: not given, the
    config's default)."""
    given = settings(args)
    values = {flag.field: given.get(flag.dest) for flag in flags}
    return {name: value for name, value in values.items() if value is not None}
