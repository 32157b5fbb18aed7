"""`conveyor inject` against what a black-box tester fed it: a switch of mode, settings the
dispatcher refuses, other autoscalers and dispatchers, YAML aliases, deep nesting, long names,
volumes named like inject's own. Each case asserts the command's output: the YAML it writes, or
its exit code and the one line it prints on stderr."""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterator
from typing import Any

import pytest

from conveyor.events import MAX_TIMEOUT
from conveyor.inject import InjectOptions, Mode, inject_yaml, load_documents
from conveyor.inject.documents import dump_documents
from tests.k8s import checks
from tests.k8s.test_inject import (
    BARE,
    BARE_DEPLOYMENT,
    BARE_JOB,
    BARE_KSVC,
    MULTI,
    inject,
    one,
    run_cli,
)


def refused(args: list[str], text: str, *says: str) -> str:
    """Runs the command, which must fail with one `error:` line; returns that line."""
    done = run_cli(*args, stdin=text)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stdout == ""
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
    for word in says:
        assert word in done.stderr
    return done.stderr


def with_dispatcher_env(text: str, env: list[dict], mode: Mode | None = None) -> str:
    """Injects, then sets ``env`` on the dispatcher as a user would (in place of inject's entry
    of the same setting)."""
    docs = inject(text, mode=mode)
    (d,) = checks.dispatchers(docs)
    checks.set_env(d.container, env)
    return dump_documents(docs)


# ------------------------------------------------------------ 1. a switch of mode


def test_sidecar_output_injected_in_job_mode_is_a_fresh_job_injection() -> None:
    """The ScaledObject of the sidecar injection is dropped (one autoscaler per queue), and the
    settings inject wrote as sidecar defaults become job mode's (drain, 600 s, grace 615)."""
    sidecar, _ = inject_yaml(BARE_DEPLOYMENT)
    done = run_cli("--mode", "job", stdin=sidecar)
    assert done.returncode == 0, done.stderr
    docs = load_documents(done.stdout)
    assert [d["kind"] for d in docs] == ["ScaledJob", "TriggerAuthentication"]
    assert docs == inject(BARE_DEPLOYMENT, mode=Mode.JOB)
    assert run_cli(stdin=done.stdout).stdout == done.stdout


def test_job_output_injected_in_sidecar_mode_is_a_fresh_sidecar_injection() -> None:
    job, _ = inject_yaml(BARE_DEPLOYMENT, InjectOptions(mode=Mode.JOB))
    done = run_cli("--mode", "sidecar", stdin=job)
    assert done.returncode == 0, done.stderr
    docs = load_documents(done.stdout)
    assert [d["kind"] for d in docs] == ["Deployment", "TriggerAuthentication", "ScaledObject"]
    assert docs == inject(BARE_DEPLOYMENT)
    # one line says the mode's defaults replaced job mode's; none about a job-sized grace
    assert done.stderr.count("warning:") == 1 and "grace" not in done.stderr, done.stderr
    assert "sidecar mode's defaults replace" in done.stderr


def test_a_switch_of_mode_keeps_what_the_user_chose() -> None:
    """Values other than the old mode's defaults were the user's: kept."""
    sidecar, _ = inject_yaml(BARE_DEPLOYMENT, InjectOptions(drain_timeout=45))
    docs = inject(
        sidecar.replace("terminationGracePeriodSeconds: 60", "terminationGracePeriodSeconds: 900"),
        mode=Mode.JOB,
    )
    (d,) = checks.dispatchers(docs)
    assert (d.env["CONVEYOR_DRAIN_TIMEOUT"], d.env["CONVEYOR_SHUTDOWN_MODE"]) == ("45", "drain")
    assert d.pod.spec["terminationGracePeriodSeconds"] == 900


