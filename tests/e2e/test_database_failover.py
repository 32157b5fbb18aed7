"""A PostgreSQL primary SIGKILLed and its synchronous standby promoted (SPEC §11.7), with
Conveyor given both hosts in libpq's way: nothing accepted is lost, every task ends SUCCESS.

A pair of the test's own (other ports, own data directories), killed by pid.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from conveyor import topology
from tests.e2e.conftest import Stack
from tests.support.amqp import collect, queues_of, remove_service, wait_for_queues
from tests.support.gateway import GatewayProcess, Platform, gateway_env, upgrade_database
from tests.support.processes import Processes
from tests.support.servers import PostgresServer, postgres_available


@pytest.fixture
def pair() -> Iterator[tuple[PostgresServer, PostgresServer]]:
    if not postgres_available():
        pytest.skip("PostgreSQL server binaries are not installed here")
    primary = PostgresServer().start()
    standby = PostgresServer(primary=primary).start()
    primary.synchronous()  # a commit is acknowledged once the standby has it
    yield primary, standby
    standby.stop()
    primary.stop()


def _submit(http: httpx.Client, url: str, timeout: float = 60) -> str | None:
    """As a client does: retried while the API answers 503 (the database is moving)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            answer = http.post(url, json={"body": {"sleep": 0.05}})
        except httpx.TransportError:
            answer = None
        if answer is not None and answer.status_code in (200, 201):
            return str(answer.json()["data"]["taskId"])
        assert answer is None or answer.status_code == 503, answer.text
        time.sleep(0.3)
    return None


@pytest.mark.timeout(300)
def test_a_primary_failover_loses_no_task(
    pair: tuple[PostgresServer, PostgresServer],
    procs: Processes,
    amqp_url: str,
    sleeper_url: str,
) -> None:
    primary, standby = pair
    url = (
        "postgresql://postgres@/conveyor?host=127.0.0.1,127.0.0.1"
        f"&port={primary.port},{standby.port}&target_session_attrs=read-write&connect_timeout=3"
    )
    upgrade_database(url)
    service = Platform(url).service(
        jsonSchema={"type": "object", "required": ["sleep"]}, taskTimeout=60, maxAttempts=3
    )
    gateway = GatewayProcess(procs, gateway_env(url, amqp_url), "gateway-failover")
    stack = Stack(procs, gateway, sleeper_url, amqp_url, service)
    stack.dispatcher("failover-pod", CONCURRENCY="8")
    tasks_url = gateway.tasks_url(service.name)

    accepted = [_submit(stack.http, tasks_url) for _ in range(40)]
    primary.kill()
    standby.promote()
    accepted += [_submit(stack.http, tasks_url) for _ in range(40)]
    assert None not in accepted, "the API did not come back after the failover"

    deadline = time.monotonic() + 120
    statuses: Counter[str] = Counter()
    while time.monotonic() < deadline:
        try:
            statuses = Counter(stack.poll(str(t))["status"] for t in accepted)
        except AssertionError:  # a 503 while a pool reconnects
            statuses = Counter()
        if statuses["SUCCESS"] == len(accepted):
            break
        time.sleep(0.5)
    stack.http.close()
    assert statuses == Counter({"SUCCESS": 80})


