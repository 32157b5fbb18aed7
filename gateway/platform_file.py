"""The declarative platform file (`conveyor admin apply -f platform.yaml`, SPEC §4).

Keys are exactly the SPEC's; an unknown key is an error that names it, so a
typo never silently drops a setting.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from conveyor.events import MessageFormat
from conveyor.topology import check_name
from gateway import body_schema

_DURATION = re.compile(r"^\s*(\d+)\s*([smhdw]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}

# The columns' range (gateway/models.py: capacities and taskTimeout are `Integer`): a larger
# number is refused here, naming its field, rather than by PostgreSQL as a traceback.
INT4_MAX = 2**31 - 1
# The purge deletes what ended before `now() - retention`, a timestamp that must stay after
# year 1: a longer retention would fail every purge, of every service.
MAX_RETENTION = 1000 * 365 * 86400

Model = TypeVar("Model", bound=BaseModel)


class PlatformError(ValueError):
    pass


def parse_duration(value: Any) -> int:
    """`7d`, `12h`, `30m`, `45s` or a number of seconds, up to MAX_RETENTION."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        seconds = value
    else:
        match = _DURATION.match(str(value))
        if not match or int(match.group(1)) <= 0:
            raise ValueError(f"not a duration: {value!r} (use e.g. 7d, 12h, 30m, 45s)")
        seconds = int(match.group(1)) * _UNITS[match.group(2)]
    if seconds > MAX_RETENTION:
        raise ValueError(f"at most {MAX_RETENTION} seconds (1000 years)")
    return seconds


class ServiceSpec(BaseModel):
    """A service's settings. Its numbers are `strict`: `maxAttempts: true` was applied as 1,
    `taskTimeout: "300"` as 300 (pydantic's lax coercion), a wrong quote silently a setting."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str
    queueName: str | None = None
    capacity: int | None = Field(None, ge=0, le=INT4_MAX, strict=True)
    jsonSchema: dict[str, Any] | None = None
    messageFormat: MessageFormat = MessageFormat.CLOUDEVENTS
    taskTimeout: int = Field(300, gt=0, le=INT4_MAX, strict=True)
    maxAttempts: int = Field(3, ge=1, le=100, strict=True)
    retention: int = 7 * 86400

    _name = field_validator("name", "queueName")(lambda cls, v: v if v is None else check_name(v))

    @field_validator("retention", mode="before")
    @classmethod
    def _retention(cls, value: Any) -> int:
        return parse_duration(value)

    @field_validator("jsonSchema")
    @classmethod
    def _schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            try:
                body_schema.check(value)
            except body_schema.SchemaRefused as exc:
                raise ValueError(str(exc)) from None
        return value

    @property
    def queue(self) -> str:
        return self.queueName or self.name


class GrantSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    service: str
    capacity: int | None = Field(None, ge=0, le=INT4_MAX, strict=True)


MIN_SECRET_BYTES = 8  # counted in bytes, as bcrypt reads them and docs/operations.md says
MAX_SECRET_BYTES = 72  # bcrypt reads no further (and bcrypt 5 refuses longer secrets)


class OperatorSpec(BaseModel):
    """Someone who reads every service through the admin API and the dashboard (SPEC §11.6)."""

    model_config = ConfigDict(extra="forbid")
    id: str
    secret: str | None = None
    secretHash: str | None = None

    _id = field_validator("id")(lambda cls, v: check_name(v))

    @model_validator(mode="after")
    def _one_secret(self) -> OperatorSpec:
        if (self.secret is None) == (self.secretHash is None):
            raise ValueError("give exactly one of secret or secretHash")
        if self.secret is not None and len(self.secret.encode()) < MIN_SECRET_BYTES:
            raise ValueError(f"secret is shorter than {MIN_SECRET_BYTES} bytes")
        if self.secret is not None and len(self.secret.encode()) > MAX_SECRET_BYTES:
            raise ValueError(f"secret is longer than bcrypt's {MAX_SECRET_BYTES} bytes")
        if self.secretHash is not None and not self.secretHash.startswith("$2"):
            raise ValueError("secretHash must be a bcrypt hash ($2b$...)")
        return self


class ClientSpec(OperatorSpec):
    """An operator's credentials plus grants: a consumer of the task API."""

    grants: list[GrantSpec] = Field(default_factory=list)


class PlatformSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    services: list[ServiceSpec] = Field(default_factory=list)
    clients: list[ClientSpec] = Field(default_factory=list)
    operators: list[OperatorSpec] = Field(default_factory=list)

    @model_validator(mode="after")
    def _references(self) -> PlatformSpec:
        """Each name once; one id is a client or an operator, never both (SPEC §11.6)."""
        names = [s.name for s in self.services]
        if len(set(names)) != len(names):
            raise ValueError("a service is declared twice")
        for kind, ids in (
            ("client", [c.id for c in self.clients]),
            ("operator", [o.id for o in self.operators]),
        ):
            twice = sorted(i for i, n in Counter(ids).items() if n > 1)  # ids.count: quadratic
            if twice:
                raise ValueError(f"{kind} declared twice: {', '.join(twice)}")
        both = sorted({c.id for c in self.clients} & {o.id for o in self.operators})
        if both:
            raise ValueError(
                f"both a client and an operator: {', '.join(both)} (clients are never operators)"
            )
        return self


def _describe(error: ValidationError) -> str:
    """One line per error, in the file's terms: our own checks' words without pydantic's
    "Value error, " prefix, and no empty location for the checks of the whole file."""
    lines = []
    for e in error.errors():
        where = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown key '{e['loc'][-1]}' at {where}")
            continue
        message = str(e["ctx"]["error"]) if e["type"] == "value_error" else e["msg"]
        lines.append(f"{where}: {message}" if where else message)
    return "; ".join(lines)


def validate(model: type[Model], data: Any) -> Model:
    """`data` as `model`, or a PlatformError telling what is wrong in one line by field: the
    platform file's and the command line's values are held to the same rules."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise PlatformError(_describe(exc)) from None


class _Loader(yaml.SafeLoader):
    """SafeLoader whose constructors' own errors (`!!int` on a word: a ValueError naming the
    word) become YAML errors at the node's position, like every other problem of the file,
    and which refuses a key given twice in one mapping (PyYAML would keep the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            self._refuse_duplicate_keys(node)
        return super().construct_mapping(node, deep)

    def _refuse_duplicate_keys(self, node: yaml.MappingNode) -> None:
        """The mapping's own scalar keys are unique; keys merged in by `<<` may be overridden."""
        seen: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, str | int | float):
                continue  # not hashable, or not a key a platform file has
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"{_key_name(key)} given twice (first at line {seen[key].line + 1})",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except yaml.YAMLError:
            raise
        except Exception:
            tag = node.tag.removeprefix("tag:yaml.org,2002:")  # a tag with a constructor
            raise yaml.constructor.ConstructorError(
                None, None, f"not a valid !!{tag} value", node.start_mark
            ) from None


_KEYS = frozenset(
    key
    for model in (PlatformSpec, ServiceSpec, GrantSpec, ClientSpec)
    for key in model.model_fields
)


def _key_name(key: object) -> str:
    """A duplicate key by name when it is one of the file's keys, else by kind: any other
    word could be a secret on a misplaced line, and the message goes to logs."""
    return f"key {key}" if isinstance(key, str) and key in _KEYS else "a key"


# A quoted word of PyYAML's problem text (an alias, a tag, a constructor's error) may be a
# secret's start: one character (a tab, an '@') is kept, anything longer is not.
_QUOTED = re.compile(r"(?<!\w)(?:'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")")  # not can't
_ONE_CHARACTER = re.compile(r"^.(?:[^\\]|\\(?:[^xuU]|x\w{2}|u\w{4}|U\w{8})).$")


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """What is wrong and where (line and column), never PyYAML's snippet of the file: the line
    it quotes may be a client's or an operator's plaintext secret, and this goes to logs."""

    def told(text: str) -> str:
        return _QUOTED.sub(lambda m: m[0] if _ONE_CHARACTER.match(m[0]) else "'…'", text)

    if isinstance(exc, yaml.MarkedYAMLError):
        parts = [
            f"{told(text)} at line {mark.line + 1}, column {mark.column + 1}"
            if mark is not None
            else told(text)
            for text, mark in ((exc.context, exc.context_mark), (exc.problem, exc.problem_mark))
            if text
        ]
        if parts:
            return "; ".join(parts)
    if isinstance(exc, yaml.reader.ReaderError):
        code = exc.character if isinstance(exc.character, int) else ord(exc.character)
        return f"unacceptable character #x{code:04x} at position {exc.position}"
    return "unreadable"


def load(text: str) -> PlatformSpec:
    try:
        data = yaml.load(text, Loader=_Loader)  # _Loader is a SafeLoader
    except yaml.YAMLError as exc:
        raise PlatformError(f"not valid YAML: {_yaml_problem(exc)}") from None
    except RecursionError:  # PyYAML's constructor recurses: a file nested ~1,000 deep
        raise PlatformError("not valid YAML: nested too deep") from None
    if data is None:  # an empty file (or only comments); `false`, `0` or `""` are no file
        data = {}
    if not isinstance(data, dict):
        raise PlatformError(
            "the platform file must be a mapping with services, clients and operators"
        )
    return validate(PlatformSpec, data)
