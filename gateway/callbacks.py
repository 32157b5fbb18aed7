"""Callback URLs: who may be called (SSRF guard) and how a call is signed.

The gateway sits inside the cluster, so a callback URL is an attacker-chosen
request from a privileged place. A URL is refused when any address its host
resolves to is loopback, private, link-local (which includes cloud metadata
endpoints), multicast, reserved or unspecified — at submission, and again at
delivery, since DNS answers change; at delivery the call then goes to the
address that was checked (`destination`), never to a second resolution.
Redirects are never followed.

How a call is signed is the contract's (`conveyor/signatures.py`): consumers verify it with
the SDK's package.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import weakref
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiodns
import httpx


class CallbackRefused(ValueError):
    """The callback may not be called; the message says why, without secrets, and `field`
    which part of the callback object is wrong (`url`, `type`, an unknown key, or "" for
    the callback itself), so that the 400002 names it."""

    def __init__(self, message: str, field: str = "url") -> None:
        super().__init__(message)
        self.field = field

    @property
    def path(self) -> str:
        return f"callback/{self.field}" if self.field else "callback"


class HostUnresolved(CallbackRefused):
    """The name does not resolve now: refused at submission, tried again at delivery (a DNS
    outage passes; a forbidden address does not)."""


@dataclass(frozen=True, slots=True)
class CallbackPolicy:
    allow_http: bool = False
    allow_private: bool = False
    allowed_hosts: tuple[str, ...] = ()


def check_shape(callback: object, policy: CallbackPolicy) -> tuple[str, str]:
    """Validates `{"type": "https", "url": ...}`; returns (url, host)."""
    if not isinstance(callback, dict):
        raise CallbackRefused("callback must be an object", field="")
    unknown = set(callback) - {"type", "url"}
    if unknown:
        first = str(sorted(map(str, unknown))[0])
        raise CallbackRefused(f"unknown callback field: {first}", field=first)
    kind = callback.get("type")
    allowed_types = {"https", "http"} if policy.allow_http else {"https"}
    if not isinstance(kind, str) or kind not in allowed_types:  # an object is not hashable
        raise CallbackRefused(f"callback type must be one of {sorted(allowed_types)}", "type")
    url = callback.get("url")
    if not isinstance(url, str) or len(url) > 2048:
        raise CallbackRefused("callback url must be a string of at most 2048 characters")
    if url != url.strip():  # urlsplit would drop the blanks that httpx then refuses to send
        raise CallbackRefused("callback url is not a valid URL")
    try:
        parts = urlsplit(url)
        port = parts.port  # raises on a malformed port
        _ = httpx.URL(url).host  # what will send it: control characters, names IDNA refuses
    except (ValueError, httpx.InvalidURL):
        raise CallbackRefused("callback url is not a valid URL") from None
    if port == 0:  # nothing listens there: every delivery would fail
        raise CallbackRefused("callback url port must be 1-65535")
    # `type` names the mechanism (an HTTP call); the URL's scheme says whether it is TLS.
    if parts.scheme not in allowed_types:
        raise CallbackRefused(f"callback url scheme must be one of {sorted(allowed_types)}")
    if not parts.hostname or parts.username or parts.password:
        raise CallbackRefused("callback url needs a host and no credentials")
    # Kept as it will be called (host lower case, IDNA, no default port, no leading zeros):
    # the notifier shares its slots per target by this text, and one endpoint spelled
    # several ways must stay one target.
    return str(httpx.URL(url)), parts.hostname.lower()


def forbidden_address(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.sixtofour is not None and _forbidden_ip(ip.sixtofour):
            return True  # 6to4 (2002::/16): a relay would reach the IPv4 address it carries
        if ip.is_site_local:
            return True  # fec0::/10: deprecated, yet private wherever it is still routed
        if ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
    return _forbidden_ip(ip)


def _forbidden_ip(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    return (
        ip.is_loopback
        or ip.is_private
        or ip.is_link_local
        or ip.is_multicast
        or ip.is_reserved
        or ip.is_unspecified
        or not ip.is_global
    )


# A look-up's limits: each query waits LOOKUP_TIMEOUT seconds, sent up to LOOKUP_TRIES times
# per name server; the whole look-up, RESOLVE_DEADLINE at most.
LOOKUP_TIMEOUT = 2.0
LOOKUP_TRIES = 2
RESOLVE_DEADLINE = 5.0
_resolvers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aiodns.DNSResolver] = (
    weakref.WeakKeyDictionary()
)


def _resolver() -> aiodns.DNSResolver:
    """The running loop's resolver (c-ares reads the system's resolv.conf and hosts file).
    Found by a sweep: the system resolver, run on the loop's shared threads, kept a thread
    for each look-up of a host that never answers, long after the check gave up; one
    client's batch of such hosts held them all, and every other client's callback was
    refused "does not resolve" for minutes."""
    loop = asyncio.get_running_loop()
    resolver = _resolvers.get(loop)
    if resolver is None:
        resolver = aiodns.DNSResolver(loop=loop, timeout=LOOKUP_TIMEOUT, tries=LOOKUP_TRIES)
        _resolvers[loop] = resolver
    return resolver


async def close_resolver() -> None:
    """Ends the running loop's resolver, if it made one (the gateway's shutdown)."""
    resolver = _resolvers.pop(asyncio.get_running_loop(), None)
    if resolver is not None:
        await resolver.close()


async def resolve(host: str, port: int | None) -> list[str]:
    try:  # an address, in any form the system reads as one (`0x7f.1`, `fe80::1%1`): no query
        numeric = socket.getaddrinfo(
            host, port or 443, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST
        )
        return list(dict.fromkeys(str(info[4][0]) for info in numeric))
    except (OSError, ValueError, UnicodeError):
        pass
    try:
        found = await asyncio.wait_for(
            _resolver().getaddrinfo(host, port=port or 443, type=socket.SOCK_STREAM),
            timeout=RESOLVE_DEADLINE,
        )
    except (aiodns.error.DNSError, OSError, TimeoutError, ValueError):  # ValueError: IDNA
        raise HostUnresolved("callback host does not resolve") from None
    # The resolver's order (RFC 6724's preferences), each address once.
    return list(dict.fromkeys(_text(node.addr[0]) for node in found.nodes))


def _text(address: bytes | str) -> str:
    return address.decode("ascii") if isinstance(address, bytes) else address


async def check_destination(url: str, policy: CallbackPolicy) -> None:
    """Raises CallbackRefused unless every address of the URL's host may be called."""
    await destination(url, policy)


