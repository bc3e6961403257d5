"""``run_report``: the summary on stdout, a non-trivial PNG or HTML figure; bad input is exit 2."""

from __future__ import annotations

import argparse
import base64
import re
import struct
import subprocess
import sys
from pathlib import Path

from nanotron_recover.report.cli import add_report_arguments, run_report

PNG_HEADER = b"\x89PNG\r\n\x1a\n"


def report(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_report_arguments(parser)
    return run_report(parser.parse_args(list(argv)))


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from the IHDR chunk."""
    assert data[:8] == PNG_HEADER and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_the_png_report_is_written_and_the_summary_printed(relaunched_run, tmp_path, capsys):
    out = tmp_path / "figures" / "report.png"
    assert report(str(relaunched_run.run_dir), "--out", str(out)) == 0
    data = out.read_bytes()
    width, height = png_size(data)
    assert len(data) > 10_000 and (width, height) == (1210, 1430), (len(data), width, height)  # 11 x 13 in at 110 dpi
    printed = capsys.readouterr().out
    assert "steps replayed after relaunches: 2 (3, 4)" in printed and f"figure: {out}" in printed
    assert "exit records (the last launch's: a relaunch overwrites them): 4 x code 0" in printed


def test_the_html_report_holds_the_figure_and_the_summary(relaunched_run, tmp_path):
    out = tmp_path / "report.html"
    other = relaunched_run.run_dir  # compared with itself: |dloss| is 0 on every step
    assert report(str(relaunched_run.run_dir), "--compare", str(other), "--out", str(out)) == 0
    page = out.read_text()
    assert "http" not in page.replace("http-equiv", "")  # self-contained: nothing fetched from outside
    (image,) = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    data = base64.b64decode(image)
    assert len(data) > 10_000 and png_size(data)[1] > png_size(data)[0]  # six panels, taller than wide
    assert "max |dloss| vs --compare run: 0 over 6 common steps" in page


def test_the_default_figure_goes_into_the_run_dir(relaunched_run):
    assert report(str(relaunched_run.run_dir)) == 0
    assert (relaunched_run.run_dir / "report.png").read_bytes()[:8] == PNG_HEADER


def test_bad_input_is_exit_2_with_a_message(tmp_path, capsys):
    assert report(str(tmp_path / "none"), "--out", str(tmp_path / "r.png")) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert report(str(tmp_path), "--out", str(tmp_path / "r.pdf")) == 2
    assert "written as .png or .html" in capsys.readouterr().err


def test_an_empty_run_folder_still_gets_a_report(tmp_path, capsys):
    assert report(str(tmp_path), "--out", str(tmp_path / "r.png")) == 0
    assert "no metrics.jsonl" in capsys.readouterr().out
    assert (tmp_path / "r.png").stat().st_size > 10_000


def test_python_dash_m_runs_the_report(relaunched_run, tmp_path):
    out = tmp_path / "r.png"
    done = subprocess.run([sys.executable, "-m", "nanotron_recover.report", str(relaunched_run.run_dir), "--out",
                           str(out)], capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr
    assert "faults fired (injected/): 2" in done.stdout and out.stat().st_size > 10_000
