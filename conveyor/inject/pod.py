"""A pod with the function as a native sidecar and the dispatcher as its main container."""

from __future__ import annotations

import math
from itertools import pairwise
from typing import Any

from conveyor.dispatcher_settings import DispatcherSettings, SettingsError
from conveyor.inject.documents import Doc, InjectError
from conveyor.inject.function import harden_function, mounts_tmp, own_empty_dir, restrict_pod
from conveyor.inject.wiring import (
    AMQP_URL,
    CONCURRENCY,
    DISPATCHER_PORT,
    DRAIN_TIMEOUT,
    FUNCTION_URL,
    HOSTNAME,
    IDLE_EXIT_SECONDS,
    METRICS_PORT,
    ONE_SHOT,
    POD_IP,
    PREFETCH_BUFFER,
    PROGRESS_PORT,
    QUEUE,
    SHUTDOWN_MODE,
    InjectOptions,
    Mode,
    Wiring,
    env_literal,
    int_or_none,
    resolve,
    seconds_text,
    setting_literal,
    spellings,
    written_drain,
)

DISPATCHER_CONTAINER = "conveyor-dispatcher"
AMQP_URL_KEY = "amqp-url"  # amqp://user:pass@rabbitmq:5672/vhost, for the dispatcher
DEFAULT_DISPATCHER_PORT: int = DispatcherSettings().dispatcher_port
KNATIVE_PROGRESS_PORT = 8082  # knative mode: progress from the function's pods (SPEC §11.5)
GRACE_MARGIN_SECONDS = 15  # nack, close and the function's own stop, after the drain
DEPLOYMENT_GRACE_LIMIT = 120  # SPEC §8: keep rolling updates short
GRACE_LIMIT = 2**63 - 1  # terminationGracePeriodSeconds is an int64
TMP_VOLUME = "conveyor-tmp"
FUNCTION_ANNOTATION = "conveyor.io/function-container"


def pod_spec(template: Any, owner: str) -> Doc:
    if not isinstance(template, dict) or not isinstance(template.get("spec"), dict):
        raise InjectError(f"{owner} has no pod template (spec.template.spec)")
    if not isinstance(template.get("metadata", {}), dict):
        raise InjectError(f"{owner}: spec.template.metadata is not a mapping")
    pod = template["spec"]
    for key in ("containers", "initContainers", "volumes"):
        _check_list_of_mappings(pod.get(key), f"{owner}: {key}")
    for key in ("labels", "annotations"):
        if not isinstance(template.get("metadata", {}).get(key, {}), dict):
            raise InjectError(f"{owner}: spec.template.metadata.{key} is not a mapping")
    for container in (pod.get("containers") or []) + (pod.get("initContainers") or []):
        where = f"{owner}: container {container.get('name', '(unnamed)')}"
        for key in ("env", "ports", "volumeMounts"):
            _check_list_of_mappings(container.get(key), f"{where}: {key}")
        if not all(isinstance(e.get("name"), str) for e in container.get("env") or []):
            raise InjectError(f"{where}: every env entry needs a string name")
    return pod


def _check_list_of_mappings(value: Any, where: str) -> None:
    """Malformed shapes become a clear error here rather than a traceback later."""
    if value is None:
        return
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise InjectError(f"{where} must be a list of mappings")


def find_dispatcher(pod: Doc) -> Doc | None:
    for container in pod.get("containers") or []:
        if isinstance(container, dict) and container.get("name") == DISPATCHER_CONTAINER:
            return container
    return None


def _runs_dispatcher(container: Doc) -> bool:
    """Whether a container runs a Conveyor dispatcher: `conveyor dispatcher` in its command
    and args (`python -m conveyor dispatcher` too), or the dispatcher's image."""
    words = [
        str(word)
        for key in ("command", "args")
        if isinstance(container.get(key), list)
        for word in container[key]
    ]
    calls = any(a.endswith("conveyor") and b == "dispatcher" for a, b in pairwise(words))
    image = str(container.get("image") or "").split("@")[0]
    repository = image.rsplit(":", 1)[0] if ":" in image.rsplit("/", 1)[-1] else image
    return calls or repository.endswith("conveyor/dispatcher")