@dataclass(frozen=True, slots=True)
class Destination:
    """Where to send a callback: the URL with its host replaced by each checked address, in
    the resolver's order (the next one is tried when one refuses the connection), the `Host`
    header and, for TLS, the name to present and verify (SNI)."""

    urls: list[httpx.URL]
    headers: dict[str, str] = field(default_factory=dict)
    extensions: dict[str, Any] = field(default_factory=dict)


async def destination(url: str, policy: CallbackPolicy) -> Destination:
    """Resolves the URL's host once, checks every address, and pins the call to one."""
    try:
        parsed = httpx.URL(url)
        host = parsed.host.lower()
    except (ValueError, httpx.InvalidURL):  # ValueError: a name IDNA cannot decode
        raise CallbackRefused("callback url is not a valid URL") from None
    if not host or host in policy.allowed_hosts or policy.allow_private:
        return Destination([parsed])
    addresses = await resolve(host, parsed.port)
    if not addresses or any(forbidden_address(a) for a in addresses):
        raise CallbackRefused("callback host resolves to a forbidden address")
    netloc = parsed.netloc.decode("ascii")
    extensions = {"sni_hostname": host} if parsed.scheme == "https" else {}
    urls = [parsed.copy_with(host=address) for address in addresses]
    return Destination(urls, {"Host": netloc}, extensions)


async def check_callback(callback: object, policy: CallbackPolicy) -> dict[str, str]:
    url, _ = check_shape(callback, policy)
    await check_destination(url, policy)
    return {"type": str(callback["type"]), "url": url}  # type: ignore[index]
