"""Log lines as text (default) or one JSON object per line (``--log-format json``) for log shippers.

A record may carry ``extra={"fields": {...}}``: text appends them as ``key=value``, JSON merges them
into the object. The engine writes one such line per finished request.
"""

from __future__ import annotations

import json
import logging
import sys
import time
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


class UndecodableMetadataFilter(logging.Filter):
    """grpcio logs every request metadata value that is not UTF-8 in full, at ERROR with a
    traceback, before any of our code runs: an ``authorization`` value with one stray byte would
    put the API key in the log, and any client could flood it. Such records become one warning per
    ``interval_s`` (with a count of the others) that does not show the value."""

    PREFIX = "Invalid encoding on"

    def __init__(self, interval_s: float = 10.0, clock=time.monotonic) -> None:
        super().__init__()
        self._interval_s, self._clock = interval_s, clock
        self._last, self._held = -float("inf"), 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(self.PREFIX):
            return True
        now = self._clock()
        if now - self._last < self._interval_s:
            self._held += 1
            return False
        held, self._held, self._last = self._held, 0, now
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.msg = "a call carried request metadata that is not valid UTF-8 (the value is not logged: it may hold a key)"
        if held:
            record.msg += f" (and {held} more like it in the last {self._interval_s:g} s)"
        record.args, record.exc_info, record.exc_text = (), None, None
        return True


GRPC_CORE_LOGGER = "grpc._cython.cygrpc"


def configure_logging(level: str, log_format: str) -> None:
    """Root logging to stdout in ``log_format`` ("text" or "json"); grpcio's records of undecodable
    metadata are redacted and rate-limited."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    grpc_core = logging.getLogger(GRPC_CORE_LOGGER)
    grpc_core.filters[:] = [f for f in grpc_core.filters if not isinstance(f, UndecodableMetadataFilter)]
    grpc_core.addFilter(UndecodableMetadataFilter())
