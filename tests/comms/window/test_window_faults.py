"""Window failures: wrong token refused, peer death during get/put/wait_signal -> PeerFailure (never a hang),
close while async ops are in flight, invalidate()."""

from __future__ import annotations

import os
import socket
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch

from torchnext.comms import (
    Communicator,
    PeerFailure,
    WindowClosed,
    WindowInvalidated,
    WorkStatus,
)
from torchnext.comms.window.tcp import CHALLENGE_BYTES, HELLO, MAGIC, TcpChannel, WindowAuthError
from torchnext.testing import RankContext, RankExited, crash_now, freeze_self, kill, run_ranks


def _wrong_token(ctx: RankContext) -> dict[str, Any]:
    comm = Communicator(ctx.store, ctx.rank, 2, timeout=timedelta(seconds=30), name="tok")
    win = comm.new_window(torch.zeros(8), transport="tcp")
    addr = win._service.address
    out: dict[str, Any] = {"bound_to": addr[0]}  # the store's interface (127.0.0.1 here), not 0.0.0.0
    with pytest.raises(WindowAuthError, match="refused the connection"):
        TcpChannel(0, ctx.rank, addr, b"\x00" * 32, 5.0, {}, {})
    # a raw client: right magic, wrong proof; then garbage -> refused and closed before any request is read
    for hello in (HELLO.pack(MAGIC, 0, os.urandom(32)), b"GET / HTTP/1.1\r\n\r\n" + b"x" * 30):
        with socket.create_connection(addr, timeout=5) as s:
            challenge = b""
            while len(challenge) < CHALLENGE_BYTES:
                challenge += s.recv(CHALLENGE_BYTES - len(challenge))
            s.sendall(hello)
            verdict = s.recv(1)
            try:  # a would-be request after the refusal: the target has closed the connection
                s.sendall(b"\x01" * 64)
                rest = s.recv(16)
            except ConnectionResetError:
                rest = b""
        out.setdefault("verdicts", []).append((verdict, rest))
    win.fence()
    out["mine"] = win.tensor.tolist()
    win.close()
    comm.shutdown()
    return out


def test_connection_with_wrong_token_is_refused() -> None:
    for res in run_ranks(_wrong_token, 2, timeout=60):
        assert res["verdicts"] == [(b"\x01", b""), (b"\x01", b"")]
        assert res["bound_to"] == "127.0.0.1"
        assert res["mine"] == [0.0] * 8


def _peer_death(ctx: RankContext, transport: str, mode: str) -> dict[str, Any]:
    comm = Communicator(ctx.store, ctx.rank, 2, timeout=timedelta(seconds=60), name="death")
    win = comm.new_window(torch.zeros(1 << 16), transport=transport, timeout=60)
    win.fence()
    if ctx.rank == 1:
        ctx.store.set("pid1", str(os.getpid()))
        if mode == "exit":
            crash_now()
        freeze_self()  # "during": rank 0 kills us while its op waits on us
        time.sleep(60)
        return {}
    pid1 = int(ctx.store.get("pid1"))
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    if mode == "exit":
        deadline = t0 + 20
        while True:  # ops keep working until the peer is gone, then raise PeerFailure
            try:
                win.get(1, 0, 1024)
                win.put(torch.ones(1024), 1, 0)
            except PeerFailure as exc:
                out["exc"] = (type(exc).__name__, exc.peer, exc.op)
                break
            if time.perf_counter() > deadline:
                out["exc"] = "no PeerFailure within 20 s"
                break
            time.sleep(0.01)
    elif mode == "during_get":
        time.sleep(0.3)  # rank 1 is frozen now (or about to be)
        w = win.get(1, async_op=True)
        assert not isinstance(w, torch.Tensor)
        out["in_flight"] = w.wait(timeout=0.3)  # False: it waits on the frozen peer
        kill(pid1)
        try:
            w.wait()
        except PeerFailure as exc:
            out["exc"] = (type(exc).__name__, exc.peer, exc.op)
        out["status"] = w.status.name
    else:  # wait_kill: the peer dies while we wait for its signal
        killer = threading.Timer(0.3, kill, args=(pid1,))
        killer.start()
        try:
            win.wait_signal(1, 1, timeout=30)
        except PeerFailure as exc:
            out["exc"] = (type(exc).__name__, exc.peer, exc.op)
        killer.join()
    out["elapsed"] = time.perf_counter() - t0
    win.invalidate("peer died")
    return out


@pytest.mark.parametrize(
    ("transport", "mode"),
    [("shm", "exit"), ("tcp", "exit"), ("tcp", "during_get"), ("shm", "wait_kill"), ("tcp", "wait_kill")],
)
def test_peer_death_raises_peer_failure_not_hang(transport: str, mode: str) -> None:
    res = run_ranks(_peer_death, 2, args=(transport, mode), timeout=90, allow_exit=[1])
    assert isinstance(res[1], RankExited)
    out = res[0]
    assert out["exc"][0] == "PeerFailure" and out["exc"][1] == 1, out
    assert out["exc"][2].startswith("window."), out
    assert out["elapsed"] < 15, out
    if mode == "during_get":
        assert out["in_flight"] is False and out["status"] == "ERROR"


