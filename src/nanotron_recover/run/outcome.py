"""How a launch ended, judged from what its run folder holds, and when relaunching has stopped helping.

Each launch is judged once it ended (:func:`judge_launch`): ``done``, ``restart`` (a relaunch will help, exit 3),
``needs_person`` or ``aborted`` (exit 2). The verdicts are kept in ``outcomes.jsonl``, so that the count of
failures that come back holds across launchers (a Slurm requeue starts a new one). Two kinds come back for ever
under a wrapper that trusts exit 3, and are turned into ``needs_person`` on their ``max_startup_failures``-th launch
in a row (default 3):

* the same **start-up failure**: no step committed, the same reasons in the exit records;
* the same **step failed**: the launches resumed before step K, committed steps, and died at K each time (a bad
  sample, a faulty device, the OOM killer): a SIGKILLed rank leaves no word, so K is read from the step records of
  each launch (its last committed step + 1), and the microbatches from what the replicas that died in step K were
  computing (the survivors log them: ``orphaned``), narrowed over the launches.

A launch that ended on purpose (a stop signal, a regrow) failed at no step. Standard library only.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any, Sequence

from nanotron_recover.run.disk_space import NEARLY_FULL_BYTES, free_bytes, full_disk_line
from nanotron_recover.run.exit_codes import EXIT_ABORTED, EXIT_DONE, EXIT_NEEDS_PERSON, EXIT_RESTART
from nanotron_recover.run.run_folder import (
    append_line,
    last_logged_step,
    latest_checkpoint_step,
    read_exits,
    read_launches,
    read_metrics_jsonl,
)

NEEDS_PERSON = "needs_person"
OUTCOME_EXIT_CODES = {"done": EXIT_DONE, NEEDS_PERSON: EXIT_NEEDS_PERSON, "aborted": EXIT_NEEDS_PERSON,
                      "restart": EXIT_RESTART}
OUTCOMES_FILE = "outcomes.jsonl"
DEFAULT_MAX_STARTUP_FAILURES = 3
STOPS_ON_PURPOSE = ("stop_signal", "regrow_stop")  # events of a launch that ended at a step boundary on purpose


def run_outcome(run_dir: Path, train_steps: int, mpirun_rc: int, checkpoints_path: str = "checkpoints", *,
                needs_final_checkpoint: bool = False) -> tuple[str, str]:
    """Was a job finished, or must it be relaunched? ``("done" | "restart" | "needs_person" | "aborted", detail)``.

    ``done``: the last step (``train_steps``) was checkpointed, or, for a run that writes no checkpoints
    (``needs_final_checkpoint`` false), logged: a job torn down inside its final save logged every step but holds
    an older model on disk, and a relaunch writes the final one. ``needs_person``: mpirun returned 2 or a rank
    recorded 2 (bad input, damaged state with no intact fallback, a full disk, a non-finite step: relaunching
    cannot help). ``aborted``: a rank's exit record says it aborted the job on a bug (exit 1: the same error
    would come back). Else ``restart``: the trainer stopped below ``min_replicas`` (rc 3), a start-up fault or an
    unresolvable hang ended the job (rc 3), or the job was torn down from outside with mpirun returning 0: a lost
    node's daemon ends every rank on this Open MPI, and those ranks leave no exit record (the detail counts them).
    """
    last = last_logged_step(run_dir)
    ckpt = latest_checkpoint_step(run_dir, checkpoints_path)
    exits = read_exits(run_dir)
    codes = sorted({int(e.get("code", -1)) for e in exits.values()})
    detail = (f"last logged step {last}/{train_steps}, mpirun rc {mpirun_rc}, latest checkpoint {ckpt}, "
              f"exit records {len(exits)} (codes {codes})")
    if EXIT_NEEDS_PERSON in codes:  # even past the last step: the newest checkpoint was found damaged
        return NEEDS_PERSON, detail
    if (ckpt is not None and ckpt >= train_steps) or (last >= train_steps and not needs_final_checkpoint):
        return "done", detail
    if mpirun_rc == EXIT_NEEDS_PERSON:
        return NEEDS_PERSON, detail
    if EXIT_ABORTED in codes:
        return "aborted", detail
    return "restart", detail


def judge_launch(run_dir: Path, train_steps: int, mpirun_rc: int, checkpoints_path: str = "checkpoints", *,
                 needs_final_checkpoint: bool = False,
                 max_startup_failures: int = DEFAULT_MAX_STARTUP_FAILURES) -> tuple[str, str]:
    """:func:`run_outcome`, recorded in ``outcomes.jsonl``; a restart that repeats a start-up failure, or a failure
    at the same step, for the ``max_startup_failures``-th time in a row becomes ``needs_person``: a requeue would
    meet it again, all night."""
    verdict, detail = run_outcome(run_dir, train_steps, mpirun_rc, checkpoints_path,
                                  needs_final_checkpoint=needs_final_checkpoint)
    free = free_bytes(run_dir)
    if verdict == "restart" and free is not None and free < NEARLY_FULL_BYTES:  # too full even for exit records
        kept = f"latest checkpoint {latest_checkpoint_step(run_dir, checkpoints_path)}; {detail}"
        return NEEDS_PERSON, full_disk_line(Path(run_dir), kept)
    launches = read_launches(run_dir)
    mine = _this_launch(read_metrics_jsonl(run_dir), launches[-1] if launches else None)
    stepped = any("event" not in r and "step" in r for r in mine)
    reasons = sorted({re.sub(r"\d+", "#", str(e.get("reason", ""))) for e in read_exits(run_dir).values()})
    failed = failed_step(mine) if verdict == "restart" else None
    record = {"launch": len(launches), "verdict": verdict, "stepped": stepped, "signature": "; ".join(reasons),
              "reasons": reasons, "failed_step": failed, "suspects": suspect_microbatches(mine, failed),
              "time": time.time()}
    append_line(Path(run_dir) / OUTCOMES_FILE, json.dumps(record))
    limit = max_startup_failures  # 0: never stop requeueing
    outcomes = read_metrics_jsonl(Path(run_dir) / OUTCOMES_FILE)
    if verdict != "restart" or limit <= 0:
        return verdict, detail
    repeated = repeated_startup_failures(outcomes)
    if repeated >= limit:
        why = record["signature"] or "no exit record"
        return NEEDS_PERSON, (f"the same start-up failure on {repeated} launches in a row ({why}): a relaunch would "
                              f"meet it again; {detail}")
    same_step = repeated_step_failures(outcomes)
    if same_step >= limit:
        return NEEDS_PERSON, f"{same_step_line(outcomes, same_step)}; {detail}"
    return verdict, detail


def _this_launch(records: list[dict[str, Any]], launch: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The metrics records of ``launch`` (by its token; records of a version without tokens: by time)."""
    if launch is None:
        return records
    token = launch.get("token")
    if token is not None and any("launch" in r for r in records):
        return [r for r in records if r.get("launch") == token]
    started = float(launch.get("time", 0.0))
    return [r for r in records if isinstance(r.get("time"), (int, float)) and r["time"] >= started]


