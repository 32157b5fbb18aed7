"""What tracing costs the gateway's submissions: tracing off against on (SPEC §11.6).

Two gateway processes on one database and one service, started alike except for tracing:
`off` has no OTLP endpoint (OTEL_SDK_DISABLED=true too, so that no variable of the caller's
shell turns it on), `on` exports every span (`submit`, `publish`) over OTLP/HTTP to a sink in
this process (`tests.support.otlp`: a real receiver that decodes and counts). The same
closed-loop load as `bench.submit` (`bench.loadgen`, a separate process) goes to each in
turn, the order alternating between repetitions, the PENDING backlog finished in SQL between
runs. Medians per concurrency level, and on/off ratios; the gateway's CPU per request is the
figure that moves least on a shared machine.

    python -m bench.tracing [--duration 5] [--reps 3] [--concurrency 1,16]
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from bench.record import banner, metadata, write_result
from bench.stack import Gateway, create_service, fresh_database, processes, start_gateway
from bench.stats import median, ratio
from bench.submit import BODY, load, reset_backlog
from tests.support.otlp import OtlpReceiver, otlp_receiver

MODES = ("off", "on")


def _env(mode: str, sink: OtlpReceiver) -> dict[str, str]:
    if mode == "off":
        return {"OTEL_SDK_DISABLED": "true"}
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint, "OTEL_SDK_DISABLED": "false"}


def _summary(runs: list[dict[str, Any]], concurrency: int) -> dict[str, Any]:
    found: dict[str, Any] = {"concurrency": concurrency}
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode and r["concurrency"] == concurrency]
        found[mode] = {
            "throughput_rps": median(r["throughput_rps"] for r in mine),
            "p50_ms": median(r["p50_ms"] for r in mine),
            "p99_ms": median(r["p99_ms"] for r in mine),
            "gateway_cpu_ms_per_request": median(r["gateway_cpu_ms_per_request"] for r in mine),
        }
    off, on = found["off"], found["on"]
    found["on_over_off"] = {key: ratio(on[key], off[key]) for key in off}
    return found


def run(options: argparse.Namespace) -> dict[str, Any]:
    levels = [int(x) for x in options.concurrency.split(",")]
    result: dict[str, Any] = {
        "benchmark": "tracing",
        "meta": metadata("bench.tracing", vars(options)),
        "body": BODY,
    }
    runs: list[dict[str, Any]] = []
    with fresh_database() as database_url, processes() as procs, otlp_receiver(False) as sink:
        service = create_service(database_url, bcrypt_rounds=4)
        gateways: dict[str, Gateway] = {
            mode: start_gateway(procs, database_url, name=f"gateway-{mode}", **_env(mode, sink))
            for mode in MODES
        }
        for rep in range(options.reps):
            for concurrency in levels:
                for mode in MODES if rep % 2 == 0 else tuple(reversed(MODES)):
                    banner(f"repetition {rep + 1}/{options.reps}: tracing {mode}, c={concurrency}")
                    spans_before = sink.span_count
                    report = load(
                        gateways[mode], service, concurrency, options.duration, options.warmup
                    )
                    found = {
                        "rep": rep + 1,
                        "mode": mode,
                        "concurrency": concurrency,
                        "throughput_rps": report["throughput_rps"],
                        "p50_ms": report["latency_ms"]["p50"],
                        "p99_ms": report["latency_ms"]["p99"],
                        "gateway_cpu_ms_per_request": report["gateway_cpu_ms_per_request"],
                        "statuses": report["statuses"],
                        "errors": report["errors"],
                        "backlog_after": reset_backlog(database_url, service),
                        # spans still in the exporter's buffer arrive during the next run
                        "spans_received_during": sink.span_count - spans_before,
                    }
                    runs.append(found)
                    print(
                        f"  {found['throughput_rps']} req/s, p50 {found['p50_ms']} ms,"
                        f" p99 {found['p99_ms']} ms, gateway CPU"
                        f" {found['gateway_cpu_ms_per_request']} ms/req,"
                        f" spans received {found['spans_received_during']}",
                        flush=True,
                    )
        for gateway in gateways.values():
            procs.stop(gateway.proc)  # the `on` gateway flushes its last spans on the way out
        result["spans_received"] = sink.span_count
        result["otlp_requests"] = sink.requests
    result["runs"] = runs
    result["summary"] = [_summary(runs, c) for c in levels]
    return result


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per run")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--concurrency", default="1,16")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    result = run(parse(argv))
    write_result("tracing", result)
    print(json.dumps(result["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
