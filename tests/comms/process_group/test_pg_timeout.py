"""torch's timeout setters on torchnext groups: ``distributed_c10d._set_pg_timeout`` (torch 2.13's, which warns
and does nothing on a group without a Gloo/NCCL backend unless torchnext wraps it), ``ProcessGroup.set_timeout``
(what ``dist.set_timeout`` calls where it exists) and ``torchnext.comms.process_group.set_timeout``: the group's
op timeout changes, and an op nobody joins fails at the new timeout, not the old one."""

from __future__ import annotations

import time
import warnings
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import torchnext  # noqa: F401  (registers the "torchnext" backend)
from torchnext.comms import CommTimeout
from torchnext.testing import RankContext, run_ranks

pytestmark = pytest.mark.timeout(300)


def _timeouts(pg: Any) -> list[float]:
    return [c.timeout.total_seconds() for c in pg.communicators.values()]


def timeout_body(ctx: RankContext) -> dict[str, Any]:
    from torchnext.comms.process_group import set_timeout

    dist.init_process_group("torchnext", store=ctx.store, rank=ctx.rank, world_size=ctx.world_size,
                            timeout=timedelta(seconds=60))
    world = dist.group.WORLD
    sub = dist.new_group([0, 1])
    out: dict[str, Any] = {"initial": _timeouts(world)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "Set timeout is now only supported for either nccl or gloo"
        c10d._set_pg_timeout(timedelta(seconds=7))  # the default group
        out["c10d_default"] = _timeouts(world)
        c10d._set_pg_timeout(timedelta(seconds=8), sub)
        out["c10d_sub"] = (_timeouts(sub), _timeouts(world))
        sub.set_timeout(timedelta(seconds=9))  # type: ignore[union-attr]  # ProcessGroup.set_timeout
        out["method"] = _timeouts(sub)
        if hasattr(dist, "set_timeout"):  # torch >= 2.14
            dist.set_timeout(timedelta(seconds=10), sub)
            out["dist_set_timeout"] = _timeouts(sub)
        set_timeout(timedelta(seconds=0.5))
        out["ours"] = _timeouts(world)
    try:
        set_timeout(timedelta(0))
    except ValueError as exc:
        out["zero"] = str(exc)
    dist.barrier(group=sub)
    if ctx.rank == 0:
        t0 = time.monotonic()
        try:
            dist.all_reduce(torch.ones(2))  # rank 1 never joins: fails at the new 0.5 s timeout, not 60 s
            out["stuck"] = "no error"
        except CommTimeout as exc:
            out["stuck"] = type(exc).__name__
        out["waited_s"] = time.monotonic() - t0
        ctx.store.set("done", "1")
    else:
        ctx.store.wait(["done"], timedelta(seconds=120))
    return out


def test_timeout_setters_change_the_group_timeout() -> None:
    res = run_ranks(timeout_body, 2, timeout=240)
    for r in res:
        assert r["initial"] == [60.0]
        assert r["c10d_default"] == [7.0]
        assert r["c10d_sub"] == ([8.0], [7.0])  # only the group it was given
        assert r["method"] == [9.0]
        assert r.get("dist_set_timeout", [10.0]) == [10.0]
        assert r["ours"] == [0.5]
        assert "timeout must be positive" in r["zero"]
    assert res[0]["stuck"] == "CommTimeout"
    assert res[0]["waited_s"] < 20, res[0]["waited_s"]


def test_set_pg_timeout_keeps_torchs_behaviour_on_gloo() -> None:
    res = run_ranks(gloo_body, 2, timeout=120)
    assert res[0] == "ok"


def gloo_body(ctx: RankContext) -> str:
    import torchnext.comms.process_group  # noqa: F401  (installs the wrapper)

    dist.init_process_group("gloo", store=ctx.store, rank=ctx.rank, world_size=ctx.world_size)
    assert getattr(c10d._set_pg_timeout, "__torchnext_timeouts__", False)
    c10d._set_pg_timeout(timedelta(seconds=5))  # forwarded to torch's own: Gloo's _set_default_timeout
    dist.barrier()
    dist.destroy_process_group()
    return "ok"
