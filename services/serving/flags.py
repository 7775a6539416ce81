"""Settings from command-line flags over environment variables over defaults, for any settings
dataclass: the worker's (``services/api/config.py``) and the router's (``services/route/config.py``)
follow the same rules, each under its own variable prefix.

Precedence: a flag given on the command line, else the environment variable
``<env_prefix><FIELD>`` (upper-case field name), else the field's default.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import fields
from pathlib import Path
from typing import ClassVar, NoReturn, Self, TypeVar, get_type_hints


class FlagSettings:
    """Base of a settings dataclass whose fields are flags and ``env_prefix`` variables.

    A subclass names its ``env_prefix``. A field's metadata holds its ``help``, and optionally
    ``min`` / ``max`` (checked by ``problems``), ``choices`` and flag ``aliases``."""

    __slots__ = ()
    env_prefix: ClassVar[str]

    def problems(self) -> list[str]:
        """Settings outside their allowed range, each as a message naming the flag and variable
        (empty: all fine). NaN and infinities are out of every range."""
        found = []
        for f in fields(self):
            low, high = f.metadata.get("min"), f.metadata.get("max", math.inf)
            value = getattr(self, f.name)
            if low is not None and not (math.isfinite(value) and low <= value <= high):
                bound = f"at least {low}" if high == math.inf else f"between {low} and {high}"
                found.append(f"--{f.name.replace('_', '-')} (env {self.env_prefix}{f.name.upper()}) must be a finite "
                             f"number {bound}, got {value}")
        return found

    def apply_env(self, environ: dict[str, str] | None = None) -> Self:
        """Overrides fields from ``env_prefix`` variables; returns self."""
        environ = os.environ if environ is None else environ
        hints = get_type_hints(type(self))
        for f in fields(self):
            name = self.env_prefix + f.name.upper()
            raw = environ.get(name)
            if raw is None:
                continue
            value = _parse(hints[f.name], raw, name)
            if "choices" in f.metadata and value not in f.metadata["choices"]:
                _refuse(f"{name}: {raw!r} is not one of {f.metadata['choices']}")
            setattr(self, f.name, value)
        return self


_TRUE, _FALSE = frozenset({"1", "true", "yes", "on"}), frozenset({"0", "false", "no", "off"})


def _bool(raw: str) -> bool:
    """A yes/no setting as written in an environment variable or a flag (true/false, 1/0, yes/no, on/off)."""
    word = raw.strip().lower()
    if word not in _TRUE | _FALSE:
        # argparse prints an ArgumentTypeError's own words ("--reflection: 'maybe' is not ...").
        raise argparse.ArgumentTypeError(f"{raw!r} is not true or false")
    return word in _TRUE


def _converter(kind: type):
    return Path if kind == (Path | None) else _bool if kind is bool else kind


def _refuse(message: str) -> NoReturn:
    """Stops the command on a setting it cannot use: one line, exit 2 (as argparse does for a flag)."""
    print(message, file=sys.stderr)
    raise SystemExit(2)


def _parse(kind: type, raw: str, origin: str):
    target = _converter(kind)
    try:
        return target(raw)
    except (ValueError, argparse.ArgumentTypeError):
        what = "true or false" if target is _bool else target.__name__
        _refuse(f"{origin}: cannot read {raw!r} as {what}")


def add_settings_flags(parser: argparse.ArgumentParser, kind: type[FlagSettings]) -> None:
    """Adds one ``--field-name`` flag per field of ``kind`` (default None: fall through to env)."""
    hints = get_type_hints(kind)
    for f in fields(kind):
        flag_type = hints[f.name]
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            *f.metadata.get("aliases", ()),
            dest=f.name,
            type=_converter(flag_type),
            choices=f.metadata.get("choices"),
            default=None,
            # A yes/no flag given bare means yes (`--cache-required`), and still takes a value (`--reflection false`).
            **({"nargs": "?", "const": True} if flag_type is bool else {}),
            help=f"{f.metadata['help']} (env {kind.env_prefix}{f.name.upper()}, default {f.default})",
        )


S = TypeVar("S", bound=FlagSettings)


def settings_from(args: argparse.Namespace, kind: type[S], environ: dict[str, str] | None = None) -> S:
    """A ``kind`` from its defaults, overridden by the environment, overridden by the flags given."""
    settings = kind().apply_env(environ)
    for f in fields(kind):
        value = getattr(args, f.name, None)
        if value is not None:
            setattr(settings, f.name, value)
    return settings
