"""Callbacks (SPEC §3.3) against a real HTTP server: retries, signature, outcome, restarts.

The consumer's endpoint is a local server that records every request and
answers from a script (e.g. 500, 500, then 200). It is addressed as
`http://localhost:<port>` because the test gateways allow-list `localhost`
and plain http; any other loopback spelling is refused by the SSRF guard.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import pytest

from conveyor import topology
from conveyor.events import EventKind, TaskEvent, encode_event
from conveyor.headers import SIGNATURE as SIGNATURE_HEADER
from conveyor.signatures import verify
from gateway.callbacks import CallbackPolicy
from gateway.notifier import Notifier
from gateway.pgpool import CONNECTION_ERRORS, Pool
from tests.support.amqp import (
    own_gateway,
    publish,
    queues_of,
    remove_service,
    scratch_database,
    wait_for_queues,
    wait_until,
)
from tests.support.gateway import SIGNING_SECRET as SECRET
from tests.support.gateway import GatewayProcess, Platform, Service, gateway_env
from tests.support.processes import Processes
from tests.support.tcpproxy import TcpProxy


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes


# Hostile answers a script may hold instead of a status.
HANG = "hang"  # read the request, never answer
TRICKLE = "trickle"  # the status line, one byte a second
ENDLESS = "endless"  # 200, then a body that never ends


@dataclass
class Hook:
    """A consumer's callback endpoint: answers `script` in turn, then its last answer."""

    script: list[int | str]
    location: str | None = None
    received: list[Received] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def answer(self, request: Received) -> int | str:
        with self.lock:
            self.received.append(request)
            return self.script[min(len(self.received), len(self.script)) - 1]

    def requests(self) -> list[Received]:
        with self.lock:
            return list(self.received)


def _handler(hook: Hook) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", 0))
            request = Received(self.path, dict(self.headers.items()), self.rfile.read(length))
            status = hook.answer(request)
            if isinstance(status, str):
                self._hostile(status)
                return
            self.send_response(status)
            if hook.location and 300 <= status < 400:
                self.send_header("Location", hook.location)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _hostile(self, kind: str) -> None:
            try:
                if kind == HANG:
                    time.sleep(120)
                elif kind == TRICKLE:
                    for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n":
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                        time.sleep(1)
                elif kind == ENDLESS:
                    self.send_response(200)
                    self.end_headers()
                    while True:
                        self.wfile.write(b"x" * 65536)
            except OSError:
                pass  # the notifier hung up: what it should do

        def log_message(self, *args: Any) -> None:
            pass

    return Handler


@pytest.fixture
def serve() -> Iterator[Any]:
    servers: list[ThreadingHTTPServer] = []

    def start(*script: int | str, redirect_to: str | None = None) -> tuple[Hook, int]:
        hook = Hook(list(script))
        server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hook))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        port = server.server_address[1]
        if redirect_to is not None:
            hook.location = f"http://localhost:{port}{redirect_to}"
        return hook, port

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def svc(platform: Platform, amqp_url: str, gateway: GatewayProcess) -> Iterator[Service]:
    service = platform.service()
    wait_for_queues(amqp_url, queues_of(service.queue_name))
    yield service
    remove_service(platform, amqp_url, service)


# -- helpers -------------------------------------------------------------------


def _submit(gateway: GatewayProcess, svc: Service, url: str) -> str:
    with gateway.http(svc.clients[0]) as http:
        answer = http.post(
            gateway.tasks_url(svc.name),
            json={"body": {"n": 1}, "callback": {"type": "http", "url": url}},
        )
    assert answer.status_code == 201, answer.text
    return answer.json()["data"]["taskId"]


def _succeed(amqp_url: str, svc: Service, task_id: str, response: Any) -> None:
    """Drives the task to SUCCESS as a dispatcher would: started, then succeeded."""
    attempt = str(uuid.uuid4())
    events = [
        TaskEvent(EventKind.STARTED, task_id, host="worker-1", attempt=attempt),
        TaskEvent(EventKind.SUCCEEDED, task_id, response=response, attempt=attempt),
    ]
    for event in events:
        publish(amqp_url, topology.out_queue(svc.queue_name), [encode_event(event, svc.name)])


def _notification(platform: Platform, task_id: str) -> str | None:
    rows = platform.sql(
        "SELECT notification_status FROM tasks WHERE task_id = %(t)s", {"t": task_id}
    )
    return rows[0][0]


