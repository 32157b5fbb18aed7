"""The operator's CLI (SPEC §4), run as a real subprocess: `python -m conveyor admin ...`.

Services, clients and grants are data: what the CLI writes must show at once
on RabbitMQ (queues declared) and on a running gateway (who may submit).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiormq.exceptions
import bcrypt
import httpx
import psycopg
import pytest
import yaml

from conveyor import topology
from conveyor.events import MessageFormat
from conveyor.settings import GatewaySettings
from gateway.database_url import libpq
from gateway.store import WRITER_LOCK as _WRITER_LOCK
from tests.support.amqp import (
    declare_like_seed_worker,
    message_count,
    queues_of,
    remove_service,
    wait_for_queues,
)
from tests.support.gateway import GatewayProcess, Platform, Service, gateway_env, run_sync
from tests.support.processes import REPO, Processes, free_port


@pytest.fixture
def cli(database_url: str, amqp_url: str) -> Any:
    def run(
        *args: str, check: bool = True, amqp: str = amqp_url
    ) -> subprocess.CompletedProcess[str]:
        env = {
            **os.environ,
            "CONVEYOR_DATABASE_URL": database_url,
            "CONVEYOR_AMQP_URL": amqp,
            "CONVEYOR_LOG_FORMAT": "json",
        }
        done = subprocess.run(
            [sys.executable, "-m", "conveyor", "admin", *args],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if check:
            assert done.returncode == 0, f"{args}: {done.stdout}{done.stderr}"
        return done

    return run


@pytest.fixture
def names(platform: Platform, amqp_url: str) -> Iterator[list[str]]:
    """Service names a test creates through the CLI; removed with their queues afterwards."""
    created: list[str] = []
    yield created
    for name in created:
        remove_service(platform, amqp_url, Service(name, name))


def _unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def _write(tmp_path: Path, spec: dict[str, Any]) -> Path:
    path = tmp_path / f"platform-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def _post(gateway: GatewayProcess, service: str, auth: tuple[str, str]) -> httpx.Response:
    with gateway.http() as http:
        return http.post(gateway.tasks_url(service), json={"body": {"n": 1}}, auth=auth)


def _error_number(answer: httpx.Response) -> int | None:
    return answer.json().get("error", {}).get("number")


async def _declare(url: str, queue: str, arguments: dict[str, Any]) -> None:
    import aio_pika

    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        await channel.declare_queue(queue, durable=True, arguments=arguments)


def _assert_quorum_in_queue(amqp_url: str, queue_name: str) -> None:
    """`-in` accepts exactly the quorum declaration and refuses a plain one."""
    delivery_limit = GatewaySettings().delivery_limit
    spec = next(
        q
        for q in topology.service_queues(queue_name, MessageFormat.CLOUDEVENTS, delivery_limit)
        if q.name == topology.in_queue(queue_name)
    )
    assert spec.arguments["x-queue-type"] == "quorum"
    run_sync(_declare(amqp_url, spec.name, spec.arguments))
    with pytest.raises(aiormq.exceptions.ChannelPreconditionFailed):
        declare_like_seed_worker(amqp_url, spec.name)


# -- apply -----------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_apply_creates_declares_and_is_idempotent(
    cli: Any, tmp_path: Path, platform: Platform, amqp_url: str, names: list[str]
) -> None:
    service, legacy, client = _unique("adm"), _unique("adm-legacy"), _unique("adm-client")
    names += [service, legacy]
    spec = {
        "services": [
            {
                "name": service,
                "queueName": service,
                "capacity": 10,
                "jsonSchema": {"type": "object", "required": ["sleep"]},
                "messageFormat": "cloudevents",
                "taskTimeout": 60,
                "maxAttempts": 2,
                "retention": "3d",
            },
            {"name": legacy, "messageFormat": "legacy"},
        ],
        "clients": [
            {
                "id": client,
                "secret": "first-secret",
                "grants": [{"service": service, "capacity": 3}],
            }
        ],
    }
    path = _write(tmp_path, spec)

    first = cli("apply", "-f", str(path))

    assert first.stdout.splitlines() == [
        f"service {service}: created",
        f"service {legacy}: created",
        f"client {client}: created",
    ]
    for queue in queues_of(service) + queues_of(legacy):
        assert message_count(amqp_url, queue) == 0, queue
    _assert_quorum_in_queue(amqp_url, service)
    declare_like_seed_worker(amqp_url, topology.in_queue(legacy))  # the seed's worker is welcome
    stored = platform.sql(
        "SELECT capacity, task_timeout, max_attempts, retention_seconds, message_format"
        " FROM services WHERE name = %(n)s",
        {"n": service},
    )
    assert stored == [(10, 60, 2, 3 * 86400, "cloudevents")]
    grants = platform.sql(
        "SELECT service, capacity FROM authorizations WHERE client_id = %(c)s", {"c": client}
    )
    assert grants == [(service, 3)]

    again = cli("apply", "-f", str(path))

    lines = again.stdout.splitlines()
    assert len(lines) == 3 and all(line.endswith(": unchanged") for line in lines), lines


def test_unknown_key_is_refused_by_name(cli: Any, tmp_path: Path, platform: Platform) -> None:
    service = _unique("adm-typo")
    path = _write(tmp_path, {"services": [{"name": service, "queueNmae": "oops"}]})

    done = cli("apply", "-f", str(path), check=False)

    assert done.returncode != 0
    assert "queueNmae" in done.stderr
    assert "Traceback" not in done.stderr
    assert platform.sql("SELECT 1 FROM services WHERE name = %(n)s", {"n": service}) == []


@pytest.mark.timeout(90)
def test_apply_reports_operators_like_clients_and_keeps_them_apart(
    cli: Any, tmp_path: Path, platform: Platform, gateway: GatewayProcess
) -> None:
    operator, secret = _unique("adm-op"), "operator-secret"
    path = _write(tmp_path, {"operators": [{"id": operator, "secret": secret}]})

    assert cli("apply", "-f", str(path)).stdout.splitlines() == [f"operator {operator}: created"]
    assert cli("apply", "-f", str(path)).stdout.splitlines() == [f"operator {operator}: unchanged"]
    (stored,) = platform.sql(
        "SELECT secret_hash FROM operators WHERE operator_id = %(o)s", {"o": operator}
    )[0]
    assert bcrypt.checkpw(secret.encode(), stored.encode())
    assert platform.sql("SELECT 1 FROM clients WHERE client_id = %(o)s", {"o": operator}) == []
    assert operator in cli("list").stdout

    with gateway.http() as http:
        admin = http.get("/v1/admin/services", auth=(operator, secret))
        client_route = http.get("/v1/services/anything/tasks/x", auth=(operator, secret))
    assert admin.status_code == 200
    assert client_route.status_code == 403 and _error_number(client_route) == 403001

    changed = _write(tmp_path, {"operators": [{"id": operator, "secret": "another-secret"}]})
    assert cli("apply", "-f", str(changed)).stdout.splitlines() == [f"operator {operator}: updated"]


def test_an_operator_declared_twice_is_refused(cli: Any, tmp_path: Path) -> None:
    twice = {
        "operators": [{"id": "op-a", "secret": "12345678"}, {"id": "op-a", "secret": "87654321"}]
    }
    done = cli("apply", "-f", str(_write(tmp_path, twice)), check=False)
    assert done.returncode != 0
    assert "operator declared twice: op-a" in done.stderr


def _row(platform: Platform, table: str, column: str, ident: str) -> list[Any]:
    """The row of `ident` in clients or operators (fixed names), empty when there is none."""
    return platform.sql(f"SELECT 1 FROM {table} WHERE {column} = %(i)s", {"i": ident})


@pytest.mark.timeout(90)
def test_a_topology_rabbitmq_refuses_applies_nothing_of_the_file(
    cli: Any, tmp_path: Path, platform: Platform, amqp_url: str, names: list[str]
) -> None:
    """cloudevents -> legacy wants a classic `-out` where a quorum one exists: RabbitMQ refuses.

    The whole file is one transaction (gateway/admin.py): the refused service keeps its old
    row, and the file's other entries, a new service listed before it included, are not
    written, nor are that new service's queues declared.
    """
    service, added, client = _unique("adm-fmt"), _unique("adm-fmt-new"), _unique("adm-client")
    names += [service, added]
    cli("apply", "-f", str(_write(tmp_path, {"services": [{"name": service}]})))
    switched = {
        "services": [{"name": added}, {"name": service, "messageFormat": "legacy"}],
        "clients": [{"id": client, "secret": "client-secret", "grants": [{"service": added}]}],
    }

    done = cli("apply", "-f", str(_write(tmp_path, switched)), check=False)

    assert done.returncode == 1, done.stdout + done.stderr
    assert platform.sql(
        "SELECT message_format FROM services WHERE name = %(n)s", {"n": service}
    ) == [("cloudevents",)]
    assert platform.sql("SELECT 1 FROM services WHERE name = %(n)s", {"n": added}) == []
    assert _row(platform, "clients", "client_id", client) == []
    assert [message_count(amqp_url, q) for q in queues_of(added)] == [None, None, None]
    _assert_quorum_in_queue(amqp_url, service)
    assert "Traceback" not in done.stderr and done.stdout == ""
    assert f"service {service}" in done.stderr and "x-queue-type" in done.stderr
    assert "cannot change in place" in done.stderr and "nothing was applied" in done.stderr


@pytest.mark.timeout(90)
def test_a_service_whose_in_queue_an_older_version_declared_is_told_to_migrate(
    cli: Any, tmp_path: Path, platform: Platform, amqp_url: str, names: list[str]
) -> None:
    """-in from before at-least-once dead-lettering: apply names the command that moves it."""
    service = _unique("adm-older-in")
    names.append(service)
    limit = GatewaySettings().delivery_limit
    older = {
        spec.name: {
            k: v
            for k, v in spec.arguments.items()
            if k not in ("x-dead-letter-strategy", "x-overflow")
        }
        for spec in topology.service_queues(service, MessageFormat.CLOUDEVENTS, limit)
    }
    for queue, arguments in older.items():  # before the row: no gateway declares them first
        run_sync(_declare(amqp_url, queue, arguments))
    cli("apply", "-f", str(_write(tmp_path, {"services": [{"name": service}]})), "--no-declare")

    done = cli("apply", "-f", str(_write(tmp_path, {"services": [{"name": service}]})), check=False)

    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "x-dead-letter-strategy" in done.stderr
    assert "conveyor admin migrate-queues" in done.stderr and "--no-declare" in done.stderr


def test_a_refused_declaration_leaves_no_queue_it_made(
    cli: Any, tmp_path: Path, platform: Platform, amqp_url: str, names: list[str]
) -> None:
    """Someone else's `-in` refuses this version's arguments: `apply` said "nothing was
    applied", and the service's `-dlq`, declared before `-in`, stayed, belonging to no
    service (found by a black-box test). What the declaration made is deleted; what was
    there before is kept."""
    service = _unique("adm-taken-in")
    names.append(service)
    in_queue, out, dlq = queues_of(service)
    run_sync(_declare(amqp_url, in_queue, {"x-max-length": 7}))

    done = cli("apply", "-f", str(_write(tmp_path, {"services": [{"name": service}]})), check=False)

    assert done.returncode == 1 and "nothing was applied" in done.stderr, done.stderr
    assert platform.sql("SELECT 1 FROM services WHERE name = %(n)s", {"n": service}) == []
    assert [message_count(amqp_url, q) for q in (dlq, in_queue, out)] == [None, 0, None]


@pytest.mark.timeout(90)
def test_service_create_refused_by_rabbitmq_keeps_the_old_row(
    cli: Any, platform: Platform, names: list[str]
) -> None:
    service = _unique("adm-fmt-one")
    names.append(service)
    cli("service", "create", service)

    done = cli("service", "create", service, "--format", "legacy", check=False)

    assert done.returncode == 1
    assert platform.sql(
        "SELECT message_format FROM services WHERE name = %(n)s", {"n": service}
    ) == [("cloudevents",)]
    assert "Traceback" not in done.stderr
    assert f"service {service}" in done.stderr and "cannot change in place" in done.stderr


def test_apply_without_rabbitmq_applies_nothing_unless_told_not_to_declare(
    cli: Any, tmp_path: Path, platform: Platform, names: list[str]
) -> None:
    service = _unique("adm-nobroker")
    names.append(service)
    path = _write(tmp_path, {"services": [{"name": service}]})
    nowhere = f"amqp://guest:guest@127.0.0.1:{free_port()}/"

    done = cli("apply", "-f", str(path), check=False, amqp=nowhere)

    assert done.returncode == 1
    assert platform.sql("SELECT 1 FROM services WHERE name = %(n)s", {"n": service}) == []
    assert "Traceback" not in done.stderr
    assert "RabbitMQ" in done.stderr and "nothing was applied" in done.stderr
    skipped = cli("apply", "-f", str(path), "--no-declare", amqp=nowhere)
    assert skipped.stdout.splitlines() == [f"service {service}: created"]


# -- clients are never operators (SPEC §11.6) ----------------------------------------------


def test_one_id_in_clients_and_operators_is_refused(
    cli: Any, tmp_path: Path, platform: Platform, names: list[str]
) -> None:
    shared, service = _unique("adm-both"), _unique("adm-both-svc")
    names.append(service)
    both = {
        "services": [{"name": service}],
        "clients": [{"id": shared, "secret": "shared-secret", "grants": [{"service": service}]}],
        "operators": [{"id": shared, "secret": "shared-secret"}],
    }

    done = cli("apply", "-f", str(_write(tmp_path, both)), check=False)

    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert f"both a client and an operator: {shared}" in done.stderr
    assert _row(platform, "clients", "client_id", shared) == []
    assert _row(platform, "operators", "operator_id", shared) == []
    assert platform.sql("SELECT 1 FROM services WHERE name = %(n)s", {"n": service}) == []


def test_a_client_never_becomes_an_operator_nor_an_operator_a_client(
    cli: Any, tmp_path: Path, platform: Platform
) -> None:
    client, operator = _unique("adm-is-client"), _unique("adm-is-op")
    cli(
        "apply",
        "-f",
        str(
            _write(
                tmp_path,
                {
                    "clients": [{"id": client, "secret": "client-secret"}],
                    "operators": [{"id": operator, "secret": "operator-secret"}],
                },
            )
        ),
    )

    as_operator = cli(
        "apply",
        "-f",
        str(_write(tmp_path, {"operators": [{"id": client, "secret": "client-secret"}]})),
        check=False,
    )
    as_client = cli(
        "apply",
        "-f",
        str(_write(tmp_path, {"clients": [{"id": operator, "secret": "operator-secret"}]})),
        check=False,
    )
    created = cli("client", "create", operator, check=False)

    assert as_operator.returncode == 1 and f"{client} is a client" in as_operator.stderr
    assert as_client.returncode == 1 and f"{operator} is an operator" in as_client.stderr
    assert created.returncode == 1 and f"{operator} is an operator" in created.stderr
    for done in (as_operator, as_client, created):
        assert "Traceback" not in done.stderr and done.stdout == ""
    assert _row(platform, "operators", "operator_id", client) == []
    assert _row(platform, "clients", "client_id", operator) == []


@pytest.mark.timeout(90)
def test_operator_delete_removes_an_operator_the_cli_made(
    cli: Any,
    tmp_path: Path,
    platform: Platform,
    procs: Processes,
    database_url: str,
    amqp_url: str,
) -> None:
    """Found by a black-box probe: no supported command removed an operator (`client delete`
    said unknown client, `apply` leaves entries missing from the file alone), only SQL did.
    `operator delete` does; the gateway refuses the operator with the next request, though
    it had verified and cached its secret (the credentials' notification, migration 0016),
    with the one refusal every credential gets (403001)."""
    operator, secret = _unique("adm-op-del"), "operator-secret"
    client = _unique("adm-op-del-client")
    cli(
        "apply",
        "-f",
        str(
            _write(
                tmp_path,
                {
                    "clients": [{"id": client, "secret": "client-secret"}],
                    "operators": [{"id": operator, "secret": secret}],
                },
            )
        ),
    )
    # Verified secrets kept far longer than this test: the refusal cannot be their expiry.
    gateway = GatewayProcess(
        procs, gateway_env(database_url, amqp_url, CONVEYOR_AUTH_CACHE_TTL="600")
    )
    with gateway.http() as http:
        assert http.get("/v1/admin/services", auth=(operator, secret)).status_code == 200
    listed = [json.loads(line) for line in cli("operator", "list").stdout.splitlines()]
    assert {"operator_id": operator} in listed

    deleted = cli("operator", "delete", operator)

    assert deleted.stdout.splitlines() == [f"operator {operator}: deleted"]
    assert _row(platform, "operators", "operator_id", operator) == []
    assert operator not in cli("operator", "list").stdout
    assert operator not in cli("list").stdout
    with gateway.http() as http:
        refused = http.get("/v1/admin/services", auth=(operator, secret))
    assert (refused.status_code, _error_number(refused)) == (403, 403001)

    again = cli("operator", "delete", operator, check=False)
    a_client = cli("operator", "delete", client, check=False)  # kinds stay apart (SPEC 11.6)
    for done, ident in ((again, operator), (a_client, client)):
        assert done.returncode == 1, done.stdout + done.stderr
        assert done.stderr.strip() == f"error: unknown operator '{ident}'"
        assert done.stdout == ""
    assert _row(platform, "clients", "client_id", client) != []


# -- a platform file's errors never show a secret ------------------------------------------

_SECRET = "TopSecretValue-123"


@pytest.mark.parametrize(
    "secret_line",
    [
        f"secret: {_SECRET}: oops",  # PyYAML's snippet showed this line
        f'secret: "{_SECRET}',  # unterminated: the problem is found at the end of the file
        f"secret: *{_SECRET}",  # an undefined alias, named in PyYAML's problem text
        f"secret: !{_SECRET} x",  # an unknown tag, named likewise
        f"secret: !!int {_SECRET}",  # a constructor's own error, not a YAMLError
        f"secret: !!bool {_SECRET}",
    ],
)
def test_invalid_yaml_names_the_line_never_the_secret(
    cli: Any, tmp_path: Path, secret_line: str
) -> None:
    """Found by a black-box probe: a YAML error printed PyYAML's snippet of the file, the
    line with a client's plaintext secret included, to stderr (CI and Job logs)."""
    path = tmp_path / "platform.yaml"
    path.write_text(f"clients:\n  - id: demo\n    {secret_line}\n    grants: []\n")

    done = cli("apply", "-f", str(path), check=False)

    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.startswith("error: not valid YAML"), done.stderr
    assert "line 3, column" in done.stderr, done.stderr
    assert _SECRET not in done.stdout + done.stderr, done.stderr
    assert _SECRET.lower() not in (done.stdout + done.stderr).lower(), done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("client", "expected"),
    [
        ({"secret": f"{_SECRET}-{'x' * 80}"}, "clients.0: secret is longer than bcrypt's 72"),
        ({"secret": [_SECRET]}, "clients.0.secret: Input should be a valid string"),
        ({"secret": _SECRET, "grant": []}, "unknown key 'grant' at clients.0.grant"),
        ({"secretHash": _SECRET}, "clients.0: secretHash must be a bcrypt hash"),
        ({"secret": _SECRET, "secretHash": _SECRET}, "give exactly one of secret or secretHash"),
        ({"secret": _SECRET, "grants": _SECRET}, "clients.0.grants: Input should be a valid list"),
    ],
)
def test_a_refused_platform_file_never_shows_a_secret(
    cli: Any, tmp_path: Path, client: dict[str, Any], expected: str
) -> None:
    """pydantic's own rendering of an error carries `input_value=...`: the file's errors are
    told in its terms, without the values."""
    path = _write(tmp_path, {"clients": [{"id": "demo", **client}]})

    done = cli("apply", "-f", str(path), check=False)

    assert done.returncode == 1, done.stdout + done.stderr
    assert expected in done.stderr, done.stderr
    assert _SECRET not in done.stdout + done.stderr, done.stderr
    assert "input_value" not in done.stderr and "Traceback" not in done.stderr


