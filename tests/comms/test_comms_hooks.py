"""Hooks: order, op_id pairing, timing of post hooks, removal, raising hooks (ranks as threads)."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import torch

from torchnext.comms import (
    AbortHookArgs,
    Communicator,
    HookError,
    OpInfo,
    PostHookArgs,
    ReduceOp,
    WorkStatus,
)
from torchnext.testing import RankContext, run_threads


def _order_and_pairing(ctx: RankContext) -> dict[str, Any]:
    comm = Communicator(ctx.store, ctx.rank, 2, timeout=timedelta(seconds=30), name="hooks")
    events: list[tuple[Any, ...]] = []
    infos: list[OpInfo] = []
    posts: list[PostHookArgs] = []
    lock = threading.Lock()

    def pre_a(info: OpInfo) -> None:
        events.append(("pre_a", info.op_id))
        infos.append(info)

    def pre_b(info: OpInfo) -> None:
        events.append(("pre_b", info.op_id))

    def post_a(args: PostHookArgs) -> None:
        with lock:
            events.append(("post_a", args.op_id, args.status.name, threading.current_thread().name))
            posts.append(args)

    def post_b(args: PostHookArgs) -> None:
        with lock:
            events.append(("post_b", args.op_id))

    ha = comm.register_pre_hook(pre_a)
    comm.register_pre_hook(pre_b)
    comm.register_post_hook(post_a)
    hb = comm.register_post_hook(post_b)
    t = torch.ones(3)
    comm.all_reduce(t, ReduceOp.MAX)
    synced = list(events)  # post hooks of a sync op ran before it returned
    w = comm.broadcast(t, 1, async_op=True)
    assert w is not None
    w.wait(timeout=30)
    after_async = list(events)
    ha.remove()
    ha.remove()  # idempotent
    hb.remove()
    comm.barrier()
    comm.shutdown()
    return {"synced": synced, "after_async": after_async, "events": events, "infos": infos, "posts": posts,
            "thread": threading.current_thread().name}


def test_hook_order_pairing_and_removal() -> None:
    for res in run_threads(_order_and_pairing, 2, timeout=60):
        ev = res["events"]
        assert res["synced"] == [("pre_a", 1), ("pre_b", 1), ("post_a", 1, "COMPLETED", res["thread"]), ("post_b", 1)]
        assert res["after_async"][4:6] == [("pre_a", 2), ("pre_b", 2)]
        assert res["after_async"][6][:3] == ("post_a", 2, "COMPLETED") and res["after_async"][7] == ("post_b", 2)
        # after removal of pre_a and post_b only pre_b / post_a run for op 3
        assert ev[8:] == [("pre_b", 3), ("post_a", 3, "COMPLETED", res["thread"])]
        info1, info2 = res["infos"]
        assert (info1.op, info1.op_id, info1.reduce_op, info1.async_op, info1.root) == ("all_reduce", 1, "max", False, None)
        assert (info2.op, info2.op_id, info2.root, info2.async_op) == ("broadcast", 2, 1, True)
        assert info1.comm_name == "hooks" and info1.ranks == (0, 1) and info1.size == 2
        assert info1.timeout == timedelta(seconds=30)
        assert info1.inputs[0] is info1.outputs[0]
        for post in res["posts"]:
            assert post.work.op_id == post.op_id and post.exception is None and post.duration_s > 0
            assert post.work.status is WorkStatus.COMPLETED and post.info.op_id == post.op_id


def _raising_hooks(ctx: RankContext) -> dict[str, Any]:
    comm = Communicator(ctx.store, ctx.rank, 2, timeout=timedelta(seconds=30), name="raising")
    out: dict[str, Any] = {}
    posts: list[tuple[int, str, str]] = []
    comm.register_post_hook(lambda a: posts.append((a.op_id, a.status.name, type(a.exception).__name__)))

    def bad_pre(info: OpInfo) -> None:
        raise KeyError("boom-pre")

    h = comm.register_pre_hook(bad_pre)
    t = torch.ones(2)
    with pytest.raises(HookError) as ei:  # both ranks' hooks raise: nobody issues, nobody hangs
        comm.all_reduce(t)
    out["pre_msg"] = str(ei.value)
    out["pre_cause"] = type(ei.value.__cause__).__name__
    out["pre_hook"] = ei.value.hook is bad_pre
    h.remove()
    comm.all_reduce(t)  # still usable; the refused op was not issued anywhere
    out["t"] = t.tolist()

    def bad_post(args: PostHookArgs) -> None:
        raise ValueError("boom-post")

    h2 = comm.register_post_hook(bad_post)
    with pytest.raises(HookError, match="bad_post"):
        comm.all_reduce(t)  # the op completed; the hook's error surfaces
    out["t2"] = t.tolist()
    w = comm.all_reduce(t, async_op=True)
    assert w is not None
    with pytest.raises(HookError, match="boom-post"):
        w.wait(timeout=30)
    out["async_status"] = w.status.name
    h2.remove()
    out["errored"] = comm.errored()
    comm.barrier()

    abort_args: list[AbortHookArgs] = []

    def bad_abort(a: AbortHookArgs) -> None:
        raise RuntimeError("boom-abort")

    comm.register_abort_hook(bad_abort)
    comm.register_abort_hook(abort_args.append)
    with pytest.raises(HookError, match="bad_abort"):
        comm.abort("why")
    out["abort_args"] = [(a.reason, a.in_flight, a.rank) for a in abort_args]
    out["aborted"] = type(comm.errored()).__name__
    out["posts"] = posts
    return out


def test_raising_hooks_surface_as_hook_error_naming_the_hook() -> None:
    for rank, res in enumerate(run_threads(_raising_hooks, 2, timeout=60)):
        assert "pre hook" in res["pre_msg"] and "bad_pre" in res["pre_msg"] and "boom-pre" in res["pre_msg"]
        assert res["pre_cause"] == "KeyError" and res["pre_hook"]
        assert res["t"] == [2.0, 2.0] and res["t2"] == [4.0, 4.0]
        assert res["async_status"] == "COMPLETED"
        assert res["errored"] is None  # hook errors do not break the communicator
        assert res["abort_args"] == [("why", (), rank)]  # the second abort hook still ran
        assert res["aborted"] == "CommAborted"
        # every pre paired with exactly one post; the refused op ended in ERROR with the HookError
        assert res["posts"][0] == (1, "ERROR", "HookError")
        assert [p[0] for p in res["posts"]] == [1, 2, 3, 4, 5]
        assert [p[1] for p in res["posts"][1:]] == ["COMPLETED"] * 4


def test_hook_must_be_callable() -> None:
    def body(ctx: RankContext) -> None:
        comm = Communicator(ctx.store, ctx.rank, 1, name="callable")
        with pytest.raises(TypeError, match="callable"):
            comm.register_pre_hook(42)  # type: ignore[arg-type]

    run_threads(body, 1)


def _long_sync_op(ctx: RankContext) -> dict[str, Any]:
    """A sync op that outlasts several wait slices (the peer issues late): it completes on the issuing thread, post
    hooks included; a per-op timeout shorter than the wait still ends it as TIMED_OUT between slices."""
    from torchnext.comms import CommTimeout
    from torchnext.comms.work import SYNC_WAIT_SLICE

    comm = Communicator(ctx.store, ctx.rank, 2, timeout=timedelta(seconds=30), name="long")
    posts: list[tuple[int, str, str]] = []
    comm.register_post_hook(lambda a: posts.append((a.op_id, a.status.name, threading.current_thread().name)))
    delay = 3 * SYNC_WAIT_SLICE.total_seconds()
    t = torch.full((4,), float(ctx.rank + 1))
    if ctx.rank == 1:
        threading.Event().wait(delay)
    comm.all_reduce(t)
    out: dict[str, Any] = {"sum": t.tolist(), "posts": list(posts), "me": threading.current_thread().name}
    if ctx.rank == 0:  # rank 1 never joins op 2: our own deadline (between slices) must end it
        try:
            comm.all_reduce(t, timeout=timedelta(seconds=2.5 * SYNC_WAIT_SLICE.total_seconds()))
        except CommTimeout as exc:
            out["timeout"] = type(exc).__name__
        out["posts2"] = list(posts)
        ctx.store.set("long_done", "1")
    else:  # stay connected until rank 0 is done (a vanished peer would make it a PeerFailure)
        ctx.store.wait(["long_done"], timedelta(seconds=30))
    return out


def test_long_sync_op_completes_on_issuing_thread_and_honours_its_timeout() -> None:
    res = run_threads(_long_sync_op, 2, timeout=60)
    for r in res:
        assert r["sum"] == [3.0] * 4
        assert r["posts"] == [(1, "COMPLETED", r["me"])]
    assert res[0]["timeout"] == "CommTimeout"
    assert res[0]["posts2"][-1][:2] == (2, "TIMED_OUT")


def _p2p_infos(ctx: RankContext) -> list[tuple[str, int | None, int | None, tuple[tuple[str, int, int], ...]]]:
    from torchnext.comms import P2POp

    comm = Communicator(ctx.store, ctx.rank, ctx.world_size, timeout=timedelta(seconds=30))
    seen: list[Any] = []
    comm.register_pre_hook(seen.append)
    peer = 1 - ctx.rank
    t = torch.ones(2)
    if ctx.rank == 0:
        comm.send(t, peer, tag=5)
    else:
        comm.recv(t, peer, tag=5)
    comm.batch_p2p([P2POp("send", t, peer, tag=3), P2POp("recv", torch.empty(2), peer, tag=3)])
    comm.all_reduce(t)
    comm.shutdown()
    return [(i.op, i.peer, i.tag, tuple((p.kind, p.peer, p.tag) for p in i.batch)) for i in seen]


def test_op_info_carries_p2p_tags_and_batch_ops() -> None:
    for rank, infos in enumerate(run_threads(_p2p_infos, 2, timeout=60)):
        first = "send" if rank == 0 else "recv"
        peer = 1 - rank
        assert infos == [
            (first, peer, 5, ()),
            ("batch_p2p", None, None, (("send", peer, 3), ("recv", peer, 3))),
            ("all_reduce", None, None, ()),
        ]


def test_check_hooks_run_after_pre_hooks_and_may_refuse_an_op() -> None:
    """A check hook refusing with a CommError: raised as is, post hooks see ERROR, the communicator stays usable
    after a non-breaking CollectiveMismatch and is errored after any other refusal."""
    import torch.distributed as dist

    from torchnext.comms import CollectiveMismatch, CommError

    comm = Communicator(dist.HashStore(), 0, 1, timeout=timedelta(seconds=30), name="checks")
    events: list[tuple[str, int, str]] = []
    verdict: dict[str, BaseException | None] = {"exc": None}

    def check(info: OpInfo) -> None:
        events.append(("check", info.op_id, info.op))
        if verdict["exc"] is not None:
            raise verdict["exc"]

    comm.register_pre_hook(lambda info: events.append(("pre", info.op_id, info.op)))
    comm.register_post_hook(lambda a: events.append(("post", a.op_id, a.status.name)))
    handle = comm.register_check_hook(check)
    t = torch.ones(2)
    comm.all_reduce(t)
    assert events == [("pre", 1, "all_reduce"), ("check", 1, "all_reduce"), ("post", 1, "COMPLETED")]
    events.clear()
    verdict["exc"] = CollectiveMismatch("differs", culprits=[0], breaks_communicator=False)
    with pytest.raises(CollectiveMismatch, match="differs") as info:
        comm.all_reduce(t)
    assert info.value is verdict["exc"]  # as is, not wrapped
    assert events == [("pre", 2, "all_reduce"), ("check", 2, "all_reduce"), ("post", 2, "ERROR")]
    assert comm.errored() is None
    verdict["exc"] = ValueError("a bug in the hook")
    with pytest.raises(HookError, match="a bug in the hook"):
        comm.all_reduce(t)
    assert comm.errored() is None  # nothing was issued
    verdict["exc"] = CommError("side channel broke")
    with pytest.raises(CommError, match="side channel broke"):
        comm.all_reduce(t)
    assert isinstance(comm.errored(), CommError)
    with pytest.raises(CommError, match="errored"):
        comm.all_reduce(t)
    handle.remove()
    comm.abort()


def test_shutdown_hooks_run_once_before_the_backend_is_released() -> None:
    import torch.distributed as dist

    comm = Communicator(dist.HashStore(), 0, 1, timeout=timedelta(seconds=30), name="shut")
    seen: list[Any] = []
    comm.register_shutdown_hook(lambda c: seen.append(c.backend_handle.pg is not None))

    def bad(c: Communicator) -> None:
        raise RuntimeError("boom")

    comm.register_shutdown_hook(bad)
    comm.all_reduce(torch.ones(1))
    with pytest.raises(HookError, match="boom"):
        comm.shutdown()
    comm.shutdown()  # idempotent: the hooks ran once
    assert seen == [True]
    assert comm.backend_handle.pg is None  # released despite the raising hook
