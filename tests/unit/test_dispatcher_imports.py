"""What the sidecar imports (SPEC §10: 50 MB idle): its RSS is mostly the modules it loads, so
the heavy ones it has no use for stay out, through both entry points. Sizes are measured by
`python -m bench.footprint`, never asserted here."""

from __future__ import annotations

import json
import subprocess
import sys

# Each of these would cost the sidecar megabytes for nothing.
NOT_IN_THE_SIDECAR = (
    "pydantic",  # with pydantic_core and pydantic_settings: ~10 MiB; the gateway's settings
    "pydantic_core",
    "pydantic_settings",
    "opentelemetry",  # tracing, unless an OTLP endpoint is configured
    "typer",  # the CLI's framework: `conveyor dispatcher` goes around it
    "rich",
    "pygments",
    "httpx",  # the calls and the local API are aiohttp's (dispatcher/invoker.py)
    "httpcore",
    "anyio",
    "starlette",
    "uvicorn",
    "gateway",
    "fastapi",
    "sqlalchemy",
    "psycopg",
    "jsonschema",
    "yaml",
)

REPORT = f"""
import json, sys
heavy = {NOT_IN_THE_SIDECAR!r}
loaded = sorted({{m.split(".")[0] if m.split(".")[0] in heavy else m for m in sys.modules}})
print(json.dumps([m for m in loaded if m in heavy]))
"""


def loaded_heavy(code: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", code + REPORT],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "CONVEYOR_QUEUE": "footprint"},
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_python_m_dispatcher_imports_nothing_heavy() -> None:
    assert loaded_heavy("import dispatcher.main, dispatcher.__main__") == []


def test_conveyor_dispatcher_reads_its_settings_without_the_cli_or_pydantic() -> None:
    """`conveyor dispatcher` (what `conveyor inject` deploys), up to the dispatcher's run,
    which is replaced by the report."""
    code = (
        "import sys, dispatcher.main\n"
        "dispatcher.main.run = lambda settings: 0\n"
        "sys.argv = ['conveyor', 'dispatcher']\n"
        "from conveyor.cli import main\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as stop:\n"
        "    assert stop.code == 0, stop.code\n"
    )
    assert loaded_heavy(code) == []
