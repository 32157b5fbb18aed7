"""A real OTLP/HTTP trace receiver, in a thread: what a collector would get from Conveyor.

`POST /v1/traces` bodies are decoded with the protocol's own protobuf classes
(`ExportTraceServiceRequest`), so a test sees exactly what the exporter sent:
each span with its service (the resource's `service.name`), trace id, span id
and parent. The tracing benchmark uses it as a sink.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.support.processes import free_port


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str  # 32 hex digits, as in a traceparent
    span_id: str
    parent_id: str  # "" for a root span
    attributes: dict[str, Any]
    error: str | None = None  # the status message of a span that ended in error
    links: tuple[tuple[str, str], ...] = ()  # (trace id, span id) of each span it links to


class OtlpReceiver:
    def __init__(self, keep: bool = True) -> None:
        self.port = free_port()
        self.keep = keep  # False: a sink that only counts (a benchmark's thousands of spans)
        self.spans: list[ReceivedSpan] = []
        self.bodies: list[bytes] = []  # every export as sent, to search for what must not be
        self.span_count = 0
        self.requests = 0
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), self._handler())

    @property
    def endpoint(self) -> str:
        """For OTEL_EXPORTER_OTLP_ENDPOINT: the exporter appends `/v1/traces`."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> OtlpReceiver:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def received(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self.spans)

    def wait_for(self, names: set[str], trace_id: str | None = None, timeout: float = 20) -> None:
        """Until spans of every name arrived (in `trace_id` when given), or `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            seen = {s.name for s in self.received() if trace_id in (None, s.trace_id)}
            if names <= seen:
                return
            time.sleep(0.05)

    def _collect(self, body: bytes) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        found = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            service = str(resource.get("service.name", ""))
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    found.append(
                        ReceivedSpan(
                            service=service,
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_id=span.parent_span_id.hex(),
                            attributes=_attributes(span.attributes),
                            error=span.status.message or "error"
                            if span.status.code == span.status.STATUS_CODE_ERROR
                            else None,
                            links=tuple(
                                (link.trace_id.hex(), link.span_id.hex()) for link in span.links
                            ),
                        )
                    )
        with self._lock:
            if self.keep:
                self.spans.extend(found)
                self.bodies.append(body)
            self.span_count += len(found)
            self.requests += 1

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                try:
                    receiver._collect(body)
                except Exception:
                    self.send_response(400)
                    self.end_headers()
                    return
                # An empty ExportTraceServiceResponse: zero bytes of protobuf.
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        return Handler


def _attributes(pairs: Any) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for pair in pairs:
        value = pair.value
        kind = value.WhichOneof("value")
        found[pair.key] = getattr(value, kind) if kind else None
    return found


@contextmanager
def otlp_receiver(keep: bool = True) -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver(keep).start()
    try:
        yield receiver
    finally:
        receiver.stop()
