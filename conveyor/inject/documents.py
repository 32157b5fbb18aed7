"""Manifests as data: YAML in and out, and what each object is to inject."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from typing import Any

import yaml

Doc = dict[str, Any]


KEDA_API = "keda.sh/v1alpha1"
KNATIVE_API = "serving.knative.dev/v1"
NETWORK_API = "networking.k8s.io/v1"
PASSTHROUGH_KINDS = {
    ("v1", "ConfigMap"),
    ("v1", "Secret"),
    ("v1", "Service"),
    ("v1", "ServiceAccount"),
}


# On every object inject generates: whose dispatcher it is. It also tells a
# knative dispatcher Deployment apart from a function's Deployment on re-injection.
DISPATCHER_FOR_LABEL = "conveyor.io/dispatcher-for"
LABEL_VALUE_LIMIT = 63  # Kubernetes' limit on a label value
NAME_LIMIT = 253  # on an object's name (a DNS subdomain), a Deployment's included
DNS_LABEL_LIMIT = 63  # on a Knative Service's name (a DNS-1035 label)
# Kubernetes' rules for names (apimachinery's validation), whole: ASCII only, as there.
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_DNS_1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


class InjectError(ValueError):
    """The input cannot be injected; the message says why, for a human."""


class _Dumper(yaml.SafeDumper):
    """Never writes anchors: every manifest stays readable and self-contained."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


# Deeper than any Kubernetes object: past it, copying and writing the manifest would exhaust
# Python's stack (a traceback instead of an error).
MAX_DEPTH = 100
# What aliases may expand to: `*a` repeated inside anchors nests exponentially ("billion laughs").
MAX_VALUES = 1_000_000


def load_documents(text: str) -> list[Doc]:
    """Parses multi-document YAML; empty documents are skipped. Anchors and aliases are
    expanded into copies: inject edits the function's container in place, and a `*sc` shared
    with another container must not carry those edits there."""
    try:
        raw = list(yaml.safe_load_all(text))
    except yaml.YAMLError as exc:
        raise InjectError(f"malformed YAML: {_one_line(str(exc))}") from None
    except RecursionError:
        raise InjectError(f"malformed YAML: nested more than {MAX_DEPTH} deep") from None
    budget = [MAX_VALUES]
    docs = [_unshared(d, 0, budget) for d in raw if d is not None]
    for index, doc in enumerate(docs, start=1):
        if not isinstance(doc, dict):
            raise InjectError(f"document {index} is not a mapping (a Kubernetes object)")
        if not isinstance(doc.get("kind"), str) or not isinstance(doc.get("apiVersion"), str):
            raise InjectError(f"document {index} has no apiVersion or kind")
    return docs


def dump_documents(docs: Iterable[Doc]) -> str:
    """Multi-document YAML, keys in insertion order, no anchors."""
    return yaml.dump_all(
        list(docs),
        Dumper=_Dumper,
        explicit_start=True,
        sort_keys=False,
        default_flow_style=False,
        width=4096,
        allow_unicode=True,
    )


def _unshared(value: Any, depth: int, budget: list[int]) -> Any:
    """``value`` with every mapping and list a fresh one (what aliases share, copied)."""
    budget[0] -= 1
    if depth > MAX_DEPTH:
        raise InjectError(f"malformed YAML: nested more than {MAX_DEPTH} deep")
    if budget[0] < 0:
        raise InjectError(f"malformed YAML: its aliases expand to over {MAX_VALUES} values")
    if isinstance(value, dict):
        return {key: _unshared(item, depth + 1, budget) for key, item in value.items()}
    if isinstance(value, list):
        return [_unshared(item, depth + 1, budget) for item in value]
    return value


def _one_line(text: str) -> str:
    return " ".join(text.split())


Key = tuple[str, str, str]


