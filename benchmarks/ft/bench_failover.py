"""Coordinator failover and partitions: how long the job stops, at the default settings.

    python benchmarks/ft/bench_failover.py                      # 20 coordinator kills, 3 restarts, 10 partitions
    python benchmarks/ft/bench_failover.py --soak-s 600         # + a 10-minute soak at full CPU load
    python benchmarks/ft/bench_failover.py --only soak --soak-s 60

* **failover**: one job of 4 member processes with two coordinator addresses A and B (``torchnext coordinator``
  processes). Each round SIGKILLs the coordinator in office; the standby takes over from the members' reports;
  then a new standby is started at the dead one's address (``--standby``, same port) for the next round.
  latency = last member's first commit after the kill - the kill (``time.monotonic()``, one clock for all
  processes). Goal: p50 <= 1 s.
* **peer, same run**: what a coordinator death cost before failover -- the job ends and is restarted: a fresh
  coordinator process and 4 fresh members (forkserver, torch preloaded) until every member committed its first
  step. ratio = failover / restart.
* **partition** (root only: network namespaces, :mod:`torchnext.testing.netns`): members on 4 hosts, the
  coordinator and the standby on two more; each round takes one member's link down and measures until the
  survivors were told the generation without it (their ``interrupt`` mark); then the link comes back and a
  replacement on that host rejoins by healing. Goal: <= 1 s.
* **soak** (``--soak-s``): 4 members, a coordinator and a standby, plus one busy loop per core; counts live members
  removed and failovers (both must be 0).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

from torchnext.testing.coordinators import CoordinatorProcess
from torchnext.testing.ft_workload import FTJob, WorkerSpec, check_commit_logs

N = 4
TOKEN = "bench-failover-token"


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def _row(name: str, xs: list[float]) -> str:
    ms = [x * 1e3 for x in xs]
    return (f"| {name} | {len(ms)} | {_pct(ms, 50):.1f} | {_pct(ms, 99):.1f} | "
            f"{(max(ms) if ms else float('nan')):.1f} |")


def _ended_well(r: dict[str, Any]) -> bool:
    """No error, or JobFinished (another member finished first: this one stopped at the finished step)."""
    return r["error"] is None or r["error"].startswith("JobFinished")


def _next_commit(reports: dict[int, dict[str, Any]], members: list[int], t: float) -> float | None:
    """When every one of ``members`` had committed a step after ``t`` (None if one never did)."""
    firsts = []
    for m in members:
        after = [c[2] for c in reports[m]["commits"] if c[2] > t]
        if not after:
            return None
        firsts.append(min(after))
    return max(firsts)


# ------------------------------------------------------------------------------------------------- failover
def failover(rounds: int) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="ftfailover")
    stop = os.path.join(tmp, "stop")
    a = CoordinatorProcess(TOKEN, initial_size=N, min_size=1).start()
    b = CoordinatorProcess(TOKEN, standby=True).start()
    ports = {"A": int(a.address.rsplit(":", 1)[1]), "B": int(b.address.rsplit(":", 1)[1])}
    coords = {"A": a, "B": b}
    office, spare = "A", "B"
    kills: list[float] = []
    try:
        with FTJob() as job:
            addresses = f"{a.address},{b.address}"
            for m in range(N):
                job.launch(WorkerSpec(coordinator=addresses, token=TOKEN, member_id=m, steps=0, stop_file=stop,
                                      step_sleep_s=0.005, finish=True))
            time.sleep(3.0)  # joined and training
            for _ in range(rounds):
                time.sleep(0.5)  # some steps in office
                kills.append(coords[office].kill())
                # the standby takes over; a new standby at the dead coordinator's address for the next round
                time.sleep(0.3)
                coords[office].close()
                coords[office] = CoordinatorProcess(TOKEN, port=ports[office], standby=True).start()
                office, spare = spare, office
            time.sleep(1.0)
            with open(stop, "w") as fh:
                fh.write("0")  # every member stops at its next step boundary
            reports = job.wait(list(range(N)), timeout=120)
    finally:
        for c in coords.values():
            c.close()
    errors = {m: r["error"] for m, r in reports.items() if not _ended_well(r)}
    lat = [x - k for k in kills if (x := _next_commit(reports, list(range(N)), k)) is not None]
    survivors = check_commit_logs(reports, survivors=[m for m in reports if m not in errors])
    return {"latency": lat, "kills": len(kills), "errors": errors, "survivors": survivors,
            "steps": max(r["step"] for r in reports.values())}


def restart_peer(reps: int) -> list[float]:
    """Time to the first commit of a job started from scratch (coordinator process + 4 fresh members)."""
    out = []
    for _ in range(reps):
        t0 = time.monotonic()
        with CoordinatorProcess(TOKEN, initial_size=N, min_size=1) as c, FTJob() as job:
            for m in range(N):
                job.launch(WorkerSpec(coordinator=c.address, token=TOKEN, member_id=m, steps=1))
            reports = job.wait(list(range(N)), timeout=120)
        firsts = [r["commits"][0][2] for r in reports.values() if r["commits"]]
        if len(firsts) == N:
            out.append(max(firsts) - t0)
    return out


# ------------------------------------------------------------------------------------------------ partition
def partition(rounds: int) -> dict[str, Any]:
    from torchnext.testing.netns import NetLab, available

    ok, why = available()
    if not ok:
        return {"skipped": why}
    tmp = tempfile.mkdtemp(prefix="ftpartition")
    stop = os.path.join(tmp, "stop")
    cuts: list[tuple[float, int]] = []
    with NetLab(N + 2) as lab:
        a = CoordinatorProcess(TOKEN, host=lab.address(N), initial_size=N, min_size=1, prefix=lab.prefix(N)).start()
        b = CoordinatorProcess(TOKEN, host=lab.address(N + 1), standby=True, prefix=lab.prefix(N + 1)).start()
        with a, b, FTJob() as job:
            addresses = f"{a.address},{b.address}"
            on_host = {m: m for m in range(N)}

            def spec(member: int, host: int) -> WorkerSpec:
                return WorkerSpec(coordinator=addresses, token=TOKEN, member_id=member, steps=0, stop_file=stop,
                                  step_sleep_s=0.005, netns=lab.netns(host), failover_timeout_s=3.0, finish=True)

            for m in range(N):
                job.launch(spec(m, m))
            time.sleep(3.0)
            next_id = 100
            for r in range(rounds):
                victim = sorted(on_host)[r % N]
                host = on_host.pop(victim)
                time.sleep(0.5)
                cuts.append((time.monotonic(), victim))
                lab.isolate([host])
                time.sleep(1.5)  # removed meanwhile (the figure comes from the survivors' marks)
                lab.reconnect([host])
                job.wait_exited([victim], 30)
                job.launch(spec(next_id, host))
                on_host[next_id] = host
                next_id += 1
                time.sleep(2.0)  # the replacement joins and heals
            time.sleep(1.0)
            with open(stop, "w") as fh:
                fh.write("0")
            reports = job.wait(sorted(job.procs), timeout=120)
    removal = []
    for t, victim in cuts:
        marks = [rc["timings"]["interrupt"] for r in reports.values() if r["error"] is None or r["member"] != victim
                 for rc in r["reconfigurations"] if victim not in rc["members"] and "interrupt" in rc["timings"]
                 and rc["timings"]["interrupt"] > t]
        if marks:
            removal.append(min(marks) - t)
    live = [m for m, r in reports.items() if _ended_well(r)]
    check_commit_logs(reports, survivors=live)
    return {"removal": removal, "cuts": len(cuts), "survivors": live,
            "errors": {m: r["error"][:80] for m, r in reports.items() if not _ended_well(r)}}


# ---------------------------------------------------------------------------------------------------- soak
def soak(seconds: float) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="ftsoak")
    stop = os.path.join(tmp, "stop")
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    load: list[float] = []
    try:
        with CoordinatorProcess(TOKEN, initial_size=N, min_size=1) as a, \
                CoordinatorProcess(TOKEN, standby=True) as b, FTJob() as job:
            addresses = f"{a.address},{b.address}"
            for m in range(N):
                job.launch(WorkerSpec(coordinator=addresses, token=TOKEN, member_id=m, steps=0, stop_file=stop,
                                      step_sleep_s=0.0, compute_s=0.002, finish=True))
            t0 = time.monotonic()
            while time.monotonic() - t0 < seconds:
                time.sleep(min(10.0, max(0.0, seconds - (time.monotonic() - t0))))
                load.append(os.getloadavg()[0])
            with open(stop, "w") as fh:
                fh.write("0")
            reports = job.wait(list(range(N)), timeout=120)
            took_office = "took office" in b.output() + a.output()
    finally:
        for p in burners:
            p.kill()
            p.wait()
    removed = [m for m, r in reports.items() if not _ended_well(r)]
    reconfigs = sum(len(r["reconfigurations"]) - 1 for r in reports.values())
    return {"seconds": seconds, "removed": removed, "extra_generations": reconfigs, "failovers": int(took_office),
            "steps": max(r["step"] for r in reports.values()), "load_max": max(load or [0.0]),
            "load_median": statistics.median(load or [0.0])}


# ----------------------------------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20, help="coordinator kills (default 20)")
    ap.add_argument("--restarts", type=int, default=3, help="restart-from-scratch peer repetitions (default 3)")
    ap.add_argument("--partitions", type=int, default=10, help="partition rounds (default 10; needs root)")
    ap.add_argument("--soak-s", type=float, default=0.0, help="soak duration in seconds (0: no soak)")
    ap.add_argument("--only", choices=["failover", "partition", "soak"], default=None)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    print(f"# bench_failover  {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")
    print(f"# torch {torch.__version__}, python {platform.python_version()}, {platform.machine()}, "
          f"{os.cpu_count()} cpus, load average {os.getloadavg()[0]:.2f}")
    print(f"# command: {' '.join([os.path.basename(sys.argv[0]), *sys.argv[1:]])}")
    out: dict[str, Any] = {}
    print("| measurement | n | p50 ms | p99 ms | max ms |\n|---|---|---|---|---|")
    if args.only in (None, "failover"):
        fo = failover(args.rounds)
        out["failover"] = fo
        print(_row("coordinator SIGKILL -> next committed step (all 4 members)", fo["latency"]))
        if args.restarts:
            peer = restart_peer(args.restarts)
            out["restart"] = peer
            print(_row("peer: job restarted from scratch -> first committed step", peer))
            if fo["latency"] and peer:
                print(f"# ratio failover / restart (p50): {_pct(fo['latency'], 50) / _pct(peer, 50):.3f}")
        print(f"# failover: {fo['kills']} kills, {fo['steps']} steps, survivors {fo['survivors']}, "
              f"errors {fo['errors'] or 'none'}; commit logs replay exactly")
    if args.only in (None, "partition") and args.partitions:
        pa = partition(args.partitions)
        out["partition"] = pa
        if "skipped" in pa:
            print(f"# partition: skipped ({pa['skipped']})")
        else:
            print(_row("link down -> survivors told the generation without the cut-off member", pa["removal"]))
            print(f"# partition: {pa['cuts']} cuts, survivors {pa['survivors']}; commit logs replay exactly")
    if args.soak_s > 0 and args.only in (None, "soak"):
        so = soak(args.soak_s)
        out["soak"] = so
        print(f"# soak {so['seconds']:.0f} s, {os.cpu_count()} busy loops + 4 members + coordinator + standby: "
              f"{len(so['removed'])} live members removed, {so['failovers']} failovers, "
              f"{so['extra_generations']} extra generations, {so['steps']} steps; load average median "
              f"{so['load_median']:.1f}, max {so['load_max']:.1f}")
    print(f"# load average at the end {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
