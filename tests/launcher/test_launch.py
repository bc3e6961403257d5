"""The launcher around mpirun: output passes through, and a launch that PRRTE itself failed to start is repeated."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from nanotron_recover.launcher.launch import PRRTE_STARTUP_FAILURES, launch_failure
from nanotron_recover.run.run_folder import ranks_wrote_since

LISTENER = PRRTE_STARTUP_FAILURES[0]


def test_only_prrte_start_up_failures_are_launch_failures() -> None:
    assert launch_failure(213, f"---\n{LISTENER}. We cannot\ncontinue.\n".encode()) == LISTENER
    assert launch_failure(213, b"A daemon failed to report back after being spawned") is not None
    assert launch_failure(0, LISTENER.encode()) is None  # mpirun said it finished
    assert launch_failure(2, LISTENER.encode()) is None  # bad input: relaunching cannot help
    assert launch_failure(137, b"Killed") is None


def test_a_rank_record_written_after_the_launch_counts(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    assert ranks_wrote_since(tmp_path, 0.0)
    assert not ranks_wrote_since(tmp_path, (tmp_path / "metrics.jsonl").stat().st_mtime + 1.0)
    assert not ranks_wrote_since(tmp_path / "absent", 0.0)


def _launcher(tmp_path: Path, script: str) -> subprocess.CompletedProcess:
    """A real launcher process whose 'mpirun' is ``script`` (a stand-in for PRRTE's start-up, not for MPI)."""
    stand_in = tmp_path / "stand_in.py"
    stand_in.write_text(textwrap.dedent(script))
    code = ("import sys; from pathlib import Path; from nanotron_recover.launcher import launch; "
            "launch.LAUNCH_RETRY_PAUSE_S = 0.0; "
            f"sys.exit(launch.launch_with_retries([sys.executable, {str(stand_in)!r}], Path({str(tmp_path)!r})))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_a_failed_start_is_launched_again_and_its_output_passes_through(tmp_path: Path) -> None:
    proc = _launcher(tmp_path, f"""
        import sys
        from pathlib import Path
        count = Path(__file__).with_name("attempts")
        n = int(count.read_text()) if count.exists() else 0
        count.write_text(str(n + 1))
        print("attempt", n, flush=True)
        if n == 0:
            print({LISTENER!r} + ". We cannot continue.", file=sys.stderr)
            sys.exit(213)
        print("ranks ran", file=sys.stderr)
        """)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "attempts").read_text() == "2"
    assert proc.stdout.splitlines() == ["attempt 0", "attempt 1"]
    assert "launching again (1/2)" in proc.stderr and proc.stderr.rstrip().endswith("ranks ran")


def test_a_failure_after_ranks_wrote_is_not_launched_again(tmp_path: Path) -> None:
    proc = _launcher(tmp_path, f"""
        import sys
        from pathlib import Path
        Path(__file__).with_name("metrics.jsonl").write_text("{{}}\\n")
        print({LISTENER!r}, file=sys.stderr)
        sys.exit(213)
        """)
    assert proc.returncode == 213
    assert "launching again" not in proc.stderr


def test_the_retries_end(tmp_path: Path) -> None:
    proc = _launcher(tmp_path, f"""
        import sys
        print({LISTENER!r}, file=sys.stderr)
        sys.exit(213)
        """)
    assert proc.returncode == 213
    assert proc.stderr.count("launching again") == 2


def _judged(tmp_path: Path, mpirun_rc: int, codes: list[int], last_step: int = 2, saved: int | None = None) -> int:
    from nanotron_recover.config import config_from_dict
    from nanotron_recover.launcher.launch import _judge
    from nanotron_recover.run.run_folder import record_exit
    from tests.conftest import make_tiny_config

    config = config_from_dict(make_tiny_config(steps=10, fault_tolerance={"enabled": True}))
    tmp_path.mkdir(parents=True)
    (tmp_path / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "loss": 1.0}}\n' for s in range(1, last_step + 1)))
    if saved is not None:
        (tmp_path / "checkpoints").mkdir()
        (tmp_path / "checkpoints" / "latest.txt").write_text(f"{saved}\n")
    for rank, code in enumerate(codes):
        record_exit(tmp_path, rank, code, "test")
    return _judge(tmp_path, config, mpirun_rc)


def test_the_launcher_exit_code_follows_the_run_not_mpirun(tmp_path: Path) -> None:
    """A start-up timeout ends the job with every rank's record saying 3 while mpirun returns 1: restart (3), so a
    wrapper or a requeue relaunches it; a rank that aborted on a bug makes it 2 (a person must look, as for bad
    input); a finished run is 0."""
    assert _judged(tmp_path / "startup", 1, [3, 3]) == 3
    assert _judged(tmp_path / "torn", 0, []) == 3  # a lost node's daemon: mpirun 0, no records
    assert _judged(tmp_path / "killed", 137, []) == 3
    assert _judged(tmp_path / "bug", 1, [1, 3]) == 2
    assert _judged(tmp_path / "badinput", 2, []) == 2
    assert _judged(tmp_path / "done", 1, [0, 0], last_step=10, saved=10) == 0
    assert _judged(tmp_path / "final-save-lost", 1, [0, 0], last_step=10, saved=8) == 3