# -- clients and grants ------------------------------------------------------------------


def _created_secret(output: str) -> str:
    match = re.search(r"^clientSecret: (\S+)$", output, re.M)
    assert match, output
    return match.group(1)


@pytest.mark.timeout(90)
def test_client_create_grant_list_revoke(
    cli: Any,
    gateway: GatewayProcess,
    platform: Platform,
    amqp_url: str,
    names: list[str],
) -> None:
    service, client = _unique("adm-svc"), _unique("adm-client")
    names.append(service)
    cli("service", "create", service)
    wait_for_queues(amqp_url, queues_of(service), timeout=2)

    secret = _created_secret(cli("client", "create", client).stdout)

    (stored,) = platform.sql(
        "SELECT secret_hash FROM clients WHERE client_id = %(c)s", {"c": client}
    )[0]
    assert stored.startswith("$2") and secret not in stored
    assert bcrypt.checkpw(secret.encode(), stored.encode())
    again = cli("client", "create", client, check=False)
    assert again.returncode != 0 and "already exists" in again.stderr

    not_yet = _post(gateway, service, (client, secret))
    assert (not_yet.status_code, _error_number(not_yet)) == (403, 403001)

    cli("grant", client, service, "--capacity", "2")
    assert _post(gateway, service, (client, secret)).status_code == 201
    listed = json.loads(cli("list").stdout)["clients"]
    assert {"client_id": client, "grants": [{"service": service, "capacity": 2}]} in listed

    cli("revoke", client, service)
    revoked = _post(gateway, service, (client, secret))  # the grant cache is emptied by NOTIFY
    assert (revoked.status_code, _error_number(revoked)) == (403, 403001)
    twice = cli("revoke", client, service, check=False)
    assert twice.returncode != 0 and "no grant" in twice.stderr


