"""Run a function on N ranks -- real processes (:func:`run_ranks`) or threads (:func:`run_threads`).

The caller (the parent) hosts the ``TCPStore`` on 127.0.0.1 with a free port: no rank hosts it, so a rank that dies
does not take the store down. Every wait is bounded; every child is killed and reaped in ``finally``, even when the
test fails. ``fn(ctx, *args)`` runs on each rank with a :class:`RankContext`; its return value (picklable) comes back
in rank order.

Process start: ``forkserver`` with ``torch``, ``torch._dynamo`` (what ``torch.optim`` imports), FSDP2,
``torchnext.comms`` and ``torchnext.ft`` preloaded (a fork of a server that imported them once; importing torch per
process costs 2-3 s here, dynamo 3-7 s under load), ``spawn`` as an option. ``fn`` must be importable by name
(a module-level function). A child ends with ``os._exit`` after reporting, so abandoned backends never delay it.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["Child", "RankContext", "RankExited", "RankFailure", "run_each", "run_ranks", "run_threads"]

_PRELOAD = ["torch", "torch.distributed", "torchnext.comms", "torch._dynamo", "torch.distributed.fsdp", "torchnext.ft",
            "torchnext.testing.ft_parallel"]
"""What the forkserver imports once (a child forked from it has them): a fault-tolerant member (or a warm spare
started beside a running job) otherwise spends ~0.4 s of CPU importing ``torchnext.ft`` and its workload first."""


class RankFailure(RuntimeError):
    """One or more ranks raised, exited unexpectedly, or did not finish in time. ``details`` maps rank -> text."""

    def __init__(self, message: str, details: dict[int, str]) -> None:
        self.details = details
        text = "\n".join(f"--- rank {r} ---\n{d}" for r, d in sorted(details.items()))
        super().__init__(f"{message}\n{text}")


@dataclass(frozen=True)
class RankExited:
    """Result slot of a rank in ``allow_exit`` that ended without returning (e.g. ``os._exit`` or killed)."""

    exitcode: int | None


@dataclass(kw_only=True)
class RankContext:
    """What ``fn`` receives on each rank."""

    rank: int
    world_size: int
    store_host: str
    store_port: int
    store_timeout_s: float = 60.0
    _store: Any = field(default=None, repr=False)

    @property
    def store(self) -> dist.TCPStore:
        """A client of the parent's TCPStore (created on first use)."""
        if self._store is None:
            self._store = dist.TCPStore(
                self.store_host, self.store_port, self.world_size, False,
                timeout=timedelta(seconds=self.store_timeout_s),
            )
        return self._store


