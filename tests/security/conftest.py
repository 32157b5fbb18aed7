"""Schemathesis names each operation's test `test_x[GET /path]` but gives every one the same
node id (`test_x`) on this pytest. Node ids are how pytest-xdist tells tests apart: it ran one
operation per test function and dropped the others, silently. Each gets the id its name says."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if type(item).__name__ == "SchemathesisFunction" and item.parent is not None:
            item._id = item.parent.id.child(item.name)  # type: ignore[attr-defined]
