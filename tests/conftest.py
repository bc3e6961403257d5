"""Shared fixtures: a tiny Llama config as a dict, to derive each multi-process run from; the ``slow`` marker
for the multi-process modules that do not carry their own ``pytestmark``."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import yaml
from _pytest.runner import runtestprotocol

from tests.upstream_crash import failure_texts, open_mpi_crash

STOCK = Path(__file__).parent / "fixtures" / "stock_nanotron.yaml"
# wandb's offline run (a service process, its handshake, its files) costs each job's logging rank seconds of
# start-up on 2 cores; the tests of the wandb copy (tests/training/test_metrics.py, the main job, a logging rank's
# handover in a fault, the campaign slice) turn it back on with WANDB_MODE=offline, the users' default
os.environ.setdefault("WANDB_MODE", "disabled")
# the fault tests judge one launch each (the exit code a scheduler sees); the launcher's own relaunch in place has
# tests of its own (tests/launcher/test_relaunch.py), which name --max-restarts
os.environ.setdefault("NANOTRON_RECOVER_MAX_RESTARTS", "0")
# NANOTRON_RECOVER_TEST_DATA_PLANE=torch runs every fault-tolerant job of the suite whose config does not name a
# data plane on the torch one (docs/data-plane.md: the fault suites on both planes)
TEST_DATA_PLANE = os.environ.get("NANOTRON_RECOVER_TEST_DATA_PLANE")
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
        if TEST_DATA_PLANE and fault_tolerance.get("enabled", True):
            config["fault_tolerance"] = {"data_plane": TEST_DATA_PLANE, **fault_tolerance}
    return config


@pytest.fixture
def tiny_config():
    return make_tiny_config


# ------------------------------------------------------------------------------- shared failure-free runs
# A failure-free run is a pure function of its config, its command-line arguments and the environment it reads:
# tests (of any module) whose reference run is the identical job share one launch per session. The key is the
# whole config as YAML, the arguments and every variable that a run reads; a test must only read the shared run
# folder (its metrics, checkpoints, output), never write into it.
_ENV_KEYS_PREFIXES = ("NANOTRON_RECOVER", "WANDB", "OMPI", "PRTE", "PMIX", "OMP_", "CUDA")


def _run_key(config: dict, extra_args) -> str:
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV_KEYS_PREFIXES))
    return yaml.safe_dump({"config": config, "args": list(extra_args), "env": env}, sort_keys=True)


@pytest.fixture(scope="session")
def failure_free_run(tmp_path_factory):
    """``failure_free_run(config, extra_args=..., timeout_s=...)`` -> the RunResult of ``run_training`` on that
    config, launched once per session for each distinct (config, arguments, environment); it must succeed."""
    from nanotron_recover.launcher.runs import run_training

    done: dict[str, object] = {}

    def run(config: dict, *, extra_args=("--synthetic-data",), timeout_s: float = 300):
        key = _run_key(config, extra_args)
        if key not in done:
            done[key] = run_training(copy.deepcopy(config), tmp_path_factory.mktemp("shared-ref"),
                                     timeout_s=timeout_s, extra_args=list(extra_args))
        return done[key]

    return run


# ------------------------------------------------------------------------------------ Open MPI's own crashes
@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """A slow (multi-process) test that failed because Open MPI segfaulted inside its own library runs once more
    (tests/upstream_crash.py says why); the crash is reported at the end of the session."""
    if item.get_closest_marker("slow") is None:
        return None
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    reports = runtestprotocol(item, nextitem=nextitem, log=False)
    if any(r.failed for r in reports):
        crash = open_mpi_crash(failure_texts(getattr(item, "_run_tmp_path", None), reports))
        if crash is not None:
            item.config._open_mpi_crashes = [*getattr(item.config, "_open_mpi_crashes", []), f"{item.nodeid}: {crash}"]
            crashed = getattr(item, "_run_tmp_path", None)  # that attempt's runs: a hang there followed the crash
            item.config._crashed_tmp_paths = [*getattr(item.config, "_crashed_tmp_paths", []),
                                              *([Path(crashed)] if crashed is not None else [])]
            item._initrequest()
            reports = runtestprotocol(item, nextitem=nextitem, log=False)
    for report in reports:
        item.ihook.pytest_runtest_logreport(report=report)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    item._run_tmp_path = (getattr(item, "funcargs", None) or {}).get("tmp_path")  # read after teardown, above


# ---------------------------------------------------------------------------------------------- hang detector
# Every fault-tolerant run of the suite has the hang monitor on. At the end of the session, scan every run dir the
# tests made: a ``hang_detected`` event in a run that injected no SIGSTOP / hang, or before it did, is a false alarm
# (it fails the session); the closest any run came to its timeout is printed (the margin), and so is every repair
# round that found no dead rank (``repair_without_failure``: logged, harmless to the trajectory, worth counting). A
# hang in a run of an attempt that Open MPI's own crash failed (that test ran once more) is listed apart: a rank
# crashed inside libmpi left its peers waiting, and the hang monitor bounded that wait, as it must.
def _scan_run_records(base: Path, crashed: list[Path] = ()) -> dict[str, list]:

    from nanotron_recover.run.run_folder import METRICS_FILE, hang_provoked_at, read_exits

    found: dict[str, list] = {"false_alarms": [], "margins": [], "without_failure": [], "after_crash": []}
    for metrics in base.rglob(METRICS_FILE):
        run_dir = metrics.parent
        # a scheduled freeze or hang, or a signal sent from outside (a frozen rank, an orphaning kill of mpirun):
        # hang events from its time on are expected, earlier ones are not
        provoked_at = hang_provoked_at(run_dir)
        expected = provoked_at is not None
        for line in metrics.read_text(errors="replace").splitlines():
            if '"hang_detected"' in line and (provoked_at is None or _event_time(line) < provoked_at):
                after_crash = any(run_dir.is_relative_to(path) for path in crashed)
                found["after_crash" if after_crash else "false_alarms"].append(f"{run_dir}: {line[:300]}")
            if '"repair_without_failure"' in line:
                found["without_failure"].append(f"{run_dir}: {line[:300]}")
        for exit_record in read_exits(run_dir).values():
            margin = exit_record.get("hang_margin")
            if margin and not expected:
                found["margins"].append(margin)
    return found


def _event_time(line: str) -> float:
    """A hang event's wall time (a line without one reads as late: never before a fault)."""
    import json

    try:
        return float(json.loads(line).get("wall_time") or float("inf"))
    except (ValueError, AttributeError):
        return float("inf")


