"""The servers freeze what they loaded at start out of the cyclic collector, and export how
long each collection stopped them (`conveyor/heap.py`)."""

from __future__ import annotations

import re

from tests.support.gateway import GatewayProcess, Platform
from tests.support.metrics import Key, samples

_FROZEN = re.compile(r'frozen["=: ]+(\d+)')


def test_the_gateway_froze_its_start_up_objects_and_exports_its_collections(
    gateway: GatewayProcess, platform: Platform
) -> None:
    found = _FROZEN.search(gateway.proc.logs())
    assert found, "the gateway did not say it froze its start-up objects"
    assert int(found.group(1)) > 50_000  # FastAPI, SQLAlchemy, aio-pika, its routes...

    service = platform.service()
    counts: dict[str, float] = {}
    with gateway.http(service.clients[0]) as http:
        for n in range(3000):  # until the garbage of serving makes a young collection
            answer = http.post(gateway.tasks_url(service.name), json={"body": {"n": n}})
            assert answer.status_code == 201
            if n % 100 == 99:
                counts = _pauses(samples(http.get("/metrics").text))
                if counts.get("0"):
                    break
    print(f"after {n + 1} submissions: {counts}")
    assert set(counts) == {"0", "1", "2"}
    assert counts["0"] > 0, "no collection was reported while serving"


def _pauses(exported: dict[Key, float]) -> dict[str, float]:
    return {
        dict(labels)["generation"]: value
        for (name, labels), value in exported.items()
        if name == "conveyor_gateway_gc_pause_seconds_count"
    }
