"""Errors caused by user input; the CLI prints them without a traceback and exits 2."""

from __future__ import annotations


class UserError(Exception):
    """An error caused by the user's input (bad file, field or value)."""


class ConfigError(UserError):
    """A configuration file is wrong: names the file, the field (entry) and the problem.

    >>> str(ConfigError("rig.toml", "sensor[2].rate_hz", "must be > 0, got -5"))
    'rig.toml: sensor[2].rate_hz: must be > 0, got -5'
    """

    def __init__(self, file: str, field: str, problem: str) -> None:
        self.file = str(file)
        self.field = field
        self.problem = problem
        super().__init__(f"{self.file}: {field}: {problem}" if field else f"{self.file}: {problem}")
