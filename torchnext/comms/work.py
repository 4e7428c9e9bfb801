"""Work: the handle of one issued op, and its status.

A :class:`Work` reaches exactly one terminal state, once::

    NOT_STARTED -> IN_PROGRESS -> COMPLETED | ERROR | TIMED_OUT | ABORTED

How completion is observed (this fixes the thread that runs post hooks, see :mod:`torchnext.comms.hooks`):

* synchronous ops on backends whose timed wait is only a wait (``BackendHandle.interruptible_wait``: Gloo
  collectives): the issuing thread waits on the backend Work itself for ``SYNC_WAIT_SLICE`` (40 ms) -- the
  lowest-latency wait; a longer op then waits on a lock of ours that a future callback (or abort()) releases,
  checking the op's deadline (an abort reaches such an op within 40 ms, at once after the first slice);
* async ops on such backends: a thread that calls ``Work.wait()`` first waits on the backend Work itself for one
  slice and completes the op there (no hand-off from the backend's thread, which costs tens of microseconds). No
  completion callback is attached when such an op is issued; it is attached when a wait outlasts its first slice,
  by ``add_done_callback``, or -- for ops nobody waits on -- by the communicator's :class:`UnwaitedWatcher` after
  :data:`UNWAITED_GRACE`. Whichever observer is first completes the op;
* all other ops (sync send/recv, whose timed wait on Gloo would *be* the op's timeout; NCCL): the backend Work's
  future callback, or, for backend Works without a future (Gloo send/recv), one waiter thread per communicator.
  ``Work.wait()`` then blocks on our own lock, not on the backend, so ``abort()`` wakes it at once.
"""

from __future__ import annotations

import _thread
import enum
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from torchnext.comms.errors import CommError, CommTimeout, HookError, PeerFailure, classify_backend_error
from torchnext.comms.hooks import OpInfo, PostHookArgs

if TYPE_CHECKING:
    from torchnext.comms.communicator import Communicator

__all__ = ["Work", "WorkStatus"]

_LOG = logging.getLogger("torchnext.comms")


class WorkStatus(enum.Enum):
    """Lifecycle of a :class:`Work`. The last four are terminal."""

    NOT_STARTED = "not_started"
    """Created; pre hooks running, not yet handed to the backend."""
    IN_PROGRESS = "in_progress"
    """Handed to the backend."""
    COMPLETED = "completed"
    ERROR = "error"
    TIMED_OUT = "timed_out"
    ABORTED = "aborted"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


SYNC_WAIT_SLICE = timedelta(milliseconds=40)
"""Longest single wait of a synchronous op in the issuing thread: bounds how late it notices an abort."""
_SLICE_S = SYNC_WAIT_SLICE.total_seconds()
_SLICE_TIMEOUT_TEXT = "Operation timed out!"  # c10d Work::wait(timeout) when the slice elapses

_TERMINAL = frozenset({WorkStatus.COMPLETED, WorkStatus.ERROR, WorkStatus.TIMED_OUT, WorkStatus.ABORTED})
_NS = WorkStatus.NOT_STARTED
_COMPLETED = WorkStatus.COMPLETED
_IP = WorkStatus.IN_PROGRESS  # hot paths test "terminal" by identity: Enum.__hash__ is slow Python code
_STATUS_OF: dict[type[CommError], WorkStatus] = {CommTimeout: WorkStatus.TIMED_OUT}
_new_tuple = tuple.__new__  # builds a NamedTuple without running its Python-level __new__ (hot path)


