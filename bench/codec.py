"""The wire codec's cost per message, in microseconds: encoding and decoding a submission (the
gateway publishes it, the dispatcher reads it) and a task event (the dispatcher publishes it,
the gateway reads it), CloudEvents binary mode, as `conveyor/events.py` runs them; and the JSON
underneath alone, the stdlib (as the codec used it before) against `conveyor/strict_json.py`.

Payloads: a small submission body (~150 B) and a large one (a 100-item list, ~7 KB); a
succeeded event with a small and a large response. Each figure is the median of `--reps`
timings of `--number` calls, after a warm-up, in this one process (no servers involved).

    python -m bench.codec [--reps 7] [--number 2000] [--sections codec,json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from bench.record import banner, metadata, write_result
from bench.stats import median, ratio
from conveyor import events, strict_json
from conveyor.events import EventKind, Submission, TaskEvent

TASK_ID = str(uuid.UUID(int=42))
SMALL = {
    "image": "https://example.com/images/123.jpg",
    "sizes": [64, 128, 256],
    "options": {"format": "webp", "quality": 80, "label": "café ☕"},
}
LARGE = {
    "items": [
        {"id": i, "name": f"item {i}", "tags": ["a", "b"], "score": i * 1.5, "ok": i % 2 == 0}
        for i in range(100)
    ]
}


def _refuse(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def stdlib_loads(raw: bytes) -> Any:
    """The codec's reading before orjson (strict_json's stdlib path)."""
    return json.loads(raw, parse_constant=_refuse)


def stdlib_dumps(value: Any) -> bytes:
    """The codec's writing of CloudEvent data before orjson (the `cloudevents` binding's)."""
    return json.dumps(value).encode()


def per_call_us(call: Callable[[], Any], number: int, reps: int) -> float:
    for _ in range(max(1, number // 10)):
        call()
    timings = []
    for _ in range(reps):
        started = time.perf_counter_ns()
        for _ in range(number):
            call()
        timings.append((time.perf_counter_ns() - started) / number / 1000)
    return round(median(timings) or 0.0, 2)


def codec(number: int, reps: int) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for size, body in (("small", SMALL), ("large", LARGE)):
        submission = Submission(TASK_ID, "thumbnails", body, max_attempts=3, timeout=300.0)
        event = TaskEvent(
            EventKind.SUCCEEDED,
            TASK_ID,
            response=body,
            attempt=str(uuid.UUID(int=7)),
            time=datetime.now(UTC),
        )
        submitted = events.encode_submission(submission)
        reported = events.encode_event(event, "thumbnails")
        figures[size] = {
            "body_bytes": len(submitted.body),
            "encode_submission_us": per_call_us(
                lambda s=submission: events.encode_submission(s), number, reps
            ),
            "decode_submission_us": per_call_us(
                lambda m=submitted: events.decode_submission(m), number, reps
            ),
            "encode_event_us": per_call_us(
                lambda e=event: events.encode_event(e, "thumbnails"), number, reps
            ),
            "decode_event_us": per_call_us(lambda m=reported: events.decode_event(m), number, reps),
        }
        print(f"  codec, {size}: {figures[size]}")
    return figures


def json_layer(number: int, reps: int) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for size, body in (("small", SMALL), ("large", LARGE)):
        raw = stdlib_dumps(body)
        row = {
            "bytes": len(raw),
            "loads_stdlib_us": per_call_us(lambda r=raw: stdlib_loads(r), number, reps),
            "loads_strict_json_us": per_call_us(lambda r=raw: strict_json.loads(r), number, reps),
            "dumps_stdlib_us": per_call_us(lambda b=body: stdlib_dumps(b), number, reps),
            "dumps_strict_json_us": per_call_us(lambda b=body: strict_json.dumps(b), number, reps),
        }
        row["loads_speedup"] = ratio(row["loads_stdlib_us"], row["loads_strict_json_us"])
        row["dumps_speedup"] = ratio(row["dumps_stdlib_us"], row["dumps_strict_json_us"])
        figures[size] = row
        print(f"  json, {size}: {row}")
    return figures


SECTIONS = {"codec": codec, "json": json_layer}


def run(options: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {"benchmark": "codec", "meta": metadata("bench.codec", vars(options))}
    for name in options.sections.split(","):
        banner(f"{name}: median µs per call of {options.reps} x {options.number}")
        result[name] = SECTIONS[name](options.number, options.reps)
    return result


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--number", type=int, default=2000, help="calls per timing")
    parser.add_argument("--sections", default="codec,json", help="codec, json or both")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    write_result("codec", run(parse(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
