"""The error catalogue of SPEC §3: every error the API can answer, in one place.

The seed writes numbers as `404 001`; on the wire they are integers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from conveyor import envelope


@dataclass(frozen=True, slots=True)
class ErrorKind:
    http_status: int
    number: int
    description: str


FORBIDDEN = ErrorKind(403, 403001, "Forbidden.")
SERVICE_NOT_FOUND = ErrorKind(404, 404001, "Service not found.")
TASK_NOT_FOUND = ErrorKind(404, 404002, "Task not found.")
SCHEMA_INVALID = ErrorKind(
    400, 400001, "Error validating the body with the target service's json-schema."
)
INVALID_REQUEST = ErrorKind(400, 400002, "Invalid request.")
TOO_LARGE = ErrorKind(413, 413001, "Request too large.")
SERVICE_CAPACITY = ErrorKind(429, 429001, "Too many service requests")
CLIENT_CAPACITY = ErrorKind(429, 429002, "Too many service requests for the clientId.")
ALREADY_FINISHED = ErrorKind(409, 409001, "Task already finished.")
NOT_FOUND = ErrorKind(404, 404000, "Not found.")
METHOD_NOT_ALLOWED = ErrorKind(405, 405000, "Method not allowed.")
UNAVAILABLE = ErrorKind(503, envelope.UNAVAILABLE_NUMBER, envelope.UNAVAILABLE_DESCRIPTION)
INTERNAL = ErrorKind(500, 500001, "Internal error.")


# What a client told "not now" (429, 503) is told to wait before it tries again: a backlog
# drains, a database comes back, within about that.
RETRY_SOON = {"Retry-After": "1"}


@dataclass(slots=True)
class ApiError(Exception):
    kind: ErrorKind
    errors: list[dict[str, str]] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)

    def envelope(self) -> dict[str, Any]:
        return envelope.error(self.kind.number, self.kind.description, self.errors)


def invalid(path: str, message: str) -> ApiError:
    return ApiError(INVALID_REQUEST, [{"path": path, "message": message}])
