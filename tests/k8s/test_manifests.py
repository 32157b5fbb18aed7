"""The kustomize bases in keda/ and knative/, rendered with `kubectl kustomize` and
checked offline: schemas (core and CRD) and the SPEC §8 rules."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from conveyor.inject import InjectOptions, inject_documents
from tests.k8s import checks
from tests.k8s.conftest import REPO_ROOT, kustomize_dirs

Render = Callable[[Path], list[dict]]
DIRS = kustomize_dirs()
IDS = [str(d.relative_to(REPO_ROOT)) for d in DIRS]


def test_every_expected_base_exists() -> None:
    assert set(IDS) >= {
        "keda",
        "keda/gateway",
        "keda/sleeper-sidecar",
        "keda/sleeper-job",
        "keda/sleeper-sidecar-pre-1.29",
        "knative",
        "knative/sleeper",
        "deploy/ha",
    }


@pytest.mark.parametrize("directory", DIRS, ids=IDS)
def test_core_kinds_validate(render: Render, directory: Path) -> None:
    docs = render(directory)
    assert docs, f"{directory} renders nothing"
    checks.validate_all(docs, crd_dir=None)


@pytest.mark.parametrize("directory", DIRS, ids=IDS)
def test_custom_kinds_validate_against_crds(render: Render, crd_dir: Path, directory: Path) -> None:
    docs = [d for d in render(directory) if checks.is_custom(d)]
    for doc in docs:
        checks.validate_custom(doc, crd_dir)


@pytest.mark.parametrize("directory", DIRS, ids=IDS)
def test_semantics(render: Render, directory: Path) -> None:
    checks.check_semantics(render(directory))


@pytest.mark.parametrize(
    ("directory", "kinds"),
    [
        ("keda/sleeper-sidecar", {"Deployment", "ScaledObject", "TriggerAuthentication"}),
        ("keda/sleeper-job", {"ScaledJob", "TriggerAuthentication"}),
        (
            "knative/sleeper",
            {"Service", "Deployment", "ScaledObject", "TriggerAuthentication", "NetworkPolicy"},
        ),
    ],
)
def test_each_mode_has_one_scaled_dispatcher(render: Render, directory: str, kinds: set) -> None:
    docs = render(REPO_ROOT / directory)
    assert {d["kind"] for d in docs} == kinds
    assert checks.check_scaling(docs) == 1


def test_sidecar_and_job_share_the_pod(render: Render) -> None:
    for directory in ("keda/sleeper-sidecar", "keda/sleeper-job"):
        (dispatcher,) = checks.dispatchers(render(REPO_ROOT / directory))
        checks.check_same_pod(dispatcher)


def test_job_mode_is_one_shot_and_drains(render: Render) -> None:
    (dispatcher,) = checks.dispatchers(render(REPO_ROOT / "keda/sleeper-job"))
    assert dispatcher.env["CONVEYOR_ONE_SHOT"] == "1"
    assert dispatcher.env["CONVEYOR_CONCURRENCY"] == "1"
    assert dispatcher.env["CONVEYOR_SHUTDOWN_MODE"] == "drain"
    grace = dispatcher.pod.spec["terminationGracePeriodSeconds"]
    assert grace > int(dispatcher.env["CONVEYOR_DRAIN_TIMEOUT"])


def test_knative_dispatcher_posts_to_the_cluster_local_service(render: Render) -> None:
    docs = render(REPO_ROOT / "knative/sleeper")
    (dispatcher,) = checks.dispatchers(docs)
    assert dispatcher.pod.owner["kind"] == "Deployment"
    assert (
        dispatcher.env["CONVEYOR_FUNCTION_URL"]
        == "http://sleeper.$(POD_NAMESPACE).svc.cluster.local/"
    )
    (ksvc,) = [d for d in docs if d["apiVersion"] == "serving.knative.dev/v1"]
    assert ksvc["spec"]["template"]["spec"]["timeoutSeconds"] >= 300  # sleeper's taskTimeout
    # Progress from the function's pods (SPEC §11.5), on a port only they may reach.
    port = int(dispatcher.env["CONVEYOR_PROGRESS_PORT"])
    assert {"name": "progress", "containerPort": port} in dispatcher.container["ports"]
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    labels = dispatcher.pod.template["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    progress_rules = [r for r in policy["spec"]["ingress"] if r.get("from")]
    assert progress_rules == [
        {
            "from": [{"podSelector": {"matchLabels": {"serving.knative.dev/service": "sleeper"}}}],
            "ports": [{"port": port, "protocol": "TCP"}],
        }
    ]


def test_top_level_bases_set_the_namespace(render: Render) -> None:
    for root in ("keda", "knative"):
        docs = render(REPO_ROOT / root)
        namespaces = [d for d in docs if d["kind"] == "Namespace"]
        assert [n["metadata"]["name"] for n in namespaces] == ["conveyor"]
        for doc in docs:
            if doc["kind"] != "Namespace":
                assert doc["metadata"].get("namespace") == "conveyor", doc["metadata"]["name"]
    assert (REPO_ROOT / "keda/namespace.yaml").read_text() == (
        REPO_ROOT / "knative/namespace.yaml"
    ).read_text()


def test_leaf_bases_are_namespace_free(render: Render) -> None:
    for directory in DIRS:
        if directory.name in {"keda", "knative", "ha"}:  # the top levels set the namespace
            continue
        for doc in render(directory):
            assert "namespace" not in doc["metadata"], f"{directory}: {doc['metadata']['name']}"


def test_pre_129_fallback_is_valid_on_old_clusters(render: Render) -> None:
    """Kubernetes 1.27's schema (strict) rejects the native sidecar and accepts the fallback."""
    import kubernetes_validate

    (native,) = [d for d in render(REPO_ROOT / "keda/sleeper-sidecar") if d["kind"] == "Deployment"]
    with pytest.raises(kubernetes_validate.ValidationError, match="restartPolicy"):
        kubernetes_validate.validate(native, "1.27", strict=True)
    docs = render(REPO_ROOT / "keda/sleeper-sidecar-pre-1.29")
    (fallback,) = [d for d in docs if d["kind"] == "Deployment"]
    kubernetes_validate.validate(fallback, "1.27", strict=True)
    pod = fallback["spec"]["template"]["spec"]
    assert "initContainers" not in pod
    assert [c["name"] for c in pod["containers"]] == ["conveyor-dispatcher", "sleeper"]
    (dispatcher,) = checks.dispatchers(docs)
    sleep = int(pod["containers"][1]["lifecycle"]["preStop"]["exec"]["command"][1])
    # The function outlives the drain, and the pod's grace period outlives both.
    assert (
        int(dispatcher.env["CONVEYOR_DRAIN_TIMEOUT"]) < sleep < pod["terminationGracePeriodSeconds"]
    )


