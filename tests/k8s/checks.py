"""Offline checks for Kubernetes objects, shared by the manifest and inject tests.

Schema validation: core kinds with kubernetes-validate (strict), KEDA and Knative
kinds with jsonschema against the real CRDs in ../shared/k8s-crds/, plus a walk
that rejects fields a CRD does not declare (what `kubectl apply` does with
server-side strict field validation). Then the rules of SPEC §8 that a schema
cannot express: the dispatcher and its trigger agree, pods are locked down, the
grace period outlasts the drain.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

Doc = dict[str, Any]

K8S_VERSION = "1.30"  # the oldest version with native sidecars on by default, +1
CRD_FILES = {
    ("keda.sh", "ScaledObject"): "keda.sh_scaledobjects.yaml",
    ("keda.sh", "ScaledJob"): "keda.sh_scaledjobs.yaml",
    ("keda.sh", "TriggerAuthentication"): "keda.sh_triggerauthentications.yaml",
    ("serving.knative.dev", "Service"): "serving.knative.dev_services.yaml",
    ("rabbitmq.com", "RabbitmqCluster"): "rabbitmq.com_rabbitmqclusters.yaml",
    ("postgresql.cnpg.io", "Cluster"): "postgresql.cnpg.io_clusters.yaml",
}
# What KEDA's rabbitmq scaler reads (../shared/k8s-crds/README.md); anything else is a typo.
RABBITMQ_METADATA_KEYS = {
    "queueName", "mode", "value", "activationValue", "host", "protocol", "vhostName",
    "useRegex", "excludeUnacknowledged", "pageSize", "operation", "timeout", "unsafeSsl",
}  # fmt: skip
DISPATCHER = "conveyor-dispatcher"
FUNCTION_ANNOTATION = "conveyor.io/function-container"
# Secrets the operator creates (documented in keda/README.md), and those the RabbitMQ and
# CloudNativePG operators generate for deploy/ha; manifests never ship them.
EXTERNAL_SECRETS = {
    "conveyor-gateway",
    "conveyor-rabbitmq",
    "conveyor-rabbitmq-default-user",
    "conveyor-postgres-app",
}
DEPLOYMENT_GRACE_LIMIT = 120


# ------------------------------------------------------------------ schemas


def is_custom(doc: Doc) -> bool:
    group = doc["apiVersion"].split("/")[0] if "/" in doc["apiVersion"] else ""
    return (group, doc["kind"]) in CRD_FILES


def validate_core(doc: Doc) -> None:
    """Strict kubernetes-validate: unknown fields and wrong types fail."""
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        raise AssertionError(f"{_name(doc)}: {path}: {exc.message}") from None


@functools.cache
def _crd_schema(crd_dir: Path, filename: str, version: str) -> Doc:
    crd = yaml.safe_load((crd_dir / filename).read_text())
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            return entry["schema"]["openAPIV3Schema"]
    raise AssertionError(f"{filename} has no version {version}")


def validate_custom(doc: Doc, crd_dir: Path) -> None:
    group, version = doc["apiVersion"].split("/")
    schema = _crd_schema(crd_dir, CRD_FILES[(group, doc["kind"])], version)
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(doc), key=lambda e: list(e.path))
    assert not errors, f"{_name(doc)}: " + "; ".join(
        f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors
    )
    unknown = list(unknown_fields(doc, schema))
    assert not unknown, f"{_name(doc)}: fields the CRD does not declare: {unknown}"


def unknown_fields(value: Any, schema: Doc, path: str = "") -> Iterator[str]:
    """Paths in ``value`` that ``schema`` neither declares nor lets through."""
    if not isinstance(schema, dict) or schema.get("x-kubernetes-preserve-unknown-fields"):
        return
    if isinstance(value, dict) and "properties" in schema:
        for key, item in value.items():
            if key in schema["properties"]:
                yield from unknown_fields(item, schema["properties"][key], f"{path}.{key}")
            elif not schema.get("additionalProperties"):
                yield f"{path}.{key}"
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key, item in value.items():
            yield from unknown_fields(item, schema["additionalProperties"], f"{path}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            yield from unknown_fields(item, schema["items"], f"{path}[{index}]")


def validate_all(docs: list[Doc], crd_dir: Path | None) -> None:
    """Core kinds always; custom kinds when the CRDs are available."""
    for doc in docs:
        if is_custom(doc):
            if crd_dir is not None:
                validate_custom(doc, crd_dir)
        else:
            validate_core(doc)


def _name(doc: Doc) -> str:
    return f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"


# ------------------------------------------------------------------ pods


@dataclass
class Pod:
    owner: Doc
    template: Doc
    spec: Doc
    long_running: bool  # serves until stopped (probes), or runs to completion

    @property
    def name(self) -> str:
        return _name(self.owner)

    def containers(self) -> list[Doc]:
        return list(self.spec.get("initContainers") or []) + list(self.spec["containers"])

    def container(self, name: str) -> Doc | None:
        return next((c for c in self.containers() if c.get("name") == name), None)


def pods(docs: list[Doc]) -> list[Pod]:
    found = []
    for doc in docs:
        kind, spec = doc["kind"], doc.get("spec") or {}
        if kind == "Deployment":
            found.append(Pod(doc, spec["template"], spec["template"]["spec"], True))
        elif kind == "ScaledJob":
            template = spec["jobTargetRef"]["template"]
            found.append(Pod(doc, template, template["spec"], True))
        elif kind == "Service" and doc["apiVersion"].startswith("serving.knative.dev/"):
            found.append(Pod(doc, spec["template"], spec["template"]["spec"], True))
        elif kind == "Job":
            found.append(Pod(doc, spec["template"], spec["template"]["spec"], False))
        elif kind == "CronJob":
            template = spec["jobTemplate"]["spec"]["template"]
            found.append(Pod(doc, template, template["spec"], False))
    return found


def env(container: Doc) -> dict[str, Any]:
    """name -> literal value, or the valueFrom mapping."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env") or []}