def test_a_value_given_way_on_a_switch_of_mode_is_said() -> None:
    """A drain chosen on purpose in sidecar mode equal to job mode's defaults gives way to
    sidecar's on the way back: silently, it made non-interruptible tasks interruptible (found
    by a review). It is said in a warning, naming the option that keeps it."""
    sidecar, _ = inject_yaml(
        BARE_DEPLOYMENT, InjectOptions(shutdown_mode="drain", drain_timeout=600)
    )
    job, _ = inject_yaml(sidecar, InjectOptions(mode=Mode.JOB))
    _, warnings = inject_yaml(job, InjectOptions(mode=Mode.SIDECAR))
    (said,) = warnings
    assert "--shutdown-mode" in said and "--drain-timeout" in said, warnings


# --------------------------------------------- 2. settings the dispatcher refuses at start


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("CONCURRENCY", "5000"),
        ("PREFETCH_BUFFER", "2000"),
        ("DISPATCHER_PORT", "70000"),
        ("METRICS_PORT", "99999"),
        ("CONVEYOR_METRICS_PORT", "-1"),
        ("LOG_FORMAT", "xml"),
    ],
)
def test_a_dispatcher_env_the_dispatcher_refuses_is_refused(variable: str, value: str) -> None:
    text = with_dispatcher_env(BARE_DEPLOYMENT, [{"name": variable, "value": value}])
    refused([], text, variable.removeprefix("CONVEYOR_"))


def test_a_concurrency_option_the_dispatcher_refuses_is_refused() -> None:
    refused(["--concurrency", "1001"], BARE_DEPLOYMENT, "CONCURRENCY", "1000")


@pytest.mark.parametrize(
    ("text", "port"),
    [(BARE_DEPLOYMENT, "8080"), (BARE_KSVC, "8082")],
    ids=["function-port", "knative-progress-port"],
)
def test_a_metrics_port_taken_in_the_pod_is_refused(text: str, port: str) -> None:
    """One network namespace: the dispatcher could not listen there."""
    with_metrics = with_dispatcher_env(text, [{"name": "METRICS_PORT", "value": port}])
    refused([], with_metrics, "METRICS_PORT", port)


def test_a_metrics_port_on_the_dispatcher_port_moves_the_dispatcher_port() -> None:
    text = with_dispatcher_env(BARE_DEPLOYMENT, [{"name": "METRICS_PORT", "value": "8081"}])
    (d,) = checks.dispatchers(inject(text))
    assert (d.env["METRICS_PORT"], d.env["CONVEYOR_DISPATCHER_PORT"]) == ("8081", "8082")


# ------------------------------------------- 3. another ScaledObject of the same workload

CPU_SCALER = """\
---
apiVersion: keda.sh/v1alpha1
kind: ScaledObject
metadata: {name: fn-cpu}
spec:
  scaleTargetRef: {name: fn}
  triggers: [{type: cpu, metricType: Utilization, metadata: {value: "60"}}]
"""


@pytest.mark.parametrize("args", [[], ["--mode", "job"]])
def test_another_scaled_object_of_the_workload_is_refused(args: list[str]) -> None:
    refused(args, BARE_DEPLOYMENT + CPU_SCALER, "ScaledObject fn-cpu", "Deployment fn")


def test_a_scaled_object_of_another_workload_passes_through() -> None:
    other = CPU_SCALER.replace("{name: fn}", "{name: other}")
    docs = inject(BARE_DEPLOYMENT + other)
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "ScaledObject"] == ["fn", "fn-cpu"]


# ------------------------------------------------ 4. a dispatcher under another name

OTHER_DISPATCHER = {
    "command": "{name: dispatcher, image: example/mine:1, command: [conveyor, dispatcher]}",
    "args": "{name: dispatcher, image: example/mine:1, command: [python], args: [-m, conveyor, dispatcher]}",
    "image": "{name: dispatcher, image: 'reg.example:5000/conveyor/dispatcher:0.1.0'}",
}


@pytest.mark.parametrize("how", sorted(OTHER_DISPATCHER))
def test_a_dispatcher_under_another_name_is_refused(how: str) -> None:
    text = BARE_DEPLOYMENT + f"        - {OTHER_DISPATCHER[how]}\n"
    refused(["--container", "fn"], text, "'dispatcher'", "conveyor-dispatcher")


