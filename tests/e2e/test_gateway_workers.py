"""`conveyor gateway --workers 2`: two processes answer on one port, exactly one runs the
background loops, and when that one is killed its replacement takes them over."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time

import httpx
import pytest

from tests.e2e.conftest import Stack
from tests.support.gateway import GatewayProcess, Platform, gateway_env
from tests.support.processes import Processes, free_port, wait_http

pytestmark = pytest.mark.timeout(240)


def _answering(url: str, want: int, timeout: float = 30) -> dict[int, bool]:
    """Which processes answered /readyz (a new connection each time), and whether each runs
    the loops."""
    seen: dict[int, bool] = {}
    deadline = time.monotonic() + timeout
    while len(seen) < want and time.monotonic() < deadline:
        try:
            ready = httpx.get(f"{url}/readyz", timeout=5).json()["data"]
        except httpx.HTTPError:
            time.sleep(0.1)
            continue
        seen[ready["process"]] = ready["background"]
    return seen


def test_one_worker_runs_the_loops_and_its_replacement_takes_them_over(
    procs: Processes,
    database_url: str,
    amqp_url: str,
    platform: Platform,
    sleeper_url: str,
) -> None:
    gateway = GatewayProcess(
        procs, gateway_env(database_url, amqp_url), "gateway-workers", "--workers", "2"
    )
    first = _answering(gateway.url, want=2)
    assert len(first) == 2, first
    assert sorted(first.values()) == [False, True], first

    service = platform.service(jsonSchema={"type": "object"}, taskTimeout=30)
    stack = Stack(procs, gateway, sleeper_url, amqp_url, service)
    stack.dispatcher("pod-w")
    assert stack.finish(stack.submit({"sleep": 0}), timeout=30)["status"] == "SUCCESS"

    (looping,) = [pid for pid, background in first.items() if background]
    os.kill(looping, signal.SIGKILL)  # a worker our gateway started: ended by its pid
    deadline = time.monotonic() + 60
    replaced: dict[int, bool] = {}
    while time.monotonic() < deadline:
        replaced = _answering(gateway.url, want=2, timeout=5)
        if len(replaced) == 2 and looping not in replaced and any(replaced.values()):
            break
        time.sleep(0.5)
    assert looping not in replaced and sorted(replaced.values()) == [False, True], replaced
    assert stack.finish(stack.submit({"sleep": 0}), timeout=30)["status"] == "SUCCESS"
    stack.http.close()

    # Whichever worker answers /metrics, it counts every worker's requests (the killed
    # worker's included): the two creates of this test.
    line = 'conveyor_gateway_requests_total{route="/v1/services/{service}/tasks",status="201"}'
    for _ in range(6):
        scraped = httpx.get(f"{gateway.url}/metrics", timeout=5).text
        values = [float(x.split()[-1]) for x in scraped.splitlines() if x.startswith(line)]
        assert values == [2.0], values


def test_after_workers_are_restarted_one_of_them_runs_the_loops(
    procs: Processes, database_url: str, amqp_url: str
) -> None:
    """Found by a sweep: SIGHUP makes uvicorn start new workers before it stops the old ones,
    so when the worker holding the loops' lock was replaced last, every new worker had
    already tried the lock and failed, and none ran the loops (tasks stayed PENDING, every
    /readyz said 200). A worker without the loops keeps trying the lock."""
    gateway = GatewayProcess(
        procs, gateway_env(database_url, amqp_url), "gateway-hup", "--workers", "2"
    )
    assert len(_answering(gateway.url, want=2)) == 2
    for _ in range(2):  # the first restart leaves the loops with the last worker started
        before = set(_answering(gateway.url, want=2))
        gateway.proc.signal(signal.SIGHUP)
        deadline = time.monotonic() + 100  # new workers start slowly on a loaded machine
        after: dict[int, bool] = {}
        while time.monotonic() < deadline:
            after = _answering(gateway.url, want=2, timeout=5)
            if len(after) == 2 and not set(after) & before and any(after.values()):
                break
            time.sleep(0.5)
        assert not set(after) & before and sorted(after.values()) == [False, True], after


def _children(pid: int) -> set[int]:
    """The processes `pid` started that are still running (Linux's /proc)."""
    found: set[int] = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as listed:
            found.update(int(child) for child in listed.read().split())
    return found


def test_a_worker_slow_to_start_still_replaces_the_old_one_on_sighup(
    procs: Processes, database_url: str, amqp_url: str
) -> None:
    """Found by CI: uvicorn's SIGHUP keeps the old worker when its replacement is not serving
    within `timeout_worker_healthcheck` (5 s by default), and a gateway worker took 5 s to
    import on a loaded machine: the restart was abandoned, old code kept running. A worker
    held stopped for 8 s stands for that slow start."""
    if not os.path.exists(f"/proc/{os.getpid()}/task"):
        pytest.skip("reads a process's children from Linux's /proc")
    gateway = GatewayProcess(
        procs, gateway_env(database_url, amqp_url), "gateway-slow-hup", "--workers", "2"
    )
    before = set(_answering(gateway.url, want=2))
    assert len(before) == 2, before
    known = _children(gateway.proc.pid)
    gateway.proc.signal(signal.SIGHUP)
    deadline = time.monotonic() + 30
    new: set[int] = set()
    while not new and time.monotonic() < deadline:
        new = _children(gateway.proc.pid) - known
        time.sleep(0.005)
    assert new, "no new worker started after SIGHUP"
    for pid in new:  # started by our gateway: stopped and continued by its pid
        os.kill(pid, signal.SIGSTOP)
    time.sleep(8)
    for pid in new:
        with contextlib.suppress(ProcessLookupError):  # uvicorn gave up on it and killed it
            os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 100
    after: dict[int, bool] = {}
    while time.monotonic() < deadline:
        after = _answering(gateway.url, want=2, timeout=5)
        if len(after) == 2 and not set(after) & before and any(after.values()):
            break  # the loops are taken within a second of the old worker's end
        time.sleep(0.5)
    assert not set(after) & before, (before, after)
    assert sorted(after.values()) == [False, True], after


def _streams_counted(url: str) -> float:
    scraped = httpx.get(f"{url}/metrics", timeout=5).text
    name = "conveyor_gateway_event_streams "
    return sum(float(line.split()[-1]) for line in scraped.splitlines() if line.startswith(name))


def test_killed_workers_are_replaced_at_once_and_their_streams_no_longer_counted(
    procs: Processes, database_url: str, amqp_url: str, platform: Platform
) -> None:
    """Found by a black-box sweep: a worker that died while uvicorn's supervisor pinged it was
    seen gone only after the whole health-check timeout (30 s), the supervisor seeing no other
    worker meanwhile (all killed: nothing served for 30 s); and the streams a killed worker
    held open stayed counted in `conveyor_gateway_event_streams` for good."""
    gateway = GatewayProcess(
        procs, gateway_env(database_url, amqp_url), "gateway-workers-killed", "--workers", "2"
    )
    workers = _answering(gateway.url, want=2)
    assert len(workers) == 2, workers
    service = platform.service()
    client = service.clients[0]
    with gateway.http(client) as http:
        answer = http.post(gateway.tasks_url(service.name), json={"body": {}})
        task_id = answer.json()["data"]["taskId"]
    path = f"{gateway.tasks_url(service.name)}/{task_id}/events"
    lines = []  # each stream's lines, read as far as its first: closed, it would end it
    with contextlib.ExitStack() as streams:
        for _ in range(4):
            reader = streams.enter_context(
                httpx.Client(base_url=gateway.url, auth=client.auth, timeout=30)
            )
            response = streams.enter_context(reader.stream("GET", path))
            lines.append(response.iter_lines())
            assert next(lines[-1]).startswith(("id:", "event:", ":"))
        deadline = time.monotonic() + 10
        while _streams_counted(gateway.url) != 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _streams_counted(gateway.url) == 4
        stalled, other = list(workers)
        os.kill(stalled, signal.SIGSTOP)  # the supervisor's next ping of it waits
        time.sleep(1.5)
        for pid in (stalled, other):  # workers our gateway started: ended by their pids
            os.kill(pid, signal.SIGKILL)
    # within 20 s (CI under load took over 10 s), not the health check's 30 s it took
    replaced = _answering(gateway.url, want=2, timeout=20)
    assert len(replaced) == 2 and not set(replaced) & set(workers), replaced
    deadline = time.monotonic() + 5
    while _streams_counted(gateway.url) != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _streams_counted(gateway.url) == 0


def test_only_background_answers_its_probes_on_the_host_asked_and_serves_no_api(
    procs: Processes, database_url: str, amqp_url: str, platform: Platform
) -> None:
    """Found by a black-box sweep: `--only-background` listened on 127.0.0.1 whatever `--host`
    said (a kubelet's probes on the pod's address failed) and served the whole API (a task
    submitted to it was accepted). It answers the probes and /metrics, where it was asked."""
    port = free_port()
    url = f"http://127.0.0.2:{port}"  # loopback too, but not 127.0.0.1
    proc = procs.conveyor(
        "gateway-only-background",
        "gateway",
        "--only-background",
        "--host",
        "127.0.0.2",
        "--port",
        str(port),
        env=gateway_env(database_url, amqp_url),
    )
    wait_http(f"{url}/healthz", timeout=30, proc=proc)
    assert httpx.get(f"{url}/readyz", timeout=10).status_code == 200
    assert "conveyor_gateway" in httpx.get(f"{url}/metrics", timeout=10).text
    service = platform.service()
    answer = httpx.post(
        f"{url}/v1/services/{service.name}/tasks",
        json={"body": {}},
        auth=service.clients[0].auth,
        timeout=10,
    )
    assert answer.status_code == 404, answer.text
    assert platform.sql(
        "SELECT count(*) FROM tasks WHERE service = %(s)s", {"s": service.name}
    ) == [(0,)]


def _gone(pid: int) -> bool:
    """Ended (a zombie nobody reaped yet counts as ended)."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[0] == "Z"


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc/<pid>/stat")
def test_workers_end_with_their_supervisor_killed(
    procs: Processes, database_url: str, amqp_url: str
) -> None:
    """Found by a black-box sweep: with the supervisor SIGKILLed, its workers went on as
    orphans, one still running the background loops, and the next gateway could not bind the
    port (exit 3, address in use). They end with it now (Linux's parent-death signal)."""
    gateway = GatewayProcess(
        procs, gateway_env(database_url, amqp_url), "gateway-workers-orphans", "--workers", "2"
    )
    workers = _answering(gateway.url, want=2)
    assert len(workers) == 2, workers
    # The supervisor's folder (lock, metrics), which a supervisor SIGKILLed cannot remove.
    environ = open(f"/proc/{next(iter(workers))}/environ", "rb").read().split(b"\0")
    (lock,) = [
        v.split(b"=", 1)[1] for v in environ if v.startswith(b"CONVEYOR_GATEWAY_LOOPS_LOCK=")
    ]
    gateway.proc.kill()  # SIGKILL, by its pid
    deadline = time.monotonic() + 20
    while not all(_gone(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [pid for pid in workers if not _gone(pid)]
    for pid in left:  # the test's own processes, should the check fail: ended by their pids
        os.kill(pid, signal.SIGKILL)
    shutil.rmtree(os.path.dirname(lock.decode()), ignore_errors=True)
    assert not left, f"workers {left} outlived their supervisor"
