"""The report's figure (matplotlib, drawn on the Agg canvas without pyplot: no display, no global state), saved as
a PNG or as one self-contained HTML page (the PNG inlined as base64, the text summary beside it).

The panel helpers (:func:`plot_loss_curves`, :func:`plot_loss_differences`, :func:`mark_events`,
:func:`save_figure`) are what the benchmarks' figures use too.
"""

from __future__ import annotations

import base64
import html
import io
import math
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Mapping

from nanotron_recover.report.quotas import quota_series
from nanotron_recover.report.summary import loss_differences, microbatch_check
from nanotron_recover.report.timeline import Marker, RunTimeline

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# kind -> (colour, line style, symbol, legend text)
MARKER_STYLES: dict[str, tuple[str, str, str, str]] = {
    "fault": ("tab:red", "-", "x", "fault fired"),
    "hang": ("tab:purple", "--", "v", "hang detected"),
    "repair": ("tab:orange", ":", "o", "repair"),
    "repair_without_failure": ("tab:gray", ":", "o", "repair without failure"),
    "spare_activated": ("tab:green", "-.", "^", "spare activated"),
    "replica_formed": ("tab:cyan", "-.", "D", "replica formed"),
    "pool_changed": ("tab:olive", ":", ".", "pool changed"),
    "stopped": ("black", "-", "s", "stopped (requeue)"),
    "resume": ("tab:blue", "--", ">", "relaunch resumed"),
}
REPAIR_PHASES = ("detect_ms", "revoke_ms", "shrink_ms", "agree_ms", "rebuild_ms")
DPI = 110


def new_figure(rows: int, cols: int = 1, width: float = 11.0, row_height: float = 2.6) -> tuple["Figure", list]:
    """A figure on the Agg canvas and its axes (flat list), without pyplot's global figure registry."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, row_height * rows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    return fig, [ax for row in axes for ax in row]


def save_figure(fig: "Figure", path: Path, title: str = "", text: str = "") -> Path:
    """``path`` ending in ``.png``: the PNG; ``.html``: one page holding the PNG (base64) and ``text``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    suffix = path.suffix.lower()
    if suffix == ".png":
        fig.savefig(path, dpi=DPI)
    elif suffix in (".html", ".htm"):
        path.write_text(html_page(png_bytes(fig), title or path.stem, text), encoding="utf-8")
    else:
        raise ValueError(f"--out {path}: the report is written as .png or .html")
    return path


def png_bytes(fig: "Figure") -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()


def html_page(png: bytes, title: str, text: str) -> str:
    """A page with no outside reference (air-gapped clusters): the image inline, the summary as preformatted text."""
    image = base64.b64encode(png).decode("ascii")
    return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>" + html.escape(title) + "</title>"
            "<style>body{font-family:sans-serif;margin:1em}pre{background:#f6f6f6;padding:1em}</style></head>"
            f"<body><h1>{html.escape(title)}</h1><img alt=\"report\" src=\"data:image/png;base64,{image}\">"
            f"<pre>{html.escape(text)}</pre></body></html>\n")


# ------------------------------------------------------------------------------------------------ panels
def plot_loss_curves(ax: "Axes", curves: Mapping[str, Mapping[int, float]], title: str = "loss per step") -> None:
    """One line per named {step: loss}; the first drawn thick and pale, so that an identical second shows."""
    styles = ["-", "--", "-.", ":", (0, (3, 1, 1, 1))]
    for i, (name, losses) in enumerate(curves.items()):
        steps = sorted(losses)
        wide = {"lw": 3.0, "alpha": 0.45} if i == 0 and len(curves) > 1 else {"lw": 1.3}
        ax.plot(steps, [losses[s] for s in steps], linestyle=styles[i % len(styles)], color=f"C{i}", label=name,
                **wide)
    ax.set(xlabel="step", ylabel="loss", title=title)


