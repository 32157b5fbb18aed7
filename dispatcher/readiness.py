"""Is the function there? Checked before consuming anything, and by `/readyz`.

A function that is still starting must not turn tasks into failures, so the
dispatcher takes no message until the function answers: a GET on
`FUNCTION_READY_URL` that is not a 5xx, or, without one, a TCP connection to
`FUNCTION_URL`'s host and port. It gives up after `FUNCTION_WAIT_TIMEOUT`
(0 means: do not wait).
"""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import SplitResult, urlsplit

import aiohttp
from tenacity import AsyncRetrying, RetryCallState, retry_if_result, wait_exponential

log = logging.getLogger(__name__)

PROBE_TIMEOUT = 1.0


class FunctionProbe:
    """One cheap reachability check, on a client of its own.

    The invoker's connection pool may be fully busy with long calls; a probe
    must not queue behind them.
    """

    def __init__(self, function_url: str, ready_url: str | None) -> None:
        self.ready_url = ready_url
        parts = urlsplit(function_url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = _port(parts)
        # Where it looks, for the log while it waits: a wrong URL shows at once.
        probed = urlsplit(ready_url) if ready_url else parts
        self.where = {"host": probed.hostname or self.host, "port": _port(probed)}
        self._session: aiohttp.ClientSession | None = None

    async def reachable(self) -> bool:
        try:
            if self.ready_url:
                async with asyncio.timeout(PROBE_TIMEOUT):
                    async with self._client().get(self.ready_url, allow_redirects=False) as got:
                        return got.status < 500
            return await self._tcp_connect()
        except (OSError, aiohttp.ClientError, TimeoutError):
            return False

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None),
                cookie_jar=aiohttp.DummyCookieJar(),
                trust_env=False,
            )
        return self._session

    async def _tcp_connect(self) -> bool:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(self.host, self.port), PROBE_TIMEOUT
        )
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass
        return True

    async def wait(self, timeout: float, stop: asyncio.Event) -> bool:
        """True once reachable; False after `timeout` seconds or when `stop` is set."""
        if timeout <= 0:
            return True

        def waiting(state: RetryCallState) -> None:
            if state.attempt_number == 1:
                log.info("waiting for the function", extra={"timeout": timeout, **self.where})

        retrying = AsyncRetrying(
            retry=retry_if_result(lambda reachable: not reachable),
            stop=lambda state: (state.seconds_since_start or 0.0) >= timeout or stop.is_set(),
            wait=wait_exponential(multiplier=0.05, max=0.5),
            before_sleep=waiting,
            retry_error_callback=lambda state: False,
        )
        reachable: bool = await retrying(self.reachable)
        if reachable and retrying.statistics.get("attempt_number", 1) > 1:
            log.info("function is reachable")
        return reachable

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def _port(url: SplitResult) -> int:
    return url.port or (443 if url.scheme == "https" else 80)
