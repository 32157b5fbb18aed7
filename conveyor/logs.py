"""Logging set-up shared by every process: JSON in production, readable on a TTY.

Message bodies and secrets are never passed to a logger; records carry ids only. A database
error is the exception: PostgreSQL's DETAIL and CONTEXT quote the row or the value it refused
("Failing row contains (…)", a task's body, its callback URL), so wherever an error is written
(a logged traceback, `describe`) a database error says its primary message only.
"""

from __future__ import annotations

import enum
import json
import logging
import re
import sys
import traceback
from datetime import UTC, datetime
from types import TracebackType
from typing import Any

ExcInfo = tuple[type[BaseException], BaseException, TracebackType | None]

# A value the server quotes in its primary message (`invalid input syntax for type uuid: "…"`)
# is cut; names it quotes (relations, constraints: at most 63 bytes) are kept.
_QUOTED_VALUE = re.compile(r'(invalid input (?:syntax|value) for [^:]*): .*|"[^"]{64,}"')


def _said_by_the_database(exc: BaseException) -> str | None:
    """A database error's primary message, without what it quotes; None for other errors.
    Duck-typed (psycopg's `diag`), so that the dispatcher, which has no driver, can use it."""
    diag = getattr(exc, "diag", None)
    primary = getattr(diag, "message_primary", None) if diag is not None else None
    if diag is None or not hasattr(exc, "sqlstate"):
        return None
    said = primary or str(exc).partition("\n")[0]
    return _QUOTED_VALUE.sub(lambda m: m.group(1) or '"…"', said)


def describe(exc: BaseException | None, limit: int = 300) -> str:
    """One line about an error that is safe to log or to serve: `repr` for most, the class and
    the primary message for a database error, each member of a group."""
    if exc is None:
        return "unknown"
    if isinstance(exc, BaseExceptionGroup):
        inner = ", ".join(describe(e, limit) for e in exc.exceptions)
        return f"{type(exc).__name__}({inner})"[:limit]
    said = _said_by_the_database(exc)
    if said is not None:
        return f"{type(exc).__name__}: {said}"[:limit]
    return repr(exc)[:limit]


def reason(exc: BaseException) -> str:
    """An error's text for a person (`str`, else its class), a database error's primary
    message only."""
    said = _said_by_the_database(exc)
    if said is not None:
        return f"{type(exc).__name__}: {said}"
    return str(exc) or type(exc).__name__


def _scrub(top: traceback.TracebackException, error: BaseException) -> None:
    """Replaces the text of each database error in a formatted chain by its primary message.
    Walks the formatted nodes beside the exceptions they stand for: one exception may stand
    at several nodes (a group member that is also a cause), and each node is written."""
    pending: list[tuple[traceback.TracebackException, BaseException | None]] = [(top, error)]
    seen: set[int] = set()
    while pending:
        te, exc = pending.pop()
        if exc is None or id(te) in seen:
            continue
        seen.add(id(te))
        said = _said_by_the_database(exc)
        if said is not None:
            te._str = said  # type: ignore[attr-defined]  # what format() writes after the class
        if te.__cause__ is not None:
            pending.append((te.__cause__, exc.__cause__))
        if te.__context__ is not None:
            pending.append((te.__context__, exc.__context__))
        members = getattr(exc, "exceptions", ())
        pending.extend(zip(te.exceptions or (), members, strict=False))


def format_exception(exc_info: ExcInfo | tuple[None, None, None]) -> str:
    _, exc, tb = exc_info
    if exc is None:
        return ""
    te = traceback.TracebackException(type(exc), exc, tb, compact=True)
    _scrub(te, exc)
    return "".join(te.format()).rstrip("\n")


class _Scrubbing(logging.Formatter):
    def formatException(self, ei: Any) -> str:
        return format_exception(ei)


class LogLevel(enum.StrEnum):
    """LOG_LEVEL, in any case and with blanks around it (`WARN`, `FATAL` as logging spells them too):
    anything else is refused at start, where logging raised its own traceback."""

    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"
    CRITICAL = "CRITICAL"

    @classmethod
    def _missing_(cls, value: object) -> LogLevel | None:
        if not isinstance(value, str):
            return None
        name = value.strip().upper()
        name = {"WARN": "WARNING", "FATAL": "CRITICAL"}.get(name, name)  # logging's aliases
        return next((m for m in cls if m.value == name), None)


class LogFormat(enum.StrEnum):
    AUTO = "auto"  # readable on a terminal, JSON otherwise
    JSON = "json"
    TEXT = "text"


# Standard record attributes, and uvicorn's ANSI duplicate of its message.
_RESERVED = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "color_message"}


class JsonFormatter(_Scrubbing):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update({k: v for k, v in record.__dict__.items() if k not in _RESERVED})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(_Scrubbing):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-5s %(name)s: %(message)s", "%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        extra = {k: v for k, v in record.__dict__.items() if k not in _RESERVED}
        line = super().format(record)
        if extra:
            line += " " + " ".join(f"{k}={v}" for k, v in extra.items())
        return line


def configure(level: LogLevel = LogLevel.INFO, fmt: LogFormat = LogFormat.AUTO) -> None:
    if fmt is LogFormat.AUTO:
        fmt = LogFormat.TEXT if sys.stdout.isatty() else LogFormat.JSON
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(JsonFormatter() if fmt is LogFormat.JSON else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.value)
    # Library chatter (connection retries are reported by our own code; alembic names each
    # of its plugins as it loads them, in every process that checks the schema); and what
    # would carry a task's data at DEBUG: sse_starlette logs each event-stream chunk it sends.
    noisy_loggers = (
        "aiormq",
        "aio_pika",
        "httpx",
        "httpcore",
        "uvicorn.access",
        "alembic.runtime.plugins",
        "sse_starlette",
    )
    for noisy in noisy_loggers:
        logging.getLogger(noisy).setLevel(logging.WARNING)
