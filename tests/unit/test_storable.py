"""`conveyor.storable.too_many_items`: how many items a JSON result would hold once read, told
from its bytes, strings' contents aside, in bounded memory."""

from __future__ import annotations

import json
import tracemalloc

import pytest

from conveyor.storable import too_many_items


@pytest.mark.parametrize(
    "value",
    [
        ["a,b", "c[d{", 'e\\",[{', "\\", "\\\\", 'x"', ",,,"],
        {"k,": ["\\\\\\", '"', "[[", {"z": "\\u00e9,"}], "": [1, 2, 3]},
        [[1], {"a": 1}, [{"b": 2}], "\n,\t"],
    ],
)
def test_items_are_counted_outside_strings_whatever_they_escape(value: object) -> None:
    items = _items(value)
    body = json.dumps(value).encode()
    assert not too_many_items(body, max_items=min(items, len(body) - 1))
    assert too_many_items(body, max_items=items - 1) == (len(body) > items - 1)


def _items(value: object) -> int:
    if isinstance(value, dict):
        return 1 + sum(_items(v) for v in value.values())
    if isinstance(value, list):
        return 1 + sum(_items(v) for v in value)
    return 1


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b'["' + b"\\u00e9" * 1_398_000 + b'"]', id="one string of escapes"),
        pytest.param(b"[" + b'"a\\\\",' * 1_500_000 + b"1]", id="many short strings"),
    ],
)
def test_a_result_of_escapes_is_counted_in_bounded_memory(body: bytes) -> None:
    """Found by a black-box sweep: 8 MiB of `\\u00e9` took 192 MB to count (the regex kept
    state per escape), so two such answers at once passed the sidecar's 256 MiB."""
    tracemalloc.start()
    try:
        too_many_items(body)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * len(body), peak
