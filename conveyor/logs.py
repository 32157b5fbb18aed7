"""Logging set-up shared by every process: JSON in production, readable on a TTY.

Message bodies and secrets are never passed to a logger; records carry ids only.
"""

from __future__ import annotations

import enum
import json
import logging
import sys
from datetime import UTC, datetime


class LogFormat(enum.StrEnum):
    AUTO = "auto"  # readable on a terminal, JSON otherwise
    JSON = "json"
    TEXT = "text"


# Standard record attributes, and uvicorn's ANSI duplicate of its message.
_RESERVED = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "color_message"}


class JsonFormatter(logging.Formatter):
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


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-5s %(name)s: %(message)s", "%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        extra = {k: v for k, v in record.__dict__.items() if k not in _RESERVED}
        line = super().format(record)
        if extra:
            line += " " + " ".join(f"{k}={v}" for k, v in extra.items())
        return line


def configure(level: str = "INFO", fmt: LogFormat = LogFormat.AUTO) -> None:
    if fmt is LogFormat.AUTO:
        fmt = LogFormat.TEXT if sys.stdout.isatty() else LogFormat.JSON
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(JsonFormatter() if fmt is LogFormat.JSON else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Library chatter (connection retries are reported by our own code).
    for noisy in ("aiormq", "aio_pika", "httpx", "httpcore", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
