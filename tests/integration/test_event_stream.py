"""GET …/tasks/{taskId}/events (SPEC §11.3): Server-Sent Events fed by PostgreSQL NOTIFY.

The changes are made in the database, as a results consumer on any replica would make them
(migration 0004's trigger notifies whoever made them); the stream is read from a gateway that
made none of them.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from conveyor.client import AsyncConveyorClient, ConveyorClient, Task, TaskWaitTimeout
from tests.security.helpers import auth_header, request_bytes
from tests.support.amqp import own_gateway, wait_until
from tests.support.gateway import (
    Client,
    GatewayProcess,
    Platform,
    Service,
    fast_hash,
    gateway_env,
)
from tests.support.processes import Processes
from tests.support.servers import PostgresServer
from tests.support.tcpproxy import TcpProxy


def _events_url(gateway: GatewayProcess, service: str, task_id: str) -> str:
    return f"{gateway.tasks_url(service)}/{task_id}/events"


def _submit(gateway: GatewayProcess, svc: Service) -> str:
    with gateway.http(svc.clients[0]) as http:
        answer = http.post(gateway.tasks_url(svc.name), json={"body": {}})
        assert answer.status_code == 201
        return str(answer.json()["data"]["taskId"])


def _set(platform: Platform, task_id: str, **columns: Any) -> None:
    """Changes the row as the gateway's writers do (`gateway.lifecycle`): `updated_at` moves."""
    columns.setdefault("updated_at", "now()")
    assignments = ", ".join(f"{name} = %({name})s" for name in columns)
    platform.sql(f"UPDATE tasks SET {assignments} WHERE task_id = %(t)s", {**columns, "t": task_id})


def _increasing(ids: list[str]) -> bool:
    numbers = [int(i) for i in ids]
    return all(a < b for a, b in itertools.pairwise(numbers))


class Reader:
    """Reads one stream in a thread; `events` fills as they come."""

    def __init__(
        self,
        gateway: GatewayProcess,
        client: Client,
        path: str,
        last_event_id: str | None = None,
    ) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.errors: list[dict[str, Any]] = []  # `event: error`: the poll's envelope
        self.comments = 0
        self.status: int | None = None
        self.ended = threading.Event()
        headers = {} if last_event_id is None else {"Last-Event-ID": last_event_id}
        self.http = httpx.Client(
            base_url=gateway.url, auth=client.auth, timeout=60, headers=headers
        )
        self._thread = threading.Thread(target=self._read, args=(path,), daemon=True)
        self._thread.start()

    def _read(self, path: str) -> None:
        try:
            with self.http.stream("GET", path) as response:
                self.status = response.status_code
                if response.status_code == 204:  # nothing to send
                    return
                assert response.headers["content-type"].startswith("text/event-stream")
                fields: dict[str, str] = {}
                for line in response.iter_lines():
                    if line.startswith(":"):
                        self.comments += 1
                    elif line == "" and fields:
                        if fields.get("event") == "error":
                            self.errors.append(json.loads(fields["data"]))
                        else:
                            self.events.append((fields["id"], json.loads(fields["data"])))
                        fields = {}
                    elif ":" in line:
                        name, _, value = line.partition(":")
                        fields[name] = value.strip()
        except httpx.HTTPError:
            pass
        finally:
            self.ended.set()

    def wait_for(self, count: int, timeout: float = 10) -> list[tuple[str, dict[str, Any]]]:
        deadline = time.monotonic() + timeout
        while len(self.events) < count and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(self.events) >= count, self.events
        return self.events

    def close(self) -> None:
        self.http.close()