def classify(doc: Doc) -> str:
    api, kind = doc["apiVersion"], doc["kind"]
    if _is_generated_dispatcher(doc) or (
        api == KEDA_API and kind in {"ScaledObject", "TriggerAuthentication"}
    ):
        return "companion"
    if (api, kind) in {("apps/v1", "Deployment"), ("batch/v1", "Job"), (KEDA_API, "ScaledJob")}:
        return "workload"
    if (api, kind) == (KNATIVE_API, "Service"):
        return "workload"
    if (api, kind) in PASSTHROUGH_KINDS:
        return "passthrough"
    raise InjectError(
        f"unsupported kind {kind} ({api}) in {name_of(doc)}: conveyor inject wires a "
        "Deployment, a Job or a Knative Service, and passes ConfigMap, Secret, "
        "Service and ServiceAccount through"
    )


def _is_generated_dispatcher(doc: Doc) -> bool:
    meta: Doc = doc["metadata"] if isinstance(doc.get("metadata"), dict) else {}
    labels: Doc = meta["labels"] if isinstance(meta.get("labels"), dict) else {}
    generated = {("apps/v1", "Deployment"), (NETWORK_API, "NetworkPolicy")}
    return (doc.get("apiVersion"), doc.get("kind")) in generated and DISPATCHER_FOR_LABEL in labels


def object_key(doc: Doc) -> Key:
    meta: Doc = doc["metadata"] if isinstance(doc.get("metadata"), dict) else {}
    return (doc["kind"], str(meta.get("namespace") or ""), str(meta.get("name") or ""))


def name_of(doc: Doc) -> str:
    meta = doc.get("metadata")
    name = meta.get("name") if isinstance(meta, dict) else None
    return f"{doc.get('kind', 'object')} {name}" if name else f"a {doc.get('kind', 'object')}"


def fitted(text: str, limit: int) -> str:
    """``text``, or when longer than ``limit`` its start and a hash of the whole: a Deployment's
    name may take 253 characters, a label value 63, and a name inject derives from it must
    stay a valid one (the same for the same name, so that re-injection finds its objects)."""
    if len(text) <= limit:
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    return f"{text[: limit - len(digest) - 1].rstrip('-._')}-{digest}"


def check_object_name(name: str, what: str, *, dns_label: bool = False) -> str:
    """``name`` if Kubernetes takes it as an object's name (a DNS-1123 subdomain; a DNS-1035
    label with ``dns_label``), else refused, naming ``what`` gave it: inject derives names,
    labels and references from it, which `kubectl apply` would refuse one by one."""
    if dns_label:
        valid = len(name) <= DNS_LABEL_LIMIT and _DNS_1035_LABEL.fullmatch(name)
        rule = f"a DNS-1035 label: at most {DNS_LABEL_LIMIT} lowercase letters, digits or '-'"
        ends = "the first a letter, the last a letter or digit"
    else:
        valid = len(name) <= NAME_LIMIT and _DNS_SUBDOMAIN.fullmatch(name)
        rule = f"a DNS-1123 subdomain: at most {NAME_LIMIT} lowercase letters, digits, '-' or '.'"
        ends = "each part between dots starting and ending with a letter or digit"
    if not valid:
        raise InjectError(f"{what} {name!r} is not a name Kubernetes takes; use {rule}, {ends}")
    return name


def workload_name(doc: Doc) -> str:
    """A workload's name, as its kind takes it: a Knative Service's is a DNS-1035 label (Knative
    names the Kubernetes Services it creates after it; inject, its URL), any other's a subdomain."""
    if not isinstance(doc.get("metadata"), dict) or not isinstance(doc.get("spec", {}), dict):
        raise InjectError(f"{name_of(doc)}: metadata and spec must be mappings")
    name = doc["metadata"].get("name")
    if not isinstance(name, str) or not name:
        raise InjectError(f"{name_of(doc)} has no metadata.name")
    knative = doc["apiVersion"] == KNATIVE_API
    what = f"{'Knative ' if knative else ''}{doc['kind']}'s metadata.name"
    return check_object_name(name, what, dns_label=knative)
