"""The shape of a job read from a raw config mapping (YAML alone: no torch, no nanotron), for what must know it
before the config can be loaded (the start-up guard, before ``MPI_Init``) or without loading it (the simulator's
calibration from run folders). :attr:`nanotron_recover.config.RecoverConfig.ranks_per_replica` is the same rule on a
loaded config; a test holds the two together."""

from __future__ import annotations

from typing import Any, Mapping


def ranks_per_replica(raw: Mapping[str, Any]) -> int:
    """A 3D replica is a ``tp x pp`` grid; an HSDP replica (``fault_tolerance.replica: fsdp``) is its shard group."""
    ft = raw.get("fault_tolerance") or {}
    if isinstance(ft, Mapping) and ft.get("enabled", True) and ft.get("replica") == "fsdp":
        return int(ft["fsdp_shard_size"])
    par = raw.get("parallelism") or {}
    return int(par.get("tp", 1)) * int(par.get("pp", 1))
