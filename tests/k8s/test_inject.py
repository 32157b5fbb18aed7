"""`conveyor inject`: every mode's output validates and obeys SPEC §8, injection is
idempotent and preserves what it does not own, and bad input gets a clear error
(exit code 2, one line on stderr, no traceback). Exercised both through the pure
function and through the real command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conveyor.inject import (
    InjectError,
    InjectOptions,
    Mode,
    ShutdownMode,
    inject_documents,
    inject_yaml,
    load_documents,
)
from conveyor.inject.documents import dump_documents
from tests.k8s import checks
from tests.k8s.conftest import REPO_ROOT

DEPLOYMENT = """\
apiVersion: apps/v1
kind: Deployment
metadata:
  name: sleeper
  labels: {app: sleeper}
spec:
  replicas: 3
  selector: {matchLabels: {app: sleeper}}
  template:
    metadata: {labels: {app: sleeper}}
    spec:
      containers:
        - name: sleeper
          image: conveyor/sleeper:0.1.0
          env: [{name: HOST, value: 0.0.0.0}, {name: PORT, value: "8080"}]
          resources:
            requests: {cpu: 50m, memory: 32Mi}
            limits: {cpu: 500m, memory: 128Mi}
          securityContext:
            allowPrivilegeEscalation: false
            readOnlyRootFilesystem: true
            runAsNonRoot: true
            capabilities: {drop: [ALL]}
            seccompProfile: {type: RuntimeDefault}
          readinessProbe: {httpGet: {path: /healthz, port: 8080}}
          livenessProbe: {httpGet: {path: /healthz, port: 8080}}
"""

JOB = """\
apiVersion: batch/v1
kind: Job
metadata:
  name: render
spec:
  backoffLimit: 1
  template:
    spec:
      restartPolicy: Never
      containers:
        - name: render
          image: example/render:1
          ports: [{containerPort: 9000}]
          resources:
            requests: {cpu: 100m, memory: 64Mi}
            limits: {cpu: "1", memory: 256Mi}
          securityContext:
            allowPrivilegeEscalation: false
            readOnlyRootFilesystem: true
            runAsNonRoot: true
            capabilities: {drop: [ALL]}
            seccompProfile: {type: RuntimeDefault}
          readinessProbe: {tcpSocket: {port: 9000}}
          livenessProbe: {tcpSocket: {port: 9000}}
"""

KSVC = """\
apiVersion: serving.knative.dev/v1
kind: Service
metadata:
  name: echo
  namespace: functions
spec:
  template:
    spec:
      containers:
        - image: example/node-echo:1
          ports: [{name: http1, containerPort: 8080}]
          resources:
            requests: {cpu: 50m, memory: 32Mi}
            limits: {cpu: 500m, memory: 128Mi}
          securityContext:
            allowPrivilegeEscalation: false
            readOnlyRootFilesystem: true
            runAsNonRoot: true
            capabilities: {drop: [ALL]}
            seccompProfile: {type: RuntimeDefault}
          readinessProbe: {httpGet: {path: /}}
          livenessProbe: {httpGet: {path: /}}
"""

# Several containers, an ordinary init container, volumes and env of its own.
MULTI = """\
apiVersion: v1
kind: ConfigMap
metadata: {name: thumbnail-config}
data: {SIZE: "128"}
---
apiVersion: apps/v1
kind: Deployment
metadata:
  name: thumbnail
  namespace: media
  annotations: {team: imaging}