# ------------------------------------------------------------------ 5. YAML aliases

ALIASED = BARE_DEPLOYMENT.replace(
    "      containers:\n", "      volumes: [{name: data, emptyDir: {}}]\n      containers:\n"
) + (
    "          securityContext: &sc {runAsUser: 1000}\n"
    "          resources: &r {requests: {cpu: 10m}}\n"
    "          volumeMounts: &vm [{name: data, mountPath: /data}]\n"
    "        - name: shipper\n"
    "          image: example/shipper:1\n"
    "          securityContext: *sc\n"
    "          resources: *r\n"
    "          volumeMounts: *vm\n"
)


def test_aliases_shared_with_another_container_do_not_carry_inject_s_edits() -> None:
    docs = inject(ALIASED, container="fn")
    pod = docs[0]["spec"]["template"]["spec"]
    (shipper,) = [c for c in pod["containers"] if c["name"] == "shipper"]
    assert shipper == {
        "name": "shipper",
        "image": "example/shipper:1",
        "securityContext": {"runAsUser": 1000},
        "resources": {"requests": {"cpu": "10m"}},
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    }
    (fn,) = pod["initContainers"]
    assert fn["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"name": "conveyor-function-tmp", "mountPath": "/tmp"} in fn["volumeMounts"]


def test_aliases_that_expand_without_end_are_refused() -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 8)]
    bomb = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n" + "\n".join(lines) + "\n"
    refused([], bomb, "malformed YAML", "aliases")


# ------------------------------------------------------------------ 8. deep nesting


@pytest.mark.parametrize("depth", [150, 500, 5000])
def test_deeply_nested_yaml_is_refused_in_one_line(depth: int) -> None:
    deep = "[" * depth + "]" * depth
    text = f"{BARE_DEPLOYMENT}---\napiVersion: v1\nkind: ConfigMap\nmetadata: {{name: x}}\ndata: {{x: {deep}}}\n"
    refused([], text, "malformed YAML", "nested")


# ---------------------------------------------------------------------- 7. long names

LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def label_maps(value: Any) -> Iterator[dict]:
    if isinstance(value, dict):
        for key, item in value.items():
            if key in {"labels", "matchLabels"} and isinstance(item, dict):
                yield item
            yield from label_maps(item)
    elif isinstance(value, list):
        for item in value:
            yield from label_maps(item)


@pytest.mark.parametrize("args", [[], ["--mode", "job"]])
def test_a_long_workload_name_gives_valid_labels_and_names(args: list[str]) -> None:
    name = "fn-" + "x" * 200
    # Its queue is named: by default the workload's name, longer than a queue name may be.
    deployment = BARE_DEPLOYMENT.replace("{name: fn}", f"{{name: {name}}}")
    done = run_cli(*args, "--queue", "fn", stdin=deployment)
    assert done.returncode == 0, done.stderr
    docs = load_documents(done.stdout)
    for labels in (m for doc in docs for m in label_maps(doc)):
        for key, value in labels.items():
            assert len(value) <= 63 and LABEL_VALUE.fullmatch(value), (key, value)
    for doc in docs:
        meta = doc["metadata"]["name"]
        assert len(meta) <= 253 and SUBDOMAIN.fullmatch(meta), meta
    assert run_cli(*args, stdin=done.stdout).stdout == done.stdout


def test_a_long_name_s_re_injection_finds_its_own_objects() -> None:
    """The shortened label still tells inject which objects are its own (a switch of mode)."""
    name = "fn-" + "y" * 80
    sidecar, _ = inject_yaml(BARE_DEPLOYMENT.replace("{name: fn}", f"{{name: {name}}}"))
    docs = inject(sidecar, mode=Mode.JOB)
    assert [d["kind"] for d in docs] == ["ScaledJob", "TriggerAuthentication"]


# ----------------------------------------------- 9. a volume named like inject's own


