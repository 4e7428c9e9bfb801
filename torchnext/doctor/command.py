"""``torchnext doctor``: print the environment, torchnext's backends and the known hazards that apply here.

Exit status: 0 normally; with ``--strict``, 1 when a warning or critical hazard applies (for CI gates and cluster
prologues; info hazards are printed but never fail the gate).
"""

from __future__ import annotations

import argparse
import json
import sys

from torchnext.doctor.report import build_report

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json", action="store_true", help="print the report as JSON (stable schema) instead of tables"
    )
    parser.add_argument(
        "--strict", action="store_true", help="exit with status 1 when a warning or critical hazard applies"
    )


def run(args: argparse.Namespace) -> int:
    report = build_report()
    if args.json:
        json.dump(report.to_json(), sys.stdout, indent=2, sort_keys=False, default=str)
        sys.stdout.write("\n")
    else:
        from rich.console import Console

        from torchnext.doctor.render import render

        render(report, Console())
    return 1 if args.strict and report.gating else 0