def failed_step(records: Sequence[dict[str, Any]]) -> int | None:
    """The step a launch died in (its last committed step + 1; its start-up names the step it resumed from), or
    None: it ended on purpose at a step boundary, or logged nothing at all (a start-up failure)."""
    if any(r.get("event") in STOPS_ON_PURPOSE for r in records):
        return None
    steps = [r["step"] for r in records if isinstance(r.get("step"), int)
             and ("event" not in r or r.get("event") == "startup")]
    return max(steps) + 1 if steps else None


def suspect_microbatches(records: Sequence[dict[str, Any]], step: int | None) -> list[int] | None:
    """The microbatches of ``step`` (indices 0 .. M-1 within the step) that every replica which died in it was
    computing (the survivors log them: ``orphaned``; a survivor that took them over and died too narrows them), or
    None when no record names them."""
    if step is None:
        return None
    taken = [set(r.get("microbatches", [])) for r in records if r.get("event") == "orphaned" and r.get("step") == step]
    common = set.intersection(*taken) if taken else set()
    return sorted(common) or None


def repeated_startup_failures(outcomes: Sequence[dict[str, Any]]) -> int:
    """How many of the newest launches in a row ended in a restart without committing a step, for a reason the
    newest launch also gave (0 if the newest did not). A shared reason, not equal sets: which secondary reasons
    get written (a survivor's "process failure" while the job is being ended) is a race, the cause is not."""
    outcomes = _by_launch(outcomes)
    newest = set(_reasons(outcomes[-1])) if outcomes else set()
    count = 0
    for record in reversed(outcomes):
        reasons = set(_reasons(record))
        if record.get("verdict") != "restart" or record.get("stepped") or \
                not (reasons & newest or reasons == newest):
            break
        count += 1
    return count


def repeated_step_failures(outcomes: Sequence[dict[str, Any]]) -> int:
    """How many of the newest launches in a row ended in a restart at the step the newest one died in (0 if the
    newest died at no step): the same step failing again and again is the data or the device, not bad luck."""
    outcomes = _by_launch(outcomes)
    step = outcomes[-1].get("failed_step") if outcomes else None
    count = 0
    for record in reversed(outcomes):
        if step is None or record.get("verdict") != "restart" or record.get("failed_step") != step:
            break
        count += 1
    return count


def same_step_line(outcomes: Sequence[dict[str, Any]], count: int) -> str:
    """What a person reads when the same step failed ``count`` launches in a row: the step, and the microbatch(es)
    the records point at (or every microbatch of the step: a SIGKILLed rank leaves no word)."""
    newest = _by_launch(outcomes)[-count:]
    step = newest[-1]["failed_step"]
    named = [set(r["suspects"]) for r in newest if r.get("suspects")]
    common = sorted(set.intersection(*named)) if named else []
    what = (f"microbatch {common[0]} of it was" if len(common) == 1 else f"its microbatches {common} were" if common
            else "no record names which of its microbatches were")
    return (f"step {step} failed on {count} launches in a row; {what} being computed by the replicas that died (a bad "
            "sample or a faulty device brings a crash back at the same step): a relaunch would meet it again")


def _by_launch(outcomes: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per launch (a launch judged twice counts once), oldest first."""
    by_launch = {record.get("launch"): record for record in outcomes}
    return [by_launch[k] for k in sorted(by_launch, key=lambda k: k if isinstance(k, int) else -1)]


def _reasons(outcome: dict[str, Any]) -> list[str]:
    """The reasons an outcome record names (older records kept only the joined ``signature``)."""
    reasons = outcome.get("reasons")
    if isinstance(reasons, list):
        return [str(r) for r in reasons]
    signature = str(outcome.get("signature", ""))
    return signature.split("; ") if signature else []