@pytest.mark.timeout(90)
def test_changed_secret_stops_the_old_one_at_once(
    cli: Any, tmp_path: Path, gateway: GatewayProcess, amqp_url: str, names: list[str]
) -> None:
    service, client = _unique("adm-rot"), _unique("adm-client")
    names.append(service)

    def platform_file(secret: str) -> Path:
        return _write(
            tmp_path,
            {
                "services": [{"name": service}],
                "clients": [{"id": client, "secret": secret, "grants": [{"service": service}]}],
            },
        )

    cli("apply", "-f", str(platform_file("old-secret-1")))
    wait_for_queues(amqp_url, queues_of(service), timeout=2)
    assert _post(gateway, service, (client, "old-secret-1")).status_code == 201
    # the old secret's verification is cached from here: apply's change makes it forgotten

    rotated = cli("apply", "-f", str(platform_file("new-secret-2")))
    assert f"client {client}: updated" in rotated.stdout.splitlines()

    old = _post(gateway, service, (client, "old-secret-1"))
    assert (old.status_code, _error_number(old)) == (403, 403001)
    assert _post(gateway, service, (client, "new-secret-2")).status_code == 201


def test_a_submission_committing_while_its_service_is_deleted_is_ended_too(
    gateway: GatewayProcess, platform: Platform, cli: Any, amqp_url: str
) -> None:
    """Found by a sweep: tasks answered 201 while `service delete` ran stayed PENDING for a
    day (their results on an -out nobody consumes), their polls 404001: a submission whose
    insert committed after the delete's sweep was in no one's list. The delete now waits for
    the service's writer lock, which every submission holds until it commits."""
    svc = platform.service()
    try:
        with psycopg.connect(libpq(platform.database_url)) as intake:  # a submission under way
            intake.execute(_WRITER_LOCK, {"service": svc.name})
            task_id = uuid.uuid4()
            intake.execute(
                "INSERT INTO tasks (task_id, client_id, service, request, publish_at)"
                " VALUES (%(t)s, %(c)s, %(s)s, '{}', now() + interval '1 hour')",
                {"t": task_id, "c": svc.clients[0].client_id, "s": svc.name},
            )
            deleting = threading.Thread(target=cli, args=("service", "delete", svc.name))
            deleting.start()
            time.sleep(1.5)  # the delete waits for the submission, which commits now
        deleting.join(timeout=60)
        assert platform.sql(
            "SELECT status, error_message FROM tasks WHERE task_id = %(t)s", {"t": task_id}
        ) == [("FAILURE", "Service deleted.")]
    finally:
        remove_service(platform, amqp_url, svc)


