"""How a process logs: the standard library's logging, to stderr, as text lines or, with
`--log-format json`, one JSON object a line (ts, level, logger, message, and exc_info
when a traceback goes with it) for log pipelines (journald, Loki, Elasticsearch), which
then need no pattern to parse a line, nor guess where a traceback ends."""

from __future__ import annotations

import logging
import sys
import traceback
from datetime import UTC, datetime

import orjson

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonLines(logging.Formatter):
    """A record as one line of JSON: a traceback goes inside it (`exc_info`), not on the
    lines after it."""

    def format(self, record: logging.LogRecord) -> str:
        row = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(
                timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            row["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            row["stack_info"] = self.formatStack(record.stack_info)
        return orjson.dumps(row).decode()


_format = "text"  # the process's, once `configure` has run


def configure(level: str, fmt: str) -> None:
    """Log at `level` (debug, info ...: ValueError if it is none) in `fmt` (LOG_FORMATS)
    to stderr. In JSON, Python's warnings become records too, so that every line of
    stderr is one object."""
    global _format
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLines() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler])
    _format = fmt
    if fmt == "json":
        logging.captureWarnings(True)


def say(text: str, level: int = logging.INFO, exc: BaseException | None = None) -> None:
    """A line a command writes to stderr whatever the log level (a client command's
    summary, a failure's one line), with `exc`'s traceback before it: as it is, or, in
    JSON, one object as a log record of the `lightgate` logger would be."""
    if _format == "json":
        info = (type(exc), exc, exc.__traceback__) if exc is not None else None
        record = logging.LogRecord("lightgate", level, "", 0, text, None, info)
        print(JsonLines().format(record), file=sys.stderr, flush=True)
        return
    if exc is not None:
        traceback.print_exception(exc)
    print(text, file=sys.stderr, flush=True)
