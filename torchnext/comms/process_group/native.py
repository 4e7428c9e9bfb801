"""The native data path of a :class:`~torchnext.comms.process_group.group.TorchnextProcessGroup` (the default:
``TORCHNEXT_NATIVE_PG=1``): its CPU ops run in C++ (:mod:`torchnext.comms.native`), Python runs per op only when
something asked for it.

How a group runs its ops::

    python_needed = (check hooks (consistency mode)                         # check_collectives
                     or any pre/post hook not marked native_equivalent     # user hooks (the Flight Recorder's are)
                        and not covered by the group's native path)        # ft's quarantine hook: staging covers it
    if python_needed: the Python path (TorchnextProcessGroup's own methods, as without the flag)
    else:             torch's C++ ProcessGroup methods -> c10d dispatcher -> the native backend -> Gloo

``reduce_scatter_tensor`` (``_reduce_scatter_base``: FSDP2's gradient reduce-scatter) over Gloo runs as what Gloo's
own reduce-scatter is (torch 2.13), with the op finished by the allreduce's future instead of by a waiter thread
(Gloo's reduce-scatter Work has no future and never reports completion; the waiter thread's two extra wake-ups cost
~0.2-0.25 ms per 4 MiB op on 2 cores)::

    buf = input.clone()                        # a PREMUL_SUM's pre-multiplied input is already a private copy
    gloo.allreduce([buf], op)                  # the same allreduce Gloo's reduce-scatter runs: the same bits
    on its future: output.copy_(buf.view(-1)[rank * n:(rank + 1) * n])   # n = output.numel()

The reference, Gloo's own ``_reduce_scatter_base``, stays beside it (the extension's ``set_rs_reference``).

The switch is made when a hook is added or removed (a watch on the communicator's hook lists), in both directions:
the group's class becomes :data:`NATIVE_CLASS` (a subclass of ``TorchnextProcessGroup`` of the same name whose op
methods are torch's C++ ones, so pybind's trampoline never calls Python) or ``TorchnextProcessGroup`` again, and
the op counter and the Flight Recorder's sequence counters are carried over, so op ids and ``collective_seq_id``
continue across the switch.

On the native path, an op the C++ side does not take on its fast path (PREMUL_SUM other than a reduce-scatter's --
FSDP2's gradient reduce-scatters stay in C++ --, several tensors, a non-CPU,
non-contiguous or sparse tensor, a dtype or size mismatch, an errored or aborted group) runs on the Python path
for that op: the same validation, the same errors (``TypeError``/``ValueError`` naming the op) and, once the group
failed, the same refusals (``PeerFailure``/``CommTimeout``/``CommAborted`` "refused: ..."). A failed native op
raises the exception :func:`_Native.make_error` builds: the class the Python path raises, a message naming the op,
its op id, the group and the rank; the communicator becomes errored with it (``Communicator._fail_from_outside``)
and the Flight Recorder dumps as after a failure on the Python path. ``abort()`` (the communicator's abort hook)
finishes every native op in flight as ABORTED at once; their waiters raise ``CommAborted``.

**A staged group** (:func:`attach_generation`: ``ft.process_group``, whose Communicator changes per generation)
keeps the fault-tolerant group's semantics on the native path. Per generation it gets a new native backend over
that generation's Gloo, in staged never-raise mode, and the group's one *switch* backend (registered for CPU once,
with the first native generation) forwards every op to the current one; an op keeps the backend -- inner Gloo,
op counter, ring -- of the generation it was issued in, and a new generation numbers its ops from its
Communicator's counter, as the Python path does (one Flight Recorder group per generation's Communicator)::

    all_reduce / broadcast / reduce (fast path):
        staged = pool.take_like(t); staged.copy_(t)      # C++ pool keyed by shape and dtype, per generation
        op(staged) -> ok ? t.copy_(staged); pool.put(staged)
                         : mark_invalid(t)                # the buffer dropped; Gloo's own Work keeps it alive
        all_reduce AVG: SUM(staged), then t = staged / size on the copy back   # Gloo's AVG is SUM then
                                                          # staged /= size: the same quotients, one pass less
    every other op: the Python path (the group's methods; out-of-place outputs are quarantined there)
    every op: its future's callbacks run before wait() returns (the Python path's order)
    a failed op: wait() returns True, the future completes with the (invalid) outputs -- never raises;
                 waited on: on_failure(op, make_error(...)) on the waiting thread;
                 never waited on (DDP's futures): found by sync_failure() before ft's commit vote

``on_failure`` is the group's: it records a deterministic error on ``ft`` and aborts the op's generation
otherwise, as the Python path does for a failed op. Callers in C++ (ft's DDP comm hook, ``csrc/ddp.cpp``) reach
the current generation's backend through the group's ``Route`` (:func:`new_route`), kept current at every
reconfiguration, without the dispatcher or torch's Python trampoline.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from torchnext._config import env_config
from torchnext.comms import native as _native_ext
from torchnext.comms.communicator import Communicator
from torchnext.comms.errors import CommAborted, CommError, CommTimeout, PeerFailure, classify_backend_error
from torchnext.comms.flight_recorder.entries import group_dict, group_fields
from torchnext.comms.hooks import AbortHookArgs, mirrored_natively

if TYPE_CHECKING:
    from torchnext.comms.process_group.group import TorchnextProcessGroup

__all__ = ["NATIVE_OPS", "attach", "attach_generation", "native_class", "new_route", "python_needed"]

_LOG = logging.getLogger("torchnext.comms")

NATIVE_OPS = (
    "allreduce", "allreduce_coalesced", "reduce", "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single",
    "reduce_scatter_tensor_coalesced", "reduce_scatter_single_coalesced", "broadcast", "allgather",
    "_allgather_base", "all_gather_single", "allgather_coalesced", "allgather_into_tensor_coalesced",
    "all_gather_single_coalesced", "alltoall", "alltoall_base", "all_to_all_single", "gather", "scatter", "barrier",
    "send", "recv", "recv_anysource",
)
"""The op methods :data:`NATIVE_CLASS` takes from torch's C++ ``ProcessGroup`` instead of the Python path."""

