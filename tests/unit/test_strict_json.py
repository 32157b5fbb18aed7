"""conveyor/strict_json.py reads and writes JSON with orjson where orjson agrees with the
stdlib, and with the stdlib where it does not: every edge where the two libraries differ,
then the same comparison on generated documents. The reference is the stdlib as the codec
used it before orjson (`json.loads(..., parse_constant=refuse)`, `json.dumps`).

Also the CloudEvents format of conveyor/events.py: its data reads and writes as the
`cloudevents` binding's own JSON format did, once per message instead of twice.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import orjson
import pytest
from cloudevents.core.formats.json import JSONFormat
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor import events, strict_json
from conveyor.strict_json import FAST_BRACKETS, NotJson, TooDeep

GENERATED = settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))


def _refuse(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def reference(raw: bytes | str) -> Any:
    """What the stdlib answers, NaN and Infinity refused however they are spelled: a value, or
    the class strict_json must raise."""
    try:
        return json.loads(raw, parse_constant=_refuse, parse_float=_refuse_infinite)
    except RecursionError:
        return TooDeep
    except (UnicodeDecodeError, ValueError):
        return NotJson


def _refuse_infinite(text: str) -> float:
    if math.isinf(value := float(text)):
        raise ValueError(text)
    return value


def answer(raw: bytes | str) -> Any:
    try:
        return strict_json.loads(raw)
    except TooDeep:
        return TooDeep
    except NotJson:
        return NotJson


def same(a: Any, b: Any) -> bool:
    """Equal, and of the same types all the way down (1 is not 1.0; NaN is NaN);
    iterative, for documents nested too deep for recursion."""
    stack = [(a, b)]
    while stack:
        x, y = stack.pop()
        if type(x) is not type(y):
            return False
        if isinstance(x, dict):
            if list(x) != list(y):
                return False
            stack.extend((x[k], y[k]) for k in x)
        elif isinstance(x, list):
            if len(x) != len(y):
                return False
            stack.extend(zip(x, y, strict=True))
        elif isinstance(x, float):
            if not (x == y or (math.isnan(x) and math.isnan(y))):
                return False
        elif x != y:
            return False
    return True


def nested(depth: int) -> bytes:
    return b'{"a":' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"


READING = {
    # what both refuse
    "nan": b'{"a": NaN}',
    "infinity": b'{"a": Infinity}',
    "minus-infinity": b'{"a": -Infinity}',
    "raw-nul": b'{"a": "x\x00y"}',
    "control-character": b'{"a": "\t"}',
    "invalid-utf8": b'{"a": "\xff"}',
    "trailing-data": b'{"a": 1} x',
    "empty": b"",
    "blank": b"  ",
    "single-quotes": b"{'a': 1}",
    "trailing-comma": b'{"a": 1,}',
    "nested-100000": b"[" * 100_000 + b"]" * 100_000,
    # what orjson refuses and the stdlib accepts: kept accepted
    "overflowing-float": b'{"a": 1e400}',
    "overflowing-negative-float": b'{"a": -1e400}',
    "escaped-lone-surrogate": b'{"a": "\\ud800"}',
    "escaped-reversed-pair": b'{"a": "\\udc00\\ud800"}',
    "encoded-surrogate": b'{"a": "\xed\xa0\x80"}',
    "utf8-bom": b'\xef\xbb\xbf{"a": 1}',
    "utf16": '{"a": 1}'.encode("utf-16"),
    "utf16-le-no-bom": '{"a": 1}'.encode("utf-16-le"),
    "utf32": '{"a": 1}'.encode("utf-32"),
    # what orjson reads differently: integers beyond 64 bits (orjson: floats)
    "two-to-the-64": b'{"a": 18446744073709551616}',
    "below-int64": b'{"a": -9223372036854775809}',
    "thirty-digits": b'{"a": [123456789012345678901234567890]}',
    "u64-max": b'{"a": 18446744073709551615}',
    "int64-min": b'{"a": -9223372036854775808}',
    "long-float": b'{"a": 0.1000000000000000055511151231257827}',
    # the stdlib's int() refuses more digits than sys.get_int_max_str_digits() (4,300)
    "widest-integer": b'{"a": -' + b"9" * sys.get_int_max_str_digits() + b"}",
    "integer-past-the-digit-limit": b'{"a": ' + b"1" * (sys.get_int_max_str_digits() + 1) + b"}",
    # depth: orjson's limit is 1,024 levels, the stdlib's the stack's
    "nested-511": nested(511),
    "nested-512": nested(512),
    "nested-1000": nested(1000),
    "nested-1024": nested(1024),
    "nested-1025": nested(1025),
    "many-brackets-shallow": json.dumps([{"i": i} for i in range(2000)]).encode(),
    # ordinary documents, both ways
    "nul-escaped": b'{"a": "x\\u0000y"}',
    "pair": b'{"a": "\\ud83d\\ude00"}',
    "duplicate-keys": b'{"a": 1, "b": 2, "a": 3}',
    "numbers": b"[0, -0, -0.0, 1.0, 1E2, 1e-400, 5e-324, 1.7976931348623157e308, 0e0]",
    "unicode": '{"é": "☕ \u2028"}'.encode(),
    "huge-string": b'{"a": "' + b"x" * (10 * 1024 * 1024) + b'"}',
}


@pytest.mark.parametrize("raw", READING.values(), ids=READING.keys())
def test_reads_as_the_stdlib_reads(raw: bytes) -> None:
    expected, got = reference(raw), answer(raw)
    assert same(got, expected), (got, expected)


def test_the_edges_read_as_they_always_did() -> None:
    """The stdlib's answers, spelled out: what the codec has always accepted and refused."""
    assert strict_json.loads(READING["two-to-the-64"]) == {"a": 2**64}
    assert strict_json.loads(READING["below-int64"]) == {"a": -(2**63) - 1}
    assert strict_json.loads(READING["escaped-lone-surrogate"]) == {"a": "\ud800"}
    # 1e400 would be read as infinity, which no component can write back as JSON: refused,
    # as orjson refuses it (the stdlib alone used to take it, and a function answering it
    # produced an event the gateway could not read)
    refusals = ("overflowing-float", "overflowing-negative-float", "nan", "infinity")
    for refused in (*refusals, "raw-nul", "invalid-utf8", "empty"):
        with pytest.raises(NotJson):
            strict_json.loads(READING[refused])
    with pytest.raises(TooDeep):
        strict_json.loads(READING["nested-100000"])
    with pytest.raises(TooDeep):  # orjson would have read it (1,024 levels)
        strict_json.loads(READING["nested-1000"])
    assert orjson.loads(READING["nested-1000"])  # which is why the stdlib reads it
    assert strict_json.loads(READING["nested-512"])  # read, by whichever