def test_a_submission_waiting_while_its_service_is_deleted_is_refused(
    gateway: GatewayProcess, platform: Platform, amqp_url: str
) -> None:
    """The other order of the same race: submissions that passed their checks while the
    delete ran, and wait for the service's writer lock the delete holds, are answered 404001
    once the delete commits, and leave no task behind. (Those queued behind the first are
    written together: such a group refused whole once left its requests unanswered.)"""
    svc = platform.service()
    client = svc.clients[0]
    answers: list[httpx.Response] = []

    def submit() -> None:
        answers.append(_post(gateway, svc.name, (client.client_id, client.secret)))

    try:
        with psycopg.connect(libpq(platform.database_url)) as deleting:  # a delete under way
            deleting.execute(_WRITER_LOCK, {"service": svc.name})
            deleting.execute("DELETE FROM services WHERE name = %(s)s", {"s": svc.name})
            submitting = [threading.Thread(target=submit) for _ in range(4)]
            for thread in submitting:
                thread.start()
            time.sleep(1.5)  # the submissions wait for the delete, which commits now
        for thread in submitting:
            thread.join(timeout=30)
        assert [(a.status_code, _error_number(a)) for a in answers] == [(404, 404001)] * 4
        assert platform.sql(
            "SELECT count(*) FROM tasks WHERE service = %(s)s", {"s": svc.name}
        ) == [(0,)]
    finally:
        remove_service(platform, amqp_url, svc)


