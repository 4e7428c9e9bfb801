"""Exits while an abandoned Gloo op is still running: the exit drain's deadline wait against none, same run.

Each child builds 2-rank Gloo pairs (ranks as threads), issues all_reduces on both ranks, aborts one rank at a random
moment and the other after it, until a pair's backend stays busy after its abort -- an op Gloo's socket cut does not
end (its data was still queued: it waits out its own timeout; docs/comms.md, "the gap") -- then exits with code 3.
The op's timeout is chosen to end just after the 5 s exit drain (``--timeouts``), inside the interpreter's
finalization. Two arms, alternated child by child:

* ``deadline`` (torchnext's behaviour): the exit waits for the graves' op deadlines when within ``EXIT_WAIT_MAX``;
* ``none`` (``EXIT_WAIT_MAX = 0``, the behaviour before): the exit gives up after the 5 s drain.

A child that exits -6 (SIGABRT: "terminate called after throwing an instance of 'gloo::IoException'") crashed on its
way out; 3 is a clean exit; 4 means no pair hit the gap (the child says so and does not count)::

    python benchmarks/comms/stress_exit_gap.py --children 12 --timeouts 5.6 6.2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time

_CHILD = textwrap.dedent("""
    import os, random, sys, threading, time
    import torch, torch.distributed as dist
    import torchnext.comms.reaper as reaper_module
    from torchnext.comms import Communicator
    from torchnext.comms.reaper import reaper

    timeout, seed, arm = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    if arm == "none":
        reaper_module.EXIT_WAIT_MAX = 0.0
    rng = random.Random(seed)

    def pair(name):
        store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
        other = dist.TCPStore("127.0.0.1", store.port, 2, False)
        comms = [None, None]
        def build(r):
            comms[r] = Communicator([store, other][r], r, 2, name=name, timeout=timeout)
        ts = [threading.Thread(target=build, args=(r,)) for r in range(2)]
        [t.start() for t in ts]; [t.join(30) for t in ts]
        return comms

    for i in range(200):
        comms = pair(f"gap{i}")
        n = rng.choice([8, 1024, 65536, 1 << 20])
        stop = threading.Event()
        def issue(c):
            try:
                while not stop.is_set():
                    c.all_reduce(torch.ones(n))
            except Exception:
                pass
        ts = [threading.Thread(target=issue, args=(c,)) for c in comms]
        [t.start() for t in ts]
        time.sleep(rng.uniform(0.0, 0.05))
        comms[rng.randrange(2)].abort("stress"); stop.set()
        [t.join(5) for t in ts]
        for c in comms:
            c.abort("stress")
        time.sleep(0.3)
        if any(g.busy() for g in reaper().graves()):
            print(f"gap after {i + 1} pair(s)", file=sys.stderr, flush=True)
            sys.exit(3)
    sys.exit(4)
""")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--children", type=int, default=12, help="children per arm (default 12)")
    ap.add_argument("--timeouts", type=float, nargs="+", default=[5.6, 6.2],
                    help="op timeouts in seconds, used in turn (default 5.6 6.2: just past the 5 s exit drain)")
    ap.add_argument("--json", help="write the counts here")
    args = ap.parse_args()
    import torch

    print(f"torch {torch.__version__}, python {sys.version.split()[0]}, {os.cpu_count()} cpus, "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    counts: dict[str, dict[str, int]] = {"deadline": {}, "none": {}}
    seconds: dict[str, list[float]] = {"deadline": [], "none": []}
    for i in range(args.children):
        for arm in ("deadline", "none") if i % 2 == 0 else ("none", "deadline"):
            timeout = args.timeouts[i % len(args.timeouts)]
            t0 = time.monotonic()
            proc = subprocess.run([sys.executable, "-c", _CHILD, str(timeout), str(i), arm], capture_output=True,
                                  text=True, timeout=300)
            code = str(proc.returncode)
            if code == "3":
                seconds[arm].append(time.monotonic() - t0)
            counts[arm][code] = counts[arm].get(code, 0) + 1
            aborted = "terminate called" in proc.stderr
            print(f"child {i:3d} {arm:8s} timeout {timeout:.1f} s: exit {code}{' (terminate called)' if aborted else ''}",
                  flush=True)
    for arm in ("deadline", "none"):
        c = counts[arm]
        crashed = sum(n for code, n in c.items() if code not in ("3", "4"))
        gapped = sum(c.values()) - c.get("4", 0)
        print(f"{arm:8s}: {crashed} of {gapped} exits with an abandoned op crashed; exit codes {c}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"counts": counts, "seconds_clean": seconds, "timeouts": args.timeouts}, f, indent=1)


if __name__ == "__main__":
    main()
