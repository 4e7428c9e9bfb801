"""Group sessions with real members (``FaultTolerantConfig.leader_address``, protocol 4): rank 0 of each replica
group holds the group's one coordinator connection and relays for the others over the local channel.

Members are threads (Gloo over loopback) with an in-process coordinator, as in tests/ft/test_ft_finish.py. A
"crash" closes a member's sockets (its client's thread stops: the peer reads EOF), a "hang" stops its client's
thread with the sockets left open (only its silence tells)."""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

import pytest
import torch

from torchnext.comms import ReduceOp
from torchnext.ft import (
    Coordinator,
    CoordinatorConfig,
    FaultTolerant,
    FaultTolerantConfig,
    MembershipConfig,
    RemovedFromGroup,
)
from torchnext.ft.group_session import GroupFollowerClient, GroupLeaderClient

pytestmark = pytest.mark.timeout(120)

GROUPS, SIZE = 2, 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop_client(ft: FaultTolerant, *, crash: bool) -> None:
    """The member's membership dies: its client thread stops; ``crash`` also closes its sockets."""
    client = ft._client
    client._closed.set()
    client._thread.join(timeout=5)
    if crash:
        if isinstance(client, GroupLeaderClient):
            client._relay.stop()
            if client._hub is not None:  # its relay listener and channel (protocol 5) close with the process
                client._hub.stop()
        with client._send_lock:
            try:
                client._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            client._sock.close()


def _run(coord: Coordinator, steps: int, kill: tuple[int, int, int, str] | None = None,
         timeout: float = 90.0, on_commit: Any = None, before_step: Any = None) -> dict[tuple[int, int], Any]:
    """Every rank of GROUPS x SIZE trains ``steps`` steps; ``kill = (group, rank, at_step, "crash"|"hang")``.
    Returns per (group, rank): ``(step_count, weight, generation, client type)``, or the exception it raised."""
    ports = {g: _free_port() for g in range(GROUPS)}
    out: dict[tuple[int, int], Any] = {}
    fts: list[FaultTolerant] = []
    ids: dict[tuple[int, int], int] = {}

    def member(g: int, r: int) -> None:
        w = torch.zeros(1)
        ft = FaultTolerant(FaultTolerantConfig(coordinator=coord.address, token=coord.token, replica_group=g,
                                               group_rank=r, group_size=SIZE, leader_address=f"127.0.0.1:{ports[g]}",
                                               timeout_s=30.0),
                           state_dict=lambda: {"w": w}, load_state_dict=lambda s: w.copy_(s["w"]))
        fts.append(ft)
        ids[(g, r)] = ft.member_id
        try:
            while ft.step_count < steps:
                if before_step is not None:
                    before_step(g, r, ft.step_count)
                if kill is not None and (g, r) == kill[:2] and ft.step_count == kill[2]:
                    _stop_client(ft, crash=kill[3] == "crash")
                    out[(g, r)] = ("killed", ft.step_count)
                    return
                with ft.step() as st:
                    grad = torch.full((1,), float(ft.step_count + 1))
                    ft.all_reduce(grad, ReduceOp.AVG)  # rank r of every live group: the same value
                    if st.commit():
                        w += grad
                        if on_commit is not None and ft.step_count < steps:  # nobody has left yet
                            on_commit()
            out[(g, r)] = (ft.step_count, float(w[0]), ft.generation, type(ft._client).__name__)
        except BaseException as exc:  # reported to the test
            out[(g, r)] = exc

    threads = [threading.Thread(target=member, args=(g, r), daemon=True) for g in range(GROUPS) for r in range(SIZE)]
    for th in threads:
        th.start()
    deadline = time.monotonic() + timeout
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    alive = [th.name for th in threads if th.is_alive()]
    for ft in fts:
        ft.close()
    assert not alive, f"member threads hung: {alive}; results so far: {out}"
    out["ids"] = ids
    return out


def _sessions(coord: Coordinator) -> int:
    """Authenticated connections the coordinator holds (one per group session, one per flat member)."""
    service = coord._service
    assert service is not None
    with service.lock:
        return len({id(c) for c in service._by_member.values()})


