"""nanotron-recover: pre-training that survives lost replicas without changing the training trajectory.

Three layers, one package each:

* :mod:`nanotron_recover.ft` -- fault-tolerant collectives over Open MPI ULFM,
* :mod:`nanotron_recover.recovery` -- in-step recovery from per-bucket gradient snapshots,
* :mod:`nanotron_recover.workload` -- the planner that keeps exactly M microbatches per step.
"""

__version__ = "0.1.0"
