"""gateway.auth in process, with an in-memory client table: what the real-stack tests in
tests/security/test_auth.py cannot observe from outside."""

from __future__ import annotations

import asyncio
import base64
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

import bcrypt

from gateway.auth import Authenticator, _Turns

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


def _table(*names: str) -> Callable[[str], Awaitable[str | None]]:
    """Clients whose secret is `<name>-secret` (bcrypt cost 8)."""
    stored = {
        name: bcrypt.hashpw(f"{name}-secret".encode(), bcrypt.gensalt(8)).decode() for name in names
    }

    async def table(client_id: str) -> str | None:
        return stored.get(client_id)

    return table


class _Logins:
    """Attempts at one authenticator, and the order their answers came in (by secret)."""

    def __init__(self, auth: Authenticator) -> None:
        self.auth = auth
        self.finished: list[str] = []

    async def attempt(self, client_id: str, secret: str, source: str) -> str | None:
        answer = await self.auth.authenticate(basic(client_id, secret), source)
        self.finished.append(secret)
        return answer

    def burst(self, client_id: str, guesses: int, sources: int) -> list[asyncio.Task[str | None]]:
        return [
            asyncio.create_task(self.attempt(client_id, f"guess-{n}", f"10.0.1.{n % sources}"))
            for n in range(guesses)
        ]


async def test_a_burst_of_guesses_at_one_client_does_not_queue_another_clients_first_login() -> (
    None
):
    """Found by a black-box test: 60 concurrent wrong secrets for one known client (client ids
    are not secret) filled the bcrypt pool's queue, and another client's first login here
    waited behind all of them (9 s). A client's checks now run one at a time: a burst at one
    client holds one of the pool's threads, and a login of another starts at once."""
    auth = Authenticator(
        _table("carol", "bob"), cache_ttl=0, failures_per_minute=1000, dummy_rounds=8
    )
    logins = _Logins(auth)
    try:
        burst = logins.burst("carol", 40, sources=1)
        await asyncio.sleep(0.01)  # the burst is queued
        assert await logins.attempt("bob", "bob-secret", "10.0.1.0") == "bob"
        done_before_bob = logins.finished.index("bob-secret")
        assert await asyncio.gather(*burst) == [None] * 40
        assert done_before_bob <= 4, done_before_bob  # not behind the 40
    finally:
        auth.close()


async def test_a_burst_of_guesses_from_one_address_does_not_queue_the_right_secret_from_another() -> (
    None
):
    """Found by a black-box sweep: a burst of wrong secrets for a client from one address,
    sent before any failure was recorded, queued on that client's one lane, and its right
    secret from any other address waited behind all of them on a process that had not
    verified it yet (100 guesses: 32 s; the SDK gives up after 10). The addresses waiting
    take turns: only a login from the guesser's own address waits behind the burst."""
    auth = Authenticator(_table("carol"), cache_ttl=0, failures_per_minute=20, dummy_rounds=8)
    logins = _Logins(auth)
    try:
        burst = logins.burst("carol", 40, sources=1)
        await asyncio.sleep(0.01)  # the burst is queued
        assert await logins.attempt("carol", "carol-secret", "10.0.0.2") == "carol"
        done_before = logins.finished.index("carol-secret")
        assert await asyncio.gather(*burst) == [None] * 40
        assert done_before <= 4, done_before  # not behind the 40
    finally:
        auth.close()


async def test_guesses_at_one_client_from_many_addresses_queue_no_other_login() -> None:
    """Found by a black-box sweep of the fix above, which first gave each (client, address)
    pair a lane of its own: 90 guesses at one client from 30 addresses were 30 checks at
    once on the gateway's one bcrypt thread, and another client's first login waited behind
    them (4 s, against 0.29 s before). A client's checks stay one at a time, each address
    taking its turn: another client waits one check at most, this client's right secret
    from a new address one check per address guessing."""
    auth = Authenticator(
        _table("erin", "dave"),
        cache_ttl=0,
        failures_per_minute=1000,
        dummy_rounds=8,
        bcrypt_threads=1,
    )
    logins = _Logins(auth)
    try:
        burst = logins.burst("erin", 30, sources=10)
        await asyncio.sleep(0.01)  # the burst is queued
        assert await logins.attempt("dave", "dave-secret", "10.0.0.5") == "dave"
        other_client = logins.finished.index("dave-secret")
        assert await logins.attempt("erin", "erin-secret", "10.0.0.6") == "erin"
        same_client = logins.finished.index("erin-secret") - other_client - 1
        assert await asyncio.gather(*burst) == [None] * 30
        assert other_client <= 2, other_client  # not behind the 30
        assert same_client <= 12, same_client  # one turn per address guessing, not 30
    finally:
        auth.close()