def _remove_left_snapshots(base: Path) -> None:
    """The runs that these tests killed leave their node-local snapshots in the default folder (``/dev/shm``):
    delete those of this session's run dirs, so that the machine's memory is not filled run after run."""
    import shutil

    from nanotron_recover.config import FaultToleranceArgs
    from nanotron_recover.run.run_folder import RUN_ID_FILE

    folder = Path(FaultToleranceArgs().local_snapshot_dir).resolve()
    for id_file in base.rglob(RUN_ID_FILE):
        run = id_file.read_text().strip()
        # a test may plant a hostile id ("../../etc"): only a plain hex id names a folder of the store
        if run and all(c in "0123456789abcdef" for c in run) and (folder / run).resolve().parent == folder:
            shutil.rmtree(folder / run, ignore_errors=True)


def pytest_sessionfinish(session, exitstatus):
    factory = getattr(session.config, "_tmp_path_factory", None)
    if factory is None:
        return
    try:
        base = factory.getbasetemp()
    except Exception:  # noqa: BLE001 - no tmp dir was made
        return
    found = _scan_run_records(base, getattr(session.config, "_crashed_tmp_paths", []))
    session.config._run_records = found
    _remove_left_snapshots(base)
    if found["false_alarms"]:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    crashes = getattr(config, "_open_mpi_crashes", [])
    if crashes:
        terminalreporter.section("Open MPI crashes (each test run once more)")
        for line in crashes:
            terminalreporter.write_line(line)
    found = getattr(config, "_run_records", None)
    if not found or not any(found.values()):
        return
    terminalreporter.section("hang detector")
    margins = found["margins"]
    if margins:
        busy = max(m["max_busy_s"] for m in margins)
        silence = max(margins, key=lambda m: m["max_silence_s"])
        ratio = max(max(m["max_busy_s"], m["max_silence_s"]) / m["timeout_s"] for m in margins)
        terminalreporter.write_line(
            f"{len(margins)} rank records of runs without an injected hang: longest busy stretch without progress "
            f"{busy:.2f} s, longest silence {silence['max_silence_s']:.2f} s ({silence.get('max_silence_of', '')}); "
            f"worst ratio to the rank's timeout {ratio:.3f}"
        )
    for line in found["without_failure"]:
        terminalreporter.write_line(f"repair without a failure (logged, trajectory kept): {line}")
    for line in found["after_crash"]:
        terminalreporter.write_line(f"hang after an Open MPI crash (that attempt ran once more): {line}")
    for alarm in found["false_alarms"]:
        terminalreporter.write_line(f"FALSE ALARM: {alarm}")
