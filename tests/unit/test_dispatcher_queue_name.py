"""The dispatcher's queue is held to the rule the gateway holds every queue name to: an empty
`CONVEYOR_QUEUE=` started, then waited forever for the gateway to declare `-in` and `-out`,
queues no gateway can declare. Now it is refused at start, naming the variable."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conveyor.dispatcher_settings import DispatcherSettings, SettingsError
from gateway.platform_file import ServiceSpec, validate
from tests.k8s.test_inject import BARE_DEPLOYMENT, run_cli
from tests.support.processes import REPO

REFUSED = ["", " ", "\t", " sleeper", "sleeper\n", "a b", "-sleeper", "sl/eeper", "x" * 101]
ACCEPTED = ["sleeper", "t-4bd5d48a4855", "a.b_c-D9", "x" * 100]


@pytest.mark.parametrize("queue", REFUSED)
def test_a_queue_name_the_gateway_would_refuse_is_refused(queue: str) -> None:
    with pytest.raises(SettingsError, match=r"^CONVEYOR_QUEUE must be a queue name"):
        DispatcherSettings.from_env({"CONVEYOR_QUEUE": queue})


@pytest.mark.parametrize("queue", ACCEPTED)
def test_a_queue_name_the_gateway_declares_is_accepted(queue: str) -> None:
    assert DispatcherSettings.from_env({"QUEUE": queue}).queue == queue


@pytest.mark.parametrize("queue", REFUSED + ACCEPTED)
def test_the_dispatcher_and_the_platform_file_share_one_rule(queue: str) -> None:
    try:
        DispatcherSettings(queue=queue)
        dispatcher_takes = True
    except SettingsError:
        dispatcher_takes = False
    try:
        validate(ServiceSpec, {"name": "service", "queueName": queue})
        gateway_takes = True
    except ValueError:
        gateway_takes = False
    assert dispatcher_takes == gateway_takes == (queue in ACCEPTED)


def test_conveyor_dispatcher_with_an_empty_queue_exits_at_once_in_one_line() -> None:
    try:
        done = subprocess.run(
            [sys.executable, "-m", "conveyor", "dispatcher"],
            cwd=REPO,
            env={**os.environ, "CONVEYOR_QUEUE": ""},
            capture_output=True,
            text=True,
            timeout=10,
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError("CONVEYOR_QUEUE= was not refused: the dispatcher ran on") from exc
    assert done.returncode == 1, done.stderr[-2000:]
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("error: CONVEYOR_QUEUE must be a queue name"), line


def test_inject_refuses_a_workload_whose_queue_no_gateway_declares() -> None:
    """`conveyor inject` names the queue after the workload by default: a name longer than a
    queue name may be needs `--queue`, or its dispatcher would never start."""
    deployment = BARE_DEPLOYMENT.replace("{name: fn}", "{name: fn-" + "x" * 100 + "}")
    refused = run_cli(stdin=deployment)
    assert refused.returncode == 2, refused.stderr
    assert "CONVEYOR_QUEUE must be a queue name" in refused.stderr
    assert run_cli("--queue", "fn", stdin=deployment).returncode == 0
