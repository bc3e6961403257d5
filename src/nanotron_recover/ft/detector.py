"""Tuning of the launcher's failure detector (PRRTE's heartbeats, ``--prtemca errmgr_detector_heartbeat_*``).

How quickly a silent peer *process* is declared dead by the runtime, and so the longest a death may take to reach
the survivors as a failure notice. Kept here, without MPI imports, so that the launcher can read it too.
"""

DETECTOR_HEARTBEAT_PERIOD_S = 1.0
DETECTOR_HEARTBEAT_TIMEOUT_S = 3.0
