"""Wire the dispatcher into a function's Kubernetes manifests (`conveyor inject`).

The function author writes a plain Deployment, Job or Knative Service with the
function's image; this module adds the dispatcher (SPEC §7) and the KEDA objects
that scale it on `<queue>-in` (SPEC §8), the way `linkerd inject` adds a proxy.
It is pure data manipulation (dicts in, dicts out, YAML at the edges) so that it
needs no Kubernetes client and can be tested offline.

Three modes, by default chosen from the input's kind:

* ``sidecar`` (Deployment): the function becomes a native sidecar (an
  ``initContainers`` entry with ``restartPolicy: Always`` and a startup probe),
  the dispatcher is the main container; a ScaledObject scales the Deployment.
* ``job`` (Job, or a Deployment to convert): a KEDA ScaledJob whose pods hold
  the same two containers, the dispatcher with ``ONE_SHOT=1``.
* ``knative`` (Knative Service): the function stays a Knative Service, made
  cluster-local; the dispatcher runs as its own Deployment posting to the
  Service's cluster URL, scaled by a ScaledObject.

Injection is idempotent: injecting the output again, with the same options,
gives the same bytes. Settings not given as options are read back from an
already injected dispatcher, so re-injecting never silently resets them.
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import yaml

from conveyor import __version__

Doc = dict[str, Any]

DISPATCHER_CONTAINER = "conveyor-dispatcher"
DEFAULT_IMAGE = f"conveyor/dispatcher:{__version__}"
DEFAULT_AMQP_SECRET = "conveyor-rabbitmq"
AMQP_URL_KEY = "amqp-url"  # amqp://user:pass@rabbitmq:5672/vhost, for the dispatcher
MANAGEMENT_URL_KEY = "management-url"  # http://user:pass@rabbitmq:15672/vhost, for KEDA
DEFAULT_DISPATCHER_PORT = 8081
DEFAULT_IDLE_EXIT_SECONDS = 60
GRACE_MARGIN_SECONDS = 15  # nack, close and the function's own stop, after the drain
DEPLOYMENT_GRACE_LIMIT = 120  # SPEC §8: keep rolling updates short
TMP_VOLUME = "conveyor-tmp"

FUNCTION_ANNOTATION = "conveyor.io/function-container"
# On every object inject generates: whose dispatcher it is. It also tells a
# knative dispatcher Deployment apart from a function's Deployment on re-injection.
DISPATCHER_FOR_LABEL = "conveyor.io/dispatcher-for"
KNATIVE_VISIBILITY_LABEL = "networking.knative.dev/visibility"

KEDA_API = "keda.sh/v1alpha1"
KNATIVE_API = "serving.knative.dev/v1"
PASSTHROUGH_KINDS = {
    ("v1", "ConfigMap"),
    ("v1", "Secret"),
    ("v1", "Service"),
    ("v1", "ServiceAccount"),
}


class InjectError(ValueError):
    """The input cannot be injected; the message says why, for a human."""


class Mode(enum.StrEnum):
    SIDECAR = "sidecar"
    JOB = "job"
    KNATIVE = "knative"


class ShutdownMode(enum.StrEnum):
    REQUEUE = "requeue"
    DRAIN = "drain"


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
    drain_timeout: int
    image: str
    amqp_secret: str
    idle_exit_seconds: int = DEFAULT_IDLE_EXIT_SECONDS


@dataclass
class InjectResult:
    documents: list[Doc]
    warnings: list[str] = field(default_factory=list)


_MODE_DEFAULTS: dict[Mode, dict[str, Any]] = {
    # Deployments: short tasks; a scale-in requeues what is in flight.
    Mode.SIDECAR: {"concurrency": 4, "shutdown_mode": ShutdownMode.REQUEUE, "drain_timeout": 30},
    Mode.KNATIVE: {"concurrency": 4, "shutdown_mode": ShutdownMode.REQUEUE, "drain_timeout": 30},
    # Jobs: long non-interruptible tasks, one message per Job.
    Mode.JOB: {"concurrency": 1, "shutdown_mode": ShutdownMode.DRAIN, "drain_timeout": 600},
}


# --------------------------------------------------------------------------- YAML


class _Dumper(yaml.SafeDumper):
    """Never writes anchors: every manifest stays readable and self-contained."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def load_documents(text: str) -> list[Doc]:
    """Parses multi-document YAML; empty documents are skipped."""
    try:
        raw = list(yaml.safe_load_all(text))
    except yaml.YAMLError as exc:
        raise InjectError(f"malformed YAML: {_one_line(str(exc))}") from None
    docs = [d for d in raw if d is not None]
    for index, doc in enumerate(docs, start=1):
        if not isinstance(doc, dict):
            raise InjectError(f"document {index} is not a mapping (a Kubernetes object)")
        if not isinstance(doc.get("kind"), str) or not isinstance(doc.get("apiVersion"), str):
            raise InjectError(f"document {index} has no apiVersion or kind")
    return docs