def _wait_notified(platform: Platform, task_id: str, timeout: float = 15.0) -> str:
    """Waits for the notifier to record an outcome; returns it."""
    return wait_until(
        lambda: (status := _notification(platform, task_id)) in ("SUCCESS", "FAILURE") and status,
        timeout,
        what=f"notification of {task_id} recorded",
    )


def _finish_by_sql(platform: Platform, task_id: str, callback_url: str | None = None) -> None:
    """The row a crash leaves behind: finished, its notification still PENDING."""
    platform.sql(
        """
        UPDATE tasks SET status = 'SUCCESS', start_date = now(), end_date = now(), progress = 100,
               response = '{"done": true}', notification_status = 'PENDING',
               callback = COALESCE(%(cb)s::jsonb, callback)
         WHERE task_id = %(t)s
        """,
        {
            "t": task_id,
            "cb": json.dumps({"type": "http", "url": callback_url}) if callback_url else None,
        },
    )


# -- tests ---------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_callback_retried_then_delivered_and_signed(
    gateway: GatewayProcess, svc: Service, platform: Platform, amqp_url: str, serve: Any
) -> None:
    hook, port = serve(500, 500, 200)
    task_id = _submit(gateway, svc, f"http://localhost:{port}/hook?x=1")

    _succeed(amqp_url, svc, task_id, {"thumbnail": "done"})

    assert _wait_notified(platform, task_id) == "SUCCESS"
    received = hook.requests()
    assert len(received) == 3
    assert {r.path for r in received} == {"/hook?x=1"}
    with gateway.http(svc.clients[0]) as http:
        polled = http.get(f"{gateway.tasks_url(svc.name)}/{task_id}").json()["data"]
    last = received[-1]
    assert json.loads(last.body) == polled
    assert polled["status"] == "SUCCESS" and polled["response"] == {"thumbnail": "done"}
    assert last.headers["Content-Type"] == "application/json"
    signature = last.headers[SIGNATURE_HEADER]
    assert verify(SECRET, last.body, signature)
    assert not verify(SECRET, last.body.replace(b"done", b"dona"), signature)
    assert not verify("another-secret", last.body, signature)


@pytest.mark.timeout(60)
def test_callback_failing_every_time_is_recorded_after_three_attempts(
    gateway: GatewayProcess, svc: Service, platform: Platform, amqp_url: str, serve: Any
) -> None:
    hook, port = serve(500)
    task_id = _submit(gateway, svc, f"http://localhost:{port}/hook")

    _succeed(amqp_url, svc, task_id, {"n": 1})

    assert _wait_notified(platform, task_id) == "FAILURE"
    assert len(hook.requests()) == 3


@pytest.mark.timeout(60)
def test_redirect_is_not_followed(
    gateway: GatewayProcess, svc: Service, platform: Platform, amqp_url: str, serve: Any
) -> None:
    hook, port = serve(302, redirect_to="/elsewhere")
    task_id = _submit(gateway, svc, f"http://localhost:{port}/hook")

    _succeed(amqp_url, svc, task_id, {"n": 1})

    assert _wait_notified(platform, task_id) == "FAILURE"
    paths = [r.path for r in hook.requests()]
    assert paths == ["/hook"] * 3  # never "/elsewhere"


@pytest.mark.timeout(60)
def test_address_forbidden_at_delivery_is_never_called(
    gateway: GatewayProcess, svc: Service, platform: Platform, serve: Any
) -> None:
    """Accepted at submission as `localhost`; by delivery time it reads as a loopback address."""
    hook, port = serve(200)
    task_id = _submit(gateway, svc, f"http://localhost:{port}/hook")

    _finish_by_sql(platform, task_id, callback_url=f"http://127.0.0.1:{port}/hook")

    assert _wait_notified(platform, task_id) == "FAILURE"
    assert hook.requests() == []


