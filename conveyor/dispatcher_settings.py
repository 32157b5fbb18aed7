"""The dispatcher's configuration (SPEC §7), read from its environment without pydantic.

The sidecar runs next to every function, where memory is part of the product (50 MB idle):
pydantic and pydantic-settings would be a fifth of that (~10 MiB of imports) to read twenty-odd
scalars. So this one class is a frozen dataclass read here, by pydantic-settings' own rules
(tests/unit/test_dispatcher_settings.py holds them to it): each setting `name` is read from
`CONVEYOR_NAME`, else the bare `NAME` that manifests conventionally spell (`FUNCTION_URL`),
names in any case; numbers strip surrounding blanks; every problem is reported at once. The
gateway's settings stay pydantic-settings (conveyor/settings.py).
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import operator
import os
import re
import types
import typing
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from conveyor import storable
from conveyor.events import MAX_TIMEOUT
from conveyor.logs import LogFormat, LogLevel
from conveyor.topology import check_name

DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
# Short enough that a frozen broker node is left within a minute, long enough that a
# busy 2-core machine never misses one.
DEFAULT_AMQP_HEARTBEAT = 15
MAX_AMQP_HEARTBEAT = 65535  # AMQP carries it in 16 bits
PREFIX = "CONVEYOR_"
MAX_PORT = 65535


class ShutdownMode(enum.StrEnum):
    REQUEUE = "requeue"
    DRAIN = "drain"


class SettingsError(ValueError):
    """The environment sets something the dispatcher cannot run with: `problems`, one per
    setting, each naming its variable."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


def _bounded(
    default: Any, *, ge: float | None = None, gt: float | None = None, le: float | None = None
) -> Any:
    bounds = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le)) if v is not None}
    return dataclasses.field(default=default, metadata=bounds)


def _http_url(default: str | None) -> Any:
    """A URL the dispatcher calls: refused at start unless aiohttp can call it."""
    return dataclasses.field(default=default, metadata={"http_url": True})


def _ip_address(default: str | None) -> Any:
    """An address the dispatcher advertises: anything else makes a URL nobody can reach."""
    return dataclasses.field(default=default, metadata={"ip_address": True})


def _amqp_url(default: str) -> Any:
    """The broker's nodes: refused at start unless each is an AMQP URL (`amqp_nodes`)."""
    return dataclasses.field(default=default, metadata={"amqp_url": True})


def _queue_name(default: str) -> Any:
    """A queue the gateway declares: refused at start unless the gateway's rule for a queue
    name takes it (an empty one waited forever for `-in` and `-out`)."""
    return dataclasses.field(default=default, metadata={"queue_name": True})


