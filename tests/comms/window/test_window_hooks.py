"""Window ops run the communicator's hooks (so the Flight Recorder sees them): one OpInfo per op named
``window.<op>`` with the target as ``peer``, post hooks with the terminal status, a raising pre hook stops the op."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch

from torchnext.comms import CommTimeout, Communicator, HookError
from torchnext.testing import RankContext, run_ranks


def _hooked_ops(ctx: RankContext) -> dict[str, Any]:
    comm = Communicator(ctx.store, ctx.rank, 2, timeout=timedelta(seconds=30), name="hooked")
    peer = 1 - ctx.rank
    pre: list[Any] = []
    post: list[Any] = []
    win = comm.new_window(torch.arange(12.0).view(3, 4))
    comm.register_pre_hook(pre.append)
    comm.register_post_hook(post.append)
    win.put(torch.ones(2), peer, 0)
    win.get(peer, 0, 4)
    win.get_rows(peer, [2, 0])
    win.accumulate(torch.ones(2), peer, 4)
    w = win.put(torch.full((2,), 7.0), peer, 8, async_op=True)
    assert w is not None and w.wait(timeout=30)
    win.signal(peer)
    win.wait_signal(peer, 1, timeout=30)
    with pytest.raises(CommTimeout):
        win.wait_signal(peer, 99, timeout=0.2)
    comm.barrier()
    seen = [(i.op, i.peer, i.async_op) for i in pre]
    done = [(a.info.op, a.status.name) for a in post]

    def refuse(info: Any) -> None:
        if info.op == "window.put":
            raise RuntimeError("no puts today")

    comm.register_pre_hook(refuse)
    before = win.get(peer, 10, 2).clone()
    with pytest.raises(HookError, match="no puts today"):
        win.put(torch.full((2,), -1.0), peer, 10)
    comm.barrier()
    after = win.get(peer, 10, 2)
    comm.barrier()
    win.close()
    comm.shutdown()
    return {"pre": seen, "post": sorted(done), "unchanged": bool(torch.equal(before, after))}


def test_window_ops_run_the_communicators_hooks() -> None:
    for rank, res in enumerate(run_ranks(_hooked_ops, 2, timeout=120)):
        peer = 1 - rank
        ops = ["window.put", "window.get", "window.get_rows", "window.accumulate", "window.put", "window.signal",
               "window.wait_signal", "window.wait_signal"]
        window_pre = [p for p in res["pre"] if p[0].startswith("window.")]
        assert [p[0] for p in window_pre] == ops, res["pre"]
        assert all(p[1] == peer for p in window_pre)
        assert [p[2] for p in window_pre] == [False, False, False, False, True, False, False, False]
        statuses = [s for op, s in res["post"] if op.startswith("window.")]
        assert sorted(statuses) == sorted(["COMPLETED"] * 7 + ["TIMED_OUT"])
        assert res["unchanged"], "a put refused by a pre hook must not write"
