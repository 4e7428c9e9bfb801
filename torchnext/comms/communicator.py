"""The Communicator: one contract (collectives, Work, split, hooks, abort) over any registered backend."""

from __future__ import annotations

import atexit
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from torchnext.comms import _validate as v
from torchnext.comms._ops import CollectiveOps, P2POp
from torchnext.comms.backends import BackendConfig, BackendHandle, get_backend
from torchnext.comms.errors import CommAborted, CommError, CommTimeout, HookError, PeerFailure
from torchnext.comms.extension import factory, option
from torchnext.comms.hooks import AbortHookArgs, HookList, OpInfo, PostHookArgs, RemovableHandle
from torchnext.comms.op_table import OpTable
from torchnext.comms.reaper import Grave, bury, drain
from torchnext.comms.reduce_op import ReduceOp
from torchnext.comms.work import UnwaitedWatcher, Work, WorkStatus, _new_tuple, future_callback

if TYPE_CHECKING:
    from torchnext.comms.flight_recorder import FlightRecorder
    from torchnext.comms.process_group import TorchnextProcessGroup
    from torchnext.comms.window import Window

__all__ = ["Communicator", "P2POp"]

_C10D = torch._C._distributed_c10d
Timeout = float | timedelta | None


_LIVE: weakref.WeakSet[Communicator] = weakref.WeakSet()
"""Every Communicator not yet garbage-collected: looked at once, at interpreter exit (:func:`_at_exit`)."""


def _at_exit() -> None:
    """``atexit``: abort every communicator that still has ops in flight or is errored (nobody waits for them any
    more), so that their backends are cancelled and reaped before the interpreter finalizes -- a Gloo thread that
    ends an op during finalization aborts the process (see :mod:`torchnext.comms.reaper`). Healthy idle ones are
    left to their owners."""
    for comm in list(_LIVE):
        if not comm._closed and (comm._in_flight or comm._ops.sync_work is not None or comm._ops.error is not None):
            try:
                comm.abort("interpreter exit")
            except Exception:
                pass
    drain()


atexit.register(_at_exit)


