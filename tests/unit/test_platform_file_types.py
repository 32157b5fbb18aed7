"""The platform file takes each field in its own type: `maxAttempts: true` was applied as 1,
`taskTimeout: "300"` as 300 and `capacity: false` as 0 (pydantic's lax coercion), a typo or a
wrong quote silently becoming a setting. Each is now refused, naming the field, as any other
wrong value of the file is; the spellings YAML gives for the right types still load."""

from __future__ import annotations

import time

import pytest

from gateway.platform_file import PlatformError, PlatformSpec, ServiceSpec, load, validate

CLIENT = "clients:\n- id: c\n  secret: secretsecret\n"


@pytest.mark.parametrize(
    ("text", "refusal"),
    [
        ("services:\n- name: s\n  maxAttempts: true\n", "services.0.maxAttempts: "),
        ("services:\n- name: s\n  taskTimeout: '300'\n", "services.0.taskTimeout: "),
        ("services:\n- name: s\n  taskTimeout: 300.0\n", "services.0.taskTimeout: "),
        ("services:\n- name: s\n  capacity: false\n", "services.0.capacity: "),
        ("services:\n- name: s\n  capacity: '10'\n", "services.0.capacity: "),
        (
            CLIENT + "  grants:\n  - service: s\n    capacity: '5'\n",
            "clients.0.grants.0.capacity: ",
        ),
        (
            CLIENT + "  grants:\n  - service: s\n    capacity: true\n",
            "clients.0.grants.0.capacity: ",
        ),
        # numbers for strings, booleans for what is no boolean
        ("services:\n- name: 123\n", "services.0.name: "),
        ("services:\n- name: s\n  queueName: 12\n", "services.0.queueName: "),
        ("clients:\n- id: c\n  secret: 123456789\n", "clients.0.secret: "),
        ("operators:\n- id: true\n  secret: secretsecret\n", "operators.0.id: "),
        (CLIENT + "  grants:\n  - service: 5\n", "clients.0.grants.0.service: "),
        ("services:\n- name: s\n  messageFormat: true\n", "services.0.messageFormat: "),
        ("services:\n- name: s\n  retention: true\n", "services.0.retention: "),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_naming_its_field(text: str, refusal: str) -> None:
    with pytest.raises(PlatformError) as refused:
        load(text)
    assert str(refused.value).startswith(refusal), refused.value


def test_the_types_yaml_gives_still_load() -> None:
    spec = load(
        "services:\n"
        "- name: s\n  queueName: q\n  capacity: 10\n  taskTimeout: 60\n  maxAttempts: 5\n"
        "  messageFormat: legacy\n  retention: 7d\n  jsonSchema: {type: object}\n"
        "- name: t\n  retention: 3600\n"
        + CLIENT
        + "  grants:\n  - service: s\n    capacity: 2\n  - service: t\n"
    )
    first, second = spec.services
    assert (first.capacity, first.taskTimeout, first.maxAttempts) == (10, 60, 5)
    assert (first.messageFormat.value, first.retention, second.retention) == (
        "legacy",
        7 * 86400,
        3600,
    )
    assert [g.capacity for g in spec.clients[0].grants] == [2, None]


def test_stored_settings_and_the_command_lines_strings_still_validate() -> None:
    """`service create` validates the stored row (messageFormat as text) with the options
    (retention as the command line's string) over it."""
    stored = {"capacity": 3, "messageFormat": "cloudevents", "taskTimeout": 30, "retention": 60}
    spec = validate(ServiceSpec, {**stored, "retention": "2h", "name": "s", "maxAttempts": 4})
    assert (spec.capacity, spec.retention, spec.maxAttempts) == (3, 7200, 4)


@pytest.mark.parametrize("text", ["false", "0", '""', "[]", "'0'"])
def test_a_file_that_is_no_mapping_is_refused_even_when_falsy(text: str) -> None:
    """`false`, `0` or `""` read as an empty file and applied nothing, exit 0 (found by a
    black-box test); only a file with nothing in it (or comments) is empty."""
    with pytest.raises(PlatformError, match="must be a mapping"):
        load(text)
    assert load("# nothing yet\n") == load("")


@pytest.mark.parametrize(("opening", "closing"), [("{a: ", "}"), ("[", "]")])
def test_a_file_nested_past_the_stack_is_refused_not_a_traceback(
    opening: str, closing: str
) -> None:
    """PyYAML's constructor recurses: 5,000 levels ended in a RecursionError traceback of
    3,000 lines (found by a black-box test)."""
    nested = opening * 5000 + "1" + closing * 5000
    with pytest.raises(PlatformError, match="nested too deep"):
        load("services:\n  - name: s\n    jsonSchema: " + nested)


def _laughs(levels: int) -> str:
    """A schema of 10**levels strings in a few hundred bytes of YAML aliases."""
    lines = [
        "services:",
        "  - name: laughs",
        "    jsonSchema:",
        "      type: object",
        "      x-defs:",
    ]
    lines.append("        d0: &d0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]")
    for i in range(1, levels):
        lines.append(f"        d{i}: &d{i} [{', '.join([f'*d{i - 1}'] * 10)}]")
    return "\n".join(lines) + "\n"


def test_a_schema_that_aliases_expand_past_the_bound_is_refused_at_once() -> None:
    """Found by a black-box sweep: 549 bytes of aliases were applied as a schema of 80 MB,
    which every gateway then read at each refresh of its catalog (1.75 GB)."""
    text = _laughs(9)  # 10**9 strings were it expanded
    assert len(text) < 1024
    began = time.monotonic()
    with pytest.raises(PlatformError, match="more than 200000 values"):
        load(text)
    assert time.monotonic() - began < 10
    assert load(_laughs(3)).services[0].jsonSchema is not None  # 1,000 strings: a schema


@pytest.mark.parametrize(
    ("value", "refusal"),
    [
        ('"a\\0b"', "NUL character"),
        ("!!binary aGVsbG8=", "bytes is not JSON"),
        ("!!set {a, b}", "set is not JSON"),
        (".nan", "NaN and Infinity"),
        ("-.inf", "NaN and Infinity"),
        ("2020-01-01", "date is not JSON"),
        ("{1: a}", "not a string"),
    ],
)
def test_a_schema_the_database_cannot_store_is_refused_in_one_line(
    value: str, refusal: str
) -> None:
    """Found by a black-box sweep: each was a traceback of `admin apply` (the database's or
    the JSON encoder's error), where every other wrong value is one line."""
    text = f"services:\n  - name: s\n    jsonSchema:\n      description: x\n      x-v: {value}\n"
    with pytest.raises(PlatformError, match=refusal):
        load(text)


def test_many_clients_are_checked_for_twins_in_linear_time() -> None:
    """Found by a black-box sweep: the check counted each id in the whole list (8.5 s for
    20,000 ids)."""
    clients = [{"id": f"c{n}", "secretHash": "$2b$04$" + "a" * 53} for n in range(40_000)]
    began = time.monotonic()
    validate(PlatformSpec, {"clients": clients})
    assert time.monotonic() - began < 10
    with pytest.raises(PlatformError, match="client declared twice: c7"):
        validate(PlatformSpec, {"clients": [*clients, clients[7]]})
