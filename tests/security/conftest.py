"""Security fixtures: the integration suite's shared gateway and platform.

The shared `gateway` serves tests that need no special settings; tests that do
(throttling, debug logs, timing) start their own `GatewayProcess` through `procs`.
"""

from __future__ import annotations

from tests.integration.conftest import gateway, platform  # noqa: F401
