"""Fault-tolerant DDP and HSDP jobs for tests and benchmarks: torch's DDP / FSDP2 on the fault-tolerant group.

Two workloads, both launched per process by :class:`~torchnext.testing.ft_workload.FTJob` with a
:class:`ParallelSpec`:

* ``ddp`` -- every process is its own replica group; torch's ``DistributedDataParallel`` (through
  :class:`torchnext.ft.DistributedDataParallel`) averages the gradients of four float64 parameters, one DDP bucket
  each. Gradients are integers times 12, so the average over 1..4 live groups is exact and the weights can be
  replayed bitwise from the commit record (:func:`ddp_expected_weights`)::

      for s, members in enumerate(step_members):
          for i in range(4): w[i] -= sum(ddp_gradient(s, m, i) for m in members) / len(members)

* ``hsdp`` -- replica groups of ``group_size`` processes: FSDP2 shards a small MLP inside each group (its own
  ``init_process_group("torchnext")``) and ``ft.device_mesh`` all-reduces gradient shards across the live groups;
  Adam state is healed shard by shard. Checked by counterpart equality (rank ``r`` of every live group holds the
  same bytes) and against plain HSDP (:func:`hsdp_reference`).

Faults (:class:`~torchnext.testing.faults.Fault`, ``member`` = the process's ``member_id``) fire at ``IDLE`` (between
steps) or ``COLLECTIVE`` -- inside backward, from the gradient hook of the parameter reduced last, 5 ms after the
earlier buckets' all-reduces were issued (peers are blocked in them). ``signal_kills`` lets a test kill from outside:
SIGUSR2 = die at the next idle point, SIGRTMIN = die inside the next backward.
"""

from __future__ import annotations

import array
import collections
import faulthandler
import hashlib
import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from torchnext.testing import procfs
from torchnext.testing.faults import Fault, FaultInjector, FaultKind, FaultPoint

__all__ = ["STACKS_SIGNAL", "ParallelSpec", "check_sessions", "ddp_expected_weights", "ddp_gradient", "hsdp_model",
           "hsdp_reference", "run_parallel"]

STACKS_SIGNAL = signal.SIGRTMIN + 2
"""The signal on which a member with ``ParallelSpec.stacks_file`` dumps its stacks (SIGUSR1/2 and SIGRTMIN are
fault triggers)."""
LONG_GAP_S = 1.0
"""A gap between two commits this long is recorded (``long_gaps``): a soak correlates them with its faults."""
DIM = 32
N_PARAMS = 4
HSDP_IN, HSDP_HIDDEN, HSDP_OUT, HSDP_BATCH = 16, 32, 4, 8


