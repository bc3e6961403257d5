"""Shared fixtures: a tiny Llama config as a dict, to derive each multi-process run from; the ``slow`` marker
for the multi-process modules that do not carry their own ``pytestmark``."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

STOCK = Path(__file__).parent / "fixtures" / "stock_nanotron.yaml"
# every test of these modules launches real mpirun jobs (each with its own hard timeout)
SLOW_MODULES = ("ft/test_ft_integ.py", "ft/test_training_faults.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if item.path.is_relative_to(here) and item.path.relative_to(here).as_posix() in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)


def make_tiny_config(
    *,
    dp: int = 1,
    tp: int = 1,
    pp: int = 1,
    accumulation: int = 4,
    engine: str = "afab",
    tp_mode: str = "ALL_REDUCE",
    steps: int = 10,
    layers: int = 4,
    fault_tolerance: dict | None = None,
    checkpoint_interval: int = 1000,
) -> dict:
    """The stock-format fixture, resized. M = dp * accumulation global microbatches per step."""
    config = copy.deepcopy(yaml.safe_load(STOCK.read_text()))
    config["parallelism"].update(dp=dp, tp=tp, pp=pp, pp_engine=engine, tp_mode=tp_mode)
    config["tokens"].update(batch_accumulation_per_replica=accumulation, train_steps=steps)
    config["model"]["model_config"]["num_hidden_layers"] = layers
    config["checkpoints"]["checkpoint_interval"] = checkpoint_interval
    lr = config["optimizer"]["learning_rate_scheduler"]
    lr.update(lr_warmup_steps=2, lr_decay_steps=max(1, steps - 2))
    if fault_tolerance is not None:
        config["fault_tolerance"] = fault_tolerance
    return config


@pytest.fixture
def tiny_config():
    return make_tiny_config