def _gateway_docs(render: Render) -> dict[str, dict]:
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in render(REPO_ROOT / "keda/gateway")}


def test_gateway_deployment(render: Render) -> None:
    docs = _gateway_docs(render)
    deployment = docs["Deployment/conveyor-gateway"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["conveyor", "gateway", "--host", "0.0.0.0", "--port", "8000"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8000}
    # readiness leaves the broker out: its outage must not take every replica out of the
    # Service while each still accepts tasks into the outbox (a sweep: 15 s into one)
    probes = (("readinessProbe", "/readyz?exclude=broker"), ("livenessProbe", "/healthz"))
    for probe, path in probes:
        get = container[probe]["httpGet"]
        assert (get["path"], ports.get(get["port"], get["port"])) == (path, 8000)
    secrets = {
        e["name"]: e["valueFrom"]["secretKeyRef"]["name"]
        for e in container["env"]
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    assert secrets == dict.fromkeys(
        [
            "CONVEYOR_DATABASE_URL",
            "CONVEYOR_AMQP_URL",
            "CONVEYOR_CALLBACK_SIGNING_SECRET",
            "CONVEYOR_CALLBACK_PREVIOUS_SIGNING_SECRET",
        ],
        "conveyor-gateway",
    )
    # Only the secret being rotated out may be absent from the Secret.
    optional = {
        e["name"]
        for e in container["env"]
        if e.get("valueFrom", {}).get("secretKeyRef", {}).get("optional")
    }
    assert optional == {"CONVEYOR_CALLBACK_PREVIOUS_SIGNING_SECRET"}
    assert container["envFrom"] == [{"configMapRef": {"name": "conveyor-gateway"}}]
    assert "ConfigMap/conveyor-gateway" in docs
    assert pod["terminationGracePeriodSeconds"] < checks.DEPLOYMENT_GRACE_LIMIT


def test_gateway_service_and_budget_select_its_pods(render: Render) -> None:
    docs = _gateway_docs(render)
    labels = docs["Deployment/conveyor-gateway"]["spec"]["template"]["metadata"]["labels"]
    service = docs["Service/conveyor-gateway"]["spec"]
    assert service["selector"].items() <= labels.items()
    assert service["ports"][0]["targetPort"] == "http"
    budget = docs["PodDisruptionBudget/conveyor-gateway"]["spec"]
    assert budget["selector"]["matchLabels"].items() <= labels.items()
    replicas = docs["Deployment/conveyor-gateway"]["spec"]["replicas"]
    assert budget["minAvailable"] < replicas, "the budget would block every node drain"


def test_purge_cronjob_and_migration_job(render: Render) -> None:
    docs = _gateway_docs(render)
    cron = docs["CronJob/conveyor-purge"]["spec"]
    assert cron["concurrencyPolicy"] == "Forbid"
    (purge,) = cron["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    assert purge["command"] == ["conveyor", "purge"]
    job = docs["Job/conveyor-db-upgrade"]["spec"]
    (upgrade,) = job["template"]["spec"]["containers"]
    assert upgrade["command"] == ["conveyor", "db", "upgrade"]
    assert job["template"]["spec"]["restartPolicy"] == "Never"


@pytest.mark.parametrize(
    "directory", ["keda/sleeper-sidecar", "keda/sleeper-job", "knative/sleeper"]
)
def test_shipped_function_manifests_are_what_inject_writes(render: Render, directory: str) -> None:
    """The examples are fixed points of `conveyor inject`: injecting them changes nothing,
    so the docs, the examples and the command cannot drift apart."""
    docs = render(REPO_ROOT / directory)
    injected = inject_documents(docs, InjectOptions()).documents
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    assert sorted(injected, key=key) == sorted(docs, key=key)
