"""A fault-tolerant training job for tests and benchmarks: an exact workload, scripted faults, a process launcher.

The workload is chosen so that correctness is checkable **exactly**: the "model" is a float64 vector ``w`` (plus a
buffer counting applied steps) trained by SGD(lr=1) on the all-reduced (SUM) gradient ``g(step, member)``, an
integer vector. Integer sums in float64 are exact, so after the run::

    w == w0 - sum(g(s, m) for s in range(steps) for m in members_of_generation_that_committed(s))

bitwise, on every survivor; a lost step or a step applied twice changes ``w``. Optional ``compute_s`` burns CPU per
step (a matmul loop) to emulate training compute.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import queue
import signal
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from torchnext.testing.faults import Fault, FaultInjector, FaultKind, FaultPoint

__all__ = ["FTJob", "WorkerSpec", "check_commit_logs", "expected_weights", "gradient", "overhead_worker",
           "run_worker"]

DIM = 64


def gradient(step: int, member: int, dim: int = DIM) -> torch.Tensor:
    """The integer gradient member ``member`` contributes at step ``step``."""
    return (torch.arange(dim, dtype=torch.float64) % 7) * (member + 1) + (step + 1)


def expected_weights(step_members: Sequence[Sequence[int]], dim: int = DIM) -> torch.Tensor:
    """``w`` after committing step ``s`` with members ``step_members[s]`` (w0 = 0)."""
    w = torch.zeros(dim, dtype=torch.float64)
    for s, members in enumerate(step_members):
        for m in members:
            w -= gradient(s, m, dim)
    return w


@dataclass(kw_only=True)
class WorkerSpec:
    """What one member process does."""

    coordinator: str
    token: str
    member_id: int
    steps: int
    faults: Sequence[Fault] = ()
    min_size: int = 1
    compute_s: float = 0.0
    """CPU work per step (seconds, approximate)."""
    state_mib: float = 0.0
    """Extra float32 state (MiB) carried in the state_dict, to make healing move real bytes."""
    timeout_s: float = 30.0
    coordinator_timeout_s: float = 2.0
    failover_timeout_s: float = 10.0
    step_sleep_s: float = 0.0
    """Sleep per step (lets a test act between steps without burning CPU)."""
    run_until_size: int = 0
    """Keep training past ``steps`` until the generation has this many members (at most ``run_until_s``)."""
    run_until_member: int = -1
    """Keep training past ``steps`` until this member id is in the generation (at most ``run_until_s``)."""
    run_until_s: float = 60.0
    stop_file: str | None = None
    """If set: train until the step count written in this file (checked between steps) instead of ``steps``."""
    defer_commit: bool = False
    """``FaultTolerantConfig(defer_commit=True)`` (the loop then ends with ``ft.confirm()``; ``commits`` holds the
    confirmed ones, ``applied`` is state: a revoked update leaves it)."""
    sigusr1_raises: bool = False
    """SIGUSR1 makes this member's next collective raise ``PeerFailure`` (faults injected from outside)."""
    signal_kills: bool = False
    """SIGUSR2 / SIGRTMIN make this member SIGKILL itself at its next idle point / inside its next all_reduce."""
    fault_log: str | None = None
    """Append ``"<time.monotonic()> <member>"`` here right before a self-inflicted kill (benchmarks time from it)."""
    event_log: str | None = None
    """Append one JSON line per generation this member commits in: ``{"member", "gen", "members", "step", "built",
    "commit"}`` (the generation's members, the step index of its first commit here, ``time.monotonic()`` marks:
    Communicator built, first commit) -- benchmarks and tests read it even for members that die later."""
    split: bool = False
    """Make a split child of each generation and record that reconfiguration invalidates it."""
    finish: bool = False
    """End with ``ft.finish()`` (the job's end: later departures change nothing) instead of ``ft.close()``; members
    that stop at different steps then end with ``JobFinished`` instead of reconfiguring each other."""
    netns: str | None = None
    """Run inside this network namespace (a host of a :class:`~torchnext.testing.netns.NetLab`)."""
    gloo_ifname: str | None = None
    """``GLOO_SOCKET_IFNAME`` for this member (the interface its Communicators bind to; None: torch's default)."""
    extra: dict[str, Any] = field(default_factory=dict)


