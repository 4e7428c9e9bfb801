"""Group sessions are the default for real members (issue 26): a replica group of more than one rank holds one
session, its rank 0's, whose local channel address is derived through the group's own store -- no address to
configure; ``group_session=False`` / ``TORCHNEXT_FT_GROUP_SESSION=0`` switch it off; a group of one rank, or ranks
without a store of their own group, connect flat (and say why)."""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from torchnext.ft import Coordinator, CoordinatorConfig, FaultTolerantConfig, MembershipConfig
from torchnext.ft.session import LEADER_KEY, plan
from torchnext.testing.multiprocess import RankContext, run_ranks

pytestmark = pytest.mark.timeout(120)


def _cfg(**kw: Any) -> FaultTolerantConfig:
    return FaultTolerantConfig(coordinator="127.0.0.1:1", token="t", **kw)


def test_the_plan_without_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHNEXT_FT_GROUP_SESSION", raising=False)
    monkeypatch.delenv("TORCHNEXT_FT_LEADER_ADDRESS", raising=False)
    assert plan(_cfg(), replica_group=None, group_rank=0, group_size=1).role == "flat"
    assert plan(_cfg(), replica_group=3, group_rank=0, group_size=1).role == "flat"
    given = _cfg(leader_address="127.0.0.1:4000")
    assert plan(given, replica_group=3, group_rank=0, group_size=2).role == "leader"
    p = plan(given, replica_group=3, group_rank=1, group_size=2)
    assert (p.role, p.address) == ("follower", "127.0.0.1:4000")
    off = plan(_cfg(group_session=False, leader_address="127.0.0.1:4000"), replica_group=3, group_rank=1, group_size=2)
    assert off.role == "flat" and "switched off" in off.why
    monkeypatch.setenv("TORCHNEXT_FT_GROUP_SESSION", "0")
    assert plan(given, replica_group=3, group_rank=1, group_size=2).role == "flat"
    on = _cfg(group_session=True, leader_address="127.0.0.1:4000")
    assert plan(on, replica_group=3, group_rank=1, group_size=2).role == "follower"  # the config wins
    monkeypatch.setenv("TORCHNEXT_FT_GROUP_SESSION", "yes")
    with pytest.raises(ValueError, match="TORCHNEXT_FT_GROUP_SESSION"):
        plan(given, replica_group=3, group_rank=1, group_size=2)
    monkeypatch.delenv("TORCHNEXT_FT_GROUP_SESSION")
    monkeypatch.setenv("TORCHNEXT_FT_LEADER_ADDRESS", "127.0.0.1:4001")
    assert plan(_cfg(), replica_group=3, group_rank=1, group_size=2).address == "127.0.0.1:4001"
    with pytest.raises(ValueError, match="group_session must be None or a bool"):
        _cfg(group_session=1)


def test_without_a_store_of_its_own_group_a_member_connects_flat_and_says_why() -> None:
    if dist.is_initialized():
        pytest.skip("this process has a default process group")
    p = plan(_cfg(), replica_group=0, group_rank=1, group_size=2)
    assert p.role == "flat" and "init_process_group" in p.why, p


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _member(ctx: RankContext, addr: str, token: str, env_off: bool, stale: str | None) -> dict[str, Any]:
    """Rank ``ctx.rank`` of replica group 0 (2 ranks): its own process group first, then FaultTolerant with no
    session settings at all; trains 3 steps. ``stale``: rank 1 finds this address under the leader key before rank 0
    publishes (a previous incarnation's leader, gone) and must read the key again."""
    from torchnext.comms import ReduceOp
    from torchnext.ft import FaultTolerant
    from torchnext.ft.group_session import GroupLeaderClient

    if env_off:
        os.environ["TORCHNEXT_FT_GROUP_SESSION"] = "0"
    store = dist.TCPStore(ctx.store_host, ctx.store_port, is_master=False, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=dist.PrefixStore("group0", store), rank=ctx.rank, world_size=2,
                            timeout=timedelta(seconds=30))
    if stale is not None:
        if ctx.rank == 1:
            from torch.distributed.distributed_c10d import _get_default_store

            _get_default_store().set(LEADER_KEY.format(name="ft", n=0), stale)
            dist.barrier()
        else:
            dist.barrier()
            time.sleep(1.0)  # the follower meets the stale address first
    ft = FaultTolerant(FaultTolerantConfig(coordinator=addr, token=token, replica_group=0, timeout_s=20.0,
                                           join_timeout_s=30.0, group_rank=ctx.rank, group_size=2))
    try:
        client = ft._client
        out: dict[str, Any] = {"session": ft.session, "why": ft.session_why, "peer": client.address,
                               "listens": client.leader_address if isinstance(client, GroupLeaderClient) else None}
        while ft.step_count < 3:
            with ft.step() as st:
                ft.all_reduce(torch.ones(1), ReduceOp.SUM)
                st.commit()
        out["step"] = ft.step_count
        out["members"] = list(ft.members)
        return out
    finally:
        ft.finish()
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["default", "stale-key", "env-off"])
def test_a_replica_group_holds_one_session_by_default(mode: str) -> None:
    cfg = MembershipConfig(min_size=1, initial_size=1)  # one replica group (of two ranks)
    with Coordinator(CoordinatorConfig(membership=cfg)) as coord:
        stale = f"127.0.0.1:{_dead_port()}" if mode == "stale-key" else None
        res = run_ranks(_member, 2, args=(coord.address, coord.token, mode == "env-off", stale), timeout=90)
    assert [r["step"] for r in res] == [3, 3], res
    if mode == "env-off":
        assert [r["session"] for r in res] == ["flat", "flat"], res
        assert all("switched off" in r["why"] for r in res)
        assert res[1]["peer"] == coord.address  # the follower's own coordinator connection
        return
    assert [r["session"] for r in res] == ["leader", "follower"], res
    assert res[0]["peer"] == coord.address
    assert res[1]["peer"] == res[0]["listens"] != coord.address  # the follower talks to its leader only
    assert res[0]["listens"].startswith("127.0.0.1:")  # the address that routes to the group's store (loopback)
    assert res[1]["peer"] != stale
