"""deploy/ha: the clusters an operator runs (RabbitMQ Cluster Operator, CloudNativePG) and
Conveyor pointed at them. Every kustomization, this one included, is also rendered and
validated by test_manifests.py (strict core kinds, CRD schemas, SPEC §8); these are the rules
of the overlay itself, which a schema cannot say."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.k8s import checks
from tests.k8s.checks import Doc
from tests.k8s.conftest import REPO_ROOT

Render = Callable[[Path], list[Doc]]
HA = REPO_ROOT / "deploy" / "ha"
# amqp://$(USER):$(PASSWORD)@host:5672/ — the credentials come from variables set before it.
AMQP_URL = re.compile(r"amqp://\$\((\w+)\):\$\((\w+)\)@([\w.-]+):5672/")


@pytest.fixture
def docs(render: Render) -> list[Doc]:
    return render(HA)


def _one(docs: list[Doc], kind: str) -> Doc:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind} objects"
    return found[0]


def test_the_clusters_validate_against_the_operators_crds(docs: list[Doc], crd_dir: Path) -> None:
    for kind in ("RabbitmqCluster", "Cluster"):
        doc = _one(docs, kind)
        assert checks.is_custom(doc), f"{kind} would not be checked against its CRD"
        checks.validate_custom(doc, crd_dir)


def test_a_three_node_rabbitmq_cluster_with_partition_handling(docs: list[Doc]) -> None:
    rabbit = _one(docs, "RabbitmqCluster")
    spec = rabbit["spec"]
    assert spec["replicas"] == 3
    assert {"cpu", "memory"} <= set(spec["resources"]["requests"])
    config = spec["rabbitmq"]["additionalConfig"]
    # docs/scale.md: autoheal brought a thawed node back, pause_minority did not pause it.
    assert re.search(r"^cluster_partition_handling = (autoheal|pause_minority)$", config, re.M)
    assert re.search(r"^queue_leader_locator = balanced$", config, re.M)
    ticktime = re.search(r"\{net_ticktime, *(\d+)\}", spec["rabbitmq"]["advancedConfig"])
    assert ticktime and int(ticktime.group(1)) < 60, "net_ticktime: the default is 60 s"


def test_the_operators_own_their_budgets(docs: list[Doc]) -> None:
    """Both operators create a PodDisruptionBudget for their pods: a second one would only
    block node drains."""
    budgets = checks.by_kind(docs, "PodDisruptionBudget")
    assert set(budgets) == {"conveyor-gateway"}


def test_postgres_replicates_synchronously(docs: list[Doc]) -> None:
    spec = _one(docs, "Cluster")["spec"]
    assert spec["instances"] == 3
    synchronous = spec["postgresql"]["synchronous"]
    assert synchronous["method"] in {"any", "first"}
    # A standby confirms each commit, and writes go on with one standby down.
    assert 1 <= synchronous["number"] <= spec["instances"] - 2
    # "preferred" would let a commit through with no standby: the guarantee needs "required".
    assert synchronous["dataDurability"] == "required"
    # CloudNativePG's webhook refuses the legacy fields next to `synchronous`.
    assert not {"minSyncReplicas", "maxSyncReplicas"} & set(spec)
    assert spec["bootstrap"]["initdb"] == {"database": "conveyor", "owner": "conveyor"}
    assert spec["storage"]["size"]


def test_every_conveyor_container_uses_the_clusters(docs: list[Doc]) -> None:
    rabbit = _one(docs, "RabbitmqCluster")["metadata"]
    postgres = _one(docs, "Cluster")["metadata"]["name"]
    database: set[str] = set()
    broker: set[str] = set()
    for pod in checks.pods(docs):
        for container in pod.containers():
            env = checks.env(container)
            where = f"{pod.name} container {container['name']}"
            if "CONVEYOR_DATABASE_URL" in env:
                ref = env["CONVEYOR_DATABASE_URL"]["secretKeyRef"]
                assert ref == {"name": f"{postgres}-app", "key": "uri"}, where
                database.add(pod.name)
            if "CONVEYOR_AMQP_URL" in env:
                match = AMQP_URL.fullmatch(str(env["CONVEYOR_AMQP_URL"]))
                assert match, f"{where}: {env['CONVEYOR_AMQP_URL']}"
                user, password, host = match.groups()
                for variable, key in ((user, "username"), (password, "password")):
                    secret = {"name": f"{rabbit['name']}-default-user", "key": key}
                    assert env.get(variable) == {"secretKeyRef": secret}, (where, variable)
                # The Service's short name resolves in its own namespace only.
                assert host in {rabbit["name"], f"{rabbit['name']}.{rabbit['namespace']}.svc"}
                assert pod.owner["metadata"]["namespace"] == rabbit["namespace"], where
                # 0 would turn heartbeats off: a frozen node would go unnoticed.
                heartbeat = int(env.get("CONVEYOR_AMQP_HEARTBEAT", 0))
                assert 0 < heartbeat <= 15, f"{where}: CONVEYOR_AMQP_HEARTBEAT {heartbeat}"
                broker.add(pod.name)
    assert database == {
        "Deployment/conveyor-gateway",
        "Job/conveyor-db-upgrade",
        "CronJob/conveyor-purge",
    }
    dispatchers = {d.pod.name for d in checks.dispatchers(docs)}
    assert dispatchers and broker == {"Deployment/conveyor-gateway"} | dispatchers


def test_variables_are_defined_before_they_are_used(docs: list[Doc]) -> None:
    """Kubernetes expands $(NAME) only from variables listed earlier in the container."""
    for pod in checks.pods(docs):
        for container in pod.containers():
            defined: set[str] = set()
            for variable in container.get("env") or []:
                for used in re.findall(r"\$\((\w+)\)", str(variable.get("value") or "")):
                    assert used in defined, f"{pod.name}: {variable['name']} uses {used}"
                defined.add(variable["name"])
