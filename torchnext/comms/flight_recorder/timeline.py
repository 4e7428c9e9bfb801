"""Timeline pictures of Flight Recorder dumps: one row per rank, one bar per recorded op coloured by state, the
hang point marked, failed and aborted ops and ``abort()`` calls marked with a cross, and a dotted line where each
new generation of a rebuilt communicator formed. PNG needs matplotlib (optional dependency, ``pip install torchnext[plot]``); HTML is a single
self-contained file (inline SVG, no scripts, no network)."""

from __future__ import annotations

import html
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchnext.comms.flight_recorder.analysis import Report

__all__ = ["STATE_COLORS", "Bar", "Mark", "TimelineError", "render_timeline", "timeline_bars", "timeline_marks"]

STATE_COLORS = {
    "completed": "#4caf50",
    "started": "#ff9800",
    "scheduled": "#9e9e9e",
    "error": "#e53935",
    "timed_out": "#b71c1c",
    "aborted": "#8e24aa",
}


class TimelineError(RuntimeError):
    """The timeline cannot be drawn (unknown file type, matplotlib missing, nothing to draw)."""


@dataclass(frozen=True, kw_only=True)
class Bar:
    rank: int
    start_s: float
    end_s: float
    state: str
    label: str
    open_ended: bool


def timeline_bars(report: Report) -> tuple[list[Bar], float | None, str]:
    """Bars (seconds from the earliest record), the hang time (or None) and the hang label."""
    t0 = min((e["time_created_ns"] for d in report.dumps for e in d.entries), default=None)
    if t0 is None:
        raise TimelineError("nothing to draw: the dumps hold no entries")
    t_end = max(
        [e.get("time_discovered_completed_ns") or e["time_created_ns"] for d in report.dumps for e in d.entries]
        + [d.time_dumped_ns or 0 for d in report.dumps]
    )
    bars = []
    for d in report.dumps:
        end_default = d.time_dumped_ns or t_end
        for e in d.entries:
            done = e.get("time_discovered_completed_ns")
            seq = e["p2p_seq_id"] if e["is_p2p"] else e["collective_seq_id"]
            bars.append(
                Bar(
                    rank=d.rank,
                    start_s=(e["time_created_ns"] - t0) / 1e9,
                    end_s=((done or end_default) - t0) / 1e9,
                    state=str(e["state"]),
                    label=f"{e['op']} #{seq} ({e['pg']}, {e['state']})",
                    open_ended=done is None,
                )
            )
    hang = report.hang_point
    hang_s = None
    label = ""
    if hang is not None:
        times = hang.detail.get("entered_time_ns") or {}
        if times:
            hang_s = (min(times.values()) - t0) / 1e9
        label = f"hang: {hang.op} #{hang.seq} on {hang.pg}, missing ranks {hang.ranks}"
    return bars, hang_s, label


@dataclass(frozen=True, kw_only=True)
class Mark:
    """A point on the timeline: ``rank`` None for a vertical line across every rank (a generation boundary)."""

    rank: int | None
    t_s: float
    kind: str
    """``generation`` (a new generation formed), ``abort`` (``abort()`` was called), or the state of a failed op
    (``error``, ``timed_out``, ``aborted``)."""
    label: str


_FAILED = ("error", "timed_out", "aborted")


