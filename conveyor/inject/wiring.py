"""The dispatcher's settings for one workload: options, else what an earlier injection
wrote, else the mode's default (so re-injecting never silently resets them)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from conveyor import __version__
from conveyor.dispatcher_settings import PREFIX, ShutdownMode, dispatcher_variable, integer
from conveyor.inject.documents import Doc, InjectError, check_object_name

# The dispatcher's variables, named by its settings (dispatcher_settings), never re-spelled.
# Each one inject writes is spelled as the dispatcher reads it first, CONVEYOR_<NAME>: an env
# entry beats an envFrom key of its name, so a ConfigMap or Secret the dispatcher takes with
# envFrom adds settings but overrides none that the KEDA trigger, the grace period, the probes
# or the NetworkPolicy were computed from.
QUEUE = dispatcher_variable("queue", prefixed=True)
AMQP_URL = dispatcher_variable("amqp_url", prefixed=True)
FUNCTION_URL = dispatcher_variable("function_url", prefixed=True)
CONCURRENCY = dispatcher_variable("concurrency", prefixed=True)
PREFETCH_BUFFER = dispatcher_variable("prefetch_buffer", prefixed=True)
SHUTDOWN_MODE = dispatcher_variable("shutdown_mode", prefixed=True)
DRAIN_TIMEOUT = dispatcher_variable("drain_timeout", prefixed=True)
DISPATCHER_PORT = dispatcher_variable("dispatcher_port", prefixed=True)
ONE_SHOT = dispatcher_variable("one_shot", prefixed=True)
IDLE_EXIT_SECONDS = dispatcher_variable("idle_exit_seconds", prefixed=True)
HOSTNAME = dispatcher_variable("hostname", prefixed=True)
PROGRESS_PORT = dispatcher_variable("progress_port", prefixed=True)
POD_IP = dispatcher_variable("pod_ip", prefixed=True)
# Not managed: an operator sets it to serve /healthz, /readyz and /metrics on all interfaces.
METRICS_PORT = dispatcher_variable("metrics_port")

DEFAULT_IMAGE = f"conveyor/dispatcher:{__version__}"
DEFAULT_AMQP_SECRET = "conveyor-rabbitmq"
DEFAULT_IDLE_EXIT_SECONDS = 60


class Mode(enum.StrEnum):
    SIDECAR = "sidecar"
    JOB = "job"
    KNATIVE = "knative"


@dataclass(frozen=True)
class InjectOptions:
    """What the command line may set. ``None`` means: keep what an earlier
    injection wrote, else use the mode's default."""

    mode: Mode | None = None
    container: str | None = None
    queue: str | None = None
    concurrency: int | None = None
    shutdown_mode: ShutdownMode | None = None
    drain_timeout: int | None = None
    image: str | None = None
    amqp_secret: str | None = None


@dataclass(frozen=True)
class Wiring:
    """The dispatcher's settings for one workload, every value resolved."""

    mode: Mode
    queue: str
    concurrency: int
    shutdown_mode: ShutdownMode
    drain_timeout: float
    image: str
    amqp_secret: str
    idle_exit_seconds: float = DEFAULT_IDLE_EXIT_SECONDS
    prefetch_buffer: int = 0
    function_path: str = "/"

    @property
    def prefetch(self) -> int:
        """Messages one dispatcher holds unacked, which KEDA's trigger counts (SPEC §7). In job
        mode 1 (concurrency 1, no buffer), as ONE_SHOT's prefetch is."""
        return self.concurrency + self.prefetch_buffer


_MODE_DEFAULTS: dict[Mode, dict[str, Any]] = {
    # Deployments: short tasks; a scale-in requeues what is in flight.
    Mode.SIDECAR: {"concurrency": 4, "shutdown_mode": ShutdownMode.REQUEUE, "drain_timeout": 30},
    Mode.KNATIVE: {"concurrency": 4, "shutdown_mode": ShutdownMode.REQUEUE, "drain_timeout": 30},
    # Jobs: long non-interruptible tasks, one message per Job.
    Mode.JOB: {"concurrency": 1, "shutdown_mode": ShutdownMode.DRAIN, "drain_timeout": 600},
}


def check_options(options: InjectOptions) -> None:
    if options.concurrency is not None and options.concurrency < 1:
        raise InjectError("--concurrency must be at least 1")
    if options.drain_timeout is not None and options.drain_timeout < 0:
        raise InjectError("--drain-timeout must not be negative")
    if options.queue is not None and not options.queue.strip():
        raise InjectError("--queue must not be empty")
    if options.amqp_secret is not None:
        check_object_name(options.amqp_secret, "--amqp-secret")


