"""How a launch is judged from its run folder (run/outcome.py): done, restart, a person's turn, and the failures
that come back (the same start-up failure, the same step) turned into a person's turn."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanotron_recover.run.exit_codes import EXIT_ABORTED, EXIT_BAD_INPUT, EXIT_DONE, EXIT_RESTART
from nanotron_recover.run.outcome import judge_launch, repeated_startup_failures, run_outcome
from nanotron_recover.run.run_folder import begin_launch, read_exits, read_launches, record_exit

REPO = Path(__file__).resolve().parents[2]


def _write(run: Path, text: str) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text(text)


@pytest.mark.parametrize(
    "logged, rc, verdict, code",
    [(4, 0, "done", EXIT_DONE), (3, 0, "restart", EXIT_RESTART), (3, 3, "restart", EXIT_RESTART),
     (0, 2, "needs_person", EXIT_BAD_INPUT)],
)
def test_slurm_outcome_helper(tmp_path: Path, logged: int, rc: int, verdict: str, code: int) -> None:
    lines = "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, logged + 1))
    _write(tmp_path, lines + '{"event": "stopped", "step": 9}\n{"step": 4, "lo')  # an event and a torn line never count
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "slurm" / "recover_job.py"), "outcome", "--run-dir",
                           str(tmp_path), "--train-steps", "4", "--mpirun-rc", str(rc)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == code and proc.stdout.split()[0] == verdict, proc.stdout + proc.stderr


def test_a_new_launch_is_judged_by_its_own_exit_records(tmp_path: Path) -> None:
    """A bug recorded by launch 1 (exit 1) must not make launch 2, torn down by a lost node (no records, mpirun
    rc 0), read as aborted: the relaunch would not be requeued."""
    assert begin_launch(tmp_path, {"by": "test", "world_size": 4}) == 1
    record_exit(tmp_path, 0, EXIT_ABORTED, "aborted: a bug")
    assert run_outcome(tmp_path, 10, 0)[0] == "aborted"
    assert begin_launch(tmp_path, {"by": "test", "world_size": 4}) == 2
    assert read_exits(tmp_path) == {} and run_outcome(tmp_path, 10, 0)[0] == "restart"
    assert json.loads((tmp_path / "launches" / "1" / "exits" / "rank-0.json").read_text())["code"] == EXIT_ABORTED
    assert [(r["launch"], r["world_size"]) for r in read_launches(tmp_path)] == [(1, 4), (2, 4)]


def test_a_run_that_checkpoints_is_done_only_once_its_last_step_is_on_disk(tmp_path: Path) -> None:
    """A job torn down inside its final save logged every step but holds step 4 on disk: done would hand the user
    an older model, so it is a restart (the relaunch writes the final checkpoint)."""
    _write(tmp_path, "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 9)))
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest.txt").write_text("4\n")
    assert run_outcome(tmp_path, 8, 0, needs_final_checkpoint=True)[0] == "restart"
    assert run_outcome(tmp_path, 8, 0, needs_final_checkpoint=False)[0] == "done"  # a run that keeps no checkpoints
    (tmp_path / "checkpoints" / "latest.txt").write_text("8\n")
    assert run_outcome(tmp_path, 8, 0, needs_final_checkpoint=True)[0] == "done"


def test_the_same_startup_failure_stops_requeueing_on_the_third_launch(tmp_path: Path) -> None:
    """Launches that end in a restart without committing a step, for the same reasons, count up across launchers
    (the count lives in the run folder); a launch judged twice counts once; a step committed resets the count."""
    def launch(reason: str, stepped: bool = False) -> str:
        begin_launch(tmp_path, {"by": "test"})
        if stepped:
            _write(tmp_path, json.dumps({"step": 1, "loss": 1.0, "time": time.time()}) + "\n")
        record_exit(tmp_path, 0, EXIT_RESTART, reason)
        verdict = judge_launch(tmp_path, 10, 3, max_startup_failures=3)[0]
        assert judge_launch(tmp_path, 10, 3, max_startup_failures=3)[0] == verdict  # judged again: same answer
        return verdict

    assert launch("rank(s) [3] died during start-up") == "restart"
    assert launch("rank(s) [3] died during start-up") == "restart"
    assert launch("rank(s) [5] died during start-up") == "needs_person"  # digits aside, the same failure
    assert launch("start-up failed: another reason") == "restart"
    assert launch("start-up failed: another reason", stepped=True) == "restart"
    assert launch("start-up failed: another reason") == "restart"  # the count began again after the step


def _outcome(launch: int, reasons: list[str], verdict: str = "restart", stepped: bool = False) -> dict:
    return {"launch": launch, "verdict": verdict, "stepped": stepped, "reasons": reasons}


def test_a_start_up_failure_counts_as_repeated_when_a_reason_comes_back():
    died, secondary = "rank # died during start-up", "start-up failed: MPI_ERR_PROC_FAILED"
    # which survivor wrote its secondary reason before the job was ended is a race: the cause still repeats
    assert repeated_startup_failures([_outcome(1, [died, secondary]), _outcome(2, [died]),
                                      _outcome(3, [died, secondary])]) == 3
    assert repeated_startup_failures([_outcome(1, ["disk gone"]), _outcome(2, [died])]) == 1
    assert repeated_startup_failures([_outcome(1, [died]), _outcome(2, [died], stepped=True),
                                      _outcome(3, [died])]) == 1
    assert repeated_startup_failures([_outcome(1, [died]), _outcome(2, [died], verdict="done")]) == 0
    assert repeated_startup_failures([_outcome(1, []), _outcome(2, [])]) == 2  # no exit record at all, twice
    old = {"launch": 1, "verdict": "restart", "stepped": False, "signature": f"{died}; {secondary}"}
    assert repeated_startup_failures([old, _outcome(2, [died])]) == 2  # a record from before "reasons" existed




def test_a_crash_that_comes_back_at_the_same_step_stops_requeueing_on_the_third_launch(tmp_path: Path) -> None:
    """Each launch resumes before step 6, commits steps, and dies at step 6 (no exit record: SIGKILLed); the
    survivors of the first death took microbatch 2 over, and died of it: the third launch is a person's turn, named
    with the step and the microbatch. A launch that died elsewhere, or stopped on purpose, resets the count."""
    def launch(last_step: int, *events: dict) -> tuple[str, str]:
        begin_launch(tmp_path, {"by": "test"})
        token = read_launches(tmp_path)[-1].get("token")
        lines = [{"event": "startup", "step": 3}, *({"step": s, "loss": 1.0} for s in range(4, last_step + 1)),
                 *events]
        with open(tmp_path / "metrics.jsonl", "a") as f:
            f.writelines(json.dumps({**r, "time": time.time(), "launch": token}) + "\n" for r in lines)
        return judge_launch(tmp_path, 10, 0, max_startup_failures=3)

    taken_over = {"event": "orphaned", "step": 6, "microbatches": [2, 3]}
    assert launch(5, taken_over)[0] == "restart"
    assert launch(5, {"event": "orphaned", "step": 6, "microbatches": [2]})[0] == "restart"
    verdict, detail = launch(5)
    assert verdict == "needs_person", detail
    assert detail.startswith("step 6 failed on 3 launches in a row; microbatch 2 of it was being computed"), detail
    assert launch(5, {"event": "regrow_stop", "step": 5})[0] == "restart"  # ended on purpose: no failed step
    assert launch(5)[0] == "restart" and launch(5)[0] == "restart"  # the count began again
    assert launch(7)[0] == "restart"  # died at another step


def test_a_crash_at_the_same_step_counts_only_launches_in_a_row():
    from nanotron_recover.run.outcome import repeated_step_failures

    def outcome(launch: int, step: int | None, verdict: str = "restart") -> dict:
        return {"launch": launch, "verdict": verdict, "failed_step": step}

    assert repeated_step_failures([outcome(1, 6), outcome(2, 6), outcome(3, 6)]) == 3
    assert repeated_step_failures([outcome(1, 6), outcome(2, 9), outcome(3, 6)]) == 1
    assert repeated_step_failures([outcome(1, 6), outcome(2, 6, "done"), outcome(3, 6)]) == 1
    assert repeated_step_failures([outcome(1, None), outcome(2, None)]) == 0  # start-up failures: counted apart
    assert repeated_step_failures([outcome(1, 6), outcome(1, 6)]) == 1  # a launch judged twice counts once
