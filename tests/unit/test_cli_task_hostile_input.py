"""`conveyor task` against input that once crashed it or blew it up.

1. Real `conveyor task submit` processes given a file that is not UTF-8 or JSON nested too deep:
   a one-line usage error, exit 2, before any request (the gateway's port has no listener),
   never a traceback.
2. A task's result as `watch` and `submit --wait` print it: the same JSON as `get` prints,
   highlighted only when small and on a terminal; a result of megabytes is written plainly
   (highlighting it took 30 s and 2 GB of memory for 6.5 MB)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from conveyor.cli import task as task_cli
from conveyor.client import Task
from tests.support.processes import REPO, free_port
from tests.unit.test_client_following import TASK_ID, Gateway, Handler, event
from tests.unit.test_task_cli_inputs import cli_gateway

ANSI = re.compile(r"\x1b\[[0-9;]*m")

# --- 1. input that is not UTF-8 or nested too deep, in a real process -------------------------


def submit(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "CONVEYOR_GATEWAY_URL": f"http://127.0.0.1:{free_port()}",
        "CONVEYOR_CLIENT_ID": "u",
        "CONVEYOR_CLIENT_SECRET": "p",
    }
    done = subprocess.run(
        [sys.executable, "-m", "conveyor", "task", "submit", "sleeper", *args],
        cwd=REPO,
        env=env,
        input=stdin,
        capture_output=True,
        timeout=60,
    )
    return subprocess.CompletedProcess(
        done.args, done.returncode, done.stdout.decode(errors="replace"), done.stderr.decode()
    )


def usage_error(done: subprocess.CompletedProcess[str]) -> str:
    """The one line of a usage error (exit 2), with nothing else printed."""
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stdout == "", done.stdout[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr[-3000:]
    return lines[0]


def deep(levels: int) -> str:
    return '{"a": ' * levels + "1" + "}" * levels


@pytest.mark.parametrize("source", ["@file", "--batch", "stdin"])
def test_input_that_is_not_utf8_is_a_usage_error(tmp_path: Path, source: str) -> None:
    latin1 = b'[{"body": {"sleep": "caf\xe9"}}]' if source == "--batch" else b'{"a": "caf\xe9"}'
    path = tmp_path / "latin1.json"
    path.write_bytes(latin1)
    if source == "@file":
        done = submit("--body", f"@{path}")
    elif source == "--batch":
        done = submit("--batch", str(path))
    else:
        done = submit("--body", "-", stdin=latin1)
    line = usage_error(done)
    option = "--batch" if source == "--batch" else "--body"
    assert option in line and "not UTF-8" in line


@pytest.mark.parametrize("source", ["@file", "--batch", "inline"])
def test_json_nested_too_deep_is_a_usage_error(tmp_path: Path, source: str) -> None:
    path = tmp_path / "deep.json"
    if source == "@file":
        path.write_text(deep(60_000))
        done = submit("--body", f"@{path}")
    elif source == "--batch":
        path.write_text(f'[{{"body": {deep(60_000)}}}]')
        done = submit("--batch", str(path))
    else:
        done = submit("--body", deep(3_000))
    line = usage_error(done)
    option = "--batch" if source == "--batch" else "--body"
    assert option in line and "nested too deep" in line


@pytest.mark.parametrize("source", ["inline", "--batch"])
def test_a_lone_surrogate_is_a_usage_error_saying_so(tmp_path: Path, source: str) -> None:
    """Found by a black-box sweep: `{"a": "\\ud800"}` is JSON Python reads, yet no Unicode
    text; the error was the codec's "'utf-8' codec can't encode character '\\ud800' in
    position 14: surrogates not allowed"."""
    if source == "--batch":
        path = tmp_path / "batch.json"
        path.write_text('[{"body": {"a": "\\ud800"}}]')
        done = submit("--batch", str(path))
    else:
        done = submit("--body", '{"a": "\\ud800"}')
    line = usage_error(done)
    assert source.replace("inline", "--body") in line and "lone surrogate" in line, line


# --- 2. a result of megabytes -----------------------------------------------------------------


