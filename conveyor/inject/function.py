"""What SPEC §8 asks of every container, filled in on the function's when its author left it out.

A function author writes the image and the port, nothing more (SPEC §1). Inject adds what a
reviewer expects of each container: resource requests and limits, a non-root, restricted
`securityContext`, and readiness and liveness probes on the function's port. Every field the
author set is kept as written; only missing ones are filled, so injecting the output again
changes nothing. The values are those of the shipped sleeper (keda/sleeper-sidecar/).
"""

from __future__ import annotations

import posixpath
from typing import Any

from conveyor.inject.documents import Doc, InjectError

# Requests and limits of a function that says nothing: the shipped sleeper's CPU, with more
# memory headroom since the runtime is unknown (a Node or Python web server idles at 30-80 MiB).
FUNCTION_REQUESTS = {"cpu": "50m", "memory": "64Mi"}
FUNCTION_LIMITS = {"cpu": "500m", "memory": "256Mi"}
# The non-root user and group every Conveyor image runs as (dispatcher/Dockerfile,
# functions/sleeper/Dockerfile): an image whose USER is root or a name (which the kubelet
# cannot check against runAsNonRoot) still starts.
NON_ROOT_ID = 10001
FUNCTION_TMP_VOLUME = "conveyor-function-tmp"
# Privileges that Kubernetes refuses to combine with allowPrivilegeEscalation: false.
_ESCALATING_CAPABILITIES = {"SYS_ADMIN", "CAP_SYS_ADMIN"}


def harden_function(container: Doc, pod: Doc, port: int | None, *, knative: bool) -> None:
    """Fills in the function container's resources, securityContext and probes.

    ``port`` is where the function listens (None in knative mode: Knative probes its serving
    port itself, and rejects any other). In a pod of inject's own (sidecar and job modes) the
    root filesystem becomes read-only with an emptyDir on /tmp, as for the dispatcher; a Knative
    Service gets neither, since Knative accepts emptyDir volumes only behind a feature flag.
    """
    where = f"container {container.get('name', '(unnamed)')!r}"
    _fill_resources(container, where)
    _fill_security_context(container, pod, where, read_only=not knative)
    _fill_probes(container, port)


def _mapping(parent: Doc, key: str, where: str) -> Doc:
    value = parent.get(key)
    if value is None:
        value = parent[key] = {}
    if not isinstance(value, dict):
        raise InjectError(f"{where}: {key} must be a mapping")
    return value


# ----------------------------------------------------------------- resources


def _fill_resources(container: Doc, where: str) -> None:
    resources = _mapping(container, "resources", where)
    requests = _mapping(resources, "requests", f"{where}: resources")
    limits = _mapping(resources, "limits", f"{where}: resources")
    for name in ("cpu", "memory"):
        request, limit = requests.get(name), limits.get(name)
        if request is None and limit is None:
            requests[name], limits[name] = FUNCTION_REQUESTS[name], FUNCTION_LIMITS[name]
        elif request is None:
            # What Kubernetes itself does with a limit alone: the request is the limit
            # (so a Guaranteed pod stays Guaranteed).
            requests[name] = limit
        elif limit is None:
            # The author sized it: bounded by what they asked for, never below it (which
            # Kubernetes would reject), and without parsing quantities to compare.
            limits[name] = request


# ----------------------------------------------------------- securityContext