class Work:
    """Handle of one op issued by a :class:`~torchnext.comms.Communicator` (returned when ``async_op=True``).

    * ``wait(timeout=None) -> bool``: block until the op is terminal. Returns True when it COMPLETED; raises its
      exception otherwise (``CommTimeout``, ``PeerFailure``, ``CommAborted``, ``CommError``; or ``HookError``
      when the op completed but a post hook raised). The op's own deadline is issue time + its timeout: when a
      wait reaches it the op becomes TIMED_OUT and ``CommTimeout`` is raised. With ``timeout`` shorter than the
      remaining time, a wait that elapses first returns **False** and the op keeps running.
    * ``is_completed()``: True once terminal (success or failure).
    * ``status``, ``exception()``, ``op``, ``op_id``, ``result()`` (waits, then returns the output tensors).

    Waiting from several threads at once is allowed.
    """

    __slots__ = (
        "__weakref__",
        "_bw",
        "_callbacks",
        "_comm",
        "_deadline",
        "_done",
        "_exc",
        "_finalize",
        "_fut",
        "_hook_error",
        "_launched",
        "_outputs",
        "_pending",
        "_racy",
        "_source",
        "_t0",
        "_t_end",
        "_table",
        "info",
        "op",
        "op_id",
        "peer",
        "status",
    )

    def __init__(
        self,
        comm: Communicator,
        op: str,
        op_id: int,
        info: OpInfo | None,
        outputs: Sequence[torch.Tensor],
        timeout_s: float,
        peer: int | None,
        needs_lock: bool,
    ) -> None:
        self._comm = comm  # kept alive by its ops; the op state is reached through its table alone
        self._table = comm._ops
        self.op = op
        self.op_id = op_id
        self.info = info
        self.peer = peer
        self._outputs = outputs
        self.status = WorkStatus.NOT_STARTED
        self._exc: BaseException | None = None
        self._hook_error: HookError | None = None
        self._finalize: Callable[[], None] | None = None
        self._pending = 1
        self._launched: Sequence[Any] | None = None  # the backend Works, once launched (cleared when terminal)
        self._bw: Any = None  # the backend Work a waiting thread may wait on directly (see wait())
        self._fut: Any = None  # the backend Work whose future gets no completion callback yet (see _watch)
        self._racy = False  # completion may be observed twice (the backend's callback and a direct waiter)
        self._callbacks: list[Callable[[Work], object]] | None = None
        self._source: list[Any] | None = None  # recv from any source: [its backend Work]
        self._t0 = time.perf_counter()
        self._t_end = 0.0
        self._deadline = self._t0 + timeout_s
        self._done: _thread.LockType | None = None
        if needs_lock:
            lock = _thread.allocate_lock()
            lock.acquire()
            self._done = lock  # released once when terminal; every waiter re-releases it (baton)

    def __repr__(self) -> str:
        return f"Work({self.op}, op_id={self.op_id}, comm={self._comm.name!r}, status={self.status.name})"

    # ----------------------------------------------------------------------------------------------- public API
    def wait(self, timeout: float | timedelta | None = None) -> bool:
        """Block until terminal (see the class docstring). Returns True when COMPLETED."""
        if self.status is _IP or self.status is _NS:
            assert self._done is not None  # only async Works are handed out before they are terminal
            bw = self._bw
            if bw is not None and timeout is None:
                self._bw = None  # one direct waiter; any other waits on the lock
                self._wait_backend(bw)
                bw = None  # (a raise below keeps this frame in the traceback: no backend object in it)
                if self.status is _COMPLETED and self._hook_error is None:
                    return True  # the common case: completed here (nothing to wait on, no lock to pass on)
            if self._fut is not None and (self.status is _IP or self.status is _NS):
                self._watch()  # a long op (or a bounded wait): the backend's callback (or abort) wakes us
            remaining = self._deadline - time.perf_counter()
            limit = remaining if timeout is None else min(_seconds(timeout), remaining)
            if self._done.acquire(timeout=min(max(limit, 0.0), threading.TIMEOUT_MAX)):
                self._done.release()
            elif time.perf_counter() >= self._deadline:
                self._time_out()
            else:
                return False
        return self._outcome()

    def add_done_callback(self, fn: Callable[[Work], object]) -> None:
        """Call ``fn(self)`` once the op is terminal (any terminal state), after its post hooks ran: on the thread
        that finished it, or at once on this thread when it already is terminal. Callbacks run in the order they
        were added; one that raises is logged (``torchnext.comms``) and does not stop the others."""
        if not callable(fn):
            raise TypeError(f"add_done_callback: fn must be callable, got {fn!r}")
        with self._table.lock:
            if self.status is _IP or self.status is _NS:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                pending = True
            else:
                pending = False
        if pending:
            self._watch()  # nobody may wait: completion must be observed by the backend's callback
        else:
            _run_callback(fn, self)

    def source_rank(self) -> int | None:
        """The rank a completed ``recv`` from any source (``src=None``) received from (None while in flight); for
        other ops, the op's peer (None for collectives)."""
        if self._source is None:
            return self.peer
        if self.status is not _COMPLETED:
            return None
        return int(self._source[0]._source_rank())

    def is_completed(self) -> bool:
        """True once the op is terminal (COMPLETED, ERROR, TIMED_OUT or ABORTED)."""
        if self.status is not _IP and self.status is not _NS:
            return True
        bw = self._bw
        if bw is not None and bw.is_completed():
            self._bw = None
            self._wait_backend(bw)  # returns at once: complete (or fail) it here
            return True
        if time.perf_counter() >= self._deadline:
            self._time_out()
            return True
        return False

    def exception(self) -> BaseException | None:
        """The op's exception once it failed, else None."""
        return self._exc

    def result(self) -> list[torch.Tensor]:
        """Wait for completion (raising on failure) and return the op's output tensors on this rank."""
        self.wait()
        return list(self._outputs)

    @property
    def communicator(self) -> Communicator:
        """The communicator that issued this op."""
        return self._comm

    @property
    def duration_s(self) -> float | None:
        """Seconds from issue to the terminal state (None while in flight)."""
        return self._t_end - self._t0 if self.status is not _IP and self.status is not _NS else None

    # ---------------------------------------------------------------------------------------------- internals
    def _outcome(self) -> bool:
        # A copy is raised, never the stored exception: raising that would give it a traceback whose frames (this
        # one, the caller's) hold this Work -- a cycle Work -> exception -> traceback -> frame -> Work that kept a
        # failed op's communicator, and with it the whole backend (threads, sockets), until a full collection.
        if self.status is _COMPLETED:
            if self._hook_error is not None:
                raise _fresh(self._hook_error)
            return True
        assert self._exc is not None
        raise _fresh(self._exc)

    def _time_out(self) -> None:
        exc = CommTimeout(
            f"did not complete within its timeout of {self._deadline - self._t0:.3f}s (the communicator is now errored)",
            **self._table.error_context(self.op, self.op_id),
        )
        self._finish(WorkStatus.TIMED_OUT, exc)

    def _wrap_backend_error(self, exc: BaseException) -> CommError:
        cls = classify_backend_error(exc)
        ctx: dict[str, Any] = self._table.error_context(self.op, self.op_id)
        if cls is PeerFailure:
            wrapped: CommError = PeerFailure(str(exc), peer=self.peer, **ctx)
        else:
            wrapped = cls(str(exc), **ctx)
        # The backend's exception keeps its message, not its frames: they hold the backend Work or future this op
        # ran on, and the Work keeps its exception -- a reference cycle through the traceback would keep an
        # abandoned backend's sockets and threads alive until a full garbage collection.
        # So do the exceptions it was raised in the handling of (``__context__``: the slice wait's timeout before
        # a second wait raised the real failure, whose frame is this Work's).
        seen: set[int] = set()
        chain: list[BaseException | None] = [exc]
        while chain:
            link = chain.pop()
            if link is not None and id(link) not in seen:
                seen.add(id(link))
                link.__traceback__ = None
                chain += [link.__cause__, link.__context__]
        wrapped.__cause__ = exc
        return wrapped

    def _on_future(self, fut: torch.futures.Future[Any]) -> None:
        """Backend future callback (backend thread, or the issuing thread if already done)."""
        try:
            fut.value()
        except Exception as exc:
            self._part_done(exc)
        else:
            self._part_done(None)

    def _part_done(self, exc: BaseException | None) -> None:
        if exc is not None:
            wrapped = self._wrap_backend_error(exc)
            self._finish(_STATUS_OF.get(type(wrapped), WorkStatus.ERROR), wrapped)
            return
        if self._pending != 1 or (self._racy and self._finalize is not None):
            # composite (batch_p2p): the last part finishes; two observers of an op with a finalizer: the first
            # runs it. (Two observers of any other op both reach _finish, whose status check lets the first win.)
            with self._table.lock:
                self._pending -= 1
                if self._pending:
                    return
        if self._finalize is not None:
            try:
                self._finalize()
            except Exception as fin_exc:
                self._finish(WorkStatus.ERROR, self._wrap_backend_error(fin_exc))
                return
        self._finish(WorkStatus.COMPLETED, None)

    def _finish(self, status: WorkStatus, exc: BaseException | None, *, breaks_comm: bool = True) -> bool:
        """Move to terminal ``status`` once (first caller wins); run post hooks; wake waiters.

        A failure (ERROR/TIMED_OUT) makes the communicator errored unless ``breaks_comm`` is False (the backend
        refused the op's arguments before issuing it)."""
        table = self._table
        if breaks_comm and isinstance(exc, CommTimeout) and self.status is _IP:
            report = table.reported_peer_failure()  # a peer died elsewhere in the group: say so, not "timeout"
            if report is not None:
                failure = PeerFailure(f"a member reported a peer failure ({report}); this op could not complete",
                                      **table.error_context(self.op, self.op_id))
                failure.__cause__ = exc
                exc = failure
        publish = False
        with table.lock:
            if self.status is not _IP and self.status is not _NS:
                return False
            self.status = status
            self._exc = exc
            self._t_end = time.perf_counter()
            self._bw = self._fut = None  # no backend object outlives the op here (their destruction order matters)
            launched, self._launched = self._launched, None
            if launched and status is not _COMPLETED:  # a failed op's backend Works may still run: buried with the
                table.add_orphans(launched, self._deadline)  # backend, until its deadline at the latest (its own)
            table.in_flight.pop(self.op_id, None)
            if status is WorkStatus.ERROR or status is WorkStatus.TIMED_OUT:
                if breaks_comm and table.error is None and isinstance(exc, CommError):
                    table.error = exc
                    # an original peer failure (not one learnt from another member's report)
                    publish = isinstance(exc, PeerFailure) and not isinstance(exc.__cause__, CommTimeout)
        if publish:
            assert isinstance(exc, PeerFailure)
            table.publish_peer_failure(exc)
        info = self.info
        if info is not None and table.post_hooks.snapshot:
            args = _new_tuple(PostHookArgs, (info, self, status, self._t_end - self._t0, exc))  # = PostHookArgs(...)
            self._hook_error = table.post_hooks.run(args, stop_on_error=False)
        if self._done is not None:
            try:
                self._done.release()
            except RuntimeError:  # a sync op's lock, already released by its backend's callback
                pass
        if self._callbacks is not None:
            with table.lock:
                callbacks, self._callbacks = self._callbacks, None
            for fn in callbacks or ():
                _run_callback(fn, self)
        return True

    def _watch(self) -> None:
        """Attach the completion callback to the backend's future (once; idempotent). Ops a thread waits on right
        away skip it -- the hand-off from the backend's thread to the waiter costs tens of microseconds -- so it is
        attached only when completion must be observed without a waiter: a wait that outlasts its first slice,
        ``add_done_callback``, or the communicator's watcher for ops nobody waited on (see ``Communicator``)."""
        backend_work = self._fut
        if backend_work is not None:
            self._fut = None
            try:
                fut = backend_work.get_future()
            except RuntimeError:  # a Gloo Work without a future (reduce_scatter): the waiter thread watches it
                self._table.wait_in_thread(backend_work, self, None)
            else:
                fut.add_done_callback(future_callback(self))

    def _wait_backend(self, backend_work: Any) -> None:
        """A waiting thread's first look at an async op: wait on the backend Work itself for ``SYNC_WAIT_SLICE``
        (the lowest-latency wait: no hand-off from the backend's thread) and complete the op here when it finished.
        Only for interruptible backends (a timed wait that elapses leaves the op running); the backend's own
        callback races with us, and the first to complete wins (``_racy``). A longer op is left to the lock."""
        try:
            backend_work.wait(SYNC_WAIT_SLICE)
        except RuntimeError as exc:
            if backend_work.is_completed():  # a real failure (or completion racing the slice): ask again
                try:
                    backend_work.wait()
                except Exception as real:
                    self._part_done(real)
                    return
            elif str(exc) == _SLICE_TIMEOUT_TEXT:
                return
            else:
                self._part_done(exc)
                return
        self._part_done(None)

    def _wait_sync(self, backend_work: Any) -> bool:
        """Synchronous op on an interruptible backend, waited for in the issuing thread (which then completes it and
        runs the post hooks). First one timed wait on the backend Work of ``SYNC_WAIT_SLICE``: as fast as a raw
        ``work.wait()``, and ops shorter than it pay nothing else. An elapsed slice costs a C++ exception (tens to
        hundreds of microseconds of CPU), so a longer op is not sliced again: a future callback releases a lock of
        ours (nothing else runs on the backend thread; abort() releases it too, having finished this Work) and this
        thread waits on it in slices, checking the op's deadline in between."""
        try:
            backend_work.wait(SYNC_WAIT_SLICE)
        except RuntimeError as exc:
            if backend_work.is_completed():  # a real failure (or completion racing the slice): ask again
                try:
                    backend_work.wait()
                except Exception as real:
                    self._part_done(real)
                    backend_work = None  # the raise keeps this frame: no backend object in it
                    return self._outcome()
            elif str(exc) != _SLICE_TIMEOUT_TEXT:
                self._part_done(exc)
                backend_work = None
                return self._outcome()
            elif not self._wait_long(backend_work.get_future()):
                backend_work = None
                return self._outcome()
        if self._finalize is None:  # a sliced op has one backend Work: complete directly
            self._complete_sync()
        else:
            self._part_done(None)
        return self._outcome()

    def _wait_long(self, fut: Any) -> bool:
        """Rest of a sync op that outlasted the first slice. True once the backend succeeded; False when the Work
        is already terminal (aborted, timed out, or failed: see ``_outcome``)."""
        ready = _thread.allocate_lock()
        ready.acquire()
        self._done = ready  # abort()'s _finish releases it too (publish, then check the status below)
        fut.add_done_callback(_releaser(ready))  # holds only the lock: no Work/comm on the backend thread
        while True:
            if self.status is not _IP:  # abort() finished this Work
                return False
            remaining = self._deadline - time.perf_counter()
            if remaining <= 0.0:
                self._time_out()
                return False
            if ready.acquire(timeout=min(remaining, _SLICE_S)):
                break
        if self.status is not _IP:
            return False
        try:
            fut.value()
        except Exception as exc:
            self._part_done(exc)
            return False
        return True

    def _complete_sync(self) -> None:
        """``_finish(COMPLETED, None)`` for a sliced sync op (never in ``_in_flight``, no ``_done`` lock): the hot
        path, so the failure-only branches of ``_finish`` are left out."""
        table = self._table
        with table.lock:
            if self.status is not _IP:  # abort() finished it first
                return
            self.status = _COMPLETED
            self._t_end = t_end = time.perf_counter()
        info = self.info
        if info is not None and table.post_hooks.snapshot:
            args = _new_tuple(PostHookArgs, (info, self, _COMPLETED, t_end - self._t0, None))
            self._hook_error = table.post_hooks.run(args, stop_on_error=False)


