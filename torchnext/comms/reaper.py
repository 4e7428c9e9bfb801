"""The reaper: releases abandoned backends -- their threads, sockets and store clients -- once nothing runs on them.

An aborted (or errored) communicator cannot destroy its backend on the spot: Gloo cannot cancel an op, and a
``ProcessGroupGloo`` destructor joins worker threads that may still be blocked in one (up to the op's timeout, with
the GIL held). Kept alive forever, every abort leaked 3 threads and 4 fds (a long-lived fault-tolerant rank died of
``EMFILE`` after a few hundred generations). So an abandoned backend becomes a :class:`Grave`::

    grave = Grave(handle, works)     # the backend Works that may still run on it, and objects to keep alive
    handle.cancel_fn()               # Gloo: shut its pair sockets down -> every op on it fails within ms
    REAPER.bury(grave)
    # reaper thread, every REAP_PERIOD while graves exist:
    #   if not grave.issuing and all(w.is_completed() for w in grave.works) for at least SETTLE:
    #       grave.works = grave.keep = []; handle.pg = None    # the destructor joins idle threads: fast

``keep`` holds what the backend may still write into (the output storages of aborted ops, quarantined by fault
tolerance): released with the backend, when no late write can land any more. ``issuing`` is set while an op was
being issued on the aborted communicator: its backend Works are added when the issuing thread leaves.

At interpreter exit (:func:`drain`, an ``atexit`` handler) the graves are reaped in the exiting thread, waiting at
most :data:`EXIT_DRAIN` for their ops to end: a backend thread that finishes an op while the interpreter finalizes
would call into Python (the op's completion callback) and abort the process (SIGABRT, "terminate called after
throwing an instance of 'gloo::IoException'"). A cut does not end every Gloo op (an all_reduce whose data was still
queued waits out its own timeout: docs/comms.md), so a grave whose ops all end by their deadline within
:data:`EXIT_WAIT_MAX` is waited for until then (plus :data:`EXIT_MARGIN`): the exit is late, never a crash
(reproduced: an op of a 6 s timeout abandoned at exit aborted the process 1 s after a 5 s drain gave up). Graves
whose ops outlive that are left alone and reported on stderr: their deadlines lie past any finalization.
"""

from __future__ import annotations

import _thread
import atexit
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torchnext.comms.backends import BackendHandle

__all__ = ["EXIT_DRAIN", "EXIT_MARGIN", "EXIT_WAIT_MAX", "REAP_PERIOD", "RELEASE_PARALLEL", "SETTLE", "SLOW_RELEASE",
           "Grave", "Reaper", "drain", "reaper"]

REAP_PERIOD = 0.02
"""Seconds between two looks at the graves."""
SETTLE = 0.05
"""A grave is reaped once its Works have all been complete for this long: a backend thread that just completed the
last one may still be running its completion callbacks (Python code: the GIL), and the destructor joins it while
holding the GIL."""
RELEASE_PARALLEL = 16
"""At most this many graves are released side by side (see :meth:`Reaper._release`)."""
SLOW_RELEASE = 0.5
"""A release (the backend's destructor) that takes this long is recorded in :attr:`Reaper.slow_releases`."""
EXIT_DRAIN = 5.0
"""At interpreter exit, wait this many seconds for the graves' ops to end (cancelled Gloo ops end in milliseconds;
an uncancellable op runs to its own timeout) -- longer where :data:`EXIT_WAIT_MAX` says so."""
EXIT_WAIT_MAX = 120.0
"""At interpreter exit, wait on for graves whose ops all end by their own deadlines within this many seconds: better
a late exit than an op ending while the interpreter finalizes (see the module docstring)."""
EXIT_MARGIN = 1.0
"""Seconds past a grave's deadline that the exit still waits (a backend starts an op's clock when it runs it, a
little after it was issued)."""