def _close_in_flight(ctx: RankContext, transport: str) -> dict[str, Any]:
    comm = Communicator(ctx.store, ctx.rank, 2, timeout=timedelta(seconds=30), name="close")
    peer = 1 - ctx.rank
    n = 200
    win = comm.new_window(torch.zeros(n * 64), transport=transport)
    works = [win.put(torch.full((64,), float(i + 1)), peer, i * 64, async_op=True) for i in range(n)]
    works.append(win.accumulate(torch.ones(64), peer, 0, async_op=True))
    win.close()  # with ops in flight: completes them, then the collective part
    out: dict[str, Any] = {"statuses": sorted({w.status.name for w in works if w is not None})}
    with pytest.raises(WindowClosed, match="window is closed"):
        win.get(peer)
    with pytest.raises(WindowClosed):
        win.put(torch.ones(1), peer, 0, async_op=True)
    win.close()  # idempotent
    expected = torch.arange(1, n + 1, dtype=torch.float32).repeat_interleave(64)
    expected[:64] += 1
    out["ok"] = bool(torch.equal(win.tensor, expected))  # still a valid local tensor after close
    comm.shutdown()
    return out


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_close_with_ops_in_flight_completes_them(transport: str) -> None:
    for res in run_ranks(_close_in_flight, 2, args=(transport,), timeout=60):
        assert res == {"statuses": ["COMPLETED"], "ok": True}


def _invalidate(ctx: RankContext) -> dict[str, Any]:
    comm = Communicator(ctx.store, ctx.rank, 2, timeout=timedelta(seconds=30), name="inv")
    win = comm.new_window(torch.zeros(4096).view(64, 64), transport="tcp")
    if ctx.rank == 1:
        win.close()  # collective; rank 0 matches it with a plain barrier after invalidating
        comm.shutdown()
        return {}
    works = [win.put(torch.ones(4096), 1, 0, async_op=True) for _ in range(300)]
    win.invalidate("generation 1 -> 2")
    out: dict[str, Any] = {}
    statuses = set()
    for w in works:
        assert w is not None
        try:
            w.wait(timeout=10)
        except WindowInvalidated as exc:
            assert "window invalidated by reconfiguration, create a new one" in str(exc)
        statuses.add(w.status.name)
    out["statuses"] = statuses
    out["all_terminal"] = all(w is not None and w.is_completed() for w in works)
    calls = [
        lambda: win.put(torch.ones(1), 1, 0),
        lambda: win.get(1),
        lambda: win.get(0, async_op=True),
        lambda: win.get_rows(1, [0]),
        lambda: win.accumulate(torch.ones(1), 1, 0),
        lambda: win.signal(1),
        lambda: win.wait_signal(1, 1, timeout=5),
        lambda: win.flush(),
        lambda: win.fence(),
    ]
    msgs = []
    for call in calls:
        with pytest.raises(WindowInvalidated) as info:
            call()
        msgs.append(str(info.value))
    out["msgs_ok"] = all("window invalidated by reconfiguration, create a new one (generation 1 -> 2)" in m
                         for m in msgs)
    win.invalidate("again")  # idempotent
    win.close()  # local only after invalidate (no collective)
    comm.barrier()
    comm.shutdown()
    return out


def test_invalidate_makes_every_later_op_raise() -> None:
    out = run_ranks(_invalidate, 2, timeout=60)[0]
    assert out["all_terminal"] and out["msgs_ok"], out
    # ops queued behind the invalidation fail with WindowInvalidated; none is left hanging
    assert WorkStatus.ERROR.name in out["statuses"], out
    assert out["statuses"] <= {WorkStatus.COMPLETED.name, WorkStatus.ERROR.name}, out


def _invalidate_blocked(ctx: RankContext) -> dict[str, Any]:
    comm = Communicator(ctx.store, ctx.rank, 2, timeout=timedelta(seconds=60), name="invb")
    win = comm.new_window(torch.zeros(1024), transport="tcp", timeout=60)
    win.fence()
    if ctx.rank == 1:
        ctx.store.set("pid1", str(os.getpid()))
        freeze_self()
        time.sleep(60)
        return {}
    pid1 = int(ctx.store.get("pid1"))
    time.sleep(0.3)
    w = win.get(1, async_op=True)
    assert not isinstance(w, torch.Tensor)
    out: dict[str, Any] = {"in_flight": w.wait(timeout=0.3)}
    t0 = time.perf_counter()
    win.invalidate("reconfigured")  # does not wait for the blocked request's 60 s timeout
    out["invalidate_s"] = time.perf_counter() - t0
    with pytest.raises(WindowInvalidated, match="create a new one"):
        w.wait(timeout=5)
    kill(pid1)
    return out


def test_invalidate_fails_an_op_blocked_on_a_frozen_peer_at_once() -> None:
    res = run_ranks(_invalidate_blocked, 2, timeout=60, allow_exit=[1])
    assert res[0]["in_flight"] is False and res[0]["invalidate_s"] < 3.0, res[0]


def _abort_invalidates(ctx: RankContext) -> dict[str, Any]:
    comm = Communicator(ctx.store, ctx.rank, 2, timeout=timedelta(seconds=60), name="abortwin")
    win = comm.new_window(torch.zeros(8))
    win.fence()
    ctx.store.set(f"fenced{ctx.rank}", "1")
    ctx.store.wait([f"fenced{1 - ctx.rank}"])
    t0 = time.perf_counter()
    comm.abort("generation 1 -> 2")  # what every reconfiguration of FaultTolerant does to the old generation
    out: dict[str, Any] = {"abort_s": time.perf_counter() - t0}
    with pytest.raises(WindowInvalidated, match=r"create a new one.*abortwin.*aborted: generation 1 -> 2"):
        win.get(1 - ctx.rank)
    with pytest.raises(WindowInvalidated):
        win.put(torch.ones(1), 1 - ctx.rank, 0)
    return out


def test_abort_invalidates_the_communicators_windows() -> None:
    for out in run_ranks(_abort_invalidates, 2, timeout=60):
        assert out["abort_s"] < 1.0, out  # invalidation's release runs in the background
