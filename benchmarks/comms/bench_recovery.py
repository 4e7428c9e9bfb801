"""Fault-tolerance benchmark: recovery time by failure position, healing throughput, replacement start-up, per-step
overhead, and a soak for wrongly removed members -- all at the default settings.

    python benchmarks/comms/bench_recovery.py                 # 30 reps per position, 20 s soak
    python benchmarks/comms/bench_recovery.py --reps 5 --soak 10 --heal-mib 32

One job of 4 member processes (torch preloaded by a forkserver) and an in-process coordinator is reused for all
repetitions: each repetition makes one member fail (it SIGKILLs itself between steps or inside the all_reduce on
SIGUSR2, or the benchmark SIGSTOPs it), waits until every survivor committed a step in the reduced generation,
launches a replacement and waits until it is back to 4 members. Times are ``time.monotonic()`` marks (system-wide
clock) from the victim, the coordinator and every survivor:

* detect   = coordinator records the failure        - failure (self-kill mark / SIGSTOP sent)
* agree    = coordinator pushes the new generation   - detect
* rebuild  = last survivor has built the Communicator - agree
* commit   = last survivor committed a step           - rebuild
* total    = last survivor committed a step           - failure          (goal: p50 <= 100 ms, p99 <= 300 ms)

Peers: torch 2.14.1's native ``dist._reconfigure`` is measured by ``bench_native_reconfigure.py`` (it is not in
torch 2.13); torchft 0.2.0 figures measured on this machine are quoted in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from torchnext.ft import Coordinator, CoordinatorConfig, MembershipConfig
from torchnext.testing.ft_workload import FTJob, WorkerSpec, overhead_worker

N = 4


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[k]


def _row(name: str, xs: list[float]) -> str:
    ms = [x * 1e3 for x in xs]
    return f"| {name} | {len(ms)} | {_pct(ms, 50):.1f} | {_pct(ms, 99):.1f} | {max(ms) if ms else float('nan'):.1f} |"


# ------------------------------------------------------------------------------------------------ recovery runs
def recovery(reps: int, heal_mib: float) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="ftbench")
    fault_log = os.path.join(tmp, "faults")
    event_log = os.path.join(tmp, "events")
    stop_file = os.path.join(tmp, "stop")
    positions = ["idle", "collective", "sigstop"]
    records: list[dict[str, Any]] = []
    replacements: list[tuple[int, float]] = []
    next_id = 100
    with Coordinator(CoordinatorConfig(membership=MembershipConfig(min_size=2, initial_size=N))) as coord, \
            FTJob() as job:

        def spec(member: int) -> WorkerSpec:
            return WorkerSpec(coordinator=coord.address, token=coord.token, member_id=member, steps=0,
                              stop_file=stop_file, signal_kills=True, fault_log=fault_log, event_log=event_log,
                              state_mib=heal_mib, step_sleep_s=0.0)

        for m in range(N):
            job.launch(spec(m))
        assert coord.wait_until(lambda c: c.step >= 3, 120), "job did not start"
        for pos in positions:
            for _ in range(reps):
                members = list(coord.members)
                victim = members[len(records) % len(members)]
                gen0 = coord.generation
                time.sleep(0.05)
                pid = job.pid(victim)
                if pos == "sigstop":
                    t_fail = time.monotonic()
                    os.kill(pid, signal.SIGSTOP)
                else:  # the victim kills itself at its next idle point / inside its next all_reduce
                    os.kill(pid, signal.SIGUSR2 if pos == "idle" else signal.SIGRTMIN)
                    t_fail = float("nan")
                assert coord.wait_until(lambda c, v=victim: v not in c.members, 10), f"{victim} not removed"
                if pos == "sigstop":
                    os.kill(pid, signal.SIGKILL)
                records.append({"pos": pos, "victim": victim, "gen0": gen0, "t_fail": t_fail})
                t_launch = time.monotonic()
                job.launch(spec(next_id))
                replacements.append((next_id, t_launch))
                next_id += 1
                assert coord.wait_until(lambda c: len(c.members) == N, 60), "replacement did not join"
                s0 = coord.step
                assert coord.wait_until(lambda c, s=s0: c.step >= s + 3, 30)
        with open(stop_file, "w") as fh:
            fh.write(str(coord.step + 5))
        reports = job.wait(sorted(job.procs), timeout=120)
        history = coord.history()
    return {"records": records, "reports": reports, "history": history, "fault_log": fault_log, "event_log": event_log,
            "replacements": replacements}


def analyse(run: dict[str, Any]) -> dict[str, dict[str, list[float]]]:
    history = run["history"]
    kills: dict[int, float] = {}
    if os.path.exists(run["fault_log"]):
        with open(run["fault_log"]) as fh:
            for line in fh:
                t, m = line.split()
                kills[int(m)] = float(t)
    gens = {h["gen"]: h for h in history if h["event"] == "generation"}
    built: dict[int, float] = {}
    first_commit: dict[int, float] = {}
    with open(run["event_log"]) as fh:
        for line in fh:
            ev = json.loads(line)
            g = ev["gen"]
            if ev["built"] is not None:
                built[g] = max(built.get(g, 0.0), ev["built"])
            first_commit[g] = max(first_commit.get(g, 0.0), ev["commit"])
    out: dict[str, dict[str, list[float]]] = {}
    for rec in run["records"]:
        victim = rec["victim"]
        fail = next(h for h in history if h["event"] == "failure" and h["member"] == victim)
        t_fail = rec["t_fail"] if rec["pos"] == "sigstop" else kills.get(victim, float("nan"))
        new_gen = next(g for g, h in sorted(gens.items()) if g > rec["gen0"] and victim not in h["members"])
        t_gen = gens[new_gen]["at"]
        if new_gen not in built or new_gen not in first_commit:
            continue
        d = out.setdefault(rec["pos"], {k: [] for k in ("detect", "agree", "rebuild", "commit", "total")})
        d["detect"].append(fail["at"] - t_fail)
        d["agree"].append(t_gen - fail["at"])
        d["rebuild"].append(built[new_gen] - t_gen)
        d["commit"].append(first_commit[new_gen] - built[new_gen])
        d["total"].append(first_commit[new_gen] - t_fail)
    return out


# ------------------------------------------------------------------------------------------------ healing vs raw
def _raw_sender(port: int, nbytes: int) -> None:
    buf = bytearray(nbytes)
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(buf)


def raw_socket_gbps(nbytes: int) -> float:
    import multiprocessing as mp

    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    p = mp.get_context("fork").Process(target=_raw_sender, args=(port, nbytes))
    p.start()
    conn, _ = srv.accept()
    t0 = time.perf_counter()  # the sender is connected and streaming: process start-up is not counted
    buf = bytearray(nbytes)
    view = memoryview(buf)
    got = 0
    while got < nbytes:
        n = conn.recv_into(view[got:], min(nbytes - got, 4 << 20))
        if n == 0:
            break
        got += n
    dt = time.perf_counter() - t0
    p.join()
    conn.close()
    srv.close()
    return got / dt / 1e9


# ------------------------------------------------------------------------------------------------ per-step overhead
def step_overhead(steps: int, compute_s: float) -> tuple[float, float, float]:
    """Medians (plain step, fault-tolerant step, its commit round trip) in seconds; same processes, interleaved."""
    with Coordinator(CoordinatorConfig(membership=MembershipConfig(min_size=1, initial_size=N))) as coord, \
            FTJob() as job:
        for m in range(N):
            job.launch(WorkerSpec(coordinator=coord.address, token=coord.token, member_id=m, steps=steps,
                                  compute_s=compute_s), overhead_worker)
        reports = job.wait(list(range(N)), timeout=600)
    plain = [x for r in reports.values() for x in r["plain"]]
    ft = [x for r in reports.values() for x in r["ft"]]
    commit = [x for r in reports.values() for x in r["commit"]]
    return statistics.median(plain), statistics.median(ft), statistics.median(commit)


# ------------------------------------------------------------------------------------------------ soak
def _burner(stop: Any) -> None:
    x = 0
    while not stop.is_set():
        x += 1


def soak(seconds: float) -> dict[str, Any]:
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    stop = ctx.Event()
    burners = [ctx.Process(target=_burner, args=(stop,), daemon=True) for _ in range(os.cpu_count() or 2)]
    for b in burners:
        b.start()
    try:
        tmp = tempfile.mkdtemp(prefix="ftsoak")
        stop_file = os.path.join(tmp, "stop")
        with Coordinator(CoordinatorConfig(membership=MembershipConfig(min_size=2, initial_size=N))) as coord, \
                FTJob() as job:
            for m in range(N):
                job.launch(WorkerSpec(coordinator=coord.address, token=coord.token, member_id=m, steps=0,
                                      stop_file=stop_file, compute_s=0.005))
            assert coord.wait_until(lambda c: c.step >= 1, 120)
            time.sleep(seconds)
            with open(stop_file, "w") as fh:
                fh.write(str(coord.step + 5))
            job.wait(list(range(N)), timeout=120)
            history = coord.history()
            steps = coord.step
            stalls = coord.stalls
    finally:
        stop.set()
        for b in burners:
            b.join(timeout=10)
            if b.is_alive():
                b.kill()
                b.join()
    wrong = [h for h in history if h["event"] in ("failure", "report") and h.get("why") != "left"]
    return {"wrongly_removed": len(wrong), "steps": steps, "seconds": seconds, "coordinator_stalls": stalls,
            "events": wrong[:5]}


# ------------------------------------------------------------------------------------------------ long chaos
def chaos(n: int, seed: int) -> dict[str, Any]:
    """``n`` random failure schedules on one 4-member job (like the CI chaos test, longer): a random member is
    SIGKILLed, SIGSTOPped (SIGCONT after its removal) or made to raise inside a collective; removed members are
    replaced; the next schedule starts when the group is back to 4. Returns agreement facts at the end."""
    import random

    rng = random.Random(seed)
    tmp = tempfile.mkdtemp(prefix="ftchaos")
    stop_file = os.path.join(tmp, "stop")
    next_id = 100
    kinds: dict[str, int] = {}
    with Coordinator(CoordinatorConfig(membership=MembershipConfig(min_size=2, initial_size=N))) as coord, \
            FTJob() as job:

        def spec(member: int) -> WorkerSpec:
            return WorkerSpec(coordinator=coord.address, token=coord.token, member_id=member, steps=0,
                              stop_file=stop_file, sigusr1_raises=True, step_sleep_s=0.002)

        for m in range(N):
            job.launch(spec(m))
        assert coord.wait_until(lambda c: c.step >= 2, 120)
        for _ in range(n):
            victim = rng.choice(list(coord.members))
            kind = rng.choice(["kill", "kill", "raise", "stop"])
            kinds[kind] = kinds.get(kind, 0) + 1
            time.sleep(rng.uniform(0.02, 0.2))
            gen, pid = coord.generation, job.pid(victim)
            if kind == "raise":
                os.kill(pid, signal.SIGUSR1)
                assert coord.wait_until(lambda c, g=gen: c.generation > g, 30)
            else:
                os.kill(pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
                assert coord.wait_until(lambda c, v=victim: v not in c.members, 30)
                if kind == "stop":
                    os.kill(pid, signal.SIGCONT)
                job.launch(spec(next_id))
                next_id += 1
            assert coord.wait_until(lambda c: len(c.members) == N and c.step > 0, 60)
        with open(stop_file, "w") as fh:
            fh.write(str(coord.step + 10))
        reports = job.wait(sorted(job.procs), timeout=300)
        steps = coord.step
    ok = [r for r in reports.values() if r["error"] is None]
    return {"schedules": n, "kinds": kinds, "committed_steps": steps, "survivors": len(ok),
            "agree": len({(r["generation"], tuple(r["members"]), r["digest"], r["step"]) for r in ok}) == 1,
            "removed_told": sum("you were removed" in (r["error"] or "") for r in reports.values())}


def native_reconfigure_peer() -> str:
    import torch.distributed as dist

    if not hasattr(dist, "_reconfigure"):
        return f"skipped: torch {torch.__version__} has no torch.distributed._reconfigure (added in 2.14.1)"
    return "present: measured by benchmarks/comms/bench_native_reconfigure.py (same failure, native rebuild)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=30, help="repetitions per failure position")
    ap.add_argument("--soak", type=float, default=20.0, help="soak seconds with the CPU fully loaded")
    ap.add_argument("--heal-mib", type=float, default=64.0, help="state carried by each member (MiB)")
    ap.add_argument("--steps", type=int, default=300, help="steps for the per-step overhead runs")
    ap.add_argument("--soak-only", action="store_true", help="run only the soak (e.g. --soak 600 once)")
    ap.add_argument("--chaos", type=int, default=0, help="run only N random failure schedules (e.g. 200)")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, python {platform.python_version()}, {platform.machine()}, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"defaults: {MembershipConfig()}")
    print("peer:", native_reconfigure_peer())

    if args.chaos:
        t0 = time.monotonic()
        print(f"## chaos: {chaos(args.chaos, seed=4321)} ({time.monotonic() - t0:.0f} s)")
        return
    if args.soak_only:
        _print_soak(soak(args.soak))
        return
    t0 = time.monotonic()
    run = recovery(args.reps, args.heal_mib)
    res = analyse(run)
    print(f"\n## recovery at default settings ({time.monotonic() - t0:.0f} s)\n")
    print("| position / phase | n | p50 ms | p99 ms | max ms |\n|---|---|---|---|---|")
    for pos, d in res.items():
        for phase in ("detect", "agree", "rebuild", "commit", "total"):
            print(_row(f"{pos}: {phase}", d[phase]))

    # healing and replacement start-up: from every member's event log (members that died later included)
    events: list[dict[str, Any]] = []
    with open(run["event_log"]) as fh:
        events = [json.loads(line) for line in fh]
    heal = [(e["healed"]["bytes"], e["healed"]["seconds"]) for e in events if e.get("healed")]
    raw = [raw_socket_gbps(int(args.heal_mib * (1 << 20))) for _ in range(3)]
    heal_gbps = [b / s / 1e9 for b, s in heal if s > 0]
    print(f"\n## healing\nreplacements healed: {len(heal)}, bytes each: {heal[0][0] if heal else 0}")
    if heal_gbps:
        print(f"healing throughput (joiner side, incl. checksums) median {statistics.median(heal_gbps):.2f} GB/s; "
              f"raw socket copy of the same bytes median {statistics.median(raw):.2f} GB/s; "
              f"ratio {statistics.median(heal_gbps) / statistics.median(raw):.2f}")
    first = {}
    for e in events:
        first.setdefault(e["member"], e["commit"])
    starts = [first[mid] - t for mid, t in run["replacements"] if mid in first]
    if starts:
        print(f"replacement launch -> first committed step: median {statistics.median(starts) * 1e3:.0f} ms "
              f"(p99 {_pct(starts, 99) * 1e3:.0f} ms, n={len(starts)}; forkserver with torch preloaded; healing "
              f"{args.heal_mib:.0f} MiB included)")

    print("\n## per-step overhead (4 ranks, same processes, interleaved blocks of 20 steps)\n\n"
          "| compute | plain Communicator step ms | FaultTolerant step ms | overhead ms | of which commit ms |\n"
          "|---|---|---|---|---|")
    for compute in (0.0, 0.020):
        p, f, c = step_overhead(args.steps, compute)
        print(f"| {compute * 1e3:.0f} ms | {p * 1e3:.3f} | {f * 1e3:.3f} | {(f - p) * 1e3:+.3f} | {c * 1e3:.3f} |")

    _print_soak(soak(args.soak))


def _print_soak(s: dict[str, Any]) -> None:
    print(f"\n## soak: {s['seconds']:.0f} s, CPU fully loaded ({os.cpu_count()} busy loops), {s['steps']} steps: "
          f"{s['wrongly_removed']} live members wrongly removed; coordinator stalls forgiven: "
          f"{s['coordinator_stalls']} {s['events']}")


if __name__ == "__main__":
    sys.exit(main())
