"""Pydantic models that *document* the API in OpenAPI (/docs).

Requests are parsed by hand in `api` (size limit first, exact error numbers),
so these models describe the wire shapes without sitting on the hot path.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Callback(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["https", "http"] = Field(
        description="`https`; `http` only when CONVEYOR_CALLBACK_ALLOW_HTTP=1"
    )
    url: str = Field(max_length=2048, examples=["https://consumer.example/hook"])


class CreateTask(BaseModel):
    model_config = ConfigDict(extra="forbid")
    body: dict[str, Any] = Field(
        description="The function's input; checked against the service's JSON Schema"
    )
    callback: Callback | None = None
    notBefore: str | None = Field(
        None,
        description="RFC 3339 time before which the task is not run (not with delaySeconds);"
        " at most CONVEYOR_MAX_DELAY ahead",
        examples=["2026-11-25T08:00:00Z"],
    )
    delaySeconds: int | None = Field(
        None, ge=0, description="Run no sooner than this many seconds from now (not with notBefore)"
    )


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tasks: list[CreateTask] = Field(
        min_length=1, max_length=1000, description="CONVEYOR_MAX_BATCH_ITEMS at most"
    )


class Created(BaseModel):
    taskId: str
    taskPosition: int = Field(
        description="1-based place among the service's PENDING tasks that are due"
    )


class CreatedEnvelope(BaseModel):
    status: Literal["success"]
    data: Created


class CreatedBatch(BaseModel):
    tasks: list[Created] = Field(description="In request order")


class BatchEnvelope(BaseModel):
    status: Literal["success"]
    data: CreatedBatch


class TaskData(BaseModel):
    taskId: str
    status: Literal["PENDING", "IN_PROGRESS", "SUCCESS", "FAILURE"]
    submitionDate: str = Field(description="ISO-8601 UTC with milliseconds, seed spelling")
    taskPosition: int | None = Field(
        None, description="PENDING only; counts only tasks that are due"
    )
    notBefore: str | None = Field(None, description="When the task was asked to run no sooner")
    startDate: str | None = None
    endDate: str | None = None
    progress: float
    response: Any = Field(None, description="SUCCESS only")
    errorMessage: str | None = Field(None, description="FAILURE only")


class TaskEnvelope(BaseModel):
    status: Literal["success"]
    data: TaskData


class FieldError(BaseModel):
    path: str
    message: str


class ErrorBody(BaseModel):
    number: int = Field(examples=[404001])
    description: str = Field(examples=["Service not found."])
    errors: list[FieldError] | None = None


class ErrorEnvelope(BaseModel):
    status: Literal["error"]
    error: ErrorBody


def inline_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The model's JSON Schema with its `$defs` inlined.

    OpenAPI resolves a `$ref` from the document's root, so a nested model's
    `#/$defs/...` (or a `#/components/schemas/...` that FastAPI never registered,
    since the body is not a FastAPI parameter) would dangle.
    """
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return resolve(defs[ref.removeprefix("#/$defs/")])
            return {key: resolve(value) for key, value in node.items()}
        if isinstance(node, list):
            return [resolve(item) for item in node]
        return node

    return resolve(schema)


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    descriptions = {
        400: "400001 body fails the service's JSON Schema; 400002 invalid request",
        403: "403001 bad or missing credentials, or no grant for this service",
        404: "404001 unknown service; 404002 unknown task",
        409: "409001 the task already finished (SUCCESS, or FAILURE other than a cancel)",
        413: "413001 request too large",
        429: "429001 service capacity reached; 429002 client capacity reached",
        431: "431001 request headers too large",
        503: "503001 database unavailable",
    }
    return {c: {"model": ErrorEnvelope, "description": descriptions[c]} for c in codes}


# -- the admin API (SPEC §11.6) ----------------------------------------------


class StatusCounts(BaseModel):
    """The live statuses now; finished tasks are counted in `finishedLastHour`."""

    PENDING: int
    IN_PROGRESS: int


class Outcomes(BaseModel):
    SUCCESS: int
    FAILURE: int


class QueueDepths(BaseModel):
    in_: int | None = Field(None, alias="in", description="Ready in -in; null: broker unknown")
    out: int | None = Field(None, description="Results ready in -out, no gateway took them yet")
    dlq: int | None = None


class RunTime(BaseModel):
    p50: float | None = Field(None, description="Seconds, newest tasks finished in the hour")
    p95: float | None = None


class Throughput(BaseModel):
    bucketSeconds: int
    buckets: list[Outcomes] = Field(description="Oldest first; the last is the current one")


class ServiceFigures(BaseModel):
    service: str
    tasks: StatusCounts
    finishedLastHour: Outcomes
    oldestPendingAgeSeconds: float | None = Field(None, description="Oldest due PENDING task")
    queues: QueueDepths
    runTimeSeconds: RunTime
    throughput: Throughput


class ServicesEnvelope(BaseModel):
    status: Literal["success"]
    data: dict[Literal["services"], list[ServiceFigures]]


class TaskSummary(BaseModel):
    taskId: str
    clientId: str
    status: Literal["PENDING", "IN_PROGRESS", "SUCCESS", "FAILURE"]
    submitionDate: str
    startDate: str | None = None
    endDate: str | None = None
    progress: float
    errorMessage: str | None = None
    workerHost: str | None = None


class TaskPage(BaseModel):
    tasks: list[TaskSummary] = Field(description="Newest first")
    nextCursor: str | None = Field(None, description="Pass as `cursor` for the next page")


class TaskPageEnvelope(BaseModel):
    status: Literal["success"]
    data: TaskPage


class Attempt(BaseModel):
    attemptId: str
    workerHost: str | None = None
    startDate: str
    endDate: str | None = None
    outcome: str | None = None
    errorMessage: str | None = None


class CallbackOutcome(BaseModel):
    url: str
    type: str | None = None
    status: str | None = Field(None, description="PENDING, SUCCESS or FAILURE of the delivery")
    rounds: int = Field(
        description="Claims of the delivery by a notifier, each up to CONVEYOR_CALLBACK_ATTEMPTS "
        "HTTP calls"
    )
    claimedUntil: str | None = None


class TaskDetail(TaskSummary):
    service: str
    request: Any = Field(description="The body the task was submitted with")
    response: Any = None
    notBefore: str | None = None
    idempotencyKey: str | None = None
    deliveries: int = Field(description="Times the function was called")
    callback: CallbackOutcome | None = None
    attempts: list[Attempt]
    rowId: int
    idempotencyFingerprint: str | None = Field(None, description="SHA-256 of the request, hex")
    attemptId: str | None = None
    traceparent: str | None = None
    publishAt: str | None = Field(
        None, description="When the relay may publish the task; null once published"
    )
    publishAttempts: int
    publishError: str | None = Field(None, description="The broker's last refusal")
    timeLimit: int | None = None
    expiresAt: str | None = None
    cancelledAt: str | None = Field(None, description="When a cancel ended the task")
    handedBackAttempt: str | None = Field(
        None, description="An attempt whose hand-back was read before its `started`"
    )
    handedBackAt: str | None = Field(None, description="When that attempt was handed back")
    handedBack: dict[str, str] | None = Field(
        None, description="Every attempt handed back before its `started` was read, to when"
    )
    updatedAt: str


class TaskDetailEnvelope(BaseModel):
    status: Literal["success"]
    data: TaskDetail