def test_an_integer_past_the_digit_limit_is_not_json() -> None:
    """int() raises a bare ValueError past sys.get_int_max_str_digits(): it must be NotJson
    like every other refusal, or readers that catch NotJson (the gateway's 400002, the event
    decoder's WireError) crash on it. One digit fewer is read, every digit kept."""
    limit = sys.get_int_max_str_digits()
    assert strict_json.loads(READING["widest-integer"]) == {"a": -int("9" * limit)}
    for raw in (READING["integer-past-the-digit-limit"], "[-" + "7" * (limit + 1) + "]"):
        with pytest.raises(NotJson, match=f"more than {limit} digits"):
            strict_json.loads(raw)


def test_text_is_read_as_well_as_bytes() -> None:
    assert strict_json.loads('{"a": [1, 2.5, "\\ud800"]}') == {"a": [1, 2.5, "\ud800"]}
    with pytest.raises(NotJson):
        strict_json.loads('{"a": NaN}')


def test_raw_control_characters_are_read_only_when_asked() -> None:
    """A newline, a tab or a NUL inside a string, unescaped, is not JSON; a careless writer's
    (a legacy worker's) is read as written when asked, and nothing else changes."""
    for raw in (b'{"e": "a\nb"}', '{"e": "a\tb\x00c"}'):
        with pytest.raises(NotJson):
            strict_json.loads(raw)
    assert strict_json.loads(b'{"e": "a\nb"}', control_characters=True) == {"e": "a\nb"}
    assert strict_json.loads('{"e": "a\tb\x00c"}', control_characters=True) == {"e": "a\tb\x00c"}
    with pytest.raises(NotJson):
        strict_json.loads(b'{"e": NaN}', control_characters=True)


