"""``nanotron-recover report RUN_DIR [--compare OTHER_RUN_DIR] [--out FILE.png|FILE.html]``: the text summary on
stdout, the figure in a file. ``python -m nanotron_recover.report`` runs the same."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from nanotron_recover.report.records import ReportError, read_run_records
from nanotron_recover.report.summary import format_summary, summarize
from nanotron_recover.report.timeline import RunTimeline, build_timeline
from nanotron_recover.run.exit_codes import EXIT_BAD_INPUT, EXIT_DONE

DEFAULT_FIGURE = "report.png"
FIGURE_SUFFIXES = (".png", ".html", ".htm")


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    """The report's options, for ``nanotron-recover report`` and ``python -m nanotron_recover.report``."""
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (--run-dir of the training run)")
    parser.add_argument("--compare", metavar="OTHER_RUN_DIR",
                        help="another run (e.g. the failure-free one): its loss overlaid, |Δloss| per step")
    parser.add_argument("--out", metavar="FILE.png|FILE.html",
                        help=f"where the figure goes: a PNG, or one self-contained HTML page (default "
                             f"RUN_DIR/{DEFAULT_FIGURE})")
    parser.add_argument("--config-file", metavar="CONFIG",
                        help="the run's config, for M and train_steps (default: RUN_DIR/config.yaml if there, else "
                             "M from the newest checkpoint)")


def load_timeline(run_dir: str | Path, config_file: str | Path | None = None) -> RunTimeline:
    """A run folder's timeline (``ReportError`` if there is no such folder)."""
    return build_timeline(read_run_records(Path(run_dir), Path(config_file) if config_file else None))


def run_report(args: argparse.Namespace) -> int:
    """Print the summary, write the figure; 2 (bad input) when a run folder or the output name is unusable."""
    out = Path(args.out) if args.out else Path(args.run_dir) / DEFAULT_FIGURE
    if out.suffix.lower() not in FIGURE_SUFFIXES:
        print(f"nanotron-recover report: --out {out}: the figure is written as .png or .html", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        timeline = load_timeline(args.run_dir, args.config_file)
        other = load_timeline(args.compare) if args.compare else None
    except ReportError as e:
        print(f"nanotron-recover report: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    text = format_summary(summarize(timeline, other))
    print(text, flush=True)
    from nanotron_recover.report.figure import render_report  # matplotlib: only when a figure is drawn

    render_report(timeline, out, compare=other, text=text)
    print(f"figure: {out}")
    return EXIT_DONE


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanotron_recover.report",
                                     description="What happened to a run and what it cost, from its run folder: "
                                                 "a text summary on stdout and a figure (PNG or HTML).")
    add_report_arguments(parser)
    return run_report(parser.parse_args(argv))
