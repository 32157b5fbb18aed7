"""The wire contract: what travels on `<queue>-in` and `<queue>-out`.

Gateway and dispatcher both speak through this module and nothing else, so the
format is defined once. Two formats exist side by side (SPEC §6.2, §6.3):

* CloudEvents, RabbitMQ binary binding: attributes in `ce-` headers, `data` in
  the body. Encoded and decoded with the `cloudevents` 2.x binding, its JSON
  data written and read by `strict_json` (once per message, orjson's speed).
* The seed's legacy JSON, read in both camelCase and snake_case spellings.

Decoding never raises anything but `WireError`, so a consumer can set a poison
message aside with one `except`.
"""

from __future__ import annotations

import enum
import json
import math
import uuid
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from cloudevents.core.bindings import rabbitmq as ce_rabbitmq
from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.v1.event import CloudEvent

from conveyor import headers as h
from conveyor import storable, strict_json

SPECVERSION_HEADER = h.CE_SPECVERSION
TRACEPARENT = "traceparent"

# Extension attributes (CloudEvents names: lowercase alphanumerics only).
EXT_ATTEMPT = "conveyorattempt"  # identifies one delivery of a task to a function
EXT_MAX_ATTEMPTS = "conveyormaxattempts"
EXT_TIMEOUT = "conveyortimeout"  # seconds one attempt may run
# The longest `conveyortimeout`: a service's taskTimeout, which the gateway keeps in a PostgreSQL
# integer (~68 years). A longer one was not written by a gateway, and overflows the clocks a
# dispatcher adds it to.
MAX_TIMEOUT = 2**31 - 1
# When the task expires (RFC 3339): no dispatcher calls it later. The message's AMQP
# `expiration` only bounds its wait in the queue, not in a dispatcher's prefetch buffer.
EXT_EXPIRES = "conveyorexpires"
# On a terminal event whose attempt sent no `started` (a call shorter than STARTED_DELAY_MS):
# who ran it and when it began, so the task still gets its workerHost and startDate.
EXT_HOST = "conveyorhost"
EXT_STARTED = "conveyorstarted"

SUBMITTED = "io.conveyor.task.submitted"
CANCELLED = "io.conveyor.task.cancelled"  # gateway -> dispatchers, on `<queue>-control`


def _json_type(datacontenttype: str | None) -> bool:
    """JSON data, as the binding decides it."""
    pattern = JSONFormat.JSON_CONTENT_TYPE_PATTERN
    return pattern.match(datacontenttype or JSONFormat.DEFAULT_CONTENT_TYPE) is not None


class _Format(JSONFormat):
    """The binding's JSON format, with `data` written by strict_json and read by it once.

    `parsed` is the body as `_from_wire` already read it (strictly): it is the data whenever
    the binding's own reading (the stdlib's, of the body decoded as UTF-8) would have given
    the same; otherwise the binding reads the body itself, exactly as it always did.
    """

    def __init__(self, parsed: Any = None) -> None:
        self.parsed = parsed

    def write_data(self, data: Any, datacontenttype: str | None) -> bytes:
        if isinstance(data, dict) and _json_type(datacontenttype):
            return strict_json.dumps(data, allow_nan=True)  # as the binding's json.dumps
        return super().write_data(data, datacontenttype)

    def read_data(self, body: bytes, datacontenttype: str | None) -> Any:
        if body and _json_type(datacontenttype) and _plain_utf8(body):
            return self.parsed
        return super().read_data(body, datacontenttype)


def _plain_utf8(body: bytes) -> bool:
    """Whether the stdlib reads `body` and `body.decode()` alike: UTF-8 without a byte order
    mark, no encoded surrogates, no bytes that make it guess UTF-16 or UTF-32."""
    if json.detect_encoding(body) != "utf-8":
        return False
    if body.isascii():
        return True
    try:
        body.decode()
    except UnicodeDecodeError:
        return False
    return True


_WRITER = _Format()


class WireError(ValueError):
    """A message that cannot be understood. Callers count it and set it aside."""


class MessageFormat(enum.StrEnum):
    CLOUDEVENTS = "cloudevents"
    LEGACY = "legacy"


class EventKind(enum.StrEnum):
    STARTED = "started"
    PROGRESS = "progress"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    # The dispatcher handed the attempt's message back to `-in` (a shutdown): the task waits
    # in the queue again. CloudEvents only: the seed's legacy format has no such message.
    REQUEUED = "requeued"

    @property
    def ce_type(self) -> str:
        return f"io.conveyor.task.{self.value}"

    @property
    def terminal(self) -> bool:
        return self in (EventKind.SUCCEEDED, EventKind.FAILED)