_KIND_TIMEOUT, _KIND_BACKEND, _KIND_ABORT = 1, 2, 3  # csrc/native.cpp's Kind
_NATIVE_CLASSES: dict[type, type] = {}


def _weakly(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (a bound method) as a callable that does not keep its object alive: once the object is gone it
    does nothing. For the hooks a ``_Native`` registers on the Communicator it holds. Reference::

        lambda *args: method(*args) if method.__self__ is alive else None
    """
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        fn = ref()
        return None if fn is None else fn(*args)

    return call


def native_class(base: type[TorchnextProcessGroup]) -> type[TorchnextProcessGroup]:
    """The native-path twin of ``base``: same name, op methods from torch's C++ ``ProcessGroup``."""
    cls = _NATIVE_CLASSES.get(base)
    if cls is None:
        members: dict[str, Any] = {name: dist.ProcessGroup.__dict__[name] for name in NATIVE_OPS}
        members["recvAnysource"] = dist.ProcessGroup.__dict__["recv_anysource"]
        members["__module__"] = base.__module__
        members["__qualname__"] = base.__qualname__
        members["__doc__"] = (f"{base.__name__} while on the native data path (see "
                              "torchnext.comms.process_group.native): its ops are torch's C++ ProcessGroup methods.")
        members["_native_twin_of"] = base
        cls = type(base.__name__, (base,), members)
        _NATIVE_CLASSES[base] = cls
    return cls


def python_needed(comm: Communicator, covered: tuple[object, ...] = ()) -> str | None:
    """Why ``comm``'s group must run its ops on the Python path, or None (see the module docstring). ``covered``:
    hooks whose work the group's native path does itself (a staged group: the fault-tolerant quarantine hook)."""
    if comm._check_hooks.snapshot:
        return "check hooks (consistency mode)"
    for fn in (*comm._pre_hooks.snapshot, *comm._post_hooks.snapshot):
        if not mirrored_natively(fn) and fn not in covered:
            return f"hook {getattr(fn, '__qualname__', fn)!r}"
    return None


def enabled() -> bool:
    """``TORCHNEXT_NATIVE_PG=1``."""
    return bool(env_config().native_pg)


def attach(pg: TorchnextProcessGroup) -> _Native | None:
    """Put ``pg`` on the native data path if the flag asks for it and the extension is available (else None: the
    Python path, with one warning from :mod:`torchnext.comms.native` naming what is missing)."""
    if not enabled() or pg._cpu is None or pg._cpu.backend != "gloo":
        return None
    if not _native_ext.status().available:
        return None
    return _Native(pg, pg._cpu)


def attach_generation(pg: TorchnextProcessGroup, comm: Communicator, switch: Any, *,
                      on_failure: Callable[[str, CommError], None], covered: tuple[object, ...] = ()) -> _Native | None:
    """Put a staged group (a :class:`~torchnext.ft.FaultTolerantProcessGroup`) on the native path for ``comm``,
    one generation's Communicator, if the flag asks for it and the extension is available (else None).

    The native backend of the generation runs in staged never-raise mode (see the module docstring);
    ``on_failure(op, exc)`` is told of every failed op (on its waiter's thread, or at :meth:`_Native.sync_failure`).
    ``switch``: the group's switch backend (``_Native.switch`` of its previous native generation), or None for its
    first one: the switch is then made and registered with the group for CPU tensors. ``covered``: as in
    :func:`python_needed`."""
    if not enabled() or comm.backend != "gloo" or comm.device.type != "cpu":
        return None
    if not _native_ext.status().available:
        return None
    return _Native(pg, comm, switch=switch if switch is not None else _NEW_SWITCH, on_failure=on_failure,
                   covered=covered)


_NEW_SWITCH = object()


def new_route() -> Any | None:
    """A new ``Route`` of the native extension (``csrc/ddp.cpp``: a staged group's current native backend, for
    callers in C++), or None when the flag is off or the extension is unavailable."""
    if not enabled() or not _native_ext.status().available:
        return None
    return _native_ext.module().Route()


class _FrSource:
    """The C++ ring as a :class:`~torchnext.comms.flight_recorder.recorder.RecordSource`."""

    def __init__(self, mod: Any, backend: Any) -> None:
        self._mod, self._backend = mod, backend

    def slots(self) -> list[list[Any]]:
        return list(self._mod.fr_slots(self._backend))

    def counters(self) -> list[int]:
        return list(self._mod.fr_counters(self._backend))

    def render(self, group: Any, global_rank: int, thread_names: dict[int, str]) -> list[Any]:
        """The ring's entries as JSON, written in C++ (``RenderingSource``): the group's fields once per
        ``(op, peer)`` here, the rest per entry there."""
        texts = {(op, peer): group_fields(group, op, peer, global_rank) for op, peer in self._mod.fr_keys(self._backend)}
        return list(self._mod.fr_render(self._backend, texts, int(group.generation), [int(r) for r in group.ranks],
                                        thread_names))

    def dicts(self, group: Any, global_rank: int, thread_names: dict[int, str]) -> list[Any]:
        """The ring's entries as the pickle dump's dicts, built in C++ (``BuildingSource``): the group's fields once
        per ``(op, peer)`` here, copied into each entry there."""
        fields = {(op, peer): group_dict(group, op, peer, global_rank) for op, peer in self._mod.fr_keys(self._backend)}
        return list(self._mod.fr_dicts(self._backend, fields, int(group.generation), [int(r) for r in group.ranks],
                                       thread_names))


class _Native:
    """The native backend of one group and the switches between its two paths."""

    def __init__(self, pg: TorchnextProcessGroup, comm: Communicator, *, switch: Any = None,
                 on_failure: Callable[[str, CommError], None] | None = None, covered: tuple[object, ...] = ()) -> None:
        mod = _native_ext.module()
        self._mod = mod
        self._comm = comm
        self._pg_ref = weakref.ref(pg)
        base = type(pg)
        self._base: type[TorchnextProcessGroup] = getattr(base, "_native_twin_of", base)
        self._native_cls = native_class(self._base)
        self._told = False
        self._retired = False
        self._on_failure = on_failure
        self._covered = covered
        rec = comm.flight_recorder
        self._rec = rec
        self._pg_id = rec.pg_id_of(comm) if rec is not None else None
        capacity = rec.capacity if rec is not None and self._pg_id is not None else 0
        ref = self._pg_ref
        base = self._base
        me = weakref.ref(self)  # the backend holds these callbacks: no strong reference back to this object

        def python_path(name: str, *args: Any) -> Any:
            group = ref()
            if group is None:
                raise RuntimeError(f"{name}: the torchnext process group was destroyed")
            native = me()
            if native is not None:
                native.to_python_counters()
            try:
                return getattr(base, name)(group, *args)
            finally:
                if native is not None:
                    native.to_native_counters()

        def make_error(kind: int, op: str, op_id: int, message: str, peer: int) -> CommError:
            native = me()
            if native is None:
                return CommError(message, op=op, op_id=op_id)
            return native.make_error(kind, op, op_id, message, peer)

        self.backend = mod.create(comm.backend_handle.pg, comm.rank, comm.size, comm.timeout, capacity, python_path,
                                  make_error)
        self._undo: list[Callable[[], None]] = []
        self._fr_undo: Callable[[], None] | None = None
        if rec is not None and self._pg_id is not None:
            self._fr_undo = rec.add_source(self._pg_id, _FrSource(mod, self.backend))
            self._undo.append(self._fr_undo)
        self.switch: Any = None
        """A staged group's switch backend (registered with the group once; its current generation's backend)."""
        if switch is None:
            for device in pg._comms:
                pg._register_backend(torch.device(device), dist.ProcessGroup.BackendType.CUSTOM, self.backend)
        else:
            def swallowed(kind: int, op: str, op_id: int, message: str, peer: int) -> None:
                native = me()
                if native is not None:
                    native.swallowed(kind, op, op_id, message, peer)

            mod.set_staged(self.backend, swallowed)
            if switch is _NEW_SWITCH:
                self.switch = mod.create_switch(self.backend)
                pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM, self.switch)
            else:
                self.switch = switch
                mod.switch_to(switch, self.backend)
        # Through weak references: this object holds the Communicator, and its hooks held this object -- a cycle
        # that kept each fault-tolerant generation's Communicator (and this) until a full garbage collection.
        self._undo.append(comm.register_abort_hook(_weakly(self._on_abort)).remove)
        self._undo.append(comm.register_shutdown_hook(_weakly(self._on_shutdown)).remove)
        update = _weakly(self.update)
        self._watches = [hooks.watch(update) for hooks in (comm._pre_hooks, comm._post_hooks, comm._check_hooks)]
        self.on_native = type(pg) is self._native_cls  # a staged group: as its previous generation left it
        if self.on_native:
            self.to_native_counters()  # ops its Communicator ran before (healing) keep their ids
        self.update()

    # ------------------------------------------------------------------------------------------------ switching
    def update(self) -> None:
        """Put the group on the path its hooks call for (called whenever a hook list changes)."""
        pg = self._pg_ref()
        if pg is None or self._retired:
            return
        why = python_needed(self._comm, self._covered)
        if why is None and not self.on_native:
            self.to_native_counters()
            self._mod.set_python_mode(self.backend, False)
            object.__setattr__(pg, "__class__", self._native_cls)
            self.on_native = True
            _LOG.debug("torchnext group %r: native data path", pg._group_name)
        elif why is not None and self.on_native:
            object.__setattr__(pg, "__class__", self._base)
            self._mod.set_python_mode(self.backend, True)
            self.on_native = False
            self.to_python_counters()
            _LOG.debug("torchnext group %r: Python path (%s)", pg._group_name, why)

    def hold_python(self, on: bool) -> bool:
        """While on the native path, send every op to the Python path (``on``) or take them natively again; whether
        the group was on the native path. (A staged group refuses ops after its step's early vote there.)"""
        if not self.on_native or self._retired:
            return False
        self._mod.set_python_mode(self.backend, on)
        return True

    @property
    def comm(self) -> Communicator:
        """The Communicator whose backend this one wraps."""
        return self._comm

    def retire(self) -> None:
        """A staged group's generation was superseded (its Communicator aborted): stop following its hooks (the
        next generation's ``_Native`` decides the path now) and freeze what its ring recorded -- the dumps keep it,
        the recorder no longer holds the backend."""
        self._retired = True
        watches, self._watches = self._watches, []
        for undo in watches:
            undo()
        if self._fr_undo is not None:
            self._fr_undo()

    def to_python_counters(self) -> None:
        """Carry the native op counter, sequence counters and first failure over to the Python side."""
        comm, mod = self._comm, self._mod
        comm._op_counter = max(comm._op_counter, int(mod.op_counter(self.backend)))
        if self._rec is not None and self._pg_id is not None:
            c = self._rec._groups[self._pg_id].counters
            for i, v in enumerate(mod.fr_counters(self.backend)):
                if v > c[i]:
                    c[i] = v
        self.sync_failure()

    def to_native_counters(self) -> None:
        """Carry the Python side's op counter and sequence counters over to the native backend."""
        comm, mod = self._comm, self._mod
        mod.set_op_counter(self.backend, max(comm._op_counter, int(mod.op_counter(self.backend))))
        if self._rec is not None and self._pg_id is not None:
            py_c = self._rec._groups[self._pg_id].counters
            mod.fr_set_counters(self.backend, [max(a, b) for a, b in zip(py_c, mod.fr_counters(self.backend),
                                                                         strict=True)])

    # ------------------------------------------------------------------------------------------------- failures
    def sync_failure(self) -> None:
        """Tell the communicator about the native path's first failure, once (a failure nobody waited on: a future
        completed with invalid outputs, DDP's way)."""
        if self._told:
            return
        first = self._mod.first_failure(self.backend)
        if first is None:
            return
        self._told = True
        kind, op, op_id, message, peer = first
        if kind != _KIND_ABORT:
            exc = self.make_error(kind, op, op_id, message, peer)
            if self._on_failure is not None:
                self._on_failure(op, exc)

    def swallowed(self, kind: int, op: str, op_id: int, message: str, peer: int) -> None:
        """A staged backend's op failed and its waiter was not raised to (called by the C++ side, on the waiting
        thread): the failure as :meth:`make_error` builds it goes to ``on_failure``."""
        exc = self.make_error(kind, op, op_id, message, peer)
        if self._on_failure is not None:
            self._on_failure(op, exc)

    def make_error(self, kind: int, op: str, op_id: int, message: str, peer: int) -> CommError:
        """The exception a failed native op raises (called by the C++ side under the GIL): the Python path's class
        for the failure; a timeout or backend failure also errors the communicator and dumps the Flight Recorder."""
        comm = self._comm
        ctx = comm._error_context(op, op_id)
        exc: CommError
        if kind == _KIND_ABORT:
            return CommAborted(message, **ctx)
        if kind == _KIND_TIMEOUT:
            exc = CommTimeout(message, **ctx)
        else:
            cls = classify_backend_error(RuntimeError(message))
            exc = (PeerFailure(message, peer=peer if peer >= 0 else None, **ctx) if cls is PeerFailure
                   else cls(message, **ctx))
        first = comm.errored() is None
        exc = comm._fail_from_outside(exc)
        self._told = True
        if first and self._rec is not None:
            if isinstance(exc, CommTimeout):
                self._rec._auto_dump_once("timeout", f"{op} op_id={op_id} on {comm.name!r}")
            else:
                dump_kind = "peer_failure" if isinstance(exc, PeerFailure) else "error"
                self._rec._auto_dump_once(dump_kind, f"{op} op_id={op_id}: {exc!r}")
        return exc

    def _on_abort(self, args: AbortHookArgs) -> None:
        """Finish every native op in flight as ABORTED; their inner Gloo Works, which Gloo may still run (it cannot
        cancel an op), go to the communicator's grave with their deadlines -- the reaper releases the backend, and
        the interpreter's exit drains, only once they ended (as for the Python path's orphans)."""
        running = self._mod.abort(self.backend, args.reason or "")
        if running is not None:  # (RunningWorks, seconds to the latest deadline)
            works, left = running
            self._comm._left_issue([works], time.perf_counter() + left)

    def _on_shutdown(self, comm: Communicator) -> None:
        self._mod.release(self.backend)
        for undo in (*self._undo, *self._watches):
            undo()
        self._undo, self._watches = [], []

    def set_timeout(self, timeout: timedelta) -> None:
        self._mod.set_timeout(self.backend, timeout)
