"""deploy/grafana/conveyor-dashboard.json names only series Conveyor really exposes.

Every PromQL expression of the dashboard (panel targets and the `service` variable's
`label_values`) is reduced to the metric names it selects, and each must be a series that a
real gateway's or a real dispatcher's /metrics exposes, after one task went through both:
`conveyor_tasks_finished_total` and `conveyor_task_run_seconds_bucket` as Prometheus stores
them, not the names the code declares. A label matcher must name a label the series has.
A misspelt name fails the check (test_a_misspelt_metric_is_reported).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.amqp import queues_of, wait_for_queues, wait_until
from tests.support.gateway import GatewayProcess, Platform
from tests.support.metrics import exposed_names, samples
from tests.support.processes import Processes, free_port, wait_http

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "conveyor-dashboard.json"

FUNCTIONS = {
    "abs", "absent", "avg", "avg_over_time", "bottomk", "ceil", "clamp_max", "clamp_min",
    "count", "count_over_time", "delta", "deriv", "floor", "group", "histogram_quantile",
    "idelta", "increase", "irate", "label_replace", "max", "max_over_time", "min",
    "min_over_time", "quantile", "quantile_over_time", "rate", "round", "scalar", "sort",
    "sort_desc", "stddev", "sum", "sum_over_time", "time", "topk", "vector",
}  # fmt: skip
KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_CLAUSE = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_SELECTOR = re.compile(r"([A-Za-z_:][\w:]*)\s*\{([^}]*)\}")
_MATCHER = re.compile(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)")
_NAME = re.compile(r"[A-Za-z_:][\w:]*")
_NUMBER = re.compile(  # 0.95, 1e3, and durations: 5m, 1h30m
    r"(?<![\w:])\d+(?:\.\d+)?(?:e[+-]?\d+)?(?:(?:ms|[smhdwy])(?:\d+(?:ms|[smhdwy]))*)?(?![\w:])"
)


def expressions(node: Any) -> Iterator[str]:
    """Every `expr` of the dashboard, and the variables' queries, wherever they are nested."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr" and isinstance(value, str):
                yield value
            elif key == "query" and isinstance(value, str) and "label_values" in value:
                yield value
            else:
                yield from expressions(value)
    elif isinstance(node, list):
        for item in node:
            yield from expressions(item)


def selected(expr: str) -> tuple[set[str], dict[str, set[str]]]:
    """The metric names an expression selects, and the labels its matchers name per metric.

    Grafana's variables go first, then what is not a name: label matchers (after reading
    them), ranges, `by (...)`-style clauses, numbers. What is left and not called like a
    function is a metric; an unknown function is an error too (a typo such as `rat(`).
    """
    text = re.sub(r"\$\{?\w+\}?", "", expr)
    text = _STRING.sub('""', text)
    matched: dict[str, set[str]] = {}
    for name, matchers in _SELECTOR.findall(text):
        matched.setdefault(name, set()).update(_MATCHER.findall(matchers))
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = _CLAUSE.sub(" ", text)
    text = re.sub(r"\blabel_values\s*\(\s*([A-Za-z_:][\w:]*)\s*,[^)]*\)", r" \1 ", text)
    text = _NUMBER.sub(" ", text)
    names: set[str] = set()
    for found in _NAME.finditer(text):
        word = found.group()
        if text[found.end() :].lstrip().startswith("("):
            if word not in FUNCTIONS:
                raise ValueError(f"unknown PromQL function {word!r} in {expr!r}")
        elif word.lower() not in KEYWORDS:
            names.add(word)
    if not names:
        raise ValueError(f"no metric in {expr!r}")
    return names, matched


def problems(
    dashboard: dict[str, Any], exposed: set[str], labels: dict[str, set[str]]
) -> list[str]:
    """What the dashboard asks for that the exposition does not have."""
    found = []
    for expr in expressions(dashboard):
        try:
            names, matched = selected(expr)
        except ValueError as exc:
            found.append(str(exc))
            continue
        found += [f"{name} (in {expr!r}) is not exposed" for name in names - exposed]
        for name, keys in matched.items():
            unknown = keys - labels.get(name, keys)  # checked when the series has samples
            found += [f"{name} has no label {k!r} (in {expr!r})" for k in sorted(unknown)]
    return found


