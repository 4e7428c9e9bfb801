"""The member simulator (:mod:`torchnext.testing.member_sim`) against the real coordinator process.

Simulated members speak the real protocol, so these tests also check the coordinator at sizes the process-based
tests never reach: formation, commits, a killed replica group detected (hang: by missed heartbeats; crash: by the
closed sockets) and the next generation holding exactly the survivors; a wrong job token refused; a coordinator
that cannot prove the token refused by the members.

By default the simulator speaks protocol 4's group sessions (issue 26: one connection per replica group, its
leader's); ``hierarchy=False`` runs every rank as a member of its own (flat), which real ``FaultTolerant`` ranks
still do. Kills: a whole group (hang or crash), a leader (its connection), a follower (reported by its leader).
"""

from __future__ import annotations

import gc
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from torchnext.ft._wire import PROTOCOL_VERSION, LineReader, encode
from torchnext.testing import _sim_worker
from torchnext.testing.coordinators import CoordinatorProcess
from torchnext.testing.member_sim import KillMode, MemberSim, SimConfig, SimError

pytestmark = pytest.mark.timeout(120)

TOKEN = "member-sim-test-token"
TIMEOUT_S = 0.6  # the coordinator's default heartbeat timeout
INTERVAL_S = 0.1
HANG_MIN_S = TIMEOUT_S - INTERVAL_S  # the silence starts at the last heartbeat, up to an interval before the kill


@pytest.fixture
def coordinator(request: pytest.FixtureRequest) -> Iterator[CoordinatorProcess]:
    groups = request.param
    with CoordinatorProcess(TOKEN, initial_size=groups, min_size=1, heartbeat_interval_s=INTERVAL_S,
                            heartbeat_timeout_s=TIMEOUT_S) as coord:
        yield coord


def _kill_and_check(sim: MemberSim, gen: int, survivors: set[int], group: int, mode: KillMode,
                    rank: int | None = None) -> tuple[int, float]:
    """Kill group ``group`` (or its rank ``rank``); the next generation is ``gen + 1`` and holds exactly the other
    survivors (a group leaves whole). Returns it and the time from the kill to its receipt by the last survivor."""
    t_kill = sim.kill_group(group, mode) if rank is None else sim.kill_rank(group, rank, mode)
    nxt = sim.await_generation(gen, timeout_s=20)
    assert nxt.ok, nxt.reason
    assert nxt.received_at is not None
    killed = set(sim.ids[group])
    assert len(killed) == sim.config.group_size
    assert nxt.gen == gen + 1, f"generation {nxt.gen} after killing group {group} in generation {gen}"
    assert set(nxt.members) == survivors - killed, f"generation {nxt.gen} after killing group {group}"
    return nxt.gen, nxt.received_at - t_kill


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="multiple of group_size"):
        SimConfig(address="127.0.0.1:1", token="t", ranks=60, group_size=8)
    with pytest.raises(ValueError, match="processes"):
        SimConfig(address="127.0.0.1:1", token="t", ranks=8, processes=0)
    with pytest.raises(ValueError, match="host:port"):
        SimConfig(address="nowhere", token="t", ranks=8)
    with pytest.raises(ValueError, match="token"):
        SimConfig(address="127.0.0.1:1", token="", ranks=8)
    with pytest.raises(ValueError, match="start_method"):
        SimConfig(address="127.0.0.1:1", token="t", ranks=8, start_method="thread")
    with pytest.raises(TypeError):
        MemberSim({"ranks": 8})  # type: ignore[arg-type]
    sim = MemberSim(SimConfig(address="127.0.0.1:1", token="t", ranks=16, group_size=8))
    with pytest.raises(ValueError, match="rank must be in"):
        sim.kill_rank(0, 8)
    with pytest.raises(ValueError, match="group must be in"):
        sim.kill_rank(2, 1)
    assert _sim_worker._HANG == KillMode.HANG.value  # the worker compares the mode's value


