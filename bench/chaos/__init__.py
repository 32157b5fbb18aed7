"""The fault-injection run: prove that a task, once accepted, always ends.

`python -m bench.chaos --tasks N` starts the whole platform as real processes
on its own database and queues, submits N tasks while killing and restarting
its parts (dispatchers, the function, the gateway, RabbitMQ, PostgreSQL), then
checks that every accepted task ended in SUCCESS or FAILURE — the outcome the
function decided — exactly once per Idempotency-Key, with nothing left on
`<q>-in`. See `run.py` for the phases and `verify.py` for the checks.
"""

from bench.chaos.config import ChaosConfig, FaultKind, FaultPlan
from bench.chaos.run import main, run
from bench.chaos.verify import doomed

__all__ = ["ChaosConfig", "FaultKind", "FaultPlan", "doomed", "main", "run"]
