"""CancellableStore: a backend build waiting for an absent peer ends when cancelled; a communicator keeps a Python
store alive for as long as its backend may call it."""

from __future__ import annotations

import gc
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from torchnext.comms import Communicator
from torchnext.comms._address import store_route_address
from torchnext.comms.cancellable_store import CancellableStore, StoreCancelled


@pytest.fixture
def server() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)


def _client(server: dist.TCPStore, timeout_s: float = 30.0) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, None, False, timeout=timedelta(seconds=timeout_s))


def test_a_build_waiting_for_an_absent_peer_ends_when_cancelled(server: dist.TCPStore) -> None:
    store = CancellableStore(_client(server))
    box: dict[str, Any] = {}

    def build() -> None:
        try:
            Communicator(store, 0, 2, name="absent", timeout=30)  # rank 1 never comes
        except BaseException as exc:
            box["error"] = exc
            box["at"] = time.monotonic()

    t = threading.Thread(target=build, daemon=True)
    t.start()
    time.sleep(0.5)
    assert t.is_alive()  # blocked in the store
    cancelled_at = time.monotonic()
    store.cancel("superseded")
    t.join(10.0)
    assert not t.is_alive()
    assert isinstance(box["error"], StoreCancelled) and "superseded" in str(box["error"])
    assert box["at"] - cancelled_at < 2.0  # not the 30 s timeout (typically ~5 ms)
    with pytest.raises(StoreCancelled):  # and every later blocking call
        store.get("anything")


def test_waits_and_gets_pass_through_and_time_out(server: dist.TCPStore) -> None:
    store = CancellableStore(_client(server, timeout_s=0.3))
    store.set("a", b"1")
    assert store.get("a") == b"1" and store.check(["a"]) and not store.check(["b"])
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    threading.Timer(0.1, lambda: _client(server).set("late", "x")).start()
    store.wait(["late"], timedelta(seconds=5))  # arrives while waiting
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="wait timeout"):
        store.get("never")  # the inner store's timeout: 0.3 s
    assert 0.25 < time.monotonic() - t0 < 3.0
    assert store.host == "127.0.0.1" and store.port == server.port
    assert store_route_address(dist.PrefixStore("p", store)) == "127.0.0.1"  # a backend binds where the store is
    with pytest.raises(TypeError, match="Store"):
        CancellableStore("not a store")  # type: ignore[arg-type]


def test_a_communicator_keeps_a_temporary_python_store_alive(server: dist.TCPStore) -> None:
    """Given only a temporary, the Python object would be gone after construction, and the next call from C++ (a
    store call through the communicator's prefix) would fail with "Not implemented"."""
    comms: list[Communicator | None] = [None, None]

    def build(r: int) -> None:
        comms[r] = Communicator(CancellableStore(_client(server)), r, 2, name="temp", timeout=30)

    ts = [threading.Thread(target=build, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30.0)
    c0, c1 = comms
    assert c0 is not None and c1 is not None
    gc.collect()
    c0.store.set("k", "v")
    assert c1.store.get("k") == b"v"
    x = torch.ones(2)
    w = c1.all_reduce(torch.ones(2), async_op=True)
    c0.all_reduce(x)
    w.wait()
    assert x.tolist() == [2.0, 2.0]
    child = c0.child(dist.PrefixStore("kid", c0.store), [0], name="kid")  # a prefix of the same Python store
    gc.collect()
    child.store.set("c", "1")
    assert c0.store.get("kid/c") == b"1"
    for c in (child, c0, c1):
        c.abort("done")