def _effective(pod: Pod, container: Doc, key: str) -> Any:
    own = (container.get("securityContext") or {}).get(key)
    return own if own is not None else (pod.spec.get("securityContext") or {}).get(key)


def check_container_hardening(pod: Pod) -> None:
    for c in pod.containers():
        where = f"{pod.name} container {c.get('name', '(unnamed)')}"
        resources = c.get("resources") or {}
        for part in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(resources.get(part) or {}), f"{where}: {part}"
        sc = c.get("securityContext") or {}
        assert sc.get("allowPrivilegeEscalation") is False, where
        assert sc.get("readOnlyRootFilesystem") is True, where
        assert sc.get("capabilities", {}).get("drop") == ["ALL"], where
        assert _effective(pod, c, "runAsNonRoot") is True, where
        assert (_effective(pod, c, "seccompProfile") or {}).get("type") == "RuntimeDefault", where
        if pod.long_running:
            assert c.get("livenessProbe") and c.get("readinessProbe"), f"{where}: probes"
    if not pod.long_running:
        job_spec = _job_spec(pod.owner)
        assert job_spec.get("activeDeadlineSeconds"), f"{pod.name}: unbounded run"


def _job_spec(doc: Doc) -> Doc:
    if doc["kind"] == "CronJob":
        return doc["spec"]["jobTemplate"]["spec"]
    return doc["spec"]


# ----------------------------------------------------------- the dispatcher


@dataclass
class Dispatcher:
    pod: Pod
    container: Doc

    @property
    def env(self) -> dict[str, Any]:
        return env(self.container)

    def setting(self, name: str, default: Any = None) -> Any:
        """The value (or valueFrom) the dispatcher takes ``name`` from: CONVEYOR_<NAME> first,
        then <NAME>, as DispatcherSettings.from_env reads them."""
        e = self.env
        return e.get(f"CONVEYOR_{name}", e.get(name, default))


def set_env(container: Doc, entries: list[Doc]) -> None:
    """Sets ``entries`` as a user editing the manifest would: each in place of the container's
    entries of the same dispatcher setting, whatever their spelling."""
    edited = {_setting(e["name"]) for e in entries}
    kept = [e for e in container.get("env") or [] if _setting(e["name"]) not in edited]
    container["env"] = kept + entries


def _setting(name: str) -> str:
    return name.upper().removeprefix("CONVEYOR_")


def dispatchers(docs: list[Doc]) -> list[Dispatcher]:
    return [
        Dispatcher(pod, c)
        for pod in pods(docs)
        for c in pod.spec["containers"]
        if c.get("name") == DISPATCHER
    ]


