"""The three modes (sidecar, job, knative) and the whole command, document by document."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from conveyor.inject.documents import (
    KEDA_API,
    LABEL_VALUE_LIMIT,
    NETWORK_API,
    Doc,
    InjectError,
    Key,
    classify,
    dump_documents,
    fitted,
    load_documents,
    name_of,
    object_key,
    workload_name,
)
from conveyor.inject.function import harden_function
from conveyor.inject.keda import (
    Companions,
    auth_name,
    dispatcher_labels,
    dispatcher_selector,
    drop_own_scaled_object,
    keda_objects,
    object_metadata,
    rabbitmq_trigger,
    refuse_other_scalers,
    scaled_name,
    trigger_authentication,
)
from conveyor.inject.pod import (
    KNATIVE_PROGRESS_PORT,
    check_settings,
    choose_dispatcher_port,
    disable_service_links,
    ensure_grace,
    find_dispatcher,
    pod_spec,
    upsert_dispatcher,
    wire_pod,
    written_grace,
)
from conveyor.inject.wiring import InjectOptions, Mode, check_options, resolve

KNATIVE_VISIBILITY_LABEL = "networking.knative.dev/visibility"


@dataclass
class InjectResult:
    documents: list[Doc]
    warnings: list[str] = field(default_factory=list)


def inject_yaml(text: str, options: InjectOptions | None = None) -> tuple[str, list[str]]:
    """The whole command: YAML text in, YAML text and warnings out."""
    result = inject_documents(load_documents(text), options or InjectOptions())
    return dump_documents(result.documents), result.warnings


def inject_documents(docs: list[Doc], options: InjectOptions) -> InjectResult:
    """Injects every workload of ``docs``; returns the new documents in order.

    KEDA objects and the knative dispatcher Deployment that an earlier injection
    produced are updated in place and emitted right after their workload; other
    supported objects pass through unchanged; anything else is an error.
    """
    check_options(options)
    docs = copy.deepcopy(docs)
    roles = [classify(doc) for doc in docs]
    if "workload" not in roles:
        raise InjectError("no Deployment, Job or Knative Service to inject in the input")
    companions = {
        object_key(d): d for d, role in zip(docs, roles, strict=True) if role == "companion"
    }
    claimed: set[Key] = set()
    warnings: list[str] = []
    groups = {
        index: _inject_workload(doc, options, Companions(companions, claimed), warnings)
        for index, (doc, role) in enumerate(zip(docs, roles, strict=True))
        if role == "workload"
    }
    result: list[Doc] = []
    for index, (doc, role) in enumerate(zip(docs, roles, strict=True)):
        if role == "workload":
            result.extend(groups[index])
        elif role == "passthrough" or object_key(doc) not in claimed:
            result.append(doc)
    _refuse_clashes(result)
    return InjectResult(result, warnings)


def _refuse_clashes(docs: list[Doc]) -> None:
    """Two objects of one API group, kind, namespace and name are one object once applied: the
    second replaces the first. A Deployment `x-dispatcher` beside Knative Service `x` (whose
    dispatcher inject names so) lost one of them, and re-injecting mistook one for the other."""
    seen: set[tuple[str, ...]] = set()
    for doc in docs:
        kind, namespace, name = object_key(doc)
        key = (doc["apiVersion"].rpartition("/")[0], kind, namespace, name)
        if name and key in seen:
            where = f" in namespace {namespace}" if namespace else ""
            raise InjectError(
                f"the output would hold two {kind} {name}{where}, and applying it keeps one: "
                "rename the workload (or object) whose name clashes"
            )
        seen.add(key)


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
    if doc["kind"] == "ScaledJob" and requested is Mode.SIDECAR:
        return Mode.SIDECAR  # and back: job mode's output in sidecar mode
    raise InjectError(
        f"--mode {requested} does not apply to {name_of(doc)}: a Deployment is injected "
        "in sidecar (or job) mode, a Job in job mode, a ScaledJob in job (or sidecar) mode, "
        "a Knative Service in knative mode"
    )


def _inject_workload(
    doc: Doc, options: InjectOptions, companions: Companions, warnings: list[str]
) -> list[Doc]:
    mode = _mode_for(doc, options.mode)
    name = workload_name(doc)
    try:
        if mode is Mode.KNATIVE:
            return _inject_knative(doc, name, options, companions, warnings)
        if mode is Mode.JOB:
            return _inject_job(doc, name, options, companions, warnings)
        return _inject_sidecar(doc, name, options, companions, warnings)
    except (AttributeError, KeyError, TypeError) as exc:
        # A field of the wrong type that the checks above did not anticipate.
        raise InjectError(
            f"{name_of(doc)} is malformed ({type(exc).__name__}: {exc}); "
            "`kubectl apply --dry-run=client -f` shows where"
        ) from None


def _inject_sidecar(
    doc: Doc, name: str, options: InjectOptions, companions: Companions, warnings: list[str]
) -> list[Doc]:
    if doc["kind"] == "ScaledJob":
        doc = _as_deployment(doc, name)
    owner = name_of(doc)
    spec = doc.setdefault("spec", {})
    wiring = wire_pod(spec.get("template"), options, Mode.SIDECAR, name, owner, warnings)
    spec.pop("replicas", None)  # KEDA owns the replica count: `kubectl apply` must not reset it
    namespace = doc["metadata"].get("namespace")
    return [doc, *keda_objects(name, name, namespace, wiring, companions)]


def _kept_metadata(doc: Doc) -> Doc:
    """What a workload's metadata keeps when it becomes another kind."""
    meta = doc.get("metadata") or {}
    keep = {"name", "namespace", "labels", "annotations"}
    return {k: copy.deepcopy(v) for k, v in meta.items() if k in keep}


