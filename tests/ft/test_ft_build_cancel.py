"""A generation's build superseded while it waits for a member that never comes ends at once, not at its timeout
(its thread, store connection and half-built backend were held for the whole ``timeout_s`` before)."""

from __future__ import annotations

import threading
import time
import types

import torch.distributed as dist

from torchnext.ft.config import FaultTolerantConfig
from torchnext.ft.fault_tolerant import FaultTolerant


def _builds(gen: str = "g7") -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(f"torchnext-ft-build[{gen}]")]


def _fake(server_port: int, *, timeout_s: float = 30.0, interruptions: int = 0) -> types.SimpleNamespace:
    """The parts of a FaultTolerant that ``_build`` uses: its member client, lock, newest announcement, reports."""
    news = threading.Event()
    client = types.SimpleNamespace(store_host="127.0.0.1", store_port=server_port, news=news, fatal=None,
                                   interruptions=interruptions)
    ft = types.SimpleNamespace(config=FaultTolerantConfig(timeout_s=timeout_s), _client=client,
                               _lock=threading.Lock(), _newest_gen=7, group_rank=0, group_size=1, reports=[],
                               trail=[])
    ft._report = lambda reason, gen=None: ft.reports.append((gen, reason))
    ft._trace = ft.trail.append
    return ft


def test_a_superseded_build_ends_at_once() -> None:
    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    ft = _fake(server.port)

    def supersede() -> None:  # generation 8 is announced while 7's build waits for member 11
        time.sleep(0.5)
        with ft._lock:
            ft._newest_gen = 8
        ft._client.news.set()

    threading.Thread(target=supersede, daemon=True).start()
    t0 = time.monotonic()
    got = FaultTolerant._build(ft, 7, (10, 11), 0, 0, time.monotonic() + 30.0)  # type: ignore[arg-type]
    assert got is None and time.monotonic() - t0 < 5.0
    deadline = time.monotonic() + 5.0
    while _builds() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _builds(), "the abandoned build still waits for its peer"
    assert ft.reports == []  # superseded, not failed: nothing to report


def test_an_interruption_before_the_announcement_does_not_call_the_build_off() -> None:
    """The coordinator failover flake of #24: the standby's first generation arrives after the interruption of the
    lost coordinator. Judged from an older count, the build was called off on every member that looked before the
    failover ran, and each then waited for a generation after it (QuorumLost after 60 s)."""
    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    ft = _fake(server.port, interruptions=1)  # the lost coordinator's interruption came before generation 7
    comm = FaultTolerant._build(ft, 7, (10,), 0, 1, time.monotonic() + 30.0)  # type: ignore[arg-type]
    try:
        assert comm is not None and comm.size == 1, ft.trail
    finally:
        if comm is not None:
            comm.abort("test over")
    ft._client.interruptions = 2  # an interruption after generation 8's announcement (counted at 1) calls it off
    assert FaultTolerant._build(ft, 8, (10, 11), 0, 1, time.monotonic() + 30.0) is None  # type: ignore[arg-type]
    assert ft.reports == [] and "interruptions 2 vs 1 at its announcement" in ft.trail[-1], ft.trail
    # called off before its thread connected: the thread sees that once connected, and ends at once (the store
    # must outlive it -- a connection to a closed port is retried for the whole timeout)
    deadline = time.monotonic() + 5.0
    while _builds("g8") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _builds("g8"), "the build called off before it connected still runs"
    del server


def test_a_failed_build_reports_the_generation_it_was_building() -> None:
    """The member is still in an older generation: a report of that one is ignored by the coordinator, so the
    build's own generation is reported (the others would wait for this member's build until their deadline)."""
    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    port = server.port
    del server  # nobody listens there now: the build's store connection fails
    ft = _fake(port, timeout_s=1.0)
    assert FaultTolerant._build(ft, 7, (10, 11), 0, 0, time.monotonic() + 30.0) is None  # type: ignore[arg-type]
    assert [gen for gen, _ in ft.reports] == [7], ft.reports
    assert "building generation 7 failed" in ft.reports[0][1]
