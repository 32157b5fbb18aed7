"""The chaos run's own logic, without any server: its copy of the sleeper's decision,
its fault schedule, its submitter's retries and its checks."""

from __future__ import annotations

import asyncio
import importlib.util
import random
import threading
import uuid
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

from bench.chaos import verify
from bench.chaos.config import SPARSE_KINDS, FaultKind, FaultPlan
from bench.chaos.submitter import Gate, SubmitResult, Submitter, TaskSpec

REPO = Path(__file__).resolve().parents[2]


def _load_sleeper(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.delenv("CALL_LOG", raising=False)  # importing it must not open a log
    spec = importlib.util.spec_from_file_location(
        "chaos_sleeper", REPO / "functions" / "sleeper" / "main.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("rate", [0.0, 0.1, 0.5, 1.0])
def test_doomed_is_exactly_the_sleepers_decision(
    monkeypatch: pytest.MonkeyPatch, rate: float
) -> None:
    sleeper = _load_sleeper(monkeypatch)
    ids = [str(uuid.UUID(int=random.Random(i).getrandbits(128))) for i in range(3000)]
    assert [verify.doomed(t, rate) for t in ids] == [sleeper.doomed(t, rate) for t in ids]
    if rate == 0.1:
        assert 200 < sum(verify.doomed(t, rate) for t in ids) < 400


def test_schedule_has_every_kind_in_order_and_is_reproducible() -> None:
    plan = FaultPlan.for_window(15.0, per_kind=1, kill_interval=5.0)
    first = plan.schedule(random.Random(7))
    assert first == plan.schedule(random.Random(7))
    assert {f.kind for f in first} == {*SPARSE_KINDS, FaultKind.DISPATCHER_SIGKILL}
    assert Counter(f.kind for f in first)[FaultKind.DISPATCHER_SIGKILL] == 3
    points = [f.at for f in first]
    assert points == sorted(points)
    assert all(plan.first <= p < plan.last for p in points)


def test_a_plan_without_infra_faults_keeps_the_others() -> None:
    plan = FaultPlan.for_window(15.0).without(
        (FaultKind.RABBITMQ_RESTART, FaultKind.POSTGRES_RESTART)
    )
    kinds = {f.kind for f in plan.schedule(random.Random(1))}
    assert FaultKind.RABBITMQ_RESTART not in kinds and FaultKind.POSTGRES_RESTART not in kinds
    assert set(SPARSE_KINDS) - kinds == {FaultKind.RABBITMQ_RESTART, FaultKind.POSTGRES_RESTART}


def _submitter(handler: httpx.MockTransport, **kwargs: float) -> Submitter:
    return Submitter(
        "http://gateway.test",
        "svc",
        ("client", "secret"),
        lambda hook: f"http://localhost:1/{hook}",
        concurrency=kwargs.get("concurrency", 4),
        rate=kwargs.get("rate", 0),
        retry_budget=kwargs.get("retry_budget", 5.0),
        transport=handler,
    )


def test_submitter_retries_with_the_same_key_until_answered() -> None:
    seen: list[str] = []
    rows: dict[str, str] = {}

    def answer(request: httpx.Request) -> httpx.Response:
        key = request.headers["Idempotency-Key"]
        seen.append(key)
        if seen.count(key) == 1:
            rows[key] = str(uuid.uuid4())  # committed, then the answer is lost
            raise httpx.RemoteProtocolError("server disconnected", request=request)
        if seen.count(key) == 2:
            return httpx.Response(503, json={"status": "error"})
        return httpx.Response(200, json={"status": "success", "data": {"taskId": rows[key]}})

    specs = [TaskSpec(f"k{i}", {"sleep": 0}, callback=i == 0, repeat=i == 1) for i in range(3)]
    result = asyncio.run(_submitter(httpx.MockTransport(answer)).run(specs))
    assert result.accepted == rows
    assert result.retried == 3 and result.found_after_failure == 3
    assert result.repeats == 1 and result.mismatches == []
    assert result.answers == Counter({"RemoteProtocolError": 3, "503": 3, "200": 4})
    assert result.callbacks == {rows["k0"]}


def test_submitter_reports_a_repeat_naming_another_task() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(201, json={"data": {"taskId": str(uuid.uuid4())}})

    specs = [TaskSpec("k", {"sleep": 0}, callback=False, repeat=True)]
    result = asyncio.run(_submitter(httpx.MockTransport(answer)).run(specs))
    assert len(result.mismatches) == 1


def test_submitter_gives_up_after_its_budget() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    specs = [TaskSpec("k", {"sleep": 0}, callback=False, repeat=False)]
    result = asyncio.run(_submitter(httpx.MockTransport(answer), retry_budget=0.3).run(specs))
    assert result.abandoned == ["k"] and not result.accepted


def test_gate_holds_submissions_at_its_limit() -> None:
    async def scenario() -> list[int]:
        gate = Gate(limit=2)
        stop = threading.Event()
        passed: list[int] = []

        async def one(index: int) -> None:
            await gate.wait_for(index, stop)
            passed.append(index)

        tasks = [asyncio.create_task(one(i)) for i in range(4)]
        await asyncio.sleep(0.05)
        held = sorted(passed)
        gate.open()
        await asyncio.gather(*tasks)
        return held

    assert asyncio.run(scenario()) == [0, 1]


def test_checks_flag_stuck_wrong_and_duplicated_keys() -> None:
    doomed_id = next(
        str(uuid.UUID(int=i)) for i in range(10_000) if verify.doomed(str(uuid.UUID(int=i)), 0.1)
    )
    fine_id = next(
        str(uuid.UUID(int=i))
        for i in range(10_000)
        if not verify.doomed(str(uuid.UUID(int=i)), 0.1)
    )
    rows = [
        (doomed_id, "SUCCESS", "a", None, None, False, 1, None),  # the function said FAILURE
        (fine_id, "SUCCESS", "b", None, None, False, 1, None),
        (str(uuid.uuid4()), "IN_PROGRESS", "b", None, None, False, 1, None),  # stuck, key again
    ]
    verdict = verify.Verdict()
    verify._check_outcomes(verdict, rows, 0.1)
    submitted = SubmitResult(accepted={"a": doomed_id, "b": fine_id})
    verify._check_idempotency(verdict, rows, submitted)
    assert [w["taskId"] for w in verdict.wrong_outcome] == [doomed_id]
    assert len(verdict.stuck) == 1
    assert verdict.idempotency["keys_with_several_rows"] == 1
    assert not verdict.idempotent and not verdict.ok


def test_a_keyless_submission_is_retried_only_when_nothing_can_have_been_made() -> None:
    calls: Counter[str] = Counter()

    def answer(request: httpx.Request) -> httpx.Response:
        body = request.content.decode()
        assert "Idempotency-Key" not in request.headers
        kind = "refused" if "refused" in body else "lost"
        calls[kind] += 1
        if calls[kind] == 1:
            if kind == "refused":
                raise httpx.ConnectError("refused", request=request)  # never reached the server
            raise httpx.ReadTimeout("no answer", request=request)  # may have been committed
        return httpx.Response(201, json={"data": {"taskId": str(uuid.uuid4())}})

    specs = [
        TaskSpec("a", {"case": "refused"}, callback=False, repeat=False, keyed=False),
        TaskSpec("b", {"case": "lost"}, callback=False, repeat=False, keyed=False),
    ]
    result = asyncio.run(_submitter(httpx.MockTransport(answer)).run(specs))
    assert list(result.accepted) == ["a"] and result.keyless == 1
    assert result.keyless_unknown == 1 and not result.abandoned
    assert calls == Counter({"refused": 2, "lost": 1})


def test_hostile_answers_must_end_as_the_platform_promises() -> None:
    rows = [
        ("t1", "SUCCESS", None, None, None, False, 1, "nul"),
        (
            "t2",
            "FAILURE",
            None,
            "The function's answer could not be parsed: x",
            None,
            False,
            1,
            "deep",
        ),
        ("t3", "SUCCESS", None, None, None, False, 1, "trickle"),  # should have been cut
        ("t4", "FAILURE", None, "workers crashed", None, False, 1, "huge"),  # wrong reason
    ]
    verdict = verify.Verdict()
    verify._check_outcomes(verdict, rows, 0.0)
    assert sorted(w["taskId"] for w in verdict.wrong_outcome) == ["t3", "t4"]
    assert verdict.hostile == {
        "nul SUCCESS": 1,
        "deep FAILURE": 1,
        "trickle SUCCESS": 1,
        "huge FAILURE": 1,
    }


def test_the_verifier_catches_a_planted_lost_task(
    platform: Any, database_url: str, tmp_path: Path
) -> None:
    """Self-check on the real database: a task the client was told about and the platform
    does not have must make the verdict fail."""
    from bench.chaos.infra import QueueState

    svc = platform.service()
    planted = str(uuid.uuid4())
    submitted = SubmitResult(accepted={"k": planted})
    verdict = verify.verify(
        database_url,
        svc.name,
        submitted,
        tmp_path / "calls.log",
        0.0,
        {},
        QueueState(0, 0),
        None,
    )
    assert verdict.lost == [planted]
    assert not verdict.ok


def test_a_stall_runs_from_the_faults_start_to_the_first_completion_after_its_end() -> None:
    from bench.chaos.cluster import stall

    completions = [1.0, 2.0, 10.0, 11.0, 30.0, 50.0]
    assert stall(completions, 0.0, 10.5) == 8.0  # 2 -> 10; closed by 11
    assert stall(completions, 12.0, 20.0) == 18.0  # nothing until 30, after the fault ended
    assert stall(completions, 11.5, 40.0) == 20.0  # 30 -> 50
    assert stall(completions, 45.0, 60.0) is None  # nothing completed after it: stuck


def test_the_cluster_faults_stay_out_of_the_single_node_plan() -> None:
    from bench.chaos.config import CLUSTER_KINDS

    assert not set(CLUSTER_KINDS) & set(SPARSE_KINDS)
    kinds = {f.kind for f in FaultPlan.for_window(400.0).schedule(random.Random(1))}
    assert not kinds & set(CLUSTER_KINDS)


def test_backlog_counts_that_differ_from_the_rows_fail_the_run() -> None:
    verdict = verify.Verdict(in_queue={"messages": 0, "consumers": 0})
    verdict.backlog = {"counted": 0, "pending": 0, "in_blocks": 0, "immediate": 0}
    assert verdict.ok
    verdict.backlog = {"counted": 1, "pending": 0, "in_blocks": 0, "immediate": 0}
    assert not verdict.backlog_exact and not verdict.ok