@pytest.mark.parametrize("volume", ["conveyor-tmp", "conveyor-function-tmp"])
def test_a_user_volume_with_inject_s_volume_name_is_refused(volume: str) -> None:
    text = BARE_DEPLOYMENT + f"      volumes: [{{name: {volume}, configMap: {{name: settings}}}}]\n"
    refused([], text, repr(volume))


def test_inject_s_own_tmp_volumes_are_reused() -> None:
    once, _ = inject_yaml(BARE_DEPLOYMENT)
    assert inject_yaml(once)[0] == once


@pytest.mark.parametrize("path", ["/tmp", "/tmp/", "//tmp", "/tmp/.", "/./tmp"])
def test_a_user_volume_on_tmp_however_spelled_is_kept_alone(path: str) -> None:
    """A sweep found inject adding its own emptyDir on /tmp beside the user's volume mounted at
    `/tmp/`: two volumes on one directory, which the API server's string check lets through."""
    text = (
        BARE_DEPLOYMENT.replace(
            "ports: [{containerPort: 8080}]\n",
            "ports: [{containerPort: 8080}]\n"
            f"          volumeMounts: [{{name: scratch, mountPath: '{path}'}}]\n",
        )
        + "      volumes: [{name: scratch, persistentVolumeClaim: {claimName: data}}]\n"
    )
    pod = inject(text)[0]["spec"]["template"]["spec"]
    containers = pod["containers"] + pod.get("initContainers", [])
    (fn,) = [c for c in containers if c["name"] == "fn"]
    assert fn["volumeMounts"] == [{"name": "scratch", "mountPath": path}]
    assert [v["name"] for v in pod["volumes"] if v["name"] == "conveyor-function-tmp"] == []
    for container in containers:
        mounted = [m["mountPath"] for m in container.get("volumeMounts", [])]
        assert len({posixpath.normpath(p) for p in mounted}) == len(mounted), container["name"]


# ------------------------------------------ 6. job mode beside another regular container


def test_job_mode_beside_another_regular_container_is_refused() -> None:
    deployment = MULTI.split("---\n")[1]
    refused(["--mode", "job", "--container", "thumbnail"], deployment, "log-shipper")


def test_job_mode_beside_a_native_sidecar_is_accepted() -> None:
    text = BARE_JOB + (
        "      initContainers:\n"
        "        - {name: proxy, image: example/proxy:1, restartPolicy: Always}\n"
    )
    docs = inject(text)
    assert one(docs, "ScaledJob")["spec"]["jobTargetRef"]["template"]["spec"]["containers"]


# ------------------------------------------- 10. a long name and KEDA's own names

SCALED_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
LONG_DEPLOYMENT = BARE_DEPLOYMENT.replace("{name: fn}", "{name: " + "a" * 70 + "}")
LONG_JOB = BARE_JOB.replace("{name: batch}", "{name: " + "b" * 70 + "}")
LONG_KSVC = BARE_KSVC.replace("{name: echo}", "{name: " + "k" * 55 + "}")


@pytest.mark.parametrize(
    ("text", "args", "kind", "target"),
    [
        (LONG_DEPLOYMENT, [], "ScaledObject", "a" * 70),
        (LONG_DEPLOYMENT, ["--mode", "job"], "ScaledJob", None),
        (LONG_JOB, [], "ScaledJob", None),
        (LONG_KSVC, [], "ScaledObject", "k" * 55 + "-dispatcher"),
    ],
    ids=["sidecar", "job-from-deployment", "job", "knative"],
)
def test_a_long_name_gives_keda_objects_names_keda_takes(
    text: str, args: list[str], kind: str, target: str | None
) -> None:
    """Found by a black-box sweep: a 70-character Deployment got a ScaledObject of that name,
    a 55-character Knative Service `<name>-dispatcher` (66). KEDA puts the name in label values
    (`scaledobject.keda.sh/name`, `scaledjob.keda.sh/name`; 63 at most) and names the HPA
    `keda-hpa-<name>`: its webhook refuses names over 54. Shortened with a hash, the object
    still scales the workload of the full name, and re-injection changes nothing."""
    done = run_cli(*args, "--queue", "fn", stdin=text)
    assert done.returncode == 0, done.stderr
    docs = load_documents(done.stdout)
    name = one(docs, kind)["metadata"]["name"]
    assert len(name) <= 54 and SCALED_NAME.fullmatch(name), (len(name), name)
    if target is not None:
        assert one(docs, kind)["spec"]["scaleTargetRef"]["name"] == target
    checks.check_scaling(docs)
    assert run_cli(*args, stdin=done.stdout).stdout == done.stdout


