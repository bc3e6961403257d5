"""benchmarks/campaign_table.py: campaign logs (as fault_campaign.py prints them) into one tally."""

from benchmarks.campaign_table import main, parse, summary, table

LOG = "\n".join([
    "fault campaign: 3 trials from seed 7; recycle on; launch bound 240 s; out /tmp/c",
    "seed      7 3d-tp2+recycle ext-kill            done           launches 1  14.8 s max|dloss| 0.0e+00 "
    "[SIGKILL ranks [1] 0.08 s after step 2] ok",
    "seed      8 recycle  node-loss           restart->done  launches 2  60.7 s max|dloss| 0.0e+00 "
    "[node n1 lost 0.07 s after step 3] ok",
    "seed      9 hsdp+recycle hang                done           launches 1  28.1 s max|dloss| 2.4e-07 "
    "[hang r1.0 step 3 forward] ok false kills: ['rank 0 stuck at step 3 (load 5.1)', "
    "'rank 1 silent at step 3 (load 5.1)']",
    "| kind | done |",
    "campaign_trials=3 failures=0 stalls=0 false_kills=2 seed=7",
])
FAILED = ("seed     10 spare    phase               FAIL           launches 1  20.0 s max|dloss| 3.1e-02 "
          "[kill r1.0 step 3 backward] FAILED: step 4 loss differs by 3.1e-02")


def test_trial_lines_are_parsed_and_everything_else_skipped() -> None:
    trials = parse(LOG.splitlines())
    assert [(t.seed, t.shape, t.kind, t.outcome, t.ok, t.false_kills) for t in trials] == [
        (7, "3d-tp2+recycle", "ext-kill", "done", True, 0),
        (8, "recycle", "node-loss", "restart->done", True, 0),
        (9, "hsdp+recycle", "hang", "done", True, 2),
    ]
    assert summary(trials) == "campaign_trials=3 failures=0 stalls=0 false_kills=2"


def test_a_failed_trial_is_counted_and_a_rerun_seed_counts_once() -> None:
    trials = parse([*LOG.splitlines(), FAILED, FAILED])
    assert summary(trials) == "campaign_trials=4 failures=1 stalls=0 false_kills=2"
    rows = {line.split(" | ")[0].strip("| "): line for line in table(trials).splitlines()}
    # columns: kind, the shapes (sorted), then done, restart->done, FAIL, STALL, trials
    assert rows["kind"] == "| kind | 3d-tp2+recycle | hsdp+recycle | recycle | spare | done | restart->done | FAIL | " \
                           "STALL | trials |"
    assert rows["phase"] == "| phase | 0 | 0 | 0 | 1 | 0 | 0 | 1 | 0 | 1 |"
    assert rows["all"] == "| all | 1 | 1 | 1 | 1 | 2 | 1 | 1 | 0 | 4 |"


def test_the_command_reads_several_logs(tmp_path, capsys) -> None:
    (tmp_path / "a.log").write_text(LOG)
    (tmp_path / "b.log").write_text(FAILED + "\n")
    assert main([str(tmp_path / "a.log"), str(tmp_path / "b.log")]).startswith("campaign_trials=4 failures=1")
    assert "| all |" in capsys.readouterr().out
