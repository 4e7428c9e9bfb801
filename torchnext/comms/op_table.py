"""The op table: the one object that owns what a Communicator's ops share.

A :class:`~torchnext.comms.Communicator` keeps its ops' shared state here -- the lock that orders terminal
transitions, the in-flight table, the error and abort state, the backend Works that may outlive their ops, the
store peer failures are published through, and the hook lists -- and a :class:`~torchnext.comms.work.Work` reads
and writes that state through this object alone (it holds its communicator only to keep it alive and to hand it
out as ``work.communicator``). Extensions never touch it: they attach through the communicator's public hook API
(``register_*_hook``, ``has_op_hooks``, ``run_pre_hooks``, ``run_post_hooks``).

Invariants, all under :attr:`OpTable.lock`::

    op_id in in_flight          <=> an async op of this communicator is issued and not terminal
    error is not None           once an op failed in a way that breaks the communicator (the first one wins)
    aborted is not None         once abort() ran (then every later op is refused)
    orphans / orphans_until     backend Works of failed ops that may still run, and when the last of them ends
                                (perf_counter; the reaper waits that long at most before releasing the backend)
"""

from __future__ import annotations

import queue
import threading
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from torchnext.comms import _peer_reports
from torchnext.comms.errors import CommAborted, CommError, PeerFailure
from torchnext.comms.hooks import AbortHookArgs, HookList, OpInfo, PostHookArgs

if TYPE_CHECKING:
    from torchnext.comms.work import Work

__all__ = ["OpTable"]


class OpTable:
    """Shared op state of one communicator (see the module docstring)."""

    __slots__ = (
        "abort_hooks",
        "aborted",
        "check_hooks",
        "error",
        "in_flight",
        "lock",
        "name",
        "orphans",
        "orphans_until",
        "post_hooks",
        "pre_hooks",
        "rank",
        "ranks",
        "store",
        "sync_work",
        "waiter",
    )

    def __init__(self, name: str, rank: int, ranks: tuple[int, ...], store: dist.Store | None) -> None:
        self.name = name
        self.rank = rank
        self.ranks = ranks
        self.store: dist.Store | None = store
        """The communicator's namespaced store; None once the backend was released."""
        self.lock = threading.Lock()
        self.in_flight: dict[int, Work] = {}
        self.sync_work: Work | None = None
        """The synchronous op in flight, if any (one issuing thread: a slot, no lock)."""
        self.error: CommError | None = None
        self.aborted: CommAborted | None = None
        self.orphans: list[Any] = []
        self.orphans_until = 0.0
        self.pre_hooks: HookList[OpInfo] = HookList("pre")
        self.post_hooks: HookList[PostHookArgs] = HookList("post")
        self.check_hooks: HookList[OpInfo] = HookList("check")
        self.abort_hooks: HookList[AbortHookArgs] = HookList("abort")
        self.waiter: CompletionWaiter | None = None

    def error_context(self, op: str | None, op_id: int | None) -> dict[str, Any]:
        """The keyword arguments every :class:`CommError` of this communicator's ops carries."""
        return {"op": op, "op_id": op_id, "comm_name": self.name, "rank": self.rank, "ranks": self.ranks}

    def add_orphans(self, works: Any, until: float) -> None:
        """Backend Works of a failed op that may still run until ``until`` (caller holds :attr:`lock`)."""
        self.orphans.extend(works)
        if until > self.orphans_until:
            self.orphans_until = until

    def wait_in_thread(self, backend_work: Any, work: Work, td: timedelta | None) -> None:
        """Have this communicator's waiter thread (started on first use) observe ``backend_work``, a backend Work
        without a future, and complete ``work`` from it."""
        waiter = self.waiter
        if waiter is None:
            waiter = self.waiter = CompletionWaiter(self.name)
        waiter.put(backend_work, work, td)

    def close_waiter(self) -> None:
        """Let the waiter thread leave once its current wait ends (abort, shutdown)."""
        if self.waiter is not None:
            self.waiter.close()

    def publish_peer_failure(self, exc: PeerFailure) -> None:
        """Tell the other members that this rank saw ``exc`` (see :mod:`torchnext.comms._peer_reports`)."""
        where = self.ranks[self.rank] if self.ranks else self.rank
        store = self.store
        if store is not None:  # (None: closed meanwhile -- nobody is left to tell)
            _peer_reports.publish(store, f"rank {self.rank} (global {where}): {exc}", self.name)

    def reported_peer_failure(self) -> str | None:
        """The failure another member published, if any (bounded: never hangs on a dead store)."""
        store = self.store
        return None if store is None else _peer_reports.reported(store, self.name)


class CompletionWaiter:
    """One daemon thread per communicator that waits on backend Works lacking a future (Gloo send/recv).

    Works are waited on in issue order; a later op that finishes first is observed when the earlier one does
    (completion is never missed, only its observation may be late). After an abort the thread may stay blocked in
    the abandoned backend until that backend's own timeout; it is a daemon and holds nothing else.
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Any, Work, timedelta | None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"torchnext-comms-waiter[{name}]", daemon=True)
        self._thread.start()

    def put(self, backend_work: Any, work: Work, timeout: timedelta | None) -> None:
        self._queue.put((backend_work, work, timeout))

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            backend_work, work, timeout = item
            try:
                if timeout is None:
                    backend_work.wait()
                else:
                    backend_work.wait(timeout)
            except Exception as exc:
                work._part_done(exc)
            else:
                work._part_done(None)
            del item, backend_work, work  # hold no reference while idle (it would keep the communicator alive)
