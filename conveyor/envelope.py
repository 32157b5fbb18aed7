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


# SPEC §3's 503001, also what a probe answers when its process is not ready.
UNAVAILABLE_NUMBER = 503001
UNAVAILABLE_DESCRIPTION = "Service temporarily unavailable."


def probe(data: dict[str, Any], ready: bool = True) -> dict[str, Any]:
    """`/healthz` and `/readyz` in the envelope (SPEC §3: every answer), gateway and dispatcher
    alike: what was checked is `data` either way, so a 503's reader finds which check failed
    where a 200's reader finds them all true."""
    if ready:
        return success(data)
    return {**error(UNAVAILABLE_NUMBER, UNAVAILABLE_DESCRIPTION), "data": data}
