"""A leap second (`23:59:60`, valid RFC 3339 §5.6) in `notBefore` was refused 400002: datetime
has no second 60. It is read as the second after `:59`, the next minute's first, in single and
batch submits alike."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from conveyor.rfc3339 import parse as parse_rfc3339
from tests.support.gateway import GatewayProcess, Platform


@pytest.mark.parametrize(
    ("text", "instant"),
    [
        ("2030-06-30T23:59:60Z", "2030-07-01T00:00:00+00:00"),
        ("2016-12-31t23:59:60z", "2017-01-01T00:00:00+00:00"),
        ("2030-06-30T23:59:60.25Z", "2030-07-01T00:00:00.250000+00:00"),
        ("2030-07-01T01:59:60+02:00", "2030-07-01T00:00:00+00:00"),
        ("2030-06-30T23:59:59Z", "2030-06-30T23:59:59+00:00"),
        ("2030-06-30T23:59:59.5-01:30", "2030-07-01T01:29:59.500000+00:00"),
    ],
)
def test_rfc3339_reads_a_leap_second_as_the_next_one(text: str, instant: str) -> None:
    assert parse_rfc3339(text) == datetime.fromisoformat(instant)


@pytest.mark.parametrize(
    "text",
    [
        "2030-06-30T23:59:61Z",
        "2030-06-30T23:60:00Z",
        "2030-06-30T24:00:00Z",
        "2030-06-30T23:59:60",
        "2030-03-15T12:34:60Z",  # RFC 3339 §5.7: only in a UTC day's last minute
        "2030-06-30T23:59:60+01:00",  # 22:59:60 UTC
    ],
)
def test_no_other_second_or_minute_past_59_is_read(text: str) -> None:
    with pytest.raises(ValueError):
        parse_rfc3339(text)


def test_past_year_9999_is_an_overflow_not_a_crash() -> None:
    with pytest.raises(OverflowError):
        parse_rfc3339("9999-12-31T23:59:60Z")


def test_a_leap_second_not_before_is_taken_single_and_batch(
    gateway: GatewayProcess, platform: Platform
) -> None:
    svc = platform.service()
    day = (datetime.now(UTC) + timedelta(days=1)).date()
    leap = f"{day.isoformat()}T23:59:60Z"
    midnight = datetime.combine(day + timedelta(days=1), datetime.min.time(), UTC)
    url = gateway.tasks_url(svc.name)
    with gateway.http(svc.clients[0]) as http:
        single = http.post(url, json={"body": {}, "notBefore": leap})
        batch = http.post(f"{url}/batch", json={"tasks": [{"body": {}, "notBefore": leap}]})
        assert (single.status_code, batch.status_code) == (201, 201), (single.text, batch.text)
        ids = [single.json()["data"]["taskId"], batch.json()["data"]["tasks"][0]["taskId"]]
        for task_id in ids:
            polled = http.get(f"{url}/{task_id}").json()["data"]
            assert datetime.fromisoformat(polled["notBefore"]) == midnight, polled
