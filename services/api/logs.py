"""Log lines as text (default) or one JSON object per line (``--log-format json``) for log shippers.

A record may carry ``extra={"fields": {...}}``: text appends them as ``key=value``, JSON merges them
into the object. The engine writes one such line per finished request.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

_TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


# Control characters (a newline in a client's request id) would let a client forge log lines.
# Unicode's own line breaks (NEL, LINE and PARAGRAPH SEPARATOR) too: str.splitlines() splits on them.
_ESCAPES = ({c: f"\\x{c:02x}" for c in [*range(32), 127, 0x85]} | {0x2028: "\\u2028", 0x2029: "\\u2029"}
            | {10: "\\n", 13: "\\r", 9: "\\t"})


def _field(value: object) -> str:
    """``key=value`` values as logfmt writes them: bare when plain, else quoted and escaped."""
    text = str(value)
    if text and text.isprintable() and not any(c in text for c in ' "='):
        return text
    return json.dumps(text, ensure_ascii=False).translate(_ESCAPES)


class TextFormatter(logging.Formatter):
    """One line per record (a traceback follows on its own lines): what a client sent is escaped."""

    def __init__(self) -> None:
        super().__init__(_TEXT)

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        line = super().formatMessage(record).translate(_ESCAPES)
        fields = getattr(record, "fields", None)
        if fields:
            line += " " + " ".join(f"{k}={_field(v)}" for k, v in fields.items())
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **getattr(record, "fields", {}),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(level: str, log_format: str) -> None:
    """Root logging to stdout in ``log_format`` ("text" or "json")."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