def test_orjson_reads_ordinary_documents_and_the_stdlib_the_rest() -> None:
    fast = strict_json._orjson_reads
    assert fast(b'{"sleep": 1, "id": 123456789012345678, "big": "1234567890"}')
    assert fast(json.dumps([{"i": i} for i in range(FAST_BRACKETS - 2)]).encode())
    assert not fast(b'{"a": 1234567890123456789}')  # 19 digits: perhaps beyond 64 bits
    assert not fast(b'{"a": "a string of 1234567890123456789"}')  # wrongly, but safely
    assert not fast(json.dumps([{"i": i} for i in range(FAST_BRACKETS)]).encode())


def test_the_fast_path_stays_within_the_stdlibs_limit() -> None:
    """What orjson reads is nested fewer than FAST_BRACKETS levels, which the stdlib reads
    even 300 frames down the stack: the two agree wherever orjson answers."""

    def down(frames: int) -> Any:
        return down(frames - 1) if frames else reference(nested(FAST_BRACKETS - 1))

    assert isinstance(down(300), dict)


# Lone surrogates (hypothesis leaves them out of text), NUL, DEL, a JSON-but-not-JS newline.
ODD_CHARACTERS = "\ud800\udbff\udc00\udfff\x00\x7f\u2028"
JSONISH = st.text(alphabet='[]{}",:0123456789.eE+-tfnrulsaNIiy \t\n\\u/é\x00', max_size=60)


def _values() -> st.SearchStrategy[Any]:
    scalars = (
        st.none()
        | st.booleans()
        | st.integers(min_value=-(2**70), max_value=2**70)
        | st.floats(allow_nan=True, allow_infinity=True)
        | st.text(st.characters() | st.sampled_from(ODD_CHARACTERS), max_size=12)
    )
    return st.recursive(
        scalars,
        lambda children: (
            st.lists(children, max_size=5)
            | st.dictionaries(st.text(max_size=5), children, max_size=5)
        ),
        max_leaves=30,
    )


@GENERATED
@given(_values(), st.booleans(), st.booleans())
def test_generated_documents_read_as_the_stdlib_reads(
    value: Any, ascii_only: bool, spaced: bool
) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only, separators=(", ", ": ") if spaced else None)
    raw = text.encode("utf-8", "surrogatepass")
    assert same(answer(raw), reference(raw))


@GENERATED
@given(st.one_of(st.binary(max_size=80), JSONISH.map(lambda t: t.encode())))
def test_generated_bytes_read_as_the_stdlib_reads(raw: bytes) -> None:
    assert same(answer(raw), reference(raw))


# ---------------------------------------------------------------------------
# writing


def stdlib_dumps(value: Any, allow_nan: bool) -> Any:
    try:
        return json.dumps(value, separators=(",", ":"), allow_nan=allow_nan)
    except (ValueError, TypeError) as exc:
        return type(exc)


def ours(value: Any, allow_nan: bool) -> Any:
    try:
        return strict_json.dumps(value, allow_nan=allow_nan).decode("utf-8", "surrogatepass")
    except (ValueError, TypeError) as exc:
        return type(exc)


def same_json(a: Any, b: Any) -> bool:
    """Both refused alike, or both the same JSON (read back by the stdlib, NaN allowed)."""
    if isinstance(a, type) or isinstance(b, type):
        return a is b
    return same(json.loads(a), json.loads(b))


WRITING = {
    "nan": {"a": math.nan},
    "infinity": [1.5, -math.inf],
    "nan-beside-null": {"a": None, "b": [math.nan]},
    "null-alone": {"a": None, "b": [None, 1.0]},
    "two-to-the-64": {"a": 2**64},
    "below-int64": [-(2**63) - 1],
    "lone-surrogate": {"a": "\ud800"},
    "surrogate-key": {"\udc00": 1},
    "int-keys": {2: "a", 2.5: "b", True: "c", None: "d"},
    "tuple": {"a": (1, 2)},
    "nested-300": {"a": json.loads("[" * 299 + "]" * 299)},
    "unicode": {"é": "☕ \u2028 \x7f \x00"},
    "numbers": [0, -0.0, 1e16, 1e-7, 5e-324, 1.7976931348623157e308, 2**63 - 1],
}


