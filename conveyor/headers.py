"""Every header two components must spell the same way, defined once.

HTTP headers are lower case here (HTTP/1.1 and HTTP/2 compare them case-insensitively;
a reader lower-cases what it receives).
"""

from __future__ import annotations

# -- the call of a function: CloudEvents HTTP binary mode, then Conveyor's own -------------
CE_ID = "ce-id"
CE_TYPE = "ce-type"
CE_SOURCE = "ce-source"
CE_SUBJECT = "ce-subject"
CE_SPECVERSION = "ce-specversion"
CE_TIME = "ce-time"
TRACEPARENT = "traceparent"  # W3C trace context, carried through
TASK_ID = "x-conveyor-task-id"
ATTEMPT = "x-conveyor-attempt"  # the delivery number, from 1
RETRY = "x-conveyor-retry"  # the dispatcher's own retries within one delivery, from 0
DEADLINE = "x-conveyor-deadline"  # RFC 3339: the call is cut then
PROGRESS_URL = "x-conveyor-progress-url"

# -- the task API's own request header -------------------------------------------------
MAX_IDEMPOTENCY_KEY = 200  # characters: the gateway refuses longer keys, the SDK sends none

# -- AMQP headers on `<queue>-in` -------------------------------------------------------
CE_EXPIRES = "ce-conveyorexpires"  # the `conveyorexpires` extension, as the binding spells it
CE_MAX_ATTEMPTS = "ce-conveyormaxattempts"  # `conveyormaxattempts`, likewise
# The gateway's DELIVERY_LIMIT, the `x-delivery-limit` it declares `-in` with: a copy that a
# graceful requeue republished starts the broker's count again, and the dispatcher goes on
# counting the crashes from CRASHES (SPEC §7.1: a worker that merely crashed its limit is left).
DELIVERY_LIMIT = "x-conveyor-delivery-limit"
CRASHES = "x-conveyor-crashes"  # returns (crashes) of earlier copies, before a graceful requeue
# On a copy a dispatcher put on `-dlq` itself (no `x-death`: the broker did not), why, in the
# broker's words: `delivery_limit`, its crashes counted through graceful requeues.
DEAD_LETTERED = "x-conveyor-dead-lettered"

# -- AMQP headers on `<queue>-out` ------------------------------------------------------
CE_STARTED = "ce-conveyorstarted"  # a terminal event's `conveyorstarted`: when its call began
DELIVERY_COUNT = "x-delivery-count"  # RabbitMQ's, on quorum queues
REQUEUES = "x-conveyor-requeues"  # deliveries a graceful requeue folded into a new message
RETURNS = "x-conveyor-returns"  # times the gateway gave a submission the broker returned back
DEATH_HEADERS = (
    "x-death",
    "x-first-death-reason",
    "x-first-death-queue",
    "x-first-death-exchange",
    DEAD_LETTERED,
)

# -- callbacks ------------------------------------------------------------------------------
SIGNATURE = "X-Conveyor-Signature"
