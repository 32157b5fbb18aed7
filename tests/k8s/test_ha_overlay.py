"""deploy/ha: the clusters an operator runs (RabbitMQ Cluster Operator, CloudNativePG) and
Conveyor pointed at them. Schemas are checked with the other bases (test_manifests.py);
these are the rules a schema cannot say."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.k8s import checks
from tests.k8s.conftest import REPO_ROOT

Render = Callable[[Path], list[dict]]
HA = REPO_ROOT / "deploy" / "ha"


@pytest.fixture
def docs(render: Render) -> list[dict[str, Any]]:
    return render(HA)


def _one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind]
    return found


def test_a_three_node_rabbitmq_cluster_with_partition_handling(docs: list[dict]) -> None:
    rabbit = _one(docs, "RabbitmqCluster")
    assert rabbit["spec"]["replicas"] == 3
    config = rabbit["spec"]["rabbitmq"]["additionalConfig"]
    assert re.search(r"^cluster_partition_handling = (autoheal|pause_minority)$", config, re.M)
    assert re.search(r"^queue_leader_locator = balanced$", config, re.M)
    assert "net_ticktime" in rabbit["spec"]["rabbitmq"]["advancedConfig"]


def test_postgres_replicates_synchronously(docs: list[dict]) -> None:
    cluster = _one(docs, "Cluster")
    assert cluster["spec"]["instances"] == 3
    synchronous = cluster["spec"]["postgresql"]["synchronous"]
    assert synchronous["number"] >= 1 and synchronous["dataDurability"] == "required"
    assert cluster["spec"]["bootstrap"]["initdb"]["database"] == "conveyor"


def test_every_conveyor_container_uses_the_clusters(docs: list[dict]) -> None:
    rabbit = _one(docs, "RabbitmqCluster")["metadata"]["name"]
    postgres = _one(docs, "Cluster")["metadata"]["name"]
    seen = {"CONVEYOR_DATABASE_URL": 0, "CONVEYOR_AMQP_URL": 0}
    for pod in checks.pods(docs):
        for container in pod.containers():
            env = checks.env(container)
            if "CONVEYOR_DATABASE_URL" in env:
                ref = env["CONVEYOR_DATABASE_URL"]["secretKeyRef"]
                assert ref == {"name": f"{postgres}-app", "key": "uri"}, pod.name
                seen["CONVEYOR_DATABASE_URL"] += 1
            if "CONVEYOR_AMQP_URL" in env:
                url = env["CONVEYOR_AMQP_URL"]
                assert isinstance(url, str) and f"@{rabbit}:5672/" in url, pod.name
                heartbeat = env.get("CONVEYOR_AMQP_HEARTBEAT", env.get("AMQP_HEARTBEAT"))
                assert heartbeat is not None and int(heartbeat) <= 15, pod.name
                seen["CONVEYOR_AMQP_URL"] += 1
    # gateway, migration Job, purge CronJob; gateway and the example dispatcher
    assert seen == {"CONVEYOR_DATABASE_URL": 3, "CONVEYOR_AMQP_URL": 2}


def test_variables_are_defined_before_they_are_used(docs: list[dict]) -> None:
    """Kubernetes expands $(NAME) only from variables listed earlier in the container."""
    for pod in checks.pods(docs):
        for container in pod.containers():
            defined: set[str] = set()
            for variable in container.get("env") or []:
                for used in re.findall(r"\$\((\w+)\)", str(variable.get("value") or "")):
                    assert used in defined, f"{pod.name}: {variable['name']} uses {used}"
                defined.add(variable["name"])