_KIND_BY_CE_TYPE = {kind.ce_type: kind for kind in EventKind}
_KIND_BY_LEGACY = {
    "started": EventKind.STARTED,
    "progress": EventKind.PROGRESS,
    "success": EventKind.SUCCEEDED,
    "succeeded": EventKind.SUCCEEDED,
    "failure": EventKind.FAILED,
    "failed": EventKind.FAILED,
}
_LEGACY_BY_KIND = {
    EventKind.STARTED: "started",
    EventKind.PROGRESS: "progress",
    EventKind.SUCCEEDED: "success",
    EventKind.FAILED: "failure",
}


@dataclass(frozen=True, slots=True)
class WireMessage:
    """An AMQP message, independent of the client library that sends it."""

    body: bytes
    headers: dict[str, Any] = field(default_factory=dict)
    content_type: str | None = "application/json"
    message_id: str | None = None
    # Seconds after which the broker drops the message (dead-lettering it where it can):
    # a submission is worth running only until its task expires.
    expiration: float | None = None


@dataclass(frozen=True, slots=True)
class Submission:
    """A task handed to a function: `<queue>-in`."""

    task_id: str
    service: str
    body: dict[str, Any]
    message_format: MessageFormat = MessageFormat.CLOUDEVENTS
    max_attempts: int | None = None
    timeout: float | None = None
    traceparent: str | None = None
    expires_at: datetime | None = None  # the task fails then: no worker should start it after
    # The crashes its workers may have before it fails (the queue's `x-delivery-limit`).
    delivery_limit: int | None = None


@dataclass(frozen=True, slots=True)
class TaskEvent:
    """A state change reported for a task: `<queue>-out`."""

    kind: EventKind
    task_id: str
    host: str | None = None
    progress: float | None = None
    response: Any = None
    error_message: str | None = None
    attempt: str | None = None
    time: datetime | None = None
    started: datetime | None = None  # terminal events only: the attempt sent no `started`
    event_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    traceparent: str | None = None
    # False for a legacy message without a message id: `event_id` was made up on receipt,
    # so a duplicate of the message cannot be recognised by it.
    identified: bool = True


# ---------------------------------------------------------------------------
# helpers


def now() -> datetime:
    return datetime.now(UTC)


def _json_bytes(value: Any) -> bytes:
    return strict_json.dumps(value)


def _load_json(body: bytes) -> Any:
    try:
        return strict_json.loads(body)
    except strict_json.NotJson as exc:
        raise WireError(f"body is not JSON: {exc.__class__.__name__}") from None


def _header_str(headers: dict[str, Any], name: str) -> str | None:
    value = headers.get(name)
    if value is None:
        return None
    if isinstance(value, bytes | bytearray):  # some clients send strings as byte arrays
        try:
            return bytes(value).decode()
        except UnicodeDecodeError:
            raise WireError(f"header {name} is not UTF-8") from None
    return str(value)


def _task_id(value: Any) -> str:
    if not isinstance(value, str):
        raise WireError("taskId missing or not a string")
    try:
        return str(uuid.UUID(value))
    except ValueError:
        raise WireError("taskId is not a UUID") from None


def _worker_time(value: Any) -> datetime | None:
    """A time a worker's clock wrote on an event (`time`, `conveyorstarted`), or None if the
    gateway cannot date by it: not RFC 3339 (epoch seconds, an HTTP date, garbage), or beyond
    what UTC holds (year 1 at +14:00 is 1 BC). Such a time is dropped, as CloudEvents lets
    `time` be, and the event is dated when read: a worker's clock fails no task (an unreadable
    `conveyorstarted` FAILed a successful one, "time is not RFC 3339")."""
    if value is None:
        return None
    try:
        parsed = (
            value
            if isinstance(value, datetime)
            else datetime.fromisoformat(str(value).replace("Z", "+00:00"))
        )
    except ValueError:
        return None
    if parsed.tzinfo is None:
        return parsed.replace(tzinfo=UTC)
    try:
        return parsed.astimezone(UTC)
    except OverflowError:
        return None


