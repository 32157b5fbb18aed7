"""OpenTelemetry spans along a task's path, one trace per task across processes (SPEC §11.6).

Off unless OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is set. Off,
every helper returns at its first line (`enabled` is False) and OpenTelemetry is never
imported: the hot path pays one global read, the dispatcher's memory and start-up nothing.
On, spans go through a BatchSpanProcessor (its own thread) to the OTLP/HTTP exporter, which,
like the sampler, reads the other standard OTEL_* variables itself.

The trace crosses processes as a W3C `traceparent`: in the HTTP request, in the CloudEvents
tracing extension of each message, on the task's row (for the result and the callback).

The provider is Conveyor's own, not installed as the process-global one: a global SDK provider
switches on FastAPI's built-in instrumentation (spans and metrics on every request), a cost
the spans below do not need.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Literal

from conveyor import logs

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

log = logging.getLogger("conveyor.tracing")

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
Kind = Literal["internal", "server", "client", "producer", "consumer"]
Attributes = Mapping[str, str | int | float | bool]

# version-traceid-parentid-flags (W3C Trace Context §3.2): version 00 is exactly that, a later
# one may append fields (visible ASCII); version ff and all-zero ids are invalid. A malformed
# one was passed on to the function as received while tracing was off (found by a sweep).
_IDS = r"-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}"
_TRACEPARENT = re.compile(rf"00{_IDS}|(?!00|ff)[0-9a-f]{{2}}{_IDS}(-[\x21-\x7e]*)?")
_MAX_TRACEPARENT = 256
SHUTDOWN_EXPORT_SECONDS = 2.0  # what a stop gives the spans still buffered
_NO_SPAN: AbstractContextManager[None] = contextlib.nullcontext()

enabled = False
_provider: TracerProvider | None = None
_tracer: Tracer | None = None
_current_span: Callable[[], Span] | None = None
_extract: Callable[[str], Context] | None = None
_kinds: dict[str, Any] = {}


def configure(service_name: str) -> bool:
    """Turns tracing on when an OTLP endpoint is configured; True if it is on.

    OTEL_SERVICE_NAME, when set, names the service instead of `service_name`.
    """
    global enabled, _provider, _tracer, _current_span, _extract
    if enabled:
        return True
    if not any(os.environ.get(name) for name in ENDPOINT_VARIABLES):
        return False
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    name = os.environ.get("OTEL_SERVICE_NAME") or service_name
    # Stopped by `shutdown()` within its bound, not again at exit without one.
    provider = TracerProvider(
        resource=Resource.create({SERVICE_NAME: name}), shutdown_on_exit=False
    )
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    propagator = TraceContextTextMapPropagator()

    def extract(traceparent: str) -> Context:
        return propagator.extract({"traceparent": traceparent})

    _kinds.update({kind.name.lower(): kind for kind in trace.SpanKind})
    _provider = provider
    _tracer = provider.get_tracer("conveyor")
    _current_span = trace.get_current_span
    _extract = extract
    enabled = True
    log.info("tracing on: spans exported over OTLP/HTTP", extra={"service": name})
    return True


def shutdown() -> None:
    """Exports the spans still buffered, then stops: blocking, SHUTDOWN_EXPORT_SECONDS at most.

    The SDK waits up to 30 s for its export thread: a collector that takes connections and never
    answers held a dispatcher's SIGTERM 30 s, and a gateway's 31 s, past SPEC §7.1's few seconds
    (found by a black-box sweep). What is not exported by then is dropped (the SDK's threads are
    daemons: they end with the process)."""
    global enabled, _provider, _tracer
    provider, _provider = _provider, None
    enabled = False
    _tracer = None
    if provider is None:
        return
    stopping = threading.Thread(target=provider.shutdown, name="tracing-shutdown", daemon=True)
    stopping.start()  # flushes the BatchSpanProcessor first
    stopping.join(SHUTDOWN_EXPORT_SECONDS)
    if stopping.is_alive():
        log.warning("spans not exported within the stop's bound: dropped")


def span(
    name: str,
    parent: str | None = None,
    attributes: Attributes | None = None,
    kind: Kind = "internal",
) -> AbstractContextManager[object]:
    """A span around a `with` block, current inside it: the child of `parent` (a traceparent)
    when given, else of the current span. A shared no-op when tracing is off."""
    if not enabled or _tracer is None:
        return _NO_SPAN
    return _exported_safely(
        _tracer.start_as_current_span(
            name,
            context=_parent(parent),
            kind=_kinds[kind],
            attributes=attributes,
            record_exception=False,
            set_status_on_exception=False,
        )
    )


@contextlib.contextmanager
def _exported_safely(made: AbstractContextManager[Any]) -> Iterator[object]:
    """OpenTelemetry would record an exception's `str` and traceback; a database error's quotes
    the row it refused (a task's body, its callback URL), and spans leave the cluster. The
    span says what the log says instead (`conveyor.logs.describe`)."""
    from opentelemetry.trace import Status, StatusCode

    with made as current:
        try:
            yield current
        except Exception as exc:
            said = logs.describe(exc, 500)
            current.add_event(
                "exception",
                {"exception.type": type(exc).__qualname__, "exception.message": said},
            )
            current.set_status(Status(StatusCode.ERROR, said))
            raise


def record(
    name: str,
    parent: str | None,
    start_ns: int,
    end_ns: int,
    attributes: Attributes | None = None,
    kind: Kind = "internal",
) -> None:
    """A span that already happened (e.g. one task's share of a batch), from `time.time_ns()`
    readings."""
    if not enabled or _tracer is None:
        return
    made = _tracer.start_span(
        name, context=_parent(parent), kind=_kinds[kind], attributes=attributes, start_time=start_ns
    )
    made.end(end_time=end_ns)


class Root:
    """A span that begins a trace of its own, linked to the span it came from: one task of a
    batch, so that each task has its own trace (SPEC §11.6) and a batch of 1,000 is not one
    trace of 1,000 tasks. Ended by its owner; every method is a no-op when tracing is off."""

    def __init__(self, made: Span | None = None) -> None:
        self._span = made

    @property
    def traceparent(self) -> str | None:
        if self._span is None:
            return None
        return _traceparent_of(self._span)

    def annotate(self, key: str, value: str | int | float | bool) -> None:
        if self._span is not None:
            self._span.set_attribute(key, value)

    def end(self) -> None:
        if self._span is not None:
            self._span.end()


def root(name: str, linked: str | None, attributes: Attributes | None = None) -> Root:
    """A new trace's first span, with a link to `linked` (a traceparent) when given."""
    if not enabled or _tracer is None or _extract is None:
        return Root()
    from opentelemetry.context import Context
    from opentelemetry.trace import Link, get_current_span

    links = None
    if linked is not None:
        links = [Link(get_current_span(_extract(linked)).get_span_context())]
    return Root(_tracer.start_span(name, context=Context(), attributes=attributes, links=links))


def current() -> str | None:
    """The current span as a traceparent, to hand on; None when tracing is off."""
    if not enabled or _current_span is None:
        return None
    return _traceparent_of(_current_span())


def _traceparent_of(made: Span) -> str | None:
    context = made.get_span_context()
    if not context.is_valid:
        return None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def annotate(key: str, value: str | int | float | bool) -> None:
    """Sets an attribute on the current span (e.g. a task id known only once it exists)."""
    if not enabled or _current_span is None:
        return
    _current_span().set_attribute(key, value)


def failed(message: str) -> None:
    """Marks the current span as failed (an outcome that is not an exception)."""
    if not enabled or _current_span is None:
        return
    from opentelemetry.trace import Status, StatusCode

    _current_span().set_status(Status(StatusCode.ERROR, message[:500]))


def checked(traceparent: str | None) -> str | None:
    """A traceparent worth passing on and storing, or None (absent, malformed, oversized)."""
    if not traceparent or len(traceparent) > _MAX_TRACEPARENT:
        return None
    return traceparent if _TRACEPARENT.fullmatch(traceparent) else None


def _parent(traceparent: str | None) -> Context | None:
    if traceparent is None or _extract is None:
        return None  # the current context
    return _extract(traceparent)