@dataclass(kw_only=True)
class ParallelSpec:
    """What one process of a fault-tolerant DDP/HSDP job does."""

    coordinator: str
    token: str
    store_port: int
    """The coordinator's TCPStore port (HSDP: each replica group's own process group rendezvous there)."""
    member_id: int
    """The process's id (the FT member id too); faults target it."""
    steps: int
    parallel: str = "ddp"
    """``"ddp"`` or ``"hsdp"``."""
    group: int = 0
    """HSDP: the replica group id (ignored for ddp: every process is its own group)."""
    group_rank: int = 0
    group_size: int = 1
    incarnation: int = 0
    """HSDP: bumped when a group is restarted (its process group rendezvous under a fresh prefix)."""
    faults: Sequence[Fault] = ()
    timeout_s: float = 30.0
    step_sleep_s: float = 0.0
    stop_file: str | None = None
    """If set: train until the step count written in this file (checked between steps) instead of ``steps``."""
    signal_kills: bool = False
    vote_early: bool = False
    """FT-DDP: ``DistributedDataParallel(vote_early=True)`` (the vote sent when backward's last bucket is reduced)."""
    defer_commit: bool = False
    """``FaultTolerantConfig(defer_commit=True)``: each step's decision awaited one step later, its optimizer update
    applied provisionally (the commit record then follows confirmations, not ``step.commit()``)."""
    find_unused_parameters: bool | None = None
    """FT-DDP: ``DistributedDataParallel(find_unused_parameters=...)``; None: its default."""
    fault_log: str | None = None
    """Append ``"<time.time()> <member>"`` right before a self-inflicted fault (benchmarks time recovery from it)."""
    signal_raises: bool = False
    """SIGUSR1: inside this process's next backward (the hook of ``signal_kills``' SIGRTMIN), its next fault-tolerant
    collective raises ``PeerFailure`` from inside the op call, on this process only (``FaultKind.RAISE_IN_OP``)."""
    raise_log: str | None = None
    """Append ``{"member", "t"}`` (``time.monotonic()``) right before a ``signal_raises`` raise fires: the signal
    only arms it, and the member's next backward may come much later (a harness times recovery from this)."""
    start_file: str | None = None
    """A warm spare: build the model (HSDP: and the replica group's process group), then wait until this file exists
    before joining. If ``stop_file`` appears first, end without joining (report ``error`` "spare not used")."""
    idle_until_started: bool = False
    """A warm spare (``start_file``) builds and waits at ``SCHED_IDLE`` -- on a machine shared with the job it
    trains beside, its start takes no CPU from the members -- and returns every thread to ``SCHED_OTHER`` when it
    starts -- the moment its go-file appears, also mid-build; only where that return is allowed (``CAP_SYS_NICE``,
    or ``RLIMIT_NICE`` >= 20: probed on a thread first), else at normal priority throughout."""
    event_log: str | None = None
    """Append one JSON line per generation this process commits in: ``{"member", "gen", "members", "step",
    "commit"}`` (``step``: the step index of its first commit here; ``commit``: ``time.monotonic()`` of it)."""
    resource_log: str | None = None
    """Append ``{"t", "step", "threads", "fds", "rss_kib"}`` (this process's own ``/proc/self`` counts, taken between
    steps) every ``resource_every_s`` seconds."""
    resource_every_s: float = 0.5
    group_store_file: str | None = None
    """HSDP: rank 0 of the replica group hosts the group's rendezvous TCPStore on 127.0.0.1 (port 0) and writes its
    port here; the other ranks read it (instead of ``store_port``). The store lives and dies with its group."""
    netns: str | None = None
    """Run inside this network namespace (a host of a :class:`~torchnext.testing.netns.NetLab`)."""
    leader_address: str | None = None
    """HSDP: the replica group's session address (``FaultTolerantConfig.leader_address``: rank 0 holds the group's
    one coordinator connection and relays for its sibling); None: derived through the group's store (the default)."""
    group_session: bool | None = None
    """HSDP: ``FaultTolerantConfig.group_session`` (None: the default, a group session; False: every rank flat)."""
    stacks_file: str | None = None
    """If set: :data:`STACKS_SIGNAL` appends every thread's Python stack to this file (``faulthandler``) -- a harness
    whose bounded wait ran out asks every live process where it is."""

    def __post_init__(self) -> None:
        if self.parallel not in ("ddp", "hsdp"):
            raise ValueError(f"ParallelSpec.parallel must be 'ddp' or 'hsdp', got {self.parallel!r}")
        if not 0 <= self.group_rank < self.group_size:
            raise ValueError(f"ParallelSpec: group_rank={self.group_rank} must be in [0, group_size={self.group_size})")


# ------------------------------------------------------------------------------------------------------ the math
def ddp_gradient(step: int, member: int, i: int) -> torch.Tensor:
    """The integer gradient (times 12: exact averages over 1..4 groups) of parameter ``i`` from ``member``."""
    return ((torch.arange(DIM, dtype=torch.float64) % 7) * (member + 1) + (step + 1) + 3 * i) * 12


def ddp_expected_weights(step_members: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """The four parameters after committing step ``s`` with members ``step_members[s]`` (w0 = 0, SGD lr=1, AVG)."""
    ws = [torch.zeros(DIM, dtype=torch.float64) for _ in range(N_PARAMS)]
    for s, members in enumerate(step_members):
        for i in range(N_PARAMS):
            ws[i] -= sum((ddp_gradient(s, m, i) for m in members), torch.zeros(DIM, dtype=torch.float64)) / len(members)
    return ws


class _DDPModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ws = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(DIM, dtype=torch.float64))
                                         for _ in range(N_PARAMS))

    def forward(self, cs: list[torch.Tensor]) -> torch.Tensor:
        # parameter i's term is built in order: backward reaches them in reverse, the order of DDP's buckets
        return sum(((w * c).sum() for w, c in zip(self.ws, cs, strict=True)), torch.zeros((), dtype=torch.float64))


