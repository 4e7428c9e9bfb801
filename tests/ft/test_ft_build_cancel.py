"""A generation's build superseded while it waits for a member that never comes ends at once, not at its timeout
(its thread, store connection and half-built backend were held for the whole ``timeout_s`` before)."""

from __future__ import annotations

import threading
import time
import types

import torch.distributed as dist

from torchnext.ft.config import FaultTolerantConfig
from torchnext.ft.fault_tolerant import FaultTolerant


def _builds() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("torchnext-ft-build[g7]")]


def test_a_superseded_build_ends_at_once() -> None:
    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    news = threading.Event()
    client = types.SimpleNamespace(store_host="127.0.0.1", store_port=server.port, news=news, fatal=None)
    ft = types.SimpleNamespace(config=FaultTolerantConfig(timeout_s=30.0), _client=client, _lock=threading.Lock(),
                               _newest_gen=7, _wait_epoch=0, group_rank=0, group_size=1, reports=[])
    ft._report = ft.reports.append

    def supersede() -> None:  # generation 8 is announced while 7's build waits for member 11
        time.sleep(0.5)
        with ft._lock:
            ft._newest_gen = 8
        news.set()

    threading.Thread(target=supersede, daemon=True).start()
    t0 = time.monotonic()
    got = FaultTolerant._build(ft, 7, (10, 11), 0, 0, time.monotonic() + 30.0)  # type: ignore[arg-type]
    assert got is None and time.monotonic() - t0 < 5.0
    deadline = time.monotonic() + 5.0
    while _builds() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _builds(), "the abandoned build still waits for its peer"
    assert ft.reports == []  # superseded, not failed: nothing to report
