"""Import cost of the comms core (issue #25: "importing the core loads none of its extensions").

    python benchmarks/comms/bench_import.py [--reps 9] [--baseline DIR] [--json out.json]

Each case is a fresh interpreter (``python -c``) that first imports torch and ``torch.distributed`` (untimed: every
case needs them), then times its own import statement: wall time and the process's CPU time (``process_time``: the
figure a loaded machine disturbs least). Cases are interleaved round by round; medians. ``--baseline DIR`` runs the
same cases against the torchnext source tree in ``DIR`` too (e.g. a worktree of an older commit), in the same
rounds: the peer. Also printed: which comms extensions each case loaded (``sys.modules``) -- the core must load none.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import statistics
import subprocess
import sys

CASES = {
    "torchnext.comms.communicator": "import torchnext.comms.communicator",
    "torchnext.comms": "import torchnext.comms",
    "torchnext.comms + FlightRecorder": "import torchnext.comms; torchnext.comms.FlightRecorder",
    "torchnext.comms.process_group": "import torchnext.comms.process_group",
}
EXTENSIONS = ("flight_recorder", "window", "consistency", "process_group", "native")

_PROBE = """
import time, sys
import torch, torch.distributed
t0, c0 = time.perf_counter(), time.process_time()
{stmt}
dt, dc = time.perf_counter() - t0, time.process_time() - c0
import torchnext
loaded = sorted({{m.split('.')[2] for m in sys.modules if m.startswith('torchnext.comms.') and m.count('.') >= 2}})
print(repr((dt, dc, loaded, torchnext.__file__)))
"""


def one(stmt: str, tree: str | None) -> tuple[float, float, list[str]]:
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = tree
    out = subprocess.run([sys.executable, "-c", _PROBE.format(stmt=stmt)], capture_output=True, text=True,
                         timeout=300, check=True, env=env, cwd=tree or os.getcwd())
    dt, dc, loaded, where = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    if tree is not None and not str(where).startswith(os.path.abspath(tree)):
        raise RuntimeError(f"--baseline {tree}: imported torchnext from {where}")
    return float(dt), float(dc), list(loaded)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--baseline", help="a torchnext source tree to compare against in the same rounds")
    ap.add_argument("--json", help="also write the figures to this JSON file")
    args = ap.parse_args()
    print(f"python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f}; {args.reps} rounds, cases interleaved")
    trees: dict[str, str | None] = {"this tree": None}
    if args.baseline:
        trees["baseline"] = args.baseline
    times: dict[tuple[str, str], list[tuple[float, float]]] = {(t, n): [] for t in trees for n in CASES}
    loaded: dict[tuple[str, str], list[str]] = {}
    for _ in range(args.reps):
        for name, stmt in CASES.items():
            for tree, where in trees.items():
                dt, dc, mods = one(stmt, where)
                times[(tree, name)].append((dt, dc))
                loaded[(tree, name)] = mods
    figures: dict[str, object] = {}
    print(f"\n{'case (on top of torch.distributed)':36} {'tree':10} {'wall s':>7} {'CPU s':>7}  extensions loaded")
    for name in CASES:
        for tree in trees:
            wall = statistics.median(x[0] for x in times[(tree, name)])
            cpu = statistics.median(x[1] for x in times[(tree, name)])
            ext = [m for m in loaded[(tree, name)] if m in EXTENSIONS]
            figures[f"{tree}: {name}"] = {"wall_s": wall, "cpu_s": cpu, "extensions": ext}
            print(f"{name:36} {tree:10} {wall:7.3f} {cpu:7.3f}  {', '.join(ext) or '-'}")
        if args.baseline:
            new = statistics.median(x[1] for x in times[("this tree", name)])
            old = statistics.median(x[1] for x in times[("baseline", name)])
            print(f"{'':36} {'ratio':10} CPU this/baseline {new / old:.2f}")
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