def timeline_marks(report: Report) -> list[Mark]:
    """Generation boundaries, ``abort()`` calls and failed ops, in seconds from the earliest record."""
    t0 = min((e["time_created_ns"] for d in report.dumps for e in d.entries), default=None)
    if t0 is None:
        return []
    marks: list[Mark] = []
    first: dict[str, tuple[int, int, list[int]]] = {}
    for d in report.dumps:
        for key, g in d.groups.items():
            if g.time_added_ns is not None and (key not in first or g.time_added_ns < first[key][0]):
                first[key] = (g.time_added_ns, g.generation, list(g.ranks))
    lowest = min((gen for _, gen, _ in first.values()), default=0)
    for key, (t, gen, ranks) in sorted(first.items(), key=lambda kv: kv[1][0]):
        if gen > lowest and t >= t0:
            marks.append(Mark(rank=None, t_s=(t - t0) / 1e9, kind="generation",
                              label=f"generation {gen} ({key}): members {ranks}"))
    for d in report.dumps:
        for ev in d.events:
            if ev["kind"] == "abort":
                marks.append(Mark(rank=d.rank, t_s=(ev["time_ns"] - t0) / 1e9, kind="abort",
                                  label=f"abort() of {ev['pg']}: {ev['reason'] or 'no reason given'}"))
        for e in d.entries:
            if e["state"] in _FAILED:
                done = e.get("time_discovered_completed_ns") or e["time_created_ns"]
                seq = e["p2p_seq_id"] if e["is_p2p"] else e["collective_seq_id"]
                marks.append(Mark(rank=d.rank, t_s=(done - t0) / 1e9, kind=str(e["state"]),
                                  label=f"{e['op']} #{seq} ({e['pg']}) {e['state']}: {e.get('error') or ''}"))
    return marks


_MARK_COLORS = {"generation": "#455a64", "abort": "#6a1b9a", **{k: STATE_COLORS[k] for k in _FAILED}}


def _ranks(report: Report) -> list[int]:
    return sorted({d.rank for d in report.dumps} | set(report.ranks_without_dump))