# ------------------------------------ 11. a container named like the dispatcher

NAMED_DISPATCHER_INIT = {
    "plain": "{name: conveyor-dispatcher, image: busybox, command: [sh, -c, 'sleep 1']}",
    "native-sidecar": "{name: conveyor-dispatcher, restartPolicy: Always, image: busybox}",
}


@pytest.mark.parametrize("how", sorted(NAMED_DISPATCHER_INIT))
def test_an_init_container_named_like_the_dispatcher_is_refused(how: str) -> None:
    """Found by a black-box sweep: inject added its dispatcher beside an init container of the
    same name, and the API server refuses a pod whose containers share a name."""
    text = BARE_DEPLOYMENT + f"      initContainers:\n        - {NAMED_DISPATCHER_INIT[how]}\n"
    refused([], text, "init container", "'conveyor-dispatcher'")


@pytest.mark.parametrize("args", [[], ["--container", "conveyor-dispatcher"]])
def test_a_function_named_like_the_dispatcher_is_told_so(args: list[str]) -> None:
    """Found by a black-box sweep: the pod was said to have no containers at all."""
    text = BARE_DEPLOYMENT.replace("- name: fn\n", "- name: conveyor-dispatcher\n")
    said = refused(args, text, "'conveyor-dispatcher'", "dispatcher's name")
    assert "no container" not in said, said


# ------------------------------------------------ 12. a Job exported from a cluster

EXPORTED_JOB = """\
apiVersion: batch/v1
kind: Job
metadata: {name: fnjob, uid: 0b0c7f1e-4f3a-4b8e-9f7e-1234567890ab}
spec:
  selector: {matchLabels: {batch.kubernetes.io/controller-uid: 0b0c7f1e-4f3a-4b8e-9f7e-1234567890ab}}
  template:
    metadata:
      labels:
        app: fnjob
        batch.kubernetes.io/controller-uid: 0b0c7f1e-4f3a-4b8e-9f7e-1234567890ab
        batch.kubernetes.io/job-name: fnjob
        controller-uid: 0b0c7f1e-4f3a-4b8e-9f7e-1234567890ab
        job-name: fnjob
    spec:
      restartPolicy: Never
      containers: [{name: fn, image: example/fn:1, ports: [{containerPort: 8080}]}]
"""


def test_an_exported_job_s_controller_labels_are_dropped() -> None:
    """Found by a black-box sweep: `kubectl get job -o yaml` keeps the labels the Job controller
    set from the Job's uid and name; the API server requires them to match each new Job's, so
    KEDA could create none. They go with the selector; the author's labels stay."""
    docs = inject(EXPORTED_JOB)
    template = one(docs, "ScaledJob")["spec"]["jobTargetRef"]["template"]
    assert template["metadata"]["labels"] == {"app": "fnjob"}
    assert inject(dump_documents(docs)) == docs


# ------------------------------------ 13. names Kubernetes refuses, and limits it sets

INT64_MAX = 2**63 - 1


@pytest.mark.parametrize("secret", ["Bad_Secret", "My_Secret", "-mq", "mq-", "s" * 254])
@pytest.mark.parametrize("text", [BARE_DEPLOYMENT, BARE_KSVC], ids=["sidecar", "knative"])
def test_an_amqp_secret_kubernetes_refuses_is_refused(text: str, secret: str) -> None:
    """Found by a black-box sweep: `Bad_Secret` went into the dispatcher's secretKeyRef and the
    TriggerAuthentication, exit 0. A Secret's name is a DNS-1123 subdomain."""
    refused(["--amqp-secret", secret], text, "--amqp-secret", "DNS-1123 subdomain")