def _progress(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise WireError("progress is not a number")
    if isinstance(value, int):  # any number of digits: clamped before a float overflows
        value = min(100, max(0, value))
    value = float(value)
    if not math.isfinite(value):
        raise WireError("progress is not finite")
    return min(100.0, max(0.0, value))


def is_cloudevent(headers: dict[str, Any] | None) -> bool:
    return headers is not None and SPECVERSION_HEADER in headers


def _to_wire(attributes: dict[str, Any], data: Any, traceparent: str | None) -> WireMessage:
    if traceparent:
        attributes[TRACEPARENT] = traceparent
    binary = ce_rabbitmq.to_binary(CloudEvent(attributes=attributes, data=data), _WRITER)
    return WireMessage(binary.body, dict(binary.headers), binary.content_type, attributes["id"])


def _from_wire(message: WireMessage) -> CloudEvent:
    headers = {
        k: value
        for k in message.headers
        if k.startswith("ce-") and (value := _header_str(message.headers, k)) is not None
    }
    # Read first, so that a body that is not JSON is a WireError saying so.
    parsed = _load_json(message.body) if message.body else None
    try:
        return _binary(headers, message, parsed)
    except Exception as exc:  # the binding raises several unrelated types
        if "ce-time" not in headers:
            raise WireError(f"invalid CloudEvent: {exc}") from None
    # `time` is optional (CloudEvents 1.0), and an event without one is dated when it is
    # read: a worker's unreadable clock fails no task (a successful task was FAILURE "invalid
    # CloudEvent: invalid literal for int() …", the binding's parse error).
    del headers["ce-time"]
    try:
        return _binary(headers, message, parsed)
    except Exception as exc:
        raise WireError(f"invalid CloudEvent: {exc}") from None


def _binary(headers: dict[str, str], message: WireMessage, parsed: Any) -> CloudEvent:
    event = ce_rabbitmq.from_binary(
        ce_rabbitmq.RabbitMQMessage(
            headers=headers, content_type=message.content_type, body=message.body
        ),
        _Format(parsed),
        CloudEvent,
    )
    assert isinstance(event, CloudEvent)
    return event


# ---------------------------------------------------------------------------
# submissions: gateway -> `<queue>-in`


def encode_submission(sub: Submission) -> WireMessage:
    wire = _encode_submission(sub)
    if sub.delivery_limit is not None:
        wire.headers[h.DELIVERY_LIMIT] = sub.delivery_limit
    if sub.expires_at is not None:
        left = (sub.expires_at - now()).total_seconds()
        wire = replace(wire, expiration=max(left, 0.001))
    return wire


def _encode_submission(sub: Submission) -> WireMessage:
    if sub.message_format is MessageFormat.LEGACY:
        return _encode_legacy_submission(sub)
    attributes: dict[str, Any] = {
        "id": sub.task_id,
        "subject": sub.task_id,
        "type": SUBMITTED,
        "source": f"/v1/services/{sub.service}",
        "datacontenttype": "application/json",
        "time": now(),
    }
    if sub.max_attempts is not None:
        attributes[EXT_MAX_ATTEMPTS] = str(sub.max_attempts)
    if sub.timeout is not None:
        attributes[EXT_TIMEOUT] = f"{sub.timeout:g}"
    if sub.expires_at is not None:
        attributes[EXT_EXPIRES] = expiry_text(sub.expires_at)
    return _to_wire(attributes, sub.body, sub.traceparent)


def expiry_text(moment: datetime) -> str:
    """`conveyorexpires`, as the gateway writes it and a dispatcher's requeue rewrites it."""
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def expiry_of(headers: dict[str, Any]) -> datetime | None:
    """A submission's `conveyorexpires`, read from its AMQP headers (None: not known)."""
    value = headers.get(h.CE_EXPIRES)
    return _optional_time(value.decode(errors="replace") if isinstance(value, bytes) else value)


def _delivery_limit(headers: dict[str, Any]) -> int | None:
    """DELIVERY_LIMIT as the gateway stamps it; anything else says nothing (the broker's own
    limit still holds)."""
    value = headers.get(h.DELIVERY_LIMIT)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def _encode_legacy_submission(sub: Submission) -> WireMessage:
    # Both spellings: the seed documents camelCase, its JS worker reads snake_case.
    payload = {
        "taskId": sub.task_id,
        "task_id": sub.task_id,
        "data": {
            "messageType": "submission",
            "message_type": "submission",
            "body": sub.body,
        },
    }
    return WireMessage(_json_bytes(payload), {}, "application/json", sub.task_id)


def decode_submission(message: WireMessage, service: str = "") -> Submission:
    """Reads either format on `-in`; raises WireError on anything else."""
    if is_cloudevent(message.headers):
        event = _from_wire(message)
        # Only a submission is a task: another event published to `-in` (a task's outcome, a
        # type of someone else's) would have its data sent to the function as a body.
        if event.get_type() != SUBMITTED:
            raise WireError(f"a CloudEvent on -in must be of type {SUBMITTED}")
        raw_id = event.get_id()
        task_id = _task_id(raw_id)
        subject = event.get_subject()
        # SPEC §6.2: id = subject. Read as a UUID only when spelled otherwise (never by ours).
        if subject is not None and subject != raw_id and _task_id(subject) != task_id:
            raise WireError("a submission's subject is not its id")
        data = event.get_data()
        if not isinstance(data, dict):
            raise WireError("submission data is not a JSON object")
        ext = event.get_extension
        return Submission(
            task_id=task_id,
            service=event.get_source().rpartition("/")[2] or service,
            body=data,
            max_attempts=_optional_attempts(ext(EXT_MAX_ATTEMPTS)),
            timeout=_optional_timeout(ext(EXT_TIMEOUT)),
            traceparent=_optional_str(ext(TRACEPARENT)),
            expires_at=_submitted_expiry(ext(EXT_EXPIRES)),
            delivery_limit=_delivery_limit(message.headers),
        )
    payload = _load_json(message.body)
    if not isinstance(payload, dict) or not isinstance(payload.get("data"), dict):
        raise WireError("legacy submission must be an object with a data object")
    data = payload["data"]
    kind = data.get("messageType", data.get("message_type"))
    if kind != "submission":
        raise WireError("legacy message is not a submission")
    body = data.get("body")
    if not isinstance(body, dict):
        raise WireError("submission body is not a JSON object")
    return Submission(
        task_id=_task_id(payload.get("taskId", payload.get("task_id"))),
        service=service,
        body=body,
        message_format=MessageFormat.LEGACY,
        delivery_limit=_delivery_limit(message.headers),
    )


def _optional_attempts(value: Any) -> int | None:
    """A task allowed no attempt would be called once all the same: say so instead."""
    if value is None:
        return None
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise WireError("expected an integer extension attribute") from None
    if number < 1:
        raise WireError(f"{EXT_MAX_ATTEMPTS} must be at least 1")
    return number


def _submitted_expiry(value: Any) -> datetime | None:
    """A submission that says it expires, unreadably, might be past it: not called."""
    moment = _optional_time(value)
    if value is not None and moment is None:
        raise WireError(f"{EXT_EXPIRES} is not an RFC 3339 time with an offset")
    return moment


def _optional_timeout(value: Any) -> float | None:
    if value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise WireError("expected a number extension attribute") from None
    if not 0 < number <= MAX_TIMEOUT:  # NaN too
        raise WireError(f"expected a timeout above 0 and at most {MAX_TIMEOUT} seconds")
    return number


def _optional_time(value: Any) -> datetime | None:
    """An RFC 3339 time with its offset; anything else says nothing (no expiry known)."""
    if not isinstance(value, str):
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        return None
    return moment if moment.tzinfo is not None else None


def _optional_str(value: Any) -> str | None:
    return None if value is None else str(value)


# ---------------------------------------------------------------------------
# task events: dispatcher or legacy worker -> `<queue>-out`


def _event_data(ev: TaskEvent) -> dict[str, Any]:
    match ev.kind:
        case EventKind.STARTED:
            return {"hostName": ev.host}
        case EventKind.PROGRESS:
            return {"progress": ev.progress}
        case EventKind.SUCCEEDED:
            return {"response": ev.response}
        case EventKind.FAILED:
            return {"errorMessage": ev.error_message}
        case EventKind.REQUEUED:
            return {}


def encode_event(
    ev: TaskEvent, service: str, fmt: MessageFormat = MessageFormat.CLOUDEVENTS
) -> WireMessage:
    data = _event_data(ev)
    if fmt is MessageFormat.LEGACY:
        if ev.kind not in _LEGACY_BY_KIND:
            raise ValueError(f"a legacy -out has no {ev.kind.value} message")
        payload = {"taskId": ev.task_id, "data": {"messageType": _LEGACY_BY_KIND[ev.kind], **data}}
        return WireMessage(_json_bytes(payload), {}, "application/json", ev.event_id)
    attributes: dict[str, Any] = {
        "id": ev.event_id,
        "subject": ev.task_id,
        "type": ev.kind.ce_type,
        "source": f"/conveyor/dispatcher/{service}",
        "datacontenttype": "application/json",
        "time": ev.time or now(),
    }
    if ev.attempt:
        attributes[EXT_ATTEMPT] = ev.attempt
    if ev.started is not None and ev.kind.terminal:
        attributes[EXT_STARTED] = ev.started.isoformat()
        if ev.host:
            attributes[EXT_HOST] = ev.host
    return _to_wire(attributes, data, ev.traceparent)


def decode_event(message: WireMessage) -> TaskEvent:
    """Reads a CloudEvent (told apart by `ce-specversion`) or a legacy message. One holding
    more JSON items than a dispatcher lets through is not read (`storable.too_many_items`)."""
    if storable.too_many_items(message.body):
        raise WireError(f"the event holds more than {storable.MAX_ITEMS} JSON items")
    if is_cloudevent(message.headers):
        return _decode_ce_event(message)
    return _decode_legacy_event(message)


def _decode_ce_event(message: WireMessage) -> TaskEvent:
    event = _from_wire(message)
    kind = _KIND_BY_CE_TYPE.get(event.get_type())
    if kind is None:
        raise WireError("unknown event type")
    data = event.get_data()
    if not isinstance(data, dict):
        raise WireError("event data is not a JSON object")
    decoded = _event_from_fields(
        kind,
        task_id=event.get_subject(),
        data=data,
        attempt=_optional_str(event.get_extension(EXT_ATTEMPT)),
        time=_worker_time(event.get_time()),
        event_id=event.get_id(),
    )
    started = event.get_extension(EXT_STARTED)
    if kind.terminal and started is not None:
        return replace(
            decoded, started=_worker_time(str(started)), host=_host(event.get_extension(EXT_HOST))
        )
    return decoded


def _decode_legacy_event(message: WireMessage) -> TaskEvent:
    try:
        payload = _load_json(message.body)
    except WireError:
        # A worker writing Latin-1 (or any bytes that are not UTF-8), or a newline, a tab or a
        # NUL inside a string as the byte itself: its words as written, with U+FFFD where they
        # cannot be read, rather than its task left IN_PROGRESS until the watchdog.
        readable = message.body.decode("utf-8", errors="replace")
        try:
            payload = strict_json.loads(readable, control_characters=True)
        except strict_json.NotJson as exc:
            raise WireError(f"body is not JSON: {exc.__class__.__name__}") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("data"), dict):
        raise WireError("legacy event must be an object with a data object")
    data = payload["data"]
    kind = _KIND_BY_LEGACY.get(_first(data, "messageType", "message_type"))
    if kind is None:
        raise WireError("unknown messageType")
    return _event_from_fields(
        kind,
        task_id=_first(payload, "taskId", "task_id"),
        data=data,
        attempt=None,
        time=None,
        event_id=message.message_id or str(uuid.uuid4()),
        identified=bool(message.message_id),
    )