spec:
  selector: {matchLabels: {app: thumbnail}}
  strategy: {type: RollingUpdate}
  template:
    metadata:
      labels: {app: thumbnail}
      annotations: {example.com/owner: imaging}
    spec:
      serviceAccountName: thumbnail
      terminationGracePeriodSeconds: 90
      initContainers:
        - name: fetch-fonts
          image: busybox:1.36
          command: [sh, -c, "cp /fonts/* /cache/"]
          volumeMounts: [{name: cache, mountPath: /cache}]
      containers:
        - name: log-shipper
          image: fluent/fluent-bit:3.0
          volumeMounts: [{name: logs, mountPath: /var/log/app}]
        - name: thumbnail
          image: conveyor/thumbnail:0.1.0
          ports: [{name: http, containerPort: 8000}, {name: debug, containerPort: 5678}]
          env:
            - {name: SIZE, valueFrom: {configMapKeyRef: {name: thumbnail-config, key: SIZE}}}
            - {name: HOST, value: 0.0.0.0}
          volumeMounts:
            - {name: cache, mountPath: /cache}
            - {name: logs, mountPath: /var/log/app}
      volumes:
        - {name: cache, emptyDir: {}}
        - {name: logs, emptyDir: {}}
"""


def inject(text: str, **options: object) -> list[dict]:
    out, _ = inject_yaml(text, InjectOptions(**options))  # type: ignore[arg-type]
    return load_documents(out)


def run_cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "conveyor", "inject", *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=120,
        check=False,
    )


def one(docs: list[dict], kind: str) -> dict:
    (found,) = [d for d in docs if d["kind"] == kind]
    return found


MODES = {
    "sidecar": (DEPLOYMENT, []),
    "job": (JOB, []),
    "job-from-deployment": (DEPLOYMENT, ["--mode", "job"]),
    "knative": (KSVC, ["--mode", "knative"]),
    "sidecar-options": (
        DEPLOYMENT,
        [
            *("--queue", "naps", "--concurrency", "8", "--shutdown-mode", "drain"),
            *("--drain-timeout", "60", "--image", "reg.example/d:2", "--amqp-secret", "mq"),
        ],
    ),
}


@pytest.fixture(scope="module", params=sorted(MODES))
def cli_output(request: pytest.FixtureRequest) -> tuple[str, list[str], str]:
    text, args = MODES[request.param]
    done = run_cli(*args, stdin=text)
    assert done.returncode == 0, done.stderr
    return request.param, args, done.stdout


# --------------------------------------------------------------- every mode


def test_output_core_kinds_validate(cli_output: tuple[str, list[str], str]) -> None:
    checks.validate_all(load_documents(cli_output[2]), crd_dir=None)


def test_output_custom_kinds_validate(
    cli_output: tuple[str, list[str], str], crd_dir: Path
) -> None:
    custom = [d for d in load_documents(cli_output[2]) if checks.is_custom(d)]
    assert custom, "no KEDA object written"
    for doc in custom:
        checks.validate_custom(doc, crd_dir)


def test_output_semantics(cli_output: tuple[str, list[str], str]) -> None:
    out = cli_output[2]
    secrets = checks.EXTERNAL_SECRETS | {"mq"}
    assert checks.check_semantics(load_documents(out), secrets) == 1


def test_cli_is_idempotent(cli_output: tuple[str, list[str], str]) -> None:
    _, args, out = cli_output
    again = run_cli(*args, stdin=out)
    assert again.returncode == 0, again.stderr
    assert again.stdout == out
    bare = run_cli(stdin=out)  # no options: the settings are read back
    assert bare.stdout == out


def test_options_reach_the_dispatcher_and_the_trigger() -> None:
    text, args = MODES["sidecar-options"]
    done = run_cli(*args, stdin=text)
    assert done.returncode == 0, done.stderr
    docs = load_documents(done.stdout)
    (d,) = checks.dispatchers(docs)
    assert d.container["image"] == "reg.example/d:2"
    assert (d.env["CONVEYOR_QUEUE"], d.env["CONVEYOR_CONCURRENCY"]) == ("naps", "8")
    assert (d.env["CONVEYOR_SHUTDOWN_MODE"], d.env["CONVEYOR_DRAIN_TIMEOUT"]) == ("drain", "60")
    assert d.env["CONVEYOR_AMQP_URL"]["secretKeyRef"] == {"name": "mq", "key": "amqp-url"}
    meta = one(docs, "ScaledObject")["spec"]["triggers"][0]["metadata"]
    assert (meta["queueName"], meta["value"]) == ("naps-in", "8")
    assert one(docs, "TriggerAuthentication")["spec"]["secretTargetRef"][0]["name"] == "mq"
    assert d.pod.spec["terminationGracePeriodSeconds"] > 60


# ---------------------------------------------------------------- by mode


def test_sidecar_layout() -> None:
    docs = inject(DEPLOYMENT)
    assert [d["kind"] for d in docs] == ["Deployment", "TriggerAuthentication", "ScaledObject"]
    deployment = docs[0]
    assert "replicas" not in deployment["spec"]
    pod = deployment["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["conveyor-dispatcher"]
    (fn,) = pod["initContainers"]
    assert fn["name"] == "sleeper" and fn["restartPolicy"] == "Always"
    assert fn["startupProbe"]["tcpSocket"] == {"port": 8080}
    (d,) = checks.dispatchers(docs)
    assert d.env["CONVEYOR_FUNCTION_URL"] == "http://127.0.0.1:8080/"
    assert d.env["CONVEYOR_QUEUE"] == "sleeper"
    assert d.env["CONVEYOR_CONCURRENCY"] == "4" and d.env["CONVEYOR_SHUTDOWN_MODE"] == "requeue"
    assert pod["terminationGracePeriodSeconds"] > int(d.env["CONVEYOR_DRAIN_TIMEOUT"])


def test_job_mode_writes_a_one_shot_scaled_job() -> None:
    docs = inject(JOB)
    assert [d["kind"] for d in docs] == ["ScaledJob", "TriggerAuthentication"]
    scaled_job = docs[0]
    target = scaled_job["spec"]["jobTargetRef"]
    assert (target["parallelism"], target["completions"], target["backoffLimit"]) == (1, 1, 1)
    (d,) = checks.dispatchers(docs)
    assert (
        d.env["CONVEYOR_ONE_SHOT"],
        d.env["CONVEYOR_CONCURRENCY"],
        d.env["CONVEYOR_SHUTDOWN_MODE"],
    ) == ("1", "1", "drain")
    assert d.env["CONVEYOR_IDLE_EXIT_SECONDS"] == "60"
    assert d.env["CONVEYOR_FUNCTION_URL"] == "http://127.0.0.1:9000/"
    assert scaled_job["spec"]["triggers"][0]["metadata"]["value"] == "1"


def test_job_mode_refuses_more_than_one_task_per_job() -> None:
    with pytest.raises(InjectError, match="concurrency must be 1"):
        inject(JOB, concurrency=4)


def test_knative_mode_feeds_the_service_from_a_dispatcher_deployment() -> None:
    docs = inject(KSVC)
    kinds = [d["kind"] for d in docs]
    assert kinds == [
        "Service",
        "Deployment",
        "NetworkPolicy",
        "TriggerAuthentication",
        "ScaledObject",
    ]
    ksvc, deployment = docs[0], docs[1]
    assert ksvc["metadata"]["labels"]["networking.knative.dev/visibility"] == "cluster-local"
    assert ksvc["spec"]["template"]["spec"]["containers"][0]["image"] == "example/node-echo:1"
    assert deployment["metadata"] == {
        "name": "echo-dispatcher",
        "namespace": "functions",
        "labels": deployment["metadata"]["labels"],
    }
    assert all(d["metadata"]["namespace"] == "functions" for d in docs)
    so = one(docs, "ScaledObject")
    assert so["spec"]["scaleTargetRef"]["name"] == "echo-dispatcher"
    (d,) = checks.dispatchers(docs)
    assert d.env["CONVEYOR_FUNCTION_URL"] == "http://echo.$(POD_NAMESPACE).svc.cluster.local/"
    # Progress from the function's pods (SPEC §11.5): the pod IP and a port of its own, open
    # to the function's pods only.
    assert d.env["CONVEYOR_PROGRESS_PORT"] == "8082"
    assert d.env["CONVEYOR_POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert {"name": "progress", "containerPort": 8082} in d.container["ports"]
    policy = one(docs, "NetworkPolicy")
    assert (
        policy["spec"]["podSelector"]["matchLabels"]
        == (deployment["spec"]["selector"]["matchLabels"])
    )
    [rule] = policy["spec"]["ingress"]
    assert rule["from"] == [
        {"podSelector": {"matchLabels": {"serving.knative.dev/service": "echo"}}}
    ]
    assert rule["ports"] == [{"port": 8082, "protocol": "TCP"}]
    again = inject(dump_documents(docs))  # re-injection updates, never duplicates
    assert [x["kind"] for x in again] == kinds


def test_knative_mode_does_not_apply_to_a_deployment() -> None:
    with pytest.raises(InjectError, match="--mode knative does not apply to Deployment sleeper"):
        inject(DEPLOYMENT, mode=Mode.KNATIVE)


# --------------------------------------------------- preserving the user's manifest


def test_multi_container_round_trip_preserves_everything_else() -> None:
    original = load_documents(MULTI)
    docs = inject(MULTI, container="thumbnail")
    assert [d["kind"] for d in docs] == [
        "ConfigMap", "Deployment", "TriggerAuthentication", "ScaledObject",
    ]  # fmt: skip
    assert docs[0] == original[0]
    before, after = original[1], docs[1]
    assert after["metadata"] == before["metadata"]
    assert after["spec"]["strategy"] == before["spec"]["strategy"]
    pod, old_pod = after["spec"]["template"]["spec"], before["spec"]["template"]["spec"]
    assert after["spec"]["template"]["metadata"]["labels"] == {"app": "thumbnail"}
    annotations = after["spec"]["template"]["metadata"]["annotations"]
    assert annotations["example.com/owner"] == "imaging"
    assert pod["serviceAccountName"] == "thumbnail"
    assert pod["terminationGracePeriodSeconds"] == 90  # already above DRAIN_TIMEOUT
    # The ordinary init container still runs first; the function follows it as a sidecar.
    assert [c["name"] for c in pod["initContainers"]] == ["fetch-fonts", "thumbnail"]
    assert pod["initContainers"][0] == old_pod["initContainers"][0]
    fn = pod["initContainers"][1]
    old_fn = old_pod["containers"][1]
    # What the author wrote is kept; SPEC §8's resources, securityContext and probes are
    # added around it, and a writable /tmp under the read-only root.
    added = {"restartPolicy", "startupProbe", *HARDENING}
    assert {k: v for k, v in fn.items() if k not in added} == {
        **old_fn, "volumeMounts": fn["volumeMounts"],
    }  # fmt: skip
    assert fn["volumeMounts"] == [*old_fn["volumeMounts"], FUNCTION_TMP]
    assert fn["startupProbe"]["tcpSocket"] == {"port": 8000}  # the port named http
    assert fn["readinessProbe"]["tcpSocket"] == {"port": 8000}
    assert [c["name"] for c in pod["containers"]] == ["conveyor-dispatcher", "log-shipper"]
    assert pod["containers"][1] == old_pod["containers"][0]
    # Other containers of the author's run as written: no pod-level context imposed on them.
    assert "securityContext" not in pod
    assert pod["volumes"][:2] == old_pod["volumes"]
    assert [v["name"] for v in pod["volumes"]] == [
        "cache", "logs", "conveyor-function-tmp", "conveyor-tmp",
    ]  # fmt: skip
    for generated in docs[2:]:
        assert generated["metadata"]["namespace"] == "media"
    (d,) = checks.dispatchers(docs)
    assert d.env["CONVEYOR_FUNCTION_URL"] == "http://127.0.0.1:8000/"
    checks.check_same_pod(d)
    checks.validate_all(docs, crd_dir=None)


def test_multi_container_reinjection_needs_no_container_option() -> None:
    once, _ = inject_yaml(MULTI, InjectOptions(container="thumbnail"))
    twice, _ = inject_yaml(once, InjectOptions())
    assert twice == once
    thrice, _ = inject_yaml(twice, InjectOptions(container="thumbnail"))
    assert thrice == once


def test_reinjection_keeps_settings_and_applies_new_ones() -> None:
    once, _ = inject_yaml(DEPLOYMENT, InjectOptions(concurrency=8, queue="naps"))
    kept = load_documents(inject_yaml(once, InjectOptions())[0])
    (d,) = checks.dispatchers(kept)
    assert (d.env["CONVEYOR_CONCURRENCY"], d.env["CONVEYOR_QUEUE"]) == ("8", "naps")
    changed = load_documents(inject_yaml(once, InjectOptions(concurrency=2))[0])
    (d,) = checks.dispatchers(changed)
    assert d.env["CONVEYOR_CONCURRENCY"] == "2"
    assert one(changed, "ScaledObject")["spec"]["triggers"][0]["metadata"]["value"] == "2"
    assert len(changed) == 3, "re-injection must update the KEDA objects, not add more"


def test_user_edits_to_keda_objects_survive_reinjection() -> None:
    docs = inject(DEPLOYMENT)
    one(docs, "ScaledObject")["spec"]["maxReplicaCount"] = 42
    again = inject_documents(docs, InjectOptions()).documents
    assert one(again, "ScaledObject")["spec"]["maxReplicaCount"] == 42


def test_dispatcher_port_moves_off_the_functions_port() -> None:
    text = DEPLOYMENT.replace('value: "8080"', 'value: "8081"').replace("port: 8080", "port: 8081")
    docs = inject(text)
    (d,) = checks.dispatchers(docs)
    assert d.env["CONVEYOR_FUNCTION_URL"] == "http://127.0.0.1:8081/"
    assert d.env["CONVEYOR_DISPATCHER_PORT"] == "8082"
    checks.check_dispatcher(d)


def test_long_drain_in_a_deployment_is_warned_about() -> None:
    done = run_cli("--drain-timeout", "300", stdin=DEPLOYMENT)
    assert done.returncode == 0, done.stderr
    assert "warning:" in done.stderr and "job mode" in done.stderr
    (d,) = checks.dispatchers(load_documents(done.stdout))
    assert d.pod.spec["terminationGracePeriodSeconds"] > 300


def test_cli_reads_a_file_like_stdin(tmp_path: Path) -> None:
    path = tmp_path / "fn.yaml"
    path.write_text(DEPLOYMENT)
    from_file = run_cli("-f", str(path))
    from_stdin = run_cli("-f", "-", stdin=DEPLOYMENT)
    assert from_file.returncode == 0 and from_file.stdout == from_stdin.stdout
    assert from_file.stdout == inject_yaml(DEPLOYMENT)[0]


# ------------------------------------- the function's container: SPEC §8 for the author

# What a function author writes (SPEC §1): the image and the port, nothing else.
BARE_DEPLOYMENT = """\
apiVersion: apps/v1
kind: Deployment
metadata: {name: fn}
spec:
  selector: {matchLabels: {app: fn}}
  template:
    metadata: {labels: {app: fn}}
    spec:
      containers:
        - name: fn
          image: example/fn:1
          ports: [{containerPort: 8080}]
