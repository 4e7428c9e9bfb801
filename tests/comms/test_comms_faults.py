"""Failures on real processes: per-op timeout, abort from another thread, peer death (os._exit), SIGSTOP."""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch

from torchnext.comms import CommAborted, CommError, CommTimeout, Communicator, PeerFailure, WorkStatus
from torchnext.testing import RankContext, RankExited, freeze_self, kill, run_ranks


def _timeout_scenario(ctx: RankContext) -> dict[str, Any]:
    comm = Communicator(ctx.store, ctx.rank, 2, timeout=timedelta(seconds=30))
    p2p = Communicator(ctx.store, ctx.rank, 2, timeout=timedelta(seconds=30), name="p2p")
    if ctx.rank == 1:  # never joins; waits until rank 0 is done
        ctx.store.wait(["done"], timedelta(seconds=60))
        return {}
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    try:  # a sync recv whose sender never sends
        p2p.recv(torch.empty(3), 1, timeout=timedelta(milliseconds=500))
    except CommTimeout as exc:
        out["recv_elapsed"] = time.perf_counter() - t0
        out["recv_msg"] = str(exc)
    # async: a short wait returns False and leaves the op running; the op's own deadline then raises CommTimeout
    w = comm.all_reduce(torch.ones(4), async_op=True, timeout=0.8)
    assert w is not None
    out["short_wait"] = w.wait(timeout=0.05)
    out["status_mid"] = w.status.name
    t0 = time.perf_counter()
    try:
        w.wait()
    except CommTimeout as exc:
        out["elapsed"] = time.perf_counter() - t0
        out["msg"] = str(exc)
        out["fields"] = (exc.op, exc.op_id, exc.comm_name, exc.ranks)
    out["status"] = w.status.name
    out["errored"] = type(comm.errored()).__name__
    try:
        comm.barrier()
    except CommError as exc:
        out["after"] = (type(exc).__name__, type(exc.__cause__).__name__)
    ctx.store.set("done", "1")
    return out


def test_per_op_timeout_raises_comm_timeout_and_errors_the_communicator() -> None:
    res = run_ranks(_timeout_scenario, 2, timeout=60)[0]
    assert 0.3 < res["recv_elapsed"] < 5.0 and "recv (op_id=1) on communicator 'p2p'" in res["recv_msg"], res
    assert res["short_wait"] is False and res["status_mid"] == "IN_PROGRESS"
    assert 0.3 < res["elapsed"] < 5.0, res
    assert res["fields"] == ("all_reduce", 1, "world", (0, 1)), res
    assert "all_reduce (op_id=1)" in res["msg"] and "'world'" in res["msg"] and "[0, 1]" in res["msg"]
    assert res["status"] == "TIMED_OUT" and res["errored"] == "CommTimeout"
    assert res["after"] == ("CommError", "CommTimeout")


def _abort_scenario(ctx: RankContext, mode: str) -> dict[str, Any]:
    comm = Communicator(ctx.store, ctx.rank, 2, timeout=timedelta(seconds=60))
    comm.all_reduce(torch.ones(2))  # healthy first
    if ctx.rank == 1:
        ctx.store.set("pid1", str(os.getpid()))
        if mode == "sigstop":
            freeze_self()  # rank 0 kills us while frozen
        ctx.store.wait(["done"], timedelta(seconds=60))  # "sleeps": never enters the op
        return {}
    pid1 = int(ctx.store.get("pid1"))
    hook_calls: list[Any] = []
    post: list[tuple[int, str]] = []
    comm.register_abort_hook(lambda a: hook_calls.append((a.reason, a.in_flight)))
    comm.register_post_hook(lambda a: post.append((a.op_id, a.status.name)))
    stamps: dict[str, float] = {}

    def aborter() -> None:
        time.sleep(0.4)
        stamps["abort"] = time.perf_counter()
        comm.abort("test")
        stamps["abort_returned"] = time.perf_counter()

    th = threading.Thread(target=aborter)
    th.start()
    out: dict[str, Any] = {}
    try:
        if mode == "sigstop":  # synchronous op blocked in the issuing thread
            comm.all_reduce(torch.ones(1000))
        else:  # async op, blocked in Work.wait
            w = comm.all_reduce(torch.ones(1000), async_op=True)
            assert w is not None
            w.wait()
    except CommAborted as exc:
        stamps["raised"] = time.perf_counter()
        out["msg"] = str(exc)
    th.join(10)
    out["latency"] = stamps["raised"] - stamps["abort"]
    comm.abort()  # idempotent: hooks not run again
    out["hooks"] = hook_calls
    out["post"] = post
    out["errored"] = type(comm.errored()).__name__
    t0 = time.perf_counter()
    try:
        comm.all_reduce(torch.ones(1))
    except CommAborted:
        out["after_s"] = time.perf_counter() - t0
    ctx.store.set("done", "1")
    if mode == "sigstop":
        kill(pid1)
    return out


def _check_abort(res: dict[str, Any]) -> None:
    assert res["latency"] < 0.1, f"abort took {res['latency'] * 1e3:.1f} ms to unblock the op"
    assert res["hooks"] == [("test", (2,))], res["hooks"]
    assert res["post"] == [(2, "ABORTED")], res["post"]  # post hook registered after op 1
    assert res["errored"] == "CommAborted"
    assert res["after_s"] < 0.05
    assert "cancelled by abort() (test)" in res["msg"] and "all_reduce (op_id=2)" in res["msg"]


def test_abort_unblocks_sync_op_when_peer_is_sigstopped() -> None:
    res = run_ranks(_abort_scenario, 2, args=("sigstop",), timeout=60, allow_exit={1})
    assert isinstance(res[1], RankExited)
    _check_abort(res[0])


