"""The dispatcher's settings (conveyor/dispatcher_settings.py) read the environment as
pydantic-settings did before them: the same variables, precedence, parsing and bounds.

The reference is a pydantic-settings model declared from the dataclass's own fields, exactly
as DispatcherSettings was declared when it was one; every value of a corpus of awkward
spellings must come out the same, or be refused by both.
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import os
import typing
from typing import Any

import pytest
from pydantic import AliasChoices, Field, ValidationError, create_model, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from conveyor.dispatcher_settings import (
    DispatcherSettings,
    SettingsError,
    ShutdownMode,
    amqp_nodes,
    dispatcher_variable,
    is_http_url,
)
from conveyor.logs import LogFormat
from conveyor.topology import check_name

HINTS = typing.get_type_hints(DispatcherSettings)
INTS = [
    *("4", " 4 ", "\t7\n", "+4", "-0", "0", "00012", "1000", "1001", "9" * 30, "1_000"),
    *("4.0", "4.", "4.000", "-4.0", "1_000.0", "4.5", "4.0_0", "4 .0", ".0", "4.0.0"),
    *("", " ", "0x10", "1e3", "3_", "_3", "1__0", "\u0664", "\u0661\u0662", "true", "None", "4 4"),
]
FLOATS = [
    *(" 1.5 ", "1_000.5", "1_0", ".5", "5.", "-0", "-1", "0.0", "1e3", "1E3", "1e-400", "1e400"),
    *("inf", "-inf", "+inf", "INF", "Infinity", "infinity", "iNfInItY", "nan", "NaN", "-nan"),
    *("", "0x1p3", "1e", "\u0661.\u0665", "1 000", "nan(1)", "1__0", "_1", "1_", "4.0_0", "0.0001"),
]
BOOLS = [
    *("true", "True", "TRUE", "1", "0", "yes", "YES", "on", "On", "off", "t", "f", "y", "n"),
    *(" true ", "", "2", "1.0", "0.0", "None", "ja", "tru\u0435"),  # Cyrillic e
]
TEXTS = ["x", " x ", "", "ünï", "http://fn:8080/path?q=1"]


def corpus(kind: Any) -> list[str]:
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return [*(m.value for m in kind), *(m.name for m in kind), " " + next(iter(kind)).value, ""]
    inner = [a for a in typing.get_args(kind) if a is not type(None)]
    kind = inner[0] if inner else kind
    return {int: INTS, float: FLOATS, bool: BOOLS, str: TEXTS}[kind]


class _Base(BaseSettings):
    model_config = SettingsConfigDict(extra="ignore", populate_by_name=True)


def _callable(cls: type, url: str | None) -> str | None:
    if url is not None and not is_http_url(url):
        raise ValueError("not an http(s) URL with a host and a port")
    return url


def _amqp_url(cls: type, setting: str) -> str:
    amqp_nodes(setting)  # ValueError
    return setting


def _queue_name(cls: type, name: str) -> str:
    return check_name(name)


def _ip_address(cls: type, address: str | None) -> str | None:
    if address is not None:
        ipaddress.ip_address(address)  # ValueError
    return address


def reference() -> type[BaseSettings]:
    """DispatcherSettings as the pydantic-settings class it used to be, with the URLs it calls,
    its queue's name and its pod's address checked as it checks them since."""
    fields: dict[str, Any] = {}
    validators: dict[str, Any] = {}
    for f in dataclasses.fields(DispatcherSettings):
        alias = AliasChoices(
            dispatcher_variable(f.name, prefixed=True), dispatcher_variable(f.name)
        )
        checks = ("http_url", "amqp_url", "queue_name", "ip_address")
        bounds = {k: v for k, v in f.metadata.items() if k not in checks}
        fields[f.name] = (HINTS[f.name], Field(f.default, validation_alias=alias, **bounds))
        if f.metadata.get("http_url"):
            validators[f"{f.name}_callable"] = field_validator(f.name)(_callable)
        if f.metadata.get("amqp_url"):
            validators[f"{f.name}_amqp_url"] = field_validator(f.name)(_amqp_url)
        if f.metadata.get("queue_name"):
            validators[f"{f.name}_queue_name"] = field_validator(f.name)(_queue_name)
        if f.metadata.get("ip_address"):
            validators[f"{f.name}_ip_address"] = field_validator(f.name)(_ip_address)
    return create_model("Reference", __base__=_Base, __validators__=validators, **fields)


def outcomes(environ: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    with monkeypatch.context() as m:
        for name in list(os.environ):
            m.delenv(name)
        for name, value in environ.items():
            m.setenv(name, value)
        try:
            ours: Any = dataclasses.asdict(DispatcherSettings.from_env())
        except SettingsError:
            ours = "refused"
        try:
            theirs: Any = reference()().model_dump()
        except ValidationError:
            theirs = "refused"
    return repr(ours), repr(theirs)  # repr: NaN equals NaN


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(DispatcherSettings)])
def test_every_value_reads_as_pydantic_settings_read_it(
    field: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    spellings = [
        dispatcher_variable(field),
        dispatcher_variable(field, prefixed=True),
        dispatcher_variable(field).lower(),
    ]
    differences = []
    for number, text in enumerate(corpus(HINTS[field])):
        environ = {spellings[number % len(spellings)]: text}
        ours, theirs = outcomes(environ, monkeypatch)
        if ours != theirs:
            differences.append(f"{environ}: ours {ours[:200]}, pydantic-settings {theirs[:200]}")
    assert not differences, "\n".join(differences)


def test_nothing_set_gives_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    ours, theirs = outcomes({}, monkeypatch)
    assert ours == theirs == repr(dataclasses.asdict(DispatcherSettings()))


def test_the_prefixed_name_wins_and_names_are_read_in_any_case(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    environ = {"CONVEYOR_CONCURRENCY": "7", "CONCURRENCY": "8", "Function_Url": "http://f/"}
    ours, theirs = outcomes(environ, monkeypatch)
    assert ours == theirs
    settings = DispatcherSettings.from_env(environ)
    assert (settings.concurrency, settings.function_url) == (7, "http://f/")
    # The prefixed name is read even when it is wrong and the bare one right, as before.
    refused = repr("refused")
    assert outcomes({"CONVEYOR_CONCURRENCY": "x", "CONCURRENCY": "8"}, monkeypatch) == (
        refused,
        refused,
    )


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(SettingsError) as refused:
        DispatcherSettings.from_env({"CONCURRENCY": "many", "SHUTDOWN_MODE": "later"})
    assert "CONCURRENCY='many'" in str(refused.value)
    assert "SHUTDOWN_MODE='later': one of requeue, drain" in str(refused.value)
    with pytest.raises(SettingsError, match="CONCURRENCY must be at least 1; TASK_TIMEOUT"):
        DispatcherSettings.from_env({"CONCURRENCY": "0", "TASK_TIMEOUT": "0"})
    # Found by a sweep: a value that does not read hid the others' ranges, to be found one
    # restart at a time.
    with pytest.raises(SettingsError) as refused:
        DispatcherSettings.from_env(
            {"CONCURRENCY": "0", "DRAIN_TIMEOUT": "nan", "SHUTDOWN_MODE": "x"}
        )
    assert [p.split(" ")[0].split("=")[0] for p in refused.value.problems] == [
        "SHUTDOWN_MODE",
        "CONCURRENCY",
        "DRAIN_TIMEOUT",
    ]


def test_each_refused_setting_is_a_line_of_its_own(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """As the gateway prints its own (README): found by a sweep on one line, `; `-joined."""
    from dispatcher import main

    for variable, value in (
        ("CONCURRENCY", "abc"),
        ("PREFETCH_BUFFER", "x"),
        ("TASK_TIMEOUT", "0"),
    ):
        monkeypatch.setenv(variable, value)
    assert main.main() == 1
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(":")[1].split("=")[0].split(" ")[1] for line in lines] == [
        "CONCURRENCY",
        "PREFETCH_BUFFER",
        "TASK_TIMEOUT",
    ], lines
    assert all(line.startswith("error: ") for line in lines)


def test_bounds_hold_however_the_settings_are_made() -> None:
    with pytest.raises(SettingsError, match="PREFETCH_BUFFER must be at most 1000"):
        DispatcherSettings(prefetch_buffer=1001)
    assert DispatcherSettings(concurrency=1000, one_shot=True).concurrency == 1000


def test_types_and_names() -> None:
    settings = DispatcherSettings.from_env(
        {"SHUTDOWN_MODE": "drain", "LOG_FORMAT": "json", "METRICS_PORT": "9090", "ONE_SHOT": "1"}
    )
    assert settings.shutdown_mode is ShutdownMode.DRAIN
    assert settings.log_format is LogFormat.JSON
    assert (settings.metrics_port, settings.progress_port, settings.one_shot) == (9090, None, True)
    assert dispatcher_variable("queue", prefixed=True) == "CONVEYOR_QUEUE"
    with pytest.raises(KeyError):
        dispatcher_variable("no_such_setting")


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        *(("IDLE_EXIT_SECONDS", v) for v in ("0", "-1", "nan", "inf")),
        *(("TASK_TIMEOUT", v) for v in ("1e12", "inf")),
        ("CANCEL_MEMORY_SECONDS", "1e300"),
        *(("RECONSUME_IDLE_SECONDS", v) for v in ("-1", "nan", "1e300")),
        *(("DISPATCHER_PORT", v) for v in ("70000", "0", "-1")),
        *(("PROGRESS_PORT", v) for v in ("65536", "-1")),
        ("METRICS_PORT", "99999"),
        # more than the gateway reads in a result: the task would fail there instead
        *(("MAX_RESPONSE_ITEMS", v) for v in ("1000001", "0")),
        # a grace period Kubernetes cannot hold, and a drain that never ends
        *(("DRAIN_TIMEOUT", v) for v in ("inf", "1e22", str(2**31))),
        # a sweep: a traceback from logging at start, or, empty, from the node list
        *(("LOG_LEVEL", v) for v in ("debugx", "", "verbose")),
        *(("AMQP_URL", v) for v in ("", " ; ", "garbage", "http://127.0.0.1:5672/")),
        # a sweep: 0 consumed at once with the function down (its tasks failed), inf waited
        # for ever; backoffs and intervals a clock cannot hold; a heartbeat AMQP cannot carry
        *(("FUNCTION_WAIT_TIMEOUT", v) for v in ("0", "inf")),
        *(("RETRY_BACKOFF", v) for v in ("inf", "1e300")),
        ("RETRY_BACKOFF_MAX", "inf"),
        ("PROGRESS_INTERVAL", "inf"),
        ("AMQP_HEARTBEAT", "65536"),
    ],
)
def test_values_the_dispatcher_cannot_run_with_are_refused(variable: str, value: str) -> None:
    """Found by a sweep: these passed start-up, then a one-shot Job left its task waiting, or a
    clock or a bind overflowed. Now each is a SettingsError naming the variable."""
    with pytest.raises(SettingsError, match=f"^{variable}( must|=)"):
        DispatcherSettings.from_env({variable: value})


def test_the_largest_values_that_work_are_accepted() -> None:
    settings = DispatcherSettings.from_env(
        {
            "TASK_TIMEOUT": str(2**31 - 1),  # the longest taskTimeout a service can have
            "IDLE_EXIT_SECONDS": "0.5",
            "DISPATCHER_PORT": "65535",
            "PROGRESS_PORT": "0",  # 0: no progress port, as before
            "FUNCTION_URL": "http://[::1]:8080/run?x=1",
            "FUNCTION_READY_URL": "https://fn.example/ready",
            "MAX_RESPONSE_ITEMS": "1000000",
            "DRAIN_TIMEOUT": str(2**31 - 1),
            "LOG_LEVEL": " warning ",
            "AMQP_URL": "amqps://u:p@rabbit-0:5671/v;amqp://rabbit-1/v",
        }
    )
    assert (settings.task_timeout, settings.dispatcher_port) == (2**31 - 1, 65535)
    assert settings.max_response_items == 1_000_000
    assert (settings.drain_timeout, settings.log_level) == (2**31 - 1, "WARNING")


@pytest.mark.parametrize("variable", ["FUNCTION_URL", "FUNCTION_READY_URL"])
@pytest.mark.parametrize(
    "url",
    [
        "ftp://127.0.0.1:8080/",
        "127.0.0.1:8080",
        "localhost:8080",
        "/run",
        "http:///run",
        "http://127.0.0.1:99999/",
        "http://127.0.0.1:0/",
        "http://127.0.0.1:port/",
    ],
)
def test_function_urls_must_be_http_with_a_host_and_a_port(variable: str, url: str) -> None:
    """Found by a sweep: `ftp://…`, no scheme or port 99999 passed start-up, then failed every
    task with the URL for its errorMessage. Now it is a SettingsError naming the variable."""
    with pytest.raises(SettingsError, match=f"^{variable} must be an http"):
        DispatcherSettings.from_env({variable: url})


def test_a_progress_port_for_a_function_elsewhere_needs_the_pod_ip() -> None:
    """Found by a sweep: without POD_IP the progress URL said 127.0.0.1, which a function in
    another pod (knative) cannot reach: its reports were lost. A loopback function may do
    without it; anything else is refused at start, naming both variables."""
    remote = {"PROGRESS_PORT": "8082", "FUNCTION_URL": "http://fn.default.svc.cluster.local/"}
    with pytest.raises(SettingsError, match=r"^PROGRESS_PORT needs POD_IP"):
        DispatcherSettings.from_env(remote)
    assert DispatcherSettings.from_env({**remote, "POD_IP": "10.1.2.3"}).pod_ip == "10.1.2.3"
    for loopback in ("http://127.0.0.1:8080/", "http://localhost:8080/", "http://[::1]:8080/"):
        local = DispatcherSettings.from_env({"PROGRESS_PORT": "8082", "FUNCTION_URL": loopback})
        assert local.pod_ip is None
    assert DispatcherSettings.from_env({**remote, "PROGRESS_PORT": "0"}).progress_port == 0


@pytest.mark.parametrize("pod_ip", ["", "pod-1", "10.1.2", "10.1.2.3:80", "[::1]"])
def test_a_pod_ip_must_be_an_ip_address(pod_ip: str) -> None:
    with pytest.raises(SettingsError, match=r"^POD_IP must be an IP address"):
        DispatcherSettings.from_env({"POD_IP": pod_ip})
