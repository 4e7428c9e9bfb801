"""Long-haul soak: one FT-HSDP job and one FT-DDP job on local ranks, thousands of seeded faults, exact checks.

Shared by ``benchmarks/ft/bench_soak.py`` (2000 faults over 30 minutes) and ``tests/ft/test_ft_soak.py`` (100 in
under 3 minutes). What :func:`run_soak` does::

    schedule = plan(config)                 # fault i at (i + U(0,1)) * minutes * 60 / faults, a random job and kind
    for each job, in its own thread:        # HSDP: groups of group_size ranks; DDP: every process its own group
        for fault in its share of schedule: # injected at its time or once the job is whole again, whichever is later
            inject(fault)                   # kill | hang | raise | partition | coordinator
            wake a warm spare (or a spare group) at once; wait (bounded) until the survivor commits in a generation
            without the victim (a raise, a coordinator kill: in any newer generation) -> recovery time;
            resume a hung victim, reconnect a cut-off one, start a new standby; wait until the spare committed;
            launch a new warm spare (the pool is refilled after every fault: the job can run forever)
            a victim group left alive (hang, partition, raise) may rejoin -- healed, as a recovered host would: once
            it commits with the survivor again it is a live group (a target again), and the next fault it makes
            the job bigger than its size is not replaced by a spare: the job stays at its size
    stop: every member stops at one step; every process is reaped; checks (``SoakResult.checks``)

Fault kinds (:class:`SoakFault`): ``kill`` SIGKILL; ``hang`` SIGSTOP, SIGCONT once removed (it is then told so and
exits 0); ``raise`` ``PeerFailure`` raised inside backward on one rank (SIGUSR1; the job regenerates); ``partition``
the victim's host loses its link (network namespaces, root only; otherwise not scheduled, the reason recorded);
``coordinator`` SIGKILL of the coordinator in office (the standby takes over; a new standby is started at the dead
one's address, so the next coordinator kill is survivable too).

One member per job is never a fault target (DDP: member 0; HSDP: group 0, whose rank 0 reports): the **survivor**.
It logs its own ``/proc/self`` thread, fd and RSS counts between steps and its longest gap between two commits.
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import random
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torchnext.testing.coordinators import CoordinatorProcess
from torchnext.testing.ft_parallel import STACKS_SIGNAL, ParallelSpec, run_parallel
from torchnext.testing.ft_workload import FTJob
from torchnext.testing.procfs import is_stopped
from torchnext.testing.soak_checks import check_job, percentile, resources_flat

__all__ = ["SoakConfig", "SoakFault", "SoakResult", "gap_phases", "plan", "run_soak"]


class SoakFault(str, enum.Enum):
    """What a scheduled soak fault does (see the module docstring)."""

    KILL = "kill"
    HANG = "hang"
    RAISE = "raise"
    PARTITION = "partition"
    COORDINATOR = "coordinator"


@dataclass(kw_only=True)
class SoakConfig:
    """One soak run."""

    faults: int = 100
    """Faults to inject in all (both jobs)."""
    minutes: float = 2.0
    """The schedule spreads ``faults`` over this long; the run lasts until both are reached."""
    seed: int = 0
    kinds: Sequence[SoakFault] = tuple(SoakFault)
    jobs: Sequence[str] = ("hsdp", "ddp")
    ddp_members: int = 3
    hsdp_groups: int = 2
    group_size: int = 2
    warmup_faults: int = 100
    """Resources are compared between the survivor's counts after this many faults (of all) and at the end."""
    rss_tolerance: float = 0.05
    growth_per_fault: float = 0.0
    """Threads and fds the survivor may gain per fault between the warm-up point and the end (0: none -- the
    benchmark's goal; a decrease is always fine). The leak this guards against gained 4.9 threads and 8 fds per
    fault."""
    heartbeat_timeout_s: float = 0.6
    """The coordinators' ``--heartbeat-timeout`` (the library default); a commit gap over this + 1 s fails."""
    max_gap_s: float | None = None
    """The bound on the survivor's longest gap between two commits (None: ``heartbeat_timeout_s`` + 1 s, the
    benchmark's goal). A timing goal, which a test on a shared machine should not judge: the CI soak bounds only
    the stalls that are bugs (a lost abort waits out an op's timeout, a missed hang never ends)."""
    step_sleep_s: float = 0.01
    wait_s: float = 90.0
    """Bound on every wait (a recovery, a start, the end); past it the run stops and fails."""
    netns: bool | None = None
    """Run on NetLab hosts (needed for partitions). None: when ``partition`` is among ``kinds`` and it is available."""
    defer_commit: bool = False
    """Every member with ``FaultTolerantConfig(defer_commit=True)``: each step's decision awaited at the next commit,
    a refused update revoked (the exact replay then also checks that no revoked update stayed applied)."""
    workdir: str | None = None
    log: Callable[[str], None] | None = None


