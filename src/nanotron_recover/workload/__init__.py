"""Layer 3: the versatile workload planner (pure functions, no communication)."""

from nanotron_recover.workload.planner import merge, orphans_of, plan_step, quotas, replan_orphans
from nanotron_recover.workload.spares import ReplicaRoster, RosterChange

__all__ = ["ReplicaRoster", "RosterChange", "merge", "orphans_of", "plan_step", "quotas", "replan_orphans"]
