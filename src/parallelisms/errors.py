"""The bottom layer: the error every bad input raises before any process starts."""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad input, reported as one line before any process starts: the constraint that failed, the values,
    and what would work."""


def require(condition: bool, message: str) -> None:
    """Raise :class:`ConfigError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(message)
