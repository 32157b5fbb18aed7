"""Consumer CLI: `conveyor task submit|get|watch`, a thin shell over `conveyor.client`.

It is what a person uses to try a service by hand: submit a body, then watch the
task move PENDING -> IN_PROGRESS -> SUCCESS/FAILURE with a live progress bar.
Credentials and the gateway come from CONVEYOR_GATEWAY_URL, CONVEYOR_CLIENT_ID and
CONVEYOR_CLIENT_SECRET (or the matching options). Errors print the gateway's
error number and description and exit 1, never a traceback. `watch` and `submit --wait` exit
0 on SUCCESS, 1 on FAILURE, and GAVE_UP (124, as `timeout(1)` does) when `--timeout` passed
first: a script tells a task still running from one that failed. Text from the gateway is
printed without its control characters (an escape sequence would drive the terminal), and cut
at MAX_SHOWN characters; the gateway's URL without its userinfo (a password).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any, NoReturn

import httpx
import typer
from rich.console import Console
from rich.highlighter import JSONHighlighter
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn
from rich.text import Text

from conveyor import rfc3339
from conveyor.cli.input_files import read_text
from conveyor.client import (
    DEFAULT_GATEWAY_URL,
    ConveyorClient,
    ConveyorError,
    Task,
    TaskWaitTimeout,
)

app = typer.Typer(help="Submit and follow tasks through the gateway.", no_args_is_help=True)

out = Console()
err = Console(stderr=True)

GatewayOpt = Annotated[
    str, typer.Option("--gateway", envvar="CONVEYOR_GATEWAY_URL", help="Gateway base URL.")
]
ClientIdOpt = Annotated[str, typer.Option("--client-id", envvar="CONVEYOR_CLIENT_ID")]
SecretOpt = Annotated[
    str, typer.Option("--client-secret", envvar="CONVEYOR_CLIENT_SECRET", show_default=False)
]
ServiceOpt = Annotated[
    str | None,
    typer.Option(
        "--service",
        "-s",
        help="Service of the task, else CONVEYOR_SERVICE (when the task id comes alone).",
    ),
]
TargetArgs = Annotated[
    list[str], typer.Argument(metavar="[SERVICE] TASK_ID", help="The task, optionally its service.")
]


def _seconds(text: str, above_zero: bool) -> float:
    """A finite number of seconds, refused up front otherwise: a negative or NaN one would
    crash the wait at its first pause (the SDK refuses it too, but only once submitted)."""
    try:
        seconds = float(text)
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(seconds) or seconds < 0 or (above_zero and seconds == 0):
        raise typer.BadParameter(f"must be a finite number {'above' if above_zero else '>='} 0")
    return seconds


def parse_interval(text: str) -> float:
    return _seconds(text, above_zero=False)


def parse_timeout(text: str) -> float:
    """Above 0: a deadline already passed could only end in an error."""
    return _seconds(text, above_zero=True)


IntervalOpt = Annotated[
    float,
    typer.Option(
        "--interval", parser=parse_interval, metavar="SECONDS", help="Seconds between polls."
    ),
]
TimeoutOpt = Annotated[
    float | None,
    typer.Option(
        "--timeout",
        parser=parse_timeout,
        metavar="SECONDS",
        help="Give up after this many seconds (exit code 124).",
    ),
]


# The bytes of a command line its locale could not decode, each kept as a lone surrogate.
_UNDECODED = re.compile("[\udc80-\udcff]")
# C0 and C1 control characters and DEL, but newline and tab.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
# A URL's userinfo (`user:password@`), up to the authority's last '@'.
_USERINFO = re.compile(r"(?<=//)[^/?#]*@")
MAX_SHOWN = 2000  # characters of a gateway's description (or error details) printed
MAX_HIGHLIGHTED = 64 * 1024  # characters of JSON highlighted on a terminal; more is plain


def shown_url(url: str) -> str:
    """The gateway's URL as printed: without its userinfo, which may hold a password."""
    return clean(_USERINFO.sub("", url, count=1))


def excerpt(text: str) -> str:
    """Text from the gateway, cut at MAX_SHOWN characters (saying so): a terminal is no place
    for a description of megabytes."""
    if len(text) <= MAX_SHOWN:
        return text
    return f"{text[:MAX_SHOWN]}... (cut: {len(text)} characters in all)"


def clean(text: object) -> str:
    """Text from the gateway, without the control characters that would drive a terminal."""
    return _CONTROL.sub("", str(text))


def json_text(value: Any, indent: int | None = 2, ascii_only: bool = False) -> str:
    """JSON from the gateway's data for a terminal: the same JSON, every control character
    in it escaped (json.dumps leaves C1 characters and DEL as they are); `ascii_only`, every
    character past ASCII too."""
    text = json.dumps(value, indent=indent, ensure_ascii=ascii_only)
    return _CONTROL.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