def test_deleting_a_service_ends_its_unfinished_tasks_at_once(
    gateway: GatewayProcess, platform: Platform, cli: Any, amqp_url: str
) -> None:
    """Found by a sweep: after `service delete` nobody consumes the service's results, so a
    task running then failed later with "No result from the worker", and one PENDING stayed
    so for the whole PENDING_TTL (a day), or ran without its result ever being recorded.
    Every unfinished task now ends FAILURE "Service deleted." in the delete's own
    transaction, its callback due; a result that comes later is ignored (terminal wins)."""
    svc = platform.service()
    try:
        with gateway.http(svc.clients[0]) as http:
            hook = {"type": "http", "url": "http://localhost:9/hook"}
            ids = [
                http.post(gateway.tasks_url(svc.name), json=body).json()["data"]["taskId"]
                for body in ({"body": {}, "callback": hook}, {"body": {}}, {"body": {}})
            ]
        waiting, running, done = ids
        platform.sql(
            "UPDATE tasks SET status = 'IN_PROGRESS', start_date = now(), attempt_id = 'a1',"
            " attempts = 1 WHERE task_id = %(t)s",
            {"t": running},
        )
        platform.sql(
            "INSERT INTO task_attempts (task_id, attempt_id, start_date)"
            " VALUES (%(t)s, 'a1', now())",
            {"t": running},
        )
        platform.sql(
            "UPDATE tasks SET status = 'SUCCESS', start_date = now(), end_date = now(),"
            " response = '1' WHERE task_id = %(t)s",
            {"t": done},
        )

        cli("service", "delete", svc.name)

        rows = {
            str(r[0]): r[1:]
            for r in platform.sql(
                "SELECT task_id, status, error_message, start_date IS NOT NULL,"
                " end_date IS NOT NULL, notification_status IS NOT NULL, publish_at IS NULL"
                " FROM tasks WHERE task_id = ANY(%(ids)s::uuid[])",
                {"ids": ids},
            )
        }
        assert rows[waiting] == ("FAILURE", "Service deleted.", False, True, True, True)
        assert rows[running] == ("FAILURE", "Service deleted.", True, True, False, True)
        assert rows[done][:2] == ("SUCCESS", None)
        assert platform.sql(
            "SELECT outcome, end_date IS NOT NULL FROM task_attempts WHERE task_id = %(t)s",
            {"t": running},
        ) == [("interrupted", True)]
    finally:
        remove_service(platform, amqp_url, svc)