@pytest.fixture(scope="module")
def exposition(
    gateway: GatewayProcess,
    platform: Platform,
    amqp_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[set[str], dict[str, set[str]]]]:
    """What a gateway and a dispatcher expose once one task went through both."""
    svc = platform.service()
    wait_for_queues(amqp_url, queues_of(svc.queue_name))
    tmp = tmp_path_factory.mktemp("dashboard")
    procs = Processes(tmp)
    try:
        function_port, dispatcher_port = free_port(), free_port()
        fake = ["-m", "tests.dispatcher.fakefunction", "--log", str(tmp / "calls.jsonl")]
        procs.start("function", [sys.executable, *fake, "--port", str(function_port)])
        dispatcher = procs.conveyor(
            "dispatcher",
            "dispatcher",
            env={
                "CONVEYOR_QUEUE": svc.queue_name,
                "CONVEYOR_AMQP_URL": amqp_url,
                "CONVEYOR_FUNCTION_URL": f"http://127.0.0.1:{function_port}/",
                "CONVEYOR_DISPATCHER_PORT": str(dispatcher_port),
                "CONVEYOR_FUNCTION_WAIT_TIMEOUT": "30",
            },
        )
        dispatcher_url = f"http://127.0.0.1:{dispatcher_port}"
        wait_http(f"{dispatcher_url}/healthz", timeout=20, proc=dispatcher)
        with gateway.http(svc.clients[0]) as http:
            answer = http.post(gateway.tasks_url(svc.name), json={"body": {"sleep": 0.2}})
            assert answer.status_code == 201, answer.text
            poll = f"{gateway.tasks_url(svc.name)}/{answer.json()['data']['taskId']}"
            wait_until(
                lambda: http.get(poll).json()["data"]["status"] == "SUCCESS",
                timeout=30,
                what="the task done",
            )
            texts = [http.get("/metrics").text, httpx.get(f"{dispatcher_url}/metrics").text]
        exposed = set().union(*(exposed_names(t) for t in texts))
        labels: dict[str, set[str]] = {}
        for text in texts:
            for name, pairs in samples(text):
                labels.setdefault(name, set()).update(k for k, _ in pairs)
        yield exposed, labels
    finally:
        procs.stop_all()


def test_every_metric_of_the_dashboard_is_exposed(
    exposition: tuple[set[str], dict[str, set[str]]],
) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert len(list(expressions(dashboard))) >= 12
    assert problems(dashboard, *exposition) == []


def test_a_misspelt_metric_is_reported(
    exposition: tuple[set[str], dict[str, set[str]]],
) -> None:
    text = DASHBOARD.read_text()
    for wrong in (
        text.replace("conveyor_tasks_finished_total", "conveyor_task_finished_total"),
        text.replace("conveyor_task_run_seconds_bucket", "conveyor_task_run_seconds"),
        text.replace("conveyor_dispatcher_function_calls_total", "conveyor_function_calls_total"),
        text.replace("label_values(conveyor_service_tasks,", "label_values(conveyor_tasks,"),
        text.replace(
            "(rate(conveyor_gateway_requests_total[", "(rat(conveyor_gateway_requests_total["
        ),
        # a label the series does not have (dispatchers know no service), escaped for JSON
        text.replace("_tasks_in_flight)", '_tasks_in_flight{service=\\"x\\"})'),
    ):
        assert wrong != text
        assert problems(json.loads(wrong), *exposition), "a broken dashboard passed"


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        (
            'histogram_quantile(0.95, sum by (service, le) (rate(a_bucket{service=~"$service",'
            ' x="b{c}"}[$__rate_interval])))',
            {"a_bucket"},
        ),
        ("sum(rate(b_total[5m] offset 1h)) / ignoring(le) sum without (x) (c)", {"b_total", "c"}),
        ("label_values(conveyor_service_tasks, service)", {"conveyor_service_tasks"}),
        ("sum(x:recorded:rate5m) > 1e3", {"x:recorded:rate5m"}),
    ],
)
def test_metric_names_are_read_from_promql(expr: str, names: set[str]) -> None:
    assert selected(expr)[0] == names
