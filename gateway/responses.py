"""JSON responses rendered with orjson (fast, and strict about NaN)."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response


class Json(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)