def plot_loss_differences(ax: "Axes", curves: Mapping[str, Mapping[int, float]], reference: str) -> None:
    """|loss - reference loss| per common step of every other curve (log scale; an exact match sits on the floor)."""
    ref = curves[reference]
    for i, (name, losses) in enumerate(curves.items()):  # colour C<i>: as in plot_loss_curves of the same curves
        if name == reference:
            continue
        deltas = loss_differences(dict(losses), dict(ref))
        ax.plot(list(deltas), [max(d, 1e-12) for d in deltas.values()], marker="o", markersize=2, linewidth=0.8,
                color=f"C{i}", label=name)
    ax.set_yscale("log")
    ax.set(xlabel="step", ylabel="|Δloss|", title=f"|loss - {reference}| per step (1e-12: identical)")


def mark_events(ax: "Axes", markers: Iterable[Marker], symbols: bool = True) -> None:
    """A vertical line per marker (its kind's colour and style), its symbol near the top of the panel (stacked
    downwards where several share a step), and one legend entry per kind."""
    seen: set[str] = set()
    stacked: dict[float, int] = {}
    top = ax.get_xaxis_transform()
    for m in markers:
        colour, style, symbol, text = MARKER_STYLES.get(m.kind, ("black", ":", ".", m.kind))
        ax.axvline(m.x, color=colour, linestyle=style, linewidth=0.9, alpha=0.8)
        if symbols:
            level = stacked[m.x] = stacked.get(m.x, -1) + 1
            ax.plot([m.x], [0.95 - 0.07 * level], marker=symbol, color=colour, transform=top, linestyle="none",
                    label=text if m.kind not in seen else None)
        seen.add(m.kind)


# ------------------------------------------------------------------------------------------------ the report
def _legend(ax: "Axes", **options: object) -> None:
    """A legend when the panel has labelled lines (an empty run has none)."""
    if ax.get_legend_handles_labels()[1]:
        ax.legend(fontsize=7, **options)


def _loss_panel(ax: "Axes", tl: RunTimeline, compare: RunTimeline | None) -> None:
    curves = {f"this run ({tl.run_dir.name})": tl.losses()}
    if compare is not None:
        curves = {f"--compare ({compare.run_dir.name})": compare.losses(), **curves}
    plot_loss_curves(ax, curves, title="loss per step (final trajectory), every fault and recovery marked")
    replayed = [p for p in tl.replayed if p.loss is not None]
    if replayed:
        ax.plot([p.step for p in replayed], [p.loss for p in replayed], "o", color="tab:gray", markersize=3,
                label="replayed (lost with its launch)")
    mark_events(ax, tl.markers)
    _legend(ax, ncol=3, loc="best")


def _delta_panel(ax: "Axes", tl: RunTimeline, compare: RunTimeline) -> None:
    plot_loss_differences(ax, {"--compare": compare.losses(), "this run": tl.losses()}, reference="--compare")
    mark_events(ax, tl.markers, symbols=False)


def _step_time_panel(ax: "Axes", tl: RunTimeline) -> None:
    for launch in tl.launches:
        mine = [p for p in tl.records if p.launch == launch.index]
        ax.plot([p.step for p in mine], [p.step_time_s * 1e3 for p in mine], marker="o", markersize=2,
                label=f"launch {launch.index}")
    mark_events(ax, tl.markers, symbols=False)
    ax.set_yscale("log")
    ax.set(xlabel="step", ylabel="ms", title="step time (every record, replays included)")
    _legend(ax)


def _replicas_panel(ax: "Axes", tl: RunTimeline) -> None:
    points = [p for p in tl.final if p.live_replicas is not None]
    ax.step([p.step for p in points], [p.live_replicas for p in points], where="mid", label="live replicas")
    pooled = [p for p in tl.final if p.pool_size is not None]
    if pooled:
        ax.step([p.step for p in pooled], [p.pool_size for p in pooled], where="mid", label="ranks in the pool")
    mark_events(ax, tl.markers, symbols=False)
    ax.set(xlabel="step", ylabel="count", title="live replicas (computing) and pool size (recycling)")
    ax.set_ylim(bottom=0)
    ax.yaxis.get_major_locator().set_params(integer=True)
    _legend(ax)


