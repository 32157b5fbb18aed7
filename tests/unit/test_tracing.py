"""conveyor.tracing on its own: off (and free) without an OTLP endpoint, exporting with one."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from conveyor import tracing
from tests.support.otlp import OtlpReceiver, otlp_receiver
from tests.support.processes import REPO

TRACE = "0af7651916cd43dd8448eb211c80319c"
PARENT = "b7ad6b7169203331"

_OFF = """
import sys
import time
from conveyor import tracing

assert tracing.configure("conveyor-test") is False
assert tracing.enabled is False
with tracing.span("submit", "00-TRACE-PARENT-01") as inside:
    assert inside is None
    assert tracing.current() is None
tracing.record("result", None, 0, 1)
tracing.annotate("k", "v")
tracing.failed("no")
tracing.shutdown()
loaded = sorted(name for name in sys.modules if name.startswith("opentelemetry"))
assert not loaded, loaded
from opentelemetry import trace

assert type(trace.get_tracer_provider()).__name__ == "ProxyTracerProvider"
print("off")
""".replace("TRACE", TRACE).replace("PARENT", PARENT)


def test_without_an_endpoint_nothing_is_installed_or_even_imported() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run(
        [sys.executable, "-c", _OFF], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "off"


def test_helpers_are_shared_no_ops_when_off(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in tracing.ENDPOINT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert not tracing.configure("conveyor-test")
    assert tracing.span("a") is tracing.span("b", f"00-{TRACE}-{PARENT}-01")  # no allocation
    assert tracing.current() is None


@pytest.mark.parametrize("variable", ["OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER"])
def test_the_standard_switches_keep_it_off(monkeypatch: pytest.MonkeyPatch, variable: str) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv(variable, "true" if variable == "OTEL_SDK_DISABLED" else "none")
    assert not tracing.configure("conveyor-test")
    assert not tracing.enabled


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with otlp_receiver() as made:
        yield made


def test_spans_are_exported_with_their_parents(
    receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "renamed")
    try:
        assert tracing.configure("conveyor-test")
        with tracing.span("outer", f"00-{TRACE}-{PARENT}-01", {"conveyor.task_id": "t1"}):
            outer = tracing.current()
            assert outer is not None and outer.split("-")[1] == TRACE
            with tracing.span("inner", kind="client"):
                inner = tracing.current()
                tracing.failed("it broke")
        tracing.record("later", outer, 1_000, 2_000, {"conveyor.status": "SUCCESS"})
        assert tracing.current() is None  # nothing is current outside the blocks
    finally:
        tracing.shutdown()  # flushes
    assert not tracing.enabled

    spans = {s.name: s for s in receiver.received()}
    assert set(spans) == {"outer", "inner", "later"}
    assert {s.service for s in spans.values()} == {"renamed"}  # OTEL_SERVICE_NAME wins
    assert {s.trace_id for s in spans.values()} == {TRACE}
    assert spans["outer"].parent_id == PARENT
    assert outer == f"00-{TRACE}-{spans['outer'].span_id}-01"
    assert inner == f"00-{TRACE}-{spans['inner'].span_id}-01"
    assert spans["inner"].parent_id == spans["outer"].span_id
    assert spans["later"].parent_id == spans["outer"].span_id
    assert spans["outer"].attributes == {"conveyor.task_id": "t1"}

    from opentelemetry import trace

    # Conveyor's provider is its own: FastAPI's instrumentation does not wake up.
    assert type(trace.get_tracer_provider()).__name__ == "ProxyTracerProvider"


def test_a_database_error_is_exported_without_the_row_it_quotes(
    receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch, database_url: str
) -> None:
    """Found by a review: OpenTelemetry records an escaping exception's `str` and traceback
    on the span (and its status), and a refused submission's CheckViolation quotes the task's
    row: body, callback URL, Idempotency-Key, sent to the collector. The span says what the
    log says now (`conveyor.logs.describe`)."""
    import psycopg

    from gateway.database_url import libpq

    mark = "BODYMARK-traced"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    try:
        assert tracing.configure("conveyor-test")
        with psycopg.connect(libpq(database_url), autocommit=True) as conn:
            conn.execute("CREATE TEMP TABLE t (a int CHECK (a > 0), b text)")
            with pytest.raises(psycopg.errors.CheckViolation), tracing.span("submit"):
                conn.execute("INSERT INTO t VALUES (-1, %s)", (mark,))
    finally:
        tracing.shutdown()
    (span,) = receiver.received()
    assert span.error is not None and "violates check constraint" in span.error
    assert receiver.bodies and not any(mark.encode() in body for body in receiver.bodies)


@pytest.mark.parametrize(
    ("value", "kept"),
    [
        (f"00-{TRACE}-{PARENT}-01", True),
        (f"01-{TRACE}-{PARENT}-00-more", True),  # a later version may append fields
        (None, False),
        ("", False),
        ("garbage", False),
        (f"00-{TRACE.upper()}-{PARENT}-01", False),
        (f"00-{TRACE}-{PARENT}-01 ", False),
        (f"00-{TRACE}-{PARENT}-01-" + "x" * 300, False),  # never stored oversized
        # Found by a sweep: passed on as received while tracing was off.
        (f"00-{'0' * 32}-{PARENT}-01", False),  # all-zero ids are invalid
        (f"00-{TRACE}-{'0' * 16}-01", False),
        (f"ff-{TRACE}-{PARENT}-01", False),  # version ff is invalid
        (f"00-{TRACE}-{PARENT}-01-garbage/../<script>", False),  # version 00 has 4 fields
        (f"01-{TRACE}-{PARENT}-01-caf\u00e9", False),  # headers are ASCII
    ],
)
def test_only_well_formed_traceparents_are_passed_on(value: str | None, kept: bool) -> None:
    assert tracing.checked(value) == (value if kept else None)


_STOP = """
import time
from conveyor import tracing

assert tracing.configure("conveyor-test")
for n in range(2000):
    with tracing.span("submit"):
        pass
started = time.monotonic()
tracing.shutdown()
print(round(time.monotonic() - started, 1))
"""


def test_a_collector_that_never_answers_holds_a_stop_a_bounded_time() -> None:
    """Found by a black-box sweep: with a collector that takes connections and never answers,
    the SDK's shutdown waited 30 s for its export thread (and again at exit), so a SIGTERM of
    a dispatcher took 30 s, of a gateway 31 s. A stop waits SHUTDOWN_EXPORT_SECONDS (2 s)."""
    with socket.socket() as silent:  # accepts connections (its backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        port = silent.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{port}"
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-c", _STOP],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        took = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.split()[-1]) <= tracing.SHUTDOWN_EXPORT_SECONDS + 1
    assert took < 15, took  # the process ends too: no second wait at exit