@dataclass(eq=False)
class Grave:
    """An abandoned backend and what must stay alive with it (see the module docstring)."""

    handle: BackendHandle
    name: str
    works: list[Any] = field(default_factory=list)
    """Backend Works that may still run on it."""
    keep: list[Any] = field(default_factory=list)
    """Objects the backend may still write into (released with it)."""
    issuing: bool = False
    """An op is being issued on its communicator: more Works may come (the issuing thread clears it)."""
    cancelled: int | None = None
    """Connections its canceller cut (Gloo: pair sockets shut down); None: it had no canceller, or it raised -- its
    ops then end only at their own timeout."""
    until: float = 0.0
    """``time.perf_counter()`` by which each of its ops has ended at its own timeout, at the latest (0: unknown)."""
    born: float = field(default_factory=time.monotonic)
    done_since: float | None = None
    released: bool = False

    def busy(self) -> bool:
        return self.issuing or not all(_completed(w) for w in self.works)

    def describe(self) -> dict[str, Any]:
        """What keeps it (diagnostics): ``{"name", "age_s", "issuing", "cancelled", "running"}``, ``running``
        the types of its Works not completed."""
        works = list(self.works)
        return {"name": self.name, "age_s": round(time.monotonic() - self.born, 3), "issuing": self.issuing,
                "cancelled": self.cancelled, "running": [type(w).__name__ for w in works if not _completed(w)]}

    def release(self) -> None:
        """Drop every reference this grave holds: the backend's destructor runs here, on the calling thread."""
        self.released = True
        self.works = []
        self.keep = []
        pg, self.handle.pg = self.handle.pg, None
        del pg


def _completed(work: Any) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:  # a Work that raises on is_completed is finished with an error
        return True


class Reaper:
    """One daemon thread per process that releases :class:`Grave` s once they are idle."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards _graves (bury() takes it from any thread)
        self._reaping = threading.Lock()  # one reap at a time (the thread's and drain()'s)
        self._graves: list[Grave] = []
        self._bell = _thread.allocate_lock()
        self._bell.acquire()
        self._thread: threading.Thread | None = None
        self.reaped = 0
        """Graves released so far (a count, for tests and diagnostics)."""
        self.slow_releases: deque[dict[str, Any]] = deque(maxlen=20)
        """The last releases that took :data:`SLOW_RELEASE` or more (:meth:`Grave.describe` + ``release_s``): one
        blocks every later release behind it (diagnostics)."""
        self.uncancelled = 0
        """Graves buried without their ops cut short (no canceller, or it raised): those ops end only at their own
        timeout, holding the backend's threads and fds that long (a count, for tests and diagnostics)."""

    @property
    def pending(self) -> int:
        """Graves not yet released."""
        return len(self._graves)

    def graves(self) -> list[Grave]:
        """A snapshot of the graves not yet released (diagnostics)."""
        with self._lock:
            return list(self._graves)

    def bury(self, grave: Grave) -> None:
        """Release ``grave`` once it is idle (its ops done, nothing being issued)."""
        with self._lock:
            self._graves.append(grave)
            if grave.cancelled is None:
                self.uncancelled += 1
            if self._thread is None:
                atexit.register(drain)
                self._thread = threading.Thread(target=self._run, name="torchnext-comms-reaper", daemon=True)
                self._thread.start()
        try:
            self._bell.release()
        except RuntimeError:  # already rung
            pass

    def reap(self) -> int:
        """Release the graves that have been idle for ``SETTLE``; returns how many remain (after those released
        here or by a concurrent call are gone: one reap at a time)."""
        with self._reaping:
            now = time.monotonic()
            ready: list[Grave] = []
            with self._lock:
                keep: list[Grave] = []
                for g in self._graves:
                    if g.busy():
                        g.done_since = None
                        keep.append(g)
                    elif g.done_since is not None and now - g.done_since >= SETTLE:
                        ready.append(g)
                    else:
                        if g.done_since is None:
                            g.done_since = now
                        keep.append(g)
                self._graves = keep
            for i in range(0, len(ready), RELEASE_PARALLEL):
                self._release(ready[i:i + RELEASE_PARALLEL])
            self.reaped += len(ready)
            with self._lock:
                return len(self._graves)

    def _release(self, graves: list[Grave]) -> None:
        """Release ``graves`` side by side (one short-lived thread each beyond the first) and note the slow ones.

        A Gloo backend's destructor mostly waits -- it joins its worker threads and its device's event loop, which
        looks at its stop flag about every 10 ms -- and torch runs it without the GIL: one release took a median
        7.8 ms (torch 2.13, 2026-12-03), so one at a time the reaper kept up with at most ~130 abandoned backends a
        second. A loop that aborted and rebuilt a 2-rank group every 8 ms (two graves per generation) outran it,
        and the backlog's fds reached a 256-file limit (the CI failure of ``test_generations_under_ulimit_256``)."""
        def one(g: Grave) -> None:
            t0 = time.monotonic()
            about = g.describe()
            g.release()
            took = time.monotonic() - t0
            if took >= SLOW_RELEASE:
                self.slow_releases.append(dict(about, release_s=round(took, 3)))

        helpers = [threading.Thread(target=one, args=(g,), name="torchnext-comms-release", daemon=True)
                   for g in graves[1:]]
        for t in helpers:
            t.start()
        one(graves[0])
        for t in helpers:
            t.join()

    def _run(self) -> None:
        while True:
            self._bell.acquire()
            while self.reap():
                time.sleep(REAP_PERIOD)

    def drain(self, timeout: float = EXIT_DRAIN) -> list[Grave]:
        """Reap every grave, waiting up to ``timeout`` for their ops to end; returns those still busy."""
        deadline = time.monotonic() + timeout
        while self.reap() and time.monotonic() < deadline:
            time.sleep(REAP_PERIOD)
        with self._lock:
            return list(self._graves)