def _refuse_other_dispatchers(pod: Doc, owner: str) -> None:
    """A dispatcher under another name would be kept beside inject's: two of them on one
    port, both consuming. Inject updates its own, found by its name among the containers; an
    init container of that name would be a second container of it, which the API server
    refuses."""
    for container in pod.get("initContainers") or []:
        if container.get("name") == DISPATCHER_CONTAINER:
            raise InjectError(
                f"{owner}: init container {DISPATCHER_CONTAINER!r} has the name of the "
                "dispatcher inject adds, and a pod's containers need names of their own: "
                "rename it"
            )
    for container in (pod.get("containers") or []) + (pod.get("initContainers") or []):
        if container.get("name") != DISPATCHER_CONTAINER and _runs_dispatcher(container):
            raise InjectError(
                f"{owner}: container {container.get('name')!r} runs a Conveyor dispatcher; "
                f"name it {DISPATCHER_CONTAINER} for inject to update it, or remove it"
            )


def _refuse_regular_containers_in_job(pod: Doc, function: Doc, owner: str) -> None:
    """A Job completes when its regular containers have exited: another one beside the
    dispatcher would keep every Job running after its one task. Native sidecars are stopped."""
    others = [
        str(c.get("name"))
        for c in pod.get("containers") or []
        if c is not function and c.get("name") != DISPATCHER_CONTAINER
    ]
    if others:
        raise InjectError(
            f"{owner}: in job mode, container(s) {', '.join(others)} would keep each Job "
            "running after its task: make them native sidecars (initContainers with "
            "restartPolicy: Always) or remove them"
        )


def _native_sidecars(pod: Doc) -> list[Doc]:
    return [c for c in pod.get("initContainers") or [] if c.get("restartPolicy") == "Always"]


def _select_function(pod: Doc, template: Doc, requested: str | None, owner: str) -> Doc:
    containers = [c for c in pod.get("containers") or [] if isinstance(c, dict)]
    everything = containers + _native_sidecars(pod)
    if not everything:
        raise InjectError(f"{owner} has no containers: nothing to inject the dispatcher next to")
    annotations = (template.get("metadata") or {}).get("annotations") or {}
    wanted = requested or annotations.get(FUNCTION_ANNOTATION)
    others = [c for c in everything if c.get("name") != DISPATCHER_CONTAINER]
    if wanted == DISPATCHER_CONTAINER or not others:
        raise InjectError(
            f"{owner}: the function's container is named {DISPATCHER_CONTAINER!r}, the "
            "dispatcher's name: inject would take it for its dispatcher; rename it"
        )
    if wanted:
        for container in everything:
            if container.get("name") == wanted:
                return container
        names = ", ".join(str(c.get("name")) for c in everything)
        raise InjectError(f"{owner} has no container named {wanted!r} (containers: {names})")
    candidates = [c for c in containers if c.get("name") != DISPATCHER_CONTAINER]
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        raise InjectError(f"{owner} has no function container: name it with --container NAME")
    names = ", ".join(str(c.get("name")) for c in candidates)
    raise InjectError(
        f"{owner} has several containers ({names}): say which one is the function "
        "with --container NAME"
    )


def function_port(container: Doc, owner: str) -> int:
    """The port the function listens on: its PORT variable, else its declared port."""
    port = env_literal(container, "PORT")
    if port is not None and port.isdigit():
        return int(port)
    ports = [p for p in container.get("ports") or [] if isinstance(p, dict)]
    named = [p for p in ports if p.get("name") == "http"]
    for entry in named + ports:
        if isinstance(entry.get("containerPort"), int):
            return entry["containerPort"]
    raise InjectError(
        f"cannot find the port of container {container.get('name')!r} in {owner}: "
        "declare ports[].containerPort or a PORT environment variable"
    )