def hsdp_model() -> torch.nn.Module:
    """The HSDP workload's model (same initial values on every process)."""
    g = torch.Generator().manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(HSDP_IN, HSDP_HIDDEN), torch.nn.ReLU(),
                            torch.nn.Linear(HSDP_HIDDEN, HSDP_HIDDEN), torch.nn.ReLU(),
                            torch.nn.Linear(HSDP_HIDDEN, HSDP_OUT))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return m


def hsdp_batch(step: int, group: int, group_rank: int) -> torch.Tensor:
    """The input of rank ``group_rank`` of replica group ``group`` at step ``step``."""
    return torch.randn(HSDP_BATCH, HSDP_IN, generator=torch.Generator().manual_seed(1000 * step + 10 * group
                                                                                      + group_rank))


def hsdp_reference(groups: int, group_size: int, steps: int) -> list[torch.Tensor]:
    """Full (unsharded) parameters after ``steps`` of plain data parallelism over ``groups * group_size`` ranks with
    the HSDP workload's data and Adam(lr=0.01) -- what FT-HSDP without faults must match (to float32 rounding)."""
    m = hsdp_model()
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    for s in range(steps):
        grads = [torch.zeros_like(p) for p in m.parameters()]
        for g in range(groups):
            for r in range(group_size):
                m.zero_grad()
                m(hsdp_batch(s, g, r)).square().mean().backward()
                for acc, p in zip(grads, m.parameters(), strict=True):
                    acc += p.grad  # type: ignore[arg-type]
        for acc, p in zip(grads, m.parameters(), strict=True):
            p.grad = acc / (groups * group_size)
        opt.step()
    return [p.detach().clone() for p in m.parameters()]


