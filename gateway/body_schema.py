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

A `pattern` is still Python's `re`, on the loop: one that backtracks without end holds it (the
README's known gaps).

Validators are compiled once per (service, updated_at): service definitions change rarely
(`conveyor admin apply`), bodies arrive at every request.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import Any

import jsonschema
import referencing.exceptions
import referencing.jsonschema
from jsonschema_specifications import REGISTRY as META_SCHEMAS

from gateway.catalog import Service

MAX_ERRORS = 20
MAX_MESSAGE = 500
_REFERENCES = ("$ref", "$dynamicRef", "$recursiveRef")


class SchemaRefused(ValueError):
    """Not a schema the gateway applies; the message says why."""


def check(schema: dict[str, Any]) -> None:
    """Raise SchemaRefused unless `schema` is a valid JSON Schema whose every reference
    resolves without fetching anything."""
    try:
        _check(schema)
    except RecursionError:
        raise SchemaRefused("invalid JSON Schema: nested too deep") from None


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


class SchemaCache:
    def __init__(self) -> None:
        self._validators: dict[tuple[str, datetime], Any] = {}

    def errors(self, service: Service, body: Any) -> list[dict[str, str]]:
        if not service.json_schema:
            return []
        validator = self._validator(service)
        try:
            found = sorted(validator.iter_errors(body), key=lambda e: list(e.absolute_path))
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
            for e in found[:MAX_ERRORS]
        ]

    def _validator(self, service: Service) -> Any:
        key = (service.name, service.updated_at)
        validator = self._validators.get(key)
        if validator is None:
            cls = _validator_class(service.json_schema or {})
            validator = cls(
                service.json_schema, registry=META_SCHEMAS, format_checker=cls.FORMAT_CHECKER
            )
            self._validators = {k: v for k, v in self._validators.items() if k[0] != service.name}
            self._validators[key] = validator
        return validator