def dump_documents(docs: Iterable[Doc]) -> str:
    """Multi-document YAML, keys in insertion order, no anchors."""
    return yaml.dump_all(
        list(docs),
        Dumper=_Dumper,
        explicit_start=True,
        sort_keys=False,
        default_flow_style=False,
        width=4096,
        allow_unicode=True,
    )


def inject_yaml(text: str, options: InjectOptions | None = None) -> tuple[str, list[str]]:
    """The whole command: YAML text in, YAML text and warnings out."""
    result = inject_documents(load_documents(text), options or InjectOptions())
    return dump_documents(result.documents), result.warnings


def _one_line(text: str) -> str:
    return " ".join(text.split())


# ------------------------------------------------------------------ orchestration


def inject_documents(docs: list[Doc], options: InjectOptions) -> InjectResult:
    """Injects every workload of ``docs``; returns the new documents in order.

    KEDA objects and the knative dispatcher Deployment that an earlier injection
    produced are updated in place and emitted right after their workload; other
    supported objects pass through unchanged; anything else is an error.
    """
    _check_options(options)
    docs = copy.deepcopy(docs)
    roles = [_classify(doc) for doc in docs]
    if "workload" not in roles:
        raise InjectError("no Deployment, Job or Knative Service to inject in the input")
    companions = {_key(d): d for d, role in zip(docs, roles, strict=True) if role == "companion"}
    claimed: set[Key] = set()
    warnings: list[str] = []
    groups = {
        index: _inject_workload(doc, options, _Companions(companions, claimed), warnings)
        for index, (doc, role) in enumerate(zip(docs, roles, strict=True))
        if role == "workload"
    }
    result: list[Doc] = []
    for index, (doc, role) in enumerate(zip(docs, roles, strict=True)):
        if role == "workload":
            result.extend(groups[index])
        elif role == "passthrough" or _key(doc) not in claimed:
            result.append(doc)
    return InjectResult(result, warnings)


Key = tuple[str, str, str]


@dataclass
class _Companions:
    """The KEDA objects (and knative dispatcher Deployments) found in the input,
    so that re-injecting updates them instead of adding duplicates."""

    found: dict[Key, Doc]
    claimed: set[Key]

    def take(self, kind: str, namespace: str | None, name: str) -> Doc | None:
        key = (kind, namespace or "", name)
        if key in self.found:
            self.claimed.add(key)
            return self.found[key]
        return None


def _check_options(options: InjectOptions) -> None:
    if options.concurrency is not None and options.concurrency < 1:
        raise InjectError("--concurrency must be at least 1")
    if options.drain_timeout is not None and options.drain_timeout < 0:
        raise InjectError("--drain-timeout must not be negative")
    if options.queue is not None and not options.queue.strip():
        raise InjectError("--queue must not be empty")


def _classify(doc: Doc) -> str:
    api, kind = doc["apiVersion"], doc["kind"]
    if _is_generated_dispatcher(doc) or (
        api == KEDA_API and kind in {"ScaledObject", "TriggerAuthentication"}
    ):
        return "companion"
    if (api, kind) in {("apps/v1", "Deployment"), ("batch/v1", "Job"), (KEDA_API, "ScaledJob")}:
        return "workload"
    if (api, kind) == (KNATIVE_API, "Service"):
        return "workload"
    if (api, kind) in PASSTHROUGH_KINDS:
        return "passthrough"
    raise InjectError(
        f"unsupported kind {kind} ({api}) in {_name_of(doc)}: conveyor inject wires a "
        "Deployment, a Job or a Knative Service, and passes ConfigMap, Secret, "
        "Service and ServiceAccount through"
    )


