"""PyTorch's distributed test suite (``DistributedTest._DistTestBase``) on torchnext groups and on plain Gloo.

Runs the whole suite (about 280 tests, ~5 s each here) once per (groups, world size) asked for, through
:mod:`torchnext.testing.torch_suite`, and prints the counts and the tests whose outcome differs between the two
kinds of group. The suite keeps its own gating on ``BACKEND == "gloo"``; only the groups it creates change.

    python benchmarks/comms/torch_dist_suite.py [--groups gloo torchnext] [--world-sizes 2 3] [-k EXPR] [--out DIR]

Writes one JUnit XML per run into ``--out`` (default ./torch_suite_results) and a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

import torchnext.testing.torch_suite as harness


def _run(groups: str, world_size: int, expr: str | None, out: Path) -> tuple[dict[str, str], float]:
    junit = out / f"{groups}_ws{world_size}.xml"
    env = {**os.environ, "BACKEND": "gloo", "WORLD_SIZE": str(world_size), "TORCHNEXT_SUITE_GROUPS": groups}
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--timeout", "600",
           f"--junitxml={junit}", harness.__file__]
    if expr:
        cmd += ["-k", expr]
    t0 = time.monotonic()
    subprocess.run(cmd, env=env, check=False)
    return harness.junit_outcomes(junit), time.monotonic() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", nargs="+", default=["gloo", "torchnext"], choices=["gloo", "torchnext"])
    parser.add_argument("--world-sizes", nargs="+", type=int, default=[2, 3])
    parser.add_argument("-k", dest="expr", default=None, help="pytest -k expression (a subset)")
    parser.add_argument("--out", type=Path, default=Path("torch_suite_results"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"torch {torch.__version__}, python {platform.python_version()}, {os.cpu_count()} CPUs, "
          f"{platform.platform()}", flush=True)
    summary: dict[str, object] = {"torch": torch.__version__, "runs": {}}
    results: dict[tuple[str, int], dict[str, str]] = {}
    for ws in args.world_sizes:
        for groups in args.groups:
            outcome, seconds = _run(groups, ws, args.expr, args.out)
            results[(groups, ws)] = outcome
            counts = {k: sum(1 for v in outcome.values() if v == k) for k in ("passed", "skipped", "failed")}
            summary["runs"][f"{groups}/ws{ws}"] = {**counts, "minutes": round(seconds / 60, 1)}  # type: ignore[index]
            print(f"{groups:9s} world size {ws}: {counts} in {seconds / 60:.1f} min", flush=True)
        if {"gloo", "torchnext"} <= set(args.groups):
            a, b = results[("gloo", ws)], results[("torchnext", ws)]
            diff = {name: (a.get(name), b.get(name)) for name in sorted(set(a) | set(b)) if a.get(name) != b.get(name)}
            summary["runs"][f"differences/ws{ws}"] = diff  # type: ignore[index]
            print(f"world size {ws}: {len(diff)} tests differ (gloo -> torchnext)")
            for name, (x, y) in diff.items():
                print(f"  {name}: {x} -> {y}")
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
