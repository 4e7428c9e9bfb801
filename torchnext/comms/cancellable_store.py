"""A store whose blocking calls can be called off: for a backend build that must be abandoned while it waits.

Building a Gloo backend blocks in the store until every member has published its address, up to the timeout.
Fault tolerance abandons a build when a newer generation supersedes it -- typically because a member it waits for
died -- and until now the abandoned build sat out its whole timeout (60 s by default), holding a thread, a store
connection and a half-built device (~2 threads, 5 fds). Wrapped in a :class:`CancellableStore`, the build's
blocking calls poll the store and give up as soon as :meth:`~CancellableStore.cancel` is called::

    store = CancellableStore(dist.TCPStore(host, port, None, False))
    # build thread:  Communicator(store, rank, size, ...)   -- blocks in store.wait / store.get
    # another thread: store.cancel("superseded")             -- the build raises StoreCancelled (ms later)

Semantics (``inner`` is the wrapped store; ``t`` the call's timeout, default ``inner.timeout``)::

    wait(keys, t):  until inner.check(keys): return | cancelled: raise StoreCancelled | t elapsed: DistStoreError
                    (polled every 1 ms at first, backing off to SLICE_S)
    get(key):       wait([key]); return inner.get(key)
    set, add, check, compare_set, delete_key, num_keys, append: inner's, unchanged (they do not block)

It is a Python ``torch.distributed.Store`` (torch calls it through its trampoline, with the GIL, from the
backend's C++): the Python object must stay alive as long as anything uses it from C++ -- a ``Communicator``
keeps the store it was given until its backend is released. Polling costs one round trip per look, only while
a key is missing.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, cast

import torch.distributed as dist

__all__ = ["SLICE_S", "CancellableStore", "StoreCancelled"]

SLICE_S = 0.05
"""The longest pause between two looks at a missing key; a cancel wakes the pause at once."""


class StoreCancelled(RuntimeError):
    """A blocking store call was called off (:meth:`CancellableStore.cancel`)."""


class CancellableStore(dist.Store):
    """``inner`` whose blocking calls end early once :meth:`cancel` was called (see the module docstring)."""

    def __init__(self, inner: dist.Store) -> None:
        if not isinstance(inner, dist.Store):
            raise TypeError(f"inner must be a torch.distributed.Store, got {type(inner).__name__}")
        super().__init__()
        self._inner: Any = cast(Any, inner)  # (torch's stubs lack several Store methods and the bytes values)
        self._cancelled = threading.Event()
        self._why = ""
        self._timeout: timedelta = self._inner.timeout
        self.set_timeout(self._timeout)

    @property
    def inner(self) -> dist.Store:
        """The wrapped store."""
        return cast(dist.Store, self._inner)

    @property
    def host(self) -> str | None:
        """The inner store's host (None without one): a backend binds to the interface that reaches it."""
        return getattr(self._inner, "host", None)

    @property
    def port(self) -> int | None:
        return getattr(self._inner, "port", None)

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self, why: str = "cancelled") -> None:
        """Make every blocking call, now and later, raise :class:`StoreCancelled` (at once: one look at the store at
        most)."""
        self._why = why
        self._cancelled.set()

    def _check(self) -> None:
        if self._cancelled.is_set():
            raise StoreCancelled(f"store call cancelled: {self._why}")

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        # polled with check() (no request stays open at the server; a timed-out c10d wait would also log two
        # warnings per slice), every 1 ms at first, backing off to SLICE_S
        self._check()
        limit = (self._timeout if timeout is None else timeout).total_seconds()
        deadline = time.monotonic() + limit
        nap = 0.001
        while not self._inner.check(keys):
            self._check()
            left = deadline - time.monotonic()
            if left <= 0:
                raise dist.DistStoreError(f"wait timeout after {limit * 1e3:.0f}ms, keys: {keys}")
            self._cancelled.wait(min(nap, left))
            nap = min(nap * 2, SLICE_S)

    def get(self, key: str) -> bytes:
        self.wait([key])
        return bytes(self._inner.get(key))

    def set(self, key: str, value: str | bytes) -> None:
        self._inner.set(key, value)

    def add(self, key: str, value: int) -> int:
        return int(self._inner.add(key, value))

    def check(self, keys: list[str]) -> bool:
        return bool(self._inner.check(keys))

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        return bytes(self._inner.compare_set(key, expected_value, desired_value))

    def delete_key(self, key: str) -> bool:
        return bool(self._inner.delete_key(key))

    def num_keys(self) -> int:
        return int(self._inner.num_keys())

    def append(self, key: str, value: str | bytes) -> None:
        self._inner.append(key, value)