def _is_generated_dispatcher(doc: Doc) -> bool:
    meta = doc.get("metadata") if isinstance(doc.get("metadata"), dict) else {}
    labels = meta.get("labels") if isinstance(meta.get("labels"), dict) else {}
    return (
        doc.get("apiVersion") == "apps/v1"
        and doc.get("kind") == "Deployment"
        and DISPATCHER_FOR_LABEL in labels
    )


def _key(doc: Doc) -> Key:
    meta = doc.get("metadata") if isinstance(doc.get("metadata"), dict) else {}
    return (doc["kind"], str(meta.get("namespace") or ""), str(meta.get("name") or ""))


def _name_of(doc: Doc) -> str:
    meta = doc.get("metadata")
    name = meta.get("name") if isinstance(meta, dict) else None
    return f"{doc.get('kind', 'object')} {name}" if name else f"a {doc.get('kind', 'object')}"


def _workload_name(doc: Doc) -> str:
    if not isinstance(doc.get("metadata"), dict) or not isinstance(doc.get("spec", {}), dict):
        raise InjectError(f"{_name_of(doc)}: metadata and spec must be mappings")
    name = doc["metadata"].get("name")
    if not isinstance(name, str) or not name:
        raise InjectError(f"{_name_of(doc)} has no metadata.name")
    return name


def _natural_mode(doc: Doc) -> Mode:
    if doc["kind"] == "Deployment":
        return Mode.SIDECAR
    if doc["kind"] in {"Job", "ScaledJob"}:
        return Mode.JOB
    return Mode.KNATIVE


def _mode_for(doc: Doc, requested: Mode | None) -> Mode:
    natural = _natural_mode(doc)
    if requested is None or requested is natural:
        return natural
    if doc["kind"] == "Deployment" and requested is Mode.JOB:
        return Mode.JOB  # the Deployment's pod template becomes the ScaledJob's
    raise InjectError(
        f"--mode {requested} does not apply to {_name_of(doc)}: a Deployment is injected "
        "in sidecar (or job) mode, a Job in job mode, a Knative Service in knative mode"
    )


def _inject_workload(
    doc: Doc, options: InjectOptions, companions: _Companions, warnings: list[str]
) -> list[Doc]:
    mode = _mode_for(doc, options.mode)
    name = _workload_name(doc)
    try:
        if mode is Mode.KNATIVE:
            return _inject_knative(doc, name, options, companions, warnings)
        if mode is Mode.JOB:
            return _inject_job(doc, name, options, companions, warnings)
        return _inject_sidecar(doc, name, options, companions, warnings)
    except (AttributeError, KeyError, TypeError) as exc:
        # A field of the wrong type that the checks above did not anticipate.
        raise InjectError(
            f"{_name_of(doc)} is malformed ({type(exc).__name__}: {exc}); "
            "`kubectl apply --dry-run=client -f` shows where"
        ) from None


# -------------------------------------------------------------- settings (Wiring)


def _env_literal(container: Doc | None, name: str) -> str | None:
    for entry in (container or {}).get("env") or []:
        if isinstance(entry, dict) and entry.get("name") == name and "value" in entry:
            return str(entry["value"])
    return None


def _env_secret_name(container: Doc | None, name: str) -> str | None:
    for entry in (container or {}).get("env") or []:
        if isinstance(entry, dict) and entry.get("name") == name:
            ref = ((entry.get("valueFrom") or {}).get("secretKeyRef")) or {}
            return ref.get("name")
    return None


def _int_or_none(value: str | None, what: str) -> int | None:
    if value is None:
        return None
    try:
        return int(float(value))
    except ValueError:
        raise InjectError(f"the existing dispatcher has a non-numeric {what}: {value!r}") from None


