"""The consumer under fire: submits every task once, whatever the platform goes through.

A pool of asyncio workers (bounded concurrency) shares a rate limiter. Each
task carries its own `Idempotency-Key`; on a 5xx, a 429, a timeout or a
connection error the same request is sent again with the same key (capped
exponential backoff, for at most `retry_budget` seconds), until a 201 or a
200 answers. A client that could not tell whether its request went through
may retry and must get exactly one task: the 200s after a failed attempt are
counted, and a sample of accepted tasks is deliberately submitted again to
check that the repeat names the same taskId.

`burst(n)` lets the next `n` submissions go without waiting for the rate
limiter, so that a gateway kill can land in the middle of a burst. The `gate`
is where the fault injector holds the submissions: task number `k` is not
submitted before `k < gate.limit` (the injector moves the limit to the next
fault's point once the current fault has begun).
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

HOSTILE_KINDS = ("nul", "deep", "huge", "trickle")
HOOKS = ("ok", "slow", "endless")


@dataclass(frozen=True, slots=True)
class TaskSpec:
    key: str  # sent as Idempotency-Key when `keyed`; the run's own name for the task anyway
    body: dict[str, Any]
    callback: bool
    repeat: bool  # submit again once accepted: the answer must be 200 with the same taskId
    keyed: bool = True  # without a key, the submission takes the group-commit path
    hook: str = "ok"  # which callback endpoint (HOOKS), when `callback`


def make_specs(
    count: int,
    run_id: str,
    rng: random.Random,
    *,
    fail_rate: float,
    max_sleep: float,
    callback_fraction: float,
    repeat_fraction: float,
    keyless_fraction: float = 0.0,
    hostile_fraction: float = 0.0,
    hostile_hook_fraction: float = 0.0,
) -> list[TaskSpec]:
    specs = []
    for i in range(count):
        body: dict[str, Any] = {"sleep": round(rng.uniform(0, max_sleep), 3), "failRate": fail_rate}
        if rng.random() < hostile_fraction:
            body = {"sleep": 0, "hostile": rng.choice(HOSTILE_KINDS)}
        callback = rng.random() < callback_fraction
        hook = rng.choice(HOOKS[1:]) if callback and rng.random() < hostile_hook_fraction else "ok"
        keyed = rng.random() >= keyless_fraction
        specs.append(
            TaskSpec(
                key=f"chaos-{run_id}-{i}",
                body=body,
                callback=callback,
                repeat=keyed and rng.random() < repeat_fraction,
                keyed=keyed,
                hook=hook,
            )
        )
    return specs


@dataclass
class SubmitResult:
    accepted: dict[str, str] = field(default_factory=dict)  # key -> taskId
    callbacks: set[str] = field(default_factory=set)  # taskIds with a well-behaved callback
    hostile_callbacks: set[str] = field(default_factory=set)  # taskIds with a hostile one
    keyless: int = 0  # accepted without an Idempotency-Key
    keyless_unknown: int = 0  # keyless, and no answer said whether it was accepted
    answers: Counter[str] = field(default_factory=Counter)  # "201", "503", "ConnectError"...
    retried: int = 0  # keys that needed more than one request
    found_after_failure: int = 0  # 200 after a failed attempt: the first one had gone through
    repeats: int = 0  # deliberate repeats checked
    mismatches: list[dict[str, Any]] = field(default_factory=list)  # repeats answering otherwise
    abandoned: list[str] = field(default_factory=list)  # keys given up after retry_budget
    rejected: dict[str, int] = field(default_factory=dict)  # keys refused with a 4xx
    first_submit: float | None = None  # time.monotonic()
    last_accept: float | None = None


class Gate:
    """Submissions may go up to task number `limit` (exclusive); moved by another thread."""

    OPEN = 1 << 62

    def __init__(self, limit: int = OPEN) -> None:
        self.limit = limit

    def open(self) -> None:
        self.limit = self.OPEN

    async def wait_for(self, index: int, stop: threading.Event) -> None:
        while index >= self.limit and not stop.is_set():
            await asyncio.sleep(0.01)


class RateLimiter:
    """Evenly spaced slots at `rate` per second, plus thread-safe bursts."""

    def __init__(self, rate: float) -> None:
        self.interval = 1.0 / rate if rate > 0 else 0.0
        self._next = 0.0
        self._burst = 0
        self._lock = threading.Lock()

    def burst(self, count: int) -> None:
        with self._lock:
            self._burst += count

    def _take_burst(self) -> bool:
        with self._lock:
            if self._burst > 0:
                self._burst -= 1
                return True
            return False

    async def acquire(self) -> None:
        while True:
            if self._take_burst():
                return
            now = time.monotonic()
            slot = max(now, self._next)
            if slot - now <= 0:
                self._next = slot + self.interval
                return
            # Sleep in short steps so a burst requested meanwhile starts at once.
            await asyncio.sleep(min(slot - now, 0.05))


class Submitter:
    def __init__(
        self,
        base_url: str,
        service: str,
        auth: tuple[str, str],
        callback_url: Callable[[str], str],
        *,
        concurrency: int,
        rate: float,
        retry_budget: float,
        transport: httpx.AsyncBaseTransport | None = None,  # tests answer without a gateway
    ) -> None:
        self.url = f"{base_url}/v1/services/{service}/tasks"
        self.auth = auth
        self.callback_url = callback_url  # hook name -> URL
        self.concurrency = concurrency
        self.retry_budget = retry_budget
        self.transport = transport
        self.limiter = RateLimiter(rate)
        self.gate = Gate()
        self.result = SubmitResult()
        self.in_flight = 0  # requests awaiting an answer, read by the fault injector
        self.submitted = 0
        self.finished = False  # every worker is done
        self.stop = threading.Event()  # the hard timeout: give up everything

    def burst(self, count: int) -> None:
        self.limiter.burst(count)

    async def run(self, specs: list[TaskSpec]) -> SubmitResult:
        queue = enumerate(specs)
        limits = httpx.Limits(max_connections=self.concurrency)
        timeout = httpx.Timeout(10.0, connect=2.0)
        try:
            async with httpx.AsyncClient(
                auth=self.auth,
                limits=limits,
                timeout=timeout,
                trust_env=False,
                transport=self.transport,
            ) as client:
                workers = (self._worker(client, queue) for _ in range(self.concurrency))
                await asyncio.gather(*workers)
        finally:
            self.finished = True
        return self.result

    async def _worker(self, client: httpx.AsyncClient, queue: Any) -> None:
        for index, spec in queue:
            await self.gate.wait_for(index, self.stop)
            if self.stop.is_set():
                return
            await self.limiter.acquire()
            await self._submit(client, spec)

    def _payload(self, spec: TaskSpec) -> dict[str, Any]:
        payload: dict[str, Any] = {"body": spec.body}
        if spec.callback:
            payload["callback"] = {"type": "http", "url": self.callback_url(spec.hook)}
        return payload

    async def _submit(self, client: httpx.AsyncClient, spec: TaskSpec) -> None:
        if self.result.first_submit is None:
            self.result.first_submit = time.monotonic()
        self.submitted += 1
        answer, requests = await self._post_until_answered(client, spec)
        if answer is None:
            if spec.keyed:
                self.result.abandoned.append(spec.key)
            else:  # it may or may not exist: the verifier counts rows nobody acknowledged
                self.result.keyless_unknown += 1
            return
        status, task_id = answer
        if status not in (200, 201):
            self.result.rejected[spec.key] = status
            return
        self.result.accepted[spec.key] = task_id
        self.result.last_accept = time.monotonic()
        self.result.keyless += not spec.keyed
        if spec.callback:
            hooked = self.result.callbacks if spec.hook == "ok" else self.result.hostile_callbacks
            hooked.add(task_id)
        if requests > 1:
            self.result.retried += 1
            self.result.found_after_failure += status == 200
        if spec.repeat:
            await self._repeat(client, spec, task_id)

    async def _repeat(self, client: httpx.AsyncClient, spec: TaskSpec, task_id: str) -> None:
        self.result.repeats += 1
        answer, _ = await self._post_until_answered(client, spec)
        if answer != (200, task_id):
            self.result.mismatches.append({"key": spec.key, "taskId": task_id, "got": answer})

    async def _post_until_answered(
        self, client: httpx.AsyncClient, spec: TaskSpec
    ) -> tuple[tuple[int, str] | None, int]:
        """((status, taskId) | None if abandoned, requests sent). 4xx other than 429 is final."""
        give_up = time.monotonic() + self.retry_budget
        pause = 0.1
        requests = 0
        while not self.stop.is_set():
            requests += 1
            answer, nothing_made = await self._post(client, spec)
            if answer is not None:
                return answer, requests
            if not spec.keyed and not nothing_made:
                break  # without a key, a retry could make a second task
            if time.monotonic() + pause > give_up:
                break
            await asyncio.sleep(pause * random.uniform(0.5, 1.0))
            pause = min(pause * 2, 2.0)
        return None, requests

    async def _post(
        self, client: httpx.AsyncClient, spec: TaskSpec
    ) -> tuple[tuple[int, str] | None, bool]:
        """One request: ((status, taskId) when final, else None to retry; whether the failure
        proves no task was made: the connection was refused, or a 429 refused it first)."""
        self.in_flight += 1
        headers = {"Idempotency-Key": spec.key} if spec.keyed else {}
        try:
            response = await client.post(self.url, json=self._payload(spec), headers=headers)
        except httpx.TransportError as exc:
            self.result.answers[type(exc).__name__] += 1
            return None, isinstance(exc, httpx.ConnectError)
        finally:
            self.in_flight -= 1
        self.result.answers[str(response.status_code)] += 1
        if response.status_code >= 500 or response.status_code == 429:
            return None, response.status_code == 429
        task_id = ""
        if response.status_code in (200, 201):
            task_id = response.json()["data"]["taskId"]
        return (response.status_code, task_id), False
