"""JSON that PostgreSQL can store: no NUL character, which neither `text` nor `jsonb` holds.

What a function or a worker answers reaches a task row in two ways: through a dispatcher,
which cleans a function's answer before it publishes it, and straight from a legacy or
third-party worker's event on `-out`, which the gateway cleans before it writes it. Both
replace NUL with U+FFFD, in keys and in strings alike, here.
"""

from __future__ import annotations

from typing import Any

NUL = "\x00"
REPLACEMENT = "\ufffd"
ESCAPED_NUL = b"\\u0000"  # how a NUL looks in serialized JSON: the cheap test before a walk


class TooDeep(ValueError):
    """Nested deeper than the caller allows."""


def text(value: str) -> str:
    return value.replace(NUL, REPLACEMENT)


def storable(value: Any, max_depth: int | None = None) -> Any:
    """A copy of `value` without NUL characters; TooDeep past `max_depth` (when given).
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