@pytest.mark.parametrize("relays", [False, True], ids=["direct", "relays"])
def test_group_sessions_train_with_one_connection_per_group(relays: bool) -> None:
    """``relays``: the two leaders form one relay chunk (protocol 5, ``relay_min_groups=2``): one votes for both
    and fans the decisions out; training is the same, exactly."""
    with Coordinator(CoordinatorConfig(membership=MembershipConfig(
            min_size=GROUPS, initial_size=GROUPS, relay_min_groups=2 if relays else 64))) as coord:
        seen: list[int] = []
        out = _run(coord, 5, on_commit=lambda: seen.append(_sessions(coord)))
        out.pop("ids")
        exact = float(sum(range(1, 6)))
        for (g, r), res in out.items():
            assert not isinstance(res, BaseException), (g, r, res)
            steps, w, gen, kind = res
            assert (steps, w, gen) == (5, exact, 1), (g, r, res)
            assert kind == ("GroupLeaderClient" if r == 0 else "GroupFollowerClient")
        assert seen and set(seen) == {GROUPS}, seen  # while training: one coordinator connection per group
        assert coord.step == 5 and coord.generation == 1
        state = coord._service.state if coord._service is not None else None
        assert state is not None and (state.relayed_at > 0) == relays  # decisions went out through the relay


@pytest.mark.parametrize(("rank", "mode"), [(1, "crash"), (1, "hang"), (0, "crash")],
                         ids=["follower-crash", "follower-hang", "leader-crash"])
@pytest.mark.parametrize("relays", [False, True], ids=["direct", "relays"])
def test_a_dead_rank_takes_its_group_out_and_the_other_group_trains_on(rank: int, mode: str, relays: bool) -> None:
    """``relays``: one of the two leaders relays the votes of both (protocol 5): a dead relay is its group's
    failure like any leader's, and the survivor trains on voting directly."""
    with Coordinator(CoordinatorConfig(membership=MembershipConfig(
            min_size=1, initial_size=GROUPS, relay_min_groups=2 if relays else 64))) as coord:
        out = _run(coord, 6, kill=(1, rank, 3, mode))
        ids = out.pop("ids")
        survivors = {k: v for k, v in out.items() if k[0] == 0}
        for key, res in survivors.items():
            assert not isinstance(res, BaseException), (key, res)
            steps, w, gen, _ = res
            assert steps == 6 and gen == 2, (key, res)  # exactly one generation more: the group left whole
            assert w == float(sum(range(1, 7))), (key, res)  # every committed step applied once
        assert out[(1, rank)] == ("killed", 3)
        other = out[(1, 1 - rank)]
        assert isinstance(other, RemovedFromGroup), other  # its group failed: the sibling learns it and stops
        gens = [(h["gen"], h["members"]) for h in coord.history() if h["event"] == "generation"]
        assert gens[:2] == [(1, [0, 1, 2, 3]), (2, sorted([ids[(0, 0)], ids[(0, 1)]]))], (gens, ids)
        failures = [h for h in coord.history() if h["event"] == "failure"]
        assert failures[0]["member"] == ids[(1, rank)], failures  # then the survivors' own departures (close)
        if rank == 1:  # detected and reported by its leader
            assert f"lost by its leader {ids[(1, 0)]}" in failures[0]["why"], failures
            assert failures[0]["hung"] == (mode == "hang")
        else:
            assert "lost by its leader" not in failures[0]["why"], failures


def test_a_follower_with_the_wrong_token_is_refused_by_the_leader() -> None:
    """The local channel authenticates as the coordinator does: a follower without the job token gets no welcome,
    and the leader, missing a follower, joins nobody."""
    with Coordinator(CoordinatorConfig(membership=MembershipConfig(min_size=1, initial_size=1))) as coord:
        port = _free_port()
        errors: dict[str, BaseException] = {}

        def leader() -> None:
            try:
                GroupLeaderClient(coord.address, coord.token, leader_address=f"127.0.0.1:{port}", replica_group=0,
                                  group_size=2, member_id=None, step=0, connect_timeout_s=2.0,
                                  coordinator_timeout_s=2.0, on_interrupt=lambda m: None)
            except BaseException as exc:
                errors["leader"] = exc

        th = threading.Thread(target=leader, daemon=True)
        th.start()
        with pytest.raises(Exception, match="auth"):
            GroupFollowerClient(f"127.0.0.1:{port}", "not-the-token", member_id=None, step=0, connect_timeout_s=2.0,
                                coordinator_timeout_s=2.0, on_interrupt=lambda m: None, replica_group=0,
                                group_rank=1, group_size=2)
        th.join(10)
        assert "only 0 of its 1 followers" in str(errors.get("leader")), errors
        assert coord.members == ()


