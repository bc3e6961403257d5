"""The campaign's trials (benchmarks/lib/campaign.py) are a pure function of their seed, and each one is a
schedule the trainer accepts: the config validation (the same as a user's run) takes every drawn config."""

from __future__ import annotations

from collections import Counter

import pytest

from benchmarks.lib.campaign import KINDS, SHAPES, STEPS, draw_trial
from nanotron_recover.config import config_from_dict


def test_a_trial_is_a_function_of_its_seed() -> None:
    for seed in range(50):
        a, b = draw_trial(seed), draw_trial(seed)
        assert (a.shape, a.kind, a.inject, a.describe()) == (b.shape, b.kind, b.inject, b.describe())
    assert len({draw_trial(seed).describe() for seed in range(50)}) > 40  # seeds do vary the schedule


RECYCLING_ON = tuple(s.with_recycle(True) for s in SHAPES)  # ``fault_campaign.py --recycle on``


@pytest.mark.parametrize("shapes", [SHAPES, RECYCLING_ON], ids=["own", "recycle-on"])
@pytest.mark.parametrize("seed", range(0, 400, 7))
def test_every_drawn_config_is_valid_and_every_fault_lands_in_the_run(seed: int, shapes) -> None:
    trial = draw_trial(seed, shapes)
    config = config_from_dict(trial.shape.config(trial.inject, "/dev/shm/unused"))  # raises on a bad schedule
    assert config.microbatches_per_step == trial.shape.M
    for spec in trial.inject:  # a fault mid-run; or in start-up (step 0), or in the final save (the last step)
        assert 1 <= spec["step"] < STEPS or (spec["phase"], spec["step"]) == ("startup", 0) or \
            (spec["phase"].startswith("checkpoint-") and spec["step"] == STEPS), spec
    for fault in trial.external:
        assert 0 <= fault.after_step < STEPS - 1
        assert all(0 <= r < trial.shape.world_size for r in fault.ranks)
        if trial.kind == "pair-same-replica":
            assert len({r // trial.shape.rpr for r in fault.ranks}) == 1 and len(set(fault.ranks)) == 2
        if trial.kind == "pair-two-replicas":
            assert len({r // trial.shape.rpr for r in fault.ranks}) == 2
    assert trial.on_bed() == (trial.kind == "node-loss")
    if trial.on_bed():  # one replica per fake node, the lost one among them
        (fault,) = trial.external
        assert sum(trial.shape.nodes) == trial.shape.world_size and not fault.ranks
        assert fault.node in {f"n{i + 1}" for i in range(len(trial.shape.nodes))}


def test_the_draws_cover_every_kind_and_shape() -> None:
    trials = [draw_trial(seed) for seed in range(1500)]
    assert set(Counter(t.kind for t in trials)) == set(KINDS)
    assert {t.shape.name for t in trials} == {s.name for s in SHAPES}
    assert any(s.get("phase") == "transfer" for t in trials for s in t.inject)
    assert any(s.get("phase") == "forming" for t in trials for s in t.inject)


def test_frozen_ranks_name_what_the_trial_freezes() -> None:
    stops = [t for t in (draw_trial(seed) for seed in range(300)) if t.kind in ("ext-stop", "hang")]
    assert stops
    for t in stops:
        frozen = t.frozen_ranks()
        assert frozen is None or len(frozen) == 1


def test_recycling_switched_on_everywhere_keeps_each_shape_and_names_it() -> None:
    assert all(s.recycle for s in RECYCLING_ON)
    assert [s.with_recycle(s.recycle) for s in SHAPES] == list(SHAPES)  # a shape's own setting: unchanged
    assert {s.name for s in RECYCLING_ON} == {s.name if s.recycle else f"{s.name}+recycle" for s in SHAPES}
    # only shapes whose survivors can form a replica get the formation faults
    trials = [draw_trial(seed, RECYCLING_ON) for seed in range(1500)]
    forming = {t.shape.name for t in trials for s in t.inject if s.get("phase") == "forming"}
    assert forming and all(next(s for s in RECYCLING_ON if s.name == n).forms for n in forming)


def test_the_torch_data_plane_reaches_every_trial_config_and_its_name() -> None:
    torch_plane = tuple(s.with_data_plane("torch") for s in SHAPES)  # ``fault_campaign.py --data-plane torch``
    assert [s.name for s in torch_plane] == [f"{s.name}+torch" for s in SHAPES]
    for seed in range(0, 60, 5):
        trial = draw_trial(seed, torch_plane)
        config = config_from_dict(trial.shape.config(trial.inject, "/dev/shm/unused"))
        assert config.fault_tolerance.data_plane == "torch"
    assert config_from_dict(SHAPES[0].config([], "/dev/shm/unused")).fault_tolerance.data_plane == "auto"