class Communicator(CollectiveOps):
    """A group of ranks that communicate tensors: torch.distributed's collective contract, complete on every backend.

    ``Communicator(store, rank, world_size, backend="gloo", timeout=timedelta(seconds=300), name="world",
    device=None)`` connects eagerly: it returns once every member joined (or raises after ``timeout``). Keys live
    under ``torchnext/<name>/`` in ``store``, so communicators with different names share one store; a name must not
    be reused on the same store (fault-tolerant code uses a fresh name per generation). ``global_ranks`` gives the
    stable ids of the members in rank order (default ``range(world_size)``); they are what ``ranks`` reports and what
    diagnostics such as the Flight Recorder name ranks by (fault tolerance passes its member ids).

    Ops (meaning as in torch.distributed; ranks, roots and peers are ranks *in this communicator*): all_reduce,
    broadcast, reduce, all_gather, all_gather_single, reduce_scatter, reduce_scatter_single, all_to_all,
    all_to_all_single, gather, scatter, send, recv, batch_p2p, barrier. Each takes ``async_op=False`` (True: return a
    :class:`Work`; False: return None after completion) and ``timeout=None`` (per-op override of the default).
    Arguments are validated before anything is issued (``TypeError``/``ValueError``).

    Failure model:

    * an op that exceeds its timeout raises :class:`CommTimeout`; a broken peer raises :class:`PeerFailure`; other
      backend failures raise :class:`CommError`. After any of these the communicator is **errored**: the backend's
      state is undefined, ``errored()`` returns the first such exception and every later op raises ``CommError``
      (``from`` it). Recover by ``abort()`` and building a new communicator (new name).
    * ``abort()`` (any thread, idempotent): marks the communicator aborted, runs abort hooks, cancels every op in
      flight on this rank (their waiters raise :class:`CommAborted` at once) and abandons the backend (Gloo cannot
      cancel an op: its worker threads finish or time out in the background; the tensors of cancelled ops may still
      be written until then, so do not reuse them). Every later op raises ``CommAborted``. Children made by
      ``split`` are independent: abort them separately.

    Consistency mode (``check_collectives=True``, default ``TORCHNEXT_CHECK_COLLECTIVES``, else on with
    ``TORCH_DISTRIBUTED_DEBUG=DETAIL``): before each op the members compare what they are about to issue (op,
    sequence number, sizes, dtypes, root, reduce op; send/recv pairs) and on a difference every member raises
    :class:`CollectiveMismatch` naming the culprits, before any data moved (see :mod:`torchnext.comms.consistency`).

    Thread-safety: ops are issued by one thread at a time per communicator (a synchronous op holds the communicator
    until it returns); a concurrent issue raises ``RuntimeError`` naming the op. ``Work.wait``, ``abort()``,
    ``errored()`` and the properties may be used from any thread. Hooks: see :mod:`torchnext.comms.hooks`.

    Example::

        comm = Communicator(store, rank, 2)
        t = torch.ones(4)
        comm.all_reduce(t)                      # t == 2 everywhere
        w = comm.all_gather_single(out, t, async_op=True); w.wait()
        sub = comm.split([0])                   # Communicator on rank 0, None on rank 1
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        *,
        backend: str = "gloo",
        timeout: float | timedelta = timedelta(seconds=300),
        name: str = "world",
        device: torch.device | str | None = None,
        global_ranks: Sequence[int] | None = None,
        flight_recorder: bool | FlightRecorder = False,
        check_collectives: bool | None = None,
    ) -> None:
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"name must be a non-empty string without '/', got {name!r}")
        if flight_recorder is not False:
            option("flight_recorder").check(flight_recorder)
        if check_collectives is None:
            from torchnext._config import env_config

            check_collectives = env_config().check_collectives
        if check_collectives is not False:
            option("check_collectives").check(check_collectives)
        if not isinstance(store, dist.Store):
            raise TypeError(f"store must be a torch.distributed.Store, got {type(store).__name__}")
        if global_ranks is None:
            ranks = tuple(range(world_size)) if _is_int(world_size) else ()
        else:
            ranks = tuple(global_ranks)
            if (len(ranks) != world_size or len(set(ranks)) != len(ranks)
                    or not all(_is_int(r) and r >= 0 for r in ranks)):
                raise ValueError(f"global_ranks must be {world_size} distinct non-negative ints, got {global_ranks!r}")
        prefixed = dist.PrefixStore(f"torchnext/{name}", store)
        self._setup(prefixed, rank, world_size, ranks, backend=backend, timeout=timeout, name=name, device=device)
        py_store = _python_store(store)
        if py_store is not None:
            self.retain(py_store)
        if flight_recorder is not False:
            option("flight_recorder").attach(self, flight_recorder)  # True: TORCHNEXT_FR_BUFFER_SIZE entries
        if check_collectives is not False:  # after the recorder: a refused op is recorded, then refused
            option("check_collectives").attach(self, check_collectives)

    @classmethod
    def from_env(
        cls,
        *,
        backend: str = "gloo",
        timeout: float | timedelta = timedelta(seconds=300),
        name: str = "world",
        device: torch.device | str | None = None,
        host_store: bool = False,
        flight_recorder: bool | FlightRecorder = False,
        check_collectives: bool | None = None,
    ) -> Communicator:
        """Build from torchrun / ``env://`` variables: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.

        Connects a ``TCPStore`` client to MASTER_ADDR:MASTER_PORT (torchrun's agent hosts it). ``host_store=True``
        makes rank 0 host it instead, for launchers that host none (then rank 0's death ends the job).
        """
        from torchnext._config import dist_env

        env = dist_env()
        is_master = host_store and env.rank == 0
        store = dist.TCPStore(
            env.master_addr, env.master_port, env.world_size, is_master,
            timeout=_as_timedelta(timeout), wait_for_workers=False,
        )
        return cls(store, env.rank, env.world_size, backend=backend, timeout=timeout, name=name, device=device,
                   flight_recorder=flight_recorder, check_collectives=check_collectives)

    def _setup(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        ranks: tuple[int, ...],
        *,
        backend: str,
        timeout: float | timedelta,
        name: str,
        device: torch.device | str | None,
    ) -> None:
        if not _is_int(size) or size < 1:
            raise ValueError(f"world_size must be a positive int, got {size!r}")
        if not _is_int(rank) or not 0 <= rank < size:
            raise ValueError(f"rank must be an int in [0, {size}), got {rank!r}")
        self._timeout = _as_timedelta(timeout)
        if self._timeout.total_seconds() <= 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        factory = get_backend(backend)
        # The ops' shared state -- lock, in-flight table, error/abort state, orphans, store, hook lists -- lives in
        # the op table (Work reaches it alone); the aliases below are the same objects, for this class's hot paths.
        self._ops = ops = OpTable(name, rank, ranks, store)
        self._rank = rank
        self._size = size
        self._ranks = ranks
        self._name = name
        self._backend_name = backend
        self._timeout_s = self._timeout.total_seconds()
        self._lock = ops.lock  # guards terminal transitions, the in-flight table, the error and abort state
        self._issue_lock = threading.Lock()  # one issuing thread at a time
        self._in_flight = ops.in_flight  # async ops in flight
        self._closed = False
        self._grave: Grave | None = None  # the abandoned backend, once aborted (or shut down errored)
        self._retained: list[Any] = []  # objects the backend may still write into (see retain())
        self._op_counter = 0
        self._split_seq = 0
        self._opts: dict[tuple[str, object], Any] = {}
        self._unwaited: UnwaitedWatcher | None = None
        self._pre_hooks = ops.pre_hooks
        self._post_hooks = ops.post_hooks
        self._check_hooks = ops.check_hooks
        self._abort_hooks = ops.abort_hooks
        self._split_hooks: HookList[Communicator] = HookList("split")
        self._shutdown_hooks: HookList[Communicator] = HookList("shutdown")
        self.extensions: dict[str, Any] = {}
        """Per-communicator state of the extensions attached to it, by extension name (``"flight_recorder"``,
        ``"windows"``, ...): see :mod:`torchnext.comms.extension`."""
        dev = None if device is None else torch.device(device)
        cfg = BackendConfig(store=store, rank=rank, size=size, timeout=self._timeout, device=dev, name=name)
        self._backend = factory(cfg)
        self._pg = self._backend.pg
        self._interruptible = self._backend.interruptible_wait
        self._futureless = self._backend.futureless_ops
        self._device = self._backend.device
        _LIVE.add(self)

    # ------------------------------------------------------------------------------------------------ properties
    @property
    def rank(self) -> int:
        """This process's rank in the communicator."""
        return self._rank

    @property
    def size(self) -> int:
        """Number of members."""
        return self._size

    @property
    def name(self) -> str:
        return self._name

    @property
    def ranks(self) -> list[int]:
        """Global ranks (ranks of the root communicator) of the members, in communicator-rank order."""
        return list(self._ranks)

    @property
    def device(self) -> torch.device:
        """Device of the tensors this communicator's backend communicates."""
        return self._device

    @property
    def backend(self) -> str:
        return self._backend_name

    @property
    def flight_recorder(self) -> FlightRecorder | None:
        """The :class:`~torchnext.comms.FlightRecorder` recording this communicator (and its split children), or
        None (``extensions["flight_recorder"]``, set by the recorder when it attaches)."""
        return self.extensions.get("flight_recorder")

    @property
    def check_collectives(self) -> bool:
        """Whether the consistency mode checks this communicator's ops (``extensions["consistency"]``, set by
        :mod:`torchnext.comms.consistency` when it attaches)."""
        return "consistency" in self.extensions

    @property
    def timeout(self) -> timedelta:
        """Default op timeout."""
        return self._timeout

    def set_timeout(self, timeout: float | timedelta) -> None:
        """Make ``timeout`` the default op timeout of every op issued from now on (ops in flight keep theirs); the
        backend's own default follows (Gloo's ``_set_default_timeout``), so a longer timeout is not cut short by it.

        Raises:
            ValueError: ``timeout`` is not positive.
        """
        td = _as_timedelta(timeout)
        if td.total_seconds() <= 0:
            raise ValueError(f"communicator {self._name!r}: timeout must be positive, got {timeout!r}")
        with self._lock:
            self._timeout = td
            self._timeout_s = td.total_seconds()
        setter = getattr(self._pg, "_set_default_timeout", None)
        if callable(setter):
            setter(td)

    @property
    def store(self) -> dist.Store:
        """This communicator's namespaced store (keys under ``torchnext/<name>/``; a split child's under its own
        sub-prefix). Components built on a communicator (windows, recovery) put their keys under a sub-prefix of it:
        ``PrefixStore("mine", comm.store)``.

        Released with the backend once the communicator is closed (aborted or shut down): the connection is this
        communicator's, and a closed communicator kept alive -- by a failed Work a user holds, or a reference cycle
        through a raised exception's traceback -- must not keep a socket open. Then raises ``RuntimeError``."""
        if self._ops.store is None:
            raise RuntimeError(f"communicator {self._name!r} is closed: its store was released with its backend")
        return self._ops.store

    @property
    def backend_handle(self) -> BackendHandle:
        """The connected backend (``.pg`` is the c10d object). Issuing on it directly bypasses op ids, hooks and
        abort: use it only for what the Communicator does not offer. After ``shutdown()`` its ``.pg`` is None (the
        backend was destroyed)."""
        return self._backend

    def __repr__(self) -> str:
        state = "aborted" if self._ops.aborted else "errored" if self._ops.error else "closed" if self._closed else "ok"
        return f"Communicator(name={self._name!r}, rank={self._rank}, size={self._size}, backend={self._backend_name!r}, {state})"

    # ------------------------------------------------------------------------------------------------- hooks
    def register_pre_hook(self, fn: Callable[[OpInfo], object]) -> RemovableHandle:
        """Call ``fn(OpInfo)`` before each op is issued (see :mod:`torchnext.comms.hooks` for exact timing)."""
        return self._pre_hooks.add(fn)

    def register_post_hook(self, fn: Callable[[PostHookArgs], object]) -> RemovableHandle:
        """Call ``fn(PostHookArgs)`` exactly once when each op reaches a terminal state."""
        return self._post_hooks.add(fn)

    def register_check_hook(self, fn: Callable[[OpInfo], object]) -> RemovableHandle:
        """Call ``fn(OpInfo)`` after the pre hooks, right before each op reaches the backend. ``fn`` may refuse
        the op by raising a :class:`CommError`, which the op call raises as is (see :mod:`torchnext.comms.hooks`);
        the consistency mode is built on it."""
        return self._check_hooks.add(fn)

    def register_abort_hook(self, fn: Callable[[AbortHookArgs], object]) -> RemovableHandle:
        """Call ``fn(AbortHookArgs)`` once when this communicator is aborted."""
        return self._abort_hooks.add(fn)

    def register_shutdown_hook(self, fn: Callable[[Communicator], object]) -> RemovableHandle:
        """Call ``fn(self)`` once in ``shutdown()``, after the ops in flight finished and before the backend is
        released (extensions release what they built on this communicator). A raising hook surfaces as
        ``HookError`` once the shutdown is complete."""
        return self._shutdown_hooks.add(fn)

    def register_split_hook(self, fn: Callable[[Communicator], object]) -> RemovableHandle:
        """Call ``fn(child)`` on this rank for every child communicator a later ``split``/``split_by_color``
        creates here, once it is connected and before the split returns (extensions use it to follow children: the
        Flight Recorder records them). A raising hook surfaces as ``HookError`` from the split; the child is shut
        down first."""
        return self._split_hooks.add(fn)

    def has_op_hooks(self) -> bool:
        """Whether any pre or post hook is registered: an extension that issues ops of its own (an RMA window) builds
        their :class:`OpInfo` and runs the hooks only then (:meth:`run_pre_hooks`, :meth:`run_post_hooks`)."""
        return bool(self._pre_hooks.snapshot or self._post_hooks.snapshot)

    def run_pre_hooks(self, info: OpInfo) -> None:
        """Run the pre hooks for an op an extension issues itself, as for the communicator's own ops.

        Raises:
            HookError: a pre hook raised (the later ones were skipped); the op must not be issued.
        """
        error = self._pre_hooks.run(info, stop_on_error=True)
        if error is not None:
            raise error

    def run_post_hooks(self, args: PostHookArgs) -> HookError | None:
        """Run the post hooks once for an extension's op that reached a terminal state; returns the first hook's
        failure as a ``HookError`` (every hook runs; nothing raises here), for the op's waiter to raise."""
        if not self._post_hooks.snapshot:
            return None
        return self._post_hooks.run(args, stop_on_error=False)

    # ------------------------------------------------------------------------------------------ state / lifecycle
    def errored(self) -> Exception | None:
        """The first failure that broke this communicator (timeout, peer failure, backend error), or the
        ``CommAborted`` of ``abort()`` when there was none; None while healthy."""
        return self._ops.error or self._ops.aborted

    def abort(self, reason: str | None = None, *, cause: BaseException | None = None) -> None:
        """Abort: unblock every in-flight op on this rank with ``CommAborted`` at once; refuse all later ops.
        ``cause`` (e.g. the membership error that made fault tolerance abort this replica group's own communicator)
        becomes the ``__cause__`` of every ``CommAborted`` this abort produces, so that a handler can tell why.

        Any thread, idempotent (later calls do nothing). Order: mark aborted, run abort hooks (extensions react
        there: this communicator's RMA windows are invalidated, so their ops raise ``WindowInvalidated``; a Flight
        Recorder dumps), cancel in-flight ops (their post hooks run here with status ABORTED), abandon the backend
        (calling its own abort when it has one). A raising abort hook surfaces as ``HookError`` after all of that is
        done.
        """
        with self._lock:
            if self._ops.aborted is not None:
                return
            self._ops.aborted = CommAborted(
                f"communicator was aborted{f' ({reason})' if reason else ''}",
                comm_name=self._name, rank=self._rank, ranks=self._ranks,
            )
            self._ops.aborted.__cause__ = cause
            in_flight = sorted(self._in_flight.items())
            sync_work = self._ops.sync_work
            if sync_work is not None and sync_work.op_id not in self._in_flight:
                in_flight = sorted([*in_flight, (sync_work.op_id, sync_work)])
        hook_error = self._abort_hooks.run(
            AbortHookArgs(comm_name=self._name, ranks=self._ranks, rank=self._rank, reason=reason,
                          in_flight=tuple(op_id for op_id, _ in in_flight)),
            stop_on_error=False,
        )
        if self._unwaited is not None:
            self._unwaited.close()
        self._ops.close_waiter()  # its thread leaves once its current wait ends (promptly: the backend is cancelled)
        for _, work in in_flight:
            exc = CommAborted(f"cancelled by abort(){f' ({reason})' if reason else ''}",
                              **self._ops.error_context(work.op, work.op_id))
            exc.__cause__ = cause
            work._finish(WorkStatus.ABORTED, exc)  # its backend Works become orphans (buried below)
        if not self._closed:
            self._closed = True
            backend = self._backend
            if backend.abort_fn is not None:
                try:
                    backend.abort_fn()
                except Exception:  # the backend is abandoned either way
                    pass
            self._bury()
        if hook_error is not None:
            raise hook_error

    def retain(self, obj: object) -> None:
        """Keep ``obj`` alive until this communicator's backend is released -- until nothing can write into it any
        more. For the buffers of cancelled ops: an abandoned backend may still write into them until its ops end
        (:mod:`torchnext.comms.reaper`), so freeing them earlier would turn a late write into heap corruption. On a
        communicator whose backend was already released, does nothing."""
        with self._lock:
            grave = self._grave
            if grave is None:
                self._retained.append(obj)
            elif not grave.released:
                grave.keep.append(obj)

    def __del__(self) -> None:
        # The last reference went without close()/abort() (an errored communicator left to go out of scope): never
        # let the backend's destructor run here -- this may be one of the backend's own threads (a completion
        # callback held the last Work -> this communicator), which cannot join itself (SIGABRT: "terminate called
        # after throwing an instance of 'std::system_error' -- Resource deadlock avoided"). The reaper's thread
        # releases it once its ops ended.
        try:
            if getattr(self, "_pg", None) is not None and not self._closed:
                self._closed = True
                self._bury()
        except Exception:  # a half-built communicator, or interpreter shutdown: nothing to hand over
            pass

    def _bury(self) -> None:
        """Hand the backend to the reaper with what may still run on it (the caller marked the communicator
        closed). An op being issued meanwhile adds its backend Works when it leaves (``_left_issue``)."""
        with self._lock:
            works, self._ops.orphans = self._ops.orphans, []
            keep, self._retained = self._retained, []
            issuing = self._issue_lock.locked()
            self._grave = bury(self._backend, self._name, works, keep, issuing=issuing, until=self._ops.orphans_until)
            self._pg = None
            self._ops.store = None  # the backend holds its own reference while it lives (it connected through it)

    def _left_issue(self, launched: Sequence[Any], until: float) -> None:
        """The issuing thread leaves an op on an aborted communicator: its backend Works go to the grave (``until``:
        the op's deadline, ``perf_counter`` time)."""
        with self._lock:
            grave = self._grave
            if grave is None:  # abort() has not buried the backend yet: it takes them
                if launched:
                    self._ops.add_orphans(launched, until)
            else:
                grave.works.extend(launched)
                if launched and until > grave.until:
                    grave.until = until
                grave.issuing = False

    def shutdown(self) -> None:
        """Release the backend cleanly (idempotent). Waits for async ops still in flight (each bounded by its
        timeout); a synchronous op running in another thread makes it raise ``RuntimeError`` instead.

        An errored or aborted communicator's backend is abandoned instead of destroyed (its threads may be blocked).
        Later ops raise ``CommError`` (``CommAborted`` if aborted).
        """
        with self._lock:
            if self._closed:
                return
            if self._ops.sync_work is not None:
                raise RuntimeError(f"shutdown() of {self._name!r} while another thread is in a synchronous "
                                   f"{self._ops.sync_work.op}; wait for it to return (or abort())")
            pending = list(self._in_flight.values())
        for work in pending:
            try:
                work.wait()
            except Exception:
                pass
        with self._lock:
            if self._closed:
                return
            self._closed = True
        hook_error = self._shutdown_hooks.run(self, stop_on_error=False) if self._shutdown_hooks.snapshot else None
        try:
            self._release()
        finally:
            if hook_error is not None:
                raise hook_error

    def _release(self) -> None:
        self._ops.close_waiter()
        if self._unwaited is not None:
            self._unwaited.close()
        backend = self._backend
        if self._ops.error is not None:
            self._bury()
            return
        if backend.shutdown_fn is not None:
            backend.shutdown_fn()
        # Destroy the backend here, on the calling thread: left to the garbage collector, its last reference could
        # go on one of its own worker threads (a completion callback briefly holds a Work -> this communicator),
        # whose destructor cannot join itself ("terminate called without an active exception").
        self._pg = None
        backend.pg = None
        self._ops.store = None

    # ------------------------------------------------------------------------------------------------ the engine
    def _fail_from_outside(self, exc: CommError) -> CommError:
        """A failure of an op that ran outside this communicator's own Works (the native process-group data path
        over this communicator's backend): the communicator becomes errored with it (the first failure wins), as
        after a failed op of its own. A timeout while another member reported a peer failure becomes that
        ``PeerFailure`` (returned); an original peer failure is published to the other members."""
        if isinstance(exc, CommTimeout):
            report = self._ops.reported_peer_failure()
            if report is not None:
                failure = PeerFailure(f"a member reported a peer failure ({report}); this op could not complete",
                                      **self._ops.error_context(exc.op, exc.op_id))
                failure.__cause__ = exc
                exc = failure
        with self._lock:
            first = self._ops.error is None and self._ops.aborted is None
            if first:
                self._ops.error = exc
        if first and isinstance(exc, PeerFailure) and not isinstance(exc.__cause__, CommTimeout):
            self._ops.publish_peer_failure(exc)
        return exc

    def _error_context(self, op: str | None, op_id: int | None) -> dict[str, Any]:
        return self._ops.error_context(op, op_id)

    def _refuse(self, op: str) -> None:
        if self._ops.aborted is not None:
            raise CommAborted("communicator was aborted; create a new one",
                              **self._ops.error_context(op, None)) from self._ops.aborted.__cause__
        error = self._ops.error
        if error is not None:
            raise CommError(f"communicator is errored since: {error}", **self._ops.error_context(op, None)) from error
        raise CommError("communicator was shut down", **self._ops.error_context(op, None))

    def _opt(self, kind: str, key: object, make: Callable[[], Any], timeout: timedelta | None) -> Any:
        """Backend options object; cached when the default timeout is used (the backend copies it per call). ``key``
        must determine the options' content; hot ops key by plain strings (a ReduceOp's ``_value_``, not the enum:
        hashing an enum runs Python code, hashing a c10d RedOpType runs pybind's)."""
        if timeout is None:
            opts = self._opts.get((kind, key))
            if opts is None:
                opts = self._opts[(kind, key)] = make()
            return opts
        opts = make()
        opts.timeout = timeout
        return opts

    def _issue(
        self,
        op: str,
        async_op: bool,
        timeout: Timeout,
        launch: Callable[[timedelta | None], Sequence[Any]],
        inputs: Sequence[torch.Tensor],
        outputs: Sequence[torch.Tensor],
        *,
        root: int | None = None,
        peer: int | None = None,
        reduce_op: ReduceOp | None = None,
        finalize: Callable[[], None] | None = None,
        has_future: bool = True,
        tag: int | None = None,
        batch: tuple[Any, ...] = (),
        splits: tuple[Any, ...] = (),
    ) -> Work | None:
        ops = self._ops
        if self._closed or ops.error is not None:
            self._refuse(op)
        if has_future and op in self._futureless:
            has_future = False
        if timeout is None:
            td, timeout_s = None, self._timeout_s
        else:
            td = _as_timedelta(timeout)
            timeout_s = td.total_seconds()
            if timeout_s <= 0:
                raise ValueError(f"{op}: timeout must be positive, got {timeout!r}")
        backend_works: Sequence[Any] = ()
        if not self._issue_lock.acquire(blocking=False):
            raise RuntimeError(
                f"{op}: another thread is issuing an op on communicator {self._name!r}; ops must be issued by one "
                "thread at a time (abort() is the exception)"
            )
        try:
            self._op_counter += 1
            op_id = self._op_counter
            info = None
            pre = self._pre_hooks.snapshot
            check = self._check_hooks.snapshot
            if pre or check or self._post_hooks.snapshot:  # positional: this is the hot path
                info = _new_tuple(OpInfo, (op, op_id, self._name, self._ranks, self._rank, self._size, async_op, root,
                                           peer, None if reduce_op is None else reduce_op._value_, tuple(inputs),
                                           tuple(outputs), td or self._timeout, tag, batch,
                                           splits))  # = OpInfo(...), minus a frame
            # sync ops first wait in this thread where the backend's timed wait is only a wait (Gloo collectives);
            # elsewhere (Gloo send/recv: a timed wait *is* the op's timeout) they wait like async ops
            sliced = not async_op and has_future and self._interruptible
            work = Work(self, op, op_id, info, outputs, timeout_s, peer, not sliced)
            if pre:
                hook_error = self._pre_hooks.run(info, stop_on_error=True)  # type: ignore[arg-type]
                if hook_error is not None:
                    work._finish(WorkStatus.ERROR, hook_error)
                    raise hook_error
            if check:  # e.g. the consistency mode: the members compare this op before anything reaches the backend
                refusal = self._check_hooks.refusal(info)  # type: ignore[arg-type]
                if refusal is not None:
                    exc, breaks = refusal
                    work._finish(WorkStatus.ERROR, exc, breaks_comm=breaks)
                    raise exc
            work._finalize = finalize
            # IN_PROGRESS before the Work is published: from here on only Work._finish changes its status (the first
            # caller wins), so an abort() at any later point is never overwritten.
            work.status = _IN_PROGRESS
            if not sliced:
                with self._lock:
                    raced = ops.aborted is not None  # abort() ran since the check above
                    if not raced:
                        self._in_flight[op_id] = work
            else:  # the one sync op in flight (one issuing thread): a slot, no lock. Publish, then check abort:
                ops.sync_work = work  # abort() sets the flag, then reads the slot -- one of us sees the other
                raced = ops.aborted is not None
            if raced:
                work._finish(WorkStatus.ABORTED, ops.aborted)
                self._refuse(op)
            try:
                backend_works = launch(td)
                work._launched = backend_works
            except Exception as exc:
                # Raised while issuing: a broken peer/timeout breaks the communicator; anything else is the backend
                # refusing the arguments (nothing was issued), which leaves the communicator usable.
                wrapped = work._wrap_backend_error(exc)
                work._finish(WorkStatus.ERROR, wrapped, breaks_comm=type(wrapped) is not CommError)
                raise wrapped from exc
            if work.status is not _IN_PROGRESS:  # abort() finished it while it was launched: nothing to watch
                if async_op:
                    return work
                work._outcome()
            if sliced:
                if len(backend_works) == 1:
                    work._wait_sync(backend_works[0])
                    return None
                work._done = _locked()  # (no such op today) several backend works: wait as below
            if len(backend_works) != 1:
                work._pending = len(backend_works)
            if has_future and self._interruptible and len(backend_works) == 1:
                # A thread that waits waits on the backend Work directly (Work.wait); its future (costly to create
                # on Gloo) gets the completion callback only if nobody waits (the watcher) or a wait outlasts its
                # first slice (Work._watch).
                work._bw = work._fut = backend_works[0]
                work._racy = True
                watcher = self._unwaited
                if watcher is None:
                    watcher = self._unwaited = UnwaitedWatcher(self._name, self._in_flight, self._lock)
                if watcher.idle:  # it sleeps: nothing per op otherwise (it looks at _in_flight itself)
                    watcher.wake()
            else:
                for bw in backend_works:
                    if has_future:
                        try:
                            fut = bw.get_future()
                        except RuntimeError:
                            ops.wait_in_thread(bw, work, td)
                        else:
                            fut.add_done_callback(future_callback(work))
                    else:
                        ops.wait_in_thread(bw, work, td)
            if async_op:
                return work
            work.wait()
            return None
        finally:
            ops.sync_work = None
            self._issue_lock.release()
            if ops.aborted is not None:  # aborted while issuing (or before): what was launched goes to the grave
                self._left_issue(backend_works, time.perf_counter() + timeout_s)
            backend_works = ()  # a raised exception keeps this frame in its traceback: no backend Work in it

    def _reduce_args(self, op_name: str, op: object, dtype: torch.dtype) -> tuple[ReduceOp, Any, bool]:
        """(ReduceOp, c10d op to pass, whether to divide by size on completion)."""
        if op is ReduceOp.SUM:
            return _SUM_ARGS
        rop = ReduceOp.coerce(op)
        rop.check_dtype(dtype)
        if rop is ReduceOp.AVG and not self._backend.native_avg:
            return rop, dist.ReduceOp.SUM, True
        return rop, rop.to_c10d(), False

    # -------------------------------------------------------------------------------------------- RMA windows
    def new_window(
        self,
        tensor: torch.Tensor,
        *,
        transport: str | None = None,
        host: str | None = None,
        timeout: float | timedelta | None = None,
    ) -> Window:
        """Collective: register ``tensor`` in a one-sided RMA window (see :mod:`torchnext.comms.window`)."""
        window: Window = factory("new_window")(self, tensor, transport=transport, host=host, timeout=timeout)
        return window

    # ------------------------------------------------------------------------------------------- process group
    def as_process_group(self, *, name: str | None = None) -> TorchnextProcessGroup:
        """This communicator as a ``torch.distributed.ProcessGroup``, accepted wherever torch takes a group
        (``dist.*(group=pg)``, DDP's ``process_group=``, ``DeviceMesh.from_group``, functional collectives); the
        same object on every call (see :mod:`torchnext.comms.process_group`)."""
        pg: TorchnextProcessGroup = factory("as_process_group")(self, name=name)
        return pg

    # --------------------------------------------------------------------------------------------------- split
    def split(self, ranks: Sequence[int], name: str | None = None, *, timeout: Timeout = None) -> Communicator | None:
        """Eager split: a new communicator of ``ranks`` (ranks of this communicator; child rank i is ``ranks[i]``).

        Collective over this communicator: every member calls it with the same list (checked: a mismatch raises
        ``ValueError`` on every rank). Members get a connected child; the others get None.
        """
        if not isinstance(ranks, (list, tuple)) or not ranks:
            raise ValueError(f"split: ranks must be a non-empty list of ranks, got {ranks!r}")
        for r in ranks:
            v.check_rank(r, self._size, "ranks entry", "split")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"split: ranks contains duplicates: {list(ranks)}")
        digest = zlib.crc32(",".join(map(str, ranks)).encode()) & 0x7FFFFFFF
        member = self._rank in ranks
        return self._split(
            color=0 if member else None, key=ranks.index(self._rank) if member else 0, check=digest,
            name=name, timeout=timeout,
        )

    def split_by_color(
        self, color: int | None, key: int = 0, *, name: str | None = None, timeout: Timeout = None
    ) -> Communicator | None:
        """Eager split with MPI_Comm_split semantics: ranks with equal ``color`` form one child, ordered by
        ``(key, rank)``; ``color=None`` means not a member (returns None). Collective over this communicator."""
        if color is not None and not _is_int(color):
            raise TypeError(f"split_by_color: color must be an int or None, got {color!r}")
        if not _is_int(key):
            raise TypeError(f"split_by_color: key must be an int, got {key!r}")
        return self._split(color=color, key=key, check=0, name=name, timeout=timeout)

    def _split(
        self, *, color: int | None, key: int, check: int, name: str | None, timeout: Timeout
    ) -> Communicator | None:
        seq = self._split_seq
        self._split_seq += 1
        mine = torch.tensor([0 if color is None else 1, color or 0, key, check], dtype=torch.int64)
        table = torch.empty(self._size * 4, dtype=torch.int64)

        def launch(td: timedelta | None) -> list[Any]:
            return [self._pg._allgather_base(table, mine, self._opt("allgather", None, _C10D.AllgatherOptions, td))]

        self._issue("split", False, timeout, launch, [mine], [table])
        rows = table.view(self._size, 4).tolist()
        if len({row[3] for row in rows}) != 1:
            raise ValueError(f"split: the ranks passed differ between members of {self._name!r} (rank {self._rank})")
        if color is None:
            return None
        members = sorted((row[2], r) for r, row in enumerate(rows) if row[0] == 1 and row[1] == color)
        return self.child(dist.PrefixStore(f"split{seq}/c{color}", self.store), [r for _, r in members],
                          name=name or f"{self._name}.{seq}.{color}")

    def child(self, store: dist.Store, ranks: Sequence[int], *, name: str, timeout: Timeout = None) -> Communicator:
        """A communicator of ``ranks`` (ranks of this communicator; child rank i is ``ranks[i]``) whose membership
        was agreed on by other means -- ``split`` agrees by a collective; ``torch.distributed.new_group`` by every
        process calling it with the same ranks. Only the members call this, each with the same namespace of a
        shared ``store`` (used as is); it connects eagerly. Same backend and device as this communicator; the
        timeout defaults to this one's. Split hooks run on the child (a Flight Recorder records it); a raising
        one surfaces as ``HookError`` after the child was shut down.

        Raises:
            ValueError: ``ranks`` has duplicates or ranks outside this communicator, or this rank is not in it.
        """
        if not isinstance(ranks, (list, tuple)) or not ranks:
            raise ValueError(f"child: ranks must be a non-empty list of ranks, got {ranks!r}")
        for r in ranks:
            v.check_rank(r, self._size, "ranks entry", "child")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"child: ranks contains duplicates: {list(ranks)}")
        if self._rank not in ranks:
            raise ValueError(f"child: this rank ({self._rank}) is not in ranks {list(ranks)}; only members call it")
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"child: name must be a non-empty string without '/', got {name!r}")
        child = Communicator.__new__(Communicator)
        child._setup(store, list(ranks).index(self._rank), len(ranks), tuple(self._ranks[r] for r in ranks),
                     backend=self._backend_name, timeout=self._timeout if timeout is None else timeout, name=name,
                     device=self._device)
        py_store = _python_store(store)  # under a prefix of ours: the Python store ours lives on
        if py_store is not None:
            child.retain(py_store)
        if self._split_hooks.snapshot:
            hook_error = self._split_hooks.run(child, stop_on_error=True)
            if hook_error is not None:
                child.shutdown()
                raise hook_error
        return child


_SUM_ARGS = (ReduceOp.SUM, dist.ReduceOp.SUM, False)
_IN_PROGRESS = WorkStatus.IN_PROGRESS




def _locked() -> Any:
    lock = threading.Lock()
    lock.acquire()
    return lock


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _as_timedelta(t: float | timedelta) -> timedelta:
    if isinstance(t, timedelta):
        return t
    if isinstance(t, (int, float)) and not isinstance(t, bool):
        return timedelta(seconds=float(t))
    raise TypeError(f"timeout must be a timedelta or seconds (float), got {t!r}")


def _python_store(store: dist.Store) -> dist.Store | None:
    """The store under ``store``'s prefixes when it is implemented in Python (a ``dist.Store`` subclass, e.g.
    :class:`~torchnext.comms.cancellable_store.CancellableStore`), else None. torch calls such a store from C++
    through a trampoline that needs the Python object alive: a communicator keeps it until its backend is released
    (a temporary one would be gone at the backend's next store call, which then fails with "Not implemented")."""
    s: Any = store
    while isinstance(s, dist.PrefixStore):
        s = s.underlying_store
    return s if isinstance(s, dist.Store) and not type(s).__module__.startswith("torch.") else None