@pytest.fixture(scope="module")
def reader_gateway(
    database_url: str, amqp_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    """A second gateway on the same database, with a quick heartbeat; its own metrics; and
    verified secrets kept for longer than any test (a change must not wait for their TTL)."""
    procs = Processes(tmp_path_factory.mktemp("reader"))
    env = gateway_env(
        database_url, amqp_url, CONVEYOR_STREAM_HEARTBEAT="0.5", CONVEYOR_AUTH_CACHE_TTL="600"
    )
    yield GatewayProcess(procs, env, "gateway-reader")
    procs.stop_all()


def test_first_state_then_each_change_then_the_end(
    gateway: GatewayProcess, reader_gateway: GatewayProcess, platform: Platform
) -> None:
    svc = platform.service()
    task_id = _submit(gateway, svc)
    reader = Reader(reader_gateway, svc.clients[0], _events_url(reader_gateway, svc.name, task_id))
    first = reader.wait_for(1)[0]
    assert first[1]["status"] == "PENDING" and first[1]["taskId"] == task_id
    _set(platform, task_id, status="IN_PROGRESS", start_date=time.strftime("%Y-%m-%d %H:%M:%SZ"))
    reader.wait_for(2)
    _set(platform, task_id, progress=42.5)
    reader.wait_for(3)
    time.sleep(1.2)  # quiet: the heartbeat comes every 0.5 s here
    _set(platform, task_id, status="SUCCESS", progress=100, response='{"ok": 1}', end_date="now()")
    events = reader.wait_for(4)
    assert reader.ended.wait(5), "the stream goes on after a terminal state"
    assert _increasing([e[0] for e in events]), events
    assert [(e[1]["status"], e[1]["progress"]) for e in events] == [
        ("PENDING", 0.0),
        ("IN_PROGRESS", 0.0),
        ("IN_PROGRESS", 42.5),
        ("SUCCESS", 100.0),
    ]
    with gateway.http(svc.clients[0]) as http:  # each event is the poll's data
        assert events[-1][1] == http.get(f"{gateway.tasks_url(svc.name)}/{task_id}").json()["data"]
    assert reader.comments >= 1
    reader.close()


def test_a_finished_task_gives_one_event_and_the_end(
    gateway: GatewayProcess, platform: Platform
) -> None:
    svc = platform.service()
    task_id = _submit(gateway, svc)
    _set(platform, task_id, status="FAILURE", error_message="Argh!", end_date="now()")
    reader = Reader(gateway, svc.clients[0], _events_url(gateway, svc.name, task_id))
    assert reader.ended.wait(5)
    assert [(e[1]["status"], e[1]["errorMessage"]) for e in reader.events] == [("FAILURE", "Argh!")]
    reader.close()


def test_a_stream_answers_one_connection_header_the_servers(
    gateway: GatewayProcess, platform: Platform
) -> None:
    """Found by a black-box sweep: a stream asked with `Connection: close` answered both
    `connection: keep-alive` (sse_starlette's) and `connection: close` (the server's). The
    header is the server's to write (RFC 9110 §7.6.1: hop-by-hop)."""
    svc = platform.service()
    task_id = _submit(gateway, svc)
    _set(platform, task_id, status="FAILURE", error_message="Argh!", end_date="now()")
    for asked, answered in (("close", ["close"]), ("keep-alive", [])):
        headers = {"Authorization": auth_header(svc.clients[0]), "Connection": asked}
        path = _events_url(gateway, svc.name, task_id)
        with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as sock:
            sock.sendall(request_bytes("GET", path, headers))
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = sock.recv(65536)
                assert chunk, head
                head += chunk
        lines = head.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
        assert lines[0].startswith("HTTP/1.1 200"), lines
        values = [
            v.strip()
            for k, v in (ln.split(":", 1) for ln in lines[1:])
            if k.lower() == "connection"
        ]
        assert values == answered, lines


def test_a_revoked_grant_ends_the_open_stream(gateway: GatewayProcess, platform: Platform) -> None:
    """A revoked grant is refused by the very next request (the catalog's notification drops
    the cached access); an open stream went on sending its task's changes to the end."""
    svc = platform.service()
    task_id = _submit(gateway, svc)
    reader = Reader(gateway, svc.clients[0], _events_url(gateway, svc.name, task_id))
    reader.wait_for(1)
    platform.sql(
        "DELETE FROM authorizations WHERE client_id = %(c)s AND service = %(s)s",
        {"c": svc.clients[0].client_id, "s": svc.name},
    )
    assert reader.ended.wait(5), "the stream outlives the grant"
    _set(platform, task_id, status="IN_PROGRESS")
    time.sleep(0.5)
    assert [e[1]["status"] for e in reader.events] == ["PENDING"]
    assert [e["error"]["number"] for e in reader.errors] == [403001]  # as the poll answers now
    reader.close()


def test_a_changed_secret_ends_its_stream_among_others_of_the_task(
    reader_gateway: GatewayProcess, platform: Platform
) -> None:
    """A stream opened with a secret since changed stops at once, however many streams its
    task has: the credentials' notification (migration 0016) wakes every stream, and each
    checks its own credentials before it takes a read another led. Only the leader of a read
    checked them, so among 20 streams of a quiet task the old secret's went on for about 20
    heartbeats; and before the notification, until the credential cache's TTL."""
    heartbeat = 0.5  # reader_gateway's beat
    svc = platform.service()
    old = svc.clients[0]
    task_id = _submit(reader_gateway, svc)
    url = _events_url(reader_gateway, svc.name, task_id)
    stale = Reader(reader_gateway, old, url)
    stale.wait_for(1)
    new = Client(old.client_id, uuid.uuid4().hex)
    platform.sql(
        "UPDATE clients SET secret_hash = %(h)s WHERE client_id = %(c)s",
        {"h": fast_hash(new.secret), "c": old.client_id},
    )
    changed = time.monotonic()
    current = [Reader(reader_gateway, new, url) for _ in range(20)]
    for reader in current:
        reader.wait_for(1)
    assert stale.ended.wait(max(0.0, changed + 3.0 - time.monotonic())), (
        f"the old secret's stream goes on {time.monotonic() - changed:.1f} s after the change"
    )
    assert [e["error"]["number"] for e in stale.errors] == [403001]
    assert [e[1]["status"] for e in stale.events] == ["PENDING"]
    time.sleep(2 * heartbeat)  # the others go on: another read each, and the next change
    assert not any(r.ended.is_set() or r.errors for r in current)
    _set(platform, task_id, status="IN_PROGRESS")
    for reader in current:
        assert [e[1]["status"] for e in reader.wait_for(2)] == ["PENDING", "IN_PROGRESS"]
        assert not reader.errors
    for reader in [stale, *current]:
        reader.close()


@pytest.mark.parametrize("gone", ["task purged", "service deleted"])
def test_a_task_that_can_no_longer_be_read_ends_its_stream_with_the_polls_error(
    reader_gateway: GatewayProcess, platform: Platform, gone: str
) -> None:
    """Found by a black-box test: a purged task's stream sent pings forever (a deleted row
    sends no notification), and a stream whose service was deleted ended like a normal end,
    its last event IN_PROGRESS. Each now ends with `event: error`, the poll's envelope: the
    purged row is found missing at the next heartbeat."""
    svc = platform.service()
    task_id = _submit(reader_gateway, svc)
    _set(platform, task_id, status="IN_PROGRESS", start_date="now()")
    reader = _follow(reader_gateway, svc, task_id)
    reader.wait_for(1)
    if gone == "task purged":
        platform.sql("DELETE FROM tasks WHERE task_id = %(t)s", {"t": task_id})
        expected = 404002
    else:
        platform.sql("DELETE FROM services WHERE name = %(s)s", {"s": svc.name})
        expected = 404001
    assert reader.ended.wait(10), "the stream goes on"
    assert [e[1]["status"] for e in reader.events] == ["IN_PROGRESS"]
    assert [e["error"]["number"] for e in reader.errors] == [expected]
    reader.close()


def _follow(gateway: GatewayProcess, svc: Service, task_id: str, **kwargs: Any) -> Reader:
    return Reader(gateway, svc.clients[0], _events_url(gateway, svc.name, task_id), **kwargs)


def test_ids_go_on_increasing_when_the_client_reconnects(
    gateway: GatewayProcess, reader_gateway: GatewayProcess, platform: Platform
) -> None:
    """SPEC §11.3's "increasing `id`" holds across connections: ids used to count 1, 2, 3
    per connection, so a client that reconnected (as EventSource does, on its own or after
    a stopping gateway's `retry`) saw them start again at 1."""
    svc = platform.service()
    task_id = _submit(gateway, svc)
    first = _follow(gateway, svc, task_id)
    first.wait_for(1)
    _set(platform, task_id, status="IN_PROGRESS", start_date="now()")
    before = [e[0] for e in first.wait_for(2)]
    first.close()
    again = _follow(reader_gateway, svc, task_id)  # another replica, as after a deploy
    again.wait_for(1)
    _set(platform, task_id, progress=20)
    after = again.wait_for(2)
    again.close()
    assert [(e[1]["status"], e[1]["progress"]) for e in after] == [
        ("IN_PROGRESS", 0.0),
        ("IN_PROGRESS", 20.0),
    ]
    # The same state has the same id on any connection; each change a greater one.
    assert after[0][0] == before[-1], (before, after)
    assert _increasing([*before, after[1][0]]), (before, after)


def test_a_reconnection_with_last_event_id_gets_no_duplicate_and_the_next_change(
    gateway: GatewayProcess, reader_gateway: GatewayProcess, platform: Platform
) -> None:
    svc = platform.service()
    task_id = _submit(gateway, svc)
    first = _follow(gateway, svc, task_id)
    first.wait_for(1)
    _set(platform, task_id, status="IN_PROGRESS", start_date="now()", progress=10)
    seen = first.wait_for(2)
    first.close()
    last_id = seen[-1][0]
    again = _follow(reader_gateway, svc, task_id, last_event_id=last_id)
    time.sleep(1.0)  # the current state comes at once when it is sent at all
    assert again.events == [], f"the state of id {last_id} was sent again: {again.events}"
    _set(platform, task_id, progress=55)
    (next_id, data), *_ = again.wait_for(1)
    assert data["progress"] == 55.0
    assert int(next_id) > int(last_id)
    _set(platform, task_id, status="SUCCESS", progress=100, response="{}", end_date="now()")
    assert again.ended.wait(5)
    assert [e[1]["status"] for e in again.events] == ["IN_PROGRESS", "SUCCESS"]
    assert _increasing([last_id, *(e[0] for e in again.events)])
    again.close()


def test_the_terminal_event_comes_once_across_reconnections(
    gateway: GatewayProcess, reader_gateway: GatewayProcess, platform: Platform
) -> None:
    """A client that has the end and reconnects (EventSource does, whenever a stream ends)
    gets 204, on which an EventSource stops (an empty 200 made it reconnect every few seconds,
    for as long as its page stayed open); one that lost the stream before the end gets it,
    once."""
    svc = platform.service()
    task_id = _submit(gateway, svc)
    first = _follow(gateway, svc, task_id)
    ((pending_id, _),) = first.wait_for(1)
    _set(platform, task_id, status="FAILURE", error_message="Argh!", end_date="now()")
    assert first.ended.wait(5)
    first.close()
    ((end_id, end),) = first.events[1:]
    assert end["status"] == "FAILURE"
    terminals = [end_id]
    for gw in (gateway, reader_gateway):
        done = _follow(gw, svc, task_id, last_event_id=end_id)
        assert done.ended.wait(5), "a stream whose end the client has goes on"
        assert done.events == [], f"the terminal event came again: {done.events}"
        assert done.status == 204
        done.close()
        late = _follow(gw, svc, task_id, last_event_id=pending_id)  # missed the end
        assert late.ended.wait(5)
        assert late.status == 200
        assert [(i, e["status"]) for i, e in late.events] == [(end_id, "FAILURE")]
        terminals += [i for i, _ in late.events]
        late.close()
    assert len(set(terminals)) == 1  # one terminal event, whichever connection carried it


def test_a_terminal_state_written_with_an_older_time_is_still_delivered(
    gateway: GatewayProcess, platform: Platform
) -> None:
    """`updated_at` is the start of the writing transaction: a result whose statement began
    before a progress that committed first is stamped earlier than it. Its id is still above
    the progress's in the stream, and a client that last saw the progress still gets it."""
    svc = platform.service()
    task_id = _submit(gateway, svc)
    _set(platform, task_id, status="IN_PROGRESS", start_date="now()", progress=30)
    first = _follow(gateway, svc, task_id)
    ((progress_id, _),) = first.wait_for(1)
    first.close()
    platform.sql(
        "UPDATE tasks SET status = 'SUCCESS', progress = 100, response = '{}', end_date = now(),"
        " updated_at = updated_at - interval '1 second' WHERE task_id = %(t)s",
        {"t": task_id},
    )
    late = _follow(gateway, svc, task_id, last_event_id=progress_id)
    assert late.ended.wait(5)
    assert [e[1]["status"] for e in late.events] == ["SUCCESS"]
    end_id = late.events[0][0]
    assert int(end_id) > int(progress_id)
    late.close()
    done = _follow(gateway, svc, task_id, last_event_id=end_id)
    assert done.ended.wait(5)
    assert done.events == [] and done.status == 204
    done.close()


@pytest.mark.parametrize("last_event_id", ["", "nope", "-5", "1e9", "9" * 40])
def test_an_unparsable_last_event_id_is_ignored(
    gateway: GatewayProcess, platform: Platform, last_event_id: str
) -> None:
    svc = platform.service()
    task_id = _submit(gateway, svc)
    reader = _follow(gateway, svc, task_id, last_event_id=last_event_id)
    ((_, data),) = reader.wait_for(1)
    assert data["status"] == "PENDING"
    reader.close()


def test_a_last_event_id_from_the_tasks_future_is_ignored(
    gateway: GatewayProcess, platform: Platform
) -> None:
    """Found by a black-box test: a Last-Event-ID above any id the task was given (2**53 - 1)
    was taken as seen, and the events that followed had made-up ids above it (2**53 and on,
    past what JavaScript holds exactly, and other than the ids the same states have on any
    other connection). Such an id is not one of ours: ignored, as an unparsable one."""
    svc = platform.service()
    task_id = _submit(gateway, svc)
    fresh = _follow(gateway, svc, task_id)
    ((fresh_id, _),) = fresh.wait_for(1)
    fresh.close()
    reader = _follow(gateway, svc, task_id, last_event_id=str(2**53 - 1))
    ((first_id, data),) = reader.wait_for(1)
    assert data["status"] == "PENDING" and first_id == fresh_id
    _set(platform, task_id, status="IN_PROGRESS", start_date="now()", progress=10)
    (_, (next_id, _)) = reader.wait_for(2)
    assert int(first_id) < int(next_id) < 2**53
    reader.close()


def test_errors_before_the_stream_are_the_polls(
    gateway: GatewayProcess, platform: Platform
) -> None:
    svc, other = platform.service(), platform.service()
    task_id = _submit(gateway, svc)
    url = _events_url(gateway, svc.name, task_id)
    with gateway.http() as anonymous, gateway.http(other.clients[0]) as stranger:
        answers = {
            "anonymous": anonymous.get(url),
            "ungranted": stranger.get(url),
            "no service": stranger.get(_events_url(gateway, "no-such-service", task_id)),
            "no task": stranger.get(_events_url(gateway, other.name, str(uuid.uuid4()))),
            "not a uuid": stranger.get(_events_url(gateway, other.name, "nope")),
            "someone else's": stranger.get(_events_url(gateway, other.name, task_id)),
        }
    numbers = {k: (a.status_code, a.json()["error"]["number"]) for k, a in answers.items()}
    assert numbers == {
        "anonymous": (403, 403001),
        "ungranted": (403, 403001),
        "no service": (404, 404001),
        "no task": (404, 404002),
        "not a uuid": (404, 404002),
        "someone else's": (404, 404002),
    }


def _open_streams(gateway: GatewayProcess) -> float:
    text = httpx.get(f"{gateway.url}/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("conveyor_gateway_event_streams "))
    return float(line.split()[1])


def test_a_client_that_goes_away_frees_its_stream(
    reader_gateway: GatewayProcess, platform: Platform
) -> None:
    svc = platform.service()
    task_ids = [_submit(reader_gateway, svc) for _ in range(5)]
    before = _open_streams(reader_gateway)
    readers = [
        Reader(reader_gateway, svc.clients[0], _events_url(reader_gateway, svc.name, t))
        for t in task_ids
    ]
    for reader in readers:
        reader.wait_for(1)
    assert _open_streams(reader_gateway) == before + 5
    for reader in readers:
        reader.close()
    deadline = time.monotonic() + 10
    while _open_streams(reader_gateway) > before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _open_streams(reader_gateway) == before


def test_a_client_gone_while_its_stream_reads_leaves_the_connection_whole(
    reader_gateway: GatewayProcess, platform: Platform
) -> None:
    """A stream cancelled in the middle of its read (the client went away) was cancelled
    again while psycopg cancelled the query on the server: the pooled connection was closed
    and replaced, a new PostgreSQL backend per such client (~7 a minute under a black-box
    test's load). The read finishes (bounded by DB_TIMEOUT), then the stream ends."""
    import psycopg

    from gateway.database_url import libpq

    svc = platform.service()
    task_id = _submit(reader_gateway, svc)
    reader = Reader(reader_gateway, svc.clients[0], _events_url(reader_gateway, svc.name, task_id))
    reader.wait_for(1)
    opened = _open_streams(reader_gateway)
    with psycopg.connect(libpq(platform.database_url)) as locker:
        locker.execute("LOCK TABLE tasks IN ACCESS EXCLUSIVE MODE")
        time.sleep(1.5)  # the stream's re-read (every 0.5 s here) waits for the lock
        reader.close()
        time.sleep(1.0)  # the gateway hears the client go, in the middle of the read
        locker.rollback()
    wait_until(lambda: _open_streams(reader_gateway) < opened, 10, what="the stream ended")
    assert "query cancellation interrupted" not in reader_gateway.proc.logs()


def test_the_sdk_follows_the_stream(gateway: GatewayProcess, platform: Platform) -> None:
    svc = platform.service()
    task_id = _submit(gateway, svc)
    seen: list[tuple[str, float]] = []

    def change() -> None:
        # Each change once the one before was followed: a stream sends the state it reads
        # when notified, so changes closer together than its reads may come as one.
        steps: list[dict[str, Any]] = [
            {"status": "IN_PROGRESS", "progress": 10},
            {"progress": 60},
            {"status": "SUCCESS", "progress": 100, "response": "{}", "end_date": "now()"},
        ]
        for followed, columns in enumerate(steps, start=1):
            wait_until(lambda n=followed: len(seen) >= n, 15, what=f"{followed} states followed")
            _set(platform, task_id, **columns)

    changer = threading.Thread(target=change)
    changer.start()
    client_id, secret = svc.clients[0].auth
    with ConveyorClient(gateway.url, client_id, secret) as client:
        # A poll every 60 s would see none of the steps: only the stream does.
        for task in client.follow(svc.name, task_id, timeout=20, interval=60):
            seen.append((task.status, task.progress))
    changer.join()
    assert seen == [
        ("PENDING", 0.0),
        ("IN_PROGRESS", 10.0),
        ("IN_PROGRESS", 60.0),
        ("SUCCESS", 100.0),
    ]
    with ConveyorClient(gateway.url, client_id, secret) as client:
        quiet = _submit(gateway, svc)
        began = time.monotonic()
        with pytest.raises(TaskWaitTimeout):
            client.wait(svc.name, quiet, timeout=1.0)
        assert time.monotonic() - began < 5


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_the_sdk_waits_through_a_gateway_restart(
    gateway: GatewayProcess, platform: Platform, flavour: str
) -> None:
    """Found by a sweep: `wait()` raised RemoteProtocolError when the gateway restarted under
    its stream (a deploy), though the task went on to SUCCESS. It now polls through an outage
    of up to `OUTAGE_WINDOW_S`: here the stream is reset, connections are refused for 2.5 s,
    and the task ends meanwhile."""
    svc = platform.service()
    task_id = _submit(gateway, svc)
    proxy = TcpProxy("127.0.0.1", gateway.port)
    url = f"http://127.0.0.1:{proxy.port}"
    client_id, secret = svc.clients[0].auth

    def outage() -> None:
        time.sleep(1.0)
        proxy.sever()
        time.sleep(1.5)
        _set(platform, task_id, status="SUCCESS", progress=100, response="{}", end_date="now()")
        time.sleep(1.0)
        proxy.restore()

    async def wait_async() -> Task:
        async with AsyncConveyorClient(url, client_id, secret) as client:
            return await client.wait(svc.name, task_id, timeout=30, interval=0.2)

    restarts = threading.Thread(target=outage)
    restarts.start()
    try:
        if flavour == "sync":
            with ConveyorClient(url, client_id, secret) as client:
                task = client.wait(svc.name, task_id, timeout=30, interval=0.2)
        else:
            task = asyncio.run(wait_async())
    finally:
        restarts.join()
        proxy.close()
    assert task.status == "SUCCESS"


async def test_the_async_sdk_follows_the_stream(
    gateway: GatewayProcess, platform: Platform
) -> None:
    svc = platform.service()
    task_id = _submit(gateway, svc)
    client_id, secret = svc.clients[0].auth
    async with AsyncConveyorClient(gateway.url, client_id, secret) as client:
        statuses = []
        async for task in client.follow(svc.name, task_id, timeout=20, interval=60):
            statuses.append(task.status)
            if task.status == "PENDING":
                _set(platform, task_id, status="FAILURE", error_message="x", end_date="now()")
        assert statuses == ["PENDING", "FAILURE"]
        with pytest.raises(TaskWaitTimeout):
            await client.wait(svc.name, _submit(gateway, svc), timeout=1.0)


def test_the_sdk_deadline_ends_a_quiet_stream_as_a_timeout(
    gateway: GatewayProcess, platform: Platform
) -> None:
    """A stream that says nothing more after the first state (a PENDING task) is still ended
    at the deadline, by the read the deadline bounds, and that is a TaskWaitTimeout, never the
    transport error of the cut read (CI once saw a RemoteProtocolError escape `wait`)."""
    svc = platform.service()
    client_id, secret = svc.clients[0].auth
    with ConveyorClient(gateway.url, client_id, secret) as client:
        began = time.monotonic()
        with pytest.raises(TaskWaitTimeout):
            client.wait(svc.name, _submit(gateway, svc), timeout=0.5)
        assert time.monotonic() - began < 5


@pytest.mark.timeout(60)
def test_a_gateway_stopping_ends_its_open_streams_cleanly(
    database_url: str, amqp_url: str, platform: Platform, tmp_path: Any
) -> None:
    """Found by a sweep: a SIGTERM (a deploy, a scale-in) cut the open streams mid-answer, with
    no end of the chunked body, and uvicorn logged "ASGI callable returned without completing
    response" as an error. A stopping gateway now ends each stream properly, after a `retry`
    line: a browser's EventSource reconnects (to another replica) and the SDK polls."""
    procs = Processes(tmp_path)
    try:
        stopping = GatewayProcess(procs, gateway_env(database_url, amqp_url), "gateway-stopping")
        svc = platform.service()
        task_id = _submit(stopping, svc)
        lines: list[str] = []
        ended: list[str] = []

        def read() -> None:
            try:
                with (
                    httpx.Client(base_url=stopping.url, auth=svc.clients[0].auth) as http,
                    http.stream("GET", _events_url(stopping, svc.name, task_id)) as response,
                ):
                    lines.extend(response.iter_lines())
                ended.append("cleanly")
            except httpx.HTTPError as exc:
                ended.append(repr(exc))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        deadline = time.monotonic() + 10
        while "event: task" not in lines and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "event: task" in lines
        stopping.proc.signal(signal.SIGTERM)
        assert stopping.proc.wait(20) in (0, -signal.SIGTERM)  # uvicorn raises it again
        reader.join(10)
        assert ended == ["cleanly"]
        assert any(line.startswith("retry:") for line in lines), lines
        logs = stopping.proc.logs()
        assert "ASGI callable returned without completing response" not in logs
        assert '"level": "error"' not in logs.lower().replace('"level":"', '"level": "')
    finally:
        procs.stop_all()


@pytest.mark.timeout(150)
def test_a_stream_waiting_its_heartbeat_polls_once_the_listener_is_lost(
    amqp_url: str, procs: Processes
) -> None:
    """The listener's connection ended and kept from coming back (the gateway's role at its
    connection limit), the pool's still serving: a stream already waiting out its heartbeat
    (15 s) kept waiting, and the task's changes meanwhile went unsent until then (found by a
    sweep). Losing the listener now wakes every stream, which then re-reads every second."""
    server = PostgresServer().start()
    try:
        server.sql("CREATE ROLE gw LOGIN CREATEDB")
        role_url = f"postgresql://gw@127.0.0.1:{server.port}/postgres"
        with own_gateway(role_url, amqp_url, procs, CONVEYOR_DB_POOL_SIZE="2") as (gw, svc, pf):
            task_id = _submit(gw, svc)
            reader = Reader(gw, svc.clients[0], _events_url(gw, svc.name, task_id))
            reader.wait_for(1)
            time.sleep(0.5)  # the stream waits for a change, or its heartbeat
            database = urlsplit(pf.database_url).path.lstrip("/")
            admin = Platform(f"postgresql://postgres@127.0.0.1:{server.port}/{database}")
            admin.sql("ALTER ROLE gw CONNECTION LIMIT 2")  # the pool's two, no third
            admin.sql(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE application_name = 'conveyor-listener'"
            )
            with gw.http() as http:
                wait_until(
                    lambda: "listener" in http.get("/readyz").json()["data"]["failing"],
                    10,
                    what="the listener down",
                )
            _set(admin, task_id, status="IN_PROGRESS", progress=50.0, start_date="now()")
            events = reader.wait_for(2, timeout=5)  # was: at the heartbeat, 15 s
            assert events[-1][1]["progress"] == 50.0, events
            reader.close()
    finally:
        server.stop()
