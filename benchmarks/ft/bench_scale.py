"""Membership at scale (issue 26): the coordinator under thousands of simulated members.

    python benchmarks/ft/bench_scale.py                               # 64, 256, 1024 ranks in groups of 8
    python benchmarks/ft/bench_scale.py --ranks 64 256 1024 4096      # larger sizes are opt-in
    python benchmarks/ft/bench_scale.py --ranks 1024 --group-size 8 --json
    python benchmarks/ft/bench_scale.py --ranks 1024 --profile /tmp/coord.prof   # cProfile the coordinator's loop
    python benchmarks/ft/bench_scale.py --flat                        # every rank its own session (protocol 3's way)
    python benchmarks/ft/bench_scale.py --no-relays                   # group sessions without vote relays (protocol 4)

By default the members speak protocol 4's group sessions (one connection per replica group, its leader's; see
docs/fault_tolerance.md, "Membership hierarchy") and every leader offers a vote relay listener (protocol 5, "Vote
relays": at the coordinator's default ``relay_min_groups`` = 64 groups and more, chunks of max(64, sqrt(groups))
sessions vote through one relay each); ``--no-relays`` keeps one vote and one decision per group, ``--flat`` connects every
rank itself, for comparison.

Per size: one ``torchnext coordinator`` process (the real one, default heartbeat settings unless given) and the
members of :class:`torchnext.testing.member_sim.MemberSim` (``--processes`` processes, the real wire protocol,
authenticated with the job token). Figures, all from one run:

* ``formation_s``: the first member's connection attempt -> the last member received the first generation;
* ``idle_cpu_frac``: the coordinator's CPU (utime + stime of ``/proc/<pid>/stat``, every thread) over
  ``--idle-s`` seconds with a formed generation and no commits, as a fraction of one core -- the heartbeat load;
* ``commit_p50_ms`` / ``commit_p99_ms``: commit rounds (first vote of a step sent -> last member received its
  decision; members vote again as soon as they have the decision) over ``--steps`` steps after 5 warm-up steps;
* ``coordinator_cpu_ms_per_step`` and ``coordinator_msgs_per_step`` over those steps (messages = everything the
  members sent to or received from the coordinator: votes, decisions, heartbeats, pings); ``relay_msgs_per_step``:
  messages on relay channels (counted at both ends), which the coordinator never sees; ``sim_cpu_ms_per_step``: the
  simulator processes' CPU (all of them, /proc) per committed step -- meaningful on a loaded machine, where wall
  figures are not;
* ``sim_late_s``: the simulator's own worst heartbeat lateness: a member removed for silence while it nears the
  timeout was starved on the simulator's side (the 2 cores are shared by the coordinator and the simulator);
* ``detect_s``: one replica group hangs (heartbeats stop, sockets stay open) -> the last survivor received the next
  generation (goal: heartbeat timeout + 0.2 s); ``detect_crash_s``: another group's sockets close -> the same;
  the next generation must hold exactly the survivors (``detect_first_s``, ``detect_first_crash_s``: -> the first
  survivor received it); ``detect_leader_s``: a third group's leader crashes; ``detect_follower_s`` /
  ``detect_follower_hang_s``: a follower of a fourth / fifth group crashes / hangs (reported by its leader: at once,
  or after the local heartbeat timeout, the coordinator's own default 0.6 s).

Every wait is bounded; a size whose formation fails within ``--formation-timeout`` reports null figures and the
reason. The coordinator and every simulator process are reaped on every path (``finally``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import sys
import time
from typing import Any

from torchnext.testing.coordinators import CoordinatorProcess
from torchnext.testing.member_sim import KillMode, MemberSim, SimConfig

KEYS = ("formation_s", "commit_p50_ms", "commit_p99_ms", "coordinator_cpu_ms_per_step", "idle_cpu_frac", "detect_s")
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads), seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # fields 14 and 15 of proc(5), counted after the comm


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def load() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def measure(args: argparse.Namespace, ranks: int) -> dict[str, Any]:
    """One size: every figure of the module docstring, or null figures and ``reason``."""
    g = args.group_size
    if ranks % g:
        raise SystemExit(f"--ranks {ranks} is not a multiple of --group-size {g}")
    groups = ranks // g
    out: dict[str, Any] = dict.fromkeys(KEYS)
    out.update(ranks=ranks, group_size=g, groups=groups, processes=min(args.processes, groups), load_before=load(),
               hierarchy=not args.flat, relays=not args.flat and not args.no_relays, reason="")
    token = secrets.token_hex(16)
    coord = CoordinatorProcess(token, initial_size=groups, min_size=1, heartbeat_interval_s=args.heartbeat_interval,
                               heartbeat_timeout_s=args.heartbeat_timeout,
                               extra=["--relay-fanout", str(args.relay_fanout)] if args.relay_fanout else [])
    if args.profile:
        path = args.profile if len(args.ranks) == 1 else f"{args.profile}.{ranks}"
        coord.command = [sys.executable, os.path.abspath(__file__), "--as-profiled-coordinator", path,
                         *coord.command[3:]]  # [python, -m, torchnext, coordinator, ...] -> under cProfile
        out["profile"] = path
    sim: MemberSim | None = None
    try:
        coord.start()
        sim = MemberSim(SimConfig(address=coord.address, token=token, ranks=ranks, group_size=g,
                                  processes=args.processes, hierarchy=not args.flat,
                                  relays=not args.no_relays, profile=args.profile_sim)).start()
        formed = sim.join(timeout_s=args.formation_timeout)
        out["retries"] = formed.retries
        out["sim_late_s"] = formed.sim_late_s  # the simulator's own worst heartbeat lateness (all calls so far)
        if not formed.ok:
            out["reason"] = f"formation failed: {formed.reason}"
            return out
        out["formation_s"] = formed.formation_s
        pid = coord.pid

        m0, c0, t0 = sim.messages(), cpu_s(pid), time.monotonic()
        time.sleep(args.idle_s)
        m1, c1, t1 = sim.messages(), cpu_s(pid), time.monotonic()
        out["idle_cpu_frac"] = (c1 - c0) / (t1 - t0)
        out["idle_msgs_per_s"] = (m1 - m0) / (t1 - t0)

        step_timeout = max(30.0, ranks * 0.05)
        warm = sim.commit(5, timeout_s=step_timeout)
        out["sim_late_s"] = warm.sim_late_s
        if not warm.ok:
            out["reason"] = f"warm-up commits failed: {warm.reason}"
            return out
        c0, t0, s0 = cpu_s(pid), time.monotonic(), sum(cpu_s(p) for p in sim.pids)
        run = sim.commit(args.steps, timeout_s=step_timeout + args.steps * ranks * 0.002)
        c1, t1, s1 = cpu_s(pid), time.monotonic(), sum(cpu_s(p) for p in sim.pids)
        out["sim_late_s"] = run.sim_late_s
        if not run.ok:
            out["reason"] = f"commits failed after {run.committed} steps: {run.reason}"
        if run.committed:
            ms = [r * 1e3 for r in run.rounds_s]
            out.update(commit_p50_ms=pct(ms, 50), commit_p99_ms=pct(ms, 99), committed=run.committed,
                       coordinator_cpu_ms_per_step=(c1 - c0) * 1e3 / run.committed,
                       coordinator_msgs_per_step=run.messages / run.committed, commit_wall_s=t1 - t0,
                       relay_msgs_per_step=run.relay_messages / run.committed,
                       sim_cpu_ms_per_step=(s1 - s0) * 1e3 / run.committed)
        if not run.ok:
            return out

        survivors = set(formed.members)
        gen = formed.gen
        kills = (("detect_s", KillMode.HANG, None), ("detect_crash_s", KillMode.CRASH, None),
                 ("detect_leader_s", KillMode.CRASH, 0), ("detect_follower_s", KillMode.CRASH, g - 1),
                 ("detect_follower_hang_s", KillMode.HANG, g - 1))
        for i, (key, mode, rank) in enumerate(kills):
            group = groups - 1 - i
            if group < 0 or len(survivors) == len(sim.ids.get(group, ())) or (rank is not None and g == 1):
                break  # no group left to survive this kill (or no follower to kill)
            t_kill = sim.kill_group(group, mode) if rank is None else sim.kill_rank(group, rank, mode)
            nxt = sim.await_generation(gen, timeout_s=args.heartbeat_timeout * 4 + 10)
            survivors -= set(sim.ids[group])
            out["sim_late_s"] = nxt.sim_late_s
            if not nxt.ok or nxt.received_at is None:
                out["reason"] = f"{key}: {mode.value} of group {group} rank {rank}: {nxt.reason}"
                return out
            if set(nxt.members) != survivors:
                out["reason"] = (f"{mode.value} of group {group}: generation {nxt.gen} holds {len(nxt.members)} "
                                 f"members, expected the {len(survivors)} survivors")
                return out
            out[key] = nxt.received_at - t_kill
            if nxt.first_at is not None and rank is None:  # first -> last receipt: the generation's delivery
                out[key.replace("detect", "detect_first")] = nxt.first_at - t_kill
            gen = nxt.gen
        return out
    except Exception as exc:  # one size failing must not hide the others: report it
        out["reason"] = out["reason"] or f"{type(exc).__name__}: {exc}"
        return out
    finally:
        if sim is not None:
            sim.close()
        if args.profile and coord.alive():
            coord.terminate(timeout=30)  # SIGTERM: the service stops and the profile is written
        coord.close()
        out["load_after"] = load()


def _fmt(v: Any, spec: str, scale: float = 1.0) -> str:
    return "—" if v is None else format(v * scale, spec)


def row(r: dict[str, Any]) -> str:
    det = "—" if r["detect_s"] is None else (
        f"{r['detect_s']:.2f} s ({_fmt(r.get('detect_first_s'), '.2f')} s) / "
        f"{_fmt(r.get('detect_crash_s'), '.0f', 1e3)} ms ({_fmt(r.get('detect_first_crash_s'), '.0f', 1e3)} ms) / "
        f"{_fmt(r.get('detect_leader_s'), '.0f', 1e3)} ms / {_fmt(r.get('detect_follower_s'), '.0f', 1e3)} ms / "
        f"{_fmt(r.get('detect_follower_hang_s'), '.2f')} s")
    cells = [f"{r['ranks']:,} ({r['groups']} x {r['group_size']})", _fmt(r.get("coordinator_msgs_per_step"), ",.0f"),
             _fmt(r["coordinator_cpu_ms_per_step"], ".1f") + (" ms" if r["coordinator_cpu_ms_per_step"] else ""),
             "—" if r["commit_p50_ms"] is None else f"{r['commit_p50_ms']:.1f} / {r['commit_p99_ms']:.1f} ms",
             _fmt(r["idle_cpu_frac"], ".1f", 100) + (" %" if r["idle_cpu_frac"] is not None else "")
             + (f" ({r['idle_msgs_per_s']:,.0f} msgs/s)" if r.get("idle_msgs_per_s") else ""),
             _fmt(r["formation_s"], ".2f") + (" s" if r["formation_s"] is not None else ""), det,
             (r["reason"] or "ok") + (f" (simulator heartbeats up to {r['sim_late_s']:.2f} s late)"
                                      if r.get("sim_late_s", 0) > 0.1 else "")]
    return "| " + " | ".join(cells) + " |"


def profiled_coordinator(argv: list[str]) -> int:
    """``--as-profiled-coordinator PATH coordinator ...``: ``torchnext coordinator`` with its service loop (the
    selector thread) under cProfile; the stats are written to PATH when the service stops (SIGTERM)."""
    import cProfile

    from torchnext.cli import main
    from torchnext.ft import service

    path, rest = argv[0], argv[1:]
    prof = cProfile.Profile()
    loop = service.MembershipService._run

    def run(self: service.MembershipService) -> None:
        prof.enable()
        try:
            loop(self)
        finally:
            prof.disable()
            prof.dump_stats(path)

    service.MembershipService._run = run  # type: ignore[method-assign]
    return main(rest)


def _mode(args: argparse.Namespace) -> str:
    if args.flat or args.group_size == 1:
        return "flat"
    return "group sessions, no relays (protocol 4's way)" if args.no_relays else "group sessions with vote relays"


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--as-profiled-coordinator":
        return profiled_coordinator(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024], help="sizes (default 64 256 1024)")
    p.add_argument("--group-size", type=int, default=8, help="ranks per replica group (default 8)")
    p.add_argument("--processes", type=int, default=2, help="simulator processes (default 2)")
    p.add_argument("--steps", type=int, default=100, help="measured commit rounds (default 100)")
    p.add_argument("--idle-s", type=float, default=3.0, help="idle window for the heartbeat load (default 3 s)")
    p.add_argument("--formation-timeout", type=float, default=60.0, help="bound on formation (default 60 s)")
    p.add_argument("--heartbeat-interval", type=float, default=0.1, help="coordinator setting (default 0.1 s)")
    p.add_argument("--heartbeat-timeout", type=float, default=0.6, help="coordinator setting (default 0.6 s)")
    p.add_argument("--flat", action="store_true", help="every rank its own coordinator session (protocol 3's way) "
                                                       "instead of one group session per replica group")
    p.add_argument("--no-relays", action="store_true", help="group sessions without vote relay listeners (protocol "
                                                            "4's way: one vote and one decision per group and step)")
    p.add_argument("--relay-fanout", type=int, default=0, help="the coordinator's sessions per relay chunk (default: "
                                                              "its own, max(64, ceil(sqrt(sessions))))")
    p.add_argument("--profile-sim", default="", help="cProfile the simulator's workers during the commits into "
                   "PATH.<pid> (one file per worker)")
    p.add_argument("--json", action="store_true", help="one JSON object per size instead of the table")
    p.add_argument("--profile", default="", help="cProfile the coordinator's loop into this file (.<ranks> added "
                                                 "when several sizes); figures are then inflated")
    args = p.parse_args()
    for n in args.ranks:
        if n < 1 or n % args.group_size:
            p.error(f"--ranks {n}: must be a positive multiple of --group-size {args.group_size}")
    if not args.json:
        import torch

        print(f"# torchnext bench_scale: python {platform.python_version()}, torch {torch.__version__}, "
              f"{platform.platform()}, {os.cpu_count()} CPUs, load {load()}")
        print(f"# heartbeat {args.heartbeat_interval} s / timeout {args.heartbeat_timeout} s, {args.steps} steps, "
              f"{args.processes} simulator processes, "
              f"{_mode(args)}")
        print("| members | coordinator msgs per step | coordinator CPU per step | commit round p50 / p99 | idle "
              "heartbeat load (one core) | formation | detection, last (first) survivor: group hang / group crash / "
              "leader crash / follower crash / follower hang | status |")
        print("|---|---|---|---|---|---|---|---|", flush=True)
    for n in args.ranks:
        r = measure(args, n)
        print(json.dumps(r) if args.json else row(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