_REAPER = Reaper()


def reaper() -> Reaper:
    """The process's reaper."""
    return _REAPER


def bury(handle: BackendHandle, name: str, works: Sequence[Any] = (), keep: Sequence[Any] = (), *,
         issuing: bool = False, until: float = 0.0) -> Grave:
    """Cancel what runs on ``handle`` (its ``cancel_fn``, if any) and hand it to the reaper; returns the grave (the
    caller may still add Works or kept objects to it, under its own lock, and clear ``issuing``). ``until``: see
    :attr:`Grave.until`."""
    grave = Grave(handle, name, list(works), list(keep), issuing, until=until)
    cancel = handle.cancel_fn
    if cancel is not None:
        try:
            grave.cancelled = int(cancel())
        except Exception:  # best effort: the ops then end at their own timeout
            pass
    _REAPER.bury(grave)
    return grave


_GIVEN_UP: set[int] = set()
"""``id`` of the graves an exit drain already waited for in vain (a later exit drain does not wait for them again)."""


def drain() -> None:
    """``atexit``: reap every abandoned backend before the interpreter finalizes (see the module docstring).

    Registered twice (by the reaper and by the Communicator's exit handler, which first aborts communicators with
    ops in flight and then drains): a grave already waited for in vain is not waited for, nor reported, again."""
    waited = [g for g in _REAPER.graves() if id(g) not in _GIVEN_UP]
    left = _REAPER.drain(EXIT_DRAIN if waited else 0.0)
    if left and all(0.0 < g.until <= time.perf_counter() + EXIT_WAIT_MAX for g in left):
        # every op left ends by its own deadline soon: wait for that rather than finalize while one may end
        left = _REAPER.drain(max(g.until for g in left) + EXIT_MARGIN - time.perf_counter())
    new = [g for g in left if id(g) not in _GIVEN_UP]
    _GIVEN_UP.update(id(g) for g in left)
    if new:
        names = ", ".join(sorted({g.name for g in new}))
        print(f"torchnext: {len(new)} abandoned backend(s) still running ops at exit ({names}); their threads may "
              "end the process abnormally", file=sys.stderr)
