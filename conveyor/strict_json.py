"""JSON as every component reads it from others and writes it on the wire: NaN and Infinity are
not JSON (they could not be re-encoded or stored), nor is a number beyond a double (`1e400`,
which would be read as infinity), and nesting deep enough to exhaust the stack is refused rather
than crashing the reader. Integers keep every digit, up to the 4,300 that Python converts
(sys.get_int_max_str_digits()): a longer literal is refused like any other, not a bare ValueError.

What is accepted, refused and meant is the stdlib's; orjson (several times faster) does the work
wherever it is certain to agree, and the stdlib everywhere else, where the two differ:

* reading, orjson refuses what the stdlib takes (an escaped lone surrogate; a UTF-8 byte order
  mark; UTF-16 and UTF-32), so its
  refusals are decided again by the stdlib; it reads integers beyond 64 bits as floats, so a
  run of 19 digits goes to the stdlib; it nests 1,024 levels, the stdlib as deep as the stack
  allows, so a document with many brackets goes to the stdlib too;
* writing, orjson refuses integers beyond 64 bits, lone surrogates, keys that are not strings
  and nesting past 254 levels, which go to the stdlib; it writes NaN and Infinity as `null`,
  so a `null` in its output is checked for them. Its bytes are compact UTF-8, the stdlib's
  escape what is not ASCII: the same JSON.

tests/unit/test_strict_json.py holds each of these edges.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import orjson


class NotJson(ValueError):
    """The bytes are not JSON this platform can carry."""


class TooDeep(NotJson):
    """Nested deeper than the stack allows."""


# Fewer opening brackets than this, and the document is nested within both parsers' limits.
FAST_BRACKETS = 512
# Digits -> "0", opening brackets -> "[", the rest -> " ": one pass finds both reasons to
# leave a document to the stdlib (an integer orjson would turn into a float, deep nesting).
_SHAPE = bytes(
    ord("0") if c in b"0123456789" else ord("[") if c in b"[{" else ord(" ") for c in range(256)
)
_LONG_NUMBER = b"0" * 19  # 2**63 has 19 digits


def loads(raw: bytes | str, *, control_characters: bool = False) -> Any:
    """`control_characters`: a control character inside a string, which JSON wants escaped,
    is read as itself (the stdlib's `strict=False`): for writers known to be careless."""
    if isinstance(raw, bytes) and _orjson_reads(raw):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass  # refused by orjson: the stdlib decides, and says why
    try:
        return json.loads(
            raw,
            parse_constant=_reject,
            parse_float=_finite_float,
            strict=not control_characters,
        )
    except RecursionError:
        raise TooDeep("nested too deep") from None
    except _Unfit as exc:  # the stdlib's hooks know no position: the message says no false one
        raise NotJson(str(exc)) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise NotJson(str(exc)) from None
    except ValueError:  # what remains: int() refusing a literal past Python's limit
        raise NotJson(f"an integer of more than {sys.get_int_max_str_digits()} digits") from None


def dumps(value: Any, *, allow_nan: bool = False, sort_keys: bool = False) -> bytes:
    """Compact JSON. NaN and Infinity raise ValueError unless `allow_nan` (then they are
    written as the stdlib writes them, which no reader here accepts); what is not JSON
    raises TypeError, as json.dumps does. `sort_keys` gives canonical bytes (for hashing)."""
    try:
        fast = orjson.dumps(value, option=orjson.OPT_SORT_KEYS if sort_keys else None)
    except orjson.JSONEncodeError:
        pass
    else:
        if b"null" not in fast or _finite(value):
            return fast
    return json.dumps(
        value, separators=(",", ":"), allow_nan=allow_nan, sort_keys=sort_keys
    ).encode()


def _orjson_reads(raw: bytes) -> bool:
    """Whether orjson's answer, if it gives one, is the stdlib's."""
    shape = raw.translate(_SHAPE)
    if _LONG_NUMBER in shape:
        return False
    return len(raw) < 2 * FAST_BRACKETS or shape.count(b"[") < FAST_BRACKETS


def _finite(value: Any) -> bool:
    """No NaN or Infinity anywhere in `value` (iterative: orjson already bounded its depth)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float):
            if not math.isfinite(item):
                return False
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return True


class _Unfit(ValueError):
    """A literal the hooks below refuse (a sweep read "NaN is not JSON: line 1 column 1 (char
    0)" wherever the NaN was)."""


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise _Unfit(f"{text[:40]} is beyond a double")
    return value


def _reject(name: str) -> Any:
    raise _Unfit(f"{name} is not JSON")
