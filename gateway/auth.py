"""Client authentication: HTTP Basic against bcrypt hashes, without one bcrypt per request.

bcrypt costs about 0.25 s by design, so successful verifications are cached in
memory under a keyed hash of the presented credentials (never the secret
itself), for a short TTL, and only while changes to the stored secrets are heard
(gateway.credentials forgets them the moment a client or operator changes, and
turns the cache off while it cannot hear): a deleted client or a changed secret
is refused by the next request. Off the cache, a request reads the stored hash,
and a secret already verified against that very hash skips bcrypt. Concurrent
first requests with the same credentials share one verification instead of
queueing a bcrypt each. bcrypt runs on a small pool of its own, so a burst of
logins cannot starve the default executor (DNS look-ups of the callback checks
run there).

Every failure looks the same (403001) and takes as long as a real check, whether the
client exists or not: when the answer is certain without bcrypt (an unknown client, or a
secret other than the one this process already verified against the hash stored now), the
refusal waits its turn in the bcrypt pool's queue, then as long as a check takes (measured),
without spending the CPU. So neither a flood of made-up client ids nor guesses at a client
that logged in here cost bcrypt work, or delay anyone else's login.

A client id's checks, real or not, run one at a time: a burst of guesses at one client
(client ids are not secret) holds one of the pool's threads, not all of them, so another
client's first login here starts at once; and concurrent guesses take as long whether the
id exists or not.

Brute force is slowed per (client id, source address), and only for wrong
credentials: client ids are not secret, and behind an ingress every consumer
shares one address, so a throttle that refused before verifying would let
anyone lock any client out. The right secret is never refused. Over its
failure budget, a pair's attempts are answered one at a time, each after a
check's time, real or not: a few guesses a second, whatever the client. The
right secret, once verified here, is accepted at once even then. The source is
the connection's peer unless CONVEYOR_FORWARDED_ALLOW_IPS names the proxies
whose X-Forwarded-For is believed; otherwise a caller could pick its own.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import os
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass

import bcrypt

SecretLookup = Callable[[str], Awaitable[str | None]]


def hash_secret(secret: str, rounds: int = 12) -> str:
    return bcrypt.hashpw(secret.encode(), bcrypt.gensalt(rounds)).decode()


def generate_secret() -> str:
    return secrets.token_urlsafe(32)


def parse_basic(header: str | None) -> tuple[str, str] | None:
    """`Basic base64(id:secret)` → (id, secret), or None for anything malformed."""
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "basic" or not token or len(token) > 1024:
        return None
    try:
        decoded = base64.b64decode(token.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None
    client_id, sep, secret = decoded.partition(":")
    if not sep or not client_id or not secret or "\x00" in decoded:  # no NUL reaches SQL
        return None
    return client_id, secret


@dataclass
class _Window:
    started: float
    count: int


class FailureThrottle:
    """Counts failures per key in fixed one-minute windows."""

    def __init__(self, limit: int, window: float = 60.0, max_keys: int = 100_000) -> None:
        self.limit = limit
        self.window = window
        self.max_keys = max_keys
        self._windows: dict[str, _Window] = {}

    def blocked(self, key: str) -> bool:
        w = self._windows.get(key)
        return bool(w and time.monotonic() - w.started < self.window and w.count >= self.limit)

    def record(self, key: str) -> None:
        now = time.monotonic()
        w = self._windows.get(key)
        if w is None or now - w.started >= self.window:
            if len(self._windows) >= self.max_keys:
                self._prune(now)
            self._windows[key] = _Window(now, 1)
        else:
            w.count += 1

    def _prune(self, now: float) -> None:
        stale = [k for k, w in self._windows.items() if now - w.started >= self.window]
        for k in stale:
            del self._windows[k]
        if len(self._windows) >= self.max_keys:
            self._windows.clear()


@dataclass(frozen=True, slots=True)
class _Verified:
    """A client's secret as last verified here: its cache key, and the hash it matched."""

    key: bytes
    stored_hash: str


