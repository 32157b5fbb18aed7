"""At LOG_LEVEL=DEBUG the libraries that would log what a task carries stay quiet: records
carry ids only, whatever the level (conveyor.logs)."""

from __future__ import annotations

import io
import logging
import sys

import pytest

from conveyor import logs


@pytest.mark.parametrize("library", ["sse_starlette.sse", "httpx", "aiormq.connection"])
def test_debug_logs_no_chunk_a_library_sends(monkeypatch: pytest.MonkeyPatch, library: str) -> None:
    """Found by a black-box sweep: at DEBUG, sse_starlette logged every event-stream chunk it
    sent ("chunk: b'id: …data: {…\\"response\\": …"), a task's response and error message."""
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    try:
        logs.configure(logs.LogLevel.DEBUG, logs.LogFormat.JSON)
        logging.getLogger(library).debug("chunk: %s", b"data: RESPONSE-MARKER")
        logging.getLogger("conveyor.test").debug("our own debug record")
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
    assert "our own debug record" in out.getvalue()  # DEBUG is on
    assert "RESPONSE-MARKER" not in out.getvalue()
