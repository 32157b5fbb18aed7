"""RFC 3339 §5.6 date-times, read strictly: what the API's `notBefore` and the CLI's
`--not-before` take (SPEC §11.4). One reader for both, so that the CLI refuses up front what
the gateway would refuse, and takes what it takes (a leap second among them)."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

# T and Z in either case, the offset required; the values are checked by datetime.
_RFC3339 = re.compile(
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt][0-9]{2}:[0-9]{2}:(?P<second>[0-9]{2})(\.[0-9]+)?"
    r"([Zz]|[+-][0-9]{2}:[0-9]{2})"
)
MAX_LENGTH = 64


def parse(text: str) -> datetime:
    """`text` in UTC; ValueError if it is not an RFC 3339 date-time with its offset,
    OverflowError if it falls before year 1 or after 9999 in UTC. A leap second (`23:59:60Z`,
    valid RFC 3339 in a UTC day's last minute, which datetime cannot hold) is read as the
    second after `:59`."""
    found = _RFC3339.fullmatch(text) if len(text) <= MAX_LENGTH else None
    if found is None:
        raise ValueError("not an RFC 3339 date-time with its offset")
    leap = found["second"] == "60"
    if leap:
        text = text[: found.start("second")] + "59" + text[found.end("second") :]
    when = datetime.fromisoformat(text.upper()).astimezone(UTC)  # it reads `Z`, not `z`
    if not leap:
        return when
    if (when.hour, when.minute) != (23, 59):  # RFC 3339 §5.7: the last minute of a UTC day
        raise ValueError("a leap second is 23:59:60 UTC")
    return when + timedelta(seconds=1)