@pytest.mark.timeout(90)
def test_pending_notification_survives_a_restart(
    database_url: str, amqp_url: str, procs: Processes, serve: Any
) -> None:
    """On a database of its own, so that no other gateway delivers it in the meantime."""
    hook, port = serve(200)
    with scratch_database(database_url) as url:
        platform = Platform(url)
        svc = platform.service()
        env = gateway_env(url, amqp_url)
        try:
            first = GatewayProcess(procs, env, "gateway-before")
            wait_for_queues(amqp_url, queues_of(svc.queue_name))
            task_id = _submit(first, svc, f"http://localhost:{port}/hook")
            first.proc.signal(signal.SIGKILL)
            first.proc.wait(timeout=10)

            _finish_by_sql(platform, task_id)
            assert _notification(platform, task_id) == "PENDING"
            assert hook.requests() == []

            GatewayProcess(procs, env, "gateway-after")
            assert _wait_notified(platform, task_id) == "SUCCESS"
            (request,) = hook.requests()
            assert json.loads(request.body)["taskId"] == task_id
            assert verify(SECRET, request.body, request.headers[SIGNATURE_HEADER])
        finally:
            procs.stop_all()
            remove_service(platform, amqp_url, svc)


@pytest.mark.timeout(90)
def test_a_callback_is_signed_with_both_secrets_while_one_is_rotated_out(
    database_url: str, amqp_url: str, procs: Processes, serve: Any
) -> None:
    """Rotating the signing secret: with CONVEYOR_CALLBACK_PREVIOUS_SIGNING_SECRET set, each
    call carries a `v1` signature per secret (Stripe's scheme while a secret is rolled), so a
    consumer still verifying with the old one and one already on the new one both accept it.
    Before, changing the secret broke every consumer until it changed its own at that very
    moment."""
    hook, port = serve(200)
    old = f"old-signing-{uuid.uuid4().hex}"
    with _notifier(
        database_url, amqp_url, procs, CONVEYOR_CALLBACK_PREVIOUS_SIGNING_SECRET=old
    ) as (gateway, platform, svc):
        task_id = _submit(gateway, svc, f"http://localhost:{port}/hook")
        _succeed(amqp_url, svc, task_id, {"ok": True})
        assert _wait_notified(platform, task_id) == "SUCCESS"
    (request,) = hook.requests()
    signature = request.headers[SIGNATURE_HEADER]
    assert signature.count("v1=") == 2, signature
    assert verify(SECRET, request.body, signature)
    assert verify(old, request.body, signature)
    assert not verify(f"other-{uuid.uuid4().hex}", request.body, signature)
    assert not verify(old, request.body + b" ", signature)


# -- hostile targets, bad URLs, dead replicas ------------------------------------


@contextmanager
def _notifier(
    database_url: str, amqp_url: str, procs: Processes, **settings: str
) -> Iterator[tuple[GatewayProcess, Platform, Service]]:
    """A gateway of its own on a scratch database, its notifier tuned by `settings`."""
    settings = {"CONVEYOR_CALLBACK_BACKOFF": "0.1", **settings}
    with own_gateway(database_url, amqp_url, procs, "gateway-notifier", **settings) as own:
        gateway, svc, platform = own
        yield gateway, platform, svc


@pytest.mark.timeout(90)
def test_a_slow_target_delays_no_other_callback(
    database_url: str, amqp_url: str, procs: Processes, serve: Any
) -> None:
    """A trickling, a hanging and an endless target, and a normal one: the normal one is
    delivered at once; the slow ones end after their attempts, each bounded by the timeout."""
    trickle, trickle_port = serve(TRICKLE)
    hang, hang_port = serve(HANG)
    _, endless_port = serve(ENDLESS)
    _, fast_port = serve(200)
    settings = {"CONVEYOR_CALLBACK_TIMEOUT": "2", "CONVEYOR_CALLBACK_ATTEMPTS": "2"}
    with _notifier(database_url, amqp_url, procs, **settings) as (gateway, platform, svc):
        slow = [
            _submit(gateway, svc, f"http://localhost:{port}/hook")
            for port in (trickle_port, hang_port)
        ]
        unread = _submit(gateway, svc, f"http://localhost:{endless_port}/hook")
        normal = _submit(gateway, svc, f"http://localhost:{fast_port}/hook")
        for task_id in (*slow, unread, normal):
            _finish_by_sql(platform, task_id)

        assert _wait_notified(platform, normal) == "SUCCESS"
        assert [_notification(platform, t) for t in slow] == ["PENDING", "PENDING"]
        assert _wait_notified(platform, unread) == "SUCCESS"  # the status is enough
        for task_id in slow:
            assert _wait_notified(platform, task_id, timeout=30) == "FAILURE"
        assert len(trickle.requests()) == len(hang.requests()) == 2