"""
BARE_JOB = """\
apiVersion: batch/v1
kind: Job
metadata: {name: batch}
spec:
  template:
    spec:
      containers:
        - {name: batch, image: example/batch:1, env: [{name: PORT, value: "9000"}]}
"""
BARE_KSVC = """\
apiVersion: serving.knative.dev/v1
kind: Service
metadata: {name: echo}
spec:
  template:
    spec:
      containers:
        - image: example/echo:1
"""
BARE = {
    "sidecar": (BARE_DEPLOYMENT, [], 8080),
    "job-from-deployment": (BARE_DEPLOYMENT, ["--mode", "job"], 8080),
    "job": (BARE_JOB, [], 9000),
    "knative": (BARE_KSVC, [], None),
}
HARDENING = {"resources", "securityContext", "readinessProbe", "livenessProbe"}
FUNCTION_TMP = {"name": "conveyor-function-tmp", "mountPath": "/tmp"}
RESTRICTED = {
    "allowPrivilegeEscalation": False,
    "runAsNonRoot": True,
    "runAsUser": 10001,
    "runAsGroup": 10001,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def function_of(docs: list[dict]) -> tuple[dict, dict]:
    """The function's container and its pod spec, in any mode's output."""
    for doc in docs:
        if doc["apiVersion"] == "serving.knative.dev/v1":
            pod = doc["spec"]["template"]["spec"]
            (fn,) = pod["containers"]
            return fn, pod
    (d,) = checks.dispatchers(docs)
    return checks.function_container(d), d.pod.spec


@pytest.fixture(scope="module", params=sorted(BARE))
def bare_output(request: pytest.FixtureRequest) -> tuple[str, list[str], str]:
    text, args, _ = BARE[request.param]
    done = run_cli(*args, stdin=text)
    assert done.returncode == 0, done.stderr
    return request.param, args, done.stdout


def test_a_bare_function_gets_resources_security_and_probes(
    bare_output: tuple[str, list[str], str],
) -> None:
    """`conveyor inject -f dep.yaml` on an image and a port gives the function's container
    what SPEC §8 asks of every container."""
    mode, _, out = bare_output
    docs = load_documents(out)
    fn, pod = function_of(docs)
    assert fn["resources"] == {
        "requests": {"cpu": "50m", "memory": "64Mi"},
        "limits": {"cpu": "500m", "memory": "256Mi"},
    }
    context = fn["securityContext"]
    assert {k: context[k] for k in RESTRICTED} == RESTRICTED
    port = BARE[mode][2]
    if port is None:
        # Knative: no port (it probes the serving port, and rejects any other), no pod-level
        # context (behind a feature flag), no emptyDir (behind another): a writable root.
        for probe in ("readinessProbe", "livenessProbe"):
            assert fn[probe]["tcpSocket"] == {}, probe
        assert "periodSeconds" not in fn["readinessProbe"]  # Knative's fast cold-start probing
        assert "readOnlyRootFilesystem" not in context
        assert {"securityContext", "volumes"}.isdisjoint(pod)
        assert "volumeMounts" not in fn and "startupProbe" not in fn
        return
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert fn[probe]["tcpSocket"] == {"port": port}, probe
    assert fn["readinessProbe"]["periodSeconds"] < fn["livenessProbe"]["periodSeconds"]
    assert context["readOnlyRootFilesystem"] is True
    assert fn["volumeMounts"] == [FUNCTION_TMP]
    assert {"name": "conveyor-function-tmp", "emptyDir": {}} in pod["volumes"]
    assert pod["securityContext"] == {
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def test_a_bare_function_s_output_validates_and_obeys_spec_8(
    bare_output: tuple[str, list[str], str], crd_dir: Path
) -> None:
    mode, _, out = bare_output
    docs = load_documents(out)
    checks.validate_all(docs, crd_dir)
    if mode == "knative":  # a writable root (see above): the other rules
        assert checks.check_scaling(docs) == 1
        checks.check_knative(docs)
        (ksvc,) = [d for d in docs if d["kind"] == "Service"]
        (fn,) = ksvc["spec"]["template"]["spec"]["containers"]
        assert "PORT" not in checks.env(fn) and "ports" not in fn
    else:
        assert checks.check_semantics(docs) == 1


def test_a_bare_function_s_injection_is_idempotent(
    bare_output: tuple[str, list[str], str],
) -> None:
    _, args, out = bare_output
    again = run_cli(*args, stdin=out)
    assert again.returncode == 0, again.stderr
    assert again.stdout == out


# The author's own choices, some of them partial: each is kept, only what is missing is added.
OPINIONATED = """\
apiVersion: apps/v1
kind: Deployment
metadata: {name: fn}
spec:
  selector: {matchLabels: {app: fn}}
  template:
    metadata: {labels: {app: fn}}
    spec:
      securityContext:
        seccompProfile: {type: Localhost, localhostProfile: profiles/fn.json}
      containers:
        - name: fn
          image: example/fn:1
          ports: [{containerPort: 8080}]
          resources:
            requests: {memory: 512Mi}
            limits: {cpu: "2"}
          securityContext:
            runAsUser: 2000
            readOnlyRootFilesystem: false
            capabilities: {add: [NET_BIND_SERVICE]}
          readinessProbe:
            httpGet: {path: /ready, port: 8080}
            periodSeconds: 3
