"""``FaultTolerantProcessGroup``: the replicate dimension of a fault-tolerant job as one stable torch process group.

``ft.process_group`` is a :class:`~torchnext.comms.TorchnextProcessGroup` whose Communicator is the current
generation's replicate Communicator of :class:`~torchnext.ft.FaultTolerant` (rank ``r`` of every live replica group),
swapped at every reconfiguration while the object stays the same -- DDP, FSDP2 and DeviceMesh hold on to it.
Semantics, per generation::

    pg.size() == ft.size                  # the live number of replica groups
    pg.rank() == ft.rank                  # this replica group's rank among them
    all_reduce(t, AVG)  ->  t = mean over the live groups of t          (a joining group takes part once healed)

**Failures never raise out of torch's machinery.** Inside a step an op of a broken generation -- aborted by a new
generation, failed on a dead peer, or refused because the Communicator is already errored -- is *recorded*, not
raised: its ``wait()`` returns, its future completes, its outputs are marked invalid (NaN), and the step cannot
commit (``step.commit()`` is False; the ``with ft.step()`` block retries it after the reconfiguration). That holds
for DDP's and FSDP2's hooks and for ``dist.*`` calls alike. Bad arguments still raise at once.

**The backend never writes into the caller's tensors.** An op abandoned by a reconfiguration is not cancelled in
the backend (gloo cannot be): its threads may still finish it later -- when a stopped peer resumes, or a peer that
already left the generation sends its last chunk -- and write into the op's buffers. The in-place ops
(``all_reduce``, ``broadcast``, ``reduce``) therefore run on private staging buffers, copied back into the caller's
tensors only when the op succeeded; the buffer of a failed op is never reused (the backend keeps it alive)::

    staged = pool.take_like(t); staged.copy_(t)     # reused across ops while they succeed
    op(staged) -> ok ? t.copy_(staged); pool.put(staged) : t.fill_(nan)   # a failed op's buffer is dropped

**Data path.** With ``TORCHNEXT_NATIVE_PG=1`` (the default) and a Gloo (CPU) Communicator, every generation runs on
the native data path unless something asks for Python per op (a user hook or ``check_collectives`` on that
generation's Communicator): a new native backend wraps the generation's Gloo, in staged never-raise mode, behind
the group's one switch backend (:mod:`torchnext.comms.process_group.native`, "A staged group"). ``all_reduce``,
``broadcast`` and ``reduce`` then run in C++ with the same staging and the same never-raise semantics; every other
op, and every op once the generation is broken, runs on this module's Python methods. A native failure is recorded
as a Python one is (:meth:`FaultTolerantProcessGroup._note_native_failure`): on the waiting thread, or -- a future
nobody waited on -- before ``ft.vote()`` (:meth:`FaultTolerantProcessGroup._drain_native`). Callers in C++
(:class:`~torchnext.ft.DistributedDataParallel`'s comm hook) issue on the current generation's native backend
through :meth:`FaultTolerantProcessGroup.native_route`, or on the group's own method while there is none. After an early vote
the native backend is held on the Python path (which refuses the step's later ops) until the step is over. With
``TORCHNEXT_NATIVE_PG=0``, no compiler, or a CUDA Communicator: the Python path for every op, as before.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from torchnext.comms.communicator import Communicator
from torchnext.comms.errors import CommError
from torchnext.comms.process_group import GroupWork, TorchnextProcessGroup
from torchnext.comms.process_group import native as _native
from torchnext.comms.process_group.group import BACKEND_NAME
from torchnext.comms.process_group.profiling import annotate
from torchnext.comms.process_group.work import mark_invalid
from torchnext.ft.errors import FailureKind, classify_failure, quiet_abort
from torchnext.ft.quarantine import quarantine_cancelled

if TYPE_CHECKING:
    from torchnext.ft.config import Reconfiguration
    from torchnext.ft.fault_tolerant import FaultTolerant

__all__ = ["FaultTolerantProcessGroup"]

_IDS = itertools.count()
_LOG = logging.getLogger(__name__)


class _Staging:
    """Private buffers for in-place ops, reused while their ops succeed: ``take(t)`` a buffer shaped like ``t``,
    ``put`` it back after a successful op; a failed op's buffer is simply not put back (an abandoned backend may
    still write into it; the backend's own reference keeps its storage alive, so nothing else gets that memory)."""

    def __init__(self) -> None:
        self._free: dict[tuple[Any, ...], list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _key(t: torch.Tensor) -> tuple[Any, ...]:
        return (tuple(t.shape), t.dtype, t.device)

    def take(self, t: torch.Tensor) -> torch.Tensor:
        with self._lock:
            free = self._free.get(self._key(t))
            buf = free.pop() if free else None
        if buf is None:
            buf = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        with torch.no_grad():
            buf.copy_(t)
        return buf

    def put(self, buf: torch.Tensor) -> None:
        with self._lock:
            free = self._free.setdefault(self._key(buf), [])
            if len(free) < _STAGING_KEEP:
                free.append(buf)


_STAGING_KEEP = 4  # free buffers kept per (shape, dtype, device): DDP has a few buckets in flight at once


class _FTWork(GroupWork):
    """A Work of the fault-tolerant group: ``wait()`` never raises a communication failure (it is recorded: the
    step cannot commit; outputs are marked invalid). A bounded ``wait(timeout)`` that elapses still raises.

    ``unstage``: ``(staged, caller)`` pairs of an in-place op run on staging buffers (``result`` holds the callers'
    tensors): when the op succeeded, ``caller.copy_(staged)`` exactly once, whoever sees the completion first, and
    the buffers go back to the pool; when it failed, the callers' tensors are marked invalid and the buffers are
    dropped."""

    def __init__(self, group: FaultTolerantProcessGroup, works: Any, result: list[Any],
                 unstage: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        super().__init__(group, works, result)
        self._ft_group = group
        self._unstage = unstage
        self._unstage_lock = threading.Lock()

    def _terminal(self, failed: bool) -> None:
        with self._unstage_lock:
            pairs, self._unstage = self._unstage, None
        if not pairs or failed:
            return
        staging = self._group._staging  # type: ignore[attr-defined]
        with torch.no_grad():
            for staged, caller in pairs:
                caller.copy_(staged)
                staging.put(staged)

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        limit = None if not timeout else timeout
        for work in self._works:
            try:
                done = work.wait(limit)
            except CommError as exc:
                self._terminal(True)
                mark_invalid(self._invalid)
                self._ft_group._note_swallowed(work, exc)
                return True
            if not done:
                raise RuntimeError(f"{work.op}: wait() timed out after {timeout} (the op is still in flight)")
        self._terminal(not self.is_success())
        return True


class FaultTolerantProcessGroup(TorchnextProcessGroup):
    """The replicate dimension of ``ft`` as a torch process group (see the module docstring). Build it with
    ``ft.process_group``."""

    def __init__(self, ft: FaultTolerant) -> None:
        # Not TorchnextProcessGroup.__init__: the group exists before ft's first generation (FSDP2 shards over a
        # mesh of it before ft.join()), and its rank, size and Communicator are the current generation's.
        dist.ProcessGroup.__init__(self, 0, 1)  # type: ignore[call-arg]
        self._comms = {}
        self._main = None  # type: ignore[assignment]
        self._group_desc = f"{ft.config.name} (fault tolerant)"
        self._lock = threading.Lock()
        self._warned = False
        self._issuing = threading.Lock()  # as TorchnextProcessGroup's: several threads issue one op at a time
        self._staging = _Staging()
        self._ft = ft
        me = dist.get_rank() if dist.is_initialized() else 0
        self._mapping: dict[int, int] = {me: ft.rank if ft.members else 0}  # torch's global -> group rank, current
        self._me = me
        self._timeout: timedelta | None = None  # set_timeout's, for every later generation
        self._native = None
        self._switch: Any = None  # the native switch backend, registered for CPU with the first native generation
        self._held: Any = None  # the native backend held on the Python path since this step's early vote
        self._route: Any = None  # the C++ route of callers in C++ (native_route), made on first use
        self._route_lock = threading.Lock()
        name = f"torchnext:{ft.config.name}:member{ft.member_id}:{next(_IDS)}"
        self._group_name = name
        _register(self, name, dist.HashStore(), self._mapping)
        ft.on_reconfigure(self._reconfigured)
        if ft._comm is not None:  # built after ft joined: its current generation's data path now
            self._follow(ft._comm)

    def _reconfigured(self, info: Reconfiguration) -> None:
        self._mapping.clear()
        self._mapping[self._me] = info.rank
        comm = self._ft._comm
        if self._timeout is not None and comm is not None:
            comm.set_timeout(self._timeout)
        self._follow(comm)

    def _follow(self, comm: Communicator | None) -> None:
        """Put the group on the data path of generation ``comm``: the native one (a new native backend wrapping
        ``comm``'s Gloo, swapped in behind the group's switch backend) unless something asks for Python."""
        old = self._native
        if old is not None:
            if old.comm is comm:
                return
            old.retire()
        self._native = None
        native = None
        if comm is not None:

            def failed(op: str, exc: CommError, comm: Communicator = comm) -> None:
                self._note_native_failure(comm, op, exc)

            try:
                native = _native.attach_generation(self, comm, self._switch, on_failure=failed,
                                                   covered=(quarantine_cancelled,))
            except Exception as exc:  # never fail a reconfiguration over the data path: the Python one works
                _LOG.warning("fault-tolerant group %r: generation %d on the Python path (native path failed: %s)",
                             self._group_name, self._ft.generation, exc)
                native = None
        if native is None:  # the Python path for this generation
            object.__setattr__(self, "__class__", getattr(type(self), "_native_twin_of", type(self)))
        else:
            self._switch = native.switch
            self._native = native
        with self._route_lock:
            if self._route is not None:
                self._route.set(None if native is None else native.backend)

    def native_route(self) -> Any:
        """The route of this group's all-reduces for callers in C++ (:class:`~torchnext.ft.DistributedDataParallel`'s
        comm hook and used-parameter map): a ``Route`` of the native extension that points at the current
        generation's native backend, or at nothing while that generation runs on the Python path (then a C++
        caller calls the group's own ``allreduce``), kept current at every reconfiguration. Made on first use; None
        when the native data path is off (``TORCHNEXT_NATIVE_PG=0``) or the extension is unavailable."""
        with self._route_lock:
            if self._route is None:
                route = _native.new_route()
                if route is None:
                    return None
                native = self._native
                route.set(None if native is None else native.backend)
                self._route = route
            return self._route

    def set_timeout(self, timeout: timedelta) -> None:
        """The default op timeout of the current generation's Communicator and of every later one (instead of
        ``FTConfig.timeout_s``)."""
        comm = self._ft._comm
        if comm is not None:
            comm.set_timeout(timeout)  # validates it
            if self._native is not None and self._native.comm is comm:
                self._native.set_timeout(timeout)
        elif not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
            raise ValueError(f"set_timeout: timeout must be a positive timedelta, got {timeout!r}")
        self._timeout = timeout

    # ------------------------------------------------------------------------------------------- identity
    def getRank(self) -> int:
        return self._ft.rank if self._ft.members else 0

    def getSize(self) -> int:
        return self._ft.size if self._ft.members else 1

    def communicator(self, device_type: str = "cpu") -> Communicator:
        """The current generation's replicate Communicator."""
        return self._ft.comm

    @property
    def communicators(self) -> dict[str, Communicator]:
        comm = self._ft.comm
        return {comm.device.type: comm}

    def errored(self) -> BaseException | None:
        self._drain_native()
        comm = self._ft._comm
        return None if comm is None else comm.errored()

    def _hold_python(self) -> None:
        """This step's vote was sent early: every op goes to the Python path, which refuses it, until the first op
        after the step (:meth:`_live` releases the hold)."""
        native = self._native
        if native is not None and native.hold_python(True):
            self._held = native

    def _close(self) -> None:
        """Its member left (``ft.close()`` / ``ft.finish()``): out of torch's group tables, where it was entered at
        construction -- they hold the group, and through it every generation's native backend and Communicator,
        for the life of the process (a member that leaves and a new ``FaultTolerant`` that joins, a thousand times
        over a job, kept a thousand). Its last generation's native backend is dropped too: the group and its
        member refer to each other, and that cycle must not keep a Communicator until a full collection.
        Idempotent."""
        _unregister(self, self._group_name)
        self._follow(None)

    def _drain_native(self) -> None:
        """Take the current generation's native failures into account (an op that failed under a future nobody
        waited on, e.g. DDP's): the Communicator becomes errored, the failure is recorded as a waited one would be.
        ``ft.should_commit()`` calls it before the vote."""
        native = self._native
        if native is not None:
            native.sync_failure()

    def __repr__(self) -> str:
        return (f"FaultTolerantProcessGroup(name={self._group_name!r}, rank={self.getRank()}, size={self.getSize()}, "
                f"generation {self._ft.generation})")

    def _get_sequence_number_for_group(self) -> int:
        comm = self._ft._comm
        native = self._native
        if native is not None and native.comm is comm:
            native.to_python_counters()
        return 0 if comm is None else int(comm._op_counter)

    def _note_swallowed(self, work: Any, exc: BaseException | None = None) -> None:
        """A failed op inside a step is expected (a member died): recorded, the step cannot commit; log at INFO.
        A deterministic error (``CollectiveMismatch``) is recorded on ``ft``: the step ends with it, not a retry."""
        exc = exc if exc is not None else work.exception()
        _LOG.info("fault-tolerant group %r: %s failed in generation %d (%s); recorded: the step will not commit",
                  self._group_name, work.op, self._ft.generation, exc)
        if exc is not None and self._record_if_deterministic(exc):
            return
        comm = getattr(work, "communicator", None)
        if comm is not None:  # the generation is broken: cancel it, so that the peers blocked in its ops fail now
            quiet_abort(comm, f"{work.op} failed in generation {self._ft.generation}")

    def _note_native_failure(self, comm: Communicator, op: str, exc: CommError) -> None:
        """:meth:`_note_swallowed` for an op of the native path (its backend never raised): the same log line,
        the same record of a deterministic error, the same abort of the op's generation."""
        _LOG.info("fault-tolerant group %r: %s failed in generation %d (%s); recorded: the step will not commit",
                  self._group_name, op, self._ft.generation, exc)
        if self._record_if_deterministic(exc):
            return
        quiet_abort(comm, f"{op} failed in generation {self._ft.generation}")

    def _record_if_deterministic(self, exc: BaseException) -> bool:
        if classify_failure(exc) is not FailureKind.DETERMINISTIC:
            return False
        self._ft._record_step_error(exc)
        return True

    def abort(self, reason: str | None = None, *, cause: BaseException | None = None) -> None:
        """Abort the current generation's Communicator (its ops raise inside the step, which then cannot commit)."""
        comm = self._ft._comm
        if comm is not None:
            comm.abort(f"fault-tolerant process group aborted{f': {reason}' if reason else ''}", cause=cause)

    def shutdown(self) -> None:
        """Nothing: the Communicators belong to ``ft`` (``ft.close()``/``ft.finish()`` release them)."""

    # ----------------------------------------------------------------------------------------------- ops
    def _live(self, op: str, tensors: list[Any]) -> Communicator | None:
        """The current generation's Communicator for an op on ``tensors``; None when that generation is broken or
        superseded (the op is then recorded as failed, not issued). Bad arguments raise."""
        ft = self._ft
        comm = ft._comm
        if ft._early_vote is not None:
            raise RuntimeError(f"{op} on the fault-tolerant process group after this step's vote was sent "
                               "(DistributedDataParallel(vote_early=True) votes when backward's last bucket is "
                               "reduced): no fault-tolerant collective may follow backward in the step")
        held = self._held
        if held is not None:  # the early vote's step is over: the native path takes ops again
            self._held = None
            held.hold_python(False)
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{op}: expected a torch.Tensor, got {type(t).__name__}")
            if comm is not None and t.device.type != comm.device.type:
                raise ValueError(f"{op}: a tensor on {t.device}, but the fault-tolerant group communicates "
                                 f"{comm.device} tensors")
        if comm is None or comm.errored() is not None or ft._newest_gen > ft.generation:
            return None
        return comm

    def _run(self, op: str, device_tensor: Any, issue: Callable[[Communicator], Any], result: list[Any]) -> GroupWork:
        comm = self._live(op, [] if device_tensor is None else [device_tensor])
        if comm is None:
            return self._failed(op, result, self._ft._comm)
        try:
            with self._issuing, annotate(op):
                works = issue(comm)
        except CommError as exc:  # refused: the generation broke between the check and the issue, or a mismatch
            return self._failed(op, result, comm, exc)
        return _FTWork(self, works, result)

    def _run_inplace(self, op: str, tensors: list[torch.Tensor],
                     issue: Callable[[Communicator, list[torch.Tensor]], Any]) -> GroupWork:
        """On private staging buffers (see the module docstring): ``issue(comm, staged)``; the callers' tensors
        get the result only when the op succeeded."""
        comm = self._live(op, tensors)
        if comm is None:
            return self._failed(op, tensors, self._ft._comm)
        with self._issuing, annotate(op):  # several threads: one op handed over at a time
            staged = [self._staging.take(t) for t in tensors]
            try:
                works = issue(comm, staged)
            except CommError as exc:  # refused before anything was issued: the buffers are still private
                for b in staged:
                    self._staging.put(b)
                return self._failed(op, tensors, comm, exc)
        return _FTWork(self, works, tensors, unstage=list(zip(staged, tensors, strict=True)))

    def _failed(self, op: str, result: list[Any], comm: Communicator | None,
                refusal: BaseException | None = None) -> GroupWork:
        """A completed Work for an op of a broken generation, or one the Communicator refused (``refusal``):
        nothing issued, outputs invalid, step uncommittable. A deterministic refusal (``CollectiveMismatch``) is
        recorded on ``ft`` -- the step raises it instead of retrying -- and leaves the Communicator as it is."""
        mark_invalid(result)
        if refusal is not None and self._record_if_deterministic(refusal):
            return _FTWork(self, (), result)
        if comm is not None:  # so that the vote sees it broken, and (errored or not) the peers' ops on it fail now
            quiet_abort(comm, f"{op} refused or issued in a broken generation")
        return _FTWork(self, (), result)


def _unregister(pg: dist.ProcessGroup, name: str) -> None:
    """Take ``pg`` out of torch's tables again (what ``destroy_process_group`` does for a group, less its shutdown:
    the generations' Communicators are their member's to abort). Tolerates a group already gone from any of them."""
    c10d: Any = dist.distributed_c10d
    world = c10d._world
    for table in (world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config,
                  world.pg_coalesce_state):
        table.pop(pg, None)
    tag = world.pg_to_tag.pop(pg, None)
    for t in ((tag, "") if tag is not None else ()):
        tagged = world.tags_to_pg.get(t)
        if tagged is not None and any(g is pg for g in tagged):
            tagged.remove(pg)
    try:
        registered = c10d._resolve_process_group(name) is pg
    except (RuntimeError, ValueError, KeyError):  # torch raises when no group has that name
        registered = False
    if registered:
        c10d._unregister_process_group(name)


def _register(pg: dist.ProcessGroup, name: str, store: dist.Store, mapping: dict[int, int]) -> None:
    """Enter ``pg`` in torch's tables under ``name`` (functional collectives and DeviceMesh resolve groups by name)."""
    c10d: Any = dist.distributed_c10d
    c10d._register_pg_in_world(pg, BACKEND_NAME, store, name, BACKEND_NAME, rank_mapping=mapping)
