"""Long-haul soak (issue 24): one FT-HSDP job and one FT-DDP job survive thousands of seeded faults.

    python benchmarks/ft/bench_soak.py                               # 2000 faults over 30 minutes (the default)
    python benchmarks/ft/bench_soak.py --faults 100 --minutes 3 --warmup-faults 20 --json soak.json
    python benchmarks/ft/bench_soak.py --kinds kill,hang --jobs ddp  # a subset

Jobs (local ranks, forkserver, torch preloaded): FT-HSDP -- ``--hsdp-groups`` replica groups of ``--group-size``
ranks (FSDP2 inside a group, ``ft.device_mesh`` across); FT-DDP -- ``--ddp-members`` processes, each its own group.
Each job has a coordinator in office and a standby, one warm spare (a spare group for HSDP: processes that imported
and built everything and wait to join) refilled after every fault. The seeded schedule spreads ``--faults`` over
``--minutes`` (fault ``i`` at ``(i + U(0,1)) * span / N``, a random job and kind); a fault is injected at its time or
once its job is whole again, whichever is later; the run lasts until both the count and the time are reached.
Kinds: kill (SIGKILL), hang (SIGSTOP, SIGCONT after removal), raise (``PeerFailure`` from inside one rank's
collective during backward), partition (the victim's host's link down; root + network namespaces only, otherwise
skipped and the reason printed), coordinator (SIGKILL of the one in office; the standby takes over; a new standby
is started at the dead one's address). See :mod:`torchnext.testing.soak`.

Checks (printed, in ``--json``; the exit status is 1 when one fails):

* every committed step replays exactly: one generation per step, gap-free logs, DDP weights bitwise equal to the
  replay of the commit record, HSDP Adam step counters equal to the committed step count;
* counterparts bitwise equal across >= 2 replica groups at the end (not made -- and failed -- with fewer);
* the survivor (a member never targeted) has the same thread and fd counts at the end as after the first
  ``--warmup-faults`` faults, RSS within +5 %;
* the survivor's longest gap between two commits <= heartbeat timeout + 1 s;
* every process exits 0, or -9 where it was SIGKILLed (SIGABRT counted apart).

The run uses a private copy of the checkout's ``torchnext`` (``--no-snapshot``: the checkout itself): processes
started an hour in import modules then, and an edit meanwhile would mix two versions of the code in one job. When a
bounded wait runs out, every live member dumps its stacks into ``<workdir>/<job>/stacks-<id>.txt`` and every
coordinator into its log (kept with ``--workdir``).

Recovery = injection -> the survivor's first commit in a generation without the victim (raise, coordinator: in a
newer generation; a raise is injected when it fires -- the signal arms it for the victim's next backward, and the
delay is printed apart); p50/p99/max per job and kind. The survivors' gaps over 1 s are listed with the faults (both
jobs) and the harness's launches that began in them. There is no peer to measure in the same run: the figures are
absolute (bench_parallel.py and bench_failover.py hold the peer comparisons for single faults).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import re
import signal
import statistics
import sys
import time
from typing import Any

import torch

_CHECKOUT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
_SNAPSHOT_ENV = "TORCHNEXT_SOAK_SNAPSHOT"


def _run_from_a_snapshot() -> None:
    """Re-run this script on a private copy of the checkout's ``torchnext`` (unless already on one): a soak lasts an
    hour, and every member, spare and coordinator it starts later imports modules then -- an edit of the checkout
    meanwhile would mix two versions of the code in one job (a spare importing a new ``ft/process_group.py`` over
    a preloaded old base class fails its first step, and the job with it). ``--no-snapshot`` runs the checkout."""
    if os.environ.get(_SNAPSHOT_ENV) or "--no-snapshot" in sys.argv:
        return
    import shutil
    import tempfile

    root = tempfile.mkdtemp(prefix="torchnext-soak-src-")
    shutil.copytree(os.path.join(_CHECKOUT, "torchnext"), os.path.join(root, "torchnext"),
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    env = {**os.environ, _SNAPSHOT_ENV: root,
           "PYTHONPATH": root + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")}
    # `python -c` / `-m` children (the forkserver, the coordinators) put their working directory first on sys.path:
    # run from the snapshot, with the paths given relative to here made absolute
    argv = list(sys.argv[1:])
    for i, a in enumerate(argv):
        if i > 0 and argv[i - 1] in ("--json", "--workdir"):
            argv[i] = os.path.abspath(a)
        elif a.startswith(("--json=", "--workdir=")):
            k, _, v = a.partition("=")
            argv[i] = f"{k}={os.path.abspath(v)}"
    os.chdir(root)
    os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *argv], env)


if __name__ == "__main__":
    _run_from_a_snapshot()
sys.path.insert(0, os.environ.get(_SNAPSHOT_ENV) or _CHECKOUT)  # the snapshot's torchnext (else this checkout's)
from torchnext import __version__  # noqa: E402  (after the path above)
from torchnext.testing.soak import SoakConfig, SoakFault, SoakResult, run_soak  # noqa: E402


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


def report(result: SoakResult) -> None:
    faults = result.faults
    kinds = {k.value: sum(1 for f in faults if f.kind is k) for k in SoakFault}
    print(f"# {len(faults)} faults injected in {result.seconds:.0f} s: "
          f"{', '.join(f'{k} {n}' for k, n in kinds.items() if n)}")
    for kind, why in result.skipped.items():
        print(f"# {kind}: skipped ({why})")
    print("\n| job/fault | n | p50 ms | p99 ms | max ms |\n|---|---|---|---|---|")
    for name, st in result.recovery().items():
        print(f"| {name} | {st['n']:.0f} | {st['p50'] * 1e3:.0f} | {st['p99'] * 1e3:.0f} | {st['max'] * 1e3:.0f} |")
    print("\n| check | result | figures |\n|---|---|---|")
    for name, c in result.checks.items():
        figures = {k: v for k, v in c.items() if k not in ("ok", "base", "end", "problems")}
        if "base" in c and isinstance(c.get("base"), dict) and isinstance(c.get("end"), dict):
            keys = ("threads", "fds", "rss_kib", "faults", "graves", "graves_busy")
            figures["warm-up"] = {k: c["base"][k] for k in keys if k in c["base"]}
            figures["end"] = {k: c["end"][k] for k in keys if k in c["end"]}
        text = "; ".join(f"{k} {_fmt(v)}" for k, v in figures.items())
        if c.get("problems"):
            text += f"; problems {c['problems'][:3]}"
        print(f"| {name} | {'PASS' if c['ok'] else 'FAIL'} | {text} |")
    gaps = result.long_gaps()
    if gaps:
        print(f"\n# the survivors' {len(gaps)} gaps between commits over 1 s, longest first (what began in them, in "
              "both jobs: seconds before the gap's end; the survivor's reconfigurations in them: seconds waited "
              "since the gap began / build / heal / to the commit)\n"
              "| job | gap s | step | faults | harness launches | reconfigurations |\n|---|---|---|---|---|---|")
        for g in gaps[:20]:
            reconf = "; ".join(f"g{r['gen']} {r['reason'] or ''} {r['wait']:.2f}/{r['build']:.2f}/{r['heal']:.2f}/"
                               f"{r['to_commit']:.2f}" for r in g.get("reconfigurations", []))
            print(f"| {g['job']} | {g['gap_s']:.2f} | {g['step']} | {'; '.join(g['faults']) or '-'} | "
                  f"{'; '.join(g['launches']) or '-'} | {reconf or '-'} |")
        _print_gap_summary(gaps)
    for j, rep in result.jobs.items():
        for note in rep.get("anomalies", []):
            print(f"# {j}: harness anomaly: {note}")
    codes: dict[str, int] = {}
    for c in result.exit_codes.values():
        codes[str(c)] = codes.get(str(c), 0) + 1
    print(f"\n# exit codes of {len(result.exit_codes)} processes: {codes}")
    for e in result.errors:
        print(f"# ERROR: {e}")
    print(f"# soak {'PASSED' if result.ok else 'FAILED'}")


def _print_gap_summary(gaps: list[dict[str, Any]]) -> None:
    """Where the long gaps' time went, per job: the median of each phase over the gaps that hold a reconfiguration."""
    for job in sorted({g["job"] for g in gaps}):
        mine = [g for g in gaps if g["job"] == job]
        last = [g["reconfigurations"][-1] for g in mine if g.get("reconfigurations")]
        if not last:
            continue
        med = {k: statistics.median(r[k] for r in last) for k in ("wait", "build", "heal", "to_commit")}
        # grouped by their text with the numbers left out ("member # missed heartbeats for #s (timeout #s)")
        reasons = collections.Counter(re.sub(r"\d+(\.\d+)?", "#", str(r["reason"])).split(":")[0] for r in last)
        print(f"# {job}: {len(last)} of {len(mine)} long gaps end in a reconfiguration; its median phases (s): "
              f"{', '.join(f'{k} {v:.2f}' for k, v in med.items())}; reasons {dict(reasons)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--faults", type=int, default=2000, help="faults in all (default 2000)")
    ap.add_argument("--minutes", type=float, default=30.0, help="the schedule spreads the faults over this (default 30)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", default=",".join(k.value for k in SoakFault),
                    help=f"comma-separated fault kinds (default: all of {[k.value for k in SoakFault]})")
    ap.add_argument("--jobs", default="hsdp,ddp", help="comma-separated: hsdp, ddp (default both)")
    ap.add_argument("--ddp-members", type=int, default=3)
    ap.add_argument("--hsdp-groups", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=2)
    ap.add_argument("--warmup-faults", type=int, default=100, help="resources are compared from after this many")
    ap.add_argument("--heartbeat-timeout", type=float, default=0.6, help="coordinators' heartbeat timeout (s)")
    ap.add_argument("--step-sleep", type=float, default=0.01, help="sleep per step (s): simulated compute")
    ap.add_argument("--wait", type=float, default=90.0, help="bound on every wait (s)")
    ap.add_argument("--no-netns", action="store_true", help="do not use network namespaces (no partitions)")
    ap.add_argument("--defer-commit", action="store_true",
                    help="members with FaultTolerantConfig(defer_commit=True) (decisions awaited a step later)")
    ap.add_argument("--workdir", default=None, help="keep the logs here (default: a temporary directory, removed)")
    ap.add_argument("--quiet", action="store_true", help="no line per fault")
    ap.add_argument("--no-snapshot", action="store_true",
                    help="run the checkout's code (default: a private copy, so that edits meanwhile cannot mix in)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    print(f"# bench_soak  {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")
    print(f"# torchnext {__version__}, torch {torch.__version__}, python {platform.python_version()}, "
          f"{platform.machine()}, {os.cpu_count()} cpus, load average {os.getloadavg()[0]:.2f}")
    print(f"# command: {' '.join([os.path.basename(sys.argv[0]), *sys.argv[1:]])}", flush=True)
    import torchnext

    print(f"# code: {os.path.dirname(os.path.abspath(torchnext.__file__))}"
          f"{' (a snapshot of ' + _CHECKOUT + ')' if os.environ.get(_SNAPSHOT_ENV) else ''}", flush=True)
    cfg = SoakConfig(faults=args.faults, minutes=args.minutes, seed=args.seed,
                     kinds=[SoakFault(k) for k in args.kinds.split(",") if k],
                     jobs=[j for j in args.jobs.split(",") if j], ddp_members=args.ddp_members,
                     hsdp_groups=args.hsdp_groups, group_size=args.group_size, warmup_faults=args.warmup_faults,
                     heartbeat_timeout_s=args.heartbeat_timeout, step_sleep_s=args.step_sleep, wait_s=args.wait,
                     netns=False if args.no_netns else None, workdir=args.workdir, defer_commit=args.defer_commit,
                     log=None if args.quiet else (lambda s: print(s, flush=True)))
    # SIGTERM, and SIGINT also where the shell started this in the background (it is ignored there), stop the
    # run like Ctrl-C: every process and network namespace is reaped and the figures so far are reported
    def _interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"interrupted by signal {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    result = run_soak(cfg)
    report(result)
    print(f"# load average at the end {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result.to_json(), fh, indent=1)
    return 0 if result.ok else 1


if __name__ == "__main__":
    try:
        rc = main()
    finally:
        snap = os.environ.get(_SNAPSHOT_ENV, "")
        if os.path.basename(snap).startswith("torchnext-soak-src-"):
            import shutil

            shutil.rmtree(snap, ignore_errors=True)
    sys.exit(rc)
