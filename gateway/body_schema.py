"""A service's JSON Schema for task bodies: checked when it is written, applied to every body.

What a schema must never do to the gateway, whose event loop serves every service:

* **fetch**. jsonschema resolves a `$ref` it does not hold by downloading it (`urlopen`, on the
  loop, without a timeout): a schema referring to a URL froze the gateway for as long as the URL
  did not answer, and let a schema author make the gateway fetch any address (SSRF, SPEC §3.3).
  A schema may refer to itself and to the JSON Schema meta-schemas, which jsonschema ships;
  `check` refuses any other reference when the schema is applied, and the validators resolve
  nothing else (a schema written by other hands fails its bodies' checks, 400001, saying so).
* **take quadratic time**. jsonschema checks `uniqueItems` by sorting, or, when the items do
  not sort (objects), by comparing every pair: 6,000 objects, 77 KB, held the loop 22 s. Items
  are compared here by a hashable key with JSON Schema's equality (1 and 1.0 equal, true and 1
  not, objects whatever their keys' order), in one pass.
* **recurse for ever**. A `$ref` chain that comes back on itself (`{"$ref": "#"}`) is refused
  by `check`; a loop it cannot see (through `allOf`) refuses its bodies when Python's stack ends.

* **take unbounded time**. A `pattern` is Python's `re`, and one that backtracks (`^(a+)+$`)
  takes twice as long with each character of a body's string: 30 characters held every service
  for seconds, 40 for hours. A body's check has CHECK_BUDGET seconds (a SIGALRM timer while it
  runs on the main thread, which `re` hears between steps of its match); past it the body is
  refused (400001) saying so.

Validators are compiled once per (service, updated_at): service definitions change rarely
(`conveyor admin apply`), bodies arrive at every request.
"""

from __future__ import annotations

import math
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from datetime import datetime
from typing import Any

import jsonschema
import referencing.exceptions
import referencing.jsonschema
from jsonschema_specifications import REGISTRY as META_SCHEMAS

from conveyor import storable, strict_json
from gateway.catalog import Service

MAX_ERRORS = 20
MAX_SCHEMA_VALUES = 200_000  # objects, arrays and values of a service's schema
MAX_MESSAGE = 500
CHECK_BUDGET = 2.0  # seconds of the event loop one body's check may take
_REFERENCES = ("$ref", "$dynamicRef", "$recursiveRef")


class SchemaRefused(ValueError):
    """Not a schema the gateway applies; the message says why."""


def check(schema: dict[str, Any]) -> None:
    """Raise SchemaRefused unless `schema` is a valid JSON Schema whose every reference
    resolves without fetching anything."""
    _storable(schema)
    try:
        _check(schema)
    except RecursionError:
        raise SchemaRefused("invalid JSON Schema: nested too deep") from None


def _storable(schema: dict[str, Any]) -> None:
    """JSON that PostgreSQL can store, of MAX_SCHEMA_VALUES values at most, counted as they are
    used, before anything else walks it. A sweep found a platform file's YAML that jsonSchema
    took for a schema and the database did not (a NUL, `!!binary`, `!!set`, `.nan`: tracebacks),
    and 549 bytes of YAML aliases that expanded to a schema of 80 MB, stored, then read by every
    gateway at each refresh of its catalog (1.75 GB, its event loop held 3 s each time)."""
    values = 0
    stack: list[Any] = [schema]
    while stack:
        item = stack.pop()
        values += 1
        if values > MAX_SCHEMA_VALUES:
            raise SchemaRefused(
                f"more than {MAX_SCHEMA_VALUES} values (YAML aliases count where they are used)"
            )
        if isinstance(item, dict):
            for key, value in item.items():
                if not isinstance(key, str):
                    raise SchemaRefused(f"a key that is not a string ({type(key).__name__})")
                _storable_text(key)
                stack.append(value)
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            _storable_text(item)
        elif isinstance(item, float) and not math.isfinite(item):
            raise SchemaRefused("NaN and Infinity are not JSON")
        elif not (item is None or isinstance(item, bool | int | float)):
            raise SchemaRefused(f"a {type(item).__name__} is not JSON")


def _storable_text(text: str) -> None:
    if storable.text(text) != text:
        raise SchemaRefused("a NUL character or a lone surrogate, which the database cannot store")


def _check(schema: dict[str, Any]) -> None:
    cls = jsonschema.validators.validator_for(schema)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise SchemaRefused(f"invalid JSON Schema: {exc.message}") from None
    specification = referencing.jsonschema.specification_with(
        cls.ID_OF(cls.META_SCHEMA) or "", default=referencing.jsonschema.DRAFT202012
    )
    resource = specification.create_resource(schema)
    registry = META_SCHEMAS.with_resource(resource.id() or "", resource).crawl()
    _resolve_references(registry.resolver(resource.id() or ""), resource)


