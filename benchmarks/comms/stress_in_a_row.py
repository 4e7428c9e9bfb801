"""Run a pytest selection N times in a row beside CPU burners; stop at the first failure.

For the failures that show only under load (a correct rank's SIGABRT at exit, a thread still winding down): issue
#24 asks ``tests/comms/flight_recorder/test_fr_mismatch.py`` to pass 50 times in a row beside two burners::

    python benchmarks/comms/stress_in_a_row.py --runs 50 --burners 2 -- tests/comms/flight_recorder/test_fr_mismatch.py

Run it from a snapshot of the tree (``git worktree add --detach``) when the checkout may change meanwhile: every run
imports the package afresh. Each run's line: time, exit code, seconds, 1-minute load, pytest's last line; the log
of a failed run is kept (``--logs``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--burners", type=int, default=2, help="busy-looping processes beside the runs (default 2)")
    ap.add_argument("--logs", default="stress-logs", help="where a failed run's output is kept")
    ap.add_argument("pytest_args", nargs="+", help="what pytest runs (after --)")
    args = ap.parse_args()
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.burners)]
    passed = 0
    try:
        for i in range(1, args.runs + 1):
            t0 = time.monotonic()
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args.pytest_args],
                                  capture_output=True, text=True)
            last = (proc.stdout.strip().splitlines() or [""])[-1]
            print(f"{time.strftime('%H:%M:%S')} run {i} exit {proc.returncode} {time.monotonic() - t0:.0f} s "
                  f"load {os.getloadavg()[0]:.1f}: {last}", flush=True)
            if proc.returncode != 0:
                (logs / f"run{i}.log").write_text(proc.stdout + proc.stderr)
                break
            passed += 1
    finally:
        for b in burners:
            b.kill()
            b.wait(10)
    print(f"{passed} of {args.runs} in a row passed beside {args.burners} burner(s)")
    sys.exit(0 if passed == args.runs else 1)


if __name__ == "__main__":
    main()