async def test_guesses_take_as_long_whether_the_client_exists_or_not() -> None:
    """One identical 403 in the same time: concurrent guesses at a client that exists were
    slower than at one that does not (a burst told which ids exist)."""
    known = {"carol": bcrypt.hashpw(b"carol-secret", bcrypt.gensalt(8)).decode()}

    async def table(client_id: str) -> str | None:
        return known.get(client_id)

    auth = Authenticator(table, cache_ttl=0, failures_per_minute=1000, dummy_rounds=8)
    loop = asyncio.get_running_loop()
    try:
        assert await auth.authenticate(basic("carol", "warm-up"), "10.0.0.9") is None

        async def burst(client_id: str) -> float:
            began = loop.time()
            guesses = [auth.authenticate(basic(client_id, f"g-{n}"), "10.0.0.1") for n in range(8)]
            assert await asyncio.gather(*guesses) == [None] * 8
            return loop.time() - began

        real, made_up = await burst("carol"), await burst("nobody")
        assert 0.4 < made_up / real < 2.5, (made_up, real)
    finally:
        auth.close()


class _Table:
    """A client table whose reads are counted, and can be held half-way."""

    def __init__(self) -> None:
        self.hashes = dict(STORED)
        self.reads = 0
        self.hold: asyncio.Event | None = None
        self.reading = asyncio.Event()

    async def __call__(self, client_id: str) -> str | None:
        self.reads += 1
        found = self.hashes.get(client_id)
        if self.hold is not None:
            self.reading.set()
            await self.hold.wait()
        return found


async def test_unheard_every_request_reads_the_stored_hash_without_bcrypt_again() -> None:
    """While the gateway cannot hear changes to the secrets (gateway.credentials), nothing is
    served from memory: a client deleted meanwhile is refused by its next request."""
    table = _Table()
    auth = Authenticator(table, cache_ttl=3600, dummy_rounds=4)
    try:
        assert await auth.authenticate(basic("client-a", SECRET)) == "client-a"
        assert await auth.authenticate(basic("client-a", SECRET)) == "client-a"
        assert table.reads == 1  # heard: the second came from memory
        auth.hearing(False)
        checks_before = auth._check_seconds
        for _ in range(3):
            assert await auth.authenticate(basic("client-a", SECRET)) == "client-a"
        assert table.reads == 4
        assert auth._check_seconds == checks_before  # verified against that hash: no bcrypt
        del table.hashes["client-a"]
        assert await auth.authenticate(basic("client-a", SECRET)) is None
    finally:
        auth.close()


async def test_forget_refuses_a_deleted_client_at_once_and_keeps_no_verification_it_raced() -> None:
    table = _Table()
    auth = Authenticator(table, cache_ttl=3600, dummy_rounds=4)
    try:
        assert await auth.authenticate(basic("client-a", SECRET)) == "client-a"
        del table.hashes["client-a"]
        assert await auth.authenticate(basic("client-a", SECRET)) == "client-a"  # memory
        auth.forget()  # the deletion's notification
        assert await auth.authenticate(basic("client-a", SECRET)) is None

        # A verification that read the hash before a change, and finished after its
        # notification, answers for the hash it read but is not kept.
        table.hashes["client-a"] = STORED["client-a"]
        auth.forget()
        table.hold = asyncio.Event()
        racing = asyncio.create_task(auth.authenticate(basic("client-a", SECRET)))
        await table.reading.wait()
        del table.hashes["client-a"]
        auth.forget()
        table.hold.set()
        assert await racing == "client-a"
        table.hold = None
        assert await auth.authenticate(basic("client-a", SECRET)) is None
    finally:
        auth.close()


async def test_a_check_given_up_while_waiting_its_turn_holds_up_no_one() -> None:
    """A request that ends while it waits for its turn (its client gone), or just as it was
    given it, passes the turn on: the next waiting check runs, and the lane is free after."""
    turns = _Turns()
    await turns.acquire("a")  # held
    gone = asyncio.create_task(turns.acquire("b"))
    granted_then_gone = asyncio.create_task(turns.acquire("c"))
    waiting = asyncio.create_task(turns.acquire("d"))
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.sleep(0)
    turns.release()  # skips b, gives c its turn...
    granted_then_gone.cancel()  # ...which ends before it runs
    await asyncio.wait_for(waiting, 1)  # d runs
    turns.release()
    assert not turns.busy and not turns.waiting
    await asyncio.wait_for(turns.acquire("e"), 1)  # free at once
