"""Sends of one turn of the event loop leave in one system call (conveyor/coalescing.py), on
the real processes: the gateway's HTTP answers, and confirmed publishes on the broker
connection both apps use. Counted with the kernel's `syscw` (write and writev calls) of
/proc/<pid>/io, which is what uvloop's socket writes go through."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx

from tests.support.gateway import GatewayProcess
from tests.support.processes import REPO


def _writes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("syscw:"):
            return int(line.split()[1])
    raise AssertionError("no syscw in /proc/<pid>/io")


def test_an_answer_leaves_the_gateway_in_one_send(gateway: GatewayProcess) -> None:
    requests = 200
    with httpx.Client(base_url=gateway.url, timeout=10) as http:  # one kept-alive connection
        http.get("/healthz").raise_for_status()
        before, started = _writes(gateway.proc.pid), time.monotonic()
        for _ in range(requests):
            answer = http.get("/healthz")
            assert answer.status_code == 200 and answer.json()
        written, took = _writes(gateway.proc.pid) - before, time.monotonic() - started
    # What the gateway's own loops send in as long with no request (to the database, the
    # broker), which grows with the time the requests take on a loaded machine: 377 sends
    # once in a loaded run, where a loop then polled every second.
    before = _writes(gateway.proc.pid)
    time.sleep(took)
    idle = _writes(gateway.proc.pid) - before
    # uvicorn writes a head and then a body: two sends per answer without the coalescing
    # (400 here), one with it; the slack is for the loops' sends, which vary from one second
    # to the next
    assert written - idle <= requests * 3 // 2, (
        f"{written} sends for {requests} answers ({idle} idle)"
    )


_PUBLISHER = textwrap.dedent(
    """
    import asyncio, json, sys
    import aio_pika, uvloop
    from conveyor.connection import ConfirmingChannel, connect_robust

    def writes():
        with open("/proc/self/io") as io:
            return next(int(l.split()[1]) for l in io if l.startswith("syscw:"))

    async def main(url, queue, count):
        connection = await connect_robust(url, name="test-coalesced-sends")
        publishing = ConfirmingChannel(connection)
        channel = await publishing.open()
        declared = await channel.declare_queue(queue, exclusive=True)
        await publishing.publish(aio_pika.Message(b"warm-up"), queue)
        before = writes()
        await asyncio.gather(
            *(publishing.publish(aio_pika.Message(b"%d" % n), queue) for n in range(count))
        )
        written = writes() - before
        bodies = set()
        async with declared.iterator() as messages:
            async for message in messages:
                bodies.add(message.body)
                await message.ack()
                if len(bodies) == count + 1:
                    break
        await connection.close()
        print(json.dumps({"writes": written, "received": len(bodies)}))

    uvloop.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
    """
)


def test_concurrent_confirmed_publishes_share_sends(amqp_url: str, queue_name: str) -> None:
    count = 100
    done = subprocess.run(
        [sys.executable, "-c", _PUBLISHER, amqp_url, f"{queue_name}-sends", str(count)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["received"] == count + 1  # every publish arrived, the warm-up's too
    # aio-pika's own publish sends each message on its own (100 sends or more)
    assert report["writes"] <= count // 4, report
