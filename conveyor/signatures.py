"""Callback signatures (docs/api.md, "Callbacks"): what the gateway signs, what a consumer checks.

Stripe's scheme, so that consumers can reuse known verifiers:
`X-Conveyor-Signature: t=<unix>,v1=<hex hmac-sha256(secret, "<t>.<body>")>`. While a secret is
rotated out (CONVEYOR_CALLBACK_PREVIOUS_SIGNING_SECRET), a second `v1` is signed with it, as
Stripe does while a secret is rolled: consumers move to the new secret at their own pace, each
accepting a call when any `v1` is its own secret's. In the contract, so that a consumer checks
a callback with the SDK's package rather than the gateway's.
"""

from __future__ import annotations

import hashlib
import hmac
import time


def sign(secret: str, body: bytes, timestamp: int | None = None, previous: str = "") -> str:
    """The header's value: `t`, then a `v1` per secret (the previous one's second, if any)."""
    t = int(time.time()) if timestamp is None else timestamp
    secrets = [secret, previous] if previous else [secret]
    return ",".join([f"t={t}", *(f"v1={_mac(each, t, body)}" for each in secrets)])


def _mac(secret: str, t: int, body: bytes) -> str:
    return hmac.new(secret.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()


# More digits than any time has: a sender's 5,000 made `int` raise where `verify` says False.
_MAX_DIGITS = 20


def verify(secret: str, body: bytes, header: str, tolerance: float = 300.0) -> bool:
    """What a consumer runs: one of the `v1` signatures is `secret`'s, and it is recent."""
    t, signatures = None, []
    for part in header.split(","):
        key, _, value = part.partition("=")
        if key == "t" and value.isascii() and value.isdigit() and len(value) <= _MAX_DIGITS:
            t = int(value)
        elif key == "v1":
            signatures.append(value.encode("utf-8", "replace"))
    if t is None or abs(time.time() - t) > tolerance:
        return False
    expected = _mac(secret, t, body).encode()
    return any(hmac.compare_digest(expected, each) for each in signatures)
