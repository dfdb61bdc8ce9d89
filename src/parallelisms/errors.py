"""The bottom layer: the error every bad input raises before any process starts."""

from __future__ import annotations

import math


class ConfigError(ValueError):
    """A bad input, reported as one line before any process starts: the constraint that failed, the values,
    and what would work."""


class LaunchError(RuntimeError):
    """A rank failed (raised by :mod:`parallelisms.launch`); the message names it and its error, ``details`` holds
    its traceback. Defined here so that the command line catches it without importing the launcher (torch)."""

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details


def require(condition: bool, message) -> None:
    """Raise :class:`ConfigError` with ``message`` unless ``condition`` holds; a message that costs something to
    build (suggestions) is passed as a function and built only on failure."""
    if not condition:
        raise ConfigError(message() if callable(message) else message)


def divisors(n: int, up_to: int = 1024) -> list[int]:
    """The divisors of ``n`` up to ``up_to``, ascending: suggestions for error messages, in time independent
    of ``n``."""
    return [d for d in range(1, min(n, up_to) + 1) if n % d == 0]


def require_finite(name: str, value, above: float | None = None, at_least: float | None = None) -> None:
    """One line unless ``value`` is a finite number above ``above`` (or at least ``at_least``)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    bound = ""
    if above is not None:
        ok, bound = ok and value > above, f" above {above:g}"
    if at_least is not None:
        ok, bound = ok and value >= at_least, f" of at least {at_least:g}"
    require(ok, f"{name} must be a finite number{bound}, got {value!r}")


class StorageError(RuntimeError):
    """A file the run writes or reads failed it (a checkpoint, a result): one line naming the path and the
    operating system's error."""


def path_kind(path) -> str:
    """What ``path`` is when it is not a readable regular file, for a one-line message: "does not exist", "is a
    symbolic link loop", "is a FIFO", "is a device", "is a socket", "is a directory"."""
    import os
    import stat

    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "is a dangling symbolic link" if os.path.islink(path) else "does not exist"
    except OSError as exc:
        return "is a symbolic link loop" if exc.errno == 40 else f"cannot be read ({exc.strerror})"
    kinds = ((stat.S_ISDIR, "is a directory"), (stat.S_ISFIFO, "is a FIFO (named pipe)"),
             (stat.S_ISCHR, "is a character device"), (stat.S_ISBLK, "is a block device"),
             (stat.S_ISSOCK, "is a socket"))
    return next((text for test, text in kinds if test(mode)), "is a regular file")
