"""Import cost of the comms core against torch's own (issue #25: "importing the core loads none of its extensions").

    python benchmarks/comms/bench_import.py [--reps 7] [--json out.json]

Each case is a fresh interpreter (``python -c``), timed from its start to the end of its import statement, cases
interleaved round by round (load drift hits all alike); medians. The peer is ``import torch.distributed`` -- what
every case imports first -- so ``added`` is what torchnext adds on top of torch. It also prints which torchnext
subpackages each case loaded (``sys.modules``): the core must load no extension.
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
    "torch.distributed (peer)": "import torch.distributed",
    "torchnext.comms.communicator": "import torchnext.comms.communicator",
    "torchnext.comms": "import torchnext.comms",
    "torchnext.comms + FlightRecorder": "import torchnext.comms; torchnext.comms.FlightRecorder",
    "torchnext.comms.process_group": "import torchnext.comms.process_group",
}
EXTENSIONS = ("flight_recorder", "window", "consistency", "process_group", "native")

_PROBE = """
import time, sys
t0 = time.perf_counter()
{stmt}
dt = time.perf_counter() - t0
loaded = sorted({{m.split('.')[2] for m in sys.modules if m.startswith('torchnext.comms.') and m.count('.') >= 2}})
print(repr((dt, loaded)))
"""


def one(stmt: str) -> tuple[float, list[str]]:
    out = subprocess.run([sys.executable, "-c", _PROBE.format(stmt=stmt)], capture_output=True, text=True,
                         timeout=300, check=True)
    dt, loaded = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    return float(dt), list(loaded)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", help="also write the figures to this JSON file")
    args = ap.parse_args()
    print(f"python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f}; {args.reps} rounds, cases interleaved")
    times: dict[str, list[float]] = {name: [] for name in CASES}
    loaded: dict[str, list[str]] = {}
    for _ in range(args.reps):
        for name, stmt in CASES.items():
            dt, mods = one(stmt)
            times[name].append(dt)
            loaded[name] = mods
    peer = statistics.median(times["torch.distributed (peer)"])
    figures: dict[str, object] = {}
    print(f"\n{'case':36} {'median s':>9} {'added s':>8}  extensions loaded")
    for name in CASES:
        med = statistics.median(times[name])
        ext = [m for m in loaded[name] if m in EXTENSIONS]
        figures[name] = {"median_s": med, "added_s": med - peer, "extensions": ext, "all_s": times[name]}
        print(f"{name:36} {med:9.3f} {med - peer:+8.3f}  {', '.join(ext) or '-'}")
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