def _render_png(report: Report, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise TimelineError(
            "a PNG timeline needs matplotlib, which is not installed: pip install 'torchnext[plot]' "
            "(or ask for an .html timeline, which needs nothing)"
        ) from None
    bars, hang_s, label = timeline_bars(report)
    ranks = _ranks(report)
    row = {r: i for i, r in enumerate(ranks)}
    fig, ax = plt.subplots(figsize=(13, 1.6 + 0.6 * len(ranks)))
    for b in bars:
        width = max(b.end_s - b.start_s, 1e-4)
        ax.broken_barh([(b.start_s, width)], (row[b.rank] - 0.35, 0.7), color=STATE_COLORS.get(b.state, "#607d8b"))
    culprits = set(report.hang_point.ranks) if report.hang_point else set()
    if hang_s is not None:
        ax.axvline(hang_s, color="red", linestyle="--", linewidth=1.5)
        ax.text(hang_s, -0.45, label, color="red", fontsize=8, va="bottom")
    for m in timeline_marks(report):
        colour = _MARK_COLORS.get(m.kind, "#607d8b")
        if m.rank is None:
            ax.axvline(m.t_s, color=colour, linestyle=":", linewidth=1.5)
            ax.text(m.t_s, len(ranks) - 0.4, f" {m.label}", color=colour, fontsize=7, va="top", rotation=0)
        elif m.rank in row:
            ax.plot([m.t_s], [row[m.rank]], marker="x" if m.kind == "abort" else "v", color=colour, markersize=9,
                    markeredgewidth=2, linestyle="none")
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels(
        [f"rank {r}" + (" (no dump)" if r in report.ranks_without_dump else "") + (" !" if r in culprits else "")
         for r in ranks]
    )
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first recorded op")
    ax.set_title("torchnext Flight Recorder timeline", pad=16)
    from matplotlib.lines import Line2D

    handles: list[Any] = [Patch(color=c, label=s) for s, c in STATE_COLORS.items()]
    handles += [Line2D([], [], color=_MARK_COLORS["abort"], marker="x", linestyle="none", label="abort()"),
                Line2D([], [], color=STATE_COLORS["error"], marker="v", linestyle="none", label="op failed"),
                Line2D([], [], color=_MARK_COLORS["generation"], linestyle=":", label="new generation")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, borderaxespad=0)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _render_html(report: Report, path: Path) -> None:
    bars, hang_s, label = timeline_bars(report)
    ranks = _ranks(report)
    row = {r: i for i, r in enumerate(ranks)}
    t_max = max([b.end_s for b in bars] + [m.t_s for m in timeline_marks(report)] + [hang_s or 0.0, 1e-3])
    left, width, row_h, top = 140, 1000, 28, 30
    scale = width / t_max
    height = top + row_h * len(ranks) + 40
    culprits = set(report.hang_point.ranks) if report.hang_point else set()
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 20}" height="{height}" '
        f'font-family="monospace" font-size="12">'
    ]
    for r, i in row.items():
        y = top + i * row_h
        name = f"rank {r}" + (" (no dump)" if r in report.ranks_without_dump else "") + (" !" if r in culprits else "")
        colour = "red" if r in culprits else "black"
        parts.append(f'<text x="4" y="{y + row_h * 0.65:.1f}" fill="{colour}">{html.escape(name)}</text>')
        parts.append(f'<line x1="{left}" y1="{y + row_h}" x2="{left + width}" y2="{y + row_h}" stroke="#eee"/>')
    for b in bars:
        x = left + b.start_s * scale
        w = max((b.end_s - b.start_s) * scale, 1.0)
        y = top + row[b.rank] * row_h + 4
        colour = STATE_COLORS.get(b.state, "#607d8b")
        parts.append(
            f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{row_h - 8}" fill="{colour}">'
            f"<title>{html.escape(b.label)}</title></rect>"
        )
    for m in timeline_marks(report):
        colour = _MARK_COLORS.get(m.kind, "#607d8b")
        x = left + min(m.t_s, t_max) * scale
        if m.rank is None:
            parts.append(f'<line x1="{x:.2f}" y1="{top - 4}" x2="{x:.2f}" y2="{height - 30}" stroke="{colour}" '
                         f'stroke-dasharray="2,3" stroke-width="2"><title>{html.escape(m.label)}</title></line>')
            parts.append(f'<text x="{x + 3:.2f}" y="{height - 32}" fill="{colour}">{html.escape(m.label)}</text>')
        elif m.rank in row:
            ym = top + row[m.rank] * row_h + row_h / 2
            parts.append(f'<text x="{x - 5:.2f}" y="{ym + 5:.1f}" fill="{colour}" font-weight="bold">'
                         f'{"✕" if m.kind == "abort" else "▼"}<title>{html.escape(m.label)}</title></text>')
    if hang_s is not None:
        x = left + hang_s * scale
        parts.append(f'<line x1="{x:.2f}" y1="{top - 10}" x2="{x:.2f}" y2="{height - 30}" stroke="red" '
                     f'stroke-dasharray="5,3" stroke-width="2"/>')
        parts.append(f'<text x="{min(x, left + width - 300):.2f}" y="{top - 14}" fill="red">{html.escape(label)}</text>')
    parts.append(
        f'<text x="{left}" y="{height - 8}">0 s</text><text x="{left + width - 80}" y="{height - 8}">{t_max:.3f} s</text>'
    )
    parts.append("</svg>")
    legend = " ".join(
        f'<span style="background:{c};padding:2px 6px;margin-right:4px">{html.escape(s)}</span>'
        for s, c in STATE_COLORS.items()
    )
    doc = (
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>torchnext Flight Recorder timeline</title></head>"
        "<body><h2>torchnext Flight Recorder timeline</h2>"
        f"<p>{legend}</p>{''.join(parts)}"
        f"<p>{html.escape(label) if label else 'no hang point found'}</p></body></html>\n"
    )
    path.write_text(doc, encoding="utf-8")


_RENDERERS: dict[str, Callable[[Report, Path], None]] = {".png": _render_png, ".html": _render_html, ".htm": _render_html}


def render_timeline(report: Report, path: str | os.PathLike[str]) -> Path:
    """Draw the timeline into ``path``; its suffix picks the renderer (``.png`` or ``.html``)."""
    p = Path(path)
    renderer = _RENDERERS.get(p.suffix.lower())
    if renderer is None:
        raise TimelineError(f"timeline file {str(p)!r}: unknown type {p.suffix!r}; use .png or .html")
    p.parent.mkdir(parents=True, exist_ok=True)
    renderer(report, p)
    return p