def _resolve(mode: Mode, name: str, options: InjectOptions, existing: Doc | None) -> Wiring:
    """Option, else the value an earlier injection wrote, else the mode's default."""
    defaults = _MODE_DEFAULTS[mode]
    concurrency = options.concurrency or _int_or_none(
        _env_literal(existing, "CONCURRENCY"), "CONCURRENCY"
    )
    if mode is Mode.JOB:
        if options.concurrency not in (None, 1):
            raise InjectError("--concurrency must be 1 in job mode: each Job takes one message")
        concurrency = 1
    shutdown = options.shutdown_mode or _env_literal(existing, "SHUTDOWN_MODE")
    drain = options.drain_timeout
    if drain is None:
        drain = _int_or_none(_env_literal(existing, "DRAIN_TIMEOUT"), "DRAIN_TIMEOUT")
    idle = _int_or_none(_env_literal(existing, "IDLE_EXIT_SECONDS"), "IDLE_EXIT_SECONDS")
    try:
        shutdown_mode = ShutdownMode(shutdown) if shutdown else defaults["shutdown_mode"]
    except ValueError:
        raise InjectError(f"SHUTDOWN_MODE must be requeue or drain, not {shutdown!r}") from None
    return Wiring(
        mode=mode,
        queue=options.queue or _env_literal(existing, "CONVEYOR_QUEUE") or name,
        concurrency=concurrency or defaults["concurrency"],
        shutdown_mode=shutdown_mode,
        drain_timeout=defaults["drain_timeout"] if drain is None else drain,
        image=options.image or (existing or {}).get("image") or DEFAULT_IMAGE,
        amqp_secret=options.amqp_secret
        or _env_secret_name(existing, "CONVEYOR_AMQP_URL")
        or DEFAULT_AMQP_SECRET,
        idle_exit_seconds=DEFAULT_IDLE_EXIT_SECONDS if idle is None else idle,
    )


# ----------------------------------------------------------------- pod wiring


def _pod_spec(template: Any, owner: str) -> Doc:
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


def _find_dispatcher(pod: Doc) -> Doc | None:
    for container in pod.get("containers") or []:
        if isinstance(container, dict) and container.get("name") == DISPATCHER_CONTAINER:
            return container
    return None


def _native_sidecars(pod: Doc) -> list[Doc]:
    return [c for c in pod.get("initContainers") or [] if c.get("restartPolicy") == "Always"]


def _select_function(pod: Doc, template: Doc, requested: str | None, owner: str) -> Doc:
    containers = [c for c in pod.get("containers") or [] if isinstance(c, dict)]
    everything = containers + _native_sidecars(pod)
    if not [c for c in everything if c.get("name") != DISPATCHER_CONTAINER]:
        raise InjectError(f"{owner} has no containers: nothing to inject the dispatcher next to")
    annotations = (template.get("metadata") or {}).get("annotations") or {}
    wanted = requested or annotations.get(FUNCTION_ANNOTATION)
    if wanted:
        for container in everything:
            if container.get("name") == wanted and wanted != DISPATCHER_CONTAINER:
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
    port = _env_literal(container, "PORT")
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


def _dispatcher_port(pod: Doc, existing: Doc | None, function: int | None) -> int:
    used = _used_ports(pod) | ({function} if function else set())
    current = _int_or_none(_env_literal(existing, "DISPATCHER_PORT"), "DISPATCHER_PORT")
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


def _probe(port: int, path: str, period: int) -> Doc:
    # The local API listens on 127.0.0.1 only: an httpGet probe from the kubelet
    # (which connects to the pod IP) cannot reach it, so probe from inside.
    code = (
        f"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{port}{path}', timeout=2)"
    )
    return {
        "exec": {"command": ["python", "-c", code]},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": 3,
    }


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
        {"name": "CONVEYOR_QUEUE", "value": wiring.queue},
        {
            "name": "CONVEYOR_AMQP_URL",
            "valueFrom": {"secretKeyRef": {"name": wiring.amqp_secret, "key": AMQP_URL_KEY}},
        },
    ]
    if "$(POD_NAMESPACE)" in function_url:
        env.append(_field_env("POD_NAMESPACE", "metadata.namespace"))
    env += [
        {"name": "FUNCTION_URL", "value": function_url},
        {"name": "CONCURRENCY", "value": str(wiring.concurrency)},
        {"name": "SHUTDOWN_MODE", "value": str(wiring.shutdown_mode)},
        {"name": "DRAIN_TIMEOUT", "value": str(wiring.drain_timeout)},
        {"name": "DISPATCHER_PORT", "value": str(port)},
        {"name": "ONE_SHOT", "value": "1" if wiring.mode is Mode.JOB else "0"},
    ]
    if wiring.mode is Mode.JOB:
        env.append({"name": "IDLE_EXIT_SECONDS", "value": str(wiring.idle_exit_seconds)})
    env.append(_field_env("HOSTNAME", "metadata.name"))
    return env


