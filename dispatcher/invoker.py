"""The HTTP call to the function, and what its answer means (docs/functions.md).

The request is a CloudEvent in HTTP binary mode (`ce-*` headers, the task's
body as plain JSON), so a function written for Knative Eventing works
unchanged, plus the `X-Conveyor-*` headers that only Conveyor functions read.

One aiohttp session with keep-alive serves every call of the process: no
connection is opened per task. aiohttp, not httpx, because the call is most of
the sidecar's work: a POST costs ~65 µs of CPU with aiohttp's C parser on
asyncio's own streams against ~385 µs through httpx, httpcore, h11 and anyio
(`python -m bench.http_client`). Redirects are not followed, cookies are not
kept, and only the deadline bounds a call (aiohttp's own timeouts are off).

| answer                               | outcome                          |
|--------------------------------------|----------------------------------|
| 2xx                                  | Success(JSON body / string / None)|
| 2xx, JSON nested too deep to carry   | Failure, final                   |
| 4xx except 408, 429 (and 1xx, 3xx)   | Failure, final                   |
| (its body cut or undecodable too)    |                                  |
| 408, 429, 5xx, network error, an     | Failure, retryable               |
| answer that is not valid HTTP        |                                  |
| no whole answer by the deadline      | Failure, retryable (time allowing)|
| an answer over MAX_RESPONSE_BYTES    | Failure, final                   |
| 2xx JSON of over MAX_RESPONSE_ITEMS  | Failure, final                   |

Nothing a function answers may crash the dispatcher or the gateway downstream:
the deadline bounds the whole call (a trickled answer included), the body is
read up to a cap, and NUL characters, which PostgreSQL cannot store, become
U+FFFD.
"""

from __future__ import annotations

import asyncio
import codecs
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from email.message import Message
from typing import Any

import aiohttp
from aiohttp.client_proto import ResponseHandler
from aiohttp.http_exceptions import HttpProcessingError
from yarl import URL

from conveyor import headers as h
from conveyor import storable, strict_json
from conveyor.storable import truncate

RETRYABLE_STATUS = frozenset({408, 429})
_ERROR_FIELDS = ("errorMessage", "error", "detail")
MAX_DEPTH = 128  # deeper answers are refused, as the gateway refuses deeper requests


class Unparseable(ValueError):
    """JSON that cannot be carried on: nested deeper than MAX_DEPTH."""


class TooLarge(Exception):
    """The answer is longer than the dispatcher's cap."""


class UnreadBody(Exception):
    """An answer that is not a success whose body could not be read (cut, or in a
    Content-Encoding it is not in): its status still decides, as the table says."""

    def __init__(self, status: int, headers: Mapping[str, str], cause: aiohttp.ClientError):
        super().__init__(status)
        self.status = status
        self.headers = headers
        self.cause = cause


@dataclass(frozen=True, slots=True)
class Success:
    response: Any

    @property
    def label(self) -> str:
        """The call's outcome in metrics (`conveyor_dispatcher_function_calls_total`)."""
        return "success"


@dataclass(frozen=True, slots=True)
class Failure:
    error: str
    retryable: bool
    retry_after: str | None = None  # the raw Retry-After header; see retry.py
    timed_out: bool = False  # no whole answer in time: told apart from a refusal in metrics
    unreachable: bool = False  # no connection: the function never saw the call (see retry.py)

    @property
    def label(self) -> str:
        """`timeout` (no answer in time), `retryable` (408, 429, 5xx, network) or `failure`
        (the function's final refusal, or an answer that cannot be carried)."""
        if self.timed_out:
            return "timeout"
        return "retryable" if self.retryable else "failure"


Outcome = Success | Failure


@dataclass(frozen=True, slots=True)
class Invocation:
    """Everything the function is told about one delivery of one task."""

    task_id: str
    attempt: int  # X-Conveyor-Attempt: the delivery number, from 1
    deadline: datetime
    body: bytes  # the task's body, JSON
    ce_type: str
    ce_source: str
    ce_time: str | None
    progress_url: str
    traceparent: str | None = None

    def headers(self, retry: int) -> dict[str, str]:
        headers = {
            h.CE_ID: self.task_id,
            h.CE_TYPE: self.ce_type,
            h.CE_SOURCE: self.ce_source,
            h.CE_SUBJECT: self.task_id,
            h.CE_SPECVERSION: "1.0",
            h.CE_TIME: self.ce_time or rfc3339(datetime.now(UTC)),
            "content-type": "application/json",
            h.TASK_ID: self.task_id,
            h.ATTEMPT: str(self.attempt),
            h.RETRY: str(retry),
            h.DEADLINE: rfc3339(self.deadline),
            h.PROGRESS_URL: self.progress_url,
        }
        if self.traceparent:
            headers[h.TRACEPARENT] = self.traceparent
        return headers