# -- found by a black-box tester: updates, ids and ranges ----------------------------------


def _service_row(platform: Platform, name: str) -> list[Any]:
    return platform.sql(
        "SELECT queue_name, capacity, json_schema, message_format, task_timeout, max_attempts,"
        " retention_seconds FROM services WHERE name = %(n)s",
        {"n": name},
    )


@pytest.mark.timeout(90)
def test_service_create_on_an_existing_service_changes_only_the_options_given(
    cli: Any, tmp_path: Path, platform: Platform, amqp_url: str
) -> None:
    """`service create NAME --capacity 5` on an applied service reset every other setting to
    its default: its queue moved to NAME, its schema went, timeout 300, attempts 3."""
    service, queue = _unique("adm-upd"), _unique("adm-upd-q")
    schema = {"type": "object", "required": ["n"]}
    applied = {
        "name": service,
        "queueName": queue,
        "capacity": 50,
        "jsonSchema": schema,
        "taskTimeout": 60,
        "maxAttempts": 5,
        "retention": "1d",
    }
    try:
        cli("apply", "-f", str(_write(tmp_path, {"services": [applied]})))

        done = cli("service", "create", service, "--capacity", "5")

        assert done.stdout.splitlines() == [f"service {service}: updated"]
        assert _service_row(platform, service) == [(queue, 5, schema, "cloudevents", 60, 5, 86400)]
        cli("service", "create", service, "--timeout", "90", "--retention", "2d")
        assert _service_row(platform, service) == [
            (queue, 5, schema, "cloudevents", 90, 5, 2 * 86400)
        ]
        cli("service", "create", service, "--unlimited", "--no-schema")
        assert _service_row(platform, service) == [
            (queue, None, None, "cloudevents", 90, 5, 2 * 86400)
        ]
        again = cli("service", "create", service)
        assert again.stdout.splitlines() == [f"service {service}: unchanged"]
        both = cli("service", "create", service, "--capacity", "1", "--unlimited", check=False)
        assert both.returncode == 1 and "Traceback" not in both.stderr, both.stderr
        assert _service_row(platform, service)[0][1] is None
    finally:
        remove_service(platform, amqp_url, Service(service, queue))