# ------------------------------------------------------------------------------------------------------ workers
def run_parallel(spec: ParallelSpec) -> dict[str, Any]:
    """Train fault-tolerantly with torch's DDP or FSDP2; return a report (membership ends are in ``error``)."""
    import torch.distributed as dist

    from torchnext.ft import FaultTolerant, FaultTolerantConfig, MembershipError
    from torchnext.ft.state import load_sharded_state, sharded_state

    idle = _IdleUntil.start(spec.start_file) if spec.start_file is not None and spec.idle_until_started else None
    torch.set_num_threads(1)
    if spec.stacks_file is not None:
        stacks = open(spec.stacks_file, "a")  # faulthandler writes to it until the process ends
        faulthandler.register(STACKS_SIGNAL, file=stacks, all_threads=True, chain=False)
    injector = FaultInjector(spec.faults, spec.member_id)
    doomed = [""]
    if spec.signal_kills:
        signal.signal(signal.SIGUSR2, lambda *_: doomed.__setitem__(0, "idle"))
        signal.signal(signal.SIGRTMIN, lambda *_: doomed.__setitem__(0, "collective"))
    if spec.signal_raises:
        signal.signal(signal.SIGUSR1, lambda *_: doomed.__setitem__(0, "raise"))
    hsdp = spec.parallel == "hsdp"
    report: dict[str, Any] = {"member": spec.member_id, "group": spec.group if hsdp else spec.member_id,
                              "group_rank": spec.group_rank if hsdp else 0, "pid": os.getpid(), "error": None}
    ft = None
    record = _Commits()
    opt: Any = None
    if hsdp:
        store = _group_store(spec)
        dist.init_process_group("torchnext", store=dist.PrefixStore(f"hsdp/g{spec.group}/i{spec.incarnation}", store),
                                rank=spec.group_rank, world_size=spec.group_size, timeout=timedelta(seconds=60))
        model: torch.nn.Module = hsdp_model()
    else:
        model = _DDPModel()
        if spec.member_id >= 100:  # a replacement starts from garbage: healing must overwrite it
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(12345.0)
    started = spec.start_file is None or _wait_to_start(spec)
    if idle is not None:
        report["idle_until_started"] = idle.finish()
    if not started:
        report["error"] = "spare not used"
        if hsdp and dist.is_initialized():
            dist.destroy_process_group()
        return report
    ddp: Any = None
    try:
        ft = FaultTolerant(
            FaultTolerantConfig(coordinator=spec.coordinator, token=spec.token, member_id=spec.member_id,
                                timeout_s=spec.timeout_s, replica_group=spec.group if hsdp else None,
                                group_rank=spec.group_rank if hsdp else None,
                                group_size=spec.group_size if hsdp else None,
                                leader_address=spec.leader_address if hsdp else None,
                                group_session=spec.group_session if hsdp else None,
                                defer_commit=spec.defer_commit),
            state_dict=lambda: sharded_state(model, *([opt] if opt is not None else [])),
            load_state_dict=lambda s: load_sharded_state(s, model, *([opt] if opt is not None else [])),
            join=False,
        )
        ft.on_reconfigure(record.reconfigurations.append)
        report["session"] = ft.session
        if hsdp:
            from torch.distributed.fsdp import fully_shard

            from torchnext.ft import device_mesh

            mesh = device_mesh(ft, ("replicate", "shard"))
            for layer in model:  # type: ignore[attr-defined]
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = torch.optim.Adam(model.parameters(), lr=0.01)  # after fully_shard: it swaps in DTensor params
            net: Any = model
        else:
            from torchnext.ft import DistributedDataParallel

            opt = torch.optim.SGD(model.parameters(), lr=1.0)
            unused = {} if spec.find_unused_parameters is None else {
                "find_unused_parameters": spec.find_unused_parameters}
            net = DistributedDataParallel(model, ft, bucket_cap_mb=DIM * 8 / (1 << 20),  # one bucket per parameter
                                          vote_early=spec.vote_early, **unused)
            model.ws[0].register_hook(_backward_fault(spec, ft, injector, doomed))  # type: ignore[index]
            ddp = net
        ft.join()
        report["joined_at"] = time.time()
        _train(spec, ft, net, opt, injector, doomed, report, record)
    except MembershipError as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["ended_at"] = time.time()
    finally:
        injector.close()
        if ft is not None:
            state = sharded_state(model, *([opt] if opt is not None else []))
            report.update(
                generation=ft.generation, members=list(ft.members), groups=[list(g) for g in ft.replica_groups],
                step=ft.step_count, commits=record.commits(), history=record.history(),
                lockstep_rounds=ft.lockstep_rounds, early_votes=ft.early_votes, revoked_steps=ft.revoked_steps,
                generations={r.generation: [list(g) for g in r.groups] for r in record.reconfigurations},
                reconfigurations=[{"gen": r.generation, "step": r.step, "groups": [list(g) for g in r.groups],
                                   "joiners": list(r.joiners), "reason": r.reason,
                                   "timings": r.timings, "healed": None if r.healed is None
                                   else [r.healed.bytes, r.healed.seconds]} for r in record.reconfigurations],
                optim_steps=sorted({int(v["step"]) for v in opt.state.values() if "step" in v}) if opt is not None
                else [],  # Adam's step counters: equal to the committed step count when no update was lost or doubled
                digest=_digest(state), params=[t.detach().tolist() for t in state["model"].values()],  # lists: a tensor
                # would travel as a shared-memory handle that dies with this process
            )
            report["ddp_counts"] = None if ddp is None else ddp.native_counts()  # which data path DDP's ops took
            if report["error"] is None:
                ft.finish()
            else:
                ft.close()
        if hsdp and dist.is_initialized():
            dist.destroy_process_group()
    return report


def check_sessions(reports: dict[int, dict[str, Any]], sessions: bool) -> None:
    """Each HSDP report's membership session (``FaultTolerant.session``): with ``sessions`` (the default) rank 0 of
    a group leads and the others follow; without (``group_session=False``), every rank is flat. AssertionError
    naming the member otherwise."""
    for m, r in reports.items():
        want = ("leader" if r["group_rank"] == 0 else "follower") if sessions else "flat"
        if r.get("session") != want:
            raise AssertionError(f"member {m}: session {r.get('session')!r}, expected {want!r}")


def _group_store(spec: ParallelSpec) -> Any:
    """The replica group's rendezvous store: the coordinator's (``store_port``) or, with ``group_store_file``, one
    hosted by the group's rank 0 (its port passed through the file)."""
    import torch.distributed as dist

    if spec.group_store_file is None:
        return dist.TCPStore("127.0.0.1", spec.store_port, is_master=False, timeout=timedelta(seconds=60))
    if spec.group_rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
        tmp = f"{spec.group_store_file}.{os.getpid()}"
        with open(tmp, "w") as fh:
            fh.write(str(store.port))
        os.replace(tmp, spec.group_store_file)
        return store
    deadline = time.monotonic() + 60.0
    while not os.path.exists(spec.group_store_file):
        if time.monotonic() > deadline:
            raise TimeoutError(f"member {spec.member_id}: group {spec.group}'s rank 0 did not publish its store port "
                               f"in {spec.group_store_file} within 60 s")
        time.sleep(0.01)
    with open(spec.group_store_file) as fh:
        port = int(fh.read())
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))