def rfc3339(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


# ---------------------------------------------------------------------------
# answer -> outcome (pure)


_NOT_HTTP = "The function's answer was not valid HTTP"


def classify(
    status: int,
    body: bytes,
    headers: Mapping[str, str] | None = None,
    max_items: int = storable.MAX_ITEMS,
) -> Outcome:
    """SPEC §7 table. `headers` only matters for Retry-After, Location and the charset;
    `max_items`: see `storable.too_many_items`."""
    if status < 100:
        # aiohttp's parser takes a three-digit 000 to 099 that its C parser refuses as 0 to 99:
        # not HTTP either way (docs/functions.md), so retried as a cut answer is, not final.
        return Failure(f"{_NOT_HTTP}: status {status} is below 100", retryable=True)
    charset = declared_charset(headers or {})
    crowded = storable.too_many_items(body, max_items)
    if 200 <= status < 300:
        if crowded:
            message = f"The function's answer holds more than {max_items} JSON items."
            return Failure(message, retryable=False)
        try:
            return Success(response_value(body, charset))
        except Unparseable as exc:
            return Failure(f"The function's answer could not be parsed: {exc}.", retryable=False)
    message = _text(body, charset).strip() if crowded else error_message(body, charset)
    if 400 <= status < 500 and status not in RETRYABLE_STATUS:
        # The function's own refusal: its message is the task's errorMessage (SPEC §7).
        return Failure(truncate(message or f"HTTP {status}"), retryable=False)
    cause = f"HTTP {status}"
    if 300 <= status < 400:
        # Said, so that a 3xx body ("<html>moved</html>") does not read as the function's.
        location = (headers or {}).get("location")
        where = f"; Location: {location}" if location else ""
        cause = f"{cause} (redirects are not followed{where})"
    if message:
        cause = f"{cause}: {message}"
    if status >= 500 or status in RETRYABLE_STATUS:
        retry_after = (headers or {}).get("retry-after")
        return Failure(truncate(cause), retryable=True, retry_after=retry_after)
    return Failure(truncate(cause), retryable=False)


def network_failure(exc: aiohttp.ClientError) -> Failure:
    """Connection refused or reset, a malformed answer: the function may come back."""
    if isinstance(exc, aiohttp.ClientResponseError | aiohttp.ClientPayloadError):
        detail = f"{_NOT_HTTP}: {_parse_error(exc)}"
        return Failure(truncate(detail), retryable=True)
    if isinstance(exc, aiohttp.ServerDisconnectedError) and not isinstance(exc.message, str):
        # aiohttp hands over the half-parsed answer (its repr holds the function's headers)
        detail = f"{_NOT_HTTP}: the connection closed before its"
        return Failure(f"{detail} headers ended", retryable=True)
    detail = str(exc) or type(exc).__name__
    if isinstance(exc, aiohttp.ClientConnectorError):
        detail = f"cannot connect to the function: {detail}"
        return Failure(truncate(detail), retryable=True, unreachable=True)
    return Failure(truncate(detail), retryable=True)


def _unread_body(exc: UnreadBody) -> Failure:
    """A 400 in a broken gzip is still the function's refusal: final, not made again (a sweep
    found it retried as an answer that is not HTTP, the status lost from its error)."""
    outcome = classify(exc.status, b"", exc.headers)  # not a 2xx (_post_once): a Failure
    retryable = isinstance(outcome, Failure) and outcome.retryable
    retry_after = outcome.retry_after if isinstance(outcome, Failure) else None
    detail = f"HTTP {exc.status} (its body could not be read: {_parse_error(exc.cause)})"
    return Failure(truncate(detail), retryable, retry_after)


def _parse_error(exc: aiohttp.ClientError) -> str:
    """aiohttp's words for what is wrong with an answer, without the 400 it gives every
    parse error (it read as the function's status) nor the function's inner URL, and
    without the lines of its caret drawing."""
    cause = exc if isinstance(exc, aiohttp.ClientResponseError) else exc.__cause__
    if isinstance(cause, aiohttp.ClientResponseError | HttpProcessingError):
        text = cause.message
    else:
        text = str(exc)
    lines = (line.strip() for line in text.splitlines())
    return " ".join(line for line in lines if line.strip("^"))


def response_value(body: bytes, charset: str | None = None) -> Any:
    """2xx body: JSON when it parses, else the text (in `charset`) as a JSON string;
    empty -> None. Raises Unparseable for JSON too deep to carry."""
    if not body.strip():
        return None
    try:
        return _declared_json(body, charset)
    except Unparseable:
        raise
    except ValueError:
        return _text(body, charset)


def error_message(body: bytes, charset: str | None = None) -> str:
    """The body's errorMessage, error or detail, else its text (in `charset`). A field that
    is empty, or only blanks, says nothing and is passed over."""
    if not body.strip():
        return ""
    try:
        payload = _declared_json(body, charset)
    except ValueError:
        return _text(body, charset).strip()
    if isinstance(payload, dict):
        for name in _ERROR_FIELDS:
            value = payload.get(name)
            if value is None or (isinstance(value, str) and not value.strip()):
                continue
            return value if isinstance(value, str) else json.dumps(value)
    return payload if isinstance(payload, str) else json.dumps(payload)


def _declared_json(body: bytes, charset: str | None) -> Any:
    """JSON in UTF-8 (RFC 8259), or in the charset its Content-Type declares: a sweep found
    `{"name": "caf\xe9"}` in ISO-8859-1 stored as a string, where the same in ASCII was an
    object, and a 400's errorMessage in it not read."""
    try:
        return _strict_json(body)
    except Unparseable:
        raise
    except ValueError:
        if charset is None:
            raise
        decoded = _text(body, charset)
        if decoded == body.decode("utf-8", errors="replace"):
            raise  # read as UTF-8 (an unknown charset, or UTF-8 itself): no other reading
        return _strict_json(decoded.encode())


def _strict_json(body: bytes) -> Any:
    """NaN/Infinity are not JSON and could not be published as such; depth and NUL are
    checked only when the bytes say they may matter (cheap for ordinary answers)."""
    try:
        value = strict_json.loads(body)
    except strict_json.TooDeep:
        raise Unparseable(f"nested deeper than {MAX_DEPTH} levels") from None
    # JSON in UTF-16 or UTF-32 spells a NUL otherwise: its copy is always checked.
    suspect = storable.suspect(body) or json.detect_encoding(body) != "utf-8"
    try:
        if suspect:
            value = storable.storable(value, MAX_DEPTH)
        elif body.count(b"[") + body.count(b"{") > MAX_DEPTH:
            storable.check_depth(value, MAX_DEPTH)
    except storable.TooDeep as exc:
        raise Unparseable(str(exc)) from None
    return value


def declared_charset(headers: Mapping[str, str]) -> str | None:
    """The charset parameter of the answer's Content-Type, if it names one."""
    content_type = headers.get("content-type")
    if not content_type:
        return None
    message = Message()
    message["content-type"] = content_type
    return message.get_content_charset()


def _text(body: bytes, charset: str | None) -> str:
    """The body in the charset it declares (ISO-8859-1 read as UTF-8 lost its accents), else
    UTF-8; both with replacement. A name that is no text codec (`zlib`, `base64`, unknown), or
    a codec without replacement (`idna`), or one that reads escapes (`unicode_escape`: the
    body's `\\u0041` would be stored as `A`), is UTF-8: what a function declares never fails it."""
    try:
        if charset is None or codecs.lookup(charset).name.endswith("escape"):
            raise LookupError(charset)
        decoded = body.decode(charset, errors="replace")
    except (LookupError, ValueError):
        decoded = body.decode("utf-8", errors="replace")
    return storable.text(decoded)


# ---------------------------------------------------------------------------
# the call


class _StrictResponseHandler(ResponseHandler):
    """A pooled connection with bytes the function sent unasked is not reused.

    aiohttp 3.14 reuses an idle pooled connection when `is_connected()` and keep-alive
    allow, without looking at `should_close` (aio-libs/aiohttp#13656): a second answer
    written after the first was queued there and taken as the next task's answer. The
    connector consults `is_connected()` only for idle pooled connections (`_get`,
    `_cleanup`), so a call in progress is not affected: an unfit idle one is closed
    instead. (`Connection.closed` reads it too; nothing here or in aiohttp reads that.)
    """

    def is_connected(self) -> bool:
        return super().is_connected() and not self.should_close


class _Connector(aiohttp.TCPConnector):
    """A TCPConnector whose connections use _StrictResponseHandler."""

    def __init__(self, *, limit: int, keepalive_timeout: float) -> None:
        super().__init__(limit=limit, keepalive_timeout=keepalive_timeout)
        self._factory = functools.partial(self._protocol, loop=self._loop)

    @staticmethod
    def _protocol(loop: asyncio.AbstractEventLoop) -> ResponseHandler:
        return _StrictResponseHandler(loop)


async def _reused(_: Any, trace: Any, __: Any) -> None:
    trace.trace_request_ctx["reused"] = True


# Which calls went out on a kept-alive connection (aiohttp's tracing, its public way to say).
_REUSE = aiohttp.TraceConfig()
_REUSE.on_connection_reuseconn.append(_reused)
# How a kept-alive connection the function closed fails a call sent on it: nothing read back.
_UNREAD = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)