def env_literal(container: Doc | None, name: str) -> str | None:
    for entry in (container or {}).get("env") or []:
        if isinstance(entry, dict) and entry.get("name") == name and "value" in entry:
            return str(entry["value"])
    return None


def spellings(variable: str) -> tuple[str, str]:
    """Both names of a dispatcher variable, in the order DispatcherSettings.from_env reads
    them: `CONVEYOR_<NAME>` wins over `<NAME>`."""
    field = variable.upper().removeprefix(PREFIX).lower()
    return dispatcher_variable(field, prefixed=True), dispatcher_variable(field)


def setting_entry(container: Doc | None, variable: str) -> Doc | None:
    """The env entry the dispatcher takes ``variable`` from (either spelling, any case, as it
    reads them; of duplicates the last, which the kubelet lets win), or None."""
    entries = [e for e in (container or {}).get("env") or [] if isinstance(e, dict)]
    for spelling in spellings(variable):
        found = [e for e in entries if str(e.get("name")).upper() == spelling]
        if found:
            return found[-1]
    return None


def setting_literal(container: Doc | None, variable: str) -> str | None:
    """The literal value the dispatcher reads for ``variable``; None when unset or valueFrom."""
    entry = setting_entry(container, variable) or {}
    return str(entry["value"]) if "value" in entry else None


def _env_secret_name(container: Doc | None, name: str) -> str | None:
    """The Secret an earlier injection (or the user) gave ``name`` from: written back, and into
    the TriggerAuthentication, so held to the rule of a Secret's name as --amqp-secret is."""
    ref = ((setting_entry(container, name) or {}).get("valueFrom") or {}).get("secretKeyRef")
    secret = (ref or {}).get("name")
    if not secret:
        return None
    return check_object_name(str(secret), f"the existing dispatcher's {name} Secret")


def int_or_none(value: str | None, what: str) -> int | None:
    """A whole number the existing dispatcher was given, as the dispatcher reads it: `4.5` is
    refused there, so it is refused here rather than written back as 4."""
    if value is None:
        return None
    try:
        return integer(value)
    except ValueError:
        raise InjectError(
            f"the existing dispatcher's {what} is not a whole number: {value!r}"
        ) from None


def seconds_or_none(value: str | None, what: str, positive: bool = False) -> float | None:
    """A duration the existing dispatcher was given, kept as it is (29.5 stays 29.5)."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        raise InjectError(f"the existing dispatcher has a non-numeric {what}: {value!r}") from None
    if not math.isfinite(seconds) or seconds < 0 or (positive and seconds == 0):
        bound = "greater than 0" if positive else "0 or more"
        raise InjectError(f"the existing dispatcher's {what} must be {bound}: {value!r}")
    return seconds


def written_drain(existing: Doc | None) -> float | None:
    """The DRAIN_TIMEOUT an existing dispatcher was given."""
    return seconds_or_none(setting_literal(existing, DRAIN_TIMEOUT), DRAIN_TIMEOUT)


def seconds_text(seconds: float) -> str:
    """How a duration is written back: `30` for 30.0, `29.5` for 29.5."""
    return str(int(seconds)) if float(seconds).is_integer() else str(seconds)


# The settings inject computes the rest of the workload from (the KEDA trigger's queue and
# value, the grace period, the function's URL), with the option that sets each one instead.
_COMPUTED_FROM: dict[str, str | None] = {
    QUEUE: "--queue",
    FUNCTION_URL: None,
    CONCURRENCY: "--concurrency",
    PREFETCH_BUFFER: None,
    SHUTDOWN_MODE: "--shutdown-mode",
    DRAIN_TIMEOUT: "--drain-timeout",
    IDLE_EXIT_SECONDS: None,
    DISPATCHER_PORT: None,
}


def _refuse_references(mode: Mode, existing: Doc | None, options: InjectOptions) -> None:
    """A setting inject reads from a ConfigMap or a Secret (valueFrom) cannot be known here: it
    would be replaced by a default without a word, and the KEDA trigger would count another
    value. The user says it instead, by the option or as a literal value."""
    given = {
        QUEUE: options.queue,
        CONCURRENCY: options.concurrency,
        SHUTDOWN_MODE: options.shutdown_mode,
        DRAIN_TIMEOUT: options.drain_timeout,
    }
    # A Job takes one message at a time and is the only mode that idles out.
    ignored = {CONCURRENCY, PREFETCH_BUFFER} if mode is Mode.JOB else {IDLE_EXIT_SECONDS}
    for variable, option in _COMPUTED_FROM.items():
        if variable in ignored:
            continue
        entry = setting_entry(existing, variable) or {}
        if "valueFrom" not in entry or "value" in entry or given.get(variable) is not None:
            continue
        instead = f"pass {option}, or " if option else ""
        raise InjectError(
            f"the existing dispatcher takes {entry.get('name')} from valueFrom, which inject "
            f"cannot read; it writes that setting itself: {instead}set it as a value"
        )


def function_path(existing: Doc | None) -> str:
    """The path (and query) of the function's URL an earlier injection or the author wrote:
    inject owns the URL's host and port, which come from the function's container, not the
    path it is served on."""
    url = setting_literal(existing, FUNCTION_URL)
    if not url:
        return "/"
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return "/"  # not a URL the dispatcher takes: inject writes its own
    path = parts.path or "/"
    return f"{path}?{parts.query}" if parts.query else path


def _replaced_defaults(mode: Mode, existing: Doc | None) -> dict[str, Any]:
    """The defaults of the mode an earlier injection wrote (ONE_SHOT says which), when this
    mode's differ: a value equal to one of them was that injection's own, and gives way to
    this mode's default (sidecar output in job mode gives what a fresh job injection gives)."""
    if existing is None:
        return {}
    before = _MODE_DEFAULTS[
        Mode.JOB if setting_literal(existing, ONE_SHOT) == "1" else Mode.SIDECAR
    ]
    return {} if before == _MODE_DEFAULTS[mode] else before