def _fill_security_context(container: Doc, pod: Doc, where: str, *, read_only: bool) -> None:
    context = _mapping(container, "securityContext", where)
    pod_context = pod.get("securityContext")
    pod_context = pod_context if isinstance(pod_context, dict) else {}

    def effective(key: str) -> Any:
        return context[key] if context.get(key) is not None else pod_context.get(key)

    capabilities = context.get("capabilities")
    if capabilities is not None and not isinstance(capabilities, dict):
        raise InjectError(f"{where}: securityContext.capabilities must be a mapping")
    added = {str(c).upper() for c in (capabilities or {}).get("add") or []}
    if context.get("privileged") is not True and not added & _ESCALATING_CAPABILITIES:
        context.setdefault("allowPrivilegeEscalation", False)
    if read_only and "readOnlyRootFilesystem" not in context:
        context["readOnlyRootFilesystem"] = True
        _mount_tmp(container, pod)
    if effective("runAsNonRoot") is None:
        user = effective("runAsUser")
        if user is None:
            context["runAsNonRoot"] = True
            context["runAsUser"] = NON_ROOT_ID
            if effective("runAsGroup") is None:
                context["runAsGroup"] = NON_ROOT_ID
        elif user != 0:  # an author who runs it as root says so; that is theirs to decide
            context["runAsNonRoot"] = True
    _mapping(context, "capabilities", where).setdefault("drop", ["ALL"])
    if effective("seccompProfile") is None:
        context["seccompProfile"] = {"type": "RuntimeDefault"}


def _mount_tmp(container: Doc, pod: Doc) -> None:
    """A read-only root still needs a writable /tmp (uploads, temporary files)."""
    if mounts_tmp(container):
        return
    container.setdefault("volumeMounts", []).append(
        {"name": FUNCTION_TMP_VOLUME, "mountPath": "/tmp"}
    )
    own_empty_dir(pod, FUNCTION_TMP_VOLUME, {})


def mounts_tmp(container: Doc) -> bool:
    """Whether a volume of the container's is on /tmp however its path is spelled (`/tmp/`,
    `//tmp`): the API server compares the strings, so a second volume there would pass."""
    return any(
        isinstance(m, dict)
        and isinstance(m.get("mountPath"), str)
        and posixpath.normpath(m["mountPath"]) in {"/tmp", "//tmp"}
        for m in container.get("volumeMounts") or []
    )


def own_empty_dir(pod: Doc, name: str, empty_dir: Doc) -> None:
    """Adds inject's emptyDir volume ``name`` to the pod, unless an earlier injection did.
    A volume of the user's under that name (a ConfigMap, say) would be mounted on /tmp."""
    volumes = pod.setdefault("volumes", [])
    found = [v for v in volumes if v.get("name") == name]
    if not found:
        volumes.append({"name": name, "emptyDir": empty_dir})
    elif any(set(v) != {"name", "emptyDir"} for v in found):
        raise InjectError(
            f"the pod's volume {name!r} is not an emptyDir, and inject mounts its own volume "
            "of that name on /tmp: rename yours"
        )


def restrict_pod(pod: Doc, own: set[int]) -> None:
    """Pod-level non-root and RuntimeDefault seccomp, as on the shipped sleeper's pod, when
    the pod holds nothing but the function and the dispatcher (``own``: their ids). Another
    container of the author's keeps running the way it was written."""
    containers = (pod.get("containers") or []) + (pod.get("initContainers") or [])
    if any(id(c) not in own for c in containers):
        return
    context = _mapping(pod, "securityContext", "the pod")
    as_root = [c for c in containers if (c.get("securityContext") or {}).get("runAsUser") == 0]
    if context.get("runAsUser") != 0 and not as_root:
        context.setdefault("runAsNonRoot", True)
    context.setdefault("seccompProfile", {"type": "RuntimeDefault"})


# -------------------------------------------------------------------- probes


def _fill_probes(container: Doc, port: int | None) -> None:
    # TCP, like the startup probe: inject cannot know the function's health path. In knative
    # mode no port: Knative probes the serving port (and rejects any other port), and without a
    # periodSeconds its queue-proxy probes readiness aggressively for fast cold starts.
    socket: Doc = {"port": port} if port is not None else {}
    readiness: Doc = {"tcpSocket": dict(socket)}
    if port is not None:
        readiness |= {"periodSeconds": 10, "timeoutSeconds": 3, "failureThreshold": 3}
    container.setdefault("readinessProbe", readiness)
    container.setdefault(
        "livenessProbe",
        {
            "tcpSocket": dict(socket),
            "periodSeconds": 20,
            "timeoutSeconds": 3,
            "failureThreshold": 3,
        },
    )
