"""Fixtures of the fault tests that run on the run's own RabbitMQ node."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.amqp import scratch_database


@pytest.fixture
def alone(database_url: str) -> Iterator[str]:
    """A database of its own: the session's gateway, on the shared broker, would otherwise
    relay these tasks there."""
    with scratch_database(database_url) as url:
        yield url