@pytest.mark.parametrize("allow_nan", [False, True])
@pytest.mark.parametrize("value", WRITING.values(), ids=WRITING.keys())
def test_writes_what_the_stdlib_writes(value: Any, allow_nan: bool) -> None:
    assert same_json(ours(value, allow_nan), stdlib_dumps(value, allow_nan))


def test_the_edges_write_as_they_always_did() -> None:
    with pytest.raises(ValueError):
        strict_json.dumps({"a": math.nan})  # orjson alone would have written null
    assert strict_json.dumps({"a": math.inf}, allow_nan=True) == b'{"a":Infinity}'
    assert strict_json.dumps({"a": 2**64}) == b'{"a":18446744073709551616}'
    assert strict_json.dumps({"a": "\ud800"}) == b'{"a":"\\ud800"}'
    with pytest.raises(TypeError):
        strict_json.dumps({"a": object()})
    # orjson's own bytes when they say the same: compact UTF-8, nulls and all
    assert strict_json.dumps({"a": None, "é": [1.5]}) == '{"a":null,"é":[1.5]}'.encode()


@GENERATED
@given(_values(), st.booleans())
def test_generated_values_write_as_the_stdlib_writes(value: Any, allow_nan: bool) -> None:
    assert same_json(ours(value, allow_nan), stdlib_dumps(value, allow_nan))


# ---------------------------------------------------------------------------
# the CloudEvents binding's data (conveyor/events.py)

CONTENT_TYPES = [None, "application/json", "application/cloudevents+json", "text/plain"]


def binding_reads(body: bytes, content_type: str | None) -> Any:
    try:
        return JSONFormat().read_data(body, content_type)
    except RecursionError:
        return TooDeep


def codec_reads(body: bytes, content_type: str | None) -> Any:
    """As `_from_wire` reads: strictly first (WireError past it), then through the format."""
    try:
        parsed = strict_json.loads(body) if body else None
    except NotJson:
        return "refused before the binding"
    return events._Format(parsed).read_data(body, content_type)


@pytest.mark.parametrize("content_type", CONTENT_TYPES)
@pytest.mark.parametrize("raw", READING.values(), ids=READING.keys())
def test_event_data_reads_as_the_binding_read_it(raw: bytes, content_type: str | None) -> None:
    ours = codec_reads(raw, content_type)
    if ours == "refused before the binding":  # as before: the body was read strictly first
        assert isinstance(reference(raw), type)
        return
    assert same(ours, binding_reads(raw, content_type))


@GENERATED
@given(
    st.one_of(st.binary(max_size=80), _values().map(lambda v: json.dumps(v).encode())),
    st.sampled_from(CONTENT_TYPES),
)
def test_generated_event_data_reads_as_the_binding_read_it(
    raw: bytes, content_type: str | None
) -> None:
    ours = codec_reads(raw, content_type)
    if ours != "refused before the binding":
        assert same(ours, binding_reads(raw, content_type))


@pytest.mark.parametrize("content_type", CONTENT_TYPES)
@pytest.mark.parametrize("value", WRITING.values(), ids=WRITING.keys())
def test_event_data_writes_as_the_binding_wrote_it(value: Any, content_type: str | None) -> None:
    def written(fmt: JSONFormat) -> Any:
        try:
            return fmt.write_data(value, content_type).decode("utf-8", "surrogatepass")
        except (ValueError, TypeError) as exc:
            return type(exc)

    ours, theirs = written(events._Format()), written(JSONFormat())
    if isinstance(value, dict) and content_type != "text/plain":
        assert same_json(ours, theirs)
    else:
        assert ours == theirs  # not JSON data: the binding's own bytes


@pytest.mark.parametrize(
    ("raw", "said"),
    [
        (b'{"a": [1, 2, NaN]}', "NaN is not JSON"),
        (b'{"a": -Infinity}', "-Infinity is not JSON"),
        (b'{"b": {}, "a": 1e999}', "1e999 is beyond a double"),
    ],
)
def test_a_refused_literal_is_named_with_no_made_up_position(raw: bytes, said: str) -> None:
    """Found by a black-box sweep: each was said to be at "line 1 column 1 (char 0)"."""
    with pytest.raises(strict_json.NotJson) as refused:
        strict_json.loads(raw)
    assert str(refused.value) == said