@dataclasses.dataclass(frozen=True, kw_only=True)
class DispatcherSettings:
    amqp_url: str = _amqp_url(DEFAULT_AMQP_URL)
    amqp_heartbeat: int = _bounded(DEFAULT_AMQP_HEARTBEAT, ge=0, le=MAX_AMQP_HEARTBEAT)
    queue: str = _queue_name("sleeper")
    function_url: str = _http_url("http://127.0.0.1:8080/")
    function_ready_url: str | None = _http_url(None)
    concurrency: int = _bounded(4, ge=1, le=1000)
    # Messages held beyond CONCURRENCY (prefetch = CONCURRENCY + this), so that the next one is
    # already here when a call ends: a slot is free again as soon as the function has answered,
    # while its terminal event is confirmed and its message acked in the background.
    prefetch_buffer: int = _bounded(0, ge=0, le=1000)
    shutdown_mode: ShutdownMode = ShutdownMode.REQUEUE
    # At most what a pod's terminationGracePeriodSeconds (and the clocks) can hold.
    drain_timeout: float = _bounded(30.0, ge=0, le=MAX_TIMEOUT)
    dispatcher_port: int = _bounded(8081, ge=1, le=MAX_PORT)
    metrics_port: int | None = _bounded(None, ge=0, le=MAX_PORT)  # None or 0: none
    # Knative mode (SPEC §11.5): progress reports from the function's pods reach the dispatcher
    # on POD_IP:PROGRESS_PORT, with each attempt's token in the URL.
    progress_port: int | None = _bounded(None, ge=0, le=MAX_PORT)
    # On every port the dispatcher serves: a request must arrive whole within it (slow loris).
    request_read_timeout: float = _bounded(60.0, gt=0, le=MAX_TIMEOUT)
    pod_ip: str | None = _ip_address(None)
    one_shot: bool = False
    # ONE_SHOT: counted from the start; a Job that has no message by then exits 0.
    idle_exit_seconds: float = _bounded(60.0, gt=0, le=MAX_TIMEOUT)
    # Nothing delivered for this long with nothing in flight: the consumer of `-in` is
    # replaced on a fresh channel (0: never; sooner when `-in` has messages ready that none
    # came to take). A broker that stopped feeding it without a word (RabbitMQ 3.10, a quorum
    # `-in` deleted and declared again at once) is heard again so. Not shorter by default:
    # aio-pika 10.2.1 keeps ~4 KB on the connection per channel ever opened there (288
    # replacements, ~1.3 MB, in a day idle).
    reconsume_idle_seconds: float = _bounded(300.0, ge=0, le=MAX_TIMEOUT)
    hostname: str = "localhost"
    # Used when a message does not carry its service's values (legacy format).
    max_attempts: int = _bounded(3, ge=1)
    task_timeout: float = _bounded(300.0, gt=0, le=MAX_TIMEOUT)
    retry_backoff: float = _bounded(0.5, ge=0, le=MAX_TIMEOUT)
    retry_backoff_max: float = _bounded(30.0, ge=0, le=MAX_TIMEOUT)
    progress_interval: float = _bounded(0.5, ge=0, le=MAX_TIMEOUT)
    # `started` goes out only once a call has run this long (0: always at once); a shorter
    # call sends its terminal event alone, carrying the host and start time. One confirmed
    # publish and one row write fewer per short task (legacy services always get `started`).
    started_delay_ms: int = _bounded(100, ge=0)
    # The longest answer read from the function: a longer one fails its task (RabbitMQ's own
    # limit on a message, 128 MiB by default, must never be reached: it closes the channel).
    max_response_bytes: int = _bounded(8 * 1024 * 1024, ge=1024)
    # The most items (objects, arrays, values) a JSON answer may hold: each is a Python object
    # once read (8 MiB of `[{},…]`: 200 MB); a crowded answer fails its task. No more than the
    # gateway reads in a result (`storable.MAX_ITEMS`), or the task would fail there instead.
    max_response_items: int = _bounded(storable.MAX_ITEMS, ge=1, le=storable.MAX_ITEMS)
    # Before consuming, how long to wait for the function to answer (SPEC §7): then exit 1.
    # Not 0: a dispatcher that consumed at once failed the tasks of a function still starting.
    function_wait_timeout: float = _bounded(300.0, gt=0, le=MAX_TIMEOUT)
    # How long a cancelled task's id is remembered (SPEC §11.1): its message may still be
    # queued, or requeued by another dispatcher, meanwhile.
    cancel_memory_seconds: float = _bounded(24 * 3600.0, gt=0, le=MAX_TIMEOUT)
    log_level: LogLevel = LogLevel.INFO
    log_format: LogFormat = LogFormat.AUTO

    def __post_init__(self) -> None:
        problems = [p for f in dataclasses.fields(self) if (p := _problem(self, f))]
        if self.progress_port and self.pod_ip is None and not _is_loopback(self.function_url):
            # The function's pods would be told 127.0.0.1: their reports would never arrive.
            problems.append(
                "PROGRESS_PORT needs POD_IP (the address the function's pods reach this"
                " dispatcher at) unless FUNCTION_URL is on this host"
            )
        if problems:
            raise SettingsError(problems)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> DispatcherSettings:
        """The settings the environment (default: this process's) gives, or SettingsError."""
        found = {k.lower(): v for k, v in (os.environ if environ is None else environ).items()}
        hints = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        problems: list[str] = []
        for f in dataclasses.fields(cls):
            for variable in (
                dispatcher_variable(f.name, prefixed=True),
                dispatcher_variable(f.name),
            ):
                text = found.get(variable.lower())
                if text is None:
                    continue
                try:
                    values[f.name] = _parse(hints[f.name], text)
                except ValueError as exc:
                    problems.append(f"{variable}={text!r}: {exc}")
                break
        try:
            settings = cls(**values)
        except SettingsError as exc:  # the values that did read: all refusals at once
            problems.extend(exc.problems)
        if problems:
            raise SettingsError(problems)
        return settings


def dispatcher_variable(field: str, prefixed: bool = False) -> str:
    """The environment variable that sets a dispatcher setting, as a manifest spells it:
    bare (`FUNCTION_URL`), or with `prefixed` the `CONVEYOR_` form for names too generic to
    stand alone in a pod's environment (`CONVEYOR_QUEUE`)."""
    if field not in {f.name for f in dataclasses.fields(DispatcherSettings)}:
        raise KeyError(field)
    return (PREFIX if prefixed else "") + field.upper()