def _used_ports(pod: Doc) -> set[int]:
    used: set[int] = set()
    for container in (pod.get("containers") or []) + (pod.get("initContainers") or []):
        for entry in container.get("ports") or []:
            if isinstance(entry, dict) and isinstance(entry.get("containerPort"), int):
                used.add(entry["containerPort"])
    return used


def choose_dispatcher_port(pod: Doc, existing: Doc | None, function: int | None) -> int:
    """The dispatcher's port: the one it had, else the default, moved off the pod's others."""
    used = _used_ports(pod) | {function, metrics_port(existing)} - {None}
    current = int_or_none(setting_literal(existing, DISPATCHER_PORT), DISPATCHER_PORT)
    port = current or DEFAULT_DISPATCHER_PORT
    while port in used:
        port += 1
    return port


def _make_native_sidecar(pod: Doc, function: Doc, port: int) -> None:
    """Moves the function to initContainers with restartPolicy Always (K8s >= 1.29):
    it starts before the dispatcher and stops after it."""
    containers = pod.get("containers") or []
    if any(c is function for c in containers):
        pod["containers"] = [c for c in containers if c is not function]
        pod.setdefault("initContainers", []).append(function)
    function["restartPolicy"] = "Always"
    function.setdefault(
        "startupProbe",
        {
            "tcpSocket": {"port": port},
            "periodSeconds": 1,
            "timeoutSeconds": 1,
            "failureThreshold": 120,
        },
    )


def _probe(port: int, metrics_port: int | None, path: str, period: int) -> Doc:
    """httpGet on METRICS_PORT when the dispatcher serves /healthz and /readyz there (on all
    interfaces); else an exec probe, since the local API listens on 127.0.0.1 only, out of
    reach of the kubelet (which connects to the pod IP). Each exec run starts a Python
    interpreter: measured 0.13-0.15 s wall, ~120 ms CPU and ~19.5 MB RSS."""
    if metrics_port is not None:
        return {
            "httpGet": {"path": path, "port": metrics_port},
            "periodSeconds": period,
            "timeoutSeconds": 3,
            "failureThreshold": 3,
        }
    code = (
        f"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{port}{path}', timeout=2)"
    )
    return {
        "exec": {"command": ["python", "-c", code]},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": 3,
    }


def metrics_port(container: Doc | None) -> int | None:
    """The dispatcher's METRICS_PORT (CONVEYOR_ first, as the dispatcher reads it), if set."""
    return int_or_none(setting_literal(container, METRICS_PORT), METRICS_PORT) or None


def container_security_context() -> Doc:
    """Non-root, read-only, no privilege: what every Conveyor container runs with."""
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "runAsUser": 10001,
        "runAsGroup": 10001,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _dispatcher_env(wiring: Wiring, function_url: str, port: int) -> list[Doc]:
    env: list[Doc] = [
        {"name": QUEUE, "value": wiring.queue},
        {
            "name": AMQP_URL,
            "valueFrom": {"secretKeyRef": {"name": wiring.amqp_secret, "key": AMQP_URL_KEY}},
        },
    ]
    if "$(POD_NAMESPACE)" in function_url:
        env.append(_field_env("POD_NAMESPACE", "metadata.namespace"))
    env += [
        {"name": FUNCTION_URL, "value": function_url},
        {"name": CONCURRENCY, "value": str(wiring.concurrency)},
    ]
    if wiring.mode is not Mode.JOB:  # written at 0 too: an envFrom's would change the prefetch
        env.append({"name": PREFETCH_BUFFER, "value": str(wiring.prefetch_buffer)})
    env += [
        {"name": SHUTDOWN_MODE, "value": str(wiring.shutdown_mode)},
        {"name": DRAIN_TIMEOUT, "value": seconds_text(wiring.drain_timeout)},
        {"name": DISPATCHER_PORT, "value": str(port)},
        {"name": ONE_SHOT, "value": "1" if wiring.mode is Mode.JOB else "0"},
    ]
    if wiring.mode is Mode.JOB:
        env.append({"name": IDLE_EXIT_SECONDS, "value": seconds_text(wiring.idle_exit_seconds)})
    if wiring.mode is Mode.KNATIVE:  # the function reports progress from its own pods
        env.append({"name": PROGRESS_PORT, "value": str(KNATIVE_PROGRESS_PORT)})
        env.append(_field_env(POD_IP, "status.podIP"))
    env.append(_field_env(HOSTNAME, "metadata.name"))
    return env


