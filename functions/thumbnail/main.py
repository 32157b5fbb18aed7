"""A CPU-heavy example function: resize one image into several thumbnails.

It shows the case the seed opens with: a task fast enough to run in seconds but
too heavy to run many of at once, so it goes through a queue and scales on its
depth. Standard library HTTP server plus Pillow; it never fetches URLs, the image
comes inline as base64.

    POST /  {"image": "<base64 PNG or JPEG>", "sizes": [64, 128], "format": "PNG"}
    200     {"thumbnails": [{"size": 64, "width": 64, "height": 48, "data": "<base64>"}]}
    400     {"errorMessage": "..."}   bad input: failed, never retried
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
import signal
import sys
import threading
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from PIL import Image, UnidentifiedImageError

MAX_BODY_BYTES = 16 << 20
MAX_PIXELS = 40_000_000
MAX_SIZES = 10
MAX_EDGE = 4096
INPUT_FORMATS = {"PNG", "JPEG"}
OUTPUT_FORMATS = {"PNG", "JPEG", "WEBP"}

Image.MAX_IMAGE_PIXELS = MAX_PIXELS  # Pillow's own bomb check, past ours


class BadRequest(Exception):
    """The input cannot be thumbnailed; answered with 400."""


@dataclass(frozen=True)
class Job:
    image: Image.Image
    sizes: list[int]
    format: str


def decode_image(encoded: Any) -> Image.Image:
    if not isinstance(encoded, str) or not encoded:
        raise BadRequest("'image' must be a base64 string")
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BadRequest("'image' is not valid base64") from exc
    try:
        image = Image.open(io.BytesIO(raw))
        if image.format not in INPUT_FORMATS:
            raise BadRequest("'image' must be a PNG or a JPEG")
        if image.width * image.height > MAX_PIXELS:
            raise BadRequest(f"'image' has more than {MAX_PIXELS} pixels")
        image.load()
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, SyntaxError) as exc:
        raise BadRequest(f"'image' cannot be decoded: {exc}") from exc
    return image


def parse_sizes(sizes: Any) -> list[int]:
    if sizes is None:
        return [128]
    if not isinstance(sizes, list) or not 1 <= len(sizes) <= MAX_SIZES:
        raise BadRequest(f"'sizes' must be a list of 1 to {MAX_SIZES} integers")
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_EDGE:
            raise BadRequest(f"each size must be an integer between 1 and {MAX_EDGE}")
    return sizes


def parse_job(raw: bytes) -> Job:
    try:
        body = json.loads(raw or b"null")
    except ValueError as exc:
        raise BadRequest("invalid JSON") from exc
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    out_format = body.get("format", "PNG")
    if not isinstance(out_format, str) or out_format.upper() not in OUTPUT_FORMATS:
        raise BadRequest(f"'format' must be one of {sorted(OUTPUT_FORMATS)}")
    sizes = parse_sizes(body.get("sizes"))
    return Job(decode_image(body.get("image")), sizes, out_format.upper())


def thumbnail(image: Image.Image, size: int, out_format: str) -> dict[str, Any]:
    """One thumbnail fitting in size x size, aspect ratio kept."""
    copy = image.copy()
    copy.thumbnail((size, size), Image.Resampling.LANCZOS)
    if out_format == "JPEG" and copy.mode not in ("RGB", "L"):
        copy = copy.convert("RGB")
    buffer = io.BytesIO()
    copy.save(buffer, format=out_format)
    return {
        "size": size,
        "width": copy.width,
        "height": copy.height,
        "data": base64.b64encode(buffer.getvalue()).decode("ascii"),
    }


def post_progress(url: str, value: float) -> None:
    """Best effort: a lost progress report must never fail the task."""
    request = urllib.request.Request(
        url,
        data=json.dumps({"progress": round(value, 2)}).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=2.0) as answer:
            answer.read()
    except (OSError, ValueError):
        pass


def run(job: Job, progress_url: str | None) -> dict[str, Any]:
    thumbnails = []
    for index, size in enumerate(job.sizes, start=1):
        thumbnails.append(thumbnail(job.image, size, job.format))
        if progress_url and index < len(job.sizes):
            post_progress(progress_url, 100 * index / len(job.sizes))
    return {"thumbnails": thumbnails}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "conveyor-thumbnail/1"

    def handle(self) -> None:
        """A caller that went away (a call cut at its deadline) ends its connection quietly:
        http.server would print a traceback for each such call."""
        try:
            super().handle()
        except ConnectionError:
            self.close_connection = True

    def do_GET(self) -> None:
        if self.path in ("/healthz", "/readyz"):
            self.answer(200, {"status": "ok"})
        else:
            self.answer(404, {"errorMessage": "not found"})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            self.close_connection = True
            self.answer(413, {"errorMessage": "request too large"})
            return
        raw = self.rfile.read(length) if length else b""
        print(f"call ce-id={self.headers.get('ce-id', '-')}", flush=True)
        try:
            job = parse_job(raw)
        except BadRequest as exc:
            self.answer(400, {"errorMessage": str(exc)})
            return
        self.answer(200, run(job, self.headers.get("X-Conveyor-Progress-Url")))

    def answer(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        """Silences the per-request access log: `do_POST` logs its own line."""


def serve(host: str, port: int) -> None:
    """Serves until SIGTERM or SIGINT, then stops accepting and returns."""
    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    print(f"thumbnail listening on http://{host}:{server.server_port}/", flush=True)
    while not stop.wait(0.5):
        pass
    server.shutdown()
    server.server_close()


if __name__ == "__main__":
    serve(os.environ.get("HOST", "127.0.0.1"), int(os.environ.get("PORT", "8080")))
    sys.exit(0)
