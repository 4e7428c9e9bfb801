"""``torchnext fr analyze DIR [--json] [--allow-pickle] [--timeline out.png|out.html] [--fail-on-issues]``.

Exit codes: 0 when the analysis ran (whatever it found), 2 on unusable input (no folder, no usable dump, a timeline
that cannot be drawn), 1 with ``--fail-on-issues`` when issues were found.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["add_arguments", "run"]

EXIT_OK, EXIT_ISSUES, EXIT_UNUSABLE = 0, 1, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="fr_command", metavar="ACTION", required=True)
    p = sub.add_parser("analyze", help="diagnose a hang or desync from a folder of Flight Recorder dumps")
    p.add_argument("dir", metavar="DIR", help="folder holding one dump per rank (ours: JSON/pickle; PyTorch's)")
    p.add_argument("--json", action="store_true", help="print the stable JSON report instead of text")
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="also read pickle dumps (unpickling can run code; a restricted unpickler is used)",
    )
    p.add_argument("--timeline", metavar="OUT", help="draw a timeline: OUT.png (needs matplotlib) or OUT.html")
    p.add_argument("--fail-on-issues", action="store_true", help="exit 1 when issues are found")
    p.add_argument(
        "--straggler-ms", type=float, default=500.0, help="report ranks entering a collective later than this (ms)"
    )


def run(args: argparse.Namespace) -> int:
    from torchnext.comms.flight_recorder.analysis import analyze
    from torchnext.comms.flight_recorder.loader import DumpFormatError, load_dir

    try:
        dumps, problems = load_dir(args.dir, allow_pickle=args.allow_pickle)
    except DumpFormatError as exc:
        print(f"torchnext fr analyze: {exc}", file=sys.stderr)
        return EXIT_UNUSABLE
    if not dumps:
        for p in problems:
            print(f"torchnext fr analyze: {p.path}: {p.message}", file=sys.stderr)
        print(f"torchnext fr analyze: no usable Flight Recorder dump in {args.dir}", file=sys.stderr)
        return EXIT_UNUSABLE
    report = analyze(dumps, problems=problems, straggler_ms=args.straggler_ms)
    if args.json:
        print(json.dumps(report.to_json(), indent=2, default=str))
    else:
        _print_text(report)
    if args.timeline:
        from torchnext.comms.flight_recorder.timeline import TimelineError, render_timeline

        try:
            out = render_timeline(report, args.timeline)
        except TimelineError as exc:
            print(f"torchnext fr analyze: {exc}", file=sys.stderr)
            return EXIT_UNUSABLE
        print(f"timeline written to {out}", file=sys.stderr)
    if args.fail_on_issues and report.issues:
        return EXIT_ISSUES
    return EXIT_OK


def _frames_text(frames: list[dict[str, Any]], limit: int = 8) -> str:
    return "\n".join(f"    {f.get('name')} at {f.get('filename')}:{f.get('line')}" for f in frames[:limit])


def _print_text(report: Any) -> None:
    """Readable report. Every string that comes from a dump is escaped: dumps carry arbitrary text (error
    messages with ``[...]``), which rich would otherwise read as markup."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    console = Console(highlight=False, soft_wrap=True)
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    for p in report.problems:
        tag = "skipped" if p.skipped else "warning"
        err.print(f"[yellow]{tag}:[/] {escape(p.path)}: {escape(p.message)}")
    table = Table(title="Flight Recorder dumps")
    for col in ("rank", "source", "entries", "dropped", "gen", "reason", "host:pid"):
        table.add_column(col, no_wrap=True, min_width=len(col) if col != "reason" else 12)
    for d in report.dumps:
        table.add_row(
            *(Text(str(x)) for x in (d.rank, d.source, len(d.entries), d.dropped, d.generation,
                                     str(d.dump_reason).split(":")[0], f"{d.host}:{d.pid}"))
        )
    console.print(table)
    for d in report.dumps:
        if d.dump_reason and ":" in d.dump_reason:
            console.print(Text(f"rank {d.rank} dumped on {d.dump_reason}", style="dim"))
    if report.ranks_without_dump:
        console.print(f"[red]ranks without a dump:[/] {report.ranks_without_dump}")
    for g in report.generations:
        style = {"failure": "bold red", "reconfigured": "cyan"}.get(g.outcome, "dim")
        head, *rest = g.message.splitlines()
        console.print(Text(head, style=style))
        for line in rest:
            console.print(Text(f"   {line}"))
    if not report.issues:
        failed = any(g.outcome == "failure" for g in report.generations)
        console.print("[green]no hang or mismatch found in the recorded collectives[/]" if failed
                      else "[green]no issues found[/]")
    for i, issue in enumerate(report.issues, 1):
        colour = "yellow" if issue.kind in ("straggler", "dtype_mismatch") else "red"
        console.print(f"[bold {colour}]{i}. {issue.kind}[/] {escape(issue.message)}")
        if issue.kind == "missing_ranks":
            for r, where in issue.detail.get("missing", {}).items():
                if not where.get("dump"):
                    console.print(f"   rank {r}: no dump (process dead, or its dump failed)")
                    continue
                stack = where.get("stack") or []
                console.print(Text(f"   rank {r} stack at dump time ({where.get('dump_reason')}):"))
                if stack:
                    console.print(Text(_frames_text(stack)))
    for key, last in report.last_completed.items():
        if last is None:
            console.print(Text(f"last completed on {key!r}: none"))
        else:
            console.print(Text(f"last completed on {key!r}: {last['op']} #{last['seq']} (generation {last['generation']})"))
    for n in report.notes:
        console.print(Text(f"note: {n}", style="dim"))