class _IdleUntil:
    """Put this process at ``SCHED_IDLE`` until ``path`` exists (:meth:`start`), if every thread can be returned to
    ``SCHED_OTHER`` then (probed on a throwaway thread: unprivileged with ``RLIMIT_NICE`` < 20 the way back is
    refused -- :meth:`start` then returns None and nothing changes).

    A watcher thread, started *before* the caller goes idle (so it is not), returns every thread the moment
    ``path`` appears -- also while the caller is still building (starved at idle on a busy machine, it would
    otherwise hold up its own start) -- and repeats until a pass moves none (a thread the caller started during a
    pass inherited idle)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.moved = 0
        self._done = threading.Event()
        self._idle = threading.Event()  # set once the caller went idle: only then can a pass find every thread
        self._watcher = threading.Thread(target=self._watch, name="idle-until-started", daemon=True)

    @classmethod
    def start(cls, path: str) -> _IdleUntil | None:
        if not hasattr(os, "SCHED_IDLE") or not _can_return_from_idle():
            return None
        self = cls(path)
        self._watcher.start()
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # threads started from here on inherit it
        finally:
            self._idle.set()
        return self

    def finish(self) -> int:
        """Return every thread now (if the watcher has not yet) and end the watcher; how many threads it moved."""
        self._done.set()
        self._watcher.join(10.0)
        return self.moved

    def _watch(self) -> None:
        while not self._done.is_set() and not os.path.exists(self.path):
            self._done.wait(0.005)
        # A go-file that is there from the start (a spare group launched and used at once) must not be acted on
        # before the caller went idle: a pass that found no idle thread ended the watcher, the caller went idle
        # after it and stayed there -- starved on the busy machine, it never joined (a CI soak's "no spare group
        # to commit within 20 s", 2026-12-04).
        self._idle.wait()
        while True:
            n = _all_threads_back()
            self.moved += n
            if n == 0:
                return


def _can_return_from_idle() -> bool:
    probe: list[bool] = []

    def both_ways() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            probe.append(True)
        except OSError:
            probe.append(False)

    t = threading.Thread(target=both_ways, name="sched-probe")
    t.start()
    t.join()
    return bool(probe and probe[0])


def _all_threads_back() -> int:
    """Every thread of this process at ``SCHED_IDLE`` back to ``SCHED_OTHER``; how many."""
    moved = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            if os.sched_getscheduler(int(tid)) == os.SCHED_IDLE:
                os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))
                moved += 1
        except OSError:  # exited since listed
            continue
    return moved


def _wait_to_start(spec: ParallelSpec) -> bool:
    """A warm spare waits for ``start_file`` (True) or ``stop_file`` (False); it also ends when its parent is gone."""
    assert spec.start_file is not None
    parent = os.getppid()
    while not os.path.exists(spec.start_file):
        if (spec.stop_file is not None and os.path.exists(spec.stop_file)) or os.getppid() != parent:
            return False
        time.sleep(0.005)
    return True


def _resources() -> dict[str, Any]:
    """This process's thread count, open fds and resident set (KiB), from ``/proc/self``; with what the fds are
    (``fd_kinds``: socket, pipe, anon_inode:[eventpoll], file ...), the threads' names (``thread_names``; the Python
    ones: ``py_threads``, without a ``[...]`` suffix) and the live Communicators (``live_comms``) and the abandoned
    backends the reaper still holds (``graves``; ``graves_busy``: those with an op still running; ``grave_list``: each
    one's :meth:`~torchnext.comms.reaper.Grave.describe`, when there are any), so that a growth names its cause.
    Diagnostics, by environment: ``TORCHNEXT_SOAK_CYCLES=1`` what only a full collection frees
    (:func:`_cycle_census`), ``TORCHNEXT_SOAK_REFS=1`` what holds the live Communicators (:func:`_comm_holders`)."""
    fds = os.listdir("/proc/self/fd")
    kinds: collections.Counter[str] = collections.Counter()
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed since listed (the listing's own fd)
        kinds[target.split(":", 1)[0] if target.startswith(("socket:", "pipe:")) else
              target if target.startswith("anon_inode:") else "file"] += 1
    names = procfs.thread_names()
    from torchnext.comms import communicator
    from torchnext.comms.reaper import reaper

    graves = reaper().graves()
    py = collections.Counter(t.name.split("[", 1)[0] for t in threading.enumerate())  # "x[g12]" counts as "x"
    out: dict[str, Any] = {"fds": len(fds), "fd_kinds": dict(kinds), "thread_names": dict(names),
                           "py_threads": dict(py),
                           "live_comms": len(communicator._LIVE),
                           "live_comm_kinds": dict(collections.Counter(
                               re.sub(r"\d+", "#", c.name) for c in list(communicator._LIVE))),
                           "graves": len(graves),
                           "graves_busy": sum(1 for g in graves if g.busy())}
    if graves:  # what keeps each (its age, whether its canceller ran, its Works still running)
        out["grave_list"] = [g.describe() for g in graves]
    if os.environ.get("TORCHNEXT_SOAK_CYCLES"):
        out["cycles"] = _cycle_census()
    if os.environ.get("TORCHNEXT_SOAK_REFS") and time.monotonic() >= _REFS_NEXT[0]:  # slow: once a minute
        out["holders"] = _comm_holders()
        _REFS_NEXT[0] = time.monotonic() + 60.0
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("Threads:"):
                out["threads"] = int(line.split()[1])
            elif line.startswith("VmRSS:"):
                out["rss_kib"] = int(line.split()[1])
    return out


def _cycle_census() -> dict[str, Any]:
    """What only the cycle collector would free now (``TORCHNEXT_SOAK_CYCLES=1``, a diagnostic: it runs a full
    collection per sample): the dead Communicators in it, and the frames (``qualname file:line``) and exception types
    in the same garbage -- a frame kept by a traceback is where such a cycle usually starts."""
    import gc

    from torchnext.comms.communicator import Communicator

    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        garbage = list(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    frames: collections.Counter[str] = collections.Counter()
    excs: collections.Counter[str] = collections.Counter()
    for o in garbage:
        if isinstance(o, type(sys._getframe())):
            frames[f"{o.f_code.co_qualname} {os.path.basename(o.f_code.co_filename)}:{o.f_lineno}"] += 1
        elif isinstance(o, BaseException):
            tb, where = o.__traceback__, list[str]()
            while tb is not None and len(where) < 4:
                where.append(f"{tb.tb_frame.f_code.co_qualname}:{tb.tb_lineno}")
                tb = tb.tb_next
            excs[f"{type(o).__name__}({str(o)[:60]!r}) tb={where}"] += 1
    comms = sum(1 for o in garbage if isinstance(o, Communicator))
    n = len(garbage)
    del garbage
    gc.collect()
    return {"objects": n, "comms": comms, "frames": dict(frames.most_common(12)),
            "exceptions": dict(excs.most_common(6))}


_REFS_NEXT = [0.0]


def _comm_holders(limit: int = 2, depth: int = 14, budget: int = 600) -> dict[str, Any]:
    """What holds the live Communicators (``TORCHNEXT_SOAK_REFS=1``, a diagnostic; slow, so at most once a minute):
    those left after a full collection (``after_gc``: fewer than ``live_comms`` means cycles held the rest), and for
    up to ``limit`` of them -- closed ones first -- one chain of referrers (``type: short repr``, holder last),
    found breadth-first through ``gc.get_referrers`` up to a module, a running frame, or an object that nothing
    tracked refers to (held from C++)."""
    import gc

    from torchnext.comms import communicator

    gc.collect()
    live = list(communicator._LIVE)
    after_gc = [repr(c) for c in live]
    closed = sorted(live, key=lambda c: not getattr(c, "_closed", False))[:limit]
    del live
    return {"after_gc": after_gc, "chains": _referrer_chains(closed, depth, budget)}


def _referrer_chains(closed: list[Any], depth: int, budget: int) -> list[list[str]]:
    import gc
    import types

    out: list[list[str]] = []
    here = sys._getframe()

    def label(o: Any) -> str:
        r = type(o).__qualname__
        if isinstance(o, dict):
            keys = list(o)[:6]
            return f"{r} keys={keys!r}"[:160]
        if isinstance(o, types.FrameType):
            return f"frame {o.f_code.co_qualname} {os.path.basename(o.f_code.co_filename)}:{o.f_lineno}"
        try:
            return f"{r}: {o!r}"[:160]
        except Exception:  # a repr that fails still names its type
            return r

    for target in closed:
        ignore = {id(closed), id(here), id(out)}  # this walk's own containers refer to what it looks at
        seen = {id(target)}
        referent: dict[int, Any] = {}  # id(referrer) -> the object it was found referring to (one step to target)
        frontier = [target]
        found: Any = None
        for _ in range(depth):
            nxt: list[Any] = []
            ignore.update((id(nxt), id(frontier)))
            for o in frontier:
                budget -= 1
                if budget < 0:
                    break
                refs = gc.get_referrers(o)
                ignore.add(id(refs))
                if not refs:  # nothing tracked holds it: held from C++
                    found = o
                    break
                for r in refs:
                    if id(r) in seen or id(r) in ignore:
                        continue
                    seen.add(id(r))
                    referent[id(r)] = o
                    if isinstance(r, (types.ModuleType, types.FrameType)):
                        found = r
                        break
                    nxt.append(r)
                if found is not None:
                    break
            if found is not None or not nxt:
                break
            frontier = nxt
        if found is None:
            out.append([label(target), "(no holder found within depth)"])
            continue
        chain = [label(found)]  # holder first, walked down to the target, then reversed
        o = found
        while o is not target:
            o = referent[id(o)]
            chain.append(label(o))
        out.append(chain[::-1])
        del referent, frontier, seen
    return out


def _backward_fault(spec: ParallelSpec, ft: Any, injector: FaultInjector,
                    doomed: list[str]) -> Any:
    """A gradient hook that fires this step's COLLECTIVE fault: registered on what backward reaches last (DDP:
    parameter 0, after the other buckets' all-reduces were issued; HSDP: the input, after the later layers'
    reduce-scatters and all-reduces)."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        f = injector.due(FaultPoint.COLLECTIVE, ft.step_count)
        if doomed[0] == "collective":
            f = Fault(kind=FaultKind.KILL, member=spec.member_id, step=ft.step_count, where=FaultPoint.COLLECTIVE)
        elif doomed[0] == "raise":
            doomed[0] = ""
            f = Fault(kind=FaultKind.RAISE_IN_OP, member=spec.member_id, step=ft.step_count,
                      where=FaultPoint.COLLECTIVE)
        if f is not None:
            time.sleep(0.005)  # the peers are now blocked in this step's first bucket all-reduces
            _log_fault(spec)
            if f.kind is FaultKind.RAISE_IN_OP and spec.raise_log is not None:
                _append(spec.raise_log, {"member": spec.member_id, "t": time.monotonic()})
            injector.fire(f, comm=ft.comm)
        return grad

    return hook