def _host_store(world_size: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, world_size, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def _child(fn: Callable[..., Any], ctx: RankContext, args: Sequence[Any], results: Any) -> None:
    try:
        out = (ctx.rank, True, fn(ctx, *args))
    except BaseException:
        out = (ctx.rank, False, traceback.format_exc())
    try:
        results.put(out)
    except Exception:  # unpicklable result
        results.put((ctx.rank, False, traceback.format_exc()))
    results.close()
    results.join_thread()
    os._exit(0)


_context_lock = threading.Lock()

_status_lock = threading.RLock()
"""Held around every look at a child's status and every start. multiprocessing's ``Popen.poll`` is not thread-safe:
a forkserver child's exit code is 8 bytes in a pipe, and two threads that both see the pipe readable both read -- one
gets the code, the other EOF, which it records as exit code 255. ``Process.start()`` polls *every* live child
(``multiprocessing.process._cleanup``), so one thread starting a process races another asking for its own child's
exit code (the soak's two job threads: an exit 255 for a member that exited 0, 2026-12-04; 5 of 200 children with
eight threads asking at once). Reentrant: ``start`` polls under it."""


class Child:
    """A ``multiprocessing`` process whose start, status and reaping are safe to use from several threads (see
    ``_status_lock``): the same surface as ``Process`` for what the harnesses use. ``join`` waits outside the lock
    (on the process's sentinel) and reads the status under it."""

    def __init__(self, ctx: Any, **kwargs: Any) -> None:
        self._p = ctx.Process(**kwargs)

    @property
    def pid(self) -> int | None:
        return self._p.pid

    @property
    def name(self) -> str:
        return str(self._p.name)

    @property
    def sentinel(self) -> int:
        return int(self._p.sentinel)

    def start(self) -> None:
        with _status_lock:
            self._p.start()

    @property
    def exitcode(self) -> int | None:
        with _status_lock:
            return self._p.exitcode

    def is_alive(self) -> bool:
        with _status_lock:
            return bool(self._p.is_alive())

    def join(self, timeout: float | None = None) -> None:
        if self._p.pid is None:
            raise ValueError(f"{self.name}: join() of a process that was never started")
        multiprocessing.connection.wait([self._p.sentinel], timeout)
        with _status_lock:
            self._p.join(0)

    def kill(self) -> None:
        with _status_lock:
            self._p.kill()

    def terminate(self) -> None:
        with _status_lock:
            self._p.terminate()


def _mp_context(start_method: str) -> Any:
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        with _context_lock:
            ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    timeout: float = 120.0,
    start_method: str = "forkserver",
    allow_exit: Collection[int] = (),
    store_timeout: float = 60.0,
) -> list[Any]:
    """Run ``fn(ctx, *args)`` on ``world_size`` processes; return their results in rank order.

    Raises :class:`RankFailure` (with every rank's traceback) when a rank raises, exits without a result (unless it
    is in ``allow_exit``: its slot is then a :class:`RankExited`), or the whole run exceeds ``timeout`` seconds.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    store = _host_store(world_size, store_timeout)
    ctx = _mp_context(start_method)
    results = ctx.Queue()
    procs = []
    got: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        for rank in range(world_size):
            rc = RankContext(rank=rank, world_size=world_size, store_host="127.0.0.1", store_port=store.port,
                             store_timeout_s=store_timeout)
            p = Child(ctx, target=_child, args=(fn, rc, tuple(args), results), name=f"rank{rank}", daemon=True)
            p.start()
            procs.append(p)
        deadline = time.monotonic() + timeout
        exited_at: dict[int, float] = {}
        while len(got) + len(errors) < world_size:
            now = time.monotonic()
            if now > deadline:
                for r in range(world_size):
                    if r not in got and r not in errors:
                        errors[r] = f"no result within {timeout}s (alive={procs[r].is_alive()})"
                break
            try:
                rank, ok, value = results.get(timeout=0.05)
            except queue.Empty:
                pass
            else:
                (got if ok else errors)[rank] = value
                continue
            for r, p in enumerate(procs):
                if r in got or r in errors or p.is_alive():
                    continue
                # exited: give its queued result a moment to arrive before judging
                first = exited_at.setdefault(r, now)
                if now - first > 1.0:
                    if r in allow_exit:
                        got[r] = RankExited(p.exitcode)
                    else:
                        errors[r] = f"process exited with code {p.exitcode} without a result"
        if errors:
            raise RankFailure(f"{len(errors)} of {world_size} ranks failed running {getattr(fn, '__name__', fn)}", errors)
        return [got[r] for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
        results.close()
        results.cancel_join_thread()
        del store


def run_threads(
    fn: Callable[..., Any], world_size: int, *, args: Sequence[Any] = (), timeout: float = 60.0, store_timeout: float = 30.0
) -> list[Any]:
    """Like :func:`run_ranks` but each rank is a daemon thread of this process (fast; no process-level faults).

    A rank still running at ``timeout`` is reported in :class:`RankFailure` and left behind (threads cannot be killed).
    """
    store = _host_store(world_size, store_timeout)
    got: dict[int, Any] = {}
    errors: dict[int, str] = {}

    def body(rank: int) -> None:
        rc = RankContext(rank=rank, world_size=world_size, store_host="127.0.0.1", store_port=store.port,
                         store_timeout_s=store_timeout)
        try:
            got[rank] = fn(rc, *args)
        except BaseException:
            errors[rank] = traceback.format_exc()

    threads = [threading.Thread(target=body, args=(r,), name=f"rank{r}", daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for r, t in enumerate(threads):
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            errors.setdefault(r, f"no result within {timeout}s")
    if errors:
        raise RankFailure(f"{len(errors)} of {world_size} ranks failed running {getattr(fn, '__name__', fn)}", errors)
    return [got[r] for r in range(world_size)]


def run_each(fns: Sequence[Callable[[], Any]], *, timeout: float = 60.0) -> dict[int, Any]:
    """Run every ``fns[i]`` in a daemon thread of its own, all at once; ``{i: its result, or the exception it
    raised}`` -- an exception is a result here, for the test to check. Reference::

        return {i: fn() or the BaseException it raised for i, fn in enumerate(fns)}   # concurrently

    Raises :class:`RankFailure` naming every thread still running ``timeout`` seconds after the start (left
    behind: threads cannot be killed) with the results so far.
    """
    out: dict[int, Any] = {}

    def body(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as exc:  # a result: the caller checks it
            out[i] = exc

    threads = [threading.Thread(target=body, args=(i,), name=f"each{i}", daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    hung = {i: f"still running after {timeout}s" for i, t in enumerate(threads) if t.is_alive()}
    if hung:
        raise RankFailure(f"{len(hung)} of {len(fns)} threads hung (results so far: {out})", hung)
    return out