def _host(value: Any) -> str | None:
    """A worker's name as a column can hold it: text, no NUL, 255 characters at most."""
    return None if value is None else storable.text(_as_text(value))[:255]


def _error_text(value: Any) -> str:
    """An errorMessage as the dispatcher keeps a function's: text, at most ERROR_LIMIT
    bytes (a worker's may be megabytes, or an object)."""
    return storable.truncate(storable.text(_as_text(value)))


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else _json_bytes(value).decode()


def _first(data: dict[str, Any], *names: str) -> Any:
    for name in names:
        if data.get(name) is not None:
            return data[name]
    return None


def _event_from_fields(
    kind: EventKind,
    *,
    task_id: Any,
    data: dict[str, Any],
    attempt: str | None,
    time: datetime | None,
    event_id: str,
    identified: bool = True,
) -> TaskEvent:
    fields: dict[str, Any] = {}
    if kind is EventKind.STARTED:
        fields["host"] = _host(_first(data, "hostName", "hostname", "host_name"))
    elif kind is EventKind.PROGRESS:
        fields["progress"] = _progress(data.get("progress"))
    elif kind is EventKind.SUCCEEDED:
        fields["response"] = data.get("response")
    elif kind is EventKind.FAILED:
        message = _first(data, "errorMessage", "error_message")
        fields["error_message"] = None if message is None else _error_text(message)
    return TaskEvent(
        kind=kind,
        task_id=_task_id(task_id),
        attempt=attempt,
        time=time,
        event_id=event_id,
        identified=identified,
        **fields,
    )


# ---------------------------------------------------------------------------
# cancels: gateway -> `<queue>-control` -> every dispatcher (SPEC §11.1)


def encode_cancel(task_id: str, service: str) -> WireMessage:
    attributes: dict[str, Any] = {
        "id": str(uuid.uuid4()),
        "type": CANCELLED,
        "source": f"/v1/services/{service}",
        "subject": task_id,
        "time": now(),
    }
    return _to_wire(attributes, None, None)


def decode_cancel(message: WireMessage) -> str:
    """The id of the cancelled task."""
    event = _from_wire(message)
    if event.get_type() != CANCELLED:
        raise WireError(f"not a cancel: {event.get_type()}")
    return _task_id(event.get_subject())
