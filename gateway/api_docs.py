"""The API's documentation page (SPEC §3.4): Swagger UI at /docs, its files from this process.

The page loaded Swagger UI from a CDN, so it stayed blank in a cluster without the internet:
its files are `fastapi-swagger`'s copies, served here. That package's own page was not kept:
it wrote the files' absolute URLs from the request's Host header, so a cache keyed without
the Host could serve a page running another origin's script on the gateway's, and behind TLS
its `http://` URLs were blocked as mixed content. This page names them by path, says where
scripts may come from (Content-Security-Policy: this origin, and its one inline script by
hash), and does not keep the credentials typed into it beyond the tab.
"""

from __future__ import annotations

import base64
import hashlib
import re
from importlib import resources

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, Response

from gateway.responses import Json

router = APIRouter(include_in_schema=False)

_FILES = {
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui.css": "text/css",
    "favicon.png": "image/png",
}
_PACKAGED = {"favicon.png": "favicon-32x32.png"}  # the name in fastapi-swagger's resources
_CONTENT = {
    name: (
        resources.files("fastapi_swagger") / "resources" / _PACKAGED.get(name, name)
    ).read_bytes()
    for name in _FILES
}
_PARAMETERS = {"tryItOutEnabled": True, "filter": True, "displayRequestDuration": True}
_INLINE_SCRIPT = re.compile(r"<script>(.*?)</script>", re.DOTALL)
OPENAPI_PATH = "/openapi.json"


@router.get(OPENAPI_PATH)
async def document(request: Request) -> Json:
    """The OpenAPI document, served by a route of the table (FastAPI's own is a bare Starlette
    route, which `/metrics` could only count as `unmatched`)."""
    return Json(request.app.openapi())


@router.get("/docs")
async def page(request: Request) -> HTMLResponse:
    base = request.scope.get("root_path", "").rstrip("/")
    answer = get_swagger_ui_html(
        openapi_url=f"{base}{OPENAPI_PATH}",
        title=f"{request.app.title} - Swagger UI",
        swagger_js_url=f"{base}/docs/swagger-ui-bundle.js",
        swagger_css_url=f"{base}/docs/swagger-ui.css",
        swagger_favicon_url=f"{base}/docs/favicon.png",
        swagger_ui_parameters=_PARAMETERS,
    )
    hashes = " ".join(
        f"'sha256-{base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()}'"
        for script in _INLINE_SCRIPT.findall(bytes(answer.body).decode())
    )
    answer.headers.update(
        {
            "Content-Security-Policy": f"default-src 'self'; script-src 'self' {hashes}; "
            "img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'",
            "X-Content-Type-Options": "nosniff",
            "Cache-Control": "no-cache",
        }
    )
    return answer


@router.get("/docs/{name}")
async def file(name: str) -> Response:
    if name not in _FILES:
        return Response(status_code=404)
    return Response(
        _CONTENT[name], media_type=_FILES[name], headers={"X-Content-Type-Options": "nosniff"}
    )