def result(items: int) -> dict[str, Any]:
    """A task's response: `items` entries, control characters in the first (escaped when
    printed); about 120 bytes of printed JSON an entry."""
    entries = [
        {"i": n, "name": f"entry {n} " + "x" * 40, "ok": True, "v": None} for n in range(items)
    ]
    entries[0]["name"] = "red \x1b[31m C1 \x9b DEL \x7f tab \t"
    return {"items": entries, "note": "done"}


SMALL = result(3)
LARGE = result(20_000)  # about 2.4 MB printed


def succeeded(response: Any) -> Task:
    raw = {"taskId": TASK_ID, "status": "SUCCESS", "progress": 100.0, "response": response}
    return Task(TASK_ID, "SUCCESS", None, None, None, None, 100.0, response, None, raw)


def terminal() -> Console:
    return Console(file=io.StringIO(), force_terminal=True, width=80)


def test_the_large_result_is_big_enough() -> None:
    assert len(task_cli.json_text(LARGE)) > 2_000_000


def test_a_small_result_on_a_terminal_is_highlighted(monkeypatch: pytest.MonkeyPatch) -> None:
    console = terminal()
    monkeypatch.setattr(task_cli, "out", console)
    task_cli.print_outcome(succeeded(SMALL))
    printed = console.file.getvalue()  # type: ignore[attr-defined]
    body = printed.split("\n", 1)[1]
    assert ANSI.search(body)
    assert ANSI.sub("", printed) == f"SUCCESS\n{task_cli.json_text(SMALL)}\n"
    assert "\\u001b[31m" in body and "\x1b[31m C1" not in body and "\\u009b" in body


def test_a_large_result_on_a_terminal_is_written_plainly(monkeypatch: pytest.MonkeyPatch) -> None:
    console = terminal()
    monkeypatch.setattr(task_cli, "out", console)
    task_cli.print_outcome(succeeded(LARGE))
    head, body = console.file.getvalue().split("\n", 1)  # type: ignore[attr-defined]
    assert ANSI.sub("", head) == "SUCCESS"
    assert body == f"{task_cli.json_text(LARGE)}\n"  # no escape sequence at all
    assert json.loads(body) == LARGE


@pytest.mark.parametrize("response", [SMALL, LARGE], ids=["small", "large"])
def test_get_and_watch_print_a_result_alike(response: Any) -> None:
    """Off a terminal both write the JSON as it is: the same text for the same data."""
    console = Console(file=io.StringIO(), force_terminal=False, width=80)
    task_cli.print_json(response, console)
    assert console.file.getvalue() == f"{task_cli.json_text(response)}\n"  # type: ignore[attr-defined]


@pytest.fixture
def finished(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gateway]:
    """A gateway where the task has succeeded with LARGE; stdout a (forced) terminal."""
    done = {"taskId": TASK_ID, "status": "SUCCESS", "progress": 100.0, "response": LARGE}

    def script(h: Handler) -> None:
        if h.path.endswith("/events"):
            h.stream([event(done)])
        elif h.command == "POST":
            h.envelope(201, {"status": "success", "data": {"taskId": TASK_ID, "taskPosition": 1}})
        else:
            h.envelope(200, {"status": "success", "data": done})

    monkeypatch.setattr(task_cli, "out", Console(force_terminal=True))  # stdout: CliRunner's
    with cli_gateway(monkeypatch, script) as server:
        yield server


@pytest.mark.parametrize(
    "command",
    [("watch", "sleeper", TASK_ID), ("submit", "sleeper", "--body", "{}", "--wait")],
    ids=["watch", "submit --wait"],
)
def test_watch_and_wait_write_a_large_result_plainly(
    finished: Gateway, command: tuple[str, ...]
) -> None:
    outcome = CliRunner().invoke(task_cli.app, list(command))
    assert outcome.exit_code == 0, outcome.output[-3000:]
    printed = outcome.stdout.split("SUCCESS", 1)[1].split("\n", 1)[1]
    assert printed == f"{task_cli.json_text(LARGE)}\n"