@pytest.mark.parametrize("relays", [False, True], ids=["direct", "relays"])
def test_group_sessions_fail_over_to_a_standby(relays: bool) -> None:
    """The primary coordinator stops after step 3: each leader fails over with one report for its group (its
    followers are told ``failover``, then ``store``), the standby takes office over both groups, and every rank
    trains on to the end; every committed step applied exactly once. ``relays`` (``relay_min_groups=2`` on both):
    the votes went through a relay before the failover and do again after it (the standby names relays from the
    listeners in the reports), and every rank ends in the standby's generation."""
    token = "group-failover-token"
    member_cfg = MembershipConfig(min_size=1, initial_size=GROUPS, relay_min_groups=2 if relays else 64)
    with Coordinator(CoordinatorConfig(token=token, membership=member_cfg)) as primary, \
            Coordinator(CoordinatorConfig(token=token, standby=True, membership=member_cfg)) as standby:
        both = _Both(primary, standby)
        relayed_before: list[float] = []

        def stop_primary(g: int, r: int, step: int) -> None:
            if (g, r, step) == (0, 0, 3):  # group 0's leader, before its step 3: the others are at most one ahead
                assert primary._service is not None and primary._service.state is not None
                with primary._service.lock:
                    relayed_before.append(primary._service.state.relayed_at)
                primary.stop()

        out = _run(both, 8, before_step=stop_primary)  # type: ignore[arg-type]
        out.pop("ids")
        assert standby.in_office and standby.term == 2
        assert standby._service is not None and standby._service.state is not None
        with standby._service.lock:
            relayed_after = standby._service.state.relayed_at
        history = standby.history()
        took = next(i for i, h in enumerate(history) if h["event"] == "takeover")
        gens = [h for h in history[took:] if h["event"] == "generation"]
        assert gens and len(gens[0]["members"]) == GROUPS * SIZE, history  # (later ones: the groups leaving)
        for key, res in out.items():
            assert not isinstance(res, BaseException), (key, res)
            steps, w, member_gen, _ = res
            assert steps == 8 and w == float(sum(range(1, 9))), (key, res)
            assert member_gen == gens[0]["gen"], (key, res, gens)  # every rank in the standby's generation
        assert (relayed_before[0] > 0) == relays and (relayed_after > 0) == relays, (relayed_before, relayed_after)
        reports = [h for h in standby.history() if h["event"] == "report"]
        assert len(reports) == GROUPS and all(len(h["followers"]) == SIZE - 1 for h in reports), reports


class _Both:
    """What ``_run`` needs of a coordinator, for a primary listed first and its standby."""

    def __init__(self, primary: Coordinator, standby: Coordinator) -> None:
        self.address = f"{primary.address},{standby.address}"
        self.token = primary.token


def _local_peer(port: int) -> tuple[socket.socket, dict[str, Any]]:
    """A raw connection to a leader's local channel, with the challenge read."""
    from torchnext.ft._wire import LineReader

    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    reader = LineReader()
    msgs: list[dict[str, Any]] = []
    while not msgs:
        msgs = reader.feed(s.recv(1 << 16))
    return s, msgs[0]


def _answer(s: socket.socket) -> list[dict[str, Any]]:
    """Everything the leader sends until it closes the connection (or 5 s)."""
    from torchnext.ft._wire import LineReader

    reader, out = LineReader(), []
    s.settimeout(5)
    try:
        while True:
            data = s.recv(1 << 16)
            if not data:
                return out
            out += reader.feed(data)
    except (TimeoutError, ConnectionResetError):
        return out