def test_a_job_ended_on_a_full_disk_leaves_no_partial_save(tmp_path: Path, capsys) -> None:
    """A rank that ends the job on a full disk cannot wait for a background save in flight: its partial folder, which
    holds the space a person must free, is removed by the launcher once no writer is alive; published checkpoints and
    the pointer stay. Another ending (a restart) leaves the partial folder to the next launch's publisher."""
    from nanotron_recover.config import config_from_dict
    from nanotron_recover.launcher.launch import _judge
    from nanotron_recover.run.run_folder import record_exit
    from tests.conftest import make_tiny_config

    config = config_from_dict(make_tiny_config(steps=10, fault_tolerance={"enabled": True}))
    for case, disk_full in (("full", True), ("restart", False)):
        run = tmp_path / case
        checkpoints = run / "checkpoints"
        (checkpoints / "4").mkdir(parents=True)
        (checkpoints / "4" / "state.json").write_text("{}")
        (checkpoints / "latest.txt").write_text("4\n")
        partial = checkpoints / ".tmp-step-6-abc-e0" / "model"
        partial.mkdir(parents=True)
        (partial / "weights.safetensors").write_bytes(b"x" * 3 * 2**20)
        (run / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "loss": 1.0}}\n' for s in range(1, 7)))
        record_exit(run, 0, 2 if disk_full else 3, "disk full" if disk_full else "restart", disk_full=disk_full)
        record_exit(run, 1, 3, "the job was ended")
        assert _judge(run, config, 1) == (2 if disk_full else 3)
        left = sorted(p.name for p in checkpoints.iterdir())
        said = capsys.readouterr().err
        if disk_full:
            assert left == ["4", "latest.txt"]
            assert f"removed the unpublished partial save {checkpoints / '.tmp-step-6-abc-e0'} (3.0 MiB)" in said
        else:
            assert left == [".tmp-step-6-abc-e0", "4", "latest.txt"]
            assert "removed" not in said


def test_a_disk_too_full_for_any_exit_record_also_loses_its_partial_save(tmp_path: Path, capsys,
                                                                         monkeypatch) -> None:
    """No rank could write its record (the launcher sees the run folder's file system nearly full: exit 2 all the
    same): the partial save goes too. The free space is what ``shutil.disk_usage`` would say of a full disk."""
    from nanotron_recover.config import config_from_dict
    from nanotron_recover.launcher import launch
    from nanotron_recover.run import outcome
    from tests.conftest import make_tiny_config

    for module in (launch, outcome):
        monkeypatch.setattr(module, "free_bytes", lambda path: 4096)
    config = config_from_dict(make_tiny_config(steps=10, fault_tolerance={"enabled": True}))
    partial = tmp_path / "checkpoints" / ".tmp-step-6-abc-e0"
    partial.mkdir(parents=True)
    (partial / "part").write_bytes(b"x" * 2**20)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    assert launch._judge(tmp_path, config, 1) == 2
    assert not partial.exists() and "removed the unpublished partial save" in capsys.readouterr().err


def test_in_an_allocation_with_odd_slots_the_launch_names_whole_replica_slots(tmp_path: Path, monkeypatch) -> None:
    """Slurm gave 3 and 5 slots; 3 replicas of 2 ranks: without ``--host``, ranks 0-2 would fill the first node and
    replica 1 would span both. The launch line names 2 and 4 slots; no placement warning is left."""
    from nanotron_recover.launcher import slurm_nodes
    from nanotron_recover.launcher.launch import build_parser, placement_warnings, train_command
    from nanotron_recover.launcher.runs import write_config
    from tests.conftest import make_tiny_config

    monkeypatch.setattr(slurm_nodes, "hostnames", lambda nodelist: ["n1", "n2"])  # scontrol's expansion, given
    monkeypatch.delenv("NANOTRON_RECOVER_HOSTFILE", raising=False)
    for name, value in {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "3,5"}.items():
        monkeypatch.setenv(name, value)
    path = write_config(make_tiny_config(dp=3, tp=2, accumulation=1), tmp_path / "config.yaml")
    args = build_parser().parse_args(["train", "--config-file", str(path), "--run-dir", str(tmp_path / "run")])
    cmd, config, _ = train_command(args)
    assert cmd[1:3] == ["--host", "n1:2,n2:4"], cmd
    assert placement_warnings(config, cmd) == []
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "4,4")  # whole replicas already: Slurm's placement stands
    cmd, config, _ = train_command(args)
    assert "--host" not in cmd