def test_abort_unblocks_async_wait_when_peer_sleeps() -> None:
    res = run_ranks(_abort_scenario, 2, args=("sleep",), timeout=60)
    _check_abort(res[0])


def _death_scenario(ctx: RankContext) -> dict[str, Any]:
    ws = ctx.world_size
    # A rank that does not talk to the dead one in the failing op learns of the death from the survivor that does
    # (its published report), at the op timeout at worst: keep that short.
    comm = Communicator(ctx.store, ctx.rank, ws, timeout=timedelta(seconds=6))
    p2p = Communicator(ctx.store, ctx.rank, ws, timeout=timedelta(seconds=20), name="p2p")
    comm.all_reduce(torch.ones(2))
    if ctx.rank == ws - 1:
        # die while the others are in the op, with an op of its own in flight (a recv nobody sends). Not the same
        # all_reduce: its worker thread could finish its whole part before the exit (seen once under load in CI),
        # and then the others' op completes -- no failure to observe
        ctx.store.wait([f"in_op_{r}" for r in range(ws - 1)], timedelta(seconds=30))
        time.sleep(0.2)
        p2p.recv(torch.empty(4), 0, async_op=True)
        os._exit(3)
    out: dict[str, Any] = {}
    ctx.store.set(f"in_op_{ctx.rank}", "1")
    t0 = time.perf_counter()
    try:
        comm.all_reduce(torch.ones(1 << 20))
    except PeerFailure as exc:
        out["elapsed"] = time.perf_counter() - t0
        out["msg"] = str(exc)
    out["errored"] = type(comm.errored()).__name__
    if ctx.rank == 0:  # p2p with the dead rank: the peer is known
        try:
            p2p.recv(torch.empty(4), ws - 1)
        except PeerFailure as exc:
            out["peer"] = exc.peer
            out["p2p_status"] = WorkStatus.ERROR.name
    # recovery, as the fault-tolerance layer does it: abort the broken communicators, survivors build a new one
    # under a new name on the same store, and it works at once
    t0 = time.perf_counter()
    comm.abort("peer 2 died")
    p2p.abort()
    gen1 = Communicator(ctx.store, ctx.rank, ws - 1, timeout=timedelta(seconds=20), name="gen1")
    t = torch.full((3,), float(ctx.rank + 1))
    gen1.all_reduce(t)
    out["recovered"] = (t.tolist(), time.perf_counter() - t0)
    return out


def test_peer_death_mid_op_raises_peer_failure() -> None:
    res = run_ranks(_death_scenario, 3, timeout=90, allow_exit={2})
    assert isinstance(res[2], RankExited) and res[2].exitcode == 3
    for r in (0, 1):
        assert res[r]["elapsed"] < 12, res[r]
        assert res[r]["errored"] == "PeerFailure"
        assert "all_reduce" in res[r]["msg"]
    assert res[0]["peer"] == 2
    for r in (0, 1):
        assert res[r]["recovered"][0] == [3.0, 3.0, 3.0] and res[r]["recovered"][1] < 20


def _abort_p2p_scenario(ctx: RankContext) -> dict[str, Any]:
    comm = Communicator(ctx.store, ctx.rank, 2, timeout=timedelta(seconds=60), name="abort_p2p")
    if ctx.rank == 1:  # never sends
        ctx.store.wait(["done"], timedelta(seconds=60))
        return {}
    stamps: dict[str, float] = {}
    pending = comm.recv(torch.empty(8), 1, tag=1, async_op=True)  # async p2p in flight too

    def aborter() -> None:
        time.sleep(0.3)
        stamps["abort"] = time.perf_counter()
        comm.abort()

    th = threading.Thread(target=aborter)
    th.start()
    out: dict[str, Any] = {}
    try:
        comm.recv(torch.empty(4), 1)  # sync recv: waits on our lock (a waiter thread watches the backend)
    except CommAborted:
        out["latency"] = time.perf_counter() - stamps["abort"]
    th.join(10)
    assert pending is not None
    out["pending"] = (pending.status.name, type(pending.exception()).__name__)
    ctx.store.set("done", "1")
    return out


def test_abort_unblocks_point_to_point() -> None:
    res = run_ranks(_abort_p2p_scenario, 2, timeout=60)[0]
    assert res["latency"] < 0.1, res
    assert res["pending"] == ("ABORTED", "CommAborted")


def _pair(store: Any, name: str) -> dict[int, Communicator]:
    import threading

    comms: dict[int, Communicator] = {}

    def member(rank: int) -> None:
        comms[rank] = Communicator(store, rank, 2, name=name)

    threads = [threading.Thread(target=member, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return comms


def test_timeout_becomes_peer_failure_when_a_member_reported_one() -> None:
    """A rank that never hears from the dead peer itself times out; if another member published a PeerFailure, the
    timeout is reported as that PeerFailure (naming the reporter) instead of a bare CommTimeout."""
    import torch.distributed as dist

    from torchnext.comms import CommTimeout

    store = dist.HashStore()
    plain = _pair(store, "plain")
    with pytest.raises(CommTimeout):  # rank 1 never joins and nobody reported anything: a plain timeout
        plain[0].all_reduce(torch.ones(1), timeout=0.3)
    reported = _pair(store, "reported")
    reported[1].store.set("peer_failure", "rank 1 (global 1): peer rank 2 failed: connection reset")
    with pytest.raises(PeerFailure, match=r"reported a peer failure \(rank 1 \(global 1\)") as info:
        reported[0].all_reduce(torch.ones(1), timeout=0.3)
    assert isinstance(info.value.__cause__, CommTimeout)
    assert isinstance(reported[0].errored(), PeerFailure)
