"""`conveyor task`: what it refuses up front, each in one line with a non-zero exit and no
request made (the SDK's ValueErrors included), and a short --timeout that gives up waiting."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from conveyor.cli import task as task_cli
from tests.unit.test_client_following import PENDING, TASK_ID, Gateway, Handler, event


@pytest.fixture
def gateway(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gateway]:
    """A healthy gateway where the task stays PENDING: its stream sends it, then heartbeats."""

    def script(h: Handler) -> None:
        if h.path.endswith("/events"):
            h.stream([event(PENDING), 5.0, ": ping\n\n"])
        elif h.command == "POST":
            data = {"taskId": TASK_ID, "taskPosition": 1}
            h.envelope(201, {"status": "success", "data": data})
        else:
            h.envelope(200, {"status": "success", "data": PENDING})

    with cli_gateway(monkeypatch, script) as server:
        yield server


@contextmanager
def cli_gateway(
    monkeypatch: pytest.MonkeyPatch, script: Callable[[Handler], None]
) -> Iterator[Gateway]:
    """`script` served, and the CLI's environment pointed at it with credentials."""
    server = Gateway(script)
    monkeypatch.setenv("CONVEYOR_GATEWAY_URL", server.url)
    monkeypatch.setenv("CONVEYOR_CLIENT_ID", "u")
    monkeypatch.setenv("CONVEYOR_CLIENT_SECRET", "p")
    monkeypatch.delenv("CONVEYOR_SERVICE", raising=False)
    try:
        yield server
    finally:
        server.released.set()
        server.shutdown()
        server.server_close()


def run(*args: str) -> Any:
    return CliRunner().invoke(task_cli.app, list(args))


def refused(gateway: Gateway, *args: str, code: int = 2) -> str:
    """The error output of a refused command line; fails unless it exits `code` before any
    request, with a message and no traceback."""
    result = run(*args)
    assert result.exit_code == code, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    assert gateway.requests == []
    assert "Traceback" not in result.output
    return str(result.stderr)


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


WAITING = [
    ("submit", "sleeper", "--body", "{}", "--wait"),
    ("watch", "sleeper", TASK_ID),
]


# --- 1. --interval and --timeout ------------------------------------------------------------


@pytest.mark.parametrize("command", WAITING, ids=["submit", "watch"])
@pytest.mark.parametrize("value", ["-1", "-0.5", "nan", "inf", "abc"])
def test_an_interval_that_is_not_seconds_is_refused(
    gateway: Gateway, command: tuple[str, ...], value: str
) -> None:
    assert "--interval" in refused(gateway, *command, "--interval", value)


@pytest.mark.parametrize("command", WAITING, ids=["submit", "watch"])
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "-inf"])
def test_a_timeout_that_is_not_positive_seconds_is_refused(
    gateway: Gateway, command: tuple[str, ...], value: str
) -> None:
    assert "--timeout" in refused(gateway, *command, "--timeout", value)


# --- 2. NaN and Infinity ----------------------------------------------------------------


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity"])
def test_a_body_with_nan_or_infinity_is_refused_in_one_line(gateway: Gateway, number: str) -> None:
    stderr = refused(gateway, "submit", "sleeper", "--body", f'{{"sleep": {number}}}')
    assert "--body is not JSON: NaN/Infinity" in one_line(stderr)


def test_a_batch_file_with_nan_is_refused_in_one_line(gateway: Gateway, tmp_path: Path) -> None:
    batch = tmp_path / "batch.json"
    batch.write_text('[{"body": {"sleep": NaN}}]')
    stderr = refused(gateway, "submit", "sleeper", "--batch", str(batch))
    assert "--batch is not JSON: NaN/Infinity" in one_line(stderr)


# --- 3. --idempotency-key -------------------------------------------------------------


@pytest.mark.parametrize("key", ["ключ", "a\nb", "", " x", "k" * 201], ids=lambda k: repr(k[:8]))
@pytest.mark.parametrize("source", ["--body", "--batch"])
def test_an_idempotency_key_the_gateway_would_not_take_is_refused_in_one_line(
    gateway: Gateway, tmp_path: Path, key: str, source: str
) -> None:
    batch = tmp_path / "batch.json"
    batch.write_text('[{"body": {}}]')
    payload = "{}" if source == "--body" else str(batch)
    stderr = refused(gateway, "submit", "sleeper", source, payload, "--idempotency-key", key)
    assert "Idempotency-Key" in one_line(stderr)


# --- 4. --gateway -------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["http://[::1", "http://h:x", "http://h/\x00"])
def test_a_gateway_url_httpx_cannot_parse_is_refused_in_one_line(
    gateway: Gateway, url: str
) -> None:
    stderr = refused(gateway, "get", "sleeper", TASK_ID, "--gateway", url)
    assert "--gateway" in one_line(stderr)


# --- 5. a short --timeout against a healthy gateway ------------------------------------------


