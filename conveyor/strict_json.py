"""JSON as every component reads it from others: NaN and Infinity are not JSON (they could
not be re-encoded or stored), and nesting deep enough to exhaust the stack is refused
rather than crashing the reader."""

from __future__ import annotations

import json
from typing import Any


class NotJson(ValueError):
    """The bytes are not JSON this platform can carry."""


class TooDeep(NotJson):
    """Nested deeper than the stack allows."""


def loads(raw: bytes | str) -> Any:
    try:
        return json.loads(raw, parse_constant=_reject)
    except RecursionError:
        raise TooDeep("nested too deep") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise NotJson(str(exc)) from None


def _reject(name: str) -> Any:
    raise json.JSONDecodeError(f"{name} is not JSON", name, 0)
