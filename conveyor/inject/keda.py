"""The KEDA objects that scale a dispatcher on its `-in` queue."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from conveyor.inject.documents import (
    DISPATCHER_FOR_LABEL,
    KEDA_API,
    LABEL_VALUE_LIMIT,
    NAME_LIMIT,
    Doc,
    InjectError,
    Key,
    fitted,
    name_of,
)
from conveyor.inject.wiring import Wiring
from conveyor.topology import in_queue

MANAGEMENT_URL_KEY = "management-url"  # http://user:pass@rabbitmq:15672/vhost, for KEDA
# KEDA puts a ScaledObject's or ScaledJob's name in label values (`scaledobject.keda.sh/name`,
# `scaledjob.keda.sh/name`, the HPA's `app.kubernetes.io/part-of`) and names the HPA
# `keda-hpa-<name>`: its admission webhook refuses names over 54 characters.
SCALED_NAME_LIMIT = 54


@dataclass
class Companions:
    """The KEDA objects (and knative dispatcher Deployments) found in the input,
    so that re-injecting updates them instead of adding duplicates."""

    found: dict[Key, Doc]
    claimed: set[Key]

    def take(self, kind: str, namespace: str | None, name: str) -> Doc | None:
        key = (kind, namespace or "", name)
        if key in self.found:
            self.claimed.add(key)
            return self.found[key]
        return None


def dispatcher_labels(name: str, component: str) -> Doc:
    value = fitted(name, LABEL_VALUE_LIMIT)
    return {
        "app.kubernetes.io/name": value,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": "conveyor",
        DISPATCHER_FOR_LABEL: value,
    }


def dispatcher_selector(name: str) -> Doc:
    """The labels that select a knative-mode dispatcher's pods."""
    labels = dispatcher_labels(name, "dispatcher")
    return {key: labels[key] for key in ("app.kubernetes.io/name", "app.kubernetes.io/component")}


def scaled_name(target: str) -> str:
    """The name of the ScaledObject or ScaledJob of workload ``target``: its own, shortened with
    a hash past what KEDA takes (the same every time, so that re-injection finds it)."""
    return fitted(target, SCALED_NAME_LIMIT)


def auth_name(name: str) -> str:
    """The TriggerAuthentication of workload ``name``'s KEDA objects: named after the
    ScaledObject or ScaledJob, so that a switch of mode and the ScaledJob's re-injection
    (whose name it is then) find the same one."""
    return fitted(f"{scaled_name(name)}-rabbitmq", NAME_LIMIT)


def object_metadata(name: str, namespace: str | None, labels: Doc) -> Doc:
    meta: Doc = {"name": name}
    if namespace:
        meta["namespace"] = namespace
    meta["labels"] = labels
    return meta


def rabbitmq_trigger(wiring: Wiring, auth_name: str) -> Doc:
    """KEDA's RabbitMQ scaler through the management API (counts unacked messages)."""
    return {
        "type": "rabbitmq",
        "metadata": {
            "protocol": "http",
            "mode": "QueueLength",
            # What one replica holds unacked, which protocol http counts: CONCURRENCY + buffer.
            "value": str(wiring.prefetch),
            "activationValue": "0",
            "queueName": in_queue(wiring.queue),
        },
        "authenticationRef": {"name": auth_name},
    }


def _update(existing: Doc | None, fresh: Doc, derived: Iterable[str]) -> Doc:
    """Keeps an existing object's other fields (user edits) and rewrites the derived ones."""
    if existing is None:
        return fresh
    for key, value in fresh.items():
        if key in {"apiVersion", "kind"}:
            existing[key] = value
        elif key == "metadata":
            meta = existing.setdefault("metadata", {})
            meta["name"] = value["name"]
            meta.setdefault("labels", {}).update(value["labels"])
        elif key == "spec":
            spec = existing.setdefault("spec", {})
            for skey, svalue in value.items():
                if skey in derived:
                    spec[skey] = svalue
                else:
                    spec.setdefault(skey, svalue)
    return existing


def trigger_authentication(
    name: str, namespace: str | None, wiring: Wiring, existing: Doc | None
) -> Doc:
    fresh = {
        "apiVersion": KEDA_API,
        "kind": "TriggerAuthentication",
        "metadata": object_metadata(
            auth_name(name), namespace, dispatcher_labels(name, "autoscaling")
        ),
        "spec": {
            "secretTargetRef": [
                {"parameter": "host", "name": wiring.amqp_secret, "key": MANAGEMENT_URL_KEY}
            ]
        },
    }
    return _update(existing, fresh, {"secretTargetRef"})


def _scaled_object(
    target: str, name: str, namespace: str | None, wiring: Wiring, existing: Doc | None
) -> Doc:
    fresh = {
        "apiVersion": KEDA_API,
        "kind": "ScaledObject",
        "metadata": object_metadata(
            scaled_name(target), namespace, dispatcher_labels(name, "autoscaling")
        ),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": target},
            "pollingInterval": 5,
            "cooldownPeriod": 120,
            "minReplicaCount": 0,
            "maxReplicaCount": 10,
            "triggers": [rabbitmq_trigger(wiring, auth_name(name))],
        },
    }
    return _update(existing, fresh, {"scaleTargetRef", "triggers"})


def keda_objects(
    target: str, name: str, namespace: str | None, wiring: Wiring, companions: Companions
) -> list[Doc]:
    """TriggerAuthentication + ScaledObject for a Deployment named ``target``."""
    auth = companions.take("TriggerAuthentication", namespace, auth_name(name))
    scaled = companions.take("ScaledObject", namespace, scaled_name(target))
    refuse_other_scalers(companions, namespace, target)
    return [
        trigger_authentication(name, namespace, wiring, auth),
        _scaled_object(target, name, namespace, wiring, scaled),
    ]


def _scaled_deployment(doc: Doc) -> str | None:
    """The name of the Deployment a ScaledObject scales (KEDA's default kind), or None."""
    ref = (doc.get("spec") or {}).get("scaleTargetRef")
    if not isinstance(ref, dict) or ref.get("kind", "Deployment") != "Deployment":
        return None
    return ref.get("name")


def refuse_other_scalers(companions: Companions, namespace: str | None, target: str) -> None:
    """KEDA refuses a second ScaledObject for one workload (and two autoscalers of one queue
    would fight): one of the user's beside inject's (claimed already) is an error, not a
    silent pair."""
    for key, doc in companions.found.items():
        if key[:2] != ("ScaledObject", namespace or "") or key in companions.claimed:
            continue
        if _scaled_deployment(doc) == target:
            raise InjectError(
                f"{name_of(doc)} also scales Deployment {target}, which inject scales on its "
                "queue: KEDA takes one ScaledObject per workload; remove it"
            )


def drop_own_scaled_object(companions: Companions, namespace: str | None, name: str) -> None:
    """Job mode replaces the Deployment that a sidecar-mode injection scaled: the ScaledObject
    that injection wrote (its name and dispatcher-for label) goes, or it and the ScaledJob
    would both start consumers of the queue."""
    found = companions.found.get(("ScaledObject", namespace or "", scaled_name(name)))
    labels = ((found or {}).get("metadata") or {}).get("labels") or {}
    if labels.get(DISPATCHER_FOR_LABEL) == fitted(name, LABEL_VALUE_LIMIT):
        companions.take("ScaledObject", namespace, scaled_name(name))
