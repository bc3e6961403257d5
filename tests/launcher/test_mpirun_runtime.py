"""NANOTRON_RECOVER_RUNTIME: the launcher's choice of runtime (fast, no MPI run; a fake prefix)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nanotron_recover.launcher.mpirun import RUNTIME_ENV, mpirun_command, runtime_prefix, runtime_versions


def _fake_prefix(tmp_path: Path) -> Path:
    prefix = tmp_path / "ft-runtime"
    (prefix / "bin").mkdir(parents=True)
    (prefix / "bin" / "mpirun").write_text("#!/bin/sh\n")
    (prefix / "bin" / "mpirun").chmod(0o755)
    return prefix


def _option_values(cmd: list[str], flag: str) -> list[str]:
    return [cmd[i + 1] for i, a in enumerate(cmd[:-1]) if a == flag]


def test_unset_changes_nothing(monkeypatch):
    monkeypatch.delenv(RUNTIME_ENV, raising=False)
    assert runtime_prefix() is None
    cmd = mpirun_command(4, ["prog"], env={"A": "1"})
    assert "--prefix" not in cmd and "--rtos" not in cmd
    assert "errmgr_detector_heartbeat_period" in cmd  # the wheel's PRRTE 3.0 detector, as before
    assert _option_values(cmd, "-x") == ["A=1"]
    monkeypatch.setenv(RUNTIME_ENV, "  ")  # empty counts as unset
    assert mpirun_command(4, ["prog"], env={"A": "1"}) == cmd


def test_runtime_selected(monkeypatch, tmp_path):
    prefix = _fake_prefix(tmp_path)
    monkeypatch.setenv(RUNTIME_ENV, str(prefix))
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    cmd = mpirun_command(6, ["prog", "arg"], env={"A": "1"}, hostfile="hosts", extra_args=["--extra"])
    assert cmd[0] == str(prefix / "bin" / "mpirun")
    assert _option_values(cmd, "--prefix") == [str(prefix)]
    assert _option_values(cmd, "--with-ft") == ["ulfm"]
    rtos = _option_values(cmd, "--rtos")[0].split(",")
    assert "recoverable" in rtos and "notifyerrors" in rtos
    prtemca = _option_values(cmd, "--prtemca")
    assert {"prte_keepalive_time", "prte_keepalive_intvl", "prte_keepalive_probes"} <= set(prtemca)
    assert not any(k.startswith("errmgr_detector") for k in prtemca)  # no such component on PRRTE master
    assert cmd[cmd.index("coll") + 1] == "^han,cuda"
    exported = dict(x.split("=", 1) for x in _option_values(cmd, "-x"))
    assert exported["A"] == "1"
    assert exported["PYTHONPATH"] == f"{prefix / 'python'}:/somewhere"  # its mpi4py first
    assert cmd[-3:] == ["--extra", "prog", "arg"]


def test_runtime_without_ulfm_is_the_plain_launch_on_it(monkeypatch, tmp_path):
    prefix = _fake_prefix(tmp_path)
    monkeypatch.setenv(RUNTIME_ENV, str(prefix))
    cmd = mpirun_command(2, ["prog"], ulfm=False)
    assert cmd[0] == str(prefix / "bin" / "mpirun")
    assert "--with-ft" not in cmd and "--rtos" not in cmd


def test_runtime_missing_mpirun_is_an_error(monkeypatch, tmp_path):
    monkeypatch.setenv(RUNTIME_ENV, str(tmp_path / "nothing"))
    with pytest.raises(FileNotFoundError, match="build_runtime.sh"):
        mpirun_command(2, ["prog"])


def test_runtime_versions(tmp_path):
    prefix = _fake_prefix(tmp_path)
    assert runtime_versions(prefix) == {}
    (prefix / "share").mkdir()
    (prefix / "share" / "ft-runtime-versions.json").write_text('{"ompi": {"version": "6.1.0a1"}}')
    assert runtime_versions(prefix)["ompi"]["version"] == "6.1.0a1"