class _Commits:
    """Every commit this process saw, compactly: a soak's survivor commits ~100,000 steps, and a list of lists per
    commit (~0.5 KB) would be most of its RSS growth -- the harness's memory, not torchnext's."""

    def __init__(self) -> None:
        self.steps = array.array("q")  # the step each commit applied (0-based)
        self.gens = array.array("q")  # ft.commit_times' generation of it
        self.times = array.array("d")  # and its time.monotonic()
        self.groups: dict[int, list[list[int]]] = {}  # the replica groups seen at the start of a step, by generation
        self.reconfigurations: list[Any] = []  # every one (ft.reconfigurations keeps the last 1,000)

    def add(self, step: int, groups: list[list[int]], ft: Any, commit: tuple[int, int, float] | None = None) -> None:
        """Record the commit of ``step`` (``commit``: its ``ft.commit_times`` entry; None: the newest)."""
        gen, count, t = ft.commit_times[-1] if commit is None else commit
        if count != step + 1:
            raise RuntimeError(f"commit record says {count} steps committed, the loop applied step {step}")
        self.steps.append(step)
        self.gens.append(gen)
        self.times.append(t)
        self.groups.setdefault(gen, groups)

    def history(self) -> list[list[Any]]:
        """``[step, groups]`` per commit."""
        return [[s, self.groups[g]] for s, g in zip(self.steps, self.gens, strict=True)]

    def commits(self) -> list[list[Any]]:
        """``[generation, committed step count, time]`` per commit (as ``ft.commit_times``, unbounded)."""
        return [[g, s + 1, t] for s, g, t in zip(self.steps, self.gens, self.times, strict=True)]