_INTEGER = re.compile(r"([+-]?[0-9]+(?:_[0-9]+)*)(?:\.0+)?")
_BOUNDS = {
    "ge": ("at least", operator.ge),
    "gt": ("greater than", operator.gt),
    "le": ("at most", operator.le),
}
_TRUE = {"1", "on", "t", "true", "y", "yes"}
_FALSE = {"0", "off", "f", "false", "n", "no"}


def integer(text: str) -> int:
    """An integer setting as the dispatcher reads it: `4` and `4.0`, not `4.5`."""
    return int(_parse(int, text))


def _parse(kind: Any, text: str) -> Any:
    """One value from its text, as pydantic's lax mode reads an environment variable."""
    if isinstance(kind, types.UnionType):  # `X | None`: the variable, when set, is an X
        (kind,) = (arg for arg in typing.get_args(kind) if arg is not type(None))
    if kind is str:
        return text
    if kind is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ValueError("not a boolean (true/false, 1/0, yes/no, on/off)")
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        try:
            return kind(text)
        except ValueError:
            raise ValueError(f"one of {', '.join(m.value for m in kind)}") from None
    number = text.strip()
    if kind is int:
        if not (found := _INTEGER.fullmatch(number)):  # "4.0" is an integer, "4.5" is not
            raise ValueError("not an integer")
        return int(found[1])
    if kind is float:
        if not number.isascii():  # float() would take other scripts' digits
            raise ValueError("not a number")
        try:
            return float(number)
        except ValueError:
            raise ValueError("not a number") from None
    raise TypeError(f"no parser for {kind!r}")


def is_http_url(url: str) -> bool:
    """Whether the dispatcher can call `url`: http or https, a host, a port from 1 to 65535.
    Anything else passed the start before, and then failed every task with the URL for its
    errorMessage."""
    return _is_url(url, ("http", "https"))


def _is_url(url: str, schemes: tuple[str, ...]) -> bool:
    try:
        parts = urlsplit(url)
        port = parts.port  # ValueError: not a number, or out of range
    except ValueError:
        return False
    return parts.scheme in schemes and bool(parts.hostname) and port != 0


def amqp_nodes(setting: str) -> list[str]:
    """The broker nodes CONVEYOR_AMQP_URL names: one URL, or a cluster's separated by `;`,
    each `amqp://` or `amqps://` with a host (and a port from 1 to 65535), or ValueError. An
    empty list, or an `http://` node, started a gateway that retried for ever (or used it as
    AMQP without a word); both processes refuse them at start alike."""
    urls = [url.strip() for url in setting.split(";") if url.strip()]
    if not urls:
        raise ValueError("must name a broker node (e.g. amqp://user:secret@rabbitmq:5672/)")
    if not all(_is_url(url, ("amqp", "amqps")) for url in urls):
        raise ValueError(
            "must be amqp:// or amqps:// URLs with a host (and a port from 1 to"
            f" {MAX_PORT}), nodes separated by ';'"
        )
    return urls


def _is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _problem(settings: DispatcherSettings, f: dataclasses.Field[Any]) -> str | None:
    value = getattr(settings, f.name)
    if value is None:
        return None
    if f.metadata.get("ip_address"):
        try:
            ipaddress.ip_address(value)
        except ValueError:
            return f"{dispatcher_variable(f.name)} must be an IP address (IPv4 or IPv6)"
        return None
    if f.metadata.get("amqp_url"):
        try:
            amqp_nodes(value)
        except ValueError as exc:
            return f"{dispatcher_variable(f.name)} {exc}"
        return None
    if f.metadata.get("queue_name"):
        try:
            check_name(value)
        except ValueError as exc:
            return f"{dispatcher_variable(f.name, prefixed=True)} must be a queue name: {exc}"
        return None
    if f.metadata.get("http_url"):
        if is_http_url(value):
            return None
        return (
            f"{dispatcher_variable(f.name)} must be an http:// or https:// URL with a host"
            f" (and a port from 1 to {MAX_PORT})"
        )
    failed = [
        f"{word} {f.metadata[bound]}"
        for bound, (word, holds) in _BOUNDS.items()
        if bound in f.metadata and not holds(value, f.metadata[bound])
    ]
    return f"{dispatcher_variable(f.name)} must be {' and '.join(failed)}" if failed else None