def _resolve_references(resolver: Any, resource: Any) -> None:
    contents = resource.contents
    if isinstance(contents, dict):
        for keyword in _REFERENCES:
            reference = contents.get(keyword)
            if not isinstance(reference, str):
                continue
            try:
                _follow(resolver, reference, contents)
            except referencing.exceptions.Unresolvable:
                raise SchemaRefused(
                    f"invalid JSON Schema: {keyword} {reference[:200]!r} does not resolve within "
                    "the schema; the gateway fetches no schema (use $defs and '#/$defs/…')"
                ) from None
    for subresource in resource.subresources():
        _resolve_references(resolver.in_subresource(subresource), subresource)


def _follow(resolver: Any, reference: str, start: dict[str, Any]) -> None:
    """Follows a chain of `$ref`s to a schema that is no `$ref` alone; SchemaRefused if the
    chain comes back on itself (`{"$ref": "#"}`): every body's check would recurse for ever."""
    seen = {id(start)}
    while True:
        resolved = resolver.lookup(reference)
        target = resolved.contents
        if id(target) in seen:
            raise SchemaRefused(
                f"invalid JSON Schema: $ref {reference[:200]!r} refers back to itself"
            )
        seen.add(id(target))
        if not isinstance(target, dict) or not isinstance(target.get("$ref"), str):
            return
        resolver, reference = resolved.resolver, target["$ref"]


def _json_key(value: Any) -> Any:
    """Equal keys for values JSON Schema calls equal (`jsonschema._utils.equal`)."""
    if isinstance(value, bool) or value is None:
        return (0, value)
    if isinstance(value, int | float):
        return (1, value)
    if isinstance(value, str):
        return (2, value)
    if isinstance(value, list):
        return (3, tuple(_json_key(item) for item in value))
    if isinstance(value, dict):
        return (4, frozenset((key, _json_key(item)) for key, item in value.items()))
    return (5, repr(value))


def _unique_items(
    validator: Any, unique: Any, instance: Any, schema: Any
) -> Iterator[jsonschema.ValidationError]:
    if not unique or not validator.is_type(instance, "array"):
        return
    seen: set[Any] = set()
    for item in instance:
        key = _json_key(item)
        if key in seen:
            yield jsonschema.ValidationError(f"{instance!r} has non-unique elements")
            return
        seen.add(key)


def _validator_class(schema: dict[str, Any]) -> Any:
    base = jsonschema.validators.validator_for(schema)
    return jsonschema.validators.extend(base, {"uniqueItems": _unique_items})


class _OutOfTime(Exception):
    """A body's check outran CHECK_BUDGET."""


@contextmanager
def _budget(seconds: float) -> Iterator[None]:
    """Raises _OutOfTime inside the block once `seconds` have passed. Only on the main thread
    (where the gateway's event loop runs, and the only one Python delivers signals to); the
    handler does nothing once the block is left, should the signal arrive just after."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(
        signal, "setitimer"
    ):
        yield
        return
    armed = [True]

    def expire(signum: int, frame: object) -> None:
        if armed[0]:
            raise _OutOfTime

    began = time.monotonic()
    previous = signal.signal(signal.SIGALRM, expire)
    others_left, others_interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        armed[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if others_left:  # someone else's timer (a test runner's): given back what it had left
            left = max(others_left - (time.monotonic() - began), 0.001)
            signal.setitimer(signal.ITIMER_REAL, left, others_interval)


class SchemaCache:
    def __init__(self) -> None:
        self._validators: dict[tuple[str, datetime], tuple[Any, bool]] = {}

    def errors(self, service: Service, body: Any) -> list[dict[str, str]]:
        if not service.json_schema:
            return []
        validator, regexes = self._validator(service)
        try:
            with _budget(CHECK_BUDGET) if regexes else nullcontext():
                errors = list(validator.iter_errors(body))
        except _OutOfTime:
            message = f"not checked against the service's JSON Schema within {CHECK_BUDGET:g} s"
            return [{"path": "body", "message": message}]
        except referencing.exceptions.Unresolvable as exc:
            message = f"the service's JSON Schema cannot be applied: {exc}"
            return [{"path": "body", "message": message[:MAX_MESSAGE]}]
        except RecursionError:  # references that loop without `check` seeing it (`allOf`)
            message = "the service's JSON Schema cannot be applied: its references loop"
            return [{"path": "body", "message": message}]
        return [
            {
                "path": "body" + "".join(f"/{p}" for p in e.absolute_path),
                "message": e.message[:MAX_MESSAGE],
            }
            for e in sorted(errors, key=lambda e: list(e.absolute_path))[:MAX_ERRORS]
        ]

    def _validator(self, service: Service) -> tuple[Any, bool]:
        """The service's validator, and whether its schema holds regular expressions (the
        only keywords left whose time a body can make unbounded: only their checks pay for
        the budget's timer, four system calls)."""
        key = (service.name, service.updated_at)
        found = self._validators.get(key)
        if found is None:
            cls = _validator_class(service.json_schema or {})
            validator = cls(
                service.json_schema, registry=META_SCHEMAS, format_checker=cls.FORMAT_CHECKER
            )
            found = (validator, b'"pattern' in strict_json.dumps(service.json_schema))
            self._validators = {k: v for k, v in self._validators.items() if k[0] != service.name}
            self._validators[key] = found
        return found