def _as_deployment(doc: Doc, name: str) -> Doc:
    """A ScaledJob's pod template as a Deployment's (job mode's output in sidecar mode). Its
    pods restart (Always, the default); its selector is the template's labels."""
    target = (doc.get("spec") or {}).get("jobTargetRef")
    if not isinstance(target, dict):
        raise InjectError(f"{name_of(doc)} has no spec.jobTargetRef")
    template: Doc = copy.deepcopy(target.get("template") or {})
    pod_spec(template, name_of(doc)).pop("restartPolicy", None)
    labels = template.setdefault("metadata", {}).setdefault("labels", {})
    if not labels:
        labels["app.kubernetes.io/name"] = fitted(name, LABEL_VALUE_LIMIT)
    selector = {"matchLabels": dict(labels)}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _kept_metadata(doc),
        "spec": {"selector": selector, "template": template},
    }


# What the Job controller puts in a Job's pod template from the Job's uid and name: a Job
# exported from a cluster (`kubectl get job -o yaml`) carries them, and the API server refuses
# any other Job whose template has them, so none of KEDA's Jobs could be created.
JOB_CONTROLLER_LABELS = (
    "batch.kubernetes.io/controller-uid",
    "batch.kubernetes.io/job-name",
    "controller-uid",
    "job-name",
)


def _job_spec_from(doc: Doc) -> Doc:
    """A Job's spec (or a Deployment's pod template) as a ScaledJob's jobTargetRef: without
    what ties it to one Job (its selector, the controller's labels)."""
    spec = copy.deepcopy(doc.get("spec") or {})
    if doc["kind"] == "Deployment":
        spec = {"template": spec.get("template")}
    for key in ("selector", "manualSelector", "replicas", "strategy"):
        spec.pop(key, None)
    template = spec.get("template")
    labels = ((template or {}).get("metadata") or {}).get("labels")
    if isinstance(labels, dict):
        for key in JOB_CONTROLLER_LABELS:
            labels.pop(key, None)
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
    return {
        "apiVersion": KEDA_API,
        "kind": "ScaledJob",
        "metadata": _kept_metadata(doc),
        "spec": {"jobTargetRef": _job_spec_from(doc)},
    }


def _inject_job(
    doc: Doc, name: str, options: InjectOptions, companions: Companions, warnings: list[str]
) -> list[Doc]:
    owner = name_of(doc)
    scaled_job = _as_scaled_job(doc)
    # KEDA's limit on the name; the rest is named after it, as when the ScaledJob is re-injected.
    scaled = scaled_name(name)
    scaled_job["metadata"]["name"] = scaled
    spec = scaled_job.setdefault("spec", {})
    target = spec.get("jobTargetRef")
    if not isinstance(target, dict):
        raise InjectError(f"{owner} has no spec.jobTargetRef")
    wiring = wire_pod(target.get("template") or {}, options, Mode.JOB, name, owner, warnings)
    spec.setdefault("pollingInterval", 10)
    spec.setdefault("successfulJobsHistoryLimit", 3)
    spec.setdefault("failedJobsHistoryLimit", 5)
    spec.setdefault("maxReplicaCount", 10)
    # The management API counts unacked messages too, so the messages that running
    # Jobs hold are in the queue length: the default strategy (queue length minus
    # running Jobs) starts one Job per ready message.
    spec.setdefault("scalingStrategy", {"strategy": "default"})
    spec["triggers"] = [rabbitmq_trigger(wiring, auth_name(scaled))]
    namespace = (scaled_job.get("metadata") or {}).get("namespace")
    if doc["kind"] == "Deployment":  # the Deployment is gone: so is its autoscaler
        drop_own_scaled_object(companions, namespace, name)
        refuse_other_scalers(companions, namespace, name)
    auth = companions.take("TriggerAuthentication", namespace, auth_name(scaled))
    return [scaled_job, trigger_authentication(scaled, namespace, wiring, auth)]