def _train(spec: ParallelSpec, ft: Any, net: Any, opt: Any, injector: FaultInjector, doomed: list[str],
           report: dict[str, Any], record: _Commits) -> None:
    target = [spec.steps if spec.stop_file is None else 1 << 62]
    backward_fault = _backward_fault(spec, ft, injector, doomed)
    logged_gen = -1
    last_commit = [0.0]
    report["max_commit_gap"] = [0.0, -1, 0.0]  # seconds, the step that ended it, time.monotonic() of that commit
    report["long_gaps"] = []  # every gap over LONG_GAP_S, as max_commit_gap (the first 500)
    next_sample = [0.0]

    def more() -> bool:
        if spec.stop_file is not None and target[0] == 1 << 62 and os.path.exists(spec.stop_file):
            with open(spec.stop_file) as fh:
                text = fh.read().strip()
            if text:
                target[0] = int(text)
        return bool(ft.step_count < target[0])

    provisional: collections.deque[tuple[int, list[list[int]]]] = collections.deque()  # defer_commit: not confirmed

    def confirmed() -> None:
        """Record the provisional steps confirmed since (their commit_times entries; a revoked one was dropped when
        its step was committed again, below)."""
        while provisional:
            s, groups = provisional[0]
            hit = next((c for c in reversed(ft.commit_times) if c[1] == s + 1), None)
            if hit is None:
                return  # still provisional
            record.add(s, groups, ft, hit)
            provisional.popleft()

    while more() or not ft.confirm():
        confirmed()
        f = injector.due(FaultPoint.IDLE, ft.step_count)
        if f is not None or doomed[0] == "idle":
            _log_fault(spec)
            injector.fire(f or Fault(kind=FaultKind.KILL, member=spec.member_id, step=0))
        with ft.step() as st:
            s = ft.step_count
            groups = [list(g) for g in ft.replica_groups]  # before the step: a grow may change them at its commit
            if spec.parallel == "ddp":
                net([ddp_gradient(s, ft.member_id, i) for i in range(N_PARAMS)]).backward()
            else:
                x = hsdp_batch(s, spec.group, spec.group_rank).requires_grad_()
                x.register_hook(backward_fault)  # fires last: the later layers' reductions were issued
                net(x).square().mean().backward()
            if st.commit():
                opt.step()
                if spec.defer_commit:
                    while provisional and provisional[-1][0] >= s:  # revoked: step_count went back to s
                        provisional.pop()
                    provisional.append((s, groups))
                else:
                    record.add(s, groups, ft)
                now = time.monotonic()
                if last_commit[0] and now - last_commit[0] > report["max_commit_gap"][0]:
                    report["max_commit_gap"] = [now - last_commit[0], s, now]
                if last_commit[0] and now - last_commit[0] > LONG_GAP_S and len(report["long_gaps"]) < 500:
                    report["long_gaps"].append([now - last_commit[0], s, now])
                last_commit[0] = now
                if spec.event_log is not None and ft.generation != logged_gen:
                    logged_gen = ft.generation
                    _append(spec.event_log, {"member": spec.member_id, "gen": logged_gen, "members": list(ft.members),
                                             "step": s, "commit": now})
            opt.zero_grad()
        if spec.resource_log is not None and time.monotonic() >= next_sample[0]:
            next_sample[0] = time.monotonic() + spec.resource_every_s
            _append(spec.resource_log, {"t": time.monotonic(), "step": ft.step_count, "members": len(ft.members),
                                        **_resources()})
        if spec.step_sleep_s:
            time.sleep(spec.step_sleep_s)
    confirmed()


def _append(path: str, record: dict[str, Any]) -> None:
    """One JSON line, in one ``write`` of an ``O_APPEND`` file (lines of concurrent writers do not interleave)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


def _log_fault(spec: ParallelSpec) -> None:
    if spec.fault_log is not None:
        with open(spec.fault_log, "a") as fh:
            fh.write(f"{time.time()} {spec.member_id}\n")


def _digest(state: dict[str, Any]) -> str:
    h = hashlib.sha256()
    tensors = [*state["model"].values(), *(v for per in state["optim"] for e in per for v in e.values()
                                           if isinstance(v, torch.Tensor))]
    for t in tensors:
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
