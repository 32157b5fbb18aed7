"""Wire the dispatcher into a function's Kubernetes manifests (`conveyor inject`).

The function author writes a plain Deployment, Job or Knative Service; this
package adds the dispatcher and the KEDA objects that scale it, the way
`linkerd inject` adds a proxy. It is data manipulation only (dicts in, dicts
out, YAML at the edges), so it needs no Kubernetes client and is tested offline.
Injection is idempotent: injecting the output again gives the same bytes.

* ``sidecar`` (Deployment): the function becomes a native sidecar, the
  dispatcher the main container; a ScaledObject scales the Deployment.
* ``job`` (Job, or a Deployment to convert): a KEDA ScaledJob whose pods hold
  the same two containers, the dispatcher with ``ONE_SHOT=1``. Switching a workload
  between sidecar and job mode drops the other mode's KEDA object inject wrote.
* ``knative`` (Knative Service): the function stays a cluster-local Knative
  Service; the dispatcher runs as its own Deployment posting to it.
"""

from conveyor.dispatcher_settings import ShutdownMode
from conveyor.inject.documents import InjectError, dump_documents, load_documents
from conveyor.inject.modes import InjectResult, inject_documents, inject_yaml
from conveyor.inject.wiring import InjectOptions, Mode

__all__ = [
    "InjectError",
    "InjectOptions",
    "InjectResult",
    "Mode",
    "ShutdownMode",
    "dump_documents",
    "inject_documents",
    "inject_yaml",
    "load_documents",
]
