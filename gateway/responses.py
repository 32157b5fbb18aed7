"""JSON responses rendered by conveyor.strict_json (orjson's speed, strict about NaN, every
integer's digits)."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from conveyor import strict_json


class Json(JSONResponse):
    """A JSONResponse, so that OpenAPI documents the routes' bodies as JSON."""

    def render(self, content: Any) -> bytes:
        return strict_json.dumps(content)