def _unless_replaced(replaced: dict[str, Any], key: str, value: Any, given_way: list[str]) -> Any:
    """`value`, or None (this mode's default) when it is the other mode's default; `given_way`
    names it, for the one warning that says so (a user who chose it passes it as an option)."""
    if key not in replaced or value != replaced[key]:
        return value
    given_way.append(f"--{key.replace('_', '-')}")
    return None


def resolve(
    mode: Mode,
    name: str,
    options: InjectOptions,
    existing: Doc | None,
    warnings: list[str] | None = None,
) -> Wiring:
    """Option, else the value an earlier injection wrote (unless it was another mode's
    default), else the mode's default."""
    defaults = _MODE_DEFAULTS[mode]
    replaced = _replaced_defaults(mode, existing)
    given_way: list[str] = []
    _refuse_references(mode, existing, options)
    written_concurrency = int_or_none(setting_literal(existing, CONCURRENCY), CONCURRENCY)
    concurrency = options.concurrency or (
        written_concurrency
        if mode is Mode.JOB  # job mode takes 1 whatever was written: nothing to warn of
        else _unless_replaced(replaced, "concurrency", written_concurrency, given_way)
    )
    if concurrency is not None and concurrency < 1:
        raise InjectError(f"{CONCURRENCY} must be at least 1, not {concurrency}")
    buffer = int_or_none(setting_literal(existing, PREFETCH_BUFFER), PREFETCH_BUFFER) or 0
    if buffer < 0:
        raise InjectError(f"{PREFETCH_BUFFER} must not be negative, not {buffer}")
    if mode is Mode.JOB:
        if options.concurrency not in (None, 1):
            raise InjectError("--concurrency must be 1 in job mode: each Job takes one message")
        # ONE_SHOT takes one message at a time whatever the buffer: none is written.
        concurrency, buffer = 1, 0
    shutdown = options.shutdown_mode or _unless_replaced(
        replaced, "shutdown_mode", setting_literal(existing, SHUTDOWN_MODE), given_way
    )
    drain: float | None = options.drain_timeout
    if drain is None:
        drain = _unless_replaced(replaced, "drain_timeout", written_drain(existing), given_way)
    if given_way and warnings is not None:
        warnings.append(
            f"{mode.value} mode's defaults replace the other mode's ({', '.join(given_way)}):"
            " pass them as options to keep the values written"
        )
    idle = seconds_or_none(
        setting_literal(existing, IDLE_EXIT_SECONDS), IDLE_EXIT_SECONDS, positive=True
    )
    try:
        shutdown_mode = ShutdownMode(shutdown) if shutdown else defaults["shutdown_mode"]
    except ValueError:
        raise InjectError(f"SHUTDOWN_MODE must be requeue or drain, not {shutdown!r}") from None
    return Wiring(
        mode=mode,
        queue=options.queue or setting_literal(existing, QUEUE) or name,
        concurrency=concurrency or defaults["concurrency"],
        shutdown_mode=shutdown_mode,
        drain_timeout=defaults["drain_timeout"] if drain is None else drain,
        image=options.image or (existing or {}).get("image") or DEFAULT_IMAGE,
        amqp_secret=options.amqp_secret
        or _env_secret_name(existing, AMQP_URL)
        or DEFAULT_AMQP_SECRET,
        idle_exit_seconds=DEFAULT_IDLE_EXIT_SECONDS if idle is None else idle,
        prefetch_buffer=buffer,
        function_path=function_path(existing),
    )
