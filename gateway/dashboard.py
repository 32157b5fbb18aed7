"""The operators' dashboard at /ui/ (SPEC §11.6): one static page that draws itself from the
admin API.

The page holds no data and needs no session: the browser keeps the operator's credentials for
the tab (sessionStorage) and sends them to the admin API as HTTP Basic, so every figure is
authorised exactly as the API authorises it, and there is no cookie to forge or to steal across
sites. The assets ship inside the package (no CDN, no build step) and are served with a policy
that lets the page run its own script only, which renders every value as text.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import RedirectResponse, Response

router = APIRouter(include_in_schema=False)

_TYPES = {"app.js": "text/javascript", "app.css": "text/css", "index.html": "text/html"}
_ASSETS = {name: (resources.files("gateway") / "ui" / name).read_bytes() for name in _TYPES}
_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
    "frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


@router.get("/ui")
async def home() -> RedirectResponse:
    return RedirectResponse("/ui/")


@router.get("/ui/static/{name}")
async def asset(name: str) -> Response:
    if name not in _ASSETS or name == "index.html":
        return Response(status_code=404, headers=_HEADERS)
    return Response(_ASSETS[name], media_type=_TYPES[name], headers=_HEADERS)


@router.get("/ui/{page:path}")
async def page(page: str) -> Response:
    """Every page (overview, service, task, login) is the same shell; the script routes."""
    return Response(_ASSETS["index.html"], media_type="text/html", headers=_HEADERS)