@pytest.mark.timeout(90)
def test_a_dead_target_with_many_tasks_delays_no_other_consumer(
    database_url: str, amqp_url: str, procs: Processes, serve: Any
) -> None:
    """Found by a sweep: one consumer whose endpoint hangs, with more finished tasks than the
    notifier has slots, held every slot for attempts x timeout, so another consumer's
    callback waited about a minute behind them (27 minutes behind 1,000). A target now has
    `CALLBACK_PER_TARGET` slots for sure, and beyond them only those that leave as many free
    for the others: here 10 - 3 = 7 of 10, and the other consumer's callback goes out at once."""
    hang, hang_port = serve(HANG)
    fast, fast_port = serve(200)
    settings = {
        "CONVEYOR_CALLBACK_TIMEOUT": "8",
        "CONVEYOR_CALLBACK_ATTEMPTS": "2",
        "CONVEYOR_CALLBACK_CONCURRENCY": "10",
        "CONVEYOR_CALLBACK_PER_TARGET": "3",
    }
    with _notifier(database_url, amqp_url, procs, **settings) as (gateway, platform, svc):
        dead = [_submit(gateway, svc, f"http://localhost:{hang_port}/hook") for _ in range(30)]
        normal = _submit(gateway, svc, f"http://localhost:{fast_port}/hook")
        for task_id in dead:
            _finish_by_sql(platform, task_id)
        # The dead target's callbacks are under way: 7 of them, not more (one consumer alone
        # gets most of the slots). Waited for, not slept on: CI's machine took over a second.
        wait_until(lambda: len(hang.requests()) >= 7, timeout=5, what="7 calls to the dead target")
        time.sleep(0.3)  # an eighth, were the bound wrong, would have started by now
        assert len(hang.requests()) == 7
        _finish_by_sql(platform, normal)

        assert _wait_notified(platform, normal, timeout=5) == "SUCCESS"
        assert len(fast.requests()) == 1
        assert len(hang.requests()) == 7


def test_a_callback_url_with_a_control_character_is_refused_at_submission(
    gateway: GatewayProcess, svc: Service
) -> None:
    with gateway.http(svc.clients[0]) as http:
        answer = http.post(
            gateway.tasks_url(svc.name),
            json={"body": {}, "callback": {"type": "http", "url": "http://localhost/a\x01"}},
        )
    assert answer.status_code == 400
    assert answer.json()["error"]["number"] == 400002
    assert answer.json()["error"]["errors"][0]["path"] == "callback/url"


@pytest.mark.timeout(60)
def test_a_stored_url_that_cannot_be_sent_is_recorded_as_failed(
    gateway: GatewayProcess, svc: Service, platform: Platform, serve: Any
) -> None:
    """A row written before URLs were checked this way: its notification still ends."""
    hook, port = serve(200)
    task_id = _submit(gateway, svc, f"http://localhost:{port}/hook")
    _finish_by_sql(platform, task_id, callback_url=f"http://localhost:{port}/a\x01")
    assert _wait_notified(platform, task_id) == "FAILURE"
    assert hook.requests() == []


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("stop", "lease"),
    [
        pytest.param(signal.SIGKILL, "3", id="killed: within its lease"),
        # Found by a sweep: a replica stopped for a deploy kept its claims, and their
        # callbacks waited out the rest of the lease. It gives them back as it stops.
        pytest.param(signal.SIGTERM, "60", id="stopped: at once"),
    ],
)
def test_callbacks_of_a_replica_that_stops_go_out_again(
    database_url: str, amqp_url: str, procs: Processes, serve: Any, stop: int, lease: str
) -> None:
    hook, port = serve(HANG, 200)
    with scratch_database(database_url) as url:
        platform = Platform(url)
        svc = platform.service()
        env = gateway_env(
            url, amqp_url, CONVEYOR_CALLBACK_LEASE=lease, CONVEYOR_CALLBACK_TIMEOUT="60"
        )
        try:
            first = GatewayProcess(procs, env, "gateway-dies")
            wait_for_queues(amqp_url, queues_of(svc.queue_name))
            task_id = _submit(first, svc, f"http://localhost:{port}/hook")
            _finish_by_sql(platform, task_id)
            wait_until(lambda: hook.requests(), 15, what="the first delivery under way")
            time.sleep(4)  # longer than a 3 s lease: it must have been renewed meanwhile
            assert _notification(platform, task_id) == "PENDING"
            first.proc.signal(stop)
            first.proc.wait(timeout=15)

            GatewayProcess(procs, env, "gateway-takes-over")
            assert _wait_notified(platform, task_id, timeout=15) == "SUCCESS"
            assert len(hook.requests()) == 2  # the lease was renewed: no second sender before
        finally:
            procs.stop_all()
            remove_service(platform, amqp_url, svc)