@dataclass(frozen=True)
class Planned:
    at: float
    job: str
    kind: SoakFault


@dataclass(kw_only=True)
class Injected:
    index: int
    job: str
    kind: SoakFault
    victim: str
    at: float
    recovery_s: float | None = None
    delay_s: float | None = None
    """raise: from the signal to the op that raised (the victim's next backward; recovery is timed from there)."""


@dataclass(kw_only=True)
class SoakResult:
    config: dict[str, Any]
    skipped: dict[str, str] = field(default_factory=dict)
    faults: list[Injected] = field(default_factory=list)
    jobs: dict[str, dict[str, Any]] = field(default_factory=dict)
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    checks: dict[str, dict[str, Any]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.errors and all(c["ok"] for c in self.checks.values())

    def recovery(self) -> dict[str, dict[str, float]]:
        """Per job and fault kind: n, p50, p99, max of the recovery times (seconds)."""
        out: dict[str, dict[str, float]] = {}
        for job in sorted({f.job for f in self.faults}):
            for kind in SoakFault:
                xs = [f.recovery_s for f in self.faults if f.job == job and f.kind is kind and f.recovery_s is not None]
                if xs:
                    out[f"{job}/{kind.value}"] = {"n": len(xs), "p50": percentile(xs, 50), "p99": percentile(xs, 99),
                                                  "max": max(xs)}
        return out

    def long_gaps(self, margin_s: float = 0.5) -> list[dict[str, Any]]:
        """Every long gap between two of a survivor's commits (``ft_parallel.LONG_GAP_S``), longest first, with what
        happened in it, in both jobs (they share the machine): the faults injected and the harness's own launches
        (spare groups, standby coordinators) between ``margin_s`` before the gap began and its end, as seconds
        before its end; and the survivor's reconfigurations that began in it (:func:`gap_phases`)."""
        out = []
        for j, rep in self.jobs.items():
            reconfs = rep.get("survivor_reconfigurations", [])
            for gap, step, end in rep.get("long_gaps", []):
                lo = end - gap - margin_s
                faults = [f"{end - f.at:.2f}s {f.job} {f.kind.value} {f.victim}" for f in self.faults
                          if lo <= f.at <= end]
                launches = [f"{end - t:.2f}s {other} {what}" for other, r in self.jobs.items()
                            for t, what in r.get("launches", []) if lo <= t <= end]
                out.append({"job": j, "gap_s": gap, "step": step, "faults": faults, "launches": launches,
                            "reconfigurations": gap_phases(reconfs, end - gap, end)})
        return sorted(out, key=lambda g: -g["gap_s"])

    def to_json(self) -> dict[str, Any]:
        return {"config": self.config, "skipped": self.skipped, "ok": self.ok, "seconds": self.seconds,
                "errors": self.errors, "checks": self.checks, "recovery": self.recovery(), "jobs": self.jobs,
                "long_gaps": self.long_gaps(),
                "exit_codes": self.exit_codes,
                "faults": [{"i": f.index, "job": f.job, "kind": f.kind.value, "victim": f.victim, "at": f.at,
                            "recovery_s": f.recovery_s, "delay_s": f.delay_s} for f in self.faults]}


def gap_phases(reconfigurations: Sequence[dict[str, Any]], begin: float, end: float) -> list[dict[str, Any]]:
    """The survivor's reconfigurations that began in the gap ``[begin, end]`` (``time.monotonic()`` of two commits),
    each split into its phases (seconds)::

        {"gen", "reason", "joiners",
         "wait": start - begin,            # from the gap's first commit until this reconfiguration began
         "interrupted": start - interrupt, # an op interrupted for it (None: it began between steps)
         "build": built - start,           # aborting the old communicators, connecting the new one
         "heal": healed - built,           # sending/receiving the state (0 for a member that takes no part)
         "to_commit": end - healed}        # (the last one's) the rest: callbacks, the step, the commit
    """
    out = []
    for r in reconfigurations:
        t = r.get("timings") or {}
        start = t.get("start")
        if start is None or not begin <= start <= end:
            continue
        built, healed = t.get("built", start), t.get("healed", t.get("built", start))
        out.append({"gen": r.get("gen"), "reason": r.get("reason"), "joiners": r.get("joiners"),
                    "wait": round(start - begin, 3),
                    "interrupted": None if "interrupt" not in t else round(start - t["interrupt"], 3),
                    "build": round(built - start, 3), "heal": round(healed - built, 3),
                    "to_commit": round(end - healed, 3)})
    return out


class SoakError(RuntimeError):
    """A soak job could not go on (a bounded wait ran out); the message says what it waited for."""


def plan(config: SoakConfig, kinds: Sequence[SoakFault] | None = None) -> list[Planned]:
    """The seeded schedule: fault ``i`` at ``(i + U(0, 1)) * minutes * 60 / faults`` s, a random job and kind."""
    rng = random.Random(config.seed)
    kinds = list(config.kinds if kinds is None else kinds)
    span = config.minutes * 60.0
    return [Planned(at=span * (i + rng.random()) / config.faults, job=rng.choice(list(config.jobs)),
                    kind=rng.choice(kinds)) for i in range(config.faults)] if kinds and config.faults else []


class _Tail:
    """A JSON-lines file read incrementally (members append, the harness reads)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = []
        self._pos = 0
        self._lock = threading.Lock()

    def read(self) -> list[dict[str, Any]]:
        with self._lock:
            if os.path.exists(self.path):
                with open(self.path, "rb") as fh:
                    fh.seek(self._pos)
                    data = fh.read()
                end = data.rfind(b"\n") + 1
                self._pos += end
                self.records += [json.loads(line) for line in data[:end].splitlines() if line.strip()]
            return self.records


class _Shared:
    """State the two job threads share: the global fault count, the warm-up mark, the stop flag."""

    def __init__(self, config: SoakConfig, t0: float) -> None:
        self.config = config
        self.t0 = t0
        self.lock = threading.Lock()
        self.injected: list[Injected] = []
        self.stop = threading.Event()
        self.errors: list[str] = []

    def log(self, text: str) -> None:
        if self.config.log is not None:
            self.config.log(f"[{time.monotonic() - self.t0:7.1f}s] {text}")


class _Job:
    """One fault-tolerant job (``ddp`` or ``hsdp``), its two coordinators, its members and its warm spares."""

    def __init__(self, kind: str, shared: _Shared, workdir: str, lab: Any, hosts: list[int]) -> None:
        cfg = shared.config
        self.kind = kind
        self.cfg = cfg
        self.shared = shared
        self.dir = os.path.join(workdir, kind)
        os.makedirs(self.dir)
        self.lab = lab
        self.token = f"soak-{kind}-{cfg.seed}"
        self.stop_file = os.path.join(self.dir, "stop")
        self.events = _Tail(os.path.join(self.dir, "events.jsonl"))
        self.resources = _Tail(os.path.join(self.dir, "survivor-resources.jsonl"))
        self.raised = _Tail(os.path.join(self.dir, "raised.jsonl"))  # when an armed raise fired, per member
        self.hsdp = kind == "hsdp"
        self.gsize = cfg.group_size if self.hsdp else 1
        self.n_groups = cfg.hsdp_groups if self.hsdp else cfg.ddp_members
        self.job = FTJob()
        self.coord_hosts = hosts[:2]
        self.free_hosts = hosts[2:]
        self.host_of: dict[int, int] = {}  # group -> host (netns)
        self.groups: dict[int, list[int]] = {}  # live group -> its member ids
        self.spares: list[int] = []  # launched spare groups, waiting
        self.next_group = 0
        self.expected_kill: set[int] = set()  # members that get SIGKILL: exit code -9 expected
        self.coords: dict[str, CoordinatorProcess] = {}
        self.retired: list[CoordinatorProcess] = []
        self.office = "A"
        self.ports: dict[str, int] = {}
        self.samples: dict[str, dict[str, Any]] = {}
        self._sampled_t = float("-inf")  # the newest resource record a sample has seen
        self.survivor = 0
        self.ids_of: dict[int, list[int]] = {}  # group -> its member ids (live, spare or gone)
        self.gone: list[int] = []  # groups left whose processes may still run (their hosts are not free yet)
        self.limbo: dict[int, int] = {}  # group left alive -> the survivor's generation it left in (may rejoin)
        self.rejoined = 0  # limbo groups that rejoined the job (healed) and became live groups again
        self.launches: list[tuple[float, str]] = []  # (time.monotonic(), what): the harness's own CPU bursts
        self.anomalies: list[str] = []  # what the harness saw go wrong with its own faults (see _keep_stopped)

    # ------------------------------------------------------------------------------------------ processes
    def _coordinator(self, name: str, *, standby: bool, port: int = 0) -> CoordinatorProcess:
        host = self.coord_hosts[0 if name == "A" else 1]
        kw: dict[str, Any] = {}
        if self.lab is not None:
            kw = {"host": self.lab.address(host), "netns": self.lab.netns(host)}
        # forked (torch preloaded): a fresh process's ~2.6 s of CPU importing torch, at every coordinator restart,
        # came out of the members training beside it
        return CoordinatorProcess(self.token, port=port, standby=standby, min_size=1, fork=True,
                                  initial_size=None if standby else self.n_groups,
                                  heartbeat_timeout_s=self.cfg.heartbeat_timeout_s, start_timeout_s=self.cfg.wait_s,
                                  **kw).launch()

    @property
    def size(self) -> int:
        """Members (ranks: groups x group size) of the whole job -- what a resource record's ``members`` is then."""
        return self.n_groups * self.gsize

    @property
    def addresses(self) -> str:
        return ",".join(self.coords[n].address for n in ("A", "B"))

    def _launch_group(self, *, spare: bool) -> int:
        g = self.next_group
        self.next_group += 1
        self.launches.append((time.monotonic(), f"{'spare ' if spare else ''}group {g}"))
        host = self.free_hosts.pop(0) if self.lab is not None else -1
        self.host_of[g] = host
        ids = [g * self.gsize + r + (100 if g >= self.n_groups and not self.hsdp else 0) for r in range(self.gsize)]
        for r, m in enumerate(ids):
            spec = ParallelSpec(
                coordinator=self.addresses, token=self.token, store_port=0, member_id=m, steps=0, parallel=self.kind,
                group=g, group_rank=r, group_size=self.gsize, stop_file=self.stop_file, signal_raises=True,
                raise_log=self.raised.path,
                step_sleep_s=self.cfg.step_sleep_s, event_log=self.events.path,
                start_file=os.path.join(self.dir, f"go-{g}") if spare else None, idle_until_started=spare,
                group_store_file=os.path.join(self.dir, f"store-{g}") if self.hsdp else None,
                resource_log=self.resources.path if m == self.survivor else None,
                netns=self.lab.netns(host) if self.lab is not None else None,
                stacks_file=os.path.join(self.dir, f"stacks-{m}.txt"), defer_commit=self.cfg.defer_commit,
            )
            self.job.launch(spec, run_parallel)  # type: ignore[arg-type]
        self.ids_of[g] = ids
        if spare:
            self.spares.append(g)
        else:
            self.groups[g] = ids
        return g

    def start(self) -> None:
        self.coords = {"A": self._coordinator("A", standby=False), "B": self._coordinator("B", standby=True)}
        for c in self.coords.values():
            c.wait_ready()
        self.ports = {n: int(c.address.rsplit(":", 1)[1]) for n, c in self.coords.items()}
        for _ in range(self.n_groups):
            self._launch_group(spare=False)
        self._launch_group(spare=True)
        self._wait(lambda: self._committed_with(self.members()), "the first generation to commit")

    def members(self) -> list[int]:
        return sorted(m for ids in self.groups.values() for m in ids)

    def _pid(self, m: int) -> int:
        return self.job.pid(m)

    # ----------------------------------------------------------------------------------------- observing
    def _survivor_gens(self) -> list[dict[str, Any]]:
        return [e for e in self.events.read() if e["member"] == self.survivor]

    def _committed_with(self, ids: Sequence[int], after_gen: int = -1) -> bool:
        return any(e["gen"] > after_gen and set(ids) <= set(e["members"]) for e in self._survivor_gens())

    def _adopt(self) -> None:
        """Groups left alive that rejoined (all of their members in a survivor generation newer than the one they
        left in) are live groups again; those whose processes all exited are forgotten."""
        for g, left_gen in list(self.limbo.items()):
            ids = self.ids_of[g]
            if all(self.job.exitcode(m) is not None for m in ids):
                del self.limbo[g]
            elif self._committed_with(ids, left_gen):
                del self.limbo[g]
                self.groups[g] = ids
                if g in self.gone:
                    self.gone.remove(g)
                self.rejoined += 1
                self.shared.log(f"{self.kind}: group {g} {ids} rejoined (healed): a live group again")

    def _wait(self, pred: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.cfg.wait_s
        while not pred():
            self.job.poll(0.01)
            if time.monotonic() > deadline:
                self._dump_stacks()
                raise SoakError(f"{self.kind}: no {what} within {self.cfg.wait_s}s (members {self.members()}, last "
                                f"generations {[(e['gen'], e['members']) for e in self._survivor_gens()[-3:]]})")

    def _dump_stacks(self) -> None:
        """Ask every live member (``stacks-<id>.txt``) and coordinator (its log) for its threads' stacks."""
        for p in self.job.procs.values():
            if p.exitcode is None and p.pid is not None:
                with contextlib.suppress(OSError):
                    os.kill(p.pid, STACKS_SIGNAL)
        for c in [*self.coords.values()]:
            with contextlib.suppress(OSError, RuntimeError):
                os.kill(c.pid, signal.SIGUSR2)
        time.sleep(1.0)
        self.shared.log(f"{self.kind}: stacks dumped into {self.dir}/stacks-*.txt and the coordinators' logs")

    def _sample(self, name: str) -> None:
        """Keep the survivor's resource counts as ``name`` (taken just before a fault or the stop): its latest
        record, with the fewest threads and fds among the records since the previous sample *and* since the
        survivor's first commit in its current generation, with as many members as the latest -- a leak is in every
        one of them; a connection not closed yet, a background build or report thread is not. A group's backend
        has a socket per peer, so counts are compared at equal membership (see :func:`_warm_sample`). (Since the
        previous sample alone, the window could hold the previous recovery: a rebuild's dip -- the old communicator's threads gone, the new one's not yet
        started -- made the warm-up sample two threads short of the end in a CI run.)"""
        recs = self.resources.read()
        if recs:
            gens = self._survivor_gens()
            settled = max(self._sampled_t, gens[-1]["commit"] if gens else float("-inf"))
            now = recs[-1].get("members")
            since = [r for r in recs if r["t"] > settled and r.get("members") == now] or recs[-1:]
            self._sampled_t = recs[-1]["t"]
            self.samples[name] = dict(recs[-1], threads=min(r["threads"] for r in since),
                                      fds=min(r["fds"] for r in since),
                                      faults=len([f for f in self.shared.injected if f.job == self.kind]))

    # ------------------------------------------------------------------------------------------- faults
    def inject(self, kind: SoakFault, rng: random.Random, index: int) -> Injected:
        self._adopt()
        gens = self._survivor_gens()
        gen_before = gens[-1]["gen"] if gens else 0
        if kind is SoakFault.COORDINATOR:
            victim = self.coords[self.office]
            at = victim.kill()
            inj = Injected(index=index, job=self.kind, kind=kind, victim=f"coordinator {self.office}", at=at)
            self._wait(lambda: any(e["gen"] > gen_before and e["commit"] > at for e in self._survivor_gens()),
                       f"commit after coordinator {self.office} was killed")
            inj.recovery_s = next(e["commit"] for e in self._survivor_gens() if e["gen"] > gen_before) - at
            self.retired.append(victim)
            self.launches.append((time.monotonic(), f"standby coordinator {self.office}"))
            self.coords[self.office] = self._coordinator(self.office, standby=True, port=self.ports[self.office])
            self.coords[self.office].wait_ready()
            self.office = "B" if self.office == "A" else "A"
            return inj
        g = rng.choice(sorted(x for x in self.groups if x != 0))
        ids = self.groups[g]
        m = rng.choice(ids)
        inj = Injected(index=index, job=self.kind, kind=kind, victim=f"member {m} (group {g})", at=time.monotonic())
        if kind is SoakFault.RAISE:
            os.kill(self._pid(m), signal.SIGUSR1)
            self._wait(lambda: any(e["gen"] > gen_before for e in self._survivor_gens()), "generation after a raise")
            # timed from the raise itself: the signal only arms it, and a victim in a group that has just joined
            # (its first steps) or on a machine busy starting the next spare may reach its next backward late
            fired = min((r["t"] for r in self.raised.read() if r["member"] == m and r["t"] >= inj.at),
                        default=inj.at)
            inj.delay_s = fired - inj.at
            inj.recovery_s = next(e["commit"] for e in self._survivor_gens() if e["gen"] > gen_before) - fired
            # a raise may also cost the group (HSDP: its sibling may be blocked); then it is replaced below (it may
            # rejoin later: see _adopt)
            if self._committed_with(ids, gen_before):
                return inj
            inj.victim += " -> group left"
        elif kind is SoakFault.KILL:
            self.expected_kill.add(m)
            inj.at = time.monotonic()
            os.kill(self._pid(m), signal.SIGKILL)
        elif kind is SoakFault.HANG:
            inj.at = time.monotonic()
            os.kill(self._pid(m), signal.SIGSTOP)
        elif kind is SoakFault.PARTITION:
            inj.at = time.monotonic()
            self.lab.isolate([self.host_of[g]])
        del self.groups[g]
        spare = None
        if len(self.groups) < self.n_groups:  # else a rejoined group stands in: the job keeps its size
            spare = self.spares.pop(0)
            open(os.path.join(self.dir, f"go-{spare}"), "w").close()
            self.groups[spare] = self.ids_of[spare]

        def without() -> list[dict[str, Any]]:
            return [e for e in self._survivor_gens() if e["gen"] > gen_before and not set(ids) & set(e["members"])]

        def removed() -> bool:
            if kind is SoakFault.HANG:
                self._keep_stopped(m, inj)
            return bool(without())

        self._wait(removed, f"generation without {inj.victim} ({kind.value})")
        if inj.recovery_s is None:
            inj.recovery_s = without()[0]["commit"] - inj.at
        if kind is SoakFault.HANG:
            os.kill(self._pid(m), signal.SIGCONT)
        elif kind is SoakFault.PARTITION:
            self.lab.reconnect([self.host_of[g]])
        if kind is not SoakFault.KILL:
            self.limbo[g] = without()[0]["gen"]
        if spare is not None:
            self._wait(lambda: self._committed_with(self.ids_of[spare]), f"spare group {spare} to commit")
        self._reclaim(g)
        if spare is not None:
            self._launch_group(spare=True)
        return inj

    def _keep_stopped(self, m: int, inj: Injected) -> None:
        """A hang's victim must stay stopped until it is removed. The 2026-12-03 full soak's DDP job waited 90 s for
        the removal of a SIGSTOPped member that was training all along (its stacks dumped, the survivor never
        stalled) -- the cause is not known. Check ``/proc``: a victim found running is recorded (``anomalies``,
        with how long after the SIGSTOP) and stopped again."""
        pid = self._pid(m)
        if time.monotonic() - inj.at < 0.05 or self.job.exitcode(m) is not None or is_stopped(pid):
            return
        note = f"fault {inj.index}: hang victim member {m} (pid {pid}) running {time.monotonic() - inj.at:.2f}s " \
               f"after its SIGSTOP; stopped again"
        self.anomalies.append(note)
        self.shared.log(f"{self.kind}: {note}")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)

    def _reclaim(self, gone: int) -> None:
        """Hosts of groups whose processes all exited are free again (netns)."""
        self.gone.append(gone)
        for g in list(self.gone):
            if all(self.job.exitcode(m) is not None for m in self.ids_of[g]):
                self.gone.remove(g)
                if self.lab is not None:
                    self.free_hosts.append(self.host_of[g])

    # --------------------------------------------------------------------------------------------- the end
    def settle(self, warm: dict[str, Any] | None, since: float, *, least_s: float = 2.0,
               most_s: float | None = None) -> None:
        """Let the survivor run fault-free for ``least_s``, and up to ``most_s`` until one of its records since
        ``since`` is back at (or below) the warm-up sample's threads and fds: what the last faults left behind for a
        while -- a backend awaiting the reaper, a superseded generation's build running out its timeout -- is gone
        by then; a leak is in every record and never is. ``most_s`` defaults to the members' op timeout + 5 s, the
        longest anything bounded may hold on: an op Gloo's socket cut does not end (docs/comms.md, "a known Gloo
        gap"). (A build superseded while it waited for a peer that had died held its thread, store connection and
        half-built backend for that timeout -- the CI failure of 2026-12-03, its end sample taken 15 s after the last
        fault; its store waits are cancelled now, :mod:`torchnext.comms.cancellable_store`.)"""
        if most_s is None:
            most_s = ParallelSpec.timeout_s + 5.0
        while True:
            self.job.poll(0.05)
            waited = time.monotonic() - since
            if waited < least_s:
                continue
            if warm is None or waited >= most_s:
                return
            if any(r["threads"] <= warm["threads"] and r["fds"] <= warm["fds"] and r.get("members") == self.size
                   for r in self.resources.read() if r["t"] > since):
                return

    def finish(self) -> dict[int, dict[str, Any]]:
        self._sample("end")
        gens = self._survivor_gens()
        last = gens[-1]["step"] if gens else 0
        # a target past every member's step: all stop at the same one
        steps = [r["step"] for r in self.resources.read()[-1:]] or [last]
        with open(self.stop_file, "w") as fh:
            fh.write(str(max(steps[0], last) + 20))
        everyone = sorted(self.job.procs)
        deadline = time.monotonic() + self.cfg.wait_s
        try:
            self.job.wait_exited(everyone, max(1.0, deadline - time.monotonic()))
        except TimeoutError as exc:
            self.shared.errors.append(f"{self.kind}: {exc}")
        self.job.poll(0.1)
        return dict(self.job.reports)

    def close(self) -> dict[str, int | None]:
        codes: dict[str, int | None] = {}
        for c in [*self.coords.values()]:
            c.terminate(10.0)
        self.job.close()
        for m in sorted(self.job.procs):
            codes[f"{self.kind}/member {m}"] = self.job.exitcode(m)
        for i, c in enumerate(self.retired):
            c.close()
            codes[f"{self.kind}/coordinator #{i} (killed)"] = c.returncode
            self._keep_log(f"coordinator-{i:04d}-killed.log", c)
        for name, c in self.coords.items():
            c.close()
            codes[f"{self.kind}/coordinator {name}"] = c.returncode
            self._keep_log(f"coordinator-{name}.log", c)
        return codes

    def _keep_log(self, name: str, c: CoordinatorProcess) -> None:
        """The coordinator's output (its takeovers, refusals, internal errors) beside the job's logs (kept with
        ``--workdir``)."""
        try:
            with open(os.path.join(self.dir, name), "w") as fh:
                fh.write(c.output())
        except OSError as exc:
            self.shared.errors.append(f"{self.kind}: cannot keep {name}: {exc}")


def _job_thread(job: _Job, todo: list[tuple[int, Planned]], shared: _Shared, rng: random.Random) -> None:
    try:
        for index, p in todo:
            while not shared.stop.is_set() and time.monotonic() - shared.t0 < p.at:
                job.job.poll(0.02)
            if shared.stop.is_set():
                return
            job._sample(f"before {index}")
            inj = job.inject(p.kind, rng, index)
            with shared.lock:
                shared.injected.append(inj)
            shared.log(f"{job.kind}: fault {index} {p.kind.value} {inj.victim}: recovered in "
                       f"{inj.recovery_s if inj.recovery_s is not None else float('nan'):.3f}s"
                       + (f" (it fired {inj.delay_s:.3f}s after the signal)" if inj.delay_s is not None else ""))
    except Exception as exc:  # a bounded wait ran out, or a process could not start: this job stops injecting (the
        # other goes on, so its figures still come), and the run fails
        shared.errors.append(f"{job.kind}: {type(exc).__name__}: {exc}")
        shared.log(f"{job.kind}: stopped injecting: {exc}")


def run_soak(config: SoakConfig) -> SoakResult:
    """Run the soak described in the module docstring; never leaves a process behind. ``result.ok`` says whether
    every check passed."""
    from torchnext.testing.netns import NetLab, available

    result = SoakResult(config={k: (list(v) if isinstance(v, (list, tuple)) else v)
                                for k, v in config.__dict__.items() if k != "log"})
    result.config["kinds"] = [k.value for k in config.kinds]
    kinds = list(config.kinds)
    use_lab = config.netns
    if SoakFault.PARTITION in kinds or use_lab:
        ok, why = available()
        if not ok:
            result.skipped["partition"] = f"network namespaces unavailable: {why}"
            kinds.remove(SoakFault.PARTITION) if SoakFault.PARTITION in kinds else None
            use_lab = False
        elif use_lab is None:
            use_lab = True
    if not use_lab and SoakFault.PARTITION in kinds:
        kinds.remove(SoakFault.PARTITION)
        result.skipped["partition"] = "run without network namespaces (netns=False)"
    schedule = plan(config, kinds)
    workdir = config.workdir or tempfile.mkdtemp(prefix="torchnext-soak-")
    os.makedirs(workdir, exist_ok=True)
    t0 = time.monotonic()
    shared = _Shared(config, t0)
    sizes = {"hsdp": 2 + config.hsdp_groups + 5, "ddp": 2 + config.ddp_members + 5}  # coordinators, groups, spares
    lab = NetLab(sum(sizes[j] for j in config.jobs)) if use_lab else None
    jobs: dict[str, _Job] = {}
    result.config["scheduled"] = len(schedule)
    try:
        first = 0
        for j in config.jobs:
            hosts = list(range(first, first + sizes[j]))
            first += sizes[j]
            jobs[j] = _Job(j, shared, workdir, lab, hosts)
        for job in jobs.values():
            job.start()
        shared.log(f"jobs started: {', '.join(f'{j}: members {job.members()}' for j, job in jobs.items())}")
        shared.t0 = time.monotonic()  # the schedule starts now: starting the jobs is not part of it
        rngs = {j: random.Random(f"{config.seed}/{j}") for j in jobs}
        threads = [threading.Thread(target=_job_thread, name=f"soak-{j}", daemon=True,
                                    args=(job, [(i, p) for i, p in enumerate(schedule) if p.job == j], shared, rngs[j]))
                   for j, job in jobs.items()]
        for t in threads:
            t.start()
        bound = config.minutes * 60 + config.faults * config.wait_s + 60
        for t in threads:
            t.join(max(1.0, bound - (time.monotonic() - shared.t0)))
            if t.is_alive():
                shared.errors.append(f"{t.name}: still injecting after {bound:.0f}s")
                shared.stop.set()
        while not shared.stop.is_set() and time.monotonic() - shared.t0 < config.minutes * 60:
            for job in jobs.values():
                job.job.poll(0.05)
        for job in jobs.values():
            job._wait(lambda: True, "")
        result.faults = sorted(shared.injected, key=lambda f: f.index)
        warm = _warm_index(result.faults, config.warmup_faults)
        settle_from = time.monotonic()
        for job in jobs.values():  # the last recovery settles before the end counts are taken
            name = _warm_sample(job, result.faults, warm)
            job.settle(job.samples.get(name) if name else None, settle_from)
        for j, job in jobs.items():
            reports = job.finish()
            result.jobs[j] = check_job(job.kind, reports, job.events.read(), survivor=job.survivor,
                                       expected_kill=job.expected_kill, group_size=job.gsize)
            result.jobs[j]["samples"] = job.samples
            result.jobs[j]["warm_sample"] = _warm_sample(job, result.faults, warm)
            member_counts = [len(e["members"]) for e in job._survivor_gens()]
            result.jobs[j]["membership"] = {"rejoined_groups": job.rejoined, "size": job.size,
                                            "max_members": max(member_counts, default=0)}
            result.jobs[j]["launches"] = job.launches
            result.jobs[j]["anomalies"] = job.anomalies
    except (Exception, KeyboardInterrupt) as exc:  # interrupted (Ctrl-C, the bench's SIGTERM): reap, then report
        shared.errors.append(f"{type(exc).__name__}: {exc}")
        result.faults = result.faults or sorted(shared.injected, key=lambda f: f.index)  # the recoveries so far
    finally:
        shared.stop.set()
        for job in jobs.values():
            try:
                result.exit_codes.update(job.close())
            except Exception as exc:  # keep reaping the other job
                shared.errors.append(f"closing {job.kind}: {exc}")
        if lab is not None:
            lab.close()
        if config.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    result.errors = shared.errors
    result.seconds = time.monotonic() - t0
    _judge(result, config, jobs)
    return result


def _member_story(jobs: dict[str, _Job], key: str) -> str:
    """What the harness knows of member ``key`` ("<job>/member <id>") that exited unexpectedly: its report's end, or
    that it sent none. (An exit code of 255 with a report was multiprocessing's "status unreadable": two threads read
    one child's status pipe, the second got EOF; every status is now read under one lock,
    :class:`torchnext.testing.multiprocess.Child`.)"""
    kind, _, m = key.partition("/member ")
    job = jobs.get(kind)
    if job is None or not m.isdigit():
        return "unknown"
    member = int(m)
    if member in job.job.reports:
        return f"reported ({job.job.reports[member].get('error') or 'finished'}), then exited"
    if member in job.job.errors:
        return "raised: " + job.job.errors[member].strip().splitlines()[-1][:300]
    return "no report"


def _warm_index(faults: list[Injected], warmup: int) -> int:
    return min(warmup, len(faults))


def _warm_sample(job: _Job, faults: list[Injected], warm: int) -> str | None:
    """The survivor's sample taken before this job's first fault after the first ``warm`` faults (of all) at which
    every replica group was in (its backends then have a pair socket per peer, as at the end: a sample taken while
    a victim had not rejoined yet has fewer, and the end would look grown); the first after ``warm`` if none was."""
    later = [f"before {f.index}" for f in faults[warm:] if f.job == job.kind and f"before {f.index}" in job.samples]
    full = [n for n in later if job.samples[n].get("members") == job.size]
    pick = full or later
    return pick[0] if pick else None


def _judge(result: SoakResult, config: SoakConfig, jobs: dict[str, _Job]) -> None:
    checks = result.checks
    limit = config.heartbeat_timeout_s + 1.0 if config.max_gap_s is None else config.max_gap_s
    bound = "heartbeat timeout + 1 s" if config.max_gap_s is None else f"{limit:g} s"
    for j, rep in result.jobs.items():
        checks[f"{j}: committed steps replay exactly"] = rep["oracle"]
        checks[f"{j}: counterparts bitwise equal (>= 2 replica groups)"] = rep["counterparts"]
        gap = rep.get("max_commit_gap")
        checks[f"{j}: survivor's longest commit gap <= {bound}"] = {
            "ok": gap is not None and gap[0] <= limit, "max_gap_s": None if gap is None else gap[0],
            "at_step": None if gap is None else gap[1], "limit_s": limit}
        warm = rep.get("warm_sample")
        samples = rep["samples"]
        checks[f"{j}: survivor's threads, fds flat and RSS within +{config.rss_tolerance:.0%} after warm-up"] = \
            resources_flat(samples.get(warm) if warm else None, samples.get("end"), config.rss_tolerance,
                           config.growth_per_fault)
    expected = {f"{j}/member {m}" for j, job in jobs.items() for m in job.expected_kill}
    bad = {k: c for k, c in result.exit_codes.items()
           if not (c == 0 or (c == -signal.SIGKILL and (k in expected or k.endswith("(killed)"))))}
    aborts = sorted(k for k, c in result.exit_codes.items() if c == -signal.SIGABRT)
    checks["every process exited 0 (or -9 where it was SIGKILLed)"] = {
        "ok": not bad and bool(result.exit_codes), "processes": len(result.exit_codes), "unexpected": bad,
        "unexpected_members": {k: _member_story(jobs, k) for k in bad if "/member " in k},
        "sigabrt": aborts, "killed": sum(1 for c in result.exit_codes.values() if c == -signal.SIGKILL)}
    survived = len([f for f in result.faults if f.recovery_s is not None])
    checks["every scheduled fault injected and recovered from"] = {
        "ok": survived == result.config["scheduled"], "recovered": survived, "scheduled": result.config["scheduled"]}