def test_an_amqp_secret_with_dots_is_taken() -> None:
    docs = inject(BARE_DEPLOYMENT, amqp_secret="mq.prod")
    assert one(docs, "TriggerAuthentication")["spec"]["secretTargetRef"][0]["name"] == "mq.prod"


def test_an_existing_dispatcher_s_secret_kubernetes_refuses_is_refused() -> None:
    ref = {"secretKeyRef": {"name": "Bad_Secret", "key": "amqp-url"}}
    text = with_dispatcher_env(BARE_DEPLOYMENT, [{"name": "CONVEYOR_AMQP_URL", "valueFrom": ref}])
    refused([], text, "CONVEYOR_AMQP_URL", "'Bad_Secret'")


@pytest.mark.parametrize("mode", sorted(BARE))
@pytest.mark.parametrize("drain", [str(MAX_TIMEOUT + 1), "9223372036854775800", "9" * 22])
def test_a_drain_timeout_past_the_dispatcher_s_bound_is_refused(mode: str, drain: str) -> None:
    """Found by a black-box sweep: 9223372036854775800 gave terminationGracePeriodSeconds
    9223372036854775815, past int64. The dispatcher takes at most MAX_TIMEOUT seconds, and
    what it would refuse at start inject refuses (as --concurrency past 1000)."""
    text, args, _ = BARE[mode]
    refused([*args, "--drain-timeout", drain], text, "DRAIN_TIMEOUT", str(MAX_TIMEOUT))


@pytest.mark.parametrize("drain", ["9223372036854775800", "1e300", str(MAX_TIMEOUT + 1)])
def test_an_existing_drain_timeout_past_the_dispatcher_s_bound_is_refused(drain: str) -> None:
    text = with_dispatcher_env(BARE_JOB, [{"name": "CONVEYOR_DRAIN_TIMEOUT", "value": drain}])
    refused([], text, "DRAIN_TIMEOUT", str(MAX_TIMEOUT))