def test_the_local_channel_survives_hostile_peers() -> None:
    """Garbage, a hello for another group, a wrong proof, deep nesting: each closes that one connection; the real
    follower then forms the session, and a late hello for a taken rank is refused while the session goes on."""
    from torchnext.ft._wire import PROTOCOL_VERSION, encode, mac, new_nonce

    with Coordinator(CoordinatorConfig(membership=MembershipConfig(min_size=1, initial_size=1))) as coord:
        port = _free_port()
        made: dict[str, Any] = {}

        def leader() -> None:
            try:
                made["leader"] = GroupLeaderClient(
                    coord.address, coord.token, leader_address=f"127.0.0.1:{port}", replica_group=5, group_size=2,
                    member_id=None, step=0, connect_timeout_s=20.0, coordinator_timeout_s=2.0,
                    on_interrupt=lambda m: None)
            except BaseException as exc:
                made["leader"] = exc

        th = threading.Thread(target=leader, daemon=True)
        th.start()
        time.sleep(0.2)

        def hello(challenge: dict[str, Any], token: str, **kw: Any) -> bytes:
            mine = new_nonce()
            return encode({"t": "hello", "nonce": mine, "proof": mac(token, "member", challenge["nonce"], mine),
                           "proto": PROTOCOL_VERSION, "step": 0, "group": 5, "group_rank": 1, "group_size": 2, **kw})

        cases = {
            "garbage": lambda c: b"\x80\x04\x95 not json\n",
            "nested": lambda c: b"[" * 5000 + b"\n",
            "other group": lambda c: hello(c, coord.token, group=6),
            "wrong token": lambda c: hello(c, "not-the-token"),
            "vote first": lambda c: b'{"t":"vote","gen":1,"step":0}\n',
        }
        for name, line in cases.items():
            s, challenge = _local_peer(port)
            with s:
                s.sendall(line(challenge))
                got = _answer(s)
            assert got and got[-1]["t"] == "reject", (name, got)
        assert "leader" not in made  # still waiting for a real follower
        follower = GroupFollowerClient(f"127.0.0.1:{port}", coord.token, member_id=None, step=0,
                                       connect_timeout_s=10.0, coordinator_timeout_s=2.0, on_interrupt=lambda m: None,
                                       replica_group=5, group_rank=1, group_size=2)
        th.join(10)
        lead = made["leader"]
        assert isinstance(lead, GroupLeaderClient), lead
        try:
            assert coord.wait_until(lambda c: c.generation == 1 and len(c.members) == 2, 10), coord.members
            s, challenge = _local_peer(port)
            with s:
                s.sendall(hello(challenge, coord.token))
                got = _answer(s)
            assert got and got[-1]["t"] == "reject" and got[-1]["code"] == "duplicate", got
            time.sleep(0.3)
            assert follower.fatal is None and lead.fatal is None
            assert coord.members == (lead.member_id, follower.member_id)
        finally:
            follower.close()
            lead.close()


