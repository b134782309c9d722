"""What every kvbridge settings object shares (the server's ``ServerConfig``, the connectors'
``ConnectorConfig``): the error a bad setting raises, the kinds of setting with one set of
bounds, and reading a secret from a file.

A kind does two things. ``check`` takes a value already of the field's type (a dataclass
field set in code) and refuses one of another type or out of bounds. ``parse`` takes a
value from a source and returns it as the field's type: a size may be written ``"4GiB"``
anywhere; a number, a flag or a list is taken from text only where every value is text
(``text=True``: the environment), and must be a number, a boolean or a list where the
source has those (TOML, JSON). Every refusal is a :class:`ConfigError` that starts with the
setting's name and ends with the value given."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._sizes import parse_size

__all__ = [
    "MAX_SECONDS",
    "ConfigError",
    "Flag",
    "Names",
    "Seconds",
    "Size",
    "Text",
    "Whole",
    "parse_settings",
    "read_secret",
]

MAX_SECONDS = 24 * 3600.0
"""The longest wait or lease any setting may ask for: a lease outlives a client that died,
holding its slots that long, and a timeout longer than a day is a typo (it also overflows
the socket layer's millisecond timers); ``inf`` is a leak, not a setting."""

_TRUE = ("1", "true", "yes")
_FALSE = ("0", "false", "no")


class ConfigError(ValueError):
    """A setting is unknown, malformed or unsafe; the message names where it came from.
    ``setting`` is the field's name where one field is to blame."""

    def __init__(self, message: str, *, setting: str | None = None) -> None:
        super().__init__(message)
        self.setting = setting


def _refuse(name: str, wanted: str, value: object) -> ConfigError:
    return ConfigError(f"{name} must be {wanted}, got {value!r}", setting=name)


@dataclass(frozen=True)
class Whole:
    """A whole number from ``low`` to ``high`` (no upper bound when ``None``)."""

    low: int = 0
    high: int | None = None

    def check(self, name: str, value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _refuse(name, "a whole number", value)
        if value < self.low or (self.high is not None and value > self.high):
            raise _refuse(name, self._bounds(), value)
        return value

    def parse(self, name: str, value: object, *, text: bool) -> int:
        if text and isinstance(value, str):
            try:
                value = int(value.strip())
            except ValueError:
                raise _refuse(name, "a whole number", value) from None
        return self.check(name, value)

    def _bounds(self) -> str:
        if self.high is None:
            return f"at least {self.low}"
        return f"{self.low}..{self.high}"


@dataclass(frozen=True)
class Size(Whole):
    """Bytes: a whole number, or text such as ``"4GiB"`` from any source."""

    def parse(self, name: str, value: object, *, text: bool) -> int:
        if isinstance(value, str):
            try:
                value = parse_size(value)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"{name} must be a size in bytes ({exc})", setting=name) from None
        return self.check(name, value)


@dataclass(frozen=True)
class Seconds:
    """Seconds, finite, up to :data:`MAX_SECONDS`; 0 only where it means "off"."""

    zero_ok: bool = False

    def check(self, name: str, value: object) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _refuse(name, "a number of seconds", value)
        low_ok = value >= 0 if self.zero_ok else value > 0
        if not (math.isfinite(value) and low_ok and value <= MAX_SECONDS):
            low = "0 (off) or a positive" if self.zero_ok else "a positive"
            raise _refuse(name, f"{low} number of seconds up to {MAX_SECONDS:.0f}", value)
        return float(value)

    def parse(self, name: str, value: object, *, text: bool) -> float:
        if text and isinstance(value, str):
            try:
                value = float(value.strip())
            except ValueError:
                raise _refuse(name, "a number of seconds", value) from None
        return self.check(name, value)


@dataclass(frozen=True)
class Flag:
    """True or false (as text: 1/0, true/false, yes/no)."""

    def check(self, name: str, value: object) -> bool:
        if not isinstance(value, bool):
            raise _refuse(name, "true or false", value)
        return value

    def parse(self, name: str, value: object, *, text: bool) -> bool:
        if text and isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        return self.check(name, value)


@dataclass(frozen=True)
class Text:
    """A string; empty only where ``empty_ok``."""

    empty_ok: bool = False

    def check(self, name: str, value: object) -> str:
        if not isinstance(value, str) or not (value or self.empty_ok):
            raise _refuse(name, "a string" if self.empty_ok else "a non-empty string", value)
        return value

    def parse(self, name: str, value: object, *, text: bool) -> str:
        return self.check(name, value)


@dataclass(frozen=True)
class Names:
    """A non-empty list of strings (as text: comma-separated)."""

    def check(self, name: str, value: object) -> tuple[str, ...]:
        if (
            not isinstance(value, tuple | list)
            or not value
            or not all(isinstance(v, str) for v in value)
        ):
            raise _refuse(name, "a non-empty list of names", value)
        return tuple(value)

    def parse(self, name: str, value: object, *, text: bool) -> tuple[str, ...]:
        if text and isinstance(value, str):
            value = [v.strip() for v in value.split(",")]
        return self.check(name, value)


Kind = Whole | Seconds | Flag | Text | Names
"""One of the kinds above (``Size`` is a ``Whole``)."""


def parse_settings(
    kinds: dict[str, Kind], given: dict[str, Any], *, source: str, text: bool
) -> dict[str, Any]:
    """Each of ``given``'s known settings as its field's type (unknown names are the
    caller's to refuse: it knows what else may share the table). Raises
    :class:`ConfigError` that starts with ``source``."""
    parsed: dict[str, Any] = {}
    for name, value in given.items():
        try:
            parsed[name] = kinds[name].parse(name, value, text=text)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}", setting=name) from None
    return parsed


def read_secret(secret_file: str) -> bytes:
    try:
        secret = Path(secret_file).read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"secret_file {secret_file}: {exc.strerror or exc}") from None
    if not secret:
        raise ConfigError(f"secret_file {secret_file} is empty")
    return secret
