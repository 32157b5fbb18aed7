"""gateway.auth in process, with an in-memory client table: what the real-stack tests in
tests/security/test_auth.py cannot observe from outside."""

from __future__ import annotations

import asyncio
import base64
import threading
from concurrent.futures import ThreadPoolExecutor

import bcrypt

from gateway.auth import Authenticator

SECRET = "right-secret"
STORED = {"client-a": bcrypt.hashpw(SECRET.encode(), bcrypt.gensalt(4)).decode()}


def basic(client_id: str, secret: str) -> str:
    return "Basic " + base64.b64encode(f"{client_id}:{secret}".encode()).decode()


async def lookup(client_id: str) -> str | None:
    return STORED.get(client_id)


async def test_bcrypt_does_not_wait_for_a_busy_default_executor() -> None:
    """Callback checks resolve names in the default executor: slow DNS must not stall logins."""
    loop = asyncio.get_running_loop()
    loop.set_default_executor(ThreadPoolExecutor(1))
    release = threading.Event()
    busy = loop.run_in_executor(None, release.wait)  # the default executor's only thread
    auth = Authenticator(lookup, dummy_rounds=4)
    try:
        answer = await asyncio.wait_for(auth.authenticate(basic("client-a", SECRET)), 10)
        assert answer == "client-a"
    finally:
        release.set()
        await busy
        auth.close()


async def test_over_budget_the_right_secret_is_accepted_and_wrong_ones_refused() -> None:
    auth = Authenticator(lookup, cache_ttl=0, failures_per_minute=2, dummy_rounds=4)
    try:
        for source in ("10.0.0.1", "10.0.0.2"):
            for n in range(5):
                assert await auth.authenticate(basic("client-a", f"guess-{n}"), source) is None
        for _ in range(2):  # first by bcrypt, then from what that verification proved
            assert await auth.authenticate(basic("client-a", SECRET), "10.0.0.1") == "client-a"
            assert await auth.authenticate(basic("client-a", "guess"), "10.0.0.1") is None
        assert await auth.authenticate(basic("ghost", SECRET), "10.0.0.1") is None
    finally:
        auth.close()