def _quota_panel(ax: "Axes", tl: RunTimeline) -> None:
    """Microbatches per computing replica (a line per replica id) and their sum, the committed count."""
    series, logged = quota_series(tl, microbatch_check(tl)[0])
    steps = sorted(series)
    replicas = sorted({r for q in series.values() for r in q}, key=lambda r: int(r) if r.isdigit() else 0)
    for i, r in enumerate(replicas):
        # a replica that does not compute a step has no quota there: a gap, not a 0; the lower ids drawn wider,
        # so that replicas with equal quotas all show
        ax.step(steps, [series[s].get(r, math.nan) for s in steps], where="mid", label=f"replica {r}",
                linewidth=1.2 + 2.5 * (len(replicas) - 1 - i) / max(1, len(replicas) - 1), alpha=0.75)
    ax.step([p.step for p in tl.final], [p.microbatches or 0 for p in tl.final], where="mid", color="black",
            linewidth=0.8, linestyle="--", label="committed (all replicas)")
    if not series:
        ax.text(0.5, 0.5, "no quotas: none logged, and M is unknown", ha="center", transform=ax.transAxes)
    how = "logged" if logged else "re-planned by the workload planner from M and the repair events (not logged)"
    mark_events(ax, tl.markers, symbols=False)
    ax.set(xlabel="step", ylabel="microbatches", title=f"each replica's quota per step ({how})")
    ax.set_ylim(bottom=0)
    ax.yaxis.get_major_locator().set_params(integer=True)
    _legend(ax, ncol=4)


def _repair_panel(ax: "Axes", tl: RunTimeline) -> None:
    """A stacked bar per repair event: detection, then revoke, shrink, agree, rebuild."""
    if not tl.repairs:
        ax.text(0.5, 0.5, "no repair events", ha="center", transform=ax.transAxes)
    x = list(range(len(tl.repairs)))
    bottom = [0.0] * len(x)
    for phase in REPAIR_PHASES:
        values = [getattr(r, phase) for r in tl.repairs]
        ax.bar(x, values, bottom=bottom, width=0.6, label=phase.removesuffix("_ms"))
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(x, [f"L{r.launch} s{r.step}\n{r.phase}" + ("*" if r.kind != "repair" else "") for r in tl.repairs],
                  fontsize=7)
    ax.set_xlim(-0.75, max(len(x), 6) - 0.25)  # a lone event stays a bar, not a wall
    ax.set(ylabel="ms", title="detect + repair latency per repair event (L launch, s step; * without a failure)")
    _legend(ax, ncol=5)


def draw_report(tl: RunTimeline, compare: RunTimeline | None = None) -> "Figure":
    """The report's figure: loss (and |Δloss| with ``compare``), step time, replicas and pool, quotas, repairs."""
    panels = [lambda ax: _loss_panel(ax, tl, compare)]
    if compare is not None:
        panels.append(lambda ax: _delta_panel(ax, tl, compare))
    panels += [lambda ax: _step_time_panel(ax, tl), lambda ax: _replicas_panel(ax, tl),
               lambda ax: _quota_panel(ax, tl), lambda ax: _repair_panel(ax, tl)]
    fig, axes = new_figure(len(panels))
    for draw, ax in zip(panels, axes):
        draw(ax)
    xs = [p.step for p in tl.records] + [m.x for m in tl.markers]
    if xs:
        for ax in axes[:-1]:  # the repair panel has its own axis (one bar per event)
            ax.set_xlim(min(xs) - 1, max(xs) + 1)
    fig.suptitle(f"nanotron-recover report: {tl.run_dir}", fontsize=10)
    return fig


def render_report(tl: RunTimeline, out: Path, compare: RunTimeline | None = None, text: str = "") -> Path:
    """Draw and save the report (PNG or HTML, by ``out``'s suffix)."""
    fig = draw_report(tl, compare)
    return save_figure(fig, out, title=f"nanotron-recover report: {tl.run_dir}", text=text)