def _run_callback(fn: Callable[[Work], object], work: Work) -> None:
    try:
        fn(work)
    except Exception:
        _LOG.exception("done callback %r of %r raised", fn, work)


def _releaser(lock: _thread.LockType) -> Callable[[Any], None]:
    """Future callback that releases ``lock`` once (tolerating abort() having released it first)."""

    def release(_fut: Any) -> None:
        try:
            lock.release()
        except RuntimeError:
            pass

    return release


def future_callback(work: Work) -> Callable[[Any], None]:
    """A backend-future callback holding only a weak reference to ``work``.

    A strong one would make the backend's future own work -> communicator -> backend: when a Gloo worker thread then
    drops the last reference, the backend's destructor runs on its own worker thread and the process aborts
    ("terminate called without an active exception", seen at exit). The Work stays alive while in flight anyway
    (held by the communicator, or by the thread waiting on a sync op).
    """
    ref = weakref.ref(work)

    def on_done(fut: Any) -> None:
        wk = ref()
        if wk is not None:
            wk._on_future(fut)

    return on_done


def _seconds(t: float | timedelta) -> float:
    return t.total_seconds() if isinstance(t, timedelta) else float(t)


UNWAITED_GRACE = timedelta(milliseconds=20)
"""How long an async op may go unwaited before its completion is watched by the backend's callback instead."""
_GRACE_S = UNWAITED_GRACE.total_seconds()
_NAP_S = _GRACE_S / 4
"""The watcher's polling period while async ops are in flight: an unwaited op gets its callback between
``UNWAITED_GRACE`` and ``UNWAITED_GRACE + _NAP_S`` after its issue."""