# The dispatcher variables inject writes, in both spellings: a user's copy in the other one
# (or in another case: the dispatcher reads names in any case) would silently win over inject's.
MANAGED_SETTINGS = frozenset(
    spelling
    for variable in (
        QUEUE,
        AMQP_URL,
        FUNCTION_URL,
        CONCURRENCY,
        PREFETCH_BUFFER,
        SHUTDOWN_MODE,
        DRAIN_TIMEOUT,
        DISPATCHER_PORT,
        ONE_SHOT,
        IDLE_EXIT_SECONDS,
        PROGRESS_PORT,
        POD_IP,
        HOSTNAME,
    )
    for spelling in spellings(variable)
)


def _managed(name: str) -> bool:
    """Whether inject owns this env entry (rewrites it, or drops it when it writes none)."""
    return name == "POD_NAMESPACE" or name.upper() in MANAGED_SETTINGS


def _field_env(name: str, path: str) -> Doc:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def upsert_dispatcher(pod: Doc, wiring: Wiring, function_url: str, port: int) -> Doc:
    """Adds the dispatcher as the first main container, or updates it in place."""
    container = find_dispatcher(pod)
    if container is None:
        container = {"name": DISPATCHER_CONTAINER}
        pod["containers"] = [container, *(pod.get("containers") or [])]
    user_env = [e for e in container.get("env") or [] if not _managed(e["name"])]
    container["image"] = wiring.image
    container.setdefault("imagePullPolicy", "IfNotPresent")
    container["command"] = ["conveyor", "dispatcher"]
    container["env"] = _dispatcher_env(wiring, function_url, port) + user_env
    container.setdefault(
        "resources",
        {
            "requests": {"cpu": "50m", "memory": "64Mi"},
            # CONCURRENCY answers of up to MAX_RESPONSE_BYTES at once (~180 MB for 4 answers of 8 MiB)
            "limits": {"cpu": "500m", "memory": "256Mi"},
        },
    )
    container.setdefault("securityContext", container_security_context())
    if wiring.mode is Mode.KNATIVE:
        ports = container.setdefault("ports", [])
        if not any(p.get("name") == "progress" for p in ports):
            ports.append({"name": "progress", "containerPort": KNATIVE_PROGRESS_PORT})
    metrics = metrics_port(container)
    container["readinessProbe"] = _probe(port, metrics, "/readyz", 10)
    container["livenessProbe"] = _probe(port, metrics, "/healthz", 20)
    if not mounts_tmp(container):
        container.setdefault("volumeMounts", []).append({"name": TMP_VOLUME, "mountPath": "/tmp"})
    own_empty_dir(pod, TMP_VOLUME, {"sizeLimit": "64Mi"})
    return container


def check_settings(dispatcher: Doc, function: int | None, owner: str) -> None:
    """The dispatcher's final env, read by its own rules (DispatcherSettings.from_env): what it
    would refuse at start is refused here, not left to a crash-looping pod. Its ports must be
    free in the pod's network namespace (the function's port, and each other's)."""
    env = {
        e["name"]: str(e["value"])
        for e in dispatcher.get("env") or []
        if "value" in e and "$(" not in str(e["value"])  # expanded by the kubelet
    }
    try:
        settings = DispatcherSettings.from_env(env)
    except SettingsError as exc:
        raise InjectError(f"{owner}: the dispatcher would refuse to start: {exc}") from None
    taken = {function: "the function's port"}
    for variable, port in (
        (DISPATCHER_PORT, settings.dispatcher_port),
        (PROGRESS_PORT, settings.progress_port),
        (METRICS_PORT, settings.metrics_port),
    ):
        if port and port in taken:
            raise InjectError(f"{owner}: the dispatcher's {variable} {port} is {taken[port]}")
        taken[port] = variable