MANAGED_ENV = {
    "CONVEYOR_QUEUE",
    "CONVEYOR_AMQP_URL",
    "POD_NAMESPACE",
    "FUNCTION_URL",
    "CONCURRENCY",
    "SHUTDOWN_MODE",
    "DRAIN_TIMEOUT",
    "DISPATCHER_PORT",
    "ONE_SHOT",
    "IDLE_EXIT_SECONDS",
    "HOSTNAME",
}


def _field_env(name: str, path: str) -> Doc:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _upsert_dispatcher(pod: Doc, wiring: Wiring, function_url: str, port: int) -> Doc:
    """Adds the dispatcher as the first main container, or updates it in place."""
    container = _find_dispatcher(pod)
    if container is None:
        container = {"name": DISPATCHER_CONTAINER}
        pod["containers"] = [container, *(pod.get("containers") or [])]
    user_env = [e for e in container.get("env") or [] if e.get("name") not in MANAGED_ENV]
    container["image"] = wiring.image
    container.setdefault("imagePullPolicy", "IfNotPresent")
    container["command"] = ["conveyor", "dispatcher"]
    container["env"] = _dispatcher_env(wiring, function_url, port) + user_env
    container.setdefault(
        "resources",
        {
            "requests": {"cpu": "50m", "memory": "64Mi"},
            "limits": {"cpu": "500m", "memory": "128Mi"},
        },
    )
    container.setdefault("securityContext", container_security_context())
    container["readinessProbe"] = _probe(port, "/readyz", 10)
    container["livenessProbe"] = _probe(port, "/healthz", 20)
    mounts = container.setdefault("volumeMounts", [])
    if not any(m.get("mountPath") == "/tmp" for m in mounts):
        mounts.append({"name": TMP_VOLUME, "mountPath": "/tmp"})
    _ensure_tmp_volume(pod)
    return container


def _ensure_tmp_volume(pod: Doc) -> None:
    volumes = pod.setdefault("volumes", [])
    if not any(v.get("name") == TMP_VOLUME for v in volumes):
        volumes.append({"name": TMP_VOLUME, "emptyDir": {"sizeLimit": "64Mi"}})


def _ensure_grace(pod: Doc, wiring: Wiring, owner: str, warnings: list[str]) -> None:
    """terminationGracePeriodSeconds must outlast the drain (SPEC §8)."""
    grace = pod.get("terminationGracePeriodSeconds")
    if not isinstance(grace, int) or grace <= wiring.drain_timeout:
        grace = wiring.drain_timeout + GRACE_MARGIN_SECONDS
        pod["terminationGracePeriodSeconds"] = grace
    if wiring.mode is not Mode.JOB and grace >= DEPLOYMENT_GRACE_LIMIT:
        warnings.append(
            f"{owner}: terminationGracePeriodSeconds {grace} is 2 minutes or more; rolling "
            "updates wait that long per pod: long non-interruptible tasks belong in job mode"
        )


def _annotate_function(template: Doc, name: str) -> None:
    meta = template.setdefault("metadata", {})
    meta.setdefault("annotations", {})[FUNCTION_ANNOTATION] = name


def _wire_pod(
    template: Doc, options: InjectOptions, mode: Mode, name: str, owner: str, warnings: list[str]
) -> Wiring:
    """Function as native sidecar + dispatcher as main container (sidecar and job)."""
    pod = _pod_spec(template, owner)
    function = _select_function(pod, template, options.container, owner)
    port = function_port(function, owner)
    existing = _find_dispatcher(pod)
    wiring = _resolve(mode, name, options, existing)
    dispatcher_port = _dispatcher_port(pod, existing, port)
    _make_native_sidecar(pod, function, port)
    _upsert_dispatcher(pod, wiring, f"http://127.0.0.1:{port}/", dispatcher_port)
    _annotate_function(template, str(function.get("name")))
    _ensure_grace(pod, wiring, owner, warnings)
    return wiring


# -------------------------------------------------------------- KEDA objects


def _labels(name: str, component: str) -> Doc:
    return {
        "app.kubernetes.io/name": name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": "conveyor",
        DISPATCHER_FOR_LABEL: name,
    }


