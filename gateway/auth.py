"""Client authentication: HTTP Basic against bcrypt hashes, without one bcrypt per request.

bcrypt costs about 0.25 s by design, so successful verifications are cached in
memory under a keyed hash of the presented credentials (never the secret
itself), for a short TTL: a revoked client or a changed secret stops working
within that TTL. Concurrent first requests with the same credentials share one
verification instead of queueing a bcrypt each.

Every failure looks the same (403001). An unknown client costs one bcrypt
against a dummy hash, so it takes as long as a wrong secret, and failures are
throttled per client id and per source address against brute force.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import bcrypt

SecretLookup = Callable[[str], Awaitable[str | None]]
SOURCE_ALLOWANCE = 5


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


class Authenticator:
    def __init__(
        self,
        lookup: SecretLookup,
        cache_ttl: float = 30.0,
        failures_per_minute: int = 20,
        dummy_rounds: int = 12,
    ) -> None:
        self._lookup = lookup
        self._ttl = cache_ttl
        self._key = secrets.token_bytes(32)  # per process: cache keys mean nothing elsewhere
        self._cache: dict[bytes, tuple[str, float]] = {}
        self._inflight: dict[bytes, asyncio.Future[str | None]] = {}
        self._by_client = FailureThrottle(failures_per_minute)
        # Many clients may share one address (an ingress, a NAT): allow more per address.
        self._by_source = FailureThrottle(failures_per_minute * SOURCE_ALLOWANCE)
        self._dummy_hash = bcrypt.hashpw(secrets.token_bytes(16), bcrypt.gensalt(dummy_rounds))

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
        if cached and cached[1] > time.monotonic():
            return cached[0]
        if self._by_client.blocked(client_id) or self._by_source.blocked(source):
            return None
        result = await self._verify_once(key, client_id, secret)
        if result is None:
            self._by_client.record(client_id)
            self._by_source.record(source)
        return result

    async def _verify_once(self, key: bytes, client_id: str, secret: str) -> str | None:
        pending = self._inflight.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        try:
            result = await self._verify(client_id, secret)
            if result is not None:
                self._cache[key] = (result, time.monotonic() + self._ttl)
            future.set_result(result)
            return result
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # mark retrieved: waiters re-raise it
            raise
        finally:
            del self._inflight[key]

    async def _verify(self, client_id: str, secret: str) -> str | None:
        stored = await self._lookup(client_id)
        hashed = stored.encode() if stored else self._dummy_hash
        ok = await asyncio.to_thread(_checkpw, secret.encode(), hashed)
        return client_id if ok and stored else None

    def forget(self) -> None:
        self._cache.clear()


def _checkpw(secret: bytes, hashed: bytes) -> bool:
    try:
        return bcrypt.checkpw(secret, hashed)
    except ValueError:  # a corrupt stored hash denies, it does not crash
        return False