def _unanswered(exc: aiohttp.ClientError) -> bool:
    """No byte of an answer came (aiohttp hands a half-read answer over as the message)."""
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return isinstance(exc.message, str)
    return True


class Invoker:
    """Calls FUNCTION_URL; one shared keep-alive session for the whole process."""

    def __init__(
        self,
        function_url: str,
        concurrency: int,
        max_response_bytes: int = 8 * 1024 * 1024,
        max_response_items: int = storable.MAX_ITEMS,
    ) -> None:
        self.url = URL(function_url)  # parsed once
        self.concurrency = concurrency
        self.max_response_bytes = max_response_bytes
        self.max_response_items = max_response_items
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        """Made on first use, inside the running loop (aiohttp binds a session to it)."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                # Idle connections are closed before the usual servers' 5 s (uvicorn, Node)
                # would close them; a call that races a server's close all the same (a
                # shorter keep-alive, a graceful restart) is made again (_post).
                connector=_Connector(limit=self.concurrency, keepalive_timeout=4.0),
                timeout=aiohttp.ClientTimeout(total=None),
                cookie_jar=aiohttp.DummyCookieJar(),
                trust_env=False,
                trace_configs=[_REUSE],
            )
        return self._session

    async def call(self, invocation: Invocation, retry: int, timeout: float) -> Outcome:
        try:
            # The deadline bounds the whole call: a function trickling its answer a byte at
            # a time is cut when it passes.
            async with asyncio.timeout(timeout):
                answer, body = await self._post(invocation, retry)
        except TimeoutError:
            return Failure(
                "The function did not answer within the task timeout.",
                retryable=True,
                timed_out=True,
            )
        except TooLarge:
            limit = self.max_response_bytes
            return Failure(f"The function's answer exceeded {limit} bytes.", retryable=False)
        except UnreadBody as exc:
            return _unread_body(exc)
        except aiohttp.ClientError as exc:
            return network_failure(exc)
        except ValueError as exc:
            # aiohttp refuses a header value with control characters (a message put on `-in`
            # by hand, with a CR LF in its ce-source): no retry can send it.
            return Failure(truncate(f"The task could not be sent to the function: {exc}"), False)
        return classify(answer.status, body, answer.headers, self.max_response_items)

    async def _post(
        self, invocation: Invocation, retry: int
    ) -> tuple[aiohttp.ClientResponse, bytes]:
        """The call, made again at once, on another connection, when the one it was sent on
        was a kept-alive connection the function closed as it went: the function read
        nothing of it (a sweep: 32 of 200 calls to a server closing idle connections failed
        so, none of them read). Each pooled connection may be stale: CONCURRENCY of them at
        most, then a new one, whose failure is the call's."""
        for _ in range(self.concurrency):
            sent_on: dict[str, bool] = {}
            try:
                return await self._post_once(invocation, retry, sent_on)
            except _UNREAD as exc:
                if not (sent_on.get("reused") and _unanswered(exc)):
                    raise
        return await self._post_once(invocation, retry, {})

    async def _post_once(
        self, invocation: Invocation, retry: int, sent_on: dict[str, bool]
    ) -> tuple[aiohttp.ClientResponse, bytes]:
        async with self._client().post(
            self.url,
            data=invocation.body,
            headers=invocation.headers(retry),
            allow_redirects=False,
            trace_request_ctx=sent_on,
        ) as answer:
            try:
                return answer, await self._read(answer)
            except aiohttp.ClientPayloadError as exc:
                if 200 <= answer.status < 300:
                    raise  # no result to record: made again, as an answer cut short is
                raise UnreadBody(answer.status, answer.headers, exc) from exc

    async def _read(self, answer: aiohttp.ClientResponse) -> bytes:
        """The body up to the cap; leaving early closes the connection (aiohttp does not
        put back a connection whose answer was not read to the end)."""
        declared = answer.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_response_bytes:
            raise TooLarge
        chunks: list[bytes] = []
        size = 0
        async for chunk in answer.content.iter_any():
            size += len(chunk)
            if size > self.max_response_bytes:
                raise TooLarge
            chunks.append(chunk)
        return b"".join(chunks)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