class _Turns:
    """One holder at a time, those waiting served one source after another (each source's
    own in order): a burst from one address delays a request from another by one turn, not
    by the burst."""

    def __init__(self) -> None:
        self.busy = False
        self.waiting: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()
        self.users = 0

    async def acquire(self, source: str) -> None:
        if not self.busy:  # then nobody waits: `release` leaves it busy while anyone does
            self.busy = True
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting.setdefault(source, deque()).append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.release()  # given the turn as it was cancelled: the next one's
            raise  # else `release` skips it

    def release(self) -> None:
        while self.waiting:
            source, queue = next(iter(self.waiting.items()))
            turn = queue.popleft()
            if queue:
                self.waiting.move_to_end(source)
            else:
                del self.waiting[source]
            if not turn.done():
                turn.set_result(None)
                return
        self.busy = False


@asynccontextmanager
async def _in_turn(lanes: dict[str, _Turns], key: str, source: str) -> AsyncIterator[None]:
    """`key`'s lane held, one holder at a time, sources taking turns (`_Turns`); the lane is
    forgotten once nobody holds or waits for it."""
    turns = lanes.setdefault(key, _Turns())
    turns.users += 1
    try:
        await turns.acquire(source)
        try:
            yield
        finally:
            turns.release()
    finally:
        turns.users -= 1
        if not turns.users:
            del lanes[key]