def test_the_longest_drain_timeout_gives_a_grace_period_within_int64() -> None:
    docs = inject(BARE_JOB, drain_timeout=MAX_TIMEOUT)
    pod = one(docs, "ScaledJob")["spec"]["jobTargetRef"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == MAX_TIMEOUT + 15 <= INT64_MAX


def test_a_grace_period_past_int64_is_not_kept() -> None:
    text = BARE_JOB.replace(
        "    spec:\n", f"    spec:\n      terminationGracePeriodSeconds: {2**64}\n"
    )
    pod = one(inject(text), "ScaledJob")["spec"]["jobTargetRef"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 615


def named(text: str, name: str) -> str:
    (old,) = re.findall(r"metadata: \{name: (\w+)\}", text)
    return text.replace(f"{{name: {old}}}", f"{{name: '{name}'}}", 1)


@pytest.mark.parametrize("name", ["MyFn", "my_fn", "fn-", "-fn", "fné", "a..b", "x" * 254])
@pytest.mark.parametrize(
    ("text", "args"),
    [(BARE_DEPLOYMENT, []), (BARE_DEPLOYMENT, ["--mode", "job"]), (BARE_JOB, []), (BARE_KSVC, [])],
    ids=["sidecar", "job-from-deployment", "job", "knative"],
)
def test_a_workload_name_kubernetes_refuses_is_refused(
    text: str, args: list[str], name: str
) -> None:
    """Found by a black-box sweep: `MyFn`, `my_fn` and `fn-` gave a Deployment, ScaledObject
    and TriggerAuthentication of those names and a label value `fn-`; `-fn` was refused only
    through the queue named after it. The queue is named here: the name itself is refused."""
    refused([*args, "--queue", "fn"], named(text, name), repr(name), "metadata.name")


@pytest.mark.parametrize("name", ["1fn", "fn.v2", "k" * 64])
def test_a_knative_service_name_knative_refuses_is_refused(name: str) -> None:
    """Knative names the Kubernetes Services of a Knative Service after it: a DNS-1035 label."""
    refused(["--queue", "fn"], named(BARE_KSVC, name), repr(name), "DNS-1035 label")


LONGEST = {
    # a dot where a shortened name is cut: the cut must not end on it
    "sidecar": (named(BARE_DEPLOYMENT, "x" * 44 + "." + "y" * 208), []),
    "job-from-deployment": (named(BARE_DEPLOYMENT, "x" * 44 + "." + "y" * 208), ["--mode", "job"]),
    "job": (named(BARE_JOB, "j" * 253), []),
    "knative": (named(BARE_KSVC, "k" * 63), []),
}
KIND_NAME_LIMITS = {"ScaledObject": 54, "ScaledJob": 54}


@pytest.mark.parametrize("mode", sorted(LONGEST))
def test_the_longest_accepted_name_gives_names_within_each_kind_s_limits(mode: str) -> None:
    """Every name inject derives (`<name>-dispatcher`, the KEDA objects', the labels) stays
    valid for the longest workload name it accepts."""
    text, args = LONGEST[mode]
    done = run_cli(*args, "--queue", "fn", stdin=text)
    assert done.returncode == 0, done.stderr
    docs = load_documents(done.stdout)
    for doc in docs:
        name = doc["metadata"]["name"]
        limit = KIND_NAME_LIMITS.get(doc["kind"], 253)
        assert len(name) <= limit and SUBDOMAIN.fullmatch(name), (doc["kind"], name)
    for labels in (m for doc in docs for m in label_maps(doc)):
        for key, value in labels.items():
            assert len(value) <= 63 and LABEL_VALUE.fullmatch(value), (key, value)
    assert run_cli(*args, stdin=done.stdout).stdout == done.stdout


def test_a_workload_name_with_dots_is_taken() -> None:
    docs = inject(named(BARE_DEPLOYMENT, "fn.v2"), queue="fn")
    assert one(docs, "ScaledObject")["spec"]["scaleTargetRef"]["name"] == "fn.v2"


CLASHES = {
    # knative mode's dispatcher Deployment (and its ScaledObject) is `<name>-dispatcher`
    "knative-dispatcher": (
        named(BARE_KSVC, "x") + "---\n" + named(BARE_DEPLOYMENT, "x-dispatcher"),
        "Deployment x-dispatcher",
    ),
    "dispatcher-knative": (
        named(BARE_DEPLOYMENT, "x-dispatcher") + "---\n" + named(BARE_KSVC, "x"),
        "Deployment x-dispatcher",
    ),
    # a Deployment and a Job of one name: one TriggerAuthentication name for both
    "deployment-job": (
        named(BARE_DEPLOYMENT, "x") + "---\n" + named(BARE_JOB, "x"),
        "TriggerAuthentication x-rabbitmq",
    ),
    "twice": (BARE_DEPLOYMENT + "---\n" + BARE_DEPLOYMENT, "Deployment fn"),
    "passed-through": (
        BARE_DEPLOYMENT + ("---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n") * 2,
        "ConfigMap c",
    ),
}


@pytest.mark.parametrize("case", sorted(CLASHES))
def test_two_objects_of_one_kind_namespace_and_name_are_refused(case: str) -> None:
    """Found by a black-box sweep: a Knative Service `x` beside a Deployment `x-dispatcher` gave
    two Deployments and two ScaledObjects `x-dispatcher` (applying one replaces the other), and
    re-injecting that scaled `x` on `x-dispatcher-in`."""
    text, clash = CLASHES[case]
    refused(["--queue", "fn"], text, clash)


def test_objects_of_one_name_in_other_namespaces_or_api_groups_are_taken() -> None:
    other = named(BARE_DEPLOYMENT, "x-dispatcher").replace(
        "metadata: {name: 'x-dispatcher'}", "metadata: {name: 'x-dispatcher', namespace: other}"
    )
    service = (
        "---\napiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec: {ports: [{port: 80}]}\n"
    )
    docs = inject(named(BARE_KSVC, "x") + "---\n" + other + service)
    assert [d["kind"] for d in docs].count("Deployment") == 2