@pytest.mark.parametrize("hierarchy", [True, False], ids=["groups", "flat"])
@pytest.mark.parametrize("coordinator", [8], indirect=True)
def test_64_ranks_form_commit_and_lose_groups(coordinator: CoordinatorProcess, hierarchy: bool) -> None:
    cfg = SimConfig(address=coordinator.address, token=TOKEN, ranks=64, group_size=8, processes=2,
                    hierarchy=hierarchy)
    with MemberSim(cfg) as sim:
        formed = sim.join(timeout_s=30)
        assert formed.ok, formed.reason
        assert formed.gen == 1 and len(formed.members) == 64 and formed.rejected == {}
        assert sorted(sim.ids) == list(range(8))
        assert sorted(m for ids in sim.ids.values() for m in ids) == sorted(formed.members)

        run = sim.commit(20, timeout_s=30)
        assert run.ok, run.reason
        assert run.committed == 20 and len(run.rounds_s) == 20 and all(r > 0 for r in run.rounds_s)
        sessions = 8 if hierarchy else 64  # a vote and a decision per session and step, plus heartbeats
        assert run.messages >= 20 * sessions * 2
        if hierarchy:  # one vote and one decision per group, not per rank (heartbeats: ~1 per group per 0.1 s)
            assert run.messages < 20 * 64 * 2, run.messages

        survivors = set(formed.members)
        gen, hang_s = _kill_and_check(sim, formed.gen, survivors, 3, KillMode.HANG)
        survivors -= set(sim.ids[3])
        assert HANG_MIN_S <= hang_s < TIMEOUT_S + 5.0  # detected by silence: never before the timeout

        after = sim.commit(5, timeout_s=30)  # the survivors go on in the new generation
        assert after.ok and after.committed == 5, after.reason

        gen2, crash_s = _kill_and_check(sim, gen, survivors, 5, KillMode.CRASH)
        assert gen2 > gen
        assert crash_s < HANG_MIN_S  # a closed socket is seen at once, not after the heartbeat timeout


@pytest.mark.parametrize("coordinator", [2], indirect=True)
def test_wrong_token_is_refused(coordinator: CoordinatorProcess) -> None:
    cfg = SimConfig(address=coordinator.address, token="not-the-job-token", ranks=16, group_size=8,
                    start_method="spawn")  # the other start method (a fresh interpreter per worker)
    with MemberSim(cfg) as sim:
        formed = sim.join(timeout_s=30)
    assert not formed.ok
    assert formed.rejected == {"auth": 16}
    assert formed.gen == 0 and formed.members == [] and formed.ids == {}