@pytest.mark.parametrize("leader_first", [True, False], ids=["leader-first", "followers-first"])
def test_group_sessions_finish_in_any_order(leader_first: bool) -> None:
    """The job's end: every rank calls ``ft.finish()`` after its last step, a leader before or after its follower.
    Nobody raises, no generation follows, and the coordinator records the end at the last committed step."""
    with Coordinator(CoordinatorConfig(membership=MembershipConfig(min_size=GROUPS,
                                                                   initial_size=GROUPS))) as coord:
        ports = {g: _free_port() for g in range(GROUPS)}
        out: dict[tuple[int, int], Any] = {}

        def member(g: int, r: int) -> None:
            try:
                ft = FaultTolerant(FaultTolerantConfig(coordinator=coord.address, token=coord.token,
                                                       replica_group=g, group_rank=r, group_size=SIZE,
                                                       leader_address=f"127.0.0.1:{ports[g]}", timeout_s=30.0))
                while ft.step_count < 4:
                    with ft.step() as st:
                        grad = torch.ones(1)
                        ft.all_reduce(grad, ReduceOp.AVG)
                        st.commit()
                time.sleep(0.3 * ((r == 0) != leader_first) + 0.1 * g)  # staggered ends
                ft.finish()
                out[(g, r)] = ft.step_count
            except BaseException as exc:  # reported to the test
                out[(g, r)] = exc

        threads = [threading.Thread(target=member, args=(g, r), daemon=True)
                   for g in range(GROUPS) for r in range(SIZE)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not any(th.is_alive() for th in threads), out
        assert out == {(g, r): 4 for g in range(GROUPS) for r in range(SIZE)}, out
        assert coord.finished_step == 4 and coord.generation == 1
        events = [h["event"] for h in coord.history()]
        assert "failure" not in events and "group_failure" not in events, events


def _leader_path_counts(coord: Coordinator) -> dict[str, int]:
    """What the leader path holds in this process: relay and heartbeat threads, coordinator sessions, fds."""
    names = [t.name for t in threading.enumerate()]
    return {"relays": sum(n.startswith("torchnext-group-relay") for n in names),
            "heartbeats": sum(n.startswith("torchnext-heartbeat") for n in names),
            "sessions": _sessions(coord), "fds": len(os.listdir("/proc/self/fd"))}


def test_restarted_groups_leave_no_session_behind() -> None:
    """The 1,000th fault on the leader path, at CI size: replica group 1 is started 6 times; each time its follower
    crashes after two commits, its leader reports it and is removed with it, and the next incarnation joins and
    heals -- while group 0 trains on throughout. A dead session releases everything: after each restart the
    process holds one relay thread (group 0's leader's), two heartbeat threads, one coordinator session, and no more
    fds than after the first restart (the reaper releases superseded backends asynchronously: a bounded wait)."""
    cycles, slack = 6, 4
    with Coordinator(CoordinatorConfig(membership=MembershipConfig(min_size=1, initial_size=2))) as coord:
        stop = threading.Event()
        errors: list[BaseException] = []

        def train(ft: FaultTolerant, w: torch.Tensor, until: Any) -> None:
            while not until():
                with ft.step() as st:
                    grad = torch.ones(1)
                    ft.all_reduce(grad, ReduceOp.AVG)
                    if st.commit():
                        w += grad
                time.sleep(0.005)

        def member(g: int, r: int, port: int, crash_after: int | None) -> None:
            w = torch.zeros(1)
            ft = None
            try:
                ft = FaultTolerant(FaultTolerantConfig(coordinator=coord.address, token=coord.token,
                                                       replica_group=g, group_rank=r, group_size=SIZE,
                                                       leader_address=f"127.0.0.1:{port}", timeout_s=30.0),
                                   state_dict=lambda: {"w": w}, load_state_dict=lambda s: w.copy_(s["w"]))
                start = ft.step_count
                if crash_after is None:
                    train(ft, w, stop.is_set)
                else:
                    train(ft, w, lambda: ft is not None and ft.step_count >= start + crash_after)
                    _stop_client(ft, crash=True)
            except RemovedFromGroup:
                pass  # group 1's leader: its follower crashed
            except BaseException as exc:  # reported to the test
                errors.append(exc)
            finally:
                if ft is not None:
                    ft.close()

        def start(g: int, crash_after: int | None) -> list[threading.Thread]:
            port = _free_port()
            ths = [threading.Thread(target=member, args=(g, r, port, crash_after if r == 1 else None), daemon=True)
                   for r in range(SIZE)]
            for th in ths:
                th.start()
            return ths

        survivors = start(0, None)
        samples: list[dict[str, int]] = []
        try:
            for _ in range(cycles):
                for th in start(1, 2):
                    th.join(60)
                    assert not th.is_alive(), f"group 1 did not end: {coord.members}; errors {errors}"
                assert not errors, errors
                # back to group 0 alone, committing: then the dead session's resources must be gone
                assert coord.wait_until(lambda c: len(c.members) == SIZE, 30), coord.members
                deadline = time.monotonic() + 15
                while True:
                    got = _leader_path_counts(coord)
                    want = {"relays": 1, "heartbeats": 2, "sessions": 1}
                    flat = {k: got[k] for k in want} == want and (not samples or got["fds"] <= samples[0]["fds"] + slack)
                    if flat or time.monotonic() > deadline:
                        break
                    time.sleep(0.1)
                samples.append(got)
                assert flat, samples
        finally:
            stop.set()
            for th in survivors:
                th.join(30)
        assert not errors, errors
        assert len(samples) == cycles and coord.generation >= 2 * cycles, (samples, coord.generation)