def check_dispatcher(d: Dispatcher) -> None:
    e, where = d.env, d.pod.name
    assert isinstance(e["CONVEYOR_QUEUE"], str) and e["CONVEYOR_QUEUE"], where
    amqp = e["CONVEYOR_AMQP_URL"]  # from the operator's secret, or composed from one
    assert (isinstance(amqp, dict) and amqp["secretKeyRef"]["key"] == "amqp-url") or (
        isinstance(amqp, str) and amqp.startswith("amqp")
    ), where
    assert int(d.setting("CONCURRENCY")) >= 1, where
    assert d.setting("SHUTDOWN_MODE") in {"requeue", "drain"}, where
    assert d.setting("ONE_SHOT") in {"0", "1"}, where
    assert d.setting("HOSTNAME") == {"fieldRef": {"fieldPath": "metadata.name"}}, where
    assert d.container["command"] == ["conveyor", "dispatcher"], where
    port = d.setting("DISPATCHER_PORT")
    metrics = e.get("CONVEYOR_METRICS_PORT", e.get("METRICS_PORT"))
    named = {p.get("name"): p["containerPort"] for p in d.container.get("ports") or []}
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        if metrics:
            # /healthz and /readyz on all interfaces: the kubelet's httpGet, no interpreter
            # started per probe as an exec probe would.
            get = d.container[probe].get("httpGet")
            assert get, f"{where}: {probe} must be httpGet on METRICS_PORT {metrics}"
            assert get["path"] == path, (where, probe)
            assert named.get(get["port"], get["port"]) == int(metrics), (where, probe)
        else:
            # Loopback-only API: kubelet httpGet probes cannot reach it, exec probes can.
            command = d.container[probe]["exec"]["command"]
            assert f"http://127.0.0.1:{port}{path}" in command[-1], (where, probe)
    grace = d.pod.spec.get("terminationGracePeriodSeconds", 30)
    assert grace > int(d.setting("DRAIN_TIMEOUT")), f"{where}: grace {grace} <= DRAIN_TIMEOUT"
    if d.pod.owner["kind"] == "Deployment":
        assert grace < DEPLOYMENT_GRACE_LIMIT, f"{where}: grace {grace} >= 2 min"
    mounts = {m["mountPath"] for m in d.container.get("volumeMounts") or []}
    assert "/tmp" in mounts, where
    # A Service named `metrics` or `conveyor-dispatcher` would otherwise set METRICS_PORT or
    # CONVEYOR_DISPATCHER_PORT to tcp://… in the pod, and the dispatcher would not start.
    assert d.pod.spec.get("enableServiceLinks") is False, f"{where}: enableServiceLinks"


def function_container(d: Dispatcher) -> Doc:
    """The function next to the dispatcher: a native sidecar of the same pod."""
    name = (d.pod.template.get("metadata") or {}).get("annotations", {}).get(FUNCTION_ANNOTATION)
    assert name, f"{d.pod.name}: no {FUNCTION_ANNOTATION} annotation"
    fn = next((c for c in d.pod.spec.get("initContainers") or [] if c["name"] == name), None)
    assert fn is not None, f"{d.pod.name}: function {name} is not an init container"
    assert fn.get("restartPolicy") == "Always", f"{d.pod.name}: {name} is not a native sidecar"
    assert fn.get("startupProbe"), f"{d.pod.name}: {name} has no startup probe"
    return fn


def check_same_pod(d: Dispatcher) -> None:
    fn = function_container(d)
    url = d.setting("FUNCTION_URL")
    match = re.fullmatch(r"http://127\.0\.0\.1:(\d+)/", url)
    assert match, f"{d.pod.name}: FUNCTION_URL {url} is not the pod's loopback"
    ports = {p["containerPort"] for p in fn.get("ports") or []}
    port_env = env(fn).get("PORT")
    assert int(match.group(1)) in ports | ({int(port_env)} if port_env else set())
    assert int(d.setting("DISPATCHER_PORT")) not in ports


# ------------------------------------------------------------------ KEDA


def by_kind(docs: list[Doc], kind: str) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def check_trigger(trigger: Doc, d: Dispatcher, auths: dict[str, Doc]) -> None:
    where = d.pod.name
    assert trigger["type"] == "rabbitmq", where
    meta = trigger["metadata"]
    assert set(meta) <= RABBITMQ_METADATA_KEYS, f"{where}: {set(meta) - RABBITMQ_METADATA_KEYS}"
    assert meta["protocol"] == "http", where
    assert meta["mode"] == "QueueLength", where
    assert meta["activationValue"] == "0", where
    # A replica holds CONCURRENCY calls plus PREFETCH_BUFFER waiting messages (SPEC §7).
    held = int(d.setting("CONCURRENCY")) + int(d.setting("PREFETCH_BUFFER", "0"))
    assert meta["value"] == str(held), f"{where}: trigger value != CONCURRENCY + PREFETCH_BUFFER"
    assert meta["queueName"] == d.env["CONVEYOR_QUEUE"] + "-in", f"{where}: queue mismatch"
    assert "host" not in meta, f"{where}: credentials belong in a TriggerAuthentication"
    auth = auths[trigger["authenticationRef"]["name"]]
    refs = {r["parameter"]: r for r in auth["spec"]["secretTargetRef"]}
    assert refs["host"]["key"] == "management-url", where
    amqp = d.env["CONVEYOR_AMQP_URL"]
    if isinstance(amqp, dict):  # one secret holds both URLs of the broker
        assert refs["host"]["name"] == amqp["secretKeyRef"]["name"], where
    else:
        assert refs["host"]["name"] in EXTERNAL_SECRETS, where