def _metadata(name: str, namespace: str | None, labels: Doc) -> Doc:
    meta: Doc = {"name": name}
    if namespace:
        meta["namespace"] = namespace
    meta["labels"] = labels
    return meta


def rabbitmq_trigger(wiring: Wiring, auth_name: str) -> Doc:
    """KEDA's RabbitMQ scaler through the management API (counts unacked messages)."""
    return {
        "type": "rabbitmq",
        "metadata": {
            "protocol": "http",
            "mode": "QueueLength",
            "value": str(wiring.concurrency),
            "activationValue": "0",
            "queueName": f"{wiring.queue}-in",
        },
        "authenticationRef": {"name": auth_name},
    }


def _update(existing: Doc | None, fresh: Doc, derived: Iterable[str]) -> Doc:
    """Keeps an existing object's other fields (user edits) and rewrites the derived ones."""
    if existing is None:
        return fresh
    for key, value in fresh.items():
        if key in {"apiVersion", "kind"}:
            existing[key] = value
        elif key == "metadata":
            meta = existing.setdefault("metadata", {})
            meta["name"] = value["name"]
            meta.setdefault("labels", {}).update(value["labels"])
        elif key == "spec":
            spec = existing.setdefault("spec", {})
            for skey, svalue in value.items():
                if skey in derived:
                    spec[skey] = svalue
                else:
                    spec.setdefault(skey, svalue)
    return existing


def _trigger_authentication(
    name: str, namespace: str | None, wiring: Wiring, existing: Doc | None
) -> Doc:
    fresh = {
        "apiVersion": KEDA_API,
        "kind": "TriggerAuthentication",
        "metadata": _metadata(f"{name}-rabbitmq", namespace, _labels(name, "autoscaling")),
        "spec": {
            "secretTargetRef": [
                {"parameter": "host", "name": wiring.amqp_secret, "key": MANAGEMENT_URL_KEY}
            ]
        },
    }
    return _update(existing, fresh, {"secretTargetRef"})


def _scaled_object(
    target: str, name: str, namespace: str | None, wiring: Wiring, existing: Doc | None
) -> Doc:
    fresh = {
        "apiVersion": KEDA_API,
        "kind": "ScaledObject",
        "metadata": _metadata(target, namespace, _labels(name, "autoscaling")),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": target},
            "pollingInterval": 5,
            "cooldownPeriod": 120,
            "minReplicaCount": 0,
            "maxReplicaCount": 10,
            "triggers": [rabbitmq_trigger(wiring, f"{name}-rabbitmq")],
        },
    }
    return _update(existing, fresh, {"scaleTargetRef", "triggers"})


# ---------------------------------------------------------------- the modes


def _inject_sidecar(
    doc: Doc, name: str, options: InjectOptions, companions: _Companions, warnings: list[str]
) -> list[Doc]:
    owner = _name_of(doc)
    spec = doc.setdefault("spec", {})
    wiring = _wire_pod(spec.get("template"), options, Mode.SIDECAR, name, owner, warnings)
    spec.pop("replicas", None)  # KEDA owns the replica count: `kubectl apply` must not reset it
    namespace = doc["metadata"].get("namespace")
    return [doc, *_keda_objects(name, name, namespace, wiring, companions)]


def _keda_objects(
    target: str, name: str, namespace: str | None, wiring: Wiring, companions: _Companions
) -> list[Doc]:
    """TriggerAuthentication + ScaledObject for a Deployment named ``target``."""
    auth = companions.take("TriggerAuthentication", namespace, f"{name}-rabbitmq")
    scaled = companions.take("ScaledObject", namespace, target)
    return [
        _trigger_authentication(name, namespace, wiring, auth),
        _scaled_object(target, name, namespace, wiring, scaled),
    ]


def _job_spec_from(doc: Doc) -> Doc:
    """A Job's spec (or a Deployment's pod template) as a ScaledJob's jobTargetRef."""
    spec = copy.deepcopy(doc.get("spec") or {})
    if doc["kind"] == "Deployment":
        spec = {"template": spec.get("template")}
    for key in ("selector", "manualSelector", "replicas", "strategy"):
        spec.pop(key, None)
    template = spec.get("template")
    if isinstance(template, dict) and isinstance(template.get("spec"), dict):
        template["spec"].setdefault("restartPolicy", "Never")
        if template["spec"]["restartPolicy"] == "Always":
            template["spec"]["restartPolicy"] = "Never"
    spec["parallelism"] = 1
    spec["completions"] = 1
    return spec


