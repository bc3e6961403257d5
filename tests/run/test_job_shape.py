"""The job shape from raw YAML agrees with the loaded config's, for 3D and HSDP replicas."""

from __future__ import annotations

import pytest

from nanotron_recover.config import config_from_dict
from nanotron_recover.run.job_shape import ranks_per_replica
from tests.conftest import make_tiny_config


@pytest.mark.parametrize("tp, pp, ft", [
    (1, 1, None), (2, 1, {"enabled": True}), (2, 2, {"enabled": True}),
    (1, 1, {"enabled": True, "replica": "fsdp", "fsdp_shard_size": 2}),
])
def test_the_raw_and_the_loaded_shape_agree(tp: int, pp: int, ft: dict | None) -> None:
    raw = make_tiny_config(dp=2, tp=tp, pp=pp, fault_tolerance=ft) if ft else make_tiny_config(dp=2, tp=tp, pp=pp)
    if ft and ft.get("replica") == "fsdp":
        raw["tokens"]["micro_batch_size"] = 2
    assert ranks_per_replica(raw) == config_from_dict(raw).ranks_per_replica
    assert ranks_per_replica(raw) == (ft or {}).get("fsdp_shard_size", tp * pp)
