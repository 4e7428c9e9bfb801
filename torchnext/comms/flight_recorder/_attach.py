"""How a :class:`~torchnext.comms.FlightRecorder` attaches to Communicators: hooks, split children, automatic dumps.

Per attached communicator::

    pre hook  (issuing thread)      -> recorder.record(pg, info.op, inputs, outputs, op_id, peer, tag, timeout,
                                                       root, reduce_op)
                                       (batch_p2p: one send/recv record per op of the batch, same op_id)
    post hook (terminal transition) -> recorder.complete(rid, state); TIMED_OUT / ERROR -> automatic dump
    abort hook (abort() caller)     -> an "abort" event (time, reason, op_ids in flight), then an automatic dump
                                       (before in-flight ops are cancelled: they show as "started")
    split child created             -> attached to the same recorder, with its own pg id

Automatic dumps go to the recorder's ``dump_dir`` (``TORCHNEXT_FR_DUMP_DIR``); without one they are skipped.
Dumps on an unhandled exception (``sys.excepthook``) and on a signal (SIGUSR1) are opt-in.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from time import time_ns
from types import TracebackType
from typing import TYPE_CHECKING, Any

from torchnext.comms.hooks import native_equivalent
from torchnext.comms.work import WorkStatus

if TYPE_CHECKING:
    from torchnext.comms.flight_recorder.recorder import FlightRecorder

__all__ = ["Attachment", "install_excepthook", "install_signal_handler"]

_STATES = {"COMPLETED": "completed", "TIMED_OUT": "timed_out", "ERROR": "error", "ABORTED": "aborted"}
_MIN_REPEAT_S = 1.0  # the same kind of automatic dump is not repeated within this interval


class Attachment:
    """The hooks one recorder registered on one communicator."""

    def __init__(self, recorder: FlightRecorder, comm: Any, generation: int | None, split_hook: Any) -> None:
        self.recorder = recorder
        self.comm = comm
        if generation is not None:
            recorder.generation = generation
        ranks = list(comm.ranks)
        self.pg_id = recorder.add_group(
            comm.name,
            ranks=ranks,
            rank=comm.rank,
            desc=comm.name,
            backend=str(comm.backend),
            timeout_ms=int(comm.timeout.total_seconds() * 1000),
        )
        # keyed by the OpInfo object (the same one reaches the post hook): window ops number themselves per window
        self._rids: dict[int, int | list[int]] = {}
        self._completed = WorkStatus.COMPLETED
        self._default_td = comm.timeout
        self._default_ms = int(self._default_td.total_seconds() * 1000)
        self._handles = [
            split_hook,
            comm.register_pre_hook(self.pre),
            comm.register_post_hook(self.post),
            comm.register_abort_hook(self.on_abort),
        ]

    @native_equivalent
    def pre(self, info: Any) -> None:
        try:
            # one unpack of the OpInfo tuple instead of a dozen attribute loads (the hot path)
            op, op_id, _, _, _, _, async_op, root, peer, reduce_op, inputs, outputs, td, tag, batch, _ = info
            ms = self._default_ms if td is self._default_td or td == self._default_td else int(td.total_seconds() * 1e3)
            if batch:
                # batch_p2p: one send/recv entry per op (peer, tag, tensor), so the analyzer pairs each of them
                now = time_ns()
                self._rids[id(info)] = [
                    self.recorder._record(self.pg_id, p.kind, (p.tensor,) if p.kind == "send" else (),
                                          (p.tensor,) if p.kind == "recv" else (), op_id, p.peer, p.tag, ms,
                                          async_op, True, now, None, None)
                    for p in batch
                ]
                return
            self._rids[id(info)] = self.recorder._record(
                self.pg_id, op, inputs, outputs, op_id, peer, tag or 0, ms, async_op, True, time_ns(), root, reduce_op,
            )
        except Exception as exc:  # the recorder must never stop an op from being issued
            self.recorder._internal_error("pre hook", exc)

    @native_equivalent
    def post(self, args: Any) -> None:
        try:
            rids = self._rids.pop(id(args.info), -1)
            status = args.status
            if status is self._completed:
                if isinstance(rids, int):
                    self.recorder.complete(rids)
                else:
                    for rid in rids:
                        self.recorder.complete(rid)
                return
            state = _STATES.get(status.name, "error")
            exc = args.exception
            error = None if exc is None else f"{type(exc).__name__}: {exc}"
            for rid in [rids] if isinstance(rids, int) else rids:
                self.recorder.complete(rid, state, error=error)
        except Exception as err:
            self.recorder._internal_error("post hook", err)
            return
        if state == "timed_out":
            self.recorder._auto_dump_once("timeout", f"{args.info.op} op_id={args.info.op_id} on {self.comm.name!r}")
        elif state == "error":
            kind = "peer_failure" if type(exc).__name__ == "PeerFailure" else "error"
            self.recorder._auto_dump_once(kind, f"{args.info.op} op_id={args.info.op_id}: {exc!r}")

    def on_abort(self, args: Any) -> None:
        try:
            self.recorder.note_event("abort", self.pg_id, reason=args.reason, in_flight=list(args.in_flight))
        except Exception as exc:
            self.recorder._internal_error("abort hook", exc)
        self.recorder._auto_dump_once("abort", f"abort() of {args.comm_name!r}: {args.reason or 'no reason given'}")

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class AutoDumper:
    """Rate-limits automatic dumps: one per kind per :data:`_MIN_REPEAT_S` (ops failing together dump once)."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def should_dump(self, kind: str) -> bool:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < _MIN_REPEAT_S:
                return False
            self._last[kind] = now
            return True


def install_excepthook(recorder: FlightRecorder) -> Callable[[], None]:
    """Chain ``sys.excepthook`` and ``threading.excepthook`` so an unhandled exception (main thread, or any other
    thread) dumps before it is reported as usual; returns an undo."""
    previous = sys.excepthook
    previous_thread = threading.excepthook

    def hook(tp: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        recorder._auto_dump_once("unhandled_exception", f"{tp.__name__}: {value}")
        previous(tp, value, tb)

    def thread_hook(args: Any) -> None:
        if args.exc_type is not SystemExit:
            name = args.thread.name if args.thread is not None else "?"
            recorder._auto_dump_once("unhandled_exception", f"{args.exc_type.__name__} in thread {name}: {args.exc_value}")
        previous_thread(args)

    sys.excepthook = hook
    threading.excepthook = thread_hook

    def undo() -> None:
        if sys.excepthook is hook:
            sys.excepthook = previous
        if threading.excepthook is thread_hook:
            threading.excepthook = previous_thread

    return undo


def install_signal_handler(recorder: FlightRecorder, signum: int) -> Callable[[], None]:
    """Dump when ``signum`` arrives (then run the previous Python handler, if any); returns an undo.

    Must be called from the main thread (a Python rule for ``signal.signal``).
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("Flight Recorder: a signal handler can only be installed from the main thread")
    previous = signal.getsignal(signum)

    def handler(sig: int, frame: Any) -> None:
        recorder.auto_dump(f"signal {signal.Signals(sig).name}")
        if callable(previous):
            previous(sig, frame)

    signal.signal(signum, handler)

    def undo() -> None:
        if signal.getsignal(signum) is handler:
            signal.signal(signum, previous)

    return undo
