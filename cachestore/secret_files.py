"""Files that hold secrets or their digests (signing keys, the namespace secret, API key digests):
read once at start; anything unusable is refused with a message naming the file and the line."""

from __future__ import annotations

from pathlib import Path

MIN_SECRET_CHARS = 32
"""A secret shorter than this is refused: ``openssl rand -hex 32`` gives 64 characters."""


class SecretFileError(ValueError):
    """A file that cannot be used; the message names it (and the line) and says how to fix it."""


def read_secret_file(path: Path, what: str) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise SecretFileError(f"{path}: cannot read the {what} ({exc})") from exc


def field_lines(path: Path, what: str) -> list[tuple[str, list[str]]]:
    """(``"PATH, line N"``, whitespace-split fields) of every line that is not blank or a ``#`` comment."""
    lines = []
    for number, line in enumerate(read_secret_file(path, what).splitlines(), 1):
        line = line.strip()
        if line and not line.startswith("#"):
            lines.append((f"{path}, line {number}", line.split()))
    return lines


def check_secret(secret: str, where: str, what: str) -> None:
    if len(secret) < MIN_SECRET_CHARS:
        raise SecretFileError(f"{where}: the {what} has {len(secret)} characters, at least {MIN_SECRET_CHARS} are "
                              "needed (e.g. openssl rand -hex 32)")


def load_secret(path: Path, what: str) -> bytes:
    """A single secret from ``path`` (surrounding whitespace dropped): one word of MIN_SECRET_CHARS or more."""
    secret = read_secret_file(path, what).strip()
    check_secret(secret, str(path), what)
    if len(secret.split()) != 1:
        # A file of several words is most likely another file (a key file's 'KEY_ID SECRET' lines).
        raise SecretFileError(f"{path}: the {what} must be one word without spaces or line breaks (e.g. the output "
                              "of openssl rand -hex 32); is this the signing key file?")
    return secret.encode()
