"""An HTTP load generator that runs in its own process, so it never shares a core's
event loop with the gateway it measures.

It speaks plain HTTP/1.1 over keep-alive connections with requests built once
as bytes (no client library in the measured path), so one process drives far
more requests per second than the gateway can answer. Two modes:

* `closed`: `concurrency` connections, each sending its next request as soon as
  the previous one is answered, for `duration` seconds or `count` requests;
  prints throughput, status counts and latency percentiles;
* `sequential`: one request at a time with a pause between them (idle
  workers); prints, per request, the task id and when it was sent and answered.

The job is read as JSON from stdin; the result is printed as one JSON line:

    echo '{"url": "http://127.0.0.1:8000", "mode": "closed", ...}' | python -m bench.loadgen
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from bench.stats import summarize


@dataclass(frozen=True)
class Job:
    url: str
    requests: list[dict[str, Any]]  # {"method", "path", "body"(optional JSON)}
    mode: str = "closed"
    concurrency: int = 1
    duration: float | None = None
    count: int | None = None
    warmup: float = 0.0
    gap: float = 0.02
    auth: tuple[str, str] | None = None
    keep_samples: bool = False

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> Job:
        auth = raw.get("auth")
        return cls(**{**raw, "auth": tuple(auth) if auth else None})


def build_requests(job: Job) -> list[bytes]:
    parts = urlsplit(job.url)
    host = f"{parts.hostname}:{parts.port or 80}"
    built = []
    for spec in job.requests:
        body = b"" if spec.get("body") is None else json.dumps(spec["body"]).encode()
        lines = [f"{spec['method']} {spec['path']} HTTP/1.1", f"Host: {host}"]
        if job.auth:
            token = base64.b64encode(f"{job.auth[0]}:{job.auth[1]}".encode()).decode()
            lines.append(f"Authorization: Basic {token}")
        if body:
            lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
        built.append(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
    return built


class Connection:
    """One keep-alive connection; reopened when the server closes it."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, raw: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        self.writer.write(raw)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length, close = 0, False
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"connection" and value.strip().lower() == b"close":
                close = True
        body = await self.reader.readexactly(length) if length else b""
        if close:
            await self.close()
        return status, body

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
            self.reader = None


@dataclass
class Tally:
    latencies: list[float] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)
    errors: int = 0
    first_sent: float | None = None
    last_done: float | None = None

    def note(self, sent: float, done: float, status: int) -> None:
        self.latencies.append((done - sent) * 1000)
        self.statuses[status] = self.statuses.get(status, 0) + 1
        if self.first_sent is None or sent < self.first_sent:
            self.first_sent = sent
        if self.last_done is None or done > self.last_done:
            self.last_done = done


async def _worker(
    conn: Connection, requests: list[bytes], offset: int, stop: Any, tally: Tally
) -> None:
    index = offset
    while not stop():
        raw = requests[index % len(requests)]
        index += 1
        sent = time.time()
        try:
            status, _ = await conn.request(raw)
        except (OSError, asyncio.IncompleteReadError, ValueError):
            tally.errors += 1
            await conn.close()
            await asyncio.sleep(0.01)
            continue
        tally.note(sent, time.time(), status)


async def closed_loop(job: Job) -> dict[str, Any]:
    parts = urlsplit(job.url)
    requests = build_requests(job)
    conns = [
        Connection(parts.hostname or "127.0.0.1", parts.port or 80) for _ in range(job.concurrency)
    ]
    warm = Tally()
    if job.warmup > 0:
        until = time.monotonic() + job.warmup
        await asyncio.gather(
            *(
                _worker(c, requests, i, lambda: time.monotonic() > until, warm)
                for i, c in enumerate(conns)
            )
        )
    tally = Tally()
    sent = [0]

    def stop() -> bool:
        if job.count is not None:
            if sent[0] >= job.count:
                return True
            sent[0] += 1
            return False
        return time.monotonic() > until

    until = time.monotonic() + (job.duration or 10.0)
    started = time.time()
    await asyncio.gather(*(_worker(c, requests, i, stop, tally) for i, c in enumerate(conns)))
    for conn in conns:
        await conn.close()
    return {**_report(job, tally, started), "warmup_requests": len(warm.latencies)}


def _report(job: Job, tally: Tally, started: float) -> dict[str, Any]:
    ok = sum(n for status, n in tally.statuses.items() if 200 <= status < 300)
    elapsed = (tally.last_done or time.time()) - started
    report: dict[str, Any] = {
        "concurrency": job.concurrency,
        "requests": len(tally.latencies),
        "ok": ok,
        "statuses": {str(k): v for k, v in sorted(tally.statuses.items())},
        "errors": tally.errors,
        "elapsed_s": round(elapsed, 3),
        "throughput_rps": round(ok / elapsed, 1) if elapsed > 0 else None,
        "latency_ms": summarize(tally.latencies),
        "first_sent": tally.first_sent,
        "last_done": tally.last_done,
    }
    if job.keep_samples:
        report["samples_ms"] = [round(x, 3) for x in tally.latencies]
    return report


async def sequential(job: Job) -> dict[str, Any]:
    """One at a time: [taskId, sent, answered, status] per request (times: time.time())."""
    parts = urlsplit(job.url)
    requests = build_requests(job)
    conn = Connection(parts.hostname or "127.0.0.1", parts.port or 80)
    samples = []
    for index in range(job.count or 100):
        sent = time.time()
        try:
            status, body = await conn.request(requests[index % len(requests)])
        except (OSError, asyncio.IncompleteReadError, ValueError):
            await conn.close()
            status, body = 0, b""
        answered = time.time()
        task_id = None
        if 200 <= status < 300:
            task_id = json.loads(body).get("data", {}).get("taskId")
        samples.append([task_id, sent, answered, status])
        await asyncio.sleep(job.gap)
    await conn.close()
    return {"samples": samples}


async def run(job: Job) -> dict[str, Any]:
    if job.mode == "sequential":
        return await sequential(job)
    return await closed_loop(job)


def main() -> None:
    job = Job.parse(json.loads(sys.stdin.read() if len(sys.argv) < 2 else sys.argv[1]))
    try:
        import uvloop

        result = uvloop.run(run(job))
    except ImportError:
        result = asyncio.run(run(job))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
