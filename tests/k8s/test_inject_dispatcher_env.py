"""`conveyor inject` and the environment the dispatcher actually runs with: each injected pod's
env goes through the kubelet's rules (Service links first, the container's own env over them,
`$(VAR)` expanded) and `DispatcherSettings.from_env`, and what the dispatcher would run with
must agree with what inject derived from it (KEDA's `value`, the grace period)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest

from conveyor.dispatcher_settings import DispatcherSettings, ShutdownMode
from conveyor.inject import InjectOptions, inject_yaml, load_documents
from conveyor.inject.documents import InjectError, dump_documents
from tests.k8s import checks
from tests.k8s.test_inject import BARE_DEPLOYMENT, BARE_JOB, BARE_KSVC, one

BARE = {"sidecar": BARE_DEPLOYMENT, "job": BARE_JOB, "knative": BARE_KSVC}
# What the downward API and the operator's Secret give the pod.
FIELDS = {
    "metadata.name": "fn-7d9c-x2b",
    "metadata.namespace": "default",
    "status.podIP": "10.0.0.7",
}
AMQP = "amqp://user:pass@rabbitmq:5672/"


def inject(text: str, **options: Any) -> tuple[list[dict], list[str]]:
    out, warnings = inject_yaml(text, InjectOptions(**options))
    return load_documents(out), warnings


def dispatcher(docs: list[dict]) -> checks.Dispatcher:
    (d,) = checks.dispatchers(docs)
    return d


def reinject_with(text: str, env: list[dict]) -> tuple[list[dict], list[str]]:
    """Injects, sets ``env`` on the dispatcher as a user would (in place of inject's entry of
    the same setting), and injects again."""
    docs, _ = inject(text)
    checks.set_env(dispatcher(docs).container, env)
    return inject(dump_documents(docs))


def service_links(name: str, ip: str, port: int) -> dict[str, str]:
    """The variables the kubelet adds for a Service of the namespace (Docker links' names)."""
    prefix = name.upper().replace("-", "_")
    url = f"tcp://{ip}:{port}"
    return {
        f"{prefix}_SERVICE_HOST": ip,
        f"{prefix}_SERVICE_PORT": str(port),
        f"{prefix}_PORT": url,
        f"{prefix}_PORT_{port}_TCP": url,
        f"{prefix}_PORT_{port}_TCP_PROTO": "tcp",
        f"{prefix}_PORT_{port}_TCP_PORT": str(port),
        f"{prefix}_PORT_{port}_TCP_ADDR": ip,
    }


def process_env(
    d: checks.Dispatcher, services: tuple[str, ...] = (), env_from: dict[str, str] | None = None
) -> dict[str, str]:
    """The dispatcher process's environment: Service links (unless the pod turns them off),
    then the keys of its envFrom sources (``env_from``), then the container's env over them,
    in order, `$(VAR)` expanded."""
    env: dict[str, str] = {}
    if d.pod.spec.get("enableServiceLinks", True) is not False:
        for name in services:
            env |= service_links(name, "10.96.0.12", 9090)
    env |= env_from or {}
    for entry in d.container.get("env") or []:
        source = entry.get("valueFrom") or {}
        if "fieldRef" in source:
            value = FIELDS[source["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in source:
            value = AMQP
        else:
            value = re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), str(entry["value"]))
        env[entry["name"]] = value
    return env


def settings(d: checks.Dispatcher, services: tuple[str, ...] = ()) -> DispatcherSettings:
    return DispatcherSettings.from_env(process_env(d, services))


def trigger_value(docs: list[dict]) -> int:
    owner = docs[0] if docs[0]["kind"] == "ScaledJob" else one(docs, "ScaledObject")
    return int(owner["spec"]["triggers"][0]["metadata"]["value"])


# ------------------------------------------------------------ KEDA's value and the buffer


@pytest.mark.parametrize("variable", ["PREFETCH_BUFFER", "CONVEYOR_PREFETCH_BUFFER"])
@pytest.mark.parametrize("mode", ["sidecar", "knative"])
def test_keda_value_counts_the_prefetch_buffer(mode: str, variable: str) -> None:
    """Found by a review: with a PREFETCH_BUFFER the trigger's value stayed CONCURRENCY, and KEDA
    over-scaled on the buffered messages. Now it is CONCURRENCY + PREFETCH_BUFFER (SPEC §7)."""
    docs, _ = reinject_with(BARE[mode], [{"name": variable, "value": "4"}])
    run = settings(dispatcher(docs))
    assert (run.concurrency, run.prefetch_buffer) == (4, 4)
    assert trigger_value(docs) == run.concurrency + run.prefetch_buffer
    checks.check_scaling(docs)
    assert inject(dump_documents(docs))[0] == docs


def test_job_mode_value_stays_one_whatever_the_buffer() -> None:
    """Found by a review: a PREFETCH_BUFFER in job mode was kept though ONE_SHOT takes one
    message at a time, so the env and the trigger disagreed. Now job mode writes no buffer."""
    docs, _ = reinject_with(BARE["job"], [{"name": "PREFETCH_BUFFER", "value": "4"}])
    run = settings(dispatcher(docs))
    assert run.one_shot and trigger_value(docs) == 1
    assert run.prefetch_buffer == 0
    checks.check_scaling(docs)


# ------------------------------------------------------- both spellings of a setting


@pytest.mark.parametrize("prefix", ["CONVEYOR_", "conveyor_"])
def test_prefixed_drain_settings_set_the_grace_period(prefix: str) -> None:
    """Found by a review: inject read only DRAIN_TIMEOUT, the dispatcher CONVEYOR_DRAIN_TIMEOUT
    first: grace 45 s for a 300 s drain. Now inject reads it as the dispatcher does."""
    docs, warnings = reinject_with(
        BARE_DEPLOYMENT,
        [
            {"name": f"{prefix}SHUTDOWN_MODE", "value": "drain"},
            {"name": f"{prefix}DRAIN_TIMEOUT", "value": "300"},
        ],
    )
    d = dispatcher(docs)
    run = settings(d)
    assert (run.shutdown_mode, run.drain_timeout) == (ShutdownMode.DRAIN, 300)
    assert d.pod.spec["terminationGracePeriodSeconds"] > run.drain_timeout
    assert any("job mode" in w for w in warnings)  # 300 s in a Deployment is still warned of
    assert (d.env["CONVEYOR_SHUTDOWN_MODE"], d.env["CONVEYOR_DRAIN_TIMEOUT"]) == ("drain", "300")


def test_prefixed_concurrency_sets_the_keda_value() -> None:
    """Found by a review: a CONVEYOR_CONCURRENCY of 8 ran 8 calls while KEDA's value said 4.
    Now inject reads it, writes CONCURRENCY=8 once, and the trigger agrees."""
    docs, _ = reinject_with(BARE_DEPLOYMENT, [{"name": "CONVEYOR_CONCURRENCY", "value": "8"}])
    run = settings(dispatcher(docs))
    assert run.concurrency == 8
    assert trigger_value(docs) == 8
    checks.check_scaling(docs)


# A copy in the other spelling of a variable inject writes (it writes CONVEYOR_<NAME>, which
# the dispatcher reads first), with what it would change.
OTHER_SPELLINGS = {
    "ONE_SHOT": "1",
    "FUNCTION_URL": "http://127.0.0.1:9999/",
    "HOSTNAME": "fixed-name",
    "DISPATCHER_PORT": "8080",  # the function's own port
    "QUEUE": "elsewhere",
}


@pytest.mark.parametrize("variable", sorted(OTHER_SPELLINGS))
def test_one_variable_per_setting(variable: str) -> None:
    """Found by a review: a user's copy of a variable in the other spelling was kept beside
    inject's, and the prefixed one won in the dispatcher. Now each setting is written once."""
    docs, _ = inject(BARE_DEPLOYMENT)
    dispatcher(docs).container["env"] += [{"name": variable, "value": OTHER_SPELLINGS[variable]}]
    docs, _ = inject(dump_documents(docs))
    d = dispatcher(docs)
    fields = [e["name"].upper().removeprefix("CONVEYOR_") for e in d.container["env"]]
    assert len(fields) == len(set(fields)), fields
    run = settings(d)
    assert not run.one_shot
    assert run.function_url == "http://127.0.0.1:8080/"
    assert run.hostname == FIELDS["metadata.name"]
    assert run.dispatcher_port != 8080
    assert run.queue == "fn"
    checks.check_scaling(docs)


# -------------------------------------------------------------- Service links


@pytest.mark.parametrize("service", ["metrics", "conveyor-dispatcher", "progress"])
@pytest.mark.parametrize("mode", sorted(BARE))
def test_service_links_cannot_reach_the_dispatcher(mode: str, service: str) -> None:
    """Found by a review: a Service named `metrics` put METRICS_PORT=tcp://… in sidecar and job
    pods and every dispatcher exited 1. Now every injected pod sets enableServiceLinks: false."""
    docs, _ = inject(BARE[mode])
    d = dispatcher(docs)
    run = settings(d, services=(service,))
    assert run.dispatcher_port == int(d.env["CONVEYOR_DISPATCHER_PORT"])
    assert d.pod.spec["enableServiceLinks"] is False


def test_an_explicit_enable_service_links_is_turned_off_with_a_warning() -> None:
    """The author's `enableServiceLinks: true` would let a Service named `metrics` stop every
    dispatcher: it is turned off, and the warning says why."""
    text = BARE_DEPLOYMENT.replace(
        "    spec:\n      containers:",
        "    spec:\n      enableServiceLinks: true\n      containers:",
    )
    docs, warnings = inject(text)
    assert dispatcher(docs).pod.spec["enableServiceLinks"] is False
    assert any("enableServiceLinks" in w for w in warnings), warnings
    assert inject(dump_documents(docs))[1] == []


# -------------------------------------------------------- what re-injecting keeps


@pytest.mark.parametrize(
    ("mode", "variable", "value"),
    [
        ("job", "IDLE_EXIT_SECONDS", "0.5"),
        ("sidecar", "DRAIN_TIMEOUT", "29.5"),
        ("knative", "DRAIN_TIMEOUT", "12.25"),
    ],
)
def test_a_fraction_of_a_second_is_kept_as_written(mode: str, variable: str, value: str) -> None:
    """Found by a review: inject read these as whole numbers, so IDLE_EXIT_SECONDS=0.5 came back
    as 0, which the dispatcher refuses (every Job's dispatcher exited 1), and a drain of 29.5 s
    as 29. Now a duration is kept as written, and the grace period still outlasts it."""
    docs, _ = reinject_with(BARE[mode], [{"name": variable, "value": value}])
    d = dispatcher(docs)
    run = settings(d)
    assert d.env[f"CONVEYOR_{variable}"] == value
    assert getattr(run, variable.lower()) == float(value)
    assert d.pod.spec["terminationGracePeriodSeconds"] > run.drain_timeout
    assert inject(dump_documents(docs))[0] == docs


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("CONCURRENCY", "4.5", "not a whole number"),
        ("CONCURRENCY", "0", "at least 1"),
        ("PREFETCH_BUFFER", "1.5", "not a whole number"),
        ("DRAIN_TIMEOUT", "-1", "0 or more"),
        ("DRAIN_TIMEOUT", "nan", "0 or more"),
    ],
)
def test_a_setting_the_dispatcher_refuses_is_refused_by_inject(
    variable: str, value: str, says: str
) -> None:
    """The dispatcher would refuse these at start; inject used to round them (4.5 → 4) or put
    its default in their place (0 → 4) without a word."""
    with pytest.raises(InjectError, match=says):
        reinject_with(BARE_DEPLOYMENT, [{"name": variable, "value": value}])