def _fresh(exc: BaseException) -> BaseException:
    """A copy of ``exc`` that was never raised (no traceback): the same type, args, attributes, cause and context,
    made without calling ``__init__`` (so a message is not formatted twice)::

        e2 = _fresh(e); type(e2) is type(e) and e2.args == e.args and e2.__dict__ == e.__dict__ and e2 is not e
    """
    new = BaseException.__new__(type(exc), *exc.args)  # sets args, skips __init__
    new.__dict__.update(exc.__dict__)
    new.__cause__, new.__context__ = exc.__cause__, exc.__context__
    new.__suppress_context__ = exc.__suppress_context__
    return new


class UnwaitedWatcher:
    """One daemon thread per communicator for the async ops whose completion nobody waits on.

    An async op on an interruptible backend gets no completion callback when issued (a thread that waits at once
    waits on the backend Work directly: no hand-off between threads). While async ops are in flight the watcher
    looks at the communicator's in-flight table every ``_NAP_S``; an op still in flight :data:`UNWAITED_GRACE`
    after its issue gets its callback (``Work._watch``), so its post hooks, Flight Recorder entry and in-flight
    bookkeeping complete even when its Work is never waited on. Nothing per op: the issuing thread only reads
    :attr:`idle` after entering an op in the table, and wakes the thread when it sleeps. The thread goes back to
    sleep at the first look that finds the table empty (a stream of short waited ops costs one wake-up per nap)::

        while True:
            wait until woken
            while True:
                sleep(NAP)
                with lock:   # the table's: an op entered after the empty look sees idle and wakes us
                    if not in_flight: idle = True; break
                for op in in_flight: if unwatched and now - op.issued >= GRACE: op._watch()

    (A queue of the ops, one entry per op, cost the issuing thread 3.5 us per 4-byte all_reduce on one pinned
    core -- the put, and the thread's per-entry work under the GIL.)
    """

    def __init__(self, name: str, in_flight: dict[int, Work], lock: threading.Lock) -> None:
        self._in_flight = in_flight
        self._lock = lock
        self._bell = _thread.allocate_lock()  # held while the thread sleeps; wake() releases it (an Event's set()
        self._bell.acquire()                  # runs Python-level Condition code: 10x the cost of a release)
        self._closed = False
        self.idle = True
        """True while the thread sleeps: the issuing thread then calls :meth:`wake` (read without a lock)."""
        self._thread = threading.Thread(target=self._run, name=f"torchnext-comms-watcher[{name}]", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Start looking (the issuing thread, after entering an op in the table, when :attr:`idle`)."""
        self.idle = False
        self._ring()

    def close(self) -> None:
        self._closed = True
        self._ring()

    def _ring(self) -> None:
        try:
            self._bell.release()
        except RuntimeError:  # already rung (a wake and a close): the thread will look anyway
            pass

    def _run(self) -> None:
        in_flight, lock = self._in_flight, self._lock
        while True:
            self._bell.acquire()
            if self._closed:
                return
            while not self._closed:
                time.sleep(_NAP_S)
                now = time.perf_counter()
                with lock:
                    due = [w for w in in_flight.values() if w._fut is not None and now - w._t0 >= _GRACE_S]
                    if not in_flight:
                        self.idle = True  # under the lock: an op entered after this sees it and wakes us
                        break
                _watch_all(due)  # a function: no loop variable keeps the last Work alive while this thread sleeps
                del due
            if self._closed:
                return


def _watch_all(works: list[Work]) -> None:
    """Attach the completion callback of the ``works`` still in flight. (Run inline, the watcher's loop variable
    held the last one -- its outputs, its communicator -- until the next wake-up: a Work kept past its completion,
    seen with the garbage collector off.)"""
    for work in works:
        if work.status is _IP or work.status is _NS:
            work._watch()
