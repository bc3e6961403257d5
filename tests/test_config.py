"""RecoverConfig: stock nanotron YAMLs load unchanged; bad fault_tolerance input names the key."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import yaml

from nanotron_recover.config import ConfigError, FaultToleranceArgs, config_from_dict, load_config

FIXTURES = Path(__file__).parent / "fixtures"
STOCK = FIXTURES / "stock_nanotron.yaml"


def stock_dict() -> dict:
    return yaml.safe_load(STOCK.read_text())


def with_ft(**ft) -> dict:
    raw = stock_dict()
    raw["fault_tolerance"] = ft
    return raw


def test_stock_yaml_loads_unchanged_with_fault_tolerance_off():
    config = load_config(STOCK)
    assert config.fault_tolerance is None and not config.ft_enabled
    assert (config.parallelism.dp, config.parallelism.tp, config.parallelism.pp) == (2, 1, 1)
    assert config.model.model_config.hidden_size == 32
    assert config.tokens.batch_accumulation_per_replica == 2
    assert config.world_size == 2
    assert config.microbatches_per_step == 4


def test_fault_tolerance_section_parsed_with_defaults_and_schedule():
    raw = with_ft(spare_replicas=1, inject=[{"step": 3, "replica": 1, "phase": "reduce"}])
    config = config_from_dict(raw)
    ft = config.fault_tolerance
    assert isinstance(ft, FaultToleranceArgs) and ft.enabled
    assert ft.spare_replicas == 1 and ft.min_replicas == 1
    assert ft.inject[0].phase == "reduce" and ft.inject[0].rank == 0
    # world = (dp + spares) x tp x pp; M counts only the dp replicas
    assert config.world_size == 3
    assert config.microbatches_per_step == 4


def test_fault_tolerance_disabled_is_the_stock_path():
    config = config_from_dict(with_ft(enabled=False, spare_replicas=2))
    assert not config.ft_enabled
    assert config.world_size == 2  # spares only exist on the ReCoVer path


@pytest.mark.parametrize(
    "ft, key",
    [
        ({"min_replica": 1}, "min_replica"),
        ({"enabled": "sometimes"}, "fault_tolerance.enabled"),
        ({"min_replicas": 3}, "fault_tolerance.min_replicas"),
        ({"min_replicas": 0}, "fault_tolerance.min_replicas"),
        ({"spare_replicas": -1}, "fault_tolerance.spare_replicas"),
        ({"collective_timeout_s": 0}, "fault_tolerance.collective_timeout_s"),
        ({"startup_peer_wait_floor_s": 0}, "fault_tolerance.startup_peer_wait_floor_s"),
        ({"startup_peer_wait_floor_s": "soon"}, "fault_tolerance.startup_peer_wait_floor_s"),
        ({"inject": [{"step": 2, "replica": 0, "phase": "lunch"}]}, "fault_tolerance.inject[0].phase"),
        ({"inject": [{"step": 99, "replica": 0}]}, "fault_tolerance.inject[0].step"),
        ({"inject": [{"step": 2, "replica": 5}]}, "fault_tolerance.inject[0].replica"),
        ({"inject": [{"step": 2, "replica": 0, "rank": 1}]}, "fault_tolerance.inject[0].rank"),
        ({"inject": [{"step": 3, "replica": 0, "phase": "checkpoint"}]}, "fault_tolerance.inject[0].step"),
        ({"inject": [{"step": 3, "replica": 0, "phase": "checkpoint-background"}]}, "fault_tolerance.inject[0].step"),
        ({"inject": [{"step": 2, "replica": 0}, {"step": 3, "replica": 1}]}, "kills every replica"),
        ({"replica": "zero3"}, "fault_tolerance.replica"),
        ({"replica": "fsdp"}, "fault_tolerance.fsdp_shard_size"),
        ({"replica": "fsdp", "fsdp_shard_size": 0}, "fault_tolerance.fsdp_shard_size"),
        ({"fsdp_shard_size": 2}, "fault_tolerance.fsdp_shard_size"),
        ({"replica": "fsdp", "fsdp_shard_size": 2, "enabled": False}, "fault_tolerance.replica"),
        ({"replica": "fsdp", "fsdp_shard_size": 4}, "tokens.micro_batch_size"),
        ({"replica": "fsdp", "fsdp_shard_size": 2, "inject": [{"step": 2, "replica": 0, "rank": 2}]},
         "fault_tolerance.inject[0].rank"),
    ],
)
def test_invalid_fault_tolerance_names_the_key(ft, key):
    with pytest.raises(ConfigError) as err:
        config_from_dict(with_ft(**ft))
    assert key in str(err.value)


def test_fsdp_replicas_size_the_world_by_shard_size():
    config = config_from_dict(with_ft(replica="fsdp", fsdp_shard_size=2, spare_replicas=1))
    assert config.sharded_replicas and config.ranks_per_replica == 2
    assert config.world_size == (2 + 1) * 2  # (dp + spares) x F
    assert config.microbatches_per_step == 4  # M does not depend on the replica kind


@pytest.mark.parametrize("key", ["tp", "pp"])
def test_fsdp_replicas_need_tp_and_pp_1(key):
    raw = with_ft(replica="fsdp", fsdp_shard_size=2)
    raw["parallelism"][key] = 2
    with pytest.raises(ConfigError, match=f"parallelism.{key}"):
        config_from_dict(raw)


def test_parallelism_that_cannot_shard_the_model_is_rejected():
    raw = stock_dict()
    raw["parallelism"]["tp"] = 3
    with pytest.raises(ConfigError, match="num_attention_heads"):
        config_from_dict(raw)


def test_unknown_top_level_key_is_rejected_by_nanotron_strictness():
    raw = copy.deepcopy(stock_dict())
    raw["fault_tolerence"] = {"enabled": True}  # misspelt section
    with pytest.raises(Exception, match="fault_tolerence"):
        config_from_dict(raw)


@pytest.mark.parametrize("section", ["checkpoints", "tokens", "optimizer", "fault_tolerance"])
def test_an_unknown_key_lists_every_key_of_its_section(section):
    import dataclasses
    import typing

    from nanotron_recover.config import RecoverConfig

    raw = copy.deepcopy(stock_dict())
    raw.setdefault(section, {})["bogus_key"] = 1
    with pytest.raises(ConfigError, match="bogus_key") as caught:
        config_from_dict(raw)
    hint = typing.get_type_hints(RecoverConfig)[section]
    kind = next(c for c in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(c))
    missing = [f.name for f in dataclasses.fields(kind) if f.name not in str(caught.value)]
    assert missing == [], f"{section}: keys not listed: {missing}"


def test_missing_config_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[1] / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    config = load_config(path)
    assert config.ft_enabled and config.fault_tolerance.inject
    if config.sharded_replicas:
        assert config.world_size == config.parallelism.dp * config.fault_tolerance.fsdp_shard_size


def test_invalid_yaml_is_a_one_line_config_error_naming_file_line_and_column(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("general:\n  project: x\n  run: [a, b\nmodel: {\n")
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{bad}:4:6: not valid YAML")


@pytest.mark.parametrize("entry", ["launch", "train"])
def test_invalid_yaml_exits_2_from_both_entry_points(tmp_path: Path, entry: str, capsys: pytest.CaptureFixture) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: b: c\n")
    if entry == "launch":
        from nanotron_recover.launcher.launch import main

        code = main(["train", "--config-file", str(bad)])
    else:
        from nanotron_recover.train import main

        code = main(["--config-file", str(bad), "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and f"{bad}:1:5" in err


def _precision_config(dtype: str, *, ft: bool, fp32_accumulation: bool = True):
    raw = with_ft(enabled=True) if ft else stock_dict()
    raw["model"]["dtype"] = dtype
    raw["optimizer"]["accumulate_grad_in_fp32"] = fp32_accumulation
    raw["data"] = {"dataset": None, "seed": 1}
    return config_from_dict(raw)


@pytest.mark.parametrize("ft", [True, False])
def test_bfloat16_is_trained_as_asked_on_both_paths(ft):
    from nanotron_recover.launcher.preflight import check_runtime_inputs

    config = _precision_config("bfloat16", ft=ft)
    check_runtime_inputs(config)
    assert config.model.dtype == torch.bfloat16  # no longer forced to float32 without CUDA


def test_bfloat16_without_fp32_accumulation_is_refused_with_fault_tolerance_only():
    from nanotron_recover.launcher.preflight import check_runtime_inputs

    with pytest.raises(ConfigError, match="accumulate_grad_in_fp32: false is not supported with fault_tolerance"):
        check_runtime_inputs(_precision_config("bfloat16", ft=True, fp32_accumulation=False))
    check_runtime_inputs(_precision_config("bfloat16", ft=False, fp32_accumulation=False))  # stock nanotron's mode


def test_float16_is_refused_before_launch():
    from nanotron_recover.launcher.preflight import check_runtime_inputs

    with pytest.raises(ConfigError, match="model.dtype: torch.float16 is not supported"):
        check_runtime_inputs(_precision_config("float16", ft=False))


def test_recycle_keeps_the_global_batch():
    assert config_from_dict(with_ft(recycle=True, replica="fsdp", fsdp_shard_size=2)).fault_tolerance.recycle
    with pytest.raises(ConfigError, match="fault_tolerance.recycle.*keep_global_batch"):
        config_from_dict(with_ft(recycle=True, keep_global_batch=False))
    assert config_from_dict(with_ft(recycle=True)).fault_tolerance.recycle


def test_recycling_is_on_by_default_when_the_global_batch_is_kept_and_a_replica_is_one_stage():
    def recycle(pp: int = 1, **ft) -> bool | None:
        raw = with_ft(**ft)
        raw["parallelism"]["pp"] = pp
        return config_from_dict(raw).fault_tolerance.recycle

    assert recycle() is True
    assert recycle(keep_global_batch=False) is False  # a formed replica would have no slot's samples to compute
    assert recycle(recycle=False) is False
    assert recycle(pp=2) is False  # a pooled rank can stay blocked in gloo's pipeline traffic (docs/limits.md)
    assert recycle(pp=2, recycle=True) is True  # asked for: allowed


def test_faults_may_name_a_formed_replica_only_when_recycling():
    dp = stock_dict()["parallelism"]["dp"]
    formed = [{"step": 2, "replica": dp, "rank": 0, "phase": "formation"}]  # the first formed replica's id
    assert config_from_dict(with_ft(recycle=True, inject=formed)).fault_tolerance.inject[0].replica == dp
    with pytest.raises(ConfigError, match=r"fault_tolerance.inject\[0\].replica"):
        config_from_dict(with_ft(recycle=False, inject=formed))
    beyond = [{"step": 2, "replica": dp + 1, "rank": 0, "phase": "formation"}]  # 1 fault: at most 1 formation
    with pytest.raises(ConfigError, match=r"fault_tolerance.inject\[0\].replica"):
        config_from_dict(with_ft(recycle=True, inject=beyond))


def test_rebalancing_is_off_by_default_and_its_knobs_parse():
    ft = config_from_dict(with_ft()).fault_tolerance
    assert not ft.rebalance and ft.replica_weights is None and ft.straggler_factor is None  # off unless asked
    ft = config_from_dict(with_ft(rebalance=True, replica_weights=[1, 0.5], rebalance_smoothing=0.5,
                                  rebalance_hysteresis=0, straggler_factor=3, straggler_steps=4)).fault_tolerance
    assert ft.rebalance and ft.replica_weights == [1, 0.5] and ft.straggler_factor == 3 and ft.straggler_steps == 4
    assert ft.straggler_action == "drain"
    slow = [{"step": 2, "replica": 0, "signal": "slow", "factor": 2}, {"step": 2, "replica": 1, "signal": "slow",
                                                                        "factor": 4}]
    assert config_from_dict(with_ft(inject=slow)).fault_tolerance.inject[1].factor == 4  # slowing kills nobody


@pytest.mark.parametrize(
    "ft, key",
    [
        ({"rebalance_smoothing": 0}, "fault_tolerance.rebalance_smoothing"),
        ({"rebalance_smoothing": 1.5}, "fault_tolerance.rebalance_smoothing"),
        ({"rebalance_hysteresis": 1}, "fault_tolerance.rebalance_hysteresis"),
        ({"rebalance_hysteresis": -0.1}, "fault_tolerance.rebalance_hysteresis"),
        ({"straggler_factor": 1.0}, "fault_tolerance.straggler_factor"),
        ({"straggler_steps": 0}, "fault_tolerance.straggler_steps"),
        ({"straggler_factor": 2.0, "straggler_action": "kill"}, "fault_tolerance.straggler_action"),
        ({"straggler_action": "evict"}, "fault_tolerance.straggler_action"),  # nothing would make a straggler
        ({"straggler_factor": 2.0, "straggler_action": "evict", "recycle": False},  # no spare could ever take
         "fault_tolerance.straggler_action"),                                      # its slot
        ({"replica_weights": [1.0]}, "fault_tolerance.replica_weights"),  # dp = 2 entries needed
        ({"replica_weights": [1.0, 0.0]}, "fault_tolerance.replica_weights"),
        ({"replica_weights": [1.0, 1.0], "spare_replicas": 1}, "fault_tolerance.replica_weights"),  # spares too
        ({"rebalance": True, "keep_global_batch": False}, "fault_tolerance.rebalance"),
        ({"straggler_factor": 2.0, "enabled": False}, "fault_tolerance.straggler_factor"),
        ({"inject": [{"step": 2, "replica": 0, "signal": "slow"}]}, "fault_tolerance.inject[0].factor"),
        ({"inject": [{"step": 2, "replica": 0, "signal": "slow", "factor": 0.5}]}, "fault_tolerance.inject[0].factor"),
        ({"inject": [{"step": 2, "replica": 0, "factor": 2}]}, "fault_tolerance.inject[0].factor"),
        ({"inject": [{"step": 99, "replica": 0, "signal": "slow", "factor": 2}]}, "fault_tolerance.inject[0].step"),
    ],
)
def test_invalid_rebalancing_names_the_key(ft, key):
    with pytest.raises(ConfigError) as err:
        config_from_dict(with_ft(**ft))
    assert key in str(err.value)


def test_a_relaunch_on_fewer_replicas_drops_the_full_size_replica_weights():
    """``--replicas R`` (a relaunch on the nodes left) with ``replica_weights`` for the full-size job: the weights
    go (quotas follow measured speeds) instead of the relaunch being refused as bad input, never requeued."""
    from nanotron_recover.launcher.overrides import apply_replicas

    raw = copy.deepcopy(stock_dict())
    raw["parallelism"]["dp"] = 4
    raw["fault_tolerance"] = {"enabled": True, "replica_weights": [1.0, 1.0, 0.5, 1.0]}
    config = config_from_dict(raw)
    apply_replicas(config, 2)
    assert config.parallelism.dp == 2 and config.fault_tolerance.replica_weights is None


def test_checkpoints_are_written_in_the_background_unless_asked_not_to(tiny_config):
    raw = tiny_config(dp=2, steps=4, checkpoint_interval=2)
    assert config_from_dict(raw).checkpoints.async_save is True
    raw["checkpoints"]["async_save"] = False
    assert config_from_dict(raw).checkpoints.async_save is False


def test_without_an_interval_the_resilient_path_saves_on_the_auto_cadence_and_the_stock_path_is_told(tiny_config):
    raw = tiny_config(dp=2, steps=4, checkpoint_interval=2, fault_tolerance={"enabled": True})
    del raw["checkpoints"]["checkpoint_interval"]
    assert config_from_dict(raw).checkpoints.checkpoint_interval == "auto"
    stock = copy.deepcopy(raw)
    del stock["fault_tolerance"]
    with pytest.raises(ConfigError, match=r"checkpoints.checkpoint_interval: 'auto' \(the default\) needs fault_tol"):
        config_from_dict(stock)


@pytest.mark.parametrize("key,value,match", [
    ("checkpoint_interval", "often", "a number of steps or 'auto'"),
    ("checkpoint_interval", 0, "must be >= 1"),
    ("checkpoint_min_interval_s", 0, "finite number > 0"),
    ("checkpoint_max_interval_h", float("inf"), "finite number > 0"),
    ("all_snapshots_lost_h", -1, "finite number > 0"),
    ("checkpoint_min_interval_s", 7200, "more than checkpoint_max_interval_h"),
])
def test_an_impossible_checkpoint_cadence_is_refused_before_the_run(tiny_config, key, value, match):
    raw = tiny_config(dp=2, steps=4, checkpoint_interval=2, fault_tolerance={"enabled": True})
    raw["checkpoints"].update({"checkpoint_interval": "auto", key: value})
    with pytest.raises(ConfigError, match=match):
        config_from_dict(raw)


def test_a_fault_inside_a_save_needs_a_fixed_interval(tiny_config):
    inject = [{"step": 2, "replica": 1, "rank": 0, "phase": "checkpoint"}]
    raw = tiny_config(dp=2, steps=4, checkpoint_interval=2, fault_tolerance={"enabled": True, "inject": inject})
    raw["checkpoints"]["checkpoint_interval"] = "auto"
    with pytest.raises(ConfigError, match="needs a fixed checkpoints.checkpoint_interval"):
        config_from_dict(raw)
