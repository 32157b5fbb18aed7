"""A service's JSON Schema: applied without fetching anything, and in linear time for
`uniqueItems` (gateway/body_schema.py)."""

from __future__ import annotations

import signal
import socket
import threading
from datetime import UTC, datetime
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.events import MessageFormat
from gateway.body_schema import SchemaCache, SchemaRefused, check
from gateway.catalog import Service
from gateway.platform_file import PlatformSpec

UNIQUE = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}


def _service(schema: dict[str, Any]) -> Service:
    return Service("s", "q", None, schema, MessageFormat.CLOUDEVENTS, 30, 3, 60, datetime.now(UTC))


@pytest.mark.parametrize(
    "schema",
    [
        {"$defs": {"a": {"type": "string"}}, "properties": {"x": {"$ref": "#/$defs/a"}}},
        {"properties": {"x": {"$ref": "#"}}},
        {
            "$schema": "http://json-schema.org/draft-04/schema#",
            "definitions": {"a": {"type": "string"}},
            "properties": {"x": {"$ref": "#/definitions/a"}},
        },
        {"properties": {"x": {"$ref": "https://json-schema.org/draft/2020-12/schema"}}},
        {
            "$id": "https://example.com/root",
            "$defs": {"a": {"$id": "a", "type": "string"}},
            "properties": {"x": {"$ref": "a"}},
        },
    ],
)
def test_a_schema_referring_to_itself_or_to_a_meta_schema_is_taken(schema: dict[str, Any]) -> None:
    check(schema)


@pytest.mark.parametrize(
    "reference",
    [
        "http://127.0.0.1:9/h.json",
        "http://169.254.169.254/latest/meta-data",
        "file:///etc/passwd",
        "other.json",
        "#/$defs/missing",
    ],
)
def test_a_schema_referring_to_anything_else_is_refused_when_applied(reference: str) -> None:
    schema = {"type": "object", "properties": {"x": {"items": {"$ref": reference}}}}
    with pytest.raises(SchemaRefused, match="does not resolve within the schema"):
        check(schema)
    spec = {"services": [{"name": "s", "jsonSchema": schema}]}
    with pytest.raises(ValueError, match="fetches no schema"):
        PlatformSpec.model_validate(spec)


def test_a_stored_schema_that_refers_outside_fetches_nothing_and_refuses_the_body() -> None:
    """A schema written by other hands than `apply` (plain SQL, an older version), referring
    to a server that takes connections and never answers: jsonschema fetched it on the
    gateway's event loop, without a timeout. Nothing is fetched now; the body cannot be
    checked, so it is refused saying why."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        silent.setblocking(False)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/h.json"
        schema = {"type": "object", "properties": {"x": {"$ref": url}}}
        errors = _checked_within(60, {"x": 5}, schema)
        with pytest.raises(BlockingIOError):
            silent.accept()
    assert errors == [
        {
            "path": "body",
            "message": f"the service's JSON Schema cannot be applied: Unresolvable: {url}",
        }
    ]


def _checked_within(seconds: float, body: Any, schema: dict[str, Any]) -> list[dict[str, str]]:
    """The errors of `body`, asked in a thread: a check that never ends fails the test."""
    answer: list[list[dict[str, str]]] = []
    worker = threading.Thread(
        target=lambda: answer.append(SchemaCache().errors(_service(schema), body)), daemon=True
    )
    worker.start()
    worker.join(seconds)
    assert answer, f"not checked within {seconds} s"
    return answer[0]


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 3)
    | st.sampled_from([0.0, 1.0, 2.5])
    | st.text("ab", max_size=2),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text("ab", max_size=2), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_JSON, max_size=6))
def test_unique_items_agree_with_jsonschemas_own(items: list[Any]) -> None:
    """1 and 1.0 equal, true and 1 not, objects whatever their keys' order: jsonschema's
    equality, checked against its own (quadratic) implementation."""
    theirs = jsonschema.Draft202012Validator(UNIQUE).is_valid({"tags": items})
    ours = not SchemaCache().errors(_service(UNIQUE), {"tags": items})
    assert ours == theirs, items


def test_unique_items_name_the_array() -> None:
    errors = SchemaCache().errors(
        _service(UNIQUE), {"tags": [{"a": 1, "b": [1]}, {"b": [1.0], "a": 1}]}
    )
    assert errors == [
        {
            "path": "body/tags",
            "message": "[{'a': 1, 'b': [1]}, {'b': [1.0], 'a': 1}] has non-unique elements",
        }
    ]


def test_unique_items_of_a_large_array_of_objects_are_checked_at_all() -> None:
    """50,000 distinct objects (a ~700 KB body): pair by pair, jsonschema compares 1.25e9
    pairs, hours of a gateway's event loop; the test waits up to a minute for any answer."""
    body = {"tags": [{"a": i} for i in range(50_000)] + [{"a": 7}]}
    errors = _checked_within(60, body, UNIQUE)
    assert errors[0]["path"] == "body/tags"


def test_a_schema_nested_past_the_stack_is_refused_not_a_crash() -> None:
    schema: dict[str, Any] = {}
    inner = schema
    for _ in range(5_000):
        inner["properties"] = {"a": {}}
        inner = inner["properties"]["a"]
    with pytest.raises(SchemaRefused, match="nested too deep"):
        check(schema)


@pytest.mark.parametrize(
    "schema",
    [
        {"$ref": "#"},
        {"$ref": "#/definitions/x", "definitions": {"x": {"$ref": "#/definitions/x"}}},
        {"properties": {"a": {"$ref": "#/properties/a"}}},
        {
            "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
            "properties": {"x": {"$ref": "#/$defs/a"}},
        },
    ],
)
def test_references_that_loop_are_refused_when_applied(schema: dict[str, Any]) -> None:
    """Each body's check recursed until Python's limit: `apply` took these, and every
    submission to the service was 500 (found by a black-box test)."""
    with pytest.raises(SchemaRefused, match="refers back to itself"):
        check(schema)


def test_a_stored_schema_whose_references_loop_refuses_the_body_saying_so() -> None:
    """A loop `check` cannot see (through `allOf`), or a schema stored by other means."""
    for schema in ({"allOf": [{"$ref": "#"}]}, {"$ref": "#"}):
        assert SchemaCache().errors(_service(schema), {}) == [
            {
                "path": "body",
                "message": "the service's JSON Schema cannot be applied: its references loop",
            }
        ]


def test_a_check_that_outruns_its_budget_refuses_the_body_and_leaves_no_timer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A `pattern` that backtracks (`^(a+)+$`: twice as long per character) is cut by the
    budget's SIGALRM, which `re` hears mid-match; the signal's handler and any timer running
    before (a test runner's) are given back; the next check is not cut by a late alarm."""
    monkeypatch.setattr("gateway.body_schema.CHECK_BUDGET", 0.2)
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(a+)+$"}}}
    cache = SchemaCache()
    handler, (timer, _) = signal.getsignal(signal.SIGALRM), signal.getitimer(signal.ITIMER_REAL)
    assert cache.errors(_service(schema), {"a": "a" * 40 + "!"}) == [
        {"path": "body", "message": "not checked against the service's JSON Schema within 0.2 s"}
    ]
    assert signal.getsignal(signal.SIGALRM) == handler  # pytest-timeout's, if it runs one
    assert (signal.getitimer(signal.ITIMER_REAL)[0] > 0) == (timer > 0)
    assert cache.errors(_service(schema), {"a": "aaaa"}) == []
