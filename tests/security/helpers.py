"""Helpers for the security tests.

The error envelope, raw HTTP over sockets, a liveness check, polling, a
recording HTTP server (callbacks, redirects) and a worker-like publisher.
"""

from __future__ import annotations

import base64
import json
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TypeVar

import aio_pika
import httpx

from conveyor import topology
from conveyor.events import EventKind, TaskEvent, WireMessage, encode_event
from tests.support.gateway import Client, GatewayProcess, Service, run_sync

T = TypeVar("T")


def error_number(answer: httpx.Response) -> tuple[int, int]:
    """(http status, envelope number) of an error answer; fails on any other shape."""
    assert answer.headers["content-type"].startswith("application/json"), answer.headers
    payload = answer.json()
    assert payload["status"] == "error", payload
    assert isinstance(payload["error"]["number"], int), payload
    assert isinstance(payload["error"]["description"], str), payload
    return answer.status_code, payload["error"]["number"]


def basic(client_id: str, secret: str) -> str:
    """An `Authorization` value, built by hand so that any bytes can go in it."""
    return "Basic " + base64.b64encode(f"{client_id}:{secret}".encode()).decode()


def still_serving(gateway: GatewayProcess, svc: Service) -> None:
    """The gateway still answers others: a normal submission and /healthz, promptly."""
    with gateway.http(svc.clients[0]) as http:
        created = http.post(gateway.tasks_url(svc.name), json={"body": {"ok": True}}, timeout=5)
        assert created.status_code == 201, created.text
        assert http.get("/healthz", timeout=5).status_code == 200


class RawAnswer:
    """What a raw socket got back: the status line's code, headers, body and timing."""

    def __init__(self, data: bytes, elapsed: float) -> None:
        self.data = data
        self.elapsed = elapsed
        head, _, self.body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        match = re.match(r"HTTP/1\.[01] (\d{3})", lines[0])
        self.status = int(match.group(1)) if match else 0
        self.headers = {
            k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])
        }

    def json_number(self) -> int:
        payload = json.loads(self.body)
        assert payload["status"] == "error", payload
        return payload["error"]["number"]


def _complete(data: bytes) -> bool:
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    match = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    return match is not None and len(body) >= int(match.group(1))


def raw_exchange(
    gateway: GatewayProcess,
    request: bytes,
    *,
    send: Callable[[socket.socket, bytes], None] | None = None,
    timeout: float = 15.0,
) -> RawAnswer:
    """Sends bytes httpx would refuse to send, and reads one answer (or until closed)."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=timeout) as sock:
        try:
            (send or _send_all)(sock, request)
        except OSError:
            pass  # the server may answer and close before it has read everything
        data = b""
        while not _complete(data):
            try:
                chunk = sock.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not chunk:
                break
            data += chunk
    return RawAnswer(data, time.monotonic() - started)


def _send_all(sock: socket.socket, data: bytes) -> None:
    sock.sendall(data)


def request_bytes(
    method: str, path: str, headers: dict[str, str] | list[tuple[str, str]], body: bytes = b""
) -> bytes:
    pairs = headers.items() if isinstance(headers, dict) else headers
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *(f"{k}: {v}" for k, v in pairs)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def auth_header(client: Client) -> str:
    return basic(client.client_id, client.secret)


def wait_until(check: Callable[[], T], timeout: float = 10.0, what: str = "") -> T:
    """Calls `check` until it returns something truthy; returns that, or fails after `timeout`."""
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not true after {timeout}s: {what}")
        time.sleep(0.1)
    return value


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes


class Recorder:
    """A local HTTP server that records every request and answers with a fixed status."""

    def __init__(self, status: int = 200, headers: dict[str, str] | None = None) -> None:
        self.received: list[Received] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                recorder.received.append(Received(self.path, dict(self.headers), body))
                self.send_response(status)
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_POST

            def log_message(self, *_: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Recorder:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.server.shutdown()
        self.server.server_close()


async def _publish(amqp_url: str, queue: str, messages: list[WireMessage]) -> None:
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        for message in messages:
            await channel.default_exchange.publish(
                aio_pika.Message(
                    body=message.body,
                    headers=message.headers or None,
                    content_type=message.content_type,
                    message_id=message.message_id,
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                ),
                routing_key=queue,
                mandatory=True,
            )


def publish(amqp_url: str, queue: str, messages: list[WireMessage]) -> None:
    """Publishes with confirms, as a worker would; a missing queue raises."""
    run_sync(_publish(amqp_url, queue, messages))


def finish_through_rabbitmq(
    gateway: GatewayProcess, amqp_url: str, svc: Service, task_id: str, response: dict
) -> None:
    """Reports `started` then `succeeded` on the service's `-out` queue, as a dispatcher would,
    once the gateway consumes that queue (its log says so)."""
    consuming = f'"service": "{svc.name}"'
    wait_until(lambda: consuming in gateway.proc.logs(), 15, "the gateway consumes results")
    events = [
        TaskEvent(kind=EventKind.STARTED, task_id=task_id, host="worker-1"),
        TaskEvent(kind=EventKind.SUCCEEDED, task_id=task_id, response=response),
    ]
    queue = topology.out_queue(svc.queue_name)
    publish(amqp_url, queue, [encode_event(ev, svc.name) for ev in events])