@pytest.mark.parametrize("timeout", ["1e-9", "0.001", "0.2"])
def test_watch_with_a_short_timeout_gives_up_waiting(gateway: Gateway, timeout: str) -> None:
    for _ in range(3):
        result = run("watch", "sleeper", TASK_ID, "--timeout", timeout, "--interval", "0.01")
        assert result.exit_code == 124, result.output  # not 1: the task did not fail
        assert f"gave up waiting: task {TASK_ID} is still PENDING" in result.stderr


# --- 6. options that do not apply to --batch -------------------------------------------------


@pytest.mark.parametrize(
    "option", [("--callback", "https://h.test/cb"), ("--wait",)], ids=["callback", "wait"]
)
def test_options_that_do_not_apply_to_a_batch_are_refused_in_one_line(
    gateway: Gateway, tmp_path: Path, option: tuple[str, ...]
) -> None:
    batch = tmp_path / "batch.json"
    batch.write_text('[{"body": {}}]')
    stderr = refused(gateway, "submit", "sleeper", "--batch", str(batch), *option)
    assert option[0] in one_line(stderr)


# --- 7. one path segment ----------------------------------------------------------------


@pytest.mark.parametrize("command", ["get", "cancel", "watch"])
@pytest.mark.parametrize("task_id", [f"{TASK_ID}/events", "/", "..", ".", "", "a\x1bb"], ids=repr)
def test_a_task_id_that_is_not_one_path_segment_is_refused_in_one_line(
    gateway: Gateway, command: str, task_id: str
) -> None:
    assert "task id" in one_line(refused(gateway, command, "sleeper", task_id))


@pytest.mark.parametrize("service", ["a/b", "..", ""], ids=repr)
def test_a_service_that_is_not_one_path_segment_is_refused_in_one_line(
    gateway: Gateway, service: str
) -> None:
    assert "service" in one_line(refused(gateway, "get", service, TASK_ID))
    assert "service" in one_line(refused(gateway, "submit", service, "--body", "{}"))


# --- --not-before ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["2030-01-01T10:00:00", "tomorrow", "2030-01-01T10:00:00+0000"])
def test_a_not_before_the_gateway_would_refuse_is_refused_in_one_line(
    gateway: Gateway, value: str
) -> None:
    args = ("submit", "sleeper", "--body", "{}", "--not-before", value)
    assert "--not-before" in one_line(refused(gateway, *args))


def test_a_leap_second_is_read_as_the_gateway_reads_it() -> None:
    """Found by a black-box test: the gateway took `23:59:60Z` once fixed, the CLI did not
    (datetime has no second 60). Both read it with conveyor/rfc3339.py: the next second."""
    assert task_cli.parse_time("2030-06-30T23:59:60Z") == datetime(2030, 7, 1, tzinfo=UTC)


# --- 8. a file that is not UTF-8, JSON nested too deep ---------------------------------------

NOT_UTF8 = b'{"sleep": "caf\xe9"}'  # Latin-1
DEEP = 60_000  # levels of a file: far past any recursion limit


def deep_object(levels: int) -> str:
    return '{"a": ' * levels + "1" + "}" * levels


@pytest.mark.parametrize("source", ["--body", "--batch"])
def test_a_file_that_is_not_utf8_is_refused_in_one_line(
    gateway: Gateway, tmp_path: Path, source: str
) -> None:
    """It was a traceback: UnicodeDecodeError escaped the reading of the file."""
    path = tmp_path / "latin1.json"
    path.write_bytes(NOT_UTF8)
    given = f"@{path}" if source == "--body" else str(path)
    line = one_line(refused(gateway, "submit", "sleeper", source, given))
    assert source in line and "not UTF-8" in line


def test_a_body_on_stdin_that_is_not_utf8_is_refused_in_one_line(gateway: Gateway) -> None:
    result = CliRunner().invoke(task_cli.app, ["submit", "sleeper", "--body", "-"], input=NOT_UTF8)
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    assert gateway.requests == []
    line = one_line(str(result.stderr))
    assert "--body" in line and "not UTF-8" in line


@pytest.mark.parametrize("source", ["--body", "--batch"])
def test_a_file_of_json_nested_too_deep_is_refused_in_one_line(
    gateway: Gateway, tmp_path: Path, source: str
) -> None:
    """It was a traceback: RecursionError escaped json.loads."""
    path = tmp_path / "deep.json"
    text = deep_object(DEEP)
    path.write_text(text if source == "--body" else f'[{{"body": {text}}}]')
    given = f"@{path}" if source == "--body" else str(path)
    line = one_line(refused(gateway, "submit", "sleeper", source, given))
    assert source in line and "nested too deep" in line


@pytest.mark.parametrize("levels", [3_000, DEEP])
def test_an_inline_body_nested_too_deep_is_refused_in_one_line(
    gateway: Gateway, levels: int
) -> None:
    line = one_line(refused(gateway, "submit", "sleeper", "--body", deep_object(levels)))
    assert "--body" in line and "nested too deep" in line