def test_idle_exit_seconds_of_zero_is_refused_in_job_mode() -> None:
    with pytest.raises(InjectError, match="greater than 0"):
        reinject_with(BARE_JOB, [{"name": "IDLE_EXIT_SECONDS", "value": "0"}])


def test_an_integer_is_read_as_the_dispatcher_reads_it() -> None:
    """`4.0` is an integer to the dispatcher: inject takes it too (and writes 4)."""
    docs, _ = reinject_with(BARE_DEPLOYMENT, [{"name": "CONCURRENCY", "value": "4.0"}])
    assert dispatcher(docs).env["CONVEYOR_CONCURRENCY"] == "4" and trigger_value(docs) == 4


def test_a_function_url_that_is_no_url_gets_inject_s_own() -> None:
    """A FUNCTION_URL without a scheme (which the dispatcher refuses) is replaced, not mined
    for a path: `localhost:8080/invoke` would have given port 80808080."""
    docs, _ = reinject_with(
        BARE_DEPLOYMENT, [{"name": "FUNCTION_URL", "value": "localhost:8080/x"}]
    )
    assert settings(dispatcher(docs)).function_url == "http://127.0.0.1:8080/"


@pytest.mark.parametrize("mode", sorted(BARE))
def test_the_functions_path_is_kept(mode: str) -> None:
    """Found by a review: re-injecting wrote FUNCTION_URL back as the bare port, so a function
    served on /invoke got its tasks POSTed to /. Inject owns the host and port (they come from
    the function's container); the path and query are the author's."""
    docs, _ = reinject_with(
        BARE[mode], [{"name": "FUNCTION_URL", "value": "http://127.0.0.1:8080/invoke?v=2"}]
    )
    d = dispatcher(docs)
    assert d.env["CONVEYOR_FUNCTION_URL"].endswith("/invoke?v=2"), d.env["CONVEYOR_FUNCTION_URL"]
    run = settings(d)
    assert run.function_url.endswith("/invoke?v=2")
    assert inject(dump_documents(docs))[0] == docs


