"""The dispatcher's own HTTP servers answer an unknown route or method in the SPEC §3
envelope, as the gateway does, on every port: a caller reads one format wherever it lands."""

from __future__ import annotations

import httpx
import pytest

from tests.dispatcher.conftest import FakeFunction, Launch, Rabbit
from tests.support.processes import free_port

pytestmark = pytest.mark.timeout(60)


def _assert_envelope(answer: httpx.Response, status: int, number: int, description: str) -> None:
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"].startswith("application/json"), answer.headers
    assert answer.json() == {
        "status": "error",
        "error": {"number": number, "description": description},
    }


async def test_unmatched_routes_and_methods_answer_the_envelope_on_every_port(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    progress_port, probe_port = free_port(), free_port()
    dispatcher = launch(
        function.url, progress_port=progress_port, pod_ip="127.0.0.1", metrics_port=probe_port
    )
    await dispatcher.wait_ready()
    task = "00000000-0000-0000-0000-000000000000"
    async with httpx.AsyncClient(timeout=5) as http:
        for base in (dispatcher.base, f"http://127.0.0.1:{probe_port}"):
            _assert_envelope(await http.get(f"{base}/nowhere"), 404, 404000, "Not found.")
            not_allowed = await http.post(f"{base}/healthz")
            _assert_envelope(not_allowed, 405, 405000, "Method not allowed.")
            assert not_allowed.headers["allow"] == "GET"
        local = await http.get(f"{dispatcher.base}/tasks/{task}/progress")
        _assert_envelope(local, 405, 405000, "Method not allowed.")
        remote = f"http://127.0.0.1:{progress_port}"
        _assert_envelope(await http.get(f"{remote}/metrics"), 404, 404000, "Not found.")
        wrong_method = await http.get(f"{remote}/tasks/{task}/progress/token")
        _assert_envelope(wrong_method, 405, 405000, "Method not allowed.")
        assert wrong_method.headers["allow"] == "POST"
