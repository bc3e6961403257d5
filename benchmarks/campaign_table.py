"""The tally of one or more fault campaigns, from their logs: trials per kind and shape, and their outcomes.

``benchmarks/fault_campaign.py`` prints one line per trial (its seed first) and a tally of that campaign alone.
A campaign stopped early, or several campaigns taken together (other seeds, kinds or recycling settings), are
tallied here from the saved logs:

  python benchmarks/campaign_table.py benchmarks/results/campaign_*.log

Prints a markdown table (a row per kind: trials per shape, then per outcome) and, last, one line
``campaign_trials=N failures=F stalls=S false_kills=K``.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

if __package__ in (None, ""):  # run as ``python benchmarks/X.py``: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.lib.campaign import KINDS  # noqa: E402

_LINE = re.compile(r"seed +(?P<seed>\d+) +(?P<shape>\S+) +(?P<kind>\S+) +(?P<outcome>\S+) +launches (?P<launches>\d+)"
                   r" .*\] (?P<verdict>ok|FAILED: .*?)(?: false kills: (?P<kills>.*))?$")
OUTCOMES = ("done", "restart->done", "FAIL", "STALL")  # always columns; others (person->done, ...) when seen


@dataclass(frozen=True)
class TrialLine:
    seed: int
    shape: str
    kind: str
    outcome: str
    ok: bool
    false_kills: int


def parse(lines: Iterable[str]) -> list[TrialLine]:
    """The trial lines of campaign logs (anything else is skipped); a seed seen twice counts once (the last)."""
    trials: dict[int, TrialLine] = {}
    for line in lines:
        m = _LINE.match(line.strip())
        if m is None:
            continue
        kills = m["kills"]
        n_kills = len(re.findall(r"rank \d+ (?:silent|stuck)", kills)) if kills else 0
        trials[int(m["seed"])] = TrialLine(int(m["seed"]), m["shape"], m["kind"], m["outcome"],
                                           m["verdict"] == "ok", n_kills)
    return list(trials.values())


def table(trials: Sequence[TrialLine]) -> str:
    shapes = sorted({t.shape for t in trials})
    by_shape = Counter((t.kind, t.shape) for t in trials)
    by_outcome = Counter((t.kind, t.outcome) for t in trials)
    outcomes = [*OUTCOMES[:2], *sorted({t.outcome for t in trials} - set(OUTCOMES)), *OUTCOMES[2:]]
    head = ["kind", *shapes, *outcomes, "trials"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    kinds = [k for k in KINDS if any(t.kind == k for t in trials)] + sorted({t.kind for t in trials} - set(KINDS))
    for kind in kinds:
        cells = [str(by_shape.get((kind, s), 0)) for s in shapes]
        cells += [str(by_outcome.get((kind, o), 0)) for o in outcomes]
        lines.append(f"| {kind} | " + " | ".join(cells) + f" | {sum(1 for t in trials if t.kind == kind)} |")
    totals = [str(sum(1 for t in trials if t.shape == s)) for s in shapes]
    totals += [str(sum(1 for t in trials if t.outcome == o)) for o in outcomes]
    lines.append("| all | " + " | ".join(totals) + f" | {len(trials)} |")
    return "\n".join(lines)


def summary(trials: Sequence[TrialLine]) -> str:
    failures = sum(1 for t in trials if t.outcome == "FAIL" or (not t.ok and t.outcome != "STALL"))
    stalls = sum(1 for t in trials if t.outcome == "STALL")
    return (f"campaign_trials={len(trials)} failures={failures} stalls={stalls} "
            f"false_kills={sum(t.false_kills for t in trials)}")


def main(argv: Sequence[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", nargs="+", type=Path)
    args = ap.parse_args(argv)
    trials = parse(line for log in args.logs for line in log.read_text().splitlines())
    print(table(trials))
    line = summary(trials)
    print(line)
    return line


if __name__ == "__main__":
    main()
