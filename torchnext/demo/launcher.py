"""The demo launcher: hosts the coordinator, starts the ranks, injects the faults, and writes the results.

``run_demo(DemoConfig(...)) -> dict`` (the summary) is what ``torchnext demo`` calls. The launcher never trains:
it hosts the coordinator (so no rank's death can take the store down), starts ``ranks`` processes running
:mod:`torchnext.demo.train` -- replica groups of ``shard_size`` ranks (hsdp: local slot ``s`` is rank ``s %
shard_size`` of group ``s // shard_size``; ddp: every rank its own group) -- reads their JSON-lines progress,
kills (SIGKILL) or hangs (SIGSTOP) the chosen ranks when the job reaches the chosen steps (:class:`Fault`), and with
``rejoin`` (the default) restarts the failed replica group from warm standby processes that heal shard by shard from
a live group and join (one set ready ahead: the set for the next rank fault is started when the previous one is
woken). One fault at a time: a fault fires at the first committed step >= its step at which every earlier fault has
recovered (its group's spares joined -- without ``rejoin``: its group left the generation -- or, for the
coordinator, a step committed under the standby; one standby coordinator per coordinator fault). ``chaos`` draws
the faults at random (:mod:`torchnext.demo.chaos`). It finally writes ``summary.json``, ``loss.png``, the Flight
Recorder dumps (``fr/``) and the analyzer's report. Every child process is killed and reaped on the way out,
whatever happened.

Member ids: ``slot + ranks * incarnation`` (incarnation 0 at launch, +1 at every restart of that slot's group).
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from torchnext.demo.fault import Fault

__all__ = ["DemoConfig", "DemoError", "Fault", "run_demo"]

SPARES_AHEAD = 3
"""With rejoin: warm spare sets kept ready for the next rank faults (each restarts one replica group)."""


class DemoError(RuntimeError):
    """The demo could not complete (a rank crashed unexpectedly, a timeout, the coordinator failed)."""


@dataclass(kw_only=True)
class DemoConfig:
    """What ``torchnext demo`` runs."""

    ranks: int = 4
    """Local ranks to launch (all replica groups together)."""
    steps: int = 200
    """Committed training steps."""
    precision: str = "nvfp4"
    """Weight precision: nvfp4, mxfp8, bf16, fp32."""
    parallel: str = "hsdp"
    """``hsdp`` (FSDP2 inside replica groups of ``shard_size`` ranks), ``ddp`` (every rank its own replica group)
    or ``diloco``."""
    shard_size: int = 2
    """hsdp/diloco: ranks per replica group (``ranks`` must be a multiple); ddp: ignored (1)."""
    faults: Sequence[Fault] = (Fault(kind="kill", rank=2, step=20),)
    """Failures to inject, in step order (empty: none)."""
    rejoin: bool = True
    """Restart each failed replica group (from warm standby processes); it heals from a live group and joins. With
    it the default run ends with two replica groups whose shards are compared; without it the killed group stays
    out and only one group finishes (nothing to compare)."""
    chaos: int = 0
    """Inject this many random faults instead of ``faults`` (:func:`torchnext.demo.chaos.chaos_schedule`, seeded
    with ``seed``); 0: ``faults``."""
    batch_size: int = 8
    """Sequences per rank per step."""
    seq_len: int = 64
    """Characters per sequence."""
    seed: int = 0
    """Seed of the model, the data and the ``chaos`` schedule."""
    sync_every: int = 10
    """diloco: inner steps between outer synchronizations; streaming-diloco: between two of one fragment."""
    fragments: int = 2
    """streaming-diloco: fragments synchronized ``sync_every / fragments`` steps apart."""
    outer_dtype: str = "fp32"
    """streaming-diloco: wire format of the outer gradients (fp32, bf16, mxfp8, mxfp4, nvfp4)."""
    out: str = "./torchnext-demo"
    """Output folder."""
    timeout_s: float = 600.0
    """Give up (DemoError) after this long."""
    heartbeat_timeout_s: float = 2.0
    """The coordinator declares a silent rank hung after this long (the library's default is 0.6 s). The demo runs
    4+ training processes (and the warm spares' start-up) on a few cores: on a loaded 2-core machine a rank was
    seen unscheduled for 0.6 s, which removed its healthy group. A ``hang`` fault is detected after this long."""
    lowp_backend: str = "eager"
    """torchnext.lowp.mm.scaled_mm backend for the block-scaled layers."""
    extra_env: dict[str, str] = field(default_factory=dict)
    """Extra environment for the rank processes."""

    @property
    def group_size(self) -> int:
        """Ranks per replica group."""
        return 1 if self.parallel == "ddp" else self.shard_size

    @property
    def groups(self) -> int:
        """Replica groups at launch."""
        return self.ranks // self.group_size

    def schedule(self) -> list[Fault]:
        """The faults to inject, in step order: ``chaos_schedule(chaos, ...)`` when ``chaos`` else ``faults``.

        Raises:
            ValueError: a bad ``chaos`` count (negative, or more than the steps fit).
        """
        if not self.chaos:
            return sorted(self.faults, key=lambda f: f.step)
        from torchnext.demo.chaos import chaos_schedule
        from torchnext.testing.netns import available

        if self.chaos < 0:
            raise ValueError(f"--chaos must be >= 0, got {self.chaos}")
        partition = os.geteuid() == 0 and available()[0]
        return chaos_schedule(self.chaos, steps=self.steps, ranks=self.ranks, seed=self.seed, partition=partition)

    def validate(self) -> None:
        """Check the configuration as a whole.

        Raises:
            ValueError: naming the flag and the value that is wrong.
        """
        from torchnext.demo.train import Parallel

        if self.parallel not in [p.value for p in Parallel]:
            raise ValueError(f"--parallel must be one of {[p.value for p in Parallel]}, got {self.parallel!r}")
        if self.ranks < 2:
            raise ValueError(f"--ranks: the demo needs at least 2 ranks, got {self.ranks}")
        if self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if self.parallel != "ddp":
            if self.shard_size < 1:
                raise ValueError(f"--shard-size must be >= 1, got {self.shard_size}")
            if self.ranks % self.shard_size:
                raise ValueError(f"--ranks {self.ranks} is not divisible by --shard-size {self.shard_size} "
                                 f"(--parallel {self.parallel} runs replica groups of --shard-size ranks)")
        if self.sync_every < 1:
            raise ValueError(f"--sync-every must be >= 1, got {self.sync_every}")
        if self.parallel == "streaming-diloco":
            from torchnext.ft.compression import outer_codec

            if self.fragments < 1 or self.sync_every % self.fragments:
                raise ValueError(f"--fragments {self.fragments} must be >= 1 and divide --sync-every {self.sync_every}")
            try:
                outer_codec(self.outer_dtype)
            except ValueError as exc:
                raise ValueError(f"--outer-dtype: {exc}") from None
        for flag, v in (("--batch-size", self.batch_size), ("--seq-len", self.seq_len)):
            if v < 1:
                raise ValueError(f"{flag} must be >= 1, got {v}")
        if self.timeout_s <= 0:
            raise ValueError(f"--timeout must be positive, got {self.timeout_s}")
        if self.heartbeat_timeout_s <= 0:
            raise ValueError(f"DemoConfig.heartbeat_timeout_s must be positive, got {self.heartbeat_timeout_s}")
        if self.chaos < 0:
            raise ValueError(f"--chaos must be >= 0, got {self.chaos}")
        if self.chaos and not self.rejoin:
            raise ValueError(f"--chaos {self.chaos} needs rejoin (drop --no-rejoin): without it every fault takes a "
                             "replica group away for good")
        faults = self.schedule()
        hit: set[int] = set()
        coordinator_faults = [f for f in faults if f.kind == "coordinator"]
        for f in coordinator_faults:
            if not 0 < f.step < self.steps:
                raise ValueError(f"--fault {f}: step {f.step} must be in (0, --steps {self.steps})")
        if self._partitioned(faults):
            if coordinator_faults:
                raise ValueError("--fault partition and --fault coordinator cannot be combined (the partition run "
                                 "hosts one coordinator process inside the network lab)")
            from torchnext.testing.netns import available

            ok, why = available()
            if not ok:
                raise ValueError(f"--fault partition needs Linux network namespaces (root, iproute2): {why}")
        for f in faults:
            if f.kind == "coordinator":
                continue
            if not 0 <= f.rank < self.ranks:
                raise ValueError(f"--fault {f}: rank {f.rank} is out of range [0, {self.ranks})")
            if not 0 < f.step < self.steps:
                raise ValueError(f"--fault {f}: step {f.step} must be in (0, --steps {self.steps})")
            group = f.rank // self.group_size
            if group in hit and not self.rejoin:
                raise ValueError(f"--fault {f}: replica group {group} (ranks {self._ranks_of(group)}) already failed "
                                 "and does not come back without --rejoin")
            hit.add(group)
        if not self.rejoin and len(hit) >= self.groups:
            raise ValueError(f"--fault: the faults take down every replica group ({self.groups}); keep one alive "
                             "or pass --rejoin")

    @property
    def partitioned(self) -> bool:
        """Whether the run needs a network lab (a ``partition`` fault)."""
        return self._partitioned(self.schedule())

    @staticmethod
    def _partitioned(faults: Sequence[Fault]) -> bool:
        return any(f.kind == "partition" for f in faults)

    def _ranks_of(self, group: int) -> list[int]:
        return list(range(group * self.group_size, (group + 1) * self.group_size))


@dataclass
class _Rank:
    member: int
    slot: int
    incarnation: int
    proc: subprocess.Popen[str]
    log: IO[str]
    started: float
    state: str = "running"  # standby | running | killed | hung | partitioned | removed | done | failed
    joined: bool = False
    session: str | None = None
    """Its membership session once joined (``FaultTolerant.session``: leader / follower / flat)."""
    warm: bool = False
    """A standby process that reported it is ready (built, warmed up, waiting for the wake-up)."""
    first_step: tuple[int, int, int] | None = None
    """(step, threads, fds) of this process at the first step it reported."""


@dataclass
class _Injected:
    fault: Fault
    at: float
    member: int
    group_members: list[int]
    standby: list[int] = field(default_factory=list)
    fired_step: int = -1
    """The committed step at which it fired (>= ``fault.step``: a fault waits for the previous one's recovery)."""
    woken: bool = False
    removed_at: float | None = None
    """When the launcher saw the generation without the failed group (``time.monotonic()``)."""
    recovered_at: float | None = None
    """When the job was whole again: the restarted group's members all joined (without rejoin: ``removed_at``);
    a coordinator fault: the first step committed after it."""


class _Launcher:
    def __init__(self, cfg: DemoConfig, on_event: Callable[[dict[str, Any]], None], coordinator: str, token: str,
                 store_port: int, *, store_host: str = "127.0.0.1", lab: Any = None) -> None:
        self.cfg = cfg
        self.on_event = on_event
        self.coordinator, self.token, self.store_port = coordinator, token, store_port
        self.store_host = store_host
        self.lab = lab  # a NetLab: rank slot i runs on host i, spares on hosts ranks + 1, ...
        self.host_of: dict[int, int] = {}
        self._next_spare_host = cfg.ranks + 1
        self.out = Path(cfg.out)
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.ranks: dict[int, _Rank] = {}
        self.losses: dict[int, float] = {}
        self.step_at: dict[int, float] = {}  # when the first rank reported each committed step
        self.sizes: list[tuple[int, int]] = []  # (step, replica groups) whenever the count changes
        self.injected: list[_Injected] = []
        self.reconfigs: list[dict[str, Any]] = []
        self.done: dict[int, dict[str, Any]] = {}
        self.removed: dict[int, dict[str, Any]] = {}
        self.spares: dict[int, list[int]] = {}  # fault index -> the warm spares that restart its group
        self._restarts: dict[int, int] = {}  # replica group -> restarts prepared so far (the spares' incarnation)

    def member_id(self, slot: int, incarnation: int) -> int:
        return slot + self.cfg.ranks * incarnation

    def group_of(self, slot: int) -> int:
        return slot // self.cfg.group_size

    # ---------------------------------------------------------------------------------------------- processes
    def spawn(self, slot: int, incarnation: int, *, standby: bool = False) -> int:
        cfg = self.cfg
        member = self.member_id(slot, incarnation)
        env = dict(os.environ)
        env.update(cfg.extra_env)
        env.update({"TORCHNEXT_FT_COORDINATOR": self.coordinator, "TORCHNEXT_FT_TOKEN": self.token,
                    "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        cmd = [sys.executable, "-m", "torchnext.demo.train", "--steps", str(cfg.steps), "--precision", cfg.precision,
               "--batch-size", str(cfg.batch_size), "--seq-len", str(cfg.seq_len), "--seed", str(cfg.seed),
               "--out", str(self.out), "--member-id", str(member), "--lowp-backend", cfg.lowp_backend,
               "--min-size", str(_min_groups(cfg.groups)), "--parallel", cfg.parallel,
               "--sync-every", str(cfg.sync_every), "--fragments", str(cfg.fragments), "--outer-dtype", cfg.outer_dtype,
               *(["--standby"] if standby else [])]
        if cfg.parallel != "ddp":
            cmd += ["--replica-group", str(self.group_of(slot)), "--group-rank", str(slot % cfg.group_size),
                    "--group-size", str(cfg.group_size), "--incarnation", str(incarnation),
                    "--store", f"{self.store_host}:{self.store_port}"]
        if self.lab is not None:
            host = slot if not standby else self._next_spare_host
            if standby:
                self._next_spare_host += 1
            self.host_of[member] = host
            cmd = [*self.lab.prefix(host), *cmd]
        log = open(self.out / "logs" / f"member_{member}.log", "w")
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                                    start_new_session=True, stdin=subprocess.PIPE if standby else subprocess.DEVNULL)
        except BaseException:
            log.close()
            raise
        self.ranks[member] = _Rank(member, slot, incarnation, proc, log, time.monotonic(),
                                   state="standby" if standby else "running")
        threading.Thread(target=self._reader, args=(member, proc), daemon=True, name=f"demo-reader-{member}").start()
        return member

    def prepare_spares(self, faults: Sequence[Fault]) -> None:
        """Start warm spares for the next rank faults that have none, until ``SPARES_AHEAD`` sets wait: not one set
        per fault at launch (a long chaos run would start hundreds of processes), but enough that a set warms up
        (seconds on a loaded machine) while the one before is used."""
        if not self.cfg.rejoin:
            return
        waiting = sum(any(self.ranks[m].state == "standby" for m in ms) for ms in self.spares.values())
        for i, f in enumerate(faults):
            if waiting >= SPARES_AHEAD:
                return
            if f.kind == "coordinator" or i in self.spares:
                continue
            g = self.group_of(f.rank)
            self._restarts[g] = self._restarts.get(g, 0) + 1
            self.spares[i] = [self.spawn(s, self._restarts[g], standby=True) for s in self.cfg._ranks_of(g)]
            waiting += 1

    def wake(self, member: int) -> None:
        """Tell a warm spare to join now."""
        r = self.ranks[member]
        if r.proc.stdin is None:
            raise DemoError(f"member {member} is not a standby process")
        r.proc.stdin.write("join\n")
        r.proc.stdin.flush()
        r.state = "running"

    def current(self, slot: int) -> _Rank | None:
        """The running process of ``slot`` (its newest incarnation), if any."""
        procs = [r for r in self.ranks.values() if r.slot == slot and r.state == "running"]
        return max(procs, key=lambda r: r.incarnation) if procs else None

    def _reader(self, member: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                continue
            ev["_member"] = member
            ev["_t"] = time.monotonic()
            self.events.put(ev)
        self.events.put({"event": "exit", "_member": member, "_t": time.monotonic(), "code": proc.wait()})

    def cleanup(self, grace_s: float = 0.0) -> None:
        """Kill (SIGKILL, whole process group) and reap every child; those that finished get ``grace_s`` to exit."""
        deadline = time.monotonic() + grace_s
        for r in self.ranks.values():
            if r.state == "done":
                try:
                    r.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for r in self.ranks.values():
            try:
                os.killpg(r.proc.pid, signal.SIGKILL)  # also any child it started; a stopped one dies too
            except (ProcessLookupError, PermissionError):
                pass
        for r in self.ranks.values():
            try:
                r.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL cannot be ignored
                pass
            for stream in (r.proc.stdin, r.proc.stdout):
                if stream is not None:
                    try:
                        stream.close()
                    except OSError:
                        pass
            r.log.close()


def _min_groups(groups: int) -> int:
    """The quorum: one replica group may carry on alone when the job has at most two."""
    return 1 if groups <= 2 else 2


def _log_tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def run_demo(cfg: DemoConfig, on_event: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run the demo end to end and return the summary (also written to ``<out>/summary.json``).

    Raises:
        ValueError: a bad configuration (:meth:`DemoConfig.validate`).
        DemoError: a rank crashed unexpectedly, or the demo did not finish within ``cfg.timeout_s``.
    """
    from torchnext.ft import Coordinator, CoordinatorConfig, MembershipConfig
    from torchnext.ft.coordinator import bound_store

    cfg.validate()
    if cfg.parallel in ("diloco", "streaming-diloco"):
        from torchnext.demo.train import _require_diloco

        _require_diloco()
    emit = on_event or (lambda ev: None)
    out = Path(cfg.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    for old in ("fr", "fr_shard"):
        shutil.rmtree(out / old, ignore_errors=True)
    (out / "fr").mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    faults = cfg.schedule()
    groups = cfg.groups
    membership = MembershipConfig(min_size=_min_groups(groups), initial_size=groups,
                                  heartbeat_timeout_s=cfg.heartbeat_timeout_s)
    lab: Any = None
    lab_coordinator: Any = None
    coordinators: list[Any] = []
    group_store: Any = None
    if cfg.partitioned:
        lab, lab_coordinator, launcher = _start_lab(cfg, emit, faults)
        coord: Any = None
    else:
        coord = Coordinator(CoordinatorConfig(membership=membership))
        coord.start()
        coordinators = [coord]
        # one standby per coordinator fault, in the members' address order: each takeover leaves the next standby
        # for the next coordinator fault
        for _ in range(sum(f.kind == "coordinator" for f in faults)):
            coordinators.append(Coordinator(CoordinatorConfig(standby=True, token=coord.token,
                                                              membership=membership)).start())
        addresses = ",".join(c.address for c in coordinators)
        # the replica groups' own process groups rendezvous at a store of the launcher's: it outlives any coordinator
        group_store = bound_store("127.0.0.1")
        launcher = _Launcher(cfg, emit, addresses, coord.token, group_store.port)
    error: BaseException | None = None
    history: list[dict[str, Any]] = []
    try:
        for slot in range(cfg.ranks):
            launcher.spawn(slot, 0)
        launcher.prepare_spares(faults)
        emit({"event": "launched", "ranks": cfg.ranks, "groups": groups, "coordinator": launcher.coordinator})
        pending = list(range(len(faults)))
        deadline = t_start + cfg.timeout_s
        while True:
            if not any(r.state in ("running", "hung", "partitioned") for r in launcher.ranks.values()):
                if launcher.done:
                    break
                raise DemoError("no rank is left training (every replica group failed or was removed)")
            if time.monotonic() > deadline:
                raise DemoError(f"the demo did not finish within {cfg.timeout_s:.0f} s (--timeout)")
            try:
                ev = launcher.events.get(timeout=0.2)
            except queue.Empty:
                continue
            kind, member = ev["event"], ev["_member"]
            rank = launcher.ranks[member]
            if kind == "joined":
                rank.joined = True
                rank.session = ev.get("session")
                for inj in launcher.injected:
                    if inj.recovered_at is None and inj.standby and all(launcher.ranks[m].joined for m in inj.standby):
                        inj.recovered_at = float(ev["_t"])
            elif kind == "standby":
                rank.warm = True
            elif kind == "step":
                step = int(ev["step"])
                launcher.losses.setdefault(step, float(ev["loss"]))
                launcher.step_at.setdefault(step, time.monotonic())
                if rank.first_step is None:
                    rank.first_step = (step, int(ev.get("threads", -1)), int(ev.get("fds", -1)))
                if not launcher.sizes or launcher.sizes[-1][1] != ev["size"]:
                    launcher.sizes.append((step, int(ev["size"])))
                for inj in launcher.injected:
                    if inj.fault.kind == "coordinator" and inj.recovered_at is None and step > inj.fault.step:
                        inj.recovered_at = float(ev["_t"])
                # one fault at a time, in step order: the first pending one fires once it is due and every
                # earlier fault has recovered
                if pending and all(inj.recovered_at is not None for inj in launcher.injected):
                    i = pending[0]
                    f = faults[i]
                    if f.kind == "coordinator":
                        if step >= f.step:
                            pending.pop(0)
                            _kill_coordinator(launcher, f, coordinators, step, emit)
                    else:
                        victim = launcher.current(f.rank)
                        spares = launcher.spares.get(i, [])
                        # not yet, its group is still (re)starting, or its spares are still warming up
                        if (step >= f.step and victim is not None and victim.joined
                                and all(launcher.ranks[m].warm for m in spares)
                                and (spares or not cfg.rejoin)):
                            pending.pop(0)
                            _inject(launcher, f, victim, spares, step, emit)
            elif kind == "reconfigured":
                launcher.reconfigs.append(ev)
                now_members = set(ev["members"])
                for inj in launcher.injected:
                    if not inj.woken and not now_members & set(inj.group_members):
                        # the failed group is out of the generation: let a hung rank run again (it must be
                        # refused), and restart the group from its warm spares
                        for m in inj.group_members:
                            r = launcher.ranks[m]
                            if r.state == "hung":
                                os.killpg(r.proc.pid, signal.SIGCONT)
                                r.state = "removed"
                            elif r.state == "partitioned":
                                launcher.lab.reconnect([launcher.host_of[m]])
                                r.state = "removed"
                        inj.removed_at = float(ev["_t"])
                        if not inj.standby:
                            inj.recovered_at = inj.removed_at
                        inj.woken = True
                        for m in inj.standby:
                            launcher.wake(m)
                        if inj.standby:
                            emit({"event": "rejoin_started", "members": inj.standby,
                                  "group": launcher.group_of(inj.fault.rank)})
                            launcher.prepare_spares(faults)
            elif kind == "removed":
                launcher.removed[member] = ev
                if rank.state in ("running", "removed"):
                    rank.state = "removed"
            elif kind == "done":
                launcher.done[member] = ev
                rank.state = "done" if rank.state == "running" else rank.state
            elif kind == "exit":
                if rank.state in ("running", "standby") and member not in launcher.done:
                    rank.state = "failed"
                    raise DemoError(f"member {member} (rank {rank.slot}) exited unexpectedly (code {ev['code']}); "
                                    "its log:\n" + _log_tail(out / "logs" / f"member_{member}.log"))
            emit(ev)
    except BaseException as exc:
        error = exc
        raise
    finally:
        try:
            history = sorted((h for c in coordinators for h in c.history()), key=lambda h: h.get("at", 0.0))
        finally:
            launcher.cleanup(grace_s=5.0 if error is None else 0.0)
            for c in coordinators:
                c.stop()
            del group_store
            if lab_coordinator is not None:
                lab_coordinator.close()
            if lab is not None:
                lab.close()
        summary = _summarize(cfg, launcher, faults, history, time.monotonic() - t_start, error)
    return summary


def _start_lab(cfg: DemoConfig, emit: Callable[[dict[str, Any]], None],
               faults: Sequence[Fault]) -> tuple[Any, Any, _Launcher]:
    """The partition run: a NetLab with one host per rank, one for the coordinator (a ``torchnext coordinator``
    process: an in-process one would not be reachable from the hosts; its store is where the groups rendezvous) and
    one per spare rank."""
    import secrets

    from torchnext.testing.coordinators import CoordinatorProcess
    from torchnext.testing.netns import NetLab

    spares = cfg.group_size * len(faults) if cfg.rejoin else 0
    lab = NetLab(cfg.ranks + 1 + spares)
    try:
        token = secrets.token_hex(16)
        host = cfg.ranks
        proc = CoordinatorProcess(token, host=lab.address(host), prefix=lab.prefix(host), min_size=_min_groups(cfg.groups),
                                  initial_size=cfg.groups, heartbeat_timeout_s=cfg.heartbeat_timeout_s).start()
        m = re.search(r"store port (\d+)", proc.output())
        if m is None:
            proc.close()
            raise DemoError(f"the coordinator did not say its store port: {proc.output()[-500:]}")
    except BaseException:
        lab.close()
        raise
    emit({"event": "lab", "hosts": lab.hosts, "coordinator": proc.address})
    launcher = _Launcher(cfg, emit, proc.address, token, int(m.group(1)), store_host=lab.address(host), lab=lab)
    return lab, proc, launcher


def _kill_coordinator(launcher: _Launcher, f: Fault, coordinators: Sequence[Any], step: int,
                      emit: Callable[[dict[str, Any]], None]) -> None:
    """Kill the coordinator in office (the first of ``coordinators`` that was not killed yet: members try the
    addresses in order, so the next standby in the list is the one that took over)."""
    from torchnext.testing.faults import drop_coordinator

    killed = sum(inj.fault.kind == "coordinator" for inj in launcher.injected)
    if killed >= len(coordinators) - 1:
        raise DemoError(f"--fault {f}: no standby coordinator left to take over")
    at = time.monotonic()
    drop_coordinator(coordinators[killed])
    launcher.injected.append(_Injected(f, at, -1, [], fired_step=step))
    emit({"event": "fault", "kind": "coordinator", "rank": -1, "member": None, "group": None, "step": step})


def _inject(launcher: _Launcher, f: Fault, victim: _Rank, standby: list[int], step: int,
            emit: Callable[[dict[str, Any]], None]) -> None:
    group = launcher.group_of(f.rank)
    siblings = [r.member for r in launcher.ranks.values()
                if r.state == "running" and launcher.group_of(r.slot) == group and r.incarnation == victim.incarnation]
    at = time.monotonic()
    if f.kind == "kill":
        os.killpg(victim.proc.pid, signal.SIGKILL)
        victim.state = "killed"
    elif f.kind == "partition":
        launcher.lab.isolate([launcher.host_of[victim.member]])
        victim.state = "partitioned"
    else:
        os.killpg(victim.proc.pid, signal.SIGSTOP)
        victim.state = "hung"
    launcher.injected.append(_Injected(f, at, victim.member, sorted(siblings), standby, fired_step=step))
    emit({"event": "fault", "kind": f.kind, "rank": f.rank, "member": victim.member, "group": group, "step": step})


def _summarize(cfg: DemoConfig, launcher: _Launcher, faults: Sequence[Fault], history: list[dict[str, Any]],
               wall: float, error: BaseException | None = None) -> dict[str, Any]:
    out = Path(cfg.out)
    failures: list[dict[str, Any]] = []
    for inj in launcher.injected:
        if inj.fault.kind == "coordinator":
            took = next((h for h in history if h["event"] == "takeover" and h["at"] >= inj.at), None)
            after = [t for t in launcher.step_at.values() if t > inj.at]
            next_commit = round(min(after) - inj.at, 4) if after else None
            failures.append({
                "kind": "coordinator", "rank": None, "member": None, "group": None, "step": inj.fault.step,
                "fired_step": inj.fired_step,
                "takeover_s": None if took is None else round(took["at"] - inj.at, 4),
                "next_commit_s": next_commit,
                "recovery_s": next_commit,  # training went on: the standby in office committed a step
                "survived": inj.recovered_at is not None,
            })
            continue
        group = set(inj.group_members)
        detected = next((h for h in history if h["at"] >= inj.at and (
            (h["event"] in ("failure", "group_failure") and h.get("member") in group) or h["event"] == "report")),
            None)
        gen = next((h for h in history if detected is not None and h["event"] == "generation"
                    and h["at"] >= detected["at"] and not group & set(h["members"])), None)
        built = [ev["timings"]["built"] for ev in launcher.reconfigs
                 if gen is not None and ev.get("generation") == gen["gen"] and ev["timings"].get("built")]
        detect = None if detected is None else round(detected["at"] - inj.at, 4)
        agree = None if detected is None or gen is None else round(gen["at"] - detected["at"], 4)
        rebuild = None if gen is None or not built else round(max(built) - gen["at"], 4)
        recovery = (round(detect + agree + rebuild, 4)
                    if detect is not None and agree is not None and rebuild is not None else None)
        if recovery is None and inj.fault.kind == "partition" and inj.removed_at is not None:
            # the network lab's coordinator is a process whose history the launcher cannot read: the survivors'
            # generation without the cut-off group (detect + agree; its rebuild takes milliseconds)
            recovery = round(inj.removed_at - inj.at, 4)
        failures.append({
            "kind": inj.fault.kind,
            "rank": inj.fault.rank,
            "member": inj.member,
            "group": launcher.group_of(inj.fault.rank),
            "step": inj.fault.step,
            "fired_step": inj.fired_step,
            "detect_s": detect,
            "agree_s": agree,
            "rebuild_s": rebuild,
            "removed_s": None if inj.removed_at is None else round(inj.removed_at - inj.at, 4),
            # the survivors training again without the failed group
            "recovery_s": recovery,
            # its restarted group (warm spares) healed and joined
            "rejoined_s": (None if not inj.standby or inj.recovered_at is None
                           else round(inj.recovered_at - inj.at, 4)),
            "survived": inj.recovered_at is not None,
        })
    by_group_rank: dict[int, set[str]] = {}
    for m, d in launcher.done.items():
        by_group_rank.setdefault(launcher.ranks[m].slot % cfg.group_size, set()).add(d["digest"])
    losses = [launcher.losses[s] for s in sorted(launcher.losses)]
    final_groups = sorted({launcher.group_of(launcher.ranks[m].slot) for m in launcher.done})
    # every rank holds the same local state (parameter shards + optimizer state) as its counterpart -- the same
    # group rank -- in every other live replica group; with fewer than two groups there is nothing to compare
    equal: bool | None = None
    if len(final_groups) >= 2:
        equal = all(len(d) == 1 for d in by_group_rank.values())
        reason = None
    elif final_groups:
        reason = "only 1 replica group finished: nothing to compare"
    else:
        reason = "no replica group finished"
    recoveries = [f["recovery_s"] for f in failures if f["recovery_s"] is not None]
    survived: dict[str, int] = {}
    for f in failures:
        if f["survived"] and error is None:
            survived[f["kind"]] = survived.get(f["kind"], 0) + 1
    summary = {
        "parallel": cfg.parallel,
        "steps_completed": max(launcher.losses) if launcher.losses else 0,
        "initial_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "world_size_history": [{"step": s, "size": n, "ranks": n * cfg.group_size} for s, n in launcher.sizes],
        "failures": failures,
        "params_equal_across_ranks": equal,
        "params_equal_reason": reason,
        "final_members": sorted(launcher.done),
        "digests": {str(m): d["digest"] for m, d in sorted(launcher.done.items())},
        "final_groups": final_groups,
        "replica_groups_compared": len(final_groups),  # < 2: nothing to compare (params_equal_across_ranks null)
        "removed_members": sorted(launcher.removed),
        # how each process that joined held its membership: by default a replica group of several ranks holds one
        # group session (its rank 0 "leader" speaks to the coordinator for its "follower"s); a DDP rank is "flat"
        "sessions": {str(m): r.session for m, r in sorted(launcher.ranks.items()) if r.session is not None},
        "chaos": cfg.chaos,
        "faults_scheduled": [str(f) for f in faults],
        "faults_injected": len(launcher.injected),
        # a fault counts once the job was whole again after it (its group rejoined, or left without rejoin; the
        # standby coordinator committed a step) and the run ended without an error
        "faults_survived": survived,
        "recovery_s": {"n": len(recoveries), "p50": _percentile(recoveries, 50), "p99": _percentile(recoveries, 99)},
        "resources": _resources(launcher),
        "precision": cfg.precision,
        "wall_s": round(wall, 2),
        "error": None if error is None else f"{type(error).__name__}: {error}",
        "config": {**asdict(cfg), "faults": [str(f) for f in faults]},
    }
    (out / "coordinator_history.json").write_text(json.dumps(history, indent=1, default=str))
    (out / "loss.json").write_text(json.dumps({str(s): launcher.losses[s] for s in sorted(launcher.losses)}))
    summary["loss_plot"] = _plot_loss(out / "loss.png", launcher.losses, failures).name
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _percentile(values: Sequence[float], q: float) -> float | None:
    from torchnext.demo.chaos import percentile

    p = percentile(values, q)
    return None if p is None else round(p, 4)


def _resources(launcher: _Launcher) -> dict[str, Any] | None:
    """Threads and fds of the longest-lived finished rank (the earliest first step; the lowest member id among
    ties) at its first step and at its end: growth across the faults it survived is a leak."""
    lived = [(r.first_step, m) for m, r in launcher.ranks.items() if m in launcher.done and r.first_step is not None]
    if not lived:
        return None
    (first, threads, fds), m = min(lived, key=lambda x: (x[0][0], x[1]))
    end = launcher.done[m]
    return {"member": m, "from_step": first, "to_step": end.get("steps"),
            "threads": [threads, end.get("threads", -1)], "fds": [fds, end.get("fds", -1)]}


def _plot_loss(path: Path, losses: dict[int, float], failures: list[dict[str, Any]]) -> Path:
    """Loss vs step with the failures marked: ``loss.png`` with matplotlib, else a dependency-free ``loss.svg``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        svg = path.with_suffix(".svg")
        svg.write_text(_loss_svg(losses, failures))
        return svg
    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=110)
    steps = sorted(losses)
    ax.plot(steps, [losses[s] for s in steps], color="#1f77b4", lw=1.8, label="loss (nats/char)")
    for f in failures:
        ax.axvline(f["step"], color="#d62728", ls="--", lw=1.2, label=f"{f['kind']} rank {f['rank']}")
    ax.set_xlabel("committed step")
    ax.set_ylabel("loss")
    ax.set_title("torchnext demo: fault-tolerant low-precision MoE training")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _loss_svg(losses: dict[int, float], failures: list[dict[str, Any]], w: int = 700, h: int = 320) -> str:
    steps = sorted(losses)
    if not steps:
        return f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}"></svg>'
    x0, x1 = steps[0], max(steps[-1], steps[0] + 1)
    lo, hi = min(losses.values()), max(losses.values())
    hi = hi if hi > lo else lo + 1.0
    pad = 40

    def xy(s: float, v: float) -> str:
        return f"{pad + (s - x0) / (x1 - x0) * (w - 2 * pad):.1f},{h - pad - (v - lo) / (hi - lo) * (h - 2 * pad):.1f}"

    points = " ".join(xy(s, losses[s]) for s in steps)
    marks = "".join(
        f'<line x1="{xy(f["step"], lo).split(",")[0]}" y1="{pad}" x2="{xy(f["step"], lo).split(",")[0]}" '
        f'y2="{h - pad}" stroke="#d62728" stroke-dasharray="6,4"/>'
        f'<text x="{xy(f["step"], hi).split(",")[0]}" y="{pad - 6}" fill="#d62728" font-size="12">'
        f'{f["kind"]} rank {f["rank"]}</text>'
        for f in failures
    )
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif">'
            f'<rect width="{w}" height="{h}" fill="white"/>'
            f'<text x="{pad}" y="18" font-size="14">torchnext demo: loss (nats/char) vs committed step, '
            f'{losses[steps[0]]:.2f} → {losses[steps[-1]]:.2f}</text>'
            f'<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="{points}"/>{marks}'
            f'<text x="{pad}" y="{h - 10}" font-size="12">step {x0}</text>'
            f'<text x="{w - pad - 60}" y="{h - 10}" font-size="12">step {x1}</text></svg>')
