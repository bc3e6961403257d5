"""A discrete-event failure simulator of one training run (pure Python, no MPI, no torch).

What it answers: given a cluster (GPUs, nodes, replica layout), failure rates and costs measured on our own runs
(:mod:`.calibrate`), how much useful training does each fault-tolerance policy deliver, and which
``spare_replicas`` / ``min_replicas`` / ``checkpoint_interval`` to set (:mod:`.plan`). Modules:

* :mod:`.params`   every number used, named, with its source, and the scaling models;
* :mod:`.cluster`  GPUs, nodes, replica slots;
* :mod:`.policies` checkpoint-restart, shrinking batch, ReCoVer (as coded), ReCoVer + spares, hypotheticals;
* :mod:`.engine`   the event loop;
* :mod:`.accounting` what a run is scored by (:class:`SimResult`);
* :mod:`.optimal`  Young/Daly and the parameter search behind the recommendations;
* :mod:`.calibrate` costs from ``metrics.jsonl`` run folders and benchmark JSON;
* :mod:`.plan`     the ``nanotron-recover plan`` command.
"""

from nanotron_recover.sim.accounting import SimResult
from nanotron_recover.sim.cluster import Cluster
from nanotron_recover.sim.engine import ScheduledFailure, simulate
from nanotron_recover.sim.params import Params
from nanotron_recover.sim.policies import Policy

__all__ = ["Cluster", "Params", "Policy", "ScheduledFailure", "SimResult", "simulate"]
