"""Text arguments of the command line that may be too long for one: ``-`` reads standard input,
``@FILE`` reads the file (UTF-8), anything else is the text itself.

Linux refuses a single argument over 128 KiB ("Argument list too long"), and a long system message
is easier kept in a file. Like the shell's ``"$(cat FILE)"``, the trailing line ends of what is read
are dropped, so ``@FILE`` and ``"$(cat FILE)"`` send the same text. A text that really starts with
``@`` goes through ``-`` (``printf '%s' '@home' | kvshare generate -``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import BinaryIO

STDIN = "-"
FROM_FILE = "@"


class PromptInputError(ValueError):
    """A ``-`` or ``@FILE`` argument cannot be read; the message names the argument and why."""


def read_text_arg(value: str, name: str, stdin: BinaryIO | None = None) -> str:
    """The text ``value`` stands for. ``name`` is how the user calls the argument (``PROMPT``,
    ``--system``), for the error message. ``stdin`` is what ``-`` reads (None: ``-`` is refused,
    for commands that read standard input themselves). Raises PromptInputError."""
    if value == STDIN:
        if stdin is None:
            raise PromptInputError(f"{name} cannot be - here (standard input is the conversation): give {name} @FILE")
        return _decoded(stdin.read(), f"{name} - (standard input)")
    if value.startswith(FROM_FILE):
        path = Path(value[len(FROM_FILE):])
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise PromptInputError(f"{name} {value}: cannot read {path}: {exc.strerror or exc}") from None
        return _decoded(data, f"{name} {value}")
    return value


def read_text_args(values: dict[str, str | None], stdin: BinaryIO | None = None) -> dict[str, str | None]:
    """``read_text_arg`` of each named value (None stays None); at most one may be ``-``, since
    standard input can be read once. ``stdin`` defaults to the process's."""
    from_stdin = [name for name, value in values.items() if value == STDIN]
    if len(from_stdin) > 1:
        raise PromptInputError(f"only one of {' and '.join(from_stdin)} can be - (standard input is read once)")
    source = stdin if stdin is not None else sys.stdin.buffer
    return {name: None if value is None else read_text_arg(value, name, source) for name, value in values.items()}


def _decoded(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as exc:
        raise PromptInputError(f"{what}: not UTF-8 text (byte {exc.start})") from None
