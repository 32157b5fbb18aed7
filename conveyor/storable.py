"""JSON that PostgreSQL can store: no NUL character, which neither `text` nor `jsonb` holds,
and no lone surrogate (half of a UTF-16 pair, which JSON may escape as `\\ud800`), which jsonb
refuses and UTF-8 cannot encode.

What a function or a worker answers reaches a task row in two ways: through a dispatcher,
which cleans a function's answer before it publishes it, and straight from a legacy or
third-party worker's event on `-out`, which the gateway cleans before it writes it. Both
replace either with U+FFFD, in keys and in strings alike, here: the task ends as the function
said, not FAILURE for a character.
"""

from __future__ import annotations

import re
from typing import Any

REPLACEMENT = "\ufffd"
ERROR_LIMIT = 4096  # bytes of an errorMessage kept, UTF-8: a function's, or a worker's
# Python reads a well-formed escaped pair as one character: a surrogate left in a str is lone.
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
# How either looks in serialized JSON: the cheap test before a walk. A pair that the stdlib
# escapes (an emoji, written ASCII-only) matches too, and the walk then changes nothing.
_ESCAPED = re.compile(rb"\\u0000|\\u[dD][89a-fA-F]")


# The most items (objects, arrays, values) of a function's or a worker's JSON result that is
# read: a dispatcher's MAX_RESPONSE_ITEMS at most, and what the gateway reads off `-out`.
MAX_ITEMS = 1_000_000
# A string once its escapes are gone: one repeat of one class, which `re` matches without the
# state per repetition that a group of alternatives keeps (a sweep: 192 MB for 8 MiB of `\u00e9`).
_BARE_STRING = re.compile(rb'"[^"]*"')
_SLICE = 1 << 18
_OPENS_CONTAINER = re.compile(rb"[ \t\r\n]*[\[{]")


def too_many_items(body: bytes, max_items: int = MAX_ITEMS) -> bool:
    """Whether a JSON object or array would hold more than `max_items` items once read: each
    object, array and value (counted by its brackets and commas, strings' contents aside).
    Read, a JSON value is a Python object: 8 MiB of `[{},…]` made 2.8 million dicts, 200 MB
    in a dispatcher (whose container allows 256 MiB for CONCURRENCY answers), ~400 MB in the
    gateway (512 MiB), which reads it again after a crash. Such a result fails its task, as
    one over MAX_RESPONSE_BYTES does. A body that opens no object or array holds one item,
    or is not JSON (text with commas)."""
    if len(body) <= max_items or not _OPENS_CONTAINER.match(body):
        return False
    unescaped = body.replace(b"\\\\", b"").replace(b'\\"', b"")  # `\\` first: `\\"` ends one
    items = 1
    start = 0
    while start < len(unescaped):  # a slice at a time: a sub's pieces are a list (~3 per string)
        end = min(start + _SLICE, len(unescaped))
        if unescaped.count(b'"', start, end) % 2:  # ends inside a string: take all of it
            end = unescaped.find(b'"', end) + 1 or len(unescaped)
        bare = _BARE_STRING.sub(b'""', unescaped[start:end])
        items += bare.count(b",") + bare.count(b"[") + bare.count(b"{")
        if items > max_items:
            return True
        start = end
    return False


def suspect(serialized: bytes) -> bool:
    """Whether JSON text may hold what PostgreSQL refuses (else no walk is needed)."""
    return b"\\u" in serialized and _ESCAPED.search(serialized) is not None


class TooDeep(ValueError):
    """Nested deeper than the caller allows."""


def text(value: str) -> str:
    return _UNSTORABLE.sub(REPLACEMENT, value)


def truncate(value: str, limit: int = ERROR_LIMIT) -> str:
    """At most `limit` bytes of UTF-8, cut on a character boundary, and storable: an error
    message may quote what a function sent (a header aiohttp decoded with surrogate escapes
    holds lone surrogates, which no UTF-8 encoder takes)."""
    value = text(value)
    encoded = value.encode()
    if len(encoded) <= limit:
        return value
    return encoded[:limit].decode("utf-8", errors="ignore")


def check_depth(value: Any, max_depth: int) -> None:
    """TooDeep if `value` nests deeper than `max_depth`; copies nothing, and holds one iterator
    per level (a copy held a stack entry per value: 8 MiB of `[{},…]` peaked at 540 MB)."""
    levels: list[Any] = [iter((value,))]
    while levels:
        for item in levels[-1]:
            if isinstance(item, dict | list):
                if len(levels) > max_depth:
                    raise TooDeep(f"nested deeper than {max_depth} levels")
                levels.append(iter(item.values() if isinstance(item, dict) else item))
                break
        else:
            levels.pop()


def storable(value: Any, max_depth: int | None = None) -> Any:
    """A copy of `value` without NUL or lone surrogates; TooDeep past `max_depth` (when given).
    Iterative, so that no value can exhaust the stack."""
    root: list[Any] = [None]
    stack: list[tuple[Any, Any, Any, int]] = [(value, root, 0, 1)]
    while stack:
        item, parent, key, depth = stack.pop()
        if isinstance(item, str):
            parent[key] = text(item)
        elif isinstance(item, dict | list):
            if max_depth is not None and depth > max_depth:
                raise TooDeep(f"nested deeper than {max_depth} levels")
            if isinstance(item, dict):
                copy: Any = {}
                for k, v in item.items():
                    clean = text(k)
                    copy[clean] = None
                    stack.append((v, copy, clean, depth + 1))
            else:
                copy = [None] * len(item)
                stack.extend((v, copy, i, depth + 1) for i, v in enumerate(item))
            parent[key] = copy
        else:
            parent[key] = item
    return root[0]