def _family(pid: int) -> list[int]:
    """`pid` and its descendants (a postmaster and its backends), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            children.setdefault(int(stat.rpartition(")")[2].split()[1]), []).append(int(entry))
    family, todo = [], [pid]
    while todo:
        member = todo.pop()
        family.append(member)
        todo.extend(children.get(member, []))
    return family


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # a backend that has just ended
            os.kill(pid, sig)


@pytest.fixture
def server() -> Iterator[PostgresServer]:
    if not postgres_available():
        pytest.skip("PostgreSQL server binaries are not installed here")
    pg = PostgresServer().start()
    yield pg
    pg.stop()


@pytest.mark.timeout(180)
def test_a_frozen_database_is_answered_503_not_waited_for(
    server: PostgresServer, procs: Processes, amqp_url: str
) -> None:
    """Found by a sweep: with PostgreSQL frozen (SIGSTOP; a silent partition is the same),
    a submission waited for as long as the freeze, 90 s, with no answer. A connection is now
    lent for CONVEYOR_DB_TIMEOUT at most: the submission is answered 503 503001 with
    Retry-After, no traceback is logged, and it goes through once the server thaws."""
    url = f"postgresql://postgres@127.0.0.1:{server.port}/conveyor?connect_timeout=3"
    upgrade_database(url)
    service = Platform(url).service()
    gateway = GatewayProcess(
        procs, gateway_env(url, amqp_url, CONVEYOR_DB_TIMEOUT="2"), "gateway-frozen-db"
    )
    tasks_url = gateway.tasks_url(service.name)
    with gateway.http(service.clients[0]) as http:
        assert http.post(tasks_url, json={"body": {}}).status_code == 201
        assert server.pid is not None
        frozen = _family(server.pid)
        _signal(frozen, signal.SIGSTOP)
        try:
            started = time.monotonic()
            answer = http.post(tasks_url, json={"body": {}}, timeout=30)
            waited = time.monotonic() - started
        finally:
            _signal(frozen, signal.SIGCONT)
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["number"] == 503001
        assert answer.headers["retry-after"] == "1"
        assert waited < 10, waited
        assert _submit(http, tasks_url, timeout=30) is not None  # thawed: accepted again
    logs = gateway.proc.logs()
    assert "Exception in ASGI application" not in logs and "unexpected error" not in logs


def _ready(http: httpx.Client) -> tuple[int, bool | None]:
    answer = http.get("/readyz", timeout=10)
    return answer.status_code, answer.json()["data"]["checks"]["database"]


@pytest.mark.timeout(180)
def test_readiness_says_a_synchronous_standby_is_missing(
    pair: tuple[PostgresServer, PostgresServer], procs: Processes, amqp_url: str
) -> None:
    """Found by a black-box sweep: with the synchronous standby gone, every commit waits for
    it (each submission answered 503 after DB_TIMEOUT) while a read does not, and /readyz
    said 200 with `database: true` for the whole outage. It now says 503 `database: false`
    until the standby is back."""
    primary, standby = pair
    url = f"postgresql://postgres@127.0.0.1:{primary.port}/conveyor?connect_timeout=3"
    upgrade_database(url)
    gateway = GatewayProcess(
        procs, gateway_env(url, amqp_url, CONVEYOR_DB_TIMEOUT="3"), "gateway-standby-away"
    )
    with gateway.http() as http:
        deadline = time.monotonic() + 30  # its loops connect after it answers: ready soon after
        while (seen := _ready(http)) != (200, True) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert seen == (200, True)
        standby.kill()
        deadline = time.monotonic() + 30
        while (seen := _ready(http)) != (503, False) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert seen == (503, False)
        standby.start()
        deadline = time.monotonic() + 60
        while (seen := _ready(http)) != (200, True) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert seen == (200, True)
    logs = gateway.proc.logs()
    assert "Traceback" not in logs, logs[-3000:]


@pytest.mark.timeout(180)
def test_a_claim_made_while_the_synchronous_standby_is_frozen_leases_nothing_by_nobody(
    pair: tuple[PostgresServer, PostgresServer], procs: Processes, amqp_url: str
) -> None:
    """Found by a sweep: with the synchronous standby frozen, the relay's claims committed on
    the primary, visible there, then waited for the standby until the gateway gave them up:
    a run-later task due meanwhile stayed leased 30 s by nobody, and ran 20-70 s late (the
    notifier's callbacks too). A claim's commit waits for no standby now."""
    primary, standby = pair
    url = f"postgresql://postgres@127.0.0.1:{primary.port}/conveyor?connect_timeout=3"
    upgrade_database(url)
    platform = Platform(url)
    service = platform.service()
    env = gateway_env(url, amqp_url, CONVEYOR_DB_TIMEOUT="3")
    gateway = GatewayProcess(procs, env, "gateway-standby-frozen")
    try:
        wait_for_queues(amqp_url, queues_of(service.queue_name))
        with gateway.http(service.clients[0]) as http:
            body = {"body": {}, "delaySeconds": 3}
            answer = http.post(gateway.tasks_url(service.name), json=body)
            assert answer.status_code == 201, answer.text
        assert standby.pid is not None
        frozen = _family(standby.pid)
        _signal(frozen, signal.SIGSTOP)
        try:
            time.sleep(8)  # due 3 s in; the relay's claims since met the frozen standby
        finally:
            _signal(frozen, signal.SIGCONT)
        thawed = time.monotonic()
        in_queue = topology.in_queue(service.queue_name)
        assert len(collect(amqp_url, in_queue, expected=1, timeout=30)) == 1
        assert time.monotonic() - thawed < 10  # not a lease's 30 s
    finally:
        procs.stop_all()
        remove_service(platform, amqp_url, service)
