"""The seed's answer envelope, shared by the gateway's API and the dispatcher's local one."""

from __future__ import annotations

from typing import Any


def success(data: Any) -> dict[str, Any]:
    return {"status": "success", "data": data}


def error(
    number: int, description: str, errors: list[dict[str, str]] | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {"number": number, "description": description}
    if errors:
        body["errors"] = errors
    return {"status": "error", "error": body}
