"""The notifier's memory of targets that let an attempt time out (gateway.notifier._Marks)."""

from __future__ import annotations

import time

import pytest

from gateway import notifier


def test_a_mark_lasts_its_time_and_goes_when_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(notifier, "SLOW_MEMORY", 0.2)
    marks = notifier._Marks()
    marks.mark("a:80")
    marks.mark("b:80")
    assert marks.current() == ["a:80", "b:80"]
    marks.forget("a:80")
    assert marks.current() == ["b:80"]
    time.sleep(0.1)
    marks.mark("c:80")
    marks.mark("b:80")  # marked again: remembered from now
    time.sleep(0.15)
    assert marks.current() == ["c:80", "b:80"]
    time.sleep(0.1)
    assert marks.current() == []


def test_marks_are_bounded_the_earliest_to_expire_go_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(notifier, "MAX_MARKS", 3)
    marks = notifier._Marks()
    for key in ("a", "b", "c", "a", "d"):
        marks.mark(key)
    assert marks.current() == ["c", "a", "d"]