@pytest.mark.timeout(90)
def test_grant_without_capacity_keeps_an_existing_grants_capacity(
    cli: Any, platform: Platform, names: list[str]
) -> None:
    """`grant C S` without --capacity on a grant of capacity 2 made it unlimited (NULL)."""
    service, client = _unique("adm-grant"), _unique("adm-grant-c")
    names.append(service)
    cli("service", "create", service)
    cli("client", "create", client)

    def capacity() -> list[Any]:
        return platform.sql(
            "SELECT capacity FROM authorizations WHERE client_id = %(c)s", {"c": client}
        )

    cli("grant", client, service, "--capacity", "2")
    kept = cli("grant", client, service)
    assert capacity() == [(2,)]
    assert kept.stdout.splitlines() == [f"granted {service} to {client} (capacity 2)"]
    listed = json.loads(cli("list").stdout)
    (entry,) = [c for c in listed["clients"] if c["client_id"] == client]
    assert entry["grants"] == [{"service": service, "capacity": 2}]
    (line,) = [json.loads(x) for x in cli("client", "list").stdout.splitlines() if client in x]
    assert line["grants"] == [{"service": service, "capacity": 2}]

    lifted = cli("grant", client, service, "--unlimited")
    assert capacity() == [(None,)]
    assert lifted.stdout.splitlines() == [f"granted {service} to {client} (unlimited)"]
    both = cli("grant", client, service, "--capacity", "3", "--unlimited", check=False)
    assert both.returncode == 1 and "Traceback" not in both.stderr, both.stderr
    assert capacity() == [(None,)]


_BAD_IDS = ["", "a:b", "a\nb", "a b", "--x", "x" * 100_000]


@pytest.mark.parametrize(
    "bad", _BAD_IDS, ids=["empty", "colon", "newline", "space", "dash", "long"]
)
def test_the_cli_refuses_the_ids_a_platform_file_refuses(
    cli: Any, platform: Platform, bad: str
) -> None:
    """`client create` took any id ('' or 'a:b', which can never log in: Basic auth splits at
    the first colon); every command now holds ids to the platform file's rule."""
    service, client = _unique("adm-ids"), _unique("adm-ids-c")
    cli("client", "create", client)
    for args in (
        ("client", "create", "--", bad),
        ("grant", "--", bad, service),
        ("grant", "--", client, bad),
        ("service", "create", "--", bad),
    ):
        done = cli(*args, check=False)
        assert done.returncode == 1, (args[:2], done.stdout, done.stderr)
        assert done.stdout == "" and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "use 1 to 100 letters, digits" in done.stderr, done.stderr
        assert len(done.stderr) < 300, done.stderr
    assert _row(platform, "clients", "client_id", bad) == []
    assert platform.sql("SELECT 1 FROM services WHERE name = %(n)s", {"n": bad}) == []


@pytest.mark.timeout(90)
def test_a_deleted_clients_id_is_not_given_to_a_new_client_while_its_tasks_remain(
    cli: Any, tmp_path: Path, platform: Platform, gateway: GatewayProcess
) -> None:
    """A new client of a deleted client's id read its tasks and shared its Idempotency-Keys."""
    client = _unique("adm-reuse")
    cli("client", "create", client)
    task_id = uuid.uuid4()
    platform.sql(
        "INSERT INTO tasks (task_id, client_id, service, request, status, response, end_date)"
        " VALUES (%(t)s, %(c)s, 'gone', '{}', 'SUCCESS', '{\"private\": 1}', now())",
        {"t": task_id, "c": client},
    )
    cli("client", "delete", client)

    created = cli("client", "create", client, check=False)
    applied = cli(
        "apply",
        "-f",
        str(_write(tmp_path, {"clients": [{"id": client, "secret": "new-owner-secret"}]})),
        check=False,
    )

    for done in (created, applied):
        assert done.returncode == 1, done.stdout + done.stderr
        assert done.stdout == "" and "Traceback" not in done.stderr
        assert f"{client}" in done.stderr and "tasks" in done.stderr, done.stderr
        assert "conveyor purge" in done.stderr, done.stderr
    assert _row(platform, "clients", "client_id", client) == []

    platform.sql("DELETE FROM tasks WHERE task_id = %(t)s", {"t": task_id})
    assert "clientSecret" in cli("client", "create", client).stdout


_HUGE = "99999999999999"


@pytest.mark.parametrize(
    ("entry", "field"),
    [
        ({"services": [{"name": "adm-huge", "capacity": int(_HUGE)}]}, "services.0.capacity"),
        ({"services": [{"name": "adm-huge", "taskTimeout": int(_HUGE)}]}, "services.0.taskTimeout"),
        ({"services": [{"name": "adm-huge", "retention": f"{_HUGE}d"}]}, "services.0.retention"),
        (
            {
                "services": [{"name": "adm-huge"}],
                "clients": [
                    {
                        "id": "adm-huge-c",
                        "secret": "huge-secret",
                        "grants": [{"service": "adm-huge", "capacity": int(_HUGE)}],
                    }
                ],
            },
            "clients.0.grants.0.capacity",
        ),
    ],
)
def test_a_number_beyond_its_column_is_refused_by_field_in_a_platform_file(
    cli: Any, tmp_path: Path, platform: Platform, entry: dict[str, Any], field: str
) -> None:
    done = cli("apply", "-f", str(_write(tmp_path, entry)), check=False)

    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.startswith(f"error: {field}: "), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert platform.sql("SELECT 1 FROM services WHERE name = 'adm-huge'") == []


