"""One-sided RMA windows: put / get / get_rows / accumulate / signal on memory registered by every rank.

``win = comm.new_window(tensor)`` (collective) registers one contiguous CPU tensor per rank -- sizes, shapes and
dtypes may differ per rank. The window **copies** ``tensor`` into window-owned shared memory and exposes it as
``win.tensor`` (same shape and dtype): that is the memory peers read and write, so read and write ``win.tensor``,
not the tensor you passed. Reference semantics (``mem[r]`` = rank r's ``win.tensor.view(-1)``)::

    win.put(src, dst, offset)            mem[dst][offset : offset + src.numel()] = src.view(-1)
    win.get(src_rank, offset, numel)     return mem[src_rank][offset : offset + numel].clone()
    win.get_rows(src_rank, idx)          return mem[src_rank].view(rows, cols)[idx]          (2-D registrations)
    win.accumulate(src, dst, offset, op) mem[dst][offset : ...] = op(mem[dst][offset : ...], src.view(-1))
    win.signal(peer, value)              counter[peer][from=me] += value
    win.wait_signal(peer, expected)      block until counter[me][from=peer] >= expected

Memory model (both transports):

* An op is **complete** when the call returns (``async_op=False``) or its ``Work`` completes. Completion means
  applied at the target: a completed put/accumulate is in the target's memory, a completed get holds the data.
* Ops from one origin execute in issue order (sync and async alike: a sync op first waits for this rank's pending
  async ops to the same target), so a ``signal`` issued after puts to the same target is observed only after those
  puts are visible (shared memory: the signal is written under the target's lock, whose syscalls are full barriers;
  TCP: one FIFO connection per pair, each request acknowledged after it was applied).
* ``flush(rank)``: waits until this rank's pending ops to ``rank`` are complete. ``fence()``: collective epoch
  boundary -- every rank flushes, then a barrier; every put/accumulate issued by anyone before the fence is visible
  to everyone after it.
* Accumulates on one target are atomic with respect to each other (a per-target lock across threads and
  processes); not with respect to puts or the target's own writes to ``win.tensor``.
* Conflicting unsynchronized puts/gets to the same elements are racy, as in MPI; order them with signals or fences.

Failures: a dead target raises :class:`~torchnext.comms.PeerFailure` (shared memory: its pidfd is checked before
and after each op and while waiting for a signal; TCP: the connection breaks), never a hang; a TCP op without a
reply within the window's timeout raises :class:`~torchnext.comms.CommTimeout`. Out-of-range accesses raise
:class:`WindowBoundsError` (an ``IndexError``) and dtype mismatches :class:`WindowDtypeError` (a ``TypeError``) on
the caller before any byte moves. After :meth:`Window.invalidate` every op raises :class:`WindowInvalidated`.

See ``docs/comms_windows.md`` for the full contract.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from torchnext.comms.errors import CommError, CommTimeout, PeerFailure
from torchnext.comms.hooks import AbortHookArgs, OpInfo
from torchnext.comms.reduce_op import ReduceOp
from torchnext.comms.window._connect import connect
from torchnext.comms.window.channel import Channel, WindowTransport
from torchnext.comms.window.errors import WindowBoundsError, WindowClosed, WindowDtypeError, WindowInvalidated
from torchnext.comms.window.segment import ACCUMULATE, Segment, dtype_code
from torchnext.comms.window.work import WindowWork
from torchnext.comms.work import WorkStatus

if TYPE_CHECKING:
    from torchnext.comms.communicator import Communicator

__all__ = ["Window", "new_window"]


_INVALIDATED_TEXT = "window invalidated by reconfiguration, create a new one"
_STATUS_ERRORS: dict[int, type[Exception]] = {1: WindowBoundsError, 2: WindowDtypeError, 4: WindowClosed}
_TERMINAL = frozenset({WorkStatus.COMPLETED, WorkStatus.ERROR, WorkStatus.TIMED_OUT, WorkStatus.ABORTED})
_BACKOFF_MAX_S = 1e-3
_LIVENESS_EVERY_S = 0.01


def new_window(
    comm: Communicator,
    tensor: torch.Tensor,
    *,
    transport: str | WindowTransport | None = None,
    host: str | None = None,
    timeout: float | timedelta | None = None,
) -> Window:
    """Collective: register ``tensor`` (copied into window-owned shared memory, see :attr:`Window.tensor`).

    ``transport``: None (auto: shared memory between ranks on the same host, TCP otherwise), ``"shm"`` (require
    same host) or ``"tcp"`` (every pair over TCP, also on one host -- for tests). Must be the same on every rank.
    ``host``: interface the TCP service binds to (default: the local address this process uses to reach the
    store's host; 127.0.0.1 for a local store). ``timeout``: per-op limit of TCP ops and the default of
    ``wait_signal`` (default: the communicator's timeout).
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"new_window: tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"new_window: windows register CPU tensors, got one on {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError("new_window: tensor is not contiguous")
    code = dtype_code(tensor.dtype)
    mode = None if transport is None else WindowTransport(transport)
    timeout_s = comm.timeout.total_seconds() if timeout is None else _seconds(timeout)
    if timeout_s <= 0:
        raise ValueError(f"new_window: timeout must be positive, got {timeout!r}")
    if comm.errored() is not None:
        raise CommError(f"communicator is errored: {comm.errored()}", op="new_window", comm_name=comm.name,
                        rank=comm.rank, ranks=comm.ranks)
    windows = _CommWindows.of(comm)
    win = Window(comm, tensor, code, mode, host, timeout_s, windows.next_seq())
    windows.live.add(win)  # invalidated when the communicator is aborted (reconfiguration)
    return win


class _CommWindows:
    """A communicator's windows (``comm.extensions["windows"]``): their sequence (each window gets its own store
    namespace) and the live ones, invalidated by an abort hook when the communicator is aborted."""

    def __init__(self) -> None:
        self.seq = 0
        self.live: weakref.WeakSet[Window] = weakref.WeakSet()

    @classmethod
    def of(cls, comm: Communicator) -> _CommWindows:
        state = comm.extensions.get("windows")
        if state is None:
            state = comm.extensions["windows"] = cls()
            comm.register_abort_hook(state.on_abort)
        assert isinstance(state, cls)
        return state

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq - 1

    def on_abort(self, args: AbortHookArgs) -> None:
        why = f"communicator {args.comm_name!r} aborted{f': {args.reason}' if args.reason else ''}"
        for win in list(self.live):
            win.invalidate(why, wait=False)


class Window:
    """Memory registered by every rank of a communicator, accessed one-sided. Build with ``comm.new_window``.

    Attributes: ``tensor`` (this rank's registered memory), ``rank``, ``size``, ``numels[r]``, ``shapes[r]``,
    ``dtypes[r]`` (every rank's registration), ``transport(r)``. Usable as a context manager (``close`` on exit).
    Thread-safety: ops may be issued from several threads; ``fence`` and ``close`` are collectives and follow the
    communicator's rule (one issuing thread at a time).
    """

    def __init__(self, comm: Communicator, tensor: torch.Tensor, code: int, mode: WindowTransport | None,
                 host: str | None, timeout_s: float, seq: int) -> None:
        self._comm = comm
        self.rank = comm.rank
        self.size = comm.size
        self._timeout_s = timeout_s
        self._ctx: dict[str, Any] = {"comm_name": comm.name, "rank": comm.rank, "ranks": comm.ranks}
        self._closed = False
        self._invalid: WindowInvalidated | None = None
        self._lock = threading.Lock()
        self._op_seq = 0
        self._pending: dict[int, WindowWork] = {}
        self._queue: queue.SimpleQueue[tuple[WindowWork, Callable[[], None]] | None] | None = None
        self._worker: threading.Thread | None = None
        self._channels: dict[int, Channel] = {}
        self._service: Any = None
        # every rank's registration and this rank's transport to each, filled by the handshake (connect)
        self.numels: list[int] = []
        self.shapes: list[tuple[int, ...]] = []
        self.dtypes: list[torch.dtype] = []
        self._kinds: list[WindowTransport] = []
        store = dist.PrefixStore(f"window{seq}", comm.store)
        store_timeout = timedelta(seconds=timeout_s)

        self._segment = Segment.create(tensor.numel(), tensor.dtype, self.size)
        try:
            self._segment.data.copy_(tensor.reshape(-1))
            self.tensor = self._segment.data.view(tensor.shape)
            connect(self, store, store_timeout, tensor, code, mode, host, _STATUS_ERRORS)
        except BaseException:
            self._release()
            raise

    # ------------------------------------------------------------------------------------------------ queries
    @property
    def dtype(self) -> torch.dtype:
        """This rank's registered dtype."""
        return self._segment.dtype

    @property
    def timeout(self) -> float:
        """Per-op limit (seconds) of TCP ops; default of ``wait_signal``."""
        return self._timeout_s

    def transport(self, rank: int) -> WindowTransport:
        """How this rank reaches ``rank``'s memory."""
        self._check_rank(rank, "transport", "rank")
        return self._kinds[rank]

    def signal_count(self, peer: int) -> int:
        """Total value signalled by ``peer`` to this rank so far."""
        self._check_rank(peer, "signal_count", "peer")
        return int(self._segment.signals[peer])

    def __repr__(self) -> str:
        state = "invalidated" if self._invalid else "closed" if self._closed else "open"
        return (f"Window(comm={self._comm.name!r}, rank={self.rank}, size={self.size}, shape={list(self.tensor.shape)},"
                f" dtype={self.dtype}, {state})")

    def __enter__(self) -> Window:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        else:  # an exception: do not start a collective that may hang; release locally
            self._shutdown_local()

    # ------------------------------------------------------------------------------------------------------ ops
    def put(self, src: torch.Tensor, dst_rank: int, offset: int = 0, *, async_op: bool = False) -> WindowWork | None:
        """Write ``src`` (flattened) into ``dst_rank``'s registered tensor at element ``offset``."""
        flat = self._src("put", src, dst_rank)
        self._range("put", dst_rank, offset, flat.numel())
        return self._run("put", dst_rank, lambda ch: ch.put(offset, flat), async_op, (), inputs=(flat,))

    def get(self, src_rank: int, offset: int = 0, numel: int | None = None, *, out: torch.Tensor | None = None,
            async_op: bool = False) -> torch.Tensor | WindowWork:
        """Read ``numel`` elements (default: to the end) of ``src_rank``'s registered tensor from ``offset``.

        Returns a new 1-D tensor, or ``out`` (contiguous, the target's dtype, ``numel`` elements). With
        ``async_op=True`` returns a Work whose ``result()[0]`` is that tensor."""
        self._check_rank(src_rank, "get", "src_rank")
        if numel is None:
            if not _is_int(offset):
                raise TypeError(f"window.get: offset must be an int, got {offset!r}")
            numel = max(self.numels[src_rank] - offset, 0)
        self._range("get", src_rank, offset, numel)
        dst = self._out("get", out, src_rank, (numel,))
        return self._run("get", src_rank, lambda ch: ch.get(offset, dst), async_op, (dst,), result=dst)

    def get_rows(self, src_rank: int, indices: torch.Tensor | Sequence[int], *, out: torch.Tensor | None = None,
                 async_op: bool = False) -> torch.Tensor | WindowWork:
        """Gather rows of ``src_rank``'s 2-D registered tensor: ``mem[src_rank].view(rows, cols)[indices]``.

        ``indices``: 1-D integer tensor or sequence; every index in ``[0, rows)`` (checked, no wrap-around).
        One vectorized copy (shared memory) or one request (TCP)."""
        self._check_rank(src_rank, "get_rows", "src_rank")
        shape = self.shapes[src_rank]
        if len(shape) != 2:
            raise ValueError(f"window.get_rows: rank {src_rank} registered shape {list(shape)}, not a 2-D tensor")
        idx = indices if isinstance(indices, torch.Tensor) else torch.as_tensor(list(indices), dtype=torch.int64)
        if idx.dim() != 1 or idx.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
            raise TypeError(f"window.get_rows: indices must be a 1-D integer tensor, got {idx.dtype} of shape "
                            f"{list(idx.shape)}")
        if idx.device.type != "cpu":
            raise ValueError(f"window.get_rows: indices must be on CPU, got {idx.device}")
        idx = idx.to(torch.int64).contiguous()
        rows = shape[0]
        if idx.numel() and _outside(idx, rows):
            bad = idx[(idx < 0) | (idx >= rows)][0].item()
            raise WindowBoundsError(f"window.get_rows: row index {bad} outside rank {src_rank}'s rows [0, {rows})")
        dst = self._out("get_rows", out, src_rank, (idx.numel(), shape[1]))
        if idx.numel() == 0 or shape[1] == 0:
            return self._run("get_rows", src_rank, lambda ch: None, async_op, (dst,), result=dst)
        return self._run("get_rows", src_rank, lambda ch: ch.get_rows(idx, dst), async_op, (dst,), result=dst)

    def accumulate(self, src: torch.Tensor, dst_rank: int, offset: int = 0, op: ReduceOp | str = ReduceOp.SUM, *,
                   async_op: bool = False) -> WindowWork | None:
        """``mem[dst][offset:offset+n] = op(mem[dst][offset:offset+n], src)``, atomic with respect to other
        accumulates on ``dst_rank``. ``op``: SUM, PRODUCT, MIN or MAX."""
        rop = ReduceOp.coerce(op)
        if rop not in ACCUMULATE:
            raise ValueError(f"window.accumulate: op {rop.name} is not supported; use one of "
                             f"{[o.name for o in ACCUMULATE]}")
        flat = self._src("accumulate", src, dst_rank)
        self._range("accumulate", dst_rank, offset, flat.numel())
        return self._run("accumulate", dst_rank, lambda ch: ch.accumulate(offset, flat, rop), async_op, (),
                         inputs=(flat,))

    def signal(self, peer: int, value: int = 1, *, async_op: bool = False) -> WindowWork | None:
        """Add ``value`` (a positive int) to ``peer``'s counter for this rank; ordered after this rank's earlier
        ops to ``peer`` (they are visible to ``peer`` once it observes the signal)."""
        self._check_rank(peer, "signal", "peer")
        if not _is_int(value) or value < 1 or value >= 1 << 62:
            raise ValueError(f"window.signal: value must be a positive int, got {value!r}")
        return self._run("signal", peer, lambda ch: ch.signal(value), async_op, ())

    def wait_signal(self, peer: int, expected: int, timeout: float | timedelta | None = None) -> int:
        """Block until the total signalled by ``peer`` to this rank is ``>= expected``; return that total.

        Polls this rank's counter with bounded backoff (spin, then sleeps doubling up to 1 ms). Raises
        ``CommTimeout`` after ``timeout`` (default: the window's), ``PeerFailure`` when ``peer`` dies first."""
        self._alive_or_raise("wait_signal")
        self._check_rank(peer, "wait_signal", "peer")
        if not _is_int(expected):
            raise TypeError(f"window.wait_signal: expected must be an int, got {expected!r}")
        limit = self._timeout_s if timeout is None else _seconds(timeout)
        info = self._hook_start("wait_signal", peer, (), (), False)
        if info is None:
            return self._wait_signal(peer, expected, limit)
        return int(self._tracked(info, (), lambda: self._wait_signal(peer, expected, limit)))

    def _wait_signal(self, peer: int, expected: int, limit: float) -> int:
        counter = self._segment.signals
        t0 = time.perf_counter()
        next_check = t0 + _LIVENESS_EVERY_S
        sleep = 0.0
        spins = 0
        while True:
            got = int(counter[peer])
            if got >= expected:
                with self._segment.lock():  # acquire side: a full barrier before the caller reads the data
                    pass
                return got
            now = time.perf_counter()
            if now >= next_check:
                self._alive_or_raise("wait_signal")
                if not self._channels[peer].alive():
                    raise PeerFailure(f"died while this rank waited for its signal (have {got}, want {expected})",
                                      peer=peer, op="window.wait_signal", **self._ctx)
                next_check = now + _LIVENESS_EVERY_S
            if now - t0 >= limit:
                raise CommTimeout(f"signal count from rank {peer} is {got} < {expected} after {limit:.3f}s",
                                  op="window.wait_signal", **self._ctx)
            spins += 1
            if spins > 64:
                sleep = min(max(sleep * 2, 1e-6), _BACKOFF_MAX_S)
                time.sleep(sleep)

    def flush(self, rank: int | None = None) -> None:
        """Wait until this rank's pending (async) ops to ``rank`` (None: to every rank) are complete, i.e. applied
        at their target. Failures of those ops are raised by their own Work, not here."""
        self._alive_or_raise("flush")
        targets = range(self.size) if rank is None else [self._check_rank(rank, "flush", "rank")]
        for r in targets:
            self._drain(r)

    def fence(self) -> None:
        """Collective epoch boundary: every rank flushes all its ops, then a barrier on the communicator. Every
        put/accumulate issued by any rank before the fence is visible to every rank after it."""
        self.flush()
        self._comm.barrier()

    # ------------------------------------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Collective. Completes (or fails) every op this rank issued, barrier, then releases the service,
        connections and mappings. Ops issued later raise :class:`WindowClosed`. ``win.tensor`` stays a valid local
        tensor. Idempotent; after ``invalidate`` it only releases locally (no collective)."""
        with self._lock:
            local_only = self._closed or self._invalid is not None
            self._closed = True  # refuse new ops from now on
        if local_only:
            self._shutdown_local()
            return
        try:
            for r in range(self.size):
                self._drain(r)
            self._comm.barrier()
        finally:
            self._shutdown_local()

    def invalidate(self, reason: str | None = None, *, wait: bool = True) -> None:
        """Local, any thread, idempotent: from now on every op raises :class:`WindowInvalidated` ("window
        invalidated by reconfiguration, create a new one"); queued async ops fail with it; the service,
        connections and mappings are released. ``Communicator.abort()`` (which every reconfiguration of the
        fault-tolerant layer runs on the old generation) calls it with ``wait=False``: the window is invalid when
        the call returns, and the release finishes in a background thread."""
        with self._lock:
            if self._invalid is not None:
                return
            self._invalid = WindowInvalidated(_INVALIDATED_TEXT + (f" ({reason})" if reason else ""),
                                              op="window", **self._ctx)
        if wait:
            self._shutdown_local()
        else:
            threading.Thread(target=self._shutdown_local, name="torchnext-window-release", daemon=True).start()

    def _shutdown_local(self) -> None:
        with self._lock:
            q, self._queue = self._queue, None
            worker, self._worker = self._worker, None
        if q is not None:
            q.put(None)
        # Release transports first: an op the worker is blocked in (a TCP request to a frozen peer) fails at once
        # instead of delaying invalidate() by up to its timeout.
        self._release()
        if worker is not None and worker is not threading.current_thread():
            worker.join(timeout=5)
        if q is not None:  # ops still queued (invalidate): fail them
            while True:
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0]._finish(WorkStatus.ERROR, self._refusal(item[0].op.removeprefix("window.")))

    def _release(self) -> None:
        """Stop the service, close channels and this rank's segment file (idempotent)."""
        if self._service is not None:
            self._service.close()
            self._service = None
        channels, self._channels = self._channels, {}
        for ch in channels.values():
            ch.close()
        self._segment.close()

    # ------------------------------------------------------------------------------------------------ internals
    def _refusal(self, op: str) -> CommError:
        if self._invalid is not None:
            exc = WindowInvalidated(self._invalid.detail, op=f"window.{op}", **self._ctx)
            exc.__cause__ = self._invalid
            return exc
        return WindowClosed("window is closed", op=f"window.{op}", **self._ctx)

    def _alive_or_raise(self, op: str) -> None:
        if self._invalid is not None or self._closed:
            raise self._refusal(op)

    def _check_rank(self, r: object, op: str, what: str) -> int:
        if not _is_int(r):
            raise TypeError(f"window.{op}: {what} must be an int, got {r!r}")
        if not 0 <= r < self.size:  # type: ignore[operator]
            raise ValueError(f"window.{op}: {what}={r} is out of range for a window of {self.size} ranks")
        return r  # type: ignore[return-value]

    def _src(self, op: str, src: torch.Tensor, dst: int) -> torch.Tensor:
        self._check_rank(dst, op, "dst_rank")
        if not isinstance(src, torch.Tensor):
            raise TypeError(f"window.{op}: src must be a torch.Tensor, got {type(src).__name__}")
        if src.device.type != "cpu":
            raise ValueError(f"window.{op}: src must be on CPU, got {src.device}")
        if src.dtype != self.dtypes[dst]:
            raise WindowDtypeError(f"window.{op}: src dtype {src.dtype} does not match rank {dst}'s registered "
                                   f"dtype {self.dtypes[dst]}")
        return src.reshape(-1).contiguous()

    def _range(self, op: str, target: int, offset: object, numel: object) -> None:
        if not _is_int(offset) or not _is_int(numel):
            raise TypeError(f"window.{op}: offset and numel must be ints, got {offset!r}, {numel!r}")
        n = self.numels[target]
        if offset < 0 or numel < 0 or offset + numel > n:  # type: ignore[operator]
            raise WindowBoundsError(f"window.{op}: elements [{offset}, {offset + numel}) are outside rank "  # type: ignore[operator]
                                    f"{target}'s registered tensor of {n} elements")

    def _out(self, op: str, out: torch.Tensor | None, target: int, shape: tuple[int, ...]) -> torch.Tensor:
        dtype = self.dtypes[target]
        if out is None:
            return torch.empty(shape, dtype=dtype)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"window.{op}: out must be a torch.Tensor, got {type(out).__name__}")
        if out.dtype != dtype:
            raise WindowDtypeError(f"window.{op}: out dtype {out.dtype} does not match rank {target}'s registered "
                                   f"dtype {dtype}")
        if out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError(f"window.{op}: out must be a contiguous CPU tensor")
        want = 1
        for s in shape:
            want *= s
        if out.numel() != want or (len(shape) == 2 and tuple(out.shape) != shape):
            raise ValueError(f"window.{op}: out has shape {list(out.shape)}, expected {list(shape)}")
        return out

    def _drain(self, target: int) -> None:
        work = self._pending.get(target)
        if work is not None and work.status not in _TERMINAL:
            try:
                work.wait()
            except Exception:
                pass  # reported by the work itself

    def _hook_start(self, op: str, peer: int, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
                    async_op: bool) -> OpInfo | None:
        """With hooks on the communicator: the op's :class:`OpInfo` (``op`` ``"window.<name>"``, ``op_id`` this
        window's sequence, ``peer`` the target rank), after the pre hooks ran (a raising one: ``HookError``, the op
        is not issued). Without hooks: None (nothing else to pay)."""
        comm = self._comm
        if not comm.has_op_hooks():
            return None
        with self._lock:
            self._op_seq += 1
            seq = self._op_seq
        info = OpInfo(f"window.{op}", seq, comm.name, tuple(comm.ranks), comm.rank, comm.size, async_op, None, peer,
                      None, tuple(inputs), tuple(outputs), timedelta(seconds=self._timeout_s))
        comm.run_pre_hooks(info)
        return info

    def _tracked(self, info: OpInfo, outputs: Sequence[torch.Tensor], body: Callable[[], Any]) -> Any:
        """Run a synchronous op under a Work that only feeds the post hooks (its terminal state and duration)."""
        work = WindowWork(self._comm, info.op, info.op_id, info, outputs, self._timeout_s, info.peer, False)
        work.status = WorkStatus.IN_PROGRESS
        try:
            out = body()
        except BaseException as exc:
            work._finish(WorkStatus.TIMED_OUT if isinstance(exc, CommTimeout) else WorkStatus.ERROR, exc)
            raise
        work._finish(WorkStatus.COMPLETED, None)
        if work._hook_error is not None:
            raise work._hook_error
        return out

    def _run(self, op: str, target: int, fn: Callable[[Channel], None], async_op: bool,
             outputs: Sequence[torch.Tensor], result: torch.Tensor | None = None,
             inputs: Sequence[torch.Tensor] = ()) -> Any:
        self._alive_or_raise(op)
        channel = self._channels.get(target)
        if channel is None:
            raise self._refusal(op)
        info = self._hook_start(op, target, inputs, outputs, async_op)
        if not async_op:
            def body() -> torch.Tensor | None:
                self._drain(target)  # program order with this rank's pending async ops to the same target
                fn(channel)
                return result

            return body() if info is None else self._tracked(info, outputs, body)
        with self._lock:
            if self._invalid is not None or self._closed:
                raise self._refusal(op)
            if info is None:
                self._op_seq += 1
            seq = self._op_seq if info is None else info.op_id
            work = WindowWork(self._comm, f"window.{op}", seq, info, outputs, self._timeout_s, target, True)
            work.status = WorkStatus.IN_PROGRESS
            self._pending[target] = work
            if self._queue is None:
                self._queue = queue.SimpleQueue()
                self._worker = threading.Thread(target=self._work_loop, args=(self._queue,), daemon=True,
                                                name=f"torchnext-window[{self._comm.name}]")
                self._worker.start()
            self._queue.put((work, lambda: fn(channel)))
        return work

    def _work_loop(self, q: queue.SimpleQueue[tuple[WindowWork, Callable[[], None]] | None]) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            work, fn = item
            if self._invalid is not None:
                work._finish(WorkStatus.ERROR, self._refusal(work.op.removeprefix("window.")))
                continue
            try:
                fn()
            except BaseException as exc:
                if self._invalid is not None:  # transports were released under it: report why
                    refusal = self._refusal(work.op.removeprefix("window."))
                    refusal.__cause__ = exc
                    work._finish(WorkStatus.ERROR, refusal)
                elif isinstance(exc, CommTimeout):
                    work._finish(WorkStatus.TIMED_OUT, exc)
                else:
                    work._finish(WorkStatus.ERROR, exc)
            else:
                work._finish(WorkStatus.COMPLETED, None)


def _outside(idx: torch.Tensor, rows: int) -> bool:
    """Whether any index is outside ``[0, rows)`` (one pass)."""
    lo, hi = torch.aminmax(idx)
    return int(lo) < 0 or int(hi) >= rows


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _seconds(t: float | timedelta) -> float:
    return t.total_seconds() if isinstance(t, timedelta) else float(t)