@pytest.mark.parametrize(
    ("variable", "option"),
    [
        ("CONCURRENCY", {"concurrency": 6}),
        ("CONVEYOR_QUEUE", {"queue": "jobs"}),
        ("DRAIN_TIMEOUT", {"drain_timeout": 40}),
        ("PREFETCH_BUFFER", None),
        ("FUNCTION_URL", None),
    ],
)
def test_a_setting_from_a_config_map_is_not_replaced_without_a_word(
    variable: str, option: dict[str, Any] | None
) -> None:
    """Found by a review: CONCURRENCY taken from a ConfigMap came back as the literal '4' (the
    default), exit 0, no warning. Inject must know these values (the KEDA trigger's queue and
    value, the grace period come from them), so it says which one it cannot read and how to set
    it; given by its option, the option's value is written."""
    reference = {"configMapKeyRef": {"name": "fn-settings", "key": variable.lower()}}
    docs, _ = inject(BARE_DEPLOYMENT)
    checks.set_env(dispatcher(docs).container, [{"name": variable, "valueFrom": reference}])
    text = dump_documents(docs)
    with pytest.raises(InjectError, match=f"{variable} from valueFrom"):
        inject(text)
    if option is None:
        return
    again, _ = inject(text, **option)
    run = settings(dispatcher(again)) if variable != "CONVEYOR_QUEUE" else None
    if variable == "CONCURRENCY":
        assert run is not None and run.concurrency == 6 and trigger_value(again) == 6
    if variable == "DRAIN_TIMEOUT":
        assert run is not None and run.drain_timeout == 40
    if variable == "CONVEYOR_QUEUE":
        assert dispatcher(again).env["CONVEYOR_QUEUE"] == "jobs"
    checks.check_scaling(again)


