"""The shared figure code: the panels the report and the benchmarks draw with, and PNG / HTML output."""

from __future__ import annotations

import pytest

from nanotron_recover.report.figure import new_figure, plot_loss_curves, plot_loss_differences, save_figure

CURVES = {"reference": {1: 8.0, 2: 7.0, 3: 6.0}, "recover": {1: 8.0, 2: 7.0 + 2e-7, 3: 6.0}}


def test_loss_panels_and_both_formats(tmp_path):
    fig, (loss, delta) = new_figure(2)
    plot_loss_curves(loss, CURVES)
    plot_loss_differences(delta, CURVES, reference="reference")
    (line,) = delta.get_lines()
    assert list(line.get_ydata()) == pytest.approx([1e-12, 2e-7, 1e-12], rel=1e-3)  # identical steps on the floor
    png = save_figure(fig, tmp_path / "f.png")
    page = save_figure(fig, tmp_path / "f.html", title="t <1>", text="a & b").read_text()
    assert png.read_bytes()[:4] == b"\x89PNG" and "t &lt;1&gt;" in page and "a &amp; b" in page
    with pytest.raises(ValueError, match=".png or .html"):
        save_figure(fig, tmp_path / "f.svg")


def test_the_benchmarks_loss_and_progress_figure_uses_them(tmp_path):
    from benchmarks.lib.report import plot_loss_and_progress

    path = tmp_path / "compare.png"
    plot_loss_and_progress({n: (c, [(0.0, 0.0), (1.0, 10.0)]) for n, c in CURVES.items()}, path, "a title")
    assert path.stat().st_size > 10_000