def _grace_for(drain: float) -> int:
    return math.ceil(drain) + GRACE_MARGIN_SECONDS


def written_grace(existing: Doc | None) -> int | None:
    """The grace period inject wrote for the existing dispatcher's drain."""
    drain = written_drain(existing)
    return None if drain is None else _grace_for(drain)


def ensure_grace(
    pod: Doc, wiring: Wiring, owner: str, warnings: list[str], written: int | None
) -> None:
    """terminationGracePeriodSeconds must outlast the drain (SPEC §8). One equal to what inject
    wrote for the previous drain (``written``) was inject's own: it follows the new drain. The
    drain is at most MAX_TIMEOUT (check_settings refused more), so the one written fits int64;
    one past int64 is no grace period the API server reads, and is replaced like a non-number."""
    grace = pod.get("terminationGracePeriodSeconds")
    if (
        not isinstance(grace, int)
        or not wiring.drain_timeout < grace <= GRACE_LIMIT
        or grace == written
    ):
        grace = _grace_for(wiring.drain_timeout)
        pod["terminationGracePeriodSeconds"] = grace
    if wiring.mode is not Mode.JOB and grace >= DEPLOYMENT_GRACE_LIMIT:
        warnings.append(
            f"{owner}: terminationGracePeriodSeconds {grace} is 2 minutes or more; rolling "
            "updates wait that long per pod: long non-interruptible tasks belong in job mode"
        )


def disable_service_links(pod: Doc, owner: str, warnings: list[str]) -> None:
    """No `<SERVICE>_PORT=tcp://…` variables in the pod: a Service named `metrics`, `progress`
    or `conveyor-dispatcher` in the namespace would set METRICS_PORT, PROGRESS_PORT or
    CONVEYOR_DISPATCHER_PORT, and every dispatcher would refuse to start. Turned off even when
    the author turned them on (the function reaches Services by their DNS names)."""
    if pod.get("enableServiceLinks") not in (None, False):
        warnings.append(
            f"{owner}: enableServiceLinks turned off: a Service's <NAME>_PORT variables can "
            "collide with the dispatcher's settings; reach Services by their DNS names"
        )
    pod["enableServiceLinks"] = False


def _annotate_function(template: Doc, name: str) -> None:
    meta = template.setdefault("metadata", {})
    meta.setdefault("annotations", {})[FUNCTION_ANNOTATION] = name


def wire_pod(
    template: Doc, options: InjectOptions, mode: Mode, name: str, owner: str, warnings: list[str]
) -> Wiring:
    """Function as native sidecar + dispatcher as main container (sidecar and job)."""
    pod = pod_spec(template, owner)
    _refuse_other_dispatchers(pod, owner)
    function = _select_function(pod, template, options.container, owner)
    if mode is Mode.JOB:
        _refuse_regular_containers_in_job(pod, function, owner)
    port = function_port(function, owner)
    existing = find_dispatcher(pod)
    wiring = resolve(mode, name, options, existing, warnings)
    dispatcher_port = choose_dispatcher_port(pod, existing, port)
    written = written_grace(existing)
    _make_native_sidecar(pod, function, port)
    harden_function(function, pod, port, knative=False)
    url = f"http://127.0.0.1:{port}{wiring.function_path}"
    dispatcher = upsert_dispatcher(pod, wiring, url, dispatcher_port)
    check_settings(dispatcher, port, owner)
    restrict_pod(pod, {id(function), id(dispatcher)})
    _annotate_function(template, str(function.get("name")))
    ensure_grace(pod, wiring, owner, warnings, written)
    disable_service_links(pod, owner, warnings)
    return wiring