def test_a_number_beyond_its_column_is_refused_by_field_on_the_command_line(
    cli: Any, platform: Platform, names: list[str]
) -> None:
    service, client = _unique("adm-huge"), _unique("adm-huge-c")
    names.append(service)
    cli("service", "create", service)
    cli("client", "create", client)
    for args, field in (
        (("service", "create", service, "--capacity", "9" * 20), "capacity"),
        (("service", "create", service, "--timeout", _HUGE), "taskTimeout"),
        (("grant", client, service, "--capacity", _HUGE), "capacity"),
    ):
        done = cli(*args, check=False)
        assert done.returncode == 1, done.stdout + done.stderr
        assert done.stderr.startswith(f"error: {field}: "), done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert _service_row(platform, service)[0][1] is None
    assert platform.sql("SELECT 1 FROM authorizations WHERE client_id = %(c)s", {"c": client}) == []


def test_a_key_given_twice_in_one_mapping_is_refused_by_name_and_line(
    cli: Any, tmp_path: Path, platform: Platform
) -> None:
    """PyYAML keeps the last of two equal keys: `name:` twice renamed the entry silently."""
    first, second = _unique("adm-dup"), _unique("adm-dup")
    path = tmp_path / "platform.yaml"
    path.write_text(f"services:\n  - name: {first}\n    capacity: 2\n    name: {second}\n")

    done = cli("apply", "-f", str(path), check=False)

    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.startswith("error: not valid YAML"), done.stderr
    assert "key name given twice" in done.stderr and "line 4" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert (
        platform.sql(
            "SELECT 1 FROM services WHERE name IN (%(a)s, %(b)s)", {"a": first, "b": second}
        )
        == []
    )


def test_a_merge_key_may_still_be_overridden(
    cli: Any, tmp_path: Path, platform: Platform, names: list[str]
) -> None:
    """YAML's merge keys (`<<: *defaults`) give values a mapping's own keys override."""
    service = _unique("adm-merge")
    names.extend([service, f"{service}-a"])  # the gateway declares their queues: removed too
    path = tmp_path / "platform.yaml"
    path.write_text(
        f"services:\n  - &d {{name: {service}-a, capacity: 2}}\n  - <<: *d\n    name: {service}\n"
    )
    done = cli("apply", "-f", str(path), "--no-declare", check=False)
    assert done.returncode == 0, done.stderr
    assert platform.sql("SELECT capacity FROM services WHERE name = %(n)s", {"n": service}) == [
        (2,)
    ]


@pytest.mark.parametrize(
    ("secret", "accepted"), [("éééé", True), ("ééé", False), ("1234567", False)]
)
def test_a_secrets_minimum_is_counted_in_bytes_as_documented(
    cli: Any, tmp_path: Path, platform: Platform, secret: str, accepted: bool
) -> None:
    """docs/operations.md: a secret is 8 to 72 bytes; "éééé" (8 bytes) was refused."""
    operator = _unique("adm-bytes")
    path = _write(tmp_path, {"operators": [{"id": operator, "secret": secret}]})

    done = cli("apply", "-f", str(path), check=False)

    if accepted:
        assert done.stdout.splitlines() == [f"operator {operator}: created"], done.stderr
    else:
        assert done.returncode == 1 and "operators.0: secret is shorter than 8 bytes" in (
            done.stderr
        ), done.stderr
        assert _row(platform, "operators", "operator_id", operator) == []
    platform.sql("DELETE FROM operators WHERE operator_id = %(o)s", {"o": operator})


@pytest.mark.timeout(90)
def test_a_queue_name_another_service_has_is_refused(
    cli: Any, tmp_path: Path, platform: Platform, amqp_url: str
) -> None:
    """Found by a black-box test: two services could share one queueName (by `apply`, or
    `service create --queue` naming another service's live queue): one's tasks then ran on the
    other's function. A queue name belongs to one service; the file or command that would give
    it to a second one is refused whole, and the first keeps it."""
    first, second, queue = _unique("adm-q1"), _unique("adm-q2"), _unique("adm-shared")
    try:
        cli(
            "apply",
            "-f",
            str(_write(tmp_path, {"services": [{"name": first, "queueName": queue}]})),
        )
        taken = cli("service", "create", second, "--queue", queue, check=False)
        assert taken.returncode == 1 and "Traceback" not in taken.stderr, taken.stderr
        assert f"queueName {queue} is service {first}'s" in taken.stderr
        both = {"services": [{"name": second, "queueName": queue}]}
        refused = cli("apply", "-f", str(_write(tmp_path, both)), check=False)
        assert refused.returncode == 1 and f"is service {first}'s" in refused.stderr
        assert platform.sql("SELECT name FROM services WHERE name = %(n)s", {"n": second}) == []
        # A service may take a name back that it had, and the first may move and free it.
        cli("service", "create", first, "--queue", queue + "-moved")
        cli("service", "create", first, "--queue", queue)
    finally:
        remove_service(platform, amqp_url, Service(first, queue))
        remove_service(platform, amqp_url, Service(first, queue + "-moved"))