@pytest.mark.timeout(120)
def test_a_replica_frozen_between_attempts_does_not_send_what_another_delivered(
    database_url: str, amqp_url: str, procs: Processes, serve: Any
) -> None:
    """Found by a sweep: a replica frozen (SIGSTOP) while it waited to try a callback again
    lost its claim to another replica, which delivered it; thawed, it sent the callback once
    more. A replica now checks that the claim is still its own before each attempt after the
    first (and records an outcome only for its own claim)."""
    hook, port = serve(500, 200)
    with scratch_database(database_url) as url:
        platform = Platform(url)
        svc = platform.service()
        env = gateway_env(url, amqp_url, CONVEYOR_CALLBACK_LEASE="3", CONVEYOR_CALLBACK_BACKOFF="4")
        try:
            first = GatewayProcess(procs, env, "gateway-frozen")
            wait_for_queues(amqp_url, queues_of(svc.queue_name))
            task_id = _submit(first, svc, f"http://localhost:{port}/hook")
            _finish_by_sql(platform, task_id)
            wait_until(lambda: hook.requests(), 15, what="the first attempt, answered 500")
            first.proc.signal(signal.SIGSTOP)
            try:
                GatewayProcess(procs, env, "gateway-takes-over")
                assert _wait_notified(platform, task_id, timeout=30) == "SUCCESS"
            finally:
                first.proc.signal(signal.SIGCONT)
            time.sleep(5)  # past the frozen replica's 4 s backoff: it would have tried again
            assert len(hook.requests()) == 2
            assert first.proc.alive()
        finally:
            procs.stop_all()
            remove_service(platform, amqp_url, svc)


@pytest.mark.timeout(60)
def test_a_claim_sent_as_the_database_froze_leases_no_callback_at_the_thaw(
    database_url: str, amqp_url: str
) -> None:
    """Found by a sweep: the notifier's claim sent as the database froze was run at the thaw
    (autocommit) on a connection the gateway had given up: the callback it took stayed leased
    for the claim's 30 s, and went out 30 s after the thaw. It now commits only once its rows
    were read, so a claim nobody reads is rolled back."""
    upstream = urlsplit(database_url)
    proxy = TcpProxy(upstream.hostname or "127.0.0.1", upstream.port or 5432)
    with scratch_database(database_url) as url:
        platform = Platform(url)
        svc = platform.service()
        (task_id,) = platform.sql(
            "INSERT INTO tasks (task_id, client_id, service, request, status, end_date,"
            " callback, notification_status) VALUES (gen_random_uuid(), %(c)s, %(s)s, '{}',"
            " 'SUCCESS', now(), %(cb)s, 'PENDING') RETURNING task_id",
            {
                "c": svc.clients[0].client_id,
                "s": svc.name,
                "cb": json.dumps({"type": "http", "url": "http://localhost:9/hook"}),
            },
        )[0]

        async def claim_as_it_freezes() -> None:
            pool = Pool(proxy.url(url), size=1, ping_after=3600, use_timeout=1.0)
            notifier = Notifier(pool, CallbackPolicy(allow_http=True), SECRET)
            try:
                async with pool.connection() as conn:  # connected before the freeze
                    await conn.execute("SELECT 1")
                proxy.pause()
                with pytest.raises(CONNECTION_ERRORS):
                    await notifier.claim()  # waits in its socket; given up after 1 s
            finally:
                proxy.resume()
                await pool.close()

        try:
            asyncio.run(claim_as_it_freezes())
            time.sleep(1.0)  # the server has read the claim, and the connection's end
            claims = "SELECT notification_attempts, notify_claimed_until FROM tasks"
            assert platform.sql(f"{claims} WHERE task_id = %(t)s", {"t": task_id}) == [(0, None)]
        finally:
            proxy.close()
            remove_service(platform, amqp_url, svc)
