"""CONVEYOR_DATABASE_URL naming several hosts in libpq's way (SPEC §11.7): every command
honours the list, and the first host being down is not an outage."""

from __future__ import annotations

import socket
import uuid

import httpx
from psycopg.conninfo import conninfo_to_dict

from gateway.database_url import database_name, libpq, with_database
from gateway.migrate import drop_database
from tests.support.gateway import GatewayProcess, Platform, gateway_env, upgrade_database
from tests.support.processes import Processes


def _dead_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _host_list(database_url: str, name: str) -> str:
    """The run's server behind a dead one, in libpq's multi-host form."""
    params = conninfo_to_dict(libpq(database_url))
    host = params.get("host") or "127.0.0.1"
    port = params.get("port") or "5432"
    user = params.get("user") or "postgres"
    password = f":{params['password']}" if params.get("password") else ""
    return (
        f"postgresql://{user}{password}@/{name}?host=127.0.0.1,{host}"
        f"&port={_dead_port()},{port}&target_session_attrs=read-write&connect_timeout=3"
    )


def test_a_host_list_survives_a_change_of_database() -> None:
    url = "postgresql+psycopg://u:p@/conveyor?host=pg-a,pg-b&port=5432,5433&target_session_attrs=read-write"
    other = conninfo_to_dict(libpq(with_database(url, "postgres")))
    assert other["dbname"] == "postgres"
    assert other["host"] == "pg-a,pg-b" and other["port"] == "5432,5433"
    assert other["target_session_attrs"] == "read-write"
    assert database_name(url) == "conveyor"


def test_db_upgrade_and_the_gateway_take_a_host_list(
    database_url: str, amqp_url: str, procs: Processes
) -> None:
    url = _host_list(database_url, f"conveyor_hosts_{uuid.uuid4().hex[:8]}")
    try:
        upgrade_database(url)

        service = Platform(url).service()
        gateway = GatewayProcess(procs, gateway_env(url, amqp_url))
        with gateway.http(service.clients[0]) as http:
            created = http.post(gateway.tasks_url(service.name), json={"body": {"n": 1}})
            assert created.status_code == 201, created.text
            task = created.json()["data"]["taskId"]
            polled = http.get(f"{gateway.tasks_url(service.name)}/{task}")
            assert polled.status_code == 200 and polled.json()["data"]["status"] == "PENDING"
        assert httpx.get(f"{gateway.url}/readyz", timeout=10).status_code == 200
    finally:
        procs.stop_all()
        drop_database(url)