class _Model(torch.nn.Module):
    applied: torch.Tensor
    ballast: torch.Tensor

    def __init__(self, dim: int, state_mib: float) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(dim, dtype=torch.float64))
        self.register_buffer("applied", torch.zeros((), dtype=torch.int64))
        n = int(state_mib * (1 << 20) // 4)
        self.register_buffer("ballast", torch.arange(n, dtype=torch.float32) if n else torch.zeros(0))


class _SGD:
    """Plain SGD with a state_dict (``torch.optim`` costs ~2 s of imports per fresh process on first use)."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float) -> None:
        self.params = params
        self.lr = lr
        self.steps = torch.zeros((), dtype=torch.int64)

    @torch.no_grad()
    def step(self) -> None:
        for p in self.params:
            if p.grad is not None:
                p.sub_(p.grad, alpha=self.lr)
        self.steps += 1

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict[str, Any]:
        return {"lr": self.lr, "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lr = float(state["lr"])
        self.steps.copy_(state["steps"])


def _load(model: torch.nn.Module, opt: _SGD, state: dict[str, Any]) -> None:
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() if v.numel() else b"")
    return h.hexdigest()


def _burn(seconds: float, a: torch.Tensor) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = a @ a
        a = a / a.norm()


def run_worker(spec: WorkerSpec) -> dict[str, Any]:
    """Train ``spec.steps`` committed steps fault-tolerantly; return a report (never raises for membership ends:
    the report's ``error`` names it)."""
    from torchnext.comms import CommAborted
    from torchnext.ft import FaultTolerant, FaultTolerantConfig, MembershipError

    torch.set_num_threads(1)
    model = _Model(DIM, spec.state_mib)
    if spec.member_id >= 100:  # replacements start from garbage: healing must overwrite it
        with torch.no_grad():
            model.w.fill_(12345.0)
            model.applied.fill_(999)
    opt = _SGD(list(model.parameters()), lr=1.0)
    injector = FaultInjector(spec.faults, spec.member_id)
    work = torch.randn(64, 64)
    report: dict[str, Any] = {"member": spec.member_id, "pid": os.getpid(), "error": None}
    ft = None
    attempts = 0
    t_start = time.monotonic()
    try:
        ft = FaultTolerant(
            FaultTolerantConfig(coordinator=spec.coordinator, token=spec.token, member_id=spec.member_id,
                                min_size=spec.min_size, timeout_s=spec.timeout_s,
                                coordinator_timeout_s=spec.coordinator_timeout_s,
                                failover_timeout_s=spec.failover_timeout_s, defer_commit=spec.defer_commit),
            state_dict=lambda: {"model": model.state_dict(), "optim": opt.state_dict()},
            load_state_dict=lambda s: _load(model, opt, s),
        )
        report["joined_at"] = time.monotonic()

        def hook(where: str) -> None:
            assert ft is not None
            injector.at(FaultPoint.RECONFIGURE if where == "reconfigure" else FaultPoint.HEALING, ft.step_count)

        ft.fault_hook = hook
        invalidated: list[str] = []
        report["split_invalidated"] = invalidated
        child = ft.split(list(range(ft.size))) if spec.split else None

        def on_reconfigure(info: Any) -> None:
            nonlocal child
            if child is not None:
                try:
                    child.barrier()
                except CommAborted as exc:
                    invalidated.append(str(exc))
                child = None

        ft.on_reconfigure(on_reconfigure)
        give_up = time.monotonic() + spec.run_until_s
        committed_in: list[int] = []  # members of the generation that committed the last step this member saw
        logged_gen = -1
        armed = [False]
        if spec.sigusr1_raises:
            signal.signal(signal.SIGUSR1, lambda *_: armed.__setitem__(0, True))
        doomed = [""]
        if spec.signal_kills:
            signal.signal(signal.SIGUSR2, lambda *_: doomed.__setitem__(0, "idle"))
            signal.signal(signal.SIGRTMIN, lambda *_: doomed.__setitem__(0, "collective"))

        def die_if(point: str) -> None:
            if doomed[0] == point:
                if spec.fault_log is not None:
                    with open(spec.fault_log, "a") as fh:
                        fh.write(f"{time.monotonic()} {spec.member_id}\n")
                os.kill(os.getpid(), signal.SIGKILL)
        target = [spec.steps if spec.stop_file is None else 1 << 62]

        def more() -> bool:
            assert ft is not None
            if spec.stop_file is not None and target[0] == 1 << 62 and os.path.exists(spec.stop_file):
                with open(spec.stop_file) as fh:
                    text = fh.read().strip()
                if text:
                    target[0] = int(text)
            if ft.step_count < target[0]:
                return True
            # judged on the generation that committed the last step: the same on every member
            short = len(committed_in) < spec.run_until_size or (spec.run_until_member >= 0
                                                                and spec.run_until_member not in committed_in)
            return short and time.monotonic() < give_up

        while more() or not ft.confirm():
            injector.at(FaultPoint.IDLE, ft.step_count)
            die_if("idle")
            attempts += 1
            with ft.step() as st:
                s = ft.step_count
                if spec.compute_s:
                    _burn(spec.compute_s, work)
                g = gradient(s, ft.member_id)
                f = injector.due(FaultPoint.COLLECTIVE, s)
                if armed[0]:
                    armed[0] = False
                    f = Fault(kind=FaultKind.RAISE, member=spec.member_id, step=s, where=FaultPoint.COLLECTIVE)
                if doomed[0] == "collective":
                    ft.all_reduce(g, async_op=True)
                    time.sleep(0.005)  # peers are now blocked in the collective
                    die_if("collective")
                if f is not None:
                    w = ft.all_reduce(g, async_op=True)
                    time.sleep(0.005)  # peers are now blocked in the collective
                    injector.fire(f)
                    w.wait()
                else:
                    ft.all_reduce(g)
                model.w.grad = g
                if st.commit():
                    if spec.event_log is not None and ft.generation != logged_gen:
                        logged_gen = ft.generation
                        marks = ft.reconfigurations[-1].timings if ft.reconfigurations else {}
                        with open(spec.event_log, "a") as fh:
                            fh.write(json.dumps({"member": spec.member_id, "gen": logged_gen,
                                                 "members": list(ft.members), "step": ft.step_count - 1,
                                                 "built": marks.get("built"), "commit": ft.commit_times[-1][2],
                                                 "healed": (ft.reconfigurations[-1].healed.__dict__
                                                            if ft.reconfigurations and ft.reconfigurations[-1].healed
                                                            and spec.member_id in ft.reconfigurations[-1].joiners
                                                            else None)}) + "\n")
                    committed_in = list(ft.members)
                    opt.step()
                    with torch.no_grad():
                        model.applied += 1
                opt.zero_grad()
            if spec.step_sleep_s:
                time.sleep(spec.step_sleep_s)
    except MembershipError as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["ended_at"] = time.monotonic()
    finally:
        injector.close()
        if ft is not None:
            report.update(
                generation=ft.generation, members=list(ft.members), step=ft.step_count,
                commits=[[g, s, t] for g, s, t in ft.commit_times],
                generations={r.generation: list(r.members) for r in ft.reconfigurations},
                reconfigurations=[{"gen": r.generation, "members": list(r.members), "donor": r.donor,
                                   "joiners": list(r.joiners), "timings": r.timings,
                                   "healed": None if r.healed is None else [r.healed.bytes, r.healed.seconds]}
                                  for r in ft.reconfigurations],
                w=model.w.detach().tolist(), applied=int(model.applied), digest=_digest(model),
                attempts=attempts, started_at=t_start,
            )
            if spec.finish and report["error"] is None:
                ft.finish()
            else:
                ft.close()
    return report


def overhead_worker(spec: WorkerSpec) -> dict[str, Any]:
    """Per-step cost of the wrapper, measured in the same processes on the same Communicator: alternating blocks
    of plain steps (compute, all_reduce, update) and fault-tolerant steps (the same inside ``ft.step()`` with a
    commit). Returns ``{"plain": [s, ...], "ft": [s, ...]}`` (step durations, seconds)."""
    from torchnext.ft import FaultTolerant, FaultTolerantConfig

    torch.set_num_threads(1)
    w = torch.zeros(DIM, dtype=torch.float64)
    work = torch.randn(64, 64)
    ft = FaultTolerant(FaultTolerantConfig(coordinator=spec.coordinator, token=spec.token, member_id=spec.member_id,
                                           timeout_s=spec.timeout_s))
    plain: list[float] = []
    fts: list[float] = []
    commits: list[float] = []
    block = 20
    try:
        for b in range(max(1, spec.steps // (2 * block))):
            for i in range(block):
                t0 = time.perf_counter()
                if spec.compute_s:
                    _burn(spec.compute_s, work)
                g = gradient(b * block + i, ft.member_id)
                ft.comm.all_reduce(g)
                w -= g
                plain.append(time.perf_counter() - t0)
            for _ in range(block):
                t0 = time.perf_counter()
                with ft.step() as st:
                    if spec.compute_s:
                        _burn(spec.compute_s, work)
                    g = gradient(ft.step_count, ft.member_id)
                    ft.all_reduce(g)
                    t1 = time.perf_counter()
                    if st.commit():
                        w -= g
                    commits.append(time.perf_counter() - t1)
                fts.append(time.perf_counter() - t0)
    finally:
        ft.close()
    return {"plain": plain, "ft": fts, "commit": commits}


def _child(spec: WorkerSpec, results: Any, fn: Callable[[WorkerSpec], Any] = run_worker) -> None:
    out: tuple[int, bool, Any]
    try:
        netns = getattr(spec, "netns", None)
        if netns:
            from torchnext.testing.netns import enter

            enter(netns)
        ifname = getattr(spec, "gloo_ifname", None)
        if ifname:
            os.environ["GLOO_SOCKET_IFNAME"] = ifname
        out = (spec.member_id, True, fn(spec))
    except BaseException:
        out = (spec.member_id, False, traceback.format_exc())
    results.put(out)
    results.close()
    results.join_thread()
    os._exit(0)


class FTJob:
    """Launch member processes (forkserver, torch preloaded) for one coordinator; collect reports; always reap.

    ``launch(spec)`` starts a member (also later, for replacements); ``wait(ids, timeout)`` returns their reports
    (a member that died has none: ``reports`` lacks it, ``exitcode(id)`` tells how it ended). ``close()`` (or
    ``with``) kills and reaps everything still running.
    """

    def __init__(self) -> None:
        from torchnext.testing.multiprocess import _mp_context

        self._ctx = _mp_context("forkserver")  # processes started as Child: thread-safe status (two soak jobs)
        self._results = self._ctx.Queue()
        self.procs: dict[int, Any] = {}
        self.reports: dict[int, dict[str, Any]] = {}
        self.errors: dict[int, str] = {}

    def launch(self, spec: WorkerSpec, fn: Callable[[WorkerSpec], Any] = run_worker) -> Any:
        """Start a member running ``fn(spec)`` (a module-level function; default :func:`run_worker`)."""
        from torchnext.testing.multiprocess import Child

        p = Child(self._ctx, target=_child, args=(spec, self._results, fn), name=f"member{spec.member_id}",
                  daemon=True)
        p.start()
        self.procs[spec.member_id] = p
        return p

    def pid(self, member: int) -> int:
        return int(self.procs[member].pid)

    def exitcode(self, member: int) -> int | None:
        code = self.procs[member].exitcode
        return None if code is None else int(code)

    def wait(self, members: Sequence[int], timeout: float) -> dict[int, dict[str, Any]]:
        """Wait until each of ``members`` reported or exited; raise ``TimeoutError`` naming the stragglers."""
        deadline = time.monotonic() + timeout
        while True:
            self._collect(0.02)
            pending = [m for m in members if m not in self.reports and m not in self.errors
                       and (self.procs[m].is_alive() or self._results_may_lag(m))]
            if not pending:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"members {pending} did not finish within {timeout}s")
        if any(m in self.errors for m in members):
            raise RuntimeError("\n".join(f"--- member {m} ---\n{self.errors[m]}" for m in members if m in self.errors))
        return {m: self.reports[m] for m in members if m in self.reports}

    def wait_exited(self, members: Sequence[int], timeout: float) -> None:
        """Wait until each of ``members``' processes exited, reading their reports meanwhile (a child blocks on
        exit until its report -- it can be large -- is read); ``TimeoutError`` naming those still running."""
        deadline = time.monotonic() + timeout
        while True:
            self._collect(0.01)
            running = [m for m in members if self.procs[m].is_alive()]
            if not running:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"members {running} still running after {timeout}s")

    def poll(self, timeout: float = 0.0) -> None:
        """Read every report that arrived (waiting up to ``timeout`` for the first): a long-running caller must, since
        a child blocks on exit until its report is read."""
        self._collect(timeout)
        while True:
            n = len(self.reports) + len(self.errors)
            self._collect(0.0)
            if len(self.reports) + len(self.errors) == n:
                return

    def _results_may_lag(self, m: int) -> bool:
        p = self.procs[m]
        if p.exitcode is None:
            return True
        marks = getattr(self, "_exit_seen", {})
        self._exit_seen = marks
        first = marks.setdefault(m, time.monotonic())
        return p.exitcode == 0 and time.monotonic() - first < 2.0

    def _collect(self, timeout: float) -> None:
        try:
            member, ok, value = self._results.get(timeout=timeout)
        except queue.Empty:
            return
        (self.reports if ok else self.errors)[member] = value

    def close(self) -> None:
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
        for p in self.procs.values():
            p.join(timeout=10)
        self._results.close()
        self._results.cancel_join_thread()

    def __enter__(self) -> FTJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_commit_logs(reports: dict[int, dict[str, Any]], *, survivors: Sequence[int] | None = None,
                      events: Sequence[dict[str, Any]] = ()) -> list[int]:
    """The oracle for runs whose coordinator changed (no single coordinator holds the whole record): the members'
    own commit logs, plus ``events`` (the lines of a shared :attr:`WorkerSpec.event_log`, which also covers
    members killed before they could report: step ``s`` was committed by the newest generation whose first commit
    any member logged is ``<= s``).

    Checks: every survivor (a report without ``error``, or those named) agrees on the generation, its members, the
    step count and the state digest, and ``applied == step``; no two members (survivors or not) recorded one step
    as committed in different generations, nor one generation with different members; every survivor's log is
    gap-free; and the survivors' ``w`` equals the exact replay of the committed steps (steps ``0 .. final - 1``
    must all be covered by some log). Returns the survivors' ids. Raises ``AssertionError`` naming what differs.
    """
    ok = {m: r for m, r in reports.items() if (r["error"] is None if survivors is None else m in survivors)}
    if not ok:
        raise AssertionError(f"no survivor: { {m: r['error'] for m, r in reports.items()} }")
    first = next(iter(ok.values()))
    for m, r in ok.items():
        for key in ("generation", "members", "step", "digest"):
            if r[key] != first[key]:
                raise AssertionError(f"member {m}'s {key} {r[key]!r} differs from member {first['member']}'s "
                                     f"{first[key]!r}")
        if r["applied"] != r["step"]:
            raise AssertionError(f"member {m} applied {r['applied']} updates for {r['step']} committed steps")
    gen_members: dict[int, list[int]] = {}
    step_gen: dict[int, int] = {}
    for m, r in reports.items():
        for g, members in r["generations"].items():
            g = int(g)
            if gen_members.setdefault(g, list(members)) != list(members):
                raise AssertionError(f"generation {g}: member {m} saw {members}, another {gen_members[g]}")
        for g, s, _ in r["commits"]:
            if step_gen.setdefault(s - 1, g) != g:
                raise AssertionError(f"step {s - 1} committed in generation {g} (member {m}) and in generation "
                                     f"{step_gen[s - 1]} (another member): split brain")
    firsts: dict[int, int] = {}
    for ev in events:
        g = int(ev["gen"])
        if gen_members.setdefault(g, list(ev["members"])) != list(ev["members"]):
            raise AssertionError(f"generation {g}: member {ev['member']} logged {ev['members']}, another "
                                 f"{gen_members[g]}")
        firsts[g] = min(firsts.get(g, 1 << 62), int(ev["step"]))
    if firsts:
        order = sorted(firsts.items(), key=lambda kv: kv[1])
        for (g1, s1), (g2, s2) in itertools.pairwise(order):
            if g2 < g1:
                raise AssertionError(f"generation {g2} first committed step {s2}, after generation {g1} (step "
                                     f"{s1})")
        for s in range(max(firsts.values()) + 1):
            g = max(g for g, f in firsts.items() if f <= s) if any(f <= s for f in firsts.values()) else None
            if g is None:
                continue
            if step_gen.setdefault(s, g) != g:
                raise AssertionError(f"step {s}: a member logged its commit in generation {step_gen[s]}, the event "
                                     f"log says generation {g}")
    for m, r in ok.items():
        steps = [s for _, s, _ in r["commits"]]
        if steps and steps != list(range(steps[0], steps[0] + len(steps))):
            raise AssertionError(f"member {m}: gap or duplicate in its committed steps {steps}")
    final = first["step"]
    missing = [s for s in range(final) if s not in step_gen or step_gen[s] not in gen_members]
    if missing:
        raise AssertionError(f"no member recorded the generation that committed steps {missing[:10]}")
    replay = expected_weights([gen_members[step_gen[s]] for s in range(final)])
    if not torch.equal(replay, torch.tensor(first["w"], dtype=torch.float64)):
        raise AssertionError("the survivors' weights differ from the exact replay of the committed steps")
    return sorted(ok)