def _knative_pod_spec(ksvc: Doc) -> Doc:
    return pod_spec((ksvc.get("spec") or {}).get("template"), name_of(ksvc))


def _dispatcher_deployment(name: str, namespace: str | None, existing: Doc | None) -> Doc:
    if existing is not None:
        return existing
    labels = dispatcher_labels(name, "dispatcher")
    selector = dispatcher_selector(name)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_metadata(f"{name}-dispatcher", namespace, labels),
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
    doc: Doc, name: str, options: InjectOptions, companions: Companions, warnings: list[str]
) -> list[Doc]:
    pod = _knative_pod_spec(doc)
    containers = [c for c in pod.get("containers") or [] if isinstance(c, dict)]
    if not containers:
        raise InjectError(f"{name_of(doc)} has no containers: nothing to send tasks to")
    # The serving container: the only one, or the one with ports (Knative allows one).
    serving = containers if len(containers) == 1 else [c for c in containers if c.get("ports")]
    for function in serving[:1]:
        harden_function(function, pod, None, knative=True)
    # Tasks come through the queue: the function needs no public route.
    doc["metadata"].setdefault("labels", {}).setdefault(KNATIVE_VISIBILITY_LABEL, "cluster-local")
    namespace = doc["metadata"].get("namespace")
    target = f"{name}-dispatcher"
    deployment = _dispatcher_deployment(
        name, namespace, companions.take("Deployment", namespace, target)
    )
    dpod = pod_spec(deployment["spec"].get("template"), name_of(deployment))
    existing = find_dispatcher(dpod)
    wiring = resolve(Mode.KNATIVE, name, options, existing)
    port = choose_dispatcher_port(dpod, existing, None)
    # Knative's cluster-local URL; POD_NAMESPACE keeps the manifest namespace-free.
    url = f"http://{name}.$(POD_NAMESPACE).svc.cluster.local{wiring.function_path}"
    written = written_grace(existing)
    check_settings(upsert_dispatcher(dpod, wiring, url, port), None, name_of(deployment))
    ensure_grace(dpod, wiring, name_of(deployment), warnings, written)
    disable_service_links(dpod, name_of(deployment), warnings)
    deployment["spec"].pop("replicas", None)
    policy = _progress_policy(name, namespace, companions.take("NetworkPolicy", namespace, target))
    return [doc, deployment, policy, *keda_objects(target, name, namespace, wiring, companions)]


def _progress_policy(name: str, namespace: str | None, existing: Doc | None) -> Doc:
    """The dispatcher's pods take traffic on the progress port only from the function's pods
    (SPEC §11.5; each report carries its attempt's token as well). The probes are exec probes
    inside the pod, or the kubelet's httpGet on a METRICS_PORT (traffic from the pod's own node,
    which CNIs let through); rules of the user's own (e.g. Prometheus on that port) are kept."""
    policy = existing or {
        "apiVersion": NETWORK_API,
        "kind": "NetworkPolicy",
        "metadata": object_metadata(
            f"{name}-dispatcher", namespace, dispatcher_labels(name, "dispatcher")
        ),
        "spec": {},
    }
    progress = {
        "from": [{"podSelector": {"matchLabels": {"serving.knative.dev/service": name}}}],
        "ports": [{"port": KNATIVE_PROGRESS_PORT, "protocol": "TCP"}],
    }
    spec = policy.setdefault("spec", {})
    others = [r for r in spec.get("ingress") or [] if r.get("ports") != progress["ports"]]
    spec["podSelector"] = {"matchLabels": dispatcher_selector(name)}
    spec["policyTypes"] = ["Ingress"]
    spec["ingress"] = [progress, *others]
    return policy