def _as_scaled_job(doc: Doc) -> Doc:
    if doc["kind"] == "ScaledJob":
        return doc
    meta = doc.get("metadata") or {}
    new_meta: Doc = {
        k: copy.deepcopy(v)
        for k, v in meta.items()
        if k in {"name", "namespace", "labels", "annotations"}
    }
    return {
        "apiVersion": KEDA_API,
        "kind": "ScaledJob",
        "metadata": new_meta,
        "spec": {"jobTargetRef": _job_spec_from(doc)},
    }


def _inject_job(
    doc: Doc, name: str, options: InjectOptions, companions: _Companions, warnings: list[str]
) -> list[Doc]:
    owner = _name_of(doc)
    scaled_job = _as_scaled_job(doc)
    spec = scaled_job.setdefault("spec", {})
    target = spec.get("jobTargetRef")
    if not isinstance(target, dict):
        raise InjectError(f"{owner} has no spec.jobTargetRef")
    wiring = _wire_pod(target.get("template"), options, Mode.JOB, name, owner, warnings)
    spec.setdefault("pollingInterval", 10)
    spec.setdefault("successfulJobsHistoryLimit", 3)
    spec.setdefault("failedJobsHistoryLimit", 5)
    spec.setdefault("maxReplicaCount", 10)
    # The management API counts unacked messages too, so the messages that running
    # Jobs hold are in the queue length: the default strategy (queue length minus
    # running Jobs) starts one Job per ready message.
    spec.setdefault("scalingStrategy", {"strategy": "default"})
    spec["triggers"] = [rabbitmq_trigger(wiring, f"{name}-rabbitmq")]
    namespace = (scaled_job.get("metadata") or {}).get("namespace")
    auth = companions.take("TriggerAuthentication", namespace, f"{name}-rabbitmq")
    return [scaled_job, _trigger_authentication(name, namespace, wiring, auth)]


def _knative_pod_spec(ksvc: Doc) -> Doc:
    return _pod_spec((ksvc.get("spec") or {}).get("template"), _name_of(ksvc))


def _dispatcher_deployment(name: str, namespace: str | None, existing: Doc | None) -> Doc:
    if existing is not None:
        return existing
    labels = _labels(name, "dispatcher")
    selector = {"app.kubernetes.io/name": name, "app.kubernetes.io/component": "dispatcher"}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(f"{name}-dispatcher", namespace, labels),
        "spec": {
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {"labels": dict(labels)},
                "spec": {
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "securityContext": {
                        "runAsNonRoot": True,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "containers": [],
                },
            },
        },
    }


def _inject_knative(
    doc: Doc, name: str, options: InjectOptions, companions: _Companions, warnings: list[str]
) -> list[Doc]:
    pod = _knative_pod_spec(doc)
    if not [c for c in pod.get("containers") or [] if isinstance(c, dict)]:
        raise InjectError(f"{_name_of(doc)} has no containers: nothing to send tasks to")
    # Tasks come through the queue: the function needs no public route.
    doc["metadata"].setdefault("labels", {}).setdefault(KNATIVE_VISIBILITY_LABEL, "cluster-local")
    namespace = doc["metadata"].get("namespace")
    target = f"{name}-dispatcher"
    deployment = _dispatcher_deployment(
        name, namespace, companions.take("Deployment", namespace, target)
    )
    dpod = _pod_spec(deployment["spec"].get("template"), _name_of(deployment))
    existing = _find_dispatcher(dpod)
    wiring = _resolve(Mode.KNATIVE, name, options, existing)
    port = _dispatcher_port(dpod, existing, None)
    # Knative's cluster-local URL; POD_NAMESPACE keeps the manifest namespace-free.
    url = f"http://{name}.$(POD_NAMESPACE).svc.cluster.local/"
    _upsert_dispatcher(dpod, wiring, url, port)
    _ensure_grace(dpod, wiring, _name_of(deployment), warnings)
    deployment["spec"].pop("replicas", None)
    return [doc, deployment, *_keda_objects(target, name, namespace, wiring, companions)]