# ------------------------------------------------------- envFrom on the dispatcher

# A ConfigMap (or Secret) of the dispatcher's settings, as an operator writes one: each
# setting inject writes, in the spelling the dispatcher reads first, and one it does not.
SETTINGS_CONFIG_MAP = {
    "CONVEYOR_QUEUE": "elsewhere",
    "CONVEYOR_FUNCTION_URL": "http://127.0.0.1:9999/",
    "CONVEYOR_CONCURRENCY": "16",
    "CONVEYOR_PREFETCH_BUFFER": "8",
    "CONVEYOR_SHUTDOWN_MODE": "drain",
    "CONVEYOR_DRAIN_TIMEOUT": "100",
    "CONVEYOR_DISPATCHER_PORT": "7000",
    "CONVEYOR_ONE_SHOT": "1",
    "CONVEYOR_IDLE_EXIT_SECONDS": "5",
    "CONVEYOR_PROGRESS_PORT": "7001",
    "CONVEYOR_POD_IP": "10.0.0.99",
    "CONVEYOR_HOSTNAME": "fixed-name",
    "CONVEYOR_LOG_FORMAT": "json",
}


@pytest.mark.parametrize("mode", sorted(BARE))
def test_env_from_on_the_dispatcher_overrides_nothing_inject_wrote(mode: str) -> None:
    """Found by a black-box sweep: an envFrom ConfigMap with CONVEYOR_CONCURRENCY=16 and
    CONVEYOR_DRAIN_TIMEOUT=100 made the dispatcher run 16 calls under a KEDA value of 4, and
    drain 100 s in a 45 s grace period (inject wrote CONCURRENCY, which the dispatcher reads
    after CONVEYOR_CONCURRENCY). An env entry beats an envFrom key of its name: what inject
    writes wins whatever the source holds; the source still sets what inject does not."""
    docs, _ = inject(BARE[mode])
    dispatcher(docs).container["envFrom"] = [{"configMapRef": {"name": "dispatcher-settings"}}]
    docs, _ = inject(dump_documents(docs))
    d = dispatcher(docs)
    assert d.container["envFrom"] == [{"configMapRef": {"name": "dispatcher-settings"}}]
    run = DispatcherSettings.from_env(process_env(d, env_from=SETTINGS_CONFIG_MAP))
    fields = {f.name for f in dataclasses.fields(DispatcherSettings)}
    written = {e["name"].upper().removeprefix("CONVEYOR_").lower() for e in d.container["env"]}
    for field in sorted(written & fields):
        assert getattr(run, field) == getattr(settings(d), field), field
    assert run.log_format == "json"
    held = 1 if run.one_shot else run.concurrency + run.prefetch_buffer  # its prefetch
    assert trigger_value(docs) == held
    assert d.pod.spec["terminationGracePeriodSeconds"] > run.drain_timeout
    checks.check_scaling(docs)
    assert inject(dump_documents(docs))[0] == docs
