"""Static checks of the Dockerfiles (Docker cannot run in the test environment):
slim base, numeric non-root user, exec-form CMD, dependencies installed before the
source is copied, the dispatcher image without the gateway's dependencies, and
every copied file present in its build context."""

from __future__ import annotations

import json
import re

import pytest

from tests.k8s.conftest import REPO_ROOT

# Dockerfile -> its build context.
IMAGES = {
    "gateway/Dockerfile": ".",
    "dispatcher/Dockerfile": ".",
    "functions/sleeper/Dockerfile": "functions/sleeper",
    "functions/thumbnail/Dockerfile": "functions/thumbnail",
    "functions/node-echo/Dockerfile": "functions/node-echo",
}


def instructions(path: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (REPO_ROOT / path).read_text())
    found = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            found.append((word.upper(), rest.strip()))
    return found


def final_stage(path: str) -> list[tuple[str, str]]:
    steps = instructions(path)
    last_from = max(i for i, (word, _) in enumerate(steps) if word == "FROM")
    return steps[last_from:]


def copy_sources(args: str) -> list[str]:
    parts = [p for p in args.split() if not p.startswith("--")]
    return parts[:-1]


@pytest.mark.parametrize("path", sorted(IMAGES))
def test_final_stage_is_slim_non_root_with_exec_cmd(path: str) -> None:
    steps = final_stage(path)
    base = steps[0][1]
    assert "slim" in base or base.startswith("${"), base
    users = [args for word, args in steps if word == "USER"]
    assert users, f"{path}: runs as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) > 0, f"{path}: USER must be a non-root number, not {uid}"
    (cmd,) = [args for word, args in steps if word == "CMD"]
    assert isinstance(json.loads(cmd), list), f"{path}: CMD must be in exec form"


@pytest.mark.parametrize("path", sorted(IMAGES))
def test_dependencies_are_installed_before_the_source_is_copied(path: str) -> None:
    steps = instructions(path)
    source = {"main.py", "server.js", "conveyor", "gateway", "dispatcher"}
    first_source = min(
        i for i, (w, a) in enumerate(steps) if w == "COPY" and source & set(copy_sources(a))
    )
    installs = [i for i, (w, a) in enumerate(steps) if w == "RUN" and "install" in a]
    if path.endswith("sleeper/Dockerfile") or path.endswith("node-echo/Dockerfile"):
        return  # no third-party dependencies to install
    assert installs and installs[0] < first_source, f"{path}: source copied before deps"


def test_component_images_install_their_own_extra() -> None:
    def runs(path: str) -> str:
        return " ".join(a for w, a in instructions(path) if w == "RUN")

    assert '".[dispatcher]"' in runs("dispatcher/Dockerfile")
    assert "gateway" not in runs("dispatcher/Dockerfile")
    assert '".[gateway]"' in runs("gateway/Dockerfile")
    assert "requirements.txt" in runs("functions/thumbnail/Dockerfile")
    cmds = {p: json.loads(a) for p in IMAGES for w, a in final_stage(p) if w == "CMD"}
    assert cmds["gateway/Dockerfile"] == [
        "conveyor", "gateway", "--host", "0.0.0.0", "--port", "8000",
    ]  # fmt: skip
    assert cmds["dispatcher/Dockerfile"] == ["conveyor", "dispatcher"]
    assert cmds["functions/sleeper/Dockerfile"] == ["python", "main.py"]
    assert cmds["functions/node-echo/Dockerfile"] == ["node", "server.js"]


@pytest.mark.parametrize("path", sorted(IMAGES))
def test_copied_files_exist_in_the_build_context(path: str) -> None:
    context = REPO_ROOT / IMAGES[path]
    ignore = (REPO_ROOT / ".dockerignore").read_text().split()
    for word, args in instructions(path):
        if word != "COPY" or "--from=" in args:
            continue
        for source in copy_sources(args):
            if "*" in source:
                continue  # optional files, e.g. alembic.ini*
            assert (context / source).exists(), f"{path}: {source} not in {context.name}/"
            if IMAGES[path] == ".":
                # The root .dockerignore is an allow-list: the file must be let through.
                top = source.strip("./").split("/")[0]
                assert f"!{top}" in ignore or f"!{top}/" in ignore, f".dockerignore drops {top}"


def test_root_dockerignore_is_an_allow_list() -> None:
    patterns = [
        line.strip()
        for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert patterns[0] == "*", "start from nothing: no .venv, .git or caches in the context"
    assert "!tests/" not in patterns and "!.venv/" not in patterns
