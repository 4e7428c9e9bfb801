"""``ft.process_group`` on the native data path (torchnext.comms.process_group.native, staged never-raise mode): on
it after join, its in-place ops on C++ staging buffers (an abandoned op's late backend write never reaches the
caller), a failed op recorded -- no raise, NaN, the step not committed, the Python path's error class -- and the
per-generation swap of the inner backend.

Members are threads of this process (Gloo over loopback); the real-member tests use an in-process coordinator, the
staging test two hand-made generations of two-rank Communicators over one HashStore. Every wait is bounded.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from torchnext.comms import CommTimeout
from torchnext.comms import native as native_ext
from torchnext.comms.communicator import Communicator
from torchnext.comms.process_group.native import native_class
from torchnext.ft import (
    FailureKind,
    classify_failure,
)
from torchnext.ft.process_group import FaultTolerantProcessGroup
from torchnext.testing import run_each
from torchnext.testing.thread_members import thread_coordinator, thread_member

pytestmark = pytest.mark.timeout(180)

N = 2


@pytest.fixture(autouse=True)
def _extension(monkeypatch: pytest.MonkeyPatch) -> None:
    st = native_ext.status()
    if not st.available:
        pytest.skip(f"the native extension cannot be built here: {st.reason}")
    monkeypatch.setenv("TORCHNEXT_NATIVE_PG", "1")


def _on_native(pg: Any) -> bool:
    """The group runs its ops in C++: the native class, a native backend for the current generation."""
    return (type(pg) is native_class(FaultTolerantProcessGroup) and pg.native
            and pg._native.comm is pg._ft._comm)


def _native_ops(pg: Any) -> int:
    native = pg._native
    return int(native._mod.op_counter(native.backend))


# ------------------------------------------------------------------------------------------------- the path
def test_the_group_is_on_the_native_path_after_join_and_back_to_python_while_a_hook_asks() -> None:
    with thread_coordinator(N) as coord:

        def member(i: int) -> dict[str, Any]:
            ft = thread_member(coord, i, min_size=N)
            pg = ft.process_group
            try:
                ft.join()
                out: dict[str, Any] = {"native": _on_native(pg)}
                with ft.step() as step:
                    t = torch.full((4,), float(i + 1))
                    pg.allreduce([t]).wait()
                    out["sum"] = t.tolist()
                    out["native_ops"] = _native_ops(pg)
                    out["python_ops"] = int(ft.comm._op_counter)
                    handle = ft.comm.register_pre_hook(lambda info: None)  # a user hook: Python per op
                    out["hooked"] = pg.native
                    u = torch.ones(2)
                    dist.all_reduce(u, group=pg)
                    handle.remove()
                    out["unhooked"] = _on_native(pg)
                    out["u"] = u.tolist()
                    out["seq"] = pg._get_sequence_number_for_group()
                    out["commit"] = step.commit()
                return out
            finally:
                ft.finish()

        out = run_each([lambda i=i: member(i) for i in range(N)])
        for i in range(N):
            assert not isinstance(out[i], BaseException), out[i]
            o = out[i]
            assert o["native"], "ft.process_group stayed on the Python path"
            assert o["sum"] == [3.0] * 4 and o["u"] == [2.0] * 2
            assert o["native_ops"] == 1 and o["python_ops"] == 0, "the op did not run in C++"
            assert o["hooked"] is False and o["unhooked"] is True
            assert o["seq"] == 2, "op ids continue across the switch to Python and back"
            assert o["commit"] is True


def test_the_python_path_without_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHNEXT_NATIVE_PG", "0")
    with thread_coordinator(N) as coord:

        def member(i: int) -> tuple[bool, type, list[float]]:
            ft = thread_member(coord, i, min_size=N)
            pg = ft.process_group
            try:
                ft.join()
                t = torch.ones(3)
                with ft.step() as step:
                    pg.allreduce([t]).wait()
                    step.commit()
                return pg.native, type(pg), t.tolist()
            finally:
                ft.finish()

        out = run_each([lambda i=i: member(i) for i in range(N)])
        for i in range(N):
            assert out[i] == (False, FaultTolerantProcessGroup, [2.0] * 3), out[i]


# ----------------------------------------------------------------------------------------- failures
@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
@pytest.mark.parametrize("how", ["wait", "future"])
def test_a_failed_op_is_recorded_not_raised_and_the_step_does_not_commit(monkeypatch: pytest.MonkeyPatch,
                                                                         native: bool, how: str) -> None:
    """Member 0's all_reduce of the first attempt times out (member 1 never issues it): no raise, NaN, the step
    does not commit, the generation's error is the same class on both paths; the retry (a new generation) commits.
    ``future``: nobody calls wait() (DDP's way): the failure is found at the vote."""
    monkeypatch.setenv("TORCHNEXT_NATIVE_PG", "1" if native else "0")
    with thread_coordinator(N) as coord:

        def member(i: int) -> dict[str, Any]:
            ft = thread_member(coord, i, min_size=N)
            pg = ft.process_group
            out: dict[str, Any] = {"commits": []}
            try:
                ft.join()
                out["native"] = _on_native(pg)
                pg.set_timeout(timedelta(seconds=1.0))
                attempt = 0
                while ft.step_count < 1:
                    attempt += 1
                    assert attempt <= 4, "the step never committed"
                    if attempt == 1:
                        gen1 = ft.comm
                    with ft.step() as step:
                        t = torch.ones(4)
                        if attempt == 1 and i == 0:
                            work = pg.allreduce([t])
                            if how == "wait":
                                out["waited"] = work.wait()
                            else:
                                out["future"] = work.get_future().wait()[0] is t
                            out["nan"] = bool(torch.isnan(t).all())
                        elif attempt == 1:
                            time.sleep(2.0)  # never issues it; votes after member 0's op timed out
                        else:
                            pg.allreduce([t]).wait()
                            out["retry"] = t.tolist()
                            out["retry_native"] = _on_native(pg)
                        out["commits"].append(step.commit())
                    if attempt == 1 and i == 0:
                        err = gen1.errored()
                        out["error"] = None if err is None else type(err)
                out["generation"] = ft.generation
                return out
            finally:
                ft.finish()

        out = run_each([lambda i=i: member(i) for i in range(N)])
        for i in range(N):
            assert not isinstance(out[i], BaseException), out[i]
        o0 = out[0]
        assert o0["native"] is native
        assert o0.get("waited", o0.get("future")) is True
        assert o0["nan"], "a failed op's outputs are marked invalid"
        assert o0["error"] is CommTimeout, "the generation's error: the Python path's class"
        assert classify_failure(CommTimeout("x")) is FailureKind.TRANSIENT
        for i in range(N):
            assert out[i]["commits"][0] is False, f"member {i} committed a step with a failed op"
            assert out[i]["commits"][-1] is True and out[i]["retry"] == [2.0] * 4
            assert out[i]["retry_native"] is native and out[i]["generation"] >= 2


# --------------------------------------------------------------------------- staging and generation swap
class _Member:
    """A hand-made fault-tolerant member: ``ft`` as FaultTolerantProcessGroup reads it, generations of two-rank
    Communicators over one shared store (``enter(gen)``: what FaultTolerant does at a reconfiguration)."""

    def __init__(self, store: dist.Store, rank: int) -> None:
        self.store, self.rank = store, rank
        self.ft = SimpleNamespace(config=SimpleNamespace(name="ftnative"), rank=rank, size=2, members=[0, 1],
                                  member_id=rank, generation=0, _newest_gen=0, _comm=None, comm=None,
                                  on_reconfigure=lambda cb: None, _record_step_error=lambda exc: None,
                                  _early_vote=None)
        self.pg = FaultTolerantProcessGroup(self.ft)  # type: ignore[arg-type]
        self.comms: list[Communicator] = []

    def enter(self, gen: int) -> Communicator:
        comm = Communicator(dist.PrefixStore(f"g{gen}", self.store), self.rank, 2, name=f"ftnative.g{gen}",
                            timeout=timedelta(seconds=30))
        self.comms.append(comm)
        self.ft.generation = self.ft._newest_gen = gen
        self.ft._comm = self.ft.comm = comm
        self.pg._reconfigured(SimpleNamespace(rank=self.rank))
        return comm


def _run_members(members: list[Any], run: Callable[[int], dict[str, Any]], *, timeout: float) -> dict[int, Any]:
    """``run(r)`` for every member at once, each in its thread; every member's communicators aborted afterwards,
    whatever happened; fails the test if one raised."""
    try:
        out = run_each([lambda r=r: run(r) for r in range(len(members))], timeout=timeout)
    finally:
        for m in members:
            for c in m.comms:
                c.abort("test over")
    assert not any(isinstance(o, BaseException) for o in out.values()), out
    return out


def test_an_abandoned_ops_late_write_never_reaches_the_caller_and_the_next_generation_runs_native() -> None:
    """Member 0 issues an in-place op member 1 does not join; the op is abandoned (the native backend's abort: the
    first thing a generation's abort does) and member 1 then completes it late on its own Gloo, so member 0's Gloo
    writes into the op's buffer -- the staging buffer, never the caller's tensor. Generation 1: a broadcast from
    member 1 (100 would land in the caller's tensor); generation 2: an all_reduce (member 1 gets 1 + 100: member 0's
    Gloo read the staged 1s, not the caller's tensor, NaN by then). Generation 3 runs on a new native backend behind
    the same switch, numbering its ops from 1."""
    store = dist.HashStore()
    members = [_Member(store, r) for r in range(2)]
    sync = threading.Barrier(2, timeout=60)

    def abandon(r: int, m: _Member, comm: Communicator, op: str, out: dict[str, Any]) -> None:
        pg = m.pg
        opts = dist.BroadcastOptions()
        opts.rootRank = 1
        if r == 0:
            a = torch.ones(4)
            work = pg.broadcast([a], opts) if op == "broadcast" else pg.allreduce([a])
            time.sleep(0.3)
            out[f"{op}_pending"] = not work.is_completed()
            native = pg._native
            native._mod.abort(native.backend, "superseded (test)")
            out[f"{op}_future_is_caller"] = work.get_future().wait()[0] is a
            out[f"{op}_nan"] = bool(torch.isnan(a).all())
        sync.wait()
        if r == 1:  # late: member 1 completes the abandoned op on its own Gloo, directly
            x = torch.full((4,), 100.0)
            gloo = comm.backend_handle.pg
            (gloo.broadcast([x], opts) if op == "broadcast" else gloo.allreduce([x])).wait(timedelta(seconds=20))
            out[f"{op}_late"] = x.tolist()
        sync.wait()
        if r == 0:
            time.sleep(0.2)  # member 0's Gloo thread writes what it received
            out[f"{op}_after"] = a.tolist()
            out[f"{op}_wait"] = work.wait()  # recorded, not raised: told to the group, which aborts the generation
            out[f"{op}_errored"] = comm.errored() is not None
        sync.wait()

    def run(r: int) -> dict[str, Any]:
        m = members[r]
        pg = m.pg
        out: dict[str, Any] = {}
        g1 = m.enter(1)
        out["g1_native"] = _on_native(pg)
        t = torch.full((4,), float(r + 1))
        pg.allreduce([t]).wait()
        out["g1_sum"] = t.tolist()
        sync.wait()
        abandon(r, m, g1, "broadcast", out)
        g2 = m.enter(2)
        out["g2_native"] = _on_native(pg)
        abandon(r, m, g2, "all_reduce", out)
        m.enter(3)
        out["g3_native"] = _on_native(pg)
        b = torch.full((4,), 10.0 * (r + 1))
        pg.allreduce([b]).wait()
        out["b"] = b.tolist()
        out["g3_op_ids"] = _native_ops(pg)
        c = torch.full((4,), 1.0)
        pg.allreduce([c]).wait()  # its staging buffer: b's, back in the pool
        out["c"] = c.tolist()
        opts = dist.BroadcastOptions()
        opts.rootRank = 1
        d = torch.full((3,), float(r))
        pg.broadcast([d], opts).wait()
        out["d"] = d.tolist()
        out["g3_op_ids_end"] = _native_ops(pg)
        out["py_ops_g3"] = int(m.comms[-1]._op_counter)
        return out

    out = _run_members(members, run, timeout=90)
    for r in range(2):
        o = out[r]
        assert o["g1_native"] and o["g2_native"] and o["g3_native"]
        assert o["g1_sum"] == [3.0] * 4 and o["b"] == [30.0] * 4 and o["c"] == [2.0] * 4 and o["d"] == [1.0] * 3
        assert o["g3_op_ids"] == 1 and o["g3_op_ids_end"] == 3, "a new generation numbers its ops from 1"
        assert o["py_ops_g3"] == 0
    o0 = out[0]
    for op in ("broadcast", "all_reduce"):
        assert o0[f"{op}_pending"] and o0[f"{op}_future_is_caller"] and o0[f"{op}_nan"], (op, o0)
        assert o0[f"{op}_wait"] is True and o0[f"{op}_errored"], (op, o0)
    assert out[1]["all_reduce_late"] == [101.0] * 4, "member 0's Gloo read the caller's tensor, not a staged copy"
    assert all(v != v for v in o0["broadcast_after"]), f"the late broadcast reached the caller: {o0}"
    assert all(v != v for v in o0["all_reduce_after"]), f"the late all_reduce reached the caller: {o0}"


def test_a_native_ops_future_callbacks_run_before_its_waiters_are_released() -> None:
    """As on the Python path (DDP's reducer waits on the used-parameter map's Work while the early vote leaves from
    that op's future callback): wait() returns only after the callbacks ran; a callback may wait on the op itself."""
    store = dist.HashStore()
    members = [_Member(store, r) for r in range(2)]

    def run(r: int) -> dict[str, Any]:
        m = members[r]
        m.enter(1)
        pg = m.pg
        seen: dict[str, Any] = {"native": _on_native(pg)}
        if r == 1:
            time.sleep(0.3)  # member 0's op is still in flight when it adds its callback
        t = torch.ones(4)
        work = pg.allreduce([t])

        def callback(_fut: Any) -> None:
            time.sleep(0.2)
            seen["inner_wait"] = work.wait()  # on the completing thread: does not block
            seen["callback_done"] = time.monotonic()

        work.get_future().add_done_callback(callback)
        seen["pending"] = not work.is_completed()
        work.wait()
        seen["waited"] = time.monotonic()
        return seen

    out = _run_members(members, run, timeout=60)
    for r in range(2):
        o = out[r]
        assert o["native"] and o["inner_wait"] is True
        assert o["callback_done"] <= o["waited"], "wait() returned before the op's future callbacks ran"
    assert out[0]["pending"], "member 0's op completed before its callback was added: nothing was checked"