def test_members_refuse_a_coordinator_without_the_token() -> None:
    """Mutual authentication: a listener that answers the hello with a forged proof gets no member."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)
    stop = threading.Event()

    def fake() -> None:
        conns = []
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(10)
            conns.append(conn)
            conn.sendall(encode({"t": "challenge", "nonce": "ab" * 16, "proto": PROTOCOL_VERSION}))
            reader, msgs = LineReader(), list[dict[str, Any]]()
            while not msgs:
                data = conn.recv(1 << 16)
                if not data:
                    break
                msgs = reader.feed(data)
            conn.sendall(encode({"t": "welcome", "proof": "00" * 32, "member": len(conns), "store_port": 1,
                                 "proto": PROTOCOL_VERSION, "heartbeat_interval_s": 0.1, "heartbeat_timeout_s": 0.6,
                                 "term": 1, "role": "office"}))

    thread = threading.Thread(target=fake, daemon=True)
    thread.start()
    try:
        cfg = SimConfig(address=f"127.0.0.1:{server.getsockname()[1]}", token=TOKEN, ranks=8, processes=1)
        with MemberSim(cfg) as sim:
            formed = sim.join(timeout_s=20)
        assert not formed.ok
        assert "could not prove it knows the job token" in formed.reason
    finally:
        stop.set()
        thread.join(timeout=5)
        server.close()


@pytest.mark.timeout(90)
def test_1024_ranks_form_commit_100_steps_and_lose_groups_leaders_and_followers() -> None:
    """Issue 26's CI test: 1,024 ranks in 128 group sessions of 8 at the default heartbeats (0.1 s / 0.6 s, both
    levels): formation, 100 commits, then a group hung, a leader crashed, a follower crashed and a follower hung,
    each followed by exactly the next generation without its group; the survivors commit after each."""
    with CoordinatorProcess(TOKEN, initial_size=128, min_size=1, heartbeat_interval_s=INTERVAL_S,
                            heartbeat_timeout_s=TIMEOUT_S) as coord:
        cfg = SimConfig(address=coord.address, token=TOKEN, ranks=1024, group_size=8, processes=2)
        with MemberSim(cfg) as sim:
            formed = sim.join(timeout_s=40)
            assert formed.ok, formed.reason
            assert len(formed.members) == 1024 and formed.gen == 1
            run = sim.commit(100, timeout_s=40)
            assert run.ok and run.committed == 100, run.reason
            assert run.messages < 100 * 1024, run.messages  # per group, not per rank: ~2 x 128 per step
            survivors, gen = set(formed.members), formed.gen
            for group, mode, rank, low, high in (
                    (127, KillMode.HANG, None, HANG_MIN_S, TIMEOUT_S + 5.0),  # the leader's silence: the coordinator
                    (126, KillMode.CRASH, 0, 0.0, HANG_MIN_S),                # a leader's EOF: at once
                    (125, KillMode.CRASH, 3, 0.0, HANG_MIN_S),                # its leader reports it at once
                    (124, KillMode.HANG, 5, TIMEOUT_S, TIMEOUT_S + 5.0)):     # its leader, after the local timeout
                gen, took = _kill_and_check(sim, gen, survivors, group, mode, rank)
                survivors -= set(sim.ids[group])
                assert low <= took < high, f"group {group} rank {rank} {mode.value}: next generation after {took:.3f}s"
                after = sim.commit(3, timeout_s=20)
                assert after.ok and after.committed == 3, after.reason
            assert len(survivors) == 1024 - 4 * 8


def test_a_worker_that_does_not_answer_says_where_it_is() -> None:
    """A bounded wait that runs out names the worker's stacks (faulthandler on SIGUSR2), not only the silence."""
    cfg = SimConfig(address="127.0.0.1:9", token=TOKEN, ranks=8, group_size=8, processes=1)
    with MemberSim(cfg) as sim:
        sim._conns[0].send(("join", {"deadline": float("inf")}))  # nobody listens at port 9: it retries forever
        with pytest.raises(SimError, match=r"did not answer 'join' within 1s; its stacks: \[\d+\.\d s of CPU since "
                                           r"it started\] .*_sim_worker\.py"):
            sim._gather(1.0, "join")


class _Finalized:
    """Garbage (a cycle, which only the collector frees) whose finalizer records the process it ran in."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.me = self

    def __del__(self) -> None:
        with open(self.log, "a") as fh:
            fh.write(f"{os.getpid()}\n")


def test_forked_workers_never_run_the_parents_finalizers(tmp_path: Path) -> None:
    """A forked worker inherits its parent's garbage. Collected there, a finalizer runs in a process without the
    parent's threads (a backend's destructor that joins them hangs: a CI run's worker sat "Garbage-collecting" past
    the join's deadline). MemberSim collects before it forks; nothing inherited is collected in a worker."""
    log = tmp_path / "finalized"
    gc.disable()
    try:
        _Finalized(log)  # garbage from the first moment: the parent cannot have collected it
    finally:
        gc.enable()
    frozen = gc.get_freeze_count()
    cfg = SimConfig(address="127.0.0.1:9", token=TOKEN, ranks=8, group_size=8, processes=1)
    with MemberSim(cfg) as sim:
        assert gc.get_freeze_count() == frozen  # the parent's own collector is as it was
        sim._conns[0].send(("collect", {}))
        sim._gather(5.0, "collect")
        worker = sim._procs[0].pid
    gc.collect()
    assert log.read_text().split() == [str(os.getpid())], f"worker pid {worker}"
