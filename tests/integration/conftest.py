"""Integration fixtures: the test database's platform data and a shared gateway."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.gateway import GatewayProcess, Platform, gateway_env
from tests.support.processes import Processes


@pytest.fixture(scope="session")
def platform(database_url: str) -> Platform:
    return Platform(database_url)


@pytest.fixture(scope="session")
def gateway(
    database_url: str, amqp_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    """One gateway for the tests that don't need special settings or to kill it."""
    procs = Processes(tmp_path_factory.mktemp("shared-gateway"))
    try:
        yield GatewayProcess(procs, gateway_env(database_url, amqp_url))
    finally:
        procs.stop_all()
