"""The thumbnail function, run as a real process, fed real images made with Pillow."""

from __future__ import annotations

import base64
import io
from typing import Any

import httpx
import pytest
from PIL import Image

from tests.functions.conftest import ProgressSink, RunningFunction, StartFunction
from tests.support.processes import PYTHON


def encode(image: Image.Image, fmt: str) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return base64.b64encode(buffer.getvalue()).decode()


def decode(data: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(data)))


def post(fn: RunningFunction, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    with httpx.Client(trust_env=False, timeout=30) as http:
        return http.post(f"{fn.url}/", json=body, headers={"ce-id": "thumb-1", **(headers or {})})


@pytest.fixture
def thumbnail(start_function: StartFunction) -> RunningFunction:
    return start_function("thumbnail", [PYTHON, "functions/thumbnail/main.py"])


@pytest.fixture
def landscape_png() -> str:
    image = Image.new("RGBA", (400, 200), (255, 0, 0, 128))
    image.paste((0, 0, 255, 255), (0, 0, 200, 200))
    return encode(image, "PNG")


def test_makes_one_thumbnail_per_size_keeping_the_aspect_ratio(
    thumbnail: RunningFunction, landscape_png: str, progress_sink: ProgressSink
) -> None:
    answer = post(
        thumbnail,
        {"image": landscape_png, "sizes": [64, 128, 32]},
        {"X-Conveyor-Progress-Url": progress_sink.url},
    )

    assert answer.status_code == 200
    thumbs = answer.json()["thumbnails"]
    assert [(t["size"], t["width"], t["height"]) for t in thumbs] == [
        (64, 64, 32),
        (128, 128, 64),
        (32, 32, 16),
    ]
    for thumb in thumbs:
        image = decode(thumb["data"])
        assert image.format == "PNG"
        assert image.size == (thumb["width"], thumb["height"])
    assert progress_sink.wait_for(2) == pytest.approx([33.33, 66.67])


def test_jpeg_input_and_output(thumbnail: RunningFunction, landscape_png: str) -> None:
    jpeg = encode(Image.new("RGB", (300, 600), (0, 128, 0)), "JPEG")

    from_jpeg = post(thumbnail, {"image": jpeg, "sizes": [100], "format": "JPEG"})
    from_rgba_png = post(thumbnail, {"image": landscape_png, "sizes": [50], "format": "jpeg"})

    assert from_jpeg.status_code == 200
    thumb = from_jpeg.json()["thumbnails"][0]
    assert (thumb["width"], thumb["height"]) == (50, 100)
    assert decode(thumb["data"]).format == "JPEG"
    assert from_rgba_png.status_code == 200, "RGBA must be converted for JPEG"


@pytest.mark.parametrize(
    ("body", "mentions"),
    [
        ({"sizes": [64]}, "image"),
        ({"image": "not base64 !!"}, "base64"),
        ({"image": base64.b64encode(b"just some text").decode()}, "decoded"),
        ({"image": "PNG", "sizes": "64"}, "sizes"),
        ({"image": "PNG", "sizes": [0]}, "size"),
        ({"image": "PNG", "sizes": [64], "format": "BMP"}, "format"),
        ([1, 2], "object"),
    ],
)
def test_rejects_bad_input_with_400(
    thumbnail: RunningFunction, landscape_png: str, body: Any, mentions: str
) -> None:
    if isinstance(body, dict) and body.get("image") == "PNG":
        body = {**body, "image": landscape_png}

    answer = post(thumbnail, body)

    assert answer.status_code == 400
    assert mentions in answer.json()["errorMessage"]


def test_rejects_formats_other_than_png_and_jpeg(thumbnail: RunningFunction) -> None:
    gif = encode(Image.new("P", (20, 20)), "GIF")

    answer = post(thumbnail, {"image": gif})

    assert answer.status_code == 400
    assert "PNG or a JPEG" in answer.json()["errorMessage"]


def test_default_is_one_128px_png(thumbnail: RunningFunction, landscape_png: str) -> None:
    answer = post(thumbnail, {"image": landscape_png})

    assert answer.status_code == 200
    [thumb] = answer.json()["thumbnails"]
    assert (thumb["size"], thumb["width"], thumb["height"]) == (128, 128, 64)
