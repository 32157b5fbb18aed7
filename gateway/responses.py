"""JSON responses rendered with orjson (fast, and strict about NaN)."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import JSONResponse


class Json(JSONResponse):
    """A JSONResponse, so that OpenAPI documents the routes' bodies as JSON."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)
