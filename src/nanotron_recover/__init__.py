"""nanotron-recover: pre-training that survives lost replicas without changing the training trajectory.

Three layers, one package each:

* :mod:`nanotron_recover.ft` -- fault-tolerant collectives over Open MPI ULFM,
* :mod:`nanotron_recover.recovery` -- in-step recovery from per-bucket gradient snapshots,
* :mod:`nanotron_recover.workload` -- the planner that keeps exactly M microbatches per step.
"""

from nanotron_recover.nanotron_compat.imports import install_import_hook as _install_import_hook

__version__ = "0.1.0"

# nanotron 0.4 cannot be imported without a fix for its import cycle; it is applied when nanotron is first
# imported (a cheap import hook: nothing heavy is imported here, so light tools stay light)
_install_import_hook()
