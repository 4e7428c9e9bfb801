"""The multi-rank harness: results in rank order, failures reported with tracebacks, hung children killed."""

from __future__ import annotations

import os
import threading
import time

import pytest

from torchnext.testing import RankContext, RankExited, RankFailure, run_each, run_ranks, run_threads


def _echo(ctx: RankContext, base: int) -> tuple[int, int, int]:
    ctx.store.set(f"k{ctx.rank}", str(ctx.rank))
    ctx.store.wait([f"k{r}" for r in range(ctx.world_size)])
    return ctx.rank, base + ctx.world_size, os.getpid()


def _fail_on_one(ctx: RankContext) -> int:
    if ctx.rank == 1:
        raise ValueError("rank one is broken")
    return ctx.rank


def _hang_on_one(ctx: RankContext) -> int:
    if ctx.rank == 1:
        ctx.store.set("hung_pid", str(os.getpid()))
        time.sleep(600)
    return ctx.rank


def _exit_on_one(ctx: RankContext) -> int:
    if ctx.rank == 1:
        os._exit(7)
    return ctx.rank


def test_results_in_rank_order_from_separate_processes() -> None:
    res = run_ranks(_echo, 3, args=(10,), timeout=60)
    assert [r[:2] for r in res] == [(0, 13), (1, 13), (2, 13)]
    assert len({r[2] for r in res} | {os.getpid()}) == 4


def test_raising_rank_reported_with_traceback() -> None:
    with pytest.raises(RankFailure, match="rank one is broken") as ei:
        run_ranks(_fail_on_one, 2, timeout=60)
    assert set(ei.value.details) == {1}


def test_hung_rank_times_out_and_is_killed() -> None:
    run_ranks(_echo, 1, args=(0,))  # warm start (the forkserver imports torch once)
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="no result within 6") as ei:
        run_ranks(_hang_on_one, 2, timeout=6)
    assert time.monotonic() - t0 < 40
    assert 1 in ei.value.details and "no result" in ei.value.details[1]


def test_exited_rank_fails_unless_allowed() -> None:
    with pytest.raises(RankFailure, match="exited with code 7"):
        run_ranks(_exit_on_one, 2, timeout=30)
    assert run_ranks(_exit_on_one, 2, timeout=30, allow_exit={1}) == [0, RankExited(7)]


def test_thread_ranks() -> None:
    assert [r[:2] for r in run_threads(_echo, 2, args=(1,))] == [(0, 3), (1, 3)]
    with pytest.raises(RankFailure, match="rank one is broken"):
        run_threads(_fail_on_one, 2)


def _exit_with(code: int) -> None:
    os._exit(code)


def test_a_childs_exit_code_is_read_once_when_many_threads_ask_at_once() -> None:
    """Two threads that both find a forkserver child's status pipe readable both read it: one gets the code, the
    other EOF, which multiprocessing records as 255 (seen as 5 of 200 children with plain ``Process``; the soak's
    job threads made a member that exited 0 look like 255). :class:`Child` reads it under one lock."""
    import multiprocessing.connection
    import threading

    from torchnext.testing.multiprocess import Child, _mp_context

    ctx = _mp_context("forkserver")
    seen: list[int | None] = []
    for _ in range(12):
        kids = [Child(ctx, target=_exit_with, args=(i % 3,), daemon=True) for i in range(20)]
        for k in kids:
            k.start()
        for k in kids:  # every status pipe readable before the threads look: the race's widest window
            multiprocessing.connection.wait([k.sentinel], 30)
        gate = threading.Barrier(8)

        def ask(kids: list[Child] = kids, gate: threading.Barrier = gate) -> None:
            gate.wait(10)
            for k in kids:
                _ = k.exitcode
                k.is_alive()

        threads = [threading.Thread(target=ask, daemon=True) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        for k in kids:
            k.join(10)
        seen += [k.exitcode for k in kids]
    assert seen == [i % 3 for _ in range(12) for i in range(20)]


def test_run_each_returns_results_and_exceptions_by_index_and_names_a_hung_thread() -> None:
    release = threading.Event()
    out = run_each([lambda: 1, lambda: (_ for _ in ()).throw(ValueError("two"))], timeout=5)
    assert out[0] == 1 and isinstance(out[1], ValueError) and str(out[1]) == "two"
    try:
        with pytest.raises(RankFailure, match="1 of 2 threads hung") as info:
            run_each([lambda: 0, lambda: release.wait(30)], timeout=0.3)
        assert set(info.value.details) == {1}
    finally:
        release.set()