@dataclass(frozen=True)
class Credentials:
    gateway: str
    client_id: str
    client_secret: str

    def client(self) -> ConveyorClient:
        if not self.client_id or not self.client_secret:
            fail(
                "set CONVEYOR_CLIENT_ID and CONVEYOR_CLIENT_SECRET (or --client-id/--client-secret)"
            )
        try:
            return ConveyorClient(self.gateway, self.client_id, self.client_secret)
        except ValueError as exc:
            fail(f"--gateway (CONVEYOR_GATEWAY_URL): {clean(exc)}", 2)


# The exit code of a wait that ended before its task did (`--timeout`).
GAVE_UP = 124


def fail(message: str, code: int = 1) -> NoReturn:
    err.print(Text.assemble(("error:", "red"), " ", message), highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@contextmanager
def reported_errors(gateway: str) -> Iterator[None]:
    """Turns client errors into a one-line message and exit code 1; what the SDK refused
    before any request (ValueError: a task id that is not one path segment, an
    Idempotency-Key it cannot send, a body with NaN) is a usage error, exit code 2."""
    try:
        yield
    except ValueError as exc:
        fail(clean(exc), 2)
    except ConveyorError as exc:
        detail = "".join(
            f"\n  {clean(e.get('path', ''))}: {clean(e.get('message', e))}" for e in exc.errors
        )
        number = f"{exc.number} " if exc.number else ""
        retry = "" if exc.retry_after is None else f", retry after {exc.retry_after:g} s"
        description = excerpt(clean(exc.description))
        fail(f"{number}{description} (HTTP {exc.http_status}{retry}){excerpt(detail)}")
    except httpx.TransportError as exc:
        at = shown_url(gateway)
        fail(f"cannot reach the gateway at {at}: {clean(exc or type(exc).__name__)}")
    except httpx.HTTPError as exc:  # an answer httpx cannot read (too many redirects...)
        fail(f"unreadable answer from the gateway at {shown_url(gateway)}: {clean(exc)}")
    except TaskWaitTimeout as exc:
        task = exc.task
        fail(f"gave up waiting: task {clean(task.task_id)} is still {clean(task.status)}", GAVE_UP)
    except KeyboardInterrupt:
        err.print("interrupted")
        raise typer.Exit(130) from None


def _read_json(text: str, option: str) -> Any:
    """JSON given inline, as `@file.json`, or `-` for stdin; UTF-8 (as JSON is, RFC 8259).
    Input that is not UTF-8, is nested too deep for Python's json or escapes a lone surrogate
    is a one-line usage error, as NaN is, not a traceback."""
    try:
        if text == "-" or text.startswith("@"):
            text = read_text(text.removeprefix("@"))
        elif _UNDECODED.search(text):  # a locale not UTF-8 (LC_ALL=C): its bytes, as UTF-8
            text = os.fsencode(text).decode("utf-8")
        # A strict stdin raises UnicodeDecodeError; the command line and a surrogateescape
        # stdin (POSIX) keep each byte that is not UTF-8 as a lone surrogate: encode refuses it.
        text.encode("utf-8")
    except OSError as exc:
        raise typer.BadParameter(str(exc), param_hint=option) from None
    except UnicodeError as exc:
        where = f" (byte {exc.start})" if isinstance(exc, UnicodeDecodeError) else ""
        fail(f"{option} is not UTF-8{where}: JSON is read as UTF-8", 2)
    try:
        value = json.loads(text, parse_constant=_no_constant)
        json.dumps(value, ensure_ascii=False).encode("utf-8")
        return value
    except UnicodeEncodeError:  # an escaped "\ud800": JSON Python reads, no Unicode text
        fail(f"{option} holds a lone surrogate (half a UTF-16 pair, \\ud800 to \\udfff)", 2)
    except _NotANumber as exc:
        fail(f"{option} is not JSON: NaN/Infinity are not JSON numbers (found {exc})", 2)
    except RecursionError:
        fail(f"{option} is JSON nested too deep to read", 2)
    except ValueError as exc:
        raise typer.BadParameter(f"not valid JSON: {exc}", param_hint=option) from None


class _NotANumber(ValueError):
    """NaN, Infinity or -Infinity, which Python's json reads but no request can carry."""


def _no_constant(constant: str) -> Any:
    raise _NotANumber(constant)


def parse_body(text: str) -> dict[str, Any]:
    """`--body` is JSON, `@file.json`, or `-` for stdin; it must be an object."""
    body = _read_json(text, "--body")
    if not isinstance(body, dict):
        raise typer.BadParameter("must be a JSON object", param_hint="--body")
    return body


def parse_time(text: str) -> datetime:
    """`--not-before`: an RFC 3339 time with its offset, read as the gateway reads it."""
    try:
        return rfc3339.parse(text)
    except ValueError:
        message = "an RFC 3339 time with its offset (Z or +hh:mm)"
    except OverflowError:
        message = "a time between the years 1 and 9999"
    fail(f"--not-before: {message}, not {text[:100]!r}", 2)


def parse_batch(source: str) -> list[dict[str, Any]]:
    """`--batch FILE` (or - for stdin): `{"tasks": [...]}`, or the list of tasks itself,
    each `{"body": {...}}` with an optional `"callback"`."""
    loaded = _read_json(source if source == "-" else f"@{source}", "--batch")
    tasks = loaded.get("tasks") if isinstance(loaded, dict) else loaded
    if not isinstance(tasks, list) or not all(isinstance(t, dict) for t in tasks):
        raise typer.BadParameter('a list of {"body": {...}} objects', param_hint="--batch")
    return tasks


def resolve_target(targets: list[str], service: str | None) -> tuple[str, str]:
    """Accepts `<service> <task_id>` or `<task_id>` with --service / CONVEYOR_SERVICE."""
    if len(targets) == 2:
        if service and service != targets[0]:
            fail(f"two services given: {targets[0]!r} and --service {service!r}", 2)
        return targets[0], targets[1]
    if len(targets) != 1:
        fail("expected [SERVICE] TASK_ID", 2)
    service = service or os.environ.get("CONVEYOR_SERVICE")
    if not service:
        fail("which service? give it before the task id, or use --service or CONVEYOR_SERVICE", 2)
    return service, targets[0]


def status_line(task: Task) -> str:
    return clean(task.status)


def status_detail(task: Task) -> str:
    if task.status == "PENDING" and task.not_before is not None:
        return f"not before {task.not_before.isoformat(timespec='seconds')}"
    if task.status == "PENDING" and task.task_position is not None:
        return f"position {task.task_position}"
    return ""


def print_json(value: Any, console: Console | None = None) -> None:
    """JSON from the gateway on stdout (`console`'s file), as `get`, `cancel`, `watch` and
    `submit --wait` print it: `json_text`, highlighted only on a terminal and up to
    MAX_HIGHLIGHTED characters. Else written as it is: rich's highlighting and rendering take
    seconds and gigabytes for a result of megabytes (30 s and 2.3 GB for 6.5 MB)."""
    console = console or out
    text = json_text(value)
    if console.is_terminal and len(text) <= MAX_HIGHLIGHTED:
        console.print(JSONHighlighter()(Text(text, no_wrap=True)), soft_wrap=True)
        return
    try:
        text.encode(getattr(console.file, "encoding", None) or "utf-8")
    except UnicodeEncodeError:  # a stdout in ASCII or Latin-1: the same JSON, escaped
        text = json_text(value, ascii_only=True)
    typer.echo(text, file=console.file)


def print_outcome(task: Task) -> None:
    if task.succeeded:
        out.print("[green]SUCCESS[/]", highlight=False)
        print_json(task.response)
        return
    message = clean(task.error_message or "(no error message)")
    err.print(Text.assemble(("FAILURE", "red"), ": ", message), highlight=False, soft_wrap=True)


def follow_live(client: ConveyorClient, service: str, task_id: str, **polling: Any) -> Task:
    """A rich progress bar redrawn at each event of the task's stream, for terminals."""
    columns = (
        TextColumn("{task.fields[status]:<12}", markup=False),
        BarColumn(),
        TaskProgressColumn(),
        TextColumn("{task.fields[detail]}", markup=False),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=err, transient=False) as bar:
        row = bar.add_task(task_id, total=100, status="...", detail="")
        for task in client.follow(service, task_id, **polling):
            bar.update(
                row, completed=task.progress, status=status_line(task), detail=status_detail(task)
            )
    return task


def follow_lines(client: ConveyorClient, service: str, task_id: str, **polling: Any) -> Task:
    """One line per visible change, for logs and pipes."""
    shown: tuple[str, int, str] | None = None
    for task in client.follow(service, task_id, **polling):
        state = (status_line(task), int(task.progress), status_detail(task))
        if state != shown:
            line = f"{state[0]} {task.progress:.1f}% {state[2]}".rstrip()
            err.print(line, markup=False, highlight=False)
            shown = state
    return task


def watch_task(
    creds: Credentials, service: str, task_id: str, timeout: float | None, interval: float
) -> None:
    follow = follow_live if err.is_terminal else follow_lines
    with reported_errors(creds.gateway), creds.client() as client:
        task = follow(client, service, task_id, timeout=timeout, interval=interval)
    print_outcome(task)
    raise typer.Exit(0 if task.succeeded else 1)


@app.command()
def submit(
    service: Annotated[str, typer.Argument(help="Target service.")],
    body: Annotated[
        str | None, typer.Option("--body", "-b", help="JSON object, @file or - (stdin).")
    ] = None,
    batch: Annotated[
        str | None,
        typer.Option(
            "--batch", help='Submit many at once: a JSON file (or -) of [{"body": {...}}, ...].'
        ),
    ] = None,
    callback: Annotated[str | None, typer.Option("--callback", help="Callback URL.")] = None,
    idempotency_key: Annotated[str | None, typer.Option("--idempotency-key")] = None,
    delay: Annotated[
        int | None, typer.Option("--delay", min=0, help="Run no sooner than SECONDS from now.")
    ] = None,
    not_before: Annotated[
        str | None,
        typer.Option("--not-before", help="Run no sooner than this RFC 3339 time."),
    ] = None,
    wait: Annotated[
        bool, typer.Option("--wait", "-w", help="Watch the task until it ends.")
    ] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print only the task id.")] = False,
    interval: IntervalOpt = 0.5,
    timeout: TimeoutOpt = None,
    gateway: GatewayOpt = DEFAULT_GATEWAY_URL,
    client_id: ClientIdOpt = "",
    client_secret: SecretOpt = "",
) -> None:
    """Submit a task (or a batch); print its id and position in the queue."""
    creds = Credentials(gateway, client_id, client_secret)
    if (body is None) == (batch is None):
        fail("give either --body or --batch", 2)
    if delay is not None and not_before is not None:
        fail("give either --delay or --not-before", 2)
    when = parse_time(not_before) if not_before is not None else None
    if batch is not None:
        if delay is not None or when is not None:
            fail("--delay and --not-before apply to --body; a batch file gives each task's", 2)
        if callback is not None:
            fail('--callback applies to --body; a batch file gives each task\'s "callback"', 2)
        if wait:
            fail("--wait follows one task: watch each of the batch's with `conveyor task watch`", 2)
        tasks = parse_batch(batch)
        with reported_errors(gateway), creds.client() as client:
            done = client.submit_batch(service, tasks, idempotency_key)
        for each in done:
            task_id = clean(each.task_id)
            typer.echo(task_id if quiet else f"{task_id} {each.position}")
        return
    assert body is not None
    payload = parse_body(body)
    with reported_errors(gateway), creds.client() as client:
        submitted = client.submit(
            service, payload, callback, idempotency_key, delay_seconds=delay, not_before=when
        )
    if quiet:
        typer.echo(clean(submitted.task_id))
    else:
        reused = "" if submitted.created else " (existing task for this idempotency key)"
        typer.echo(f"taskId: {clean(submitted.task_id)}{reused}")
        typer.echo(f"taskPosition: {submitted.position}")
    if wait:
        watch_task(creds, service, submitted.task_id, timeout, interval)


@app.command()
def cancel(
    targets: TargetArgs,
    service: ServiceOpt = None,
    gateway: GatewayOpt = DEFAULT_GATEWAY_URL,
    client_id: ClientIdOpt = "",
    client_secret: SecretOpt = "",
) -> None:
    """Cancel a PENDING or IN_PROGRESS task: `cancel <service> <task_id>`; prints its state."""
    service_name, task_id = resolve_target(targets, service)
    creds = Credentials(gateway, client_id, client_secret)
    with reported_errors(gateway), creds.client() as client:
        task = client.cancel(service_name, task_id)
    print_json(task.raw)


@app.command()
def get(
    targets: TargetArgs,
    service: ServiceOpt = None,
    gateway: GatewayOpt = DEFAULT_GATEWAY_URL,
    client_id: ClientIdOpt = "",
    client_secret: SecretOpt = "",
) -> None:
    """Print a task's state as JSON: `get <service> <task_id>` or `get <task_id> --service S`."""
    service_name, task_id = resolve_target(targets, service)
    creds = Credentials(gateway, client_id, client_secret)
    with reported_errors(gateway), creds.client() as client:
        task = client.get(service_name, task_id)
    print_json(task.raw)


@app.command()
def watch(
    targets: TargetArgs,
    service: ServiceOpt = None,
    interval: IntervalOpt = 0.5,
    timeout: TimeoutOpt = None,
    gateway: GatewayOpt = DEFAULT_GATEWAY_URL,
    client_id: ClientIdOpt = "",
    client_secret: SecretOpt = "",
) -> None:
    """Follow a task live until it ends; exit 0 on SUCCESS, 1 on FAILURE, 124 on --timeout."""
    service_name, task_id = resolve_target(targets, service)
    watch_task(
        Credentials(gateway, client_id, client_secret), service_name, task_id, timeout, interval
    )