class Authenticator:
    def __init__(
        self,
        lookup: SecretLookup,
        cache_ttl: float = 30.0,
        failures_per_minute: int = 20,
        dummy_rounds: int = 12,
        bcrypt_threads: int = min(4, os.cpu_count() or 1),
    ) -> None:
        self._lookup = lookup
        self._ttl = cache_ttl
        self._key = secrets.token_bytes(32)  # per process: cache keys mean nothing elsewhere
        self._cache: dict[bytes, tuple[str, float]] = {}
        self._inflight: dict[bytes, asyncio.Future[str | None]] = {}
        self._verified: dict[str, _Verified] = {}  # one entry per client that authenticated
        self._failures = FailureThrottle(failures_per_minute)  # per (client id, source)
        self._over_budget: dict[str, _Turns] = {}  # per (client id, source) over its budget
        self._checks: dict[str, _Turns] = {}  # per client id: its checks, source by source
        self._bcrypt = ThreadPoolExecutor(bcrypt_threads, thread_name_prefix="conveyor-bcrypt")
        self._dummy_hash = bcrypt.hashpw(secrets.token_bytes(16), bcrypt.gensalt(dummy_rounds))
        self._check_seconds: float | None = None  # how long a check takes here (moving mean)
        self._heard = True  # changes to the stored secrets reach `forget` (gateway.credentials)
        self._generation = 0  # bumped by `forget`: a verification it raced is not cached

    def forget(self) -> None:
        """The stored secrets changed: each client's next request reads its hash again (one
        verified against that same hash still skips bcrypt)."""
        self._generation += 1
        self._cache.clear()

    def hearing(self, heard: bool) -> None:
        """Whether changes to the stored secrets are heard; unheard, nothing is served from
        memory, since a change would go unnoticed until the TTL."""
        self._heard = heard
        self.forget()

    def _cache_key(self, client_id: str, secret: str) -> bytes:
        return hmac.new(self._key, f"{client_id}\0{secret}".encode(), hashlib.sha256).digest()

    async def authenticate(self, header: str | None, source: str = "") -> str | None:
        """The client id, or None. None covers every reason, on purpose."""
        creds = parse_basic(header)
        if creds is None:
            return None
        client_id, secret = creds
        key = self._cache_key(client_id, secret)
        cached = self._cache.get(key)
        if cached and self._heard and cached[1] > time.monotonic():
            return cached[0]
        pair = f"{client_id}\0{source}"
        if self._failures.blocked(pair):
            result = await self._verify_throttled(pair, source, key, client_id, secret)
        else:
            result = await self._verify_once(key, client_id, secret, source)
        if result is None:
            self._failures.record(pair)
        return result

    async def _verify_throttled(
        self, pair: str, source: str, key: bytes, client_id: str, secret: str
    ) -> str | None:
        """Over the pair's failure budget: one attempt at a time, each a check's time; the
        secret verified here before is still accepted at once."""
        verified = self._verified.get(client_id)
        if verified is not None and hmac.compare_digest(verified.key, key):
            generation = self._generation
            stored = await self._lookup(client_id)
            if stored is not None and hmac.compare_digest(verified.stored_hash, stored):
                self._remember(key, client_id, stored, generation)
                return client_id
        async with _in_turn(self._over_budget, pair, source):
            return await self._verify_once(key, client_id, secret, source)

    async def _verify_once(
        self, key: bytes, client_id: str, secret: str, source: str
    ) -> str | None:
        pending = self._inflight.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        try:
            result = await self._verify(key, client_id, secret, source)
            future.set_result(result)
            return result
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # mark retrieved: waiters re-raise it
            raise
        finally:
            del self._inflight[key]

    async def _verify(self, key: bytes, client_id: str, secret: str, source: str) -> str | None:
        generation = self._generation
        stored = await self._lookup(client_id)
        verified = self._verified.get(client_id)
        refused = stored is None  # no such client: nothing could be accepted
        if stored is not None and verified and hmac.compare_digest(verified.stored_hash, stored):
            # This very hash was matched here: the answer is certain without bcrypt.
            if hmac.compare_digest(verified.key, key):
                self._remember(key, client_id, stored, generation)
                return client_id
            refused = True
        # One check at a time per client id, whether it exists or not: a burst of guesses at
        # one client takes one of the pool's threads (the others' logins go on), and takes as
        # long for an id that does not exist. The sources waiting take turns: a burst from
        # one address, sent before its failures were recorded, queued the right secret from
        # every other address behind it (found by a black-box sweep: 100 guesses, 32 s).
        async with _in_turn(self._checks, client_id, source):
            if refused or stored is None:
                await self._as_long_as_a_check()
                return None
            if not await self._check(secret.encode(), stored.encode()):
                return None
        self._remember(key, client_id, stored, generation)
        return client_id

    async def _check(self, secret: bytes, hashed: bytes) -> bool:
        """One bcrypt check on the pool; its duration feeds what a refusal without one waits."""
        loop = asyncio.get_running_loop()
        ok, seconds = await loop.run_in_executor(self._bcrypt, _timed_checkpw, secret, hashed)
        last = self._check_seconds
        self._check_seconds = seconds if last is None else 0.8 * last + 0.2 * seconds
        return ok

    async def _as_long_as_a_check(self) -> None:
        """A refusal that takes as long as a check, queue included, without its CPU: its turn
        in the pool's queue (a no-op), then a check's measured time. Until one was measured,
        a real check of the dummy hash."""
        if self._check_seconds is None:
            await self._check(secrets.token_bytes(16), self._dummy_hash)
            return
        await asyncio.get_running_loop().run_in_executor(self._bcrypt, _nothing)
        await asyncio.sleep(self._check_seconds)

    def _remember(self, key: bytes, client_id: str, stored: str, generation: int) -> None:
        """`_verified` is only ever compared with a hash read afresh, so it is kept through a
        `forget`; the cache, which skips that read, only if nothing changed since it."""
        self._verified[client_id] = _Verified(key, stored)
        if self._heard and generation == self._generation:
            self._cache[key] = (client_id, time.monotonic() + self._ttl)

    def close(self) -> None:
        self._bcrypt.shutdown(wait=False, cancel_futures=True)


def _timed_checkpw(secret: bytes, hashed: bytes) -> tuple[bool, float]:
    started = time.perf_counter()
    try:
        ok = bcrypt.checkpw(secret, hashed)
    except ValueError:  # a corrupt stored hash denies, it does not crash
        ok = False
    return ok, time.perf_counter() - started


def _nothing() -> None:
    return None