"""


def test_the_authors_own_settings_are_kept() -> None:
    docs = inject(OPINIONATED)
    fn, pod = function_of(docs)
    assert fn["resources"] == {
        # a limit alone: the request is that limit, as Kubernetes itself would make it
        # a request alone: a limit never below it
        "requests": {"memory": "512Mi", "cpu": "2"},
        "limits": {"cpu": "2", "memory": "512Mi"},
    }
    assert fn["securityContext"] == {
        "runAsUser": 2000,
        "readOnlyRootFilesystem": False,
        "capabilities": {"add": ["NET_BIND_SERVICE"], "drop": ["ALL"]},
        "allowPrivilegeEscalation": False,
        "runAsNonRoot": True,  # consistent with the author's non-zero user
        # no seccompProfile: the pod's own Localhost profile applies
    }
    assert "volumeMounts" not in fn  # a writable root needs no /tmp volume
    assert fn["readinessProbe"] == {"httpGet": {"path": "/ready", "port": 8080}, "periodSeconds": 3}
    assert fn["livenessProbe"]["tcpSocket"] == {"port": 8080}  # the one missing probe
    assert pod["securityContext"] == {
        "seccompProfile": {"type": "Localhost", "localhostProfile": "profiles/fn.json"},
        "runAsNonRoot": True,
    }
    checks.validate_all(docs, crd_dir=None)
    assert inject(dump_documents(docs)) == docs


def test_a_function_the_author_runs_as_root_is_not_made_non_root() -> None:
    text = BARE_DEPLOYMENT.replace(
        "ports: [{containerPort: 8080}]",
        "ports: [{containerPort: 8080}]\n          securityContext: {runAsUser: 0}",
    )
    fn, pod = function_of(inject(text))
    assert "runAsNonRoot" not in fn["securityContext"]
    assert "runAsNonRoot" not in pod["securityContext"]  # the kubelet would refuse to start it
    assert fn["securityContext"]["runAsUser"] == 0


def test_a_knative_functions_own_settings_are_kept() -> None:
    docs = inject(KSVC)
    original = load_documents(KSVC)[0]["spec"]["template"]["spec"]["containers"][0]
    fn, pod = function_of(docs)
    assert fn["resources"] == original["resources"]
    assert fn["readinessProbe"] == original["readinessProbe"] == {"httpGet": {"path": "/"}}
    assert fn["livenessProbe"] == original["livenessProbe"]
    # runAsNonRoot was the author's: the image's own (non-root) user stays, no uid imposed.
    assert fn["securityContext"] == original["securityContext"]
    assert "securityContext" not in pod


# ------------------------------------------------ the dispatcher's probes on METRICS_PORT


@pytest.mark.parametrize("variable", ["METRICS_PORT", "CONVEYOR_METRICS_PORT"])
def test_dispatcher_probes_use_httpget_on_metrics_port(variable: str) -> None:
    """With METRICS_PORT, /healthz and /readyz are served on all interfaces: the kubelet's
    httpGet reaches them, and no Python interpreter starts for every probe."""
    docs = inject(BARE_DEPLOYMENT)
    (d,) = checks.dispatchers(docs)
    assert "exec" in d.container["readinessProbe"]  # loopback only: probed from inside
    d.container["env"].append({"name": variable, "value": "9090"})
    again = inject(dump_documents(docs))
    (d,) = checks.dispatchers(again)
    assert d.container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": 9090}
    assert d.container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": 9090}
    assert "exec" not in d.container["readinessProbe"]
    checks.check_dispatcher(d)
    assert inject(dump_documents(again)) == again


# -------------------------------------------------------------------- errors

NO_CONTAINERS = DEPLOYMENT.split("      containers:")[0] + "      containers: []\n"
NO_PORT = DEPLOYMENT.replace('{name: PORT, value: "8080"}', "{name: X, value: y}")
TWO = MULTI.split("---\n")[1]
STATEFULSET = DEPLOYMENT.replace("kind: Deployment", "kind: StatefulSet")
ERRORS = {
    "no containers": (NO_CONTAINERS, [], "has no containers"),
    "several containers": (TWO, [], "several containers (log-shipper, thumbnail)"),
    "missing container": (TWO, ["--container", "nope"], "no container named 'nope'"),
    "no port": (NO_PORT, [], "cannot find the port of container 'sleeper'"),
    "unknown kind": (STATEFULSET, [], "unsupported kind StatefulSet"),
    "malformed yaml": ("kind: Deployment\n  bad: [unclosed\n", [], "malformed YAML"),
    "not a mapping": ("- just\n- a list\n", [], "not a mapping"),
    "no kind": ("metadata: {name: x}\n", [], "has no apiVersion or kind"),
    "nothing to inject": ("", [], "no Deployment, Job or Knative Service"),
    "only a configmap": (MULTI.split("---\n")[0], [], "no Deployment, Job or Knative"),
    "job concurrency": (JOB, ["--concurrency", "3"], "must be 1 in job mode"),
    "mode mismatch": (JOB, ["--mode", "sidecar"], "--mode sidecar does not apply to Job"),
    "env not a list": (
        NO_PORT.replace("env: [{name: HOST", "env: oops\n          x: [{name: HOST"),
        [],
        "env must be a list of mappings",
    ),
    "annotations not a mapping": (
        DEPLOYMENT.replace("metadata: {labels: {app: sleeper}}", "metadata: {annotations: [a]}"),
        [],
        "metadata.annotations is not a mapping",
    ),
}


def _options(args: list[str]) -> InjectOptions:
    pairs = dict(zip(args[::2], args[1::2], strict=True))
    return InjectOptions(
        container=pairs.get("--container"),
        concurrency=int(pairs["--concurrency"]) if "--concurrency" in pairs else None,
        mode=Mode(pairs["--mode"]) if "--mode" in pairs else None,
    )


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_bad_input_raises_a_clear_error(case: str) -> None:
    text, args, message = ERRORS[case]
    with pytest.raises(InjectError) as caught:
        inject_yaml(text, _options(args))
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_bad_input_exits_2_with_a_message_and_no_traceback(case: str) -> None:
    text, args, message = ERRORS[case]
    done = run_cli(*args, stdin=text)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stdout == ""
    assert message in done.stderr
    assert done.stderr.startswith("error: ")
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "args",
    [["-f", "does-not-exist.yaml"], ["--mode", "daemonset"], ["--shutdown-mode", "later"]],
)
def test_bad_arguments_exit_2_without_traceback(args: list[str]) -> None:
    done = run_cli(*args, stdin=DEPLOYMENT)
    assert done.returncode == 2
    assert done.stdout == "" and done.stderr.strip()
    assert "Traceback" not in done.stderr


def test_shutdown_mode_values_are_the_specs() -> None:
    assert {m.value for m in ShutdownMode} == {"requeue", "drain"}