def check_scaling(docs: list[Doc]) -> int:
    """Every dispatcher is scaled by exactly one KEDA object that agrees with it.
    Returns how many dispatchers were checked."""
    auths = by_kind(docs, "TriggerAuthentication")
    scaled_objects = by_kind(docs, "ScaledObject")
    ds = dispatchers(docs)
    for d in ds:
        check_dispatcher(d)
        if d.pod.owner["kind"] == "ScaledJob":
            assert d.setting("ONE_SHOT") == "1", f"{d.pod.name}: a Job's dispatcher is one-shot"
            assert d.pod.spec.get("restartPolicy") in {"Never", "OnFailure"}
            check_same_pod(d)
            triggers = d.pod.owner["spec"]["triggers"]
        else:
            assert d.setting("ONE_SHOT") == "0", d.pod.name
            name = d.pod.owner["metadata"]["name"]
            targeting = [
                so
                for so in scaled_objects.values()
                if so["spec"]["scaleTargetRef"]["name"] == name
                and so["spec"]["scaleTargetRef"].get("kind", "Deployment") == "Deployment"
            ]
            assert len(targeting) == 1, f"{d.pod.name}: {len(targeting)} ScaledObjects"
            assert targeting[0]["spec"]["minReplicaCount"] == 0
            assert "replicas" not in d.pod.owner["spec"], f"{d.pod.name}: KEDA owns replicas"
            triggers = targeting[0]["spec"]["triggers"]
        assert len(triggers) == 1, d.pod.name
        check_trigger(triggers[0], d, auths)
    return len(ds)


def check_knative(docs: list[Doc]) -> None:
    """The fields of a Knative Service we rely on (its CRD schema is loose)."""
    services = [d for d in docs if d["apiVersion"].startswith("serving.knative.dev/")]
    for ksvc in services:
        name = ksvc["metadata"]["name"]
        labels = ksvc["metadata"].get("labels") or {}
        assert labels.get("networking.knative.dev/visibility") == "cluster-local", name
        containers = ksvc["spec"]["template"]["spec"]["containers"]
        assert containers and all(c.get("image") for c in containers), name
        for c in containers:
            assert "PORT" not in env(c), f"{name}: Knative reserves PORT"
            for port in c.get("ports") or []:
                assert port.get("name", "http1") in {"http1", "h2c"}, name
        feeding = [
            d
            for d in dispatchers(docs)
            if d.setting("FUNCTION_URL") == f"http://{name}.$(POD_NAMESPACE).svc.cluster.local/"
        ]
        assert len(feeding) == 1, f"{name}: {len(feeding)} dispatchers post to it"
        names = [e["name"].removeprefix("CONVEYOR_") for e in feeding[0].container["env"]]
        assert names.index("POD_NAMESPACE") < names.index("FUNCTION_URL")
        assert feeding[0].env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}


def check_references(docs: list[Doc], secrets: set[str] = EXTERNAL_SECRETS) -> None:
    """ConfigMaps referenced exist in the render; Secrets are the documented ones."""
    configmaps = set(by_kind(docs, "ConfigMap"))
    for pod in pods(docs):
        for c in pod.containers():
            for source in c.get("envFrom") or []:
                if "configMapRef" in source:
                    assert source["configMapRef"]["name"] in configmaps, pod.name
                if "secretRef" in source:
                    assert source["secretRef"]["name"] in secrets, pod.name
            for value in env(c).values():
                if isinstance(value, dict) and "secretKeyRef" in value:
                    assert value["secretKeyRef"]["name"] in secrets, pod.name
                if isinstance(value, dict) and "configMapKeyRef" in value:
                    assert value["configMapKeyRef"]["name"] in configmaps, pod.name


def check_semantics(docs: list[Doc], secrets: set[str] = EXTERNAL_SECRETS) -> int:
    """The SPEC §8 rules for one rendered or injected set of objects; returns the
    number of dispatchers checked."""
    for pod in pods(docs):
        check_container_hardening(pod)
    count = check_scaling(docs)
    check_knative(docs)
    check_references(docs, secrets)
    return count
