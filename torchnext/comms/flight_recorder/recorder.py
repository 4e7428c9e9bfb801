"""Flight Recorder: a ring buffer of the collectives a rank issued, dumped to one self-describing file per rank.

Semantics (a tiny reference)::

    fr = FlightRecorder(capacity=2000, rank=r, world_size=n)
    pg = fr.add_group("world", ranks=[0, 1, ..., n - 1], backend="gloo")
    rid = fr.record(pg, "all_reduce", inputs=[t], outputs=[t])   # entry: state "started", collective_seq_id += 1
    fr.complete(rid)                                             # state "completed", completion time, duration
    fr.entries()        # the last `capacity` entries, oldest first, as dicts (PyTorch's FR fields + ours)
    fr.dump("/dumps")   # /dumps/torchnext_fr_rank_<r>.json, written atomically

The recorder is fed by the Communicator's hooks (:meth:`FlightRecorder.attach`); :meth:`record` /
:meth:`complete` are the whole recording API, so any other source (tests, custom back ends) can feed it too.

Cost: recording keeps raw, cheap objects in a preallocated ring (``torch.Size`` shapes, dtypes, integer times, code
objects for frames) and formats them only when dumped. One ``time.time_ns()`` call per event; no locks on the hot path
(record ids come from an atomic counter, every record owns its slot). Capacity 0 disables recording.

States: ``scheduled`` -> ``started`` -> ``completed``, or ``error`` / ``timed_out`` / ``aborted``. On CPU back ends an
op starts when it is issued, so :meth:`record` writes ``started`` by default (with the start time = creation time).

Thread-safety: :meth:`record`, :meth:`complete` and :meth:`dump` may be called from any thread.
"""

from __future__ import annotations

import itertools
import json
import os
import pickle
import platform
import socket
import sys
import threading
import time
from _thread import get_ident
from collections.abc import Callable, Sequence
from enum import Enum
from pathlib import Path
from types import CodeType
from typing import Any, Protocol

import torch

from torchnext._config import env_config
from torchnext.comms.flight_recorder._attach import Attachment, install_excepthook, install_signal_handler
from torchnext.comms.flight_recorder._attach import AutoDumper as _AutoDumper
from torchnext.comms.flight_recorder.entries import (
    _CSEQ,
    _ERROR,
    _FINAL_STATES,
    _GEN,
    _ISP2P,
    _PG,
    _PSEQ,
    _RID,
    _STATE,
    _TCREATED,
    _TDONE,
    _TSTARTED,
    P2P_OPS,
    Built,
    Rendered,
    entries_json,
    format_entries,
    merge_built,
)
from torchnext.comms.flight_recorder.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    FR_SCHEMA_VERSION,
    atomic_write,
    dump_file_name,
    thread_stacks,
)
from torchnext.comms.flight_recorder.groups import _G_CDONE, _G_CSTART, _G_PDONE, _G_PSTART, Group, unique_key

__all__ = ["EntryState", "FlightRecorder", "FlightRecorderError", "P2P_OPS"]


class RecordSource(Protocol):
    """Records made outside a recorder for one of its groups (the native process-group data path's C++ ring: see
    :meth:`FlightRecorder.add_source`)."""

    def slots(self) -> list[list[Any]]:
        """The live records, oldest first, in the recorder's slot layout (``pg_id``/``generation`` may be None)."""
        ...

    def counters(self) -> list[int]:
        """The group's 8 sequence counters as the source sees them (see ``groups.py``)."""
        ...


class BuildingSource(RecordSource, Protocol):
    """A source that also builds its entries' pickle-dump dicts itself (the native ring, in C++)."""

    def dicts(self, group: Group, global_rank: int, thread_names: dict[int, str]) -> list[Built]:
        """The live records as :data:`~torchnext.comms.flight_recorder.entries.Built`, oldest first."""
        ...


class RenderingSource(RecordSource, Protocol):
    """A source that also writes its entries' JSON itself (the native ring, in C++): the JSON dump's fast path."""

    def render(self, group: Group, global_rank: int, thread_names: dict[int, str]) -> list[Rendered]:
        """The live records as :data:`~torchnext.comms.flight_recorder.entries.Rendered`, oldest first."""
        ...


class _Frozen:
    """What a removed source had recorded (its dumps keep the entries)."""

    def __init__(self, slots: list[list[Any]], counters: list[int]) -> None:
        self._slots, self._counters = slots, counters

    def slots(self) -> list[list[Any]]:
        return [list(s) for s in self._slots]

    def counters(self) -> list[int]:
        return list(self._counters)


class FlightRecorderError(ValueError):
    """Bad use of the Flight Recorder (unknown group, bad capacity, bad dump format, ...)."""


class EntryState(str, Enum):
    """Lifecycle of one recorded op."""

    SCHEDULED = "scheduled"
    STARTED = "started"
    COMPLETED = "completed"
    ERROR = "error"
    TIMED_OUT = "timed_out"
    ABORTED = "aborted"


_DUMP_FORMATS = ("json", "pickle")
MAX_EVENTS = 1000
"""Communicator events (aborts) a recorder keeps for its dumps."""

def _shapes(tensors: Sequence[Any]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    return tuple(t.shape for t in tensors), tuple(t.dtype for t in tensors)


class FlightRecorder:
    """Ring buffer of collective records for one rank (see the module docstring for semantics).

    Args:
        capacity: ring size; ``None`` reads ``TORCHNEXT_FR_BUFFER_SIZE`` (default 2000); 0 disables recording.
        rank: this process's global rank (names the dump file).
        world_size: global world size (written in the dump).
        record_frames: capture the caller's Python stack (capped at ``max_frames``) on every record.
        max_frames: depth cap for ``record_frames``.
        dump_dir: folder for automatic dumps; ``None`` reads ``TORCHNEXT_FR_DUMP_DIR`` (unset: no automatic dumps).
        auto_dump_formats: formats written by automatic dumps.
        generation: communicator generation stamped on new groups and entries (settable later).
    """

    def __init__(
        self,
        capacity: int | None = None,
        *,
        rank: int = 0,
        world_size: int = 1,
        record_frames: bool = False,
        max_frames: int = 16,
        dump_dir: str | os.PathLike[str] | None = None,
        auto_dump_formats: Sequence[str] = ("json",),
        generation: int = 0,
    ) -> None:
        cfg = env_config()
        if capacity is None:
            capacity = cfg.fr_buffer_size
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0:
            raise FlightRecorderError(f"Flight Recorder capacity must be an int >= 0, got {capacity!r}")
        if max_frames < 1:
            raise FlightRecorderError(f"max_frames must be >= 1, got {max_frames}")
        for fmt in auto_dump_formats:
            if fmt not in _DUMP_FORMATS:
                raise FlightRecorderError(f"unknown dump format {fmt!r}; expected one of {_DUMP_FORMATS}")
        self.capacity = capacity
        self.rank = rank
        self.world_size = world_size
        self.record_frames = record_frames
        self.max_frames = max_frames
        if dump_dir is None and cfg.fr_dump_dir is not None:
            dump_dir = cfg.fr_dump_dir
        self.dump_dir: Path | None = Path(dump_dir) if dump_dir is not None else None
        self.auto_dump_formats = tuple(auto_dump_formats)
        self.generation = generation
        self._ring: list[list[Any] | None] = [None] * capacity
        self._ids = itertools.count()
        self._next_id = 0  # records handed out (kept beside the counter, read by dump)
        self._groups: list[Group] = []
        self._group_keys: dict[str, Group] = {}
        # Group registration and dumps only, never on the record path. Re-entrant: a signal handler may dump while
        # the interrupted main thread is inside a dump.
        self._lock = threading.RLock()
        self._skip_prefix = os.path.dirname(os.path.abspath(__file__))
        self._attachments: list[Any] = []
        self._undo: list[Callable[[], None]] = []
        self._auto = _AutoDumper()
        self.last_dump_paths: list[Path] = []
        self.dump_errors: list[str] = []
        self._events: list[dict[str, Any]] = []
        self._sources: list[tuple[int, RecordSource]] = []

    # ------------------------------------------------------------------ attaching
    @classmethod
    def attach(
        cls,
        comm: Any,
        capacity: int | None = 2000,
        *,
        record_frames: bool = False,
        max_frames: int = 16,
        dump_dir: str | os.PathLike[str] | None = None,
        auto_dump_formats: Sequence[str] = ("json",),
        generation: int = 0,
        dump_on_exception: bool = False,
        dump_on_signal: int | None = None,
    ) -> FlightRecorder:
        """A new recorder fed by ``comm``'s hooks (and those of the children ``comm.split`` creates later).

        ``capacity=None`` reads ``TORCHNEXT_FR_BUFFER_SIZE``; capacity 0 returns a disabled recorder and registers
        no hooks (zero cost). Automatic dumps (timeout, peer failure, other op errors, ``abort()``) go to
        ``dump_dir`` (default ``TORCHNEXT_FR_DUMP_DIR``). ``dump_on_exception`` dumps on an unhandled exception;
        ``dump_on_signal=signal.SIGUSR1`` dumps when that signal arrives (main thread only).
        """
        ranks = list(comm.ranks)
        rec = cls(
            capacity,
            rank=ranks[comm.rank],
            world_size=len(ranks) if ranks == list(range(len(ranks))) else max(ranks) + 1,
            record_frames=record_frames,
            max_frames=max_frames,
            dump_dir=dump_dir,
            auto_dump_formats=auto_dump_formats,
            generation=generation,
        )
        rec.add_communicator(comm)
        if dump_on_exception:
            rec.enable_dump_on_exception()
        if dump_on_signal is not None:
            rec.enable_dump_on_signal(dump_on_signal)
        return rec

    def add_communicator(self, comm: Any, *, generation: int | None = None) -> int:
        """Record ``comm`` too (a split child, or a communicator rebuilt for a new ``generation``); returns its
        pg id (-1 when the recorder is disabled). Its future split children are attached automatically (a split
        hook on ``comm``); ``comm.flight_recorder`` is this recorder from now on."""
        comm.extensions["flight_recorder"] = self
        split = comm.register_split_hook(self.add_communicator)
        if not self.enabled:  # no op hooks: a disabled recorder costs nothing
            with self._lock:
                self._undo.append(split.remove)
            return -1
        att = Attachment(self, comm, generation, split)
        with self._lock:
            self._attachments.append(att)
        return att.pg_id

    def pg_id_of(self, comm: Any) -> int | None:
        """The pg id under which ``comm`` is recorded, or None when it is not attached (or recording is disabled)."""
        with self._lock:
            return next((a.pg_id for a in self._attachments if a.comm is comm), None)

    def detach(self) -> None:
        """Stop recording: remove every hook and handler this recorder installed (entries stay readable)."""
        with self._lock:
            attachments, self._attachments = self._attachments, []
            undo, self._undo = self._undo, []
        for att in attachments:
            att.detach()
            if att.comm.extensions.get("flight_recorder") is self:
                del att.comm.extensions["flight_recorder"]
        for fn in reversed(undo):
            fn()

    def enable_dump_on_exception(self) -> None:
        """Dump (to :attr:`dump_dir`) when an exception reaches ``sys.excepthook`` (an unhandled exception)."""
        self._require_dump_dir("dump_on_exception")
        self._undo.append(install_excepthook(self))

    def enable_dump_on_signal(self, signum: int) -> None:
        """Dump (to :attr:`dump_dir`) when ``signum`` (e.g. ``signal.SIGUSR1``) arrives. Main thread only."""
        self._require_dump_dir("dump_on_signal")
        self._undo.append(install_signal_handler(self, signum))

    def _internal_error(self, where: str, exc: Exception) -> None:
        """A recorder bug must not break communication: report it once per kind and keep going."""
        msg = f"torchnext Flight Recorder: rank {self.rank}: {where} failed: {exc!r}"
        if msg not in self.dump_errors:
            self.dump_errors.append(msg)
            print(msg, file=sys.stderr)

    def _require_dump_dir(self, what: str) -> None:
        if self.dump_dir is None:
            raise FlightRecorderError(f"{what} needs a dump folder: pass dump_dir= or set TORCHNEXT_FR_DUMP_DIR")

    def _auto_dump_once(self, kind: str, detail: str) -> None:
        if self.dump_dir is not None and self._auto.should_dump(kind):
            self.auto_dump(f"{kind}: {detail}")

    # ------------------------------------------------------------------ groups
    @property
    def enabled(self) -> bool:
        """False when the capacity is 0 (nothing is recorded)."""
        return self.capacity > 0

    def add_group(
        self,
        name: str,
        *,
        ranks: Sequence[int],
        rank: int | None = None,
        desc: str = "",
        backend: str = "gloo",
        timeout_ms: int | None = None,
    ) -> int:
        """Register a communicator and return its ``pg_id`` (the handle :meth:`record` takes).

        ``ranks`` are the members' global ranks (in group-rank order); ``rank`` is this process's rank in the group
        (default: the index of :attr:`rank` in ``ranks``). Groups are keyed by name, plus ``@g<generation>`` when
        the generation is not 0, so a rebuilt communicator keeps a distinct key in ``pg_config``.
        """
        ranks = [int(r) for r in ranks]
        if rank is None:
            if self.rank not in ranks:
                raise FlightRecorderError(
                    f"rank {self.rank} is not a member of group {name!r} (ranks {ranks}); pass rank= explicitly"
                )
            rank = ranks.index(self.rank)
        key = name if self.generation == 0 else f"{name}@g{self.generation}"
        with self._lock:
            key = unique_key(self._group_keys, key, ranks, self.generation)
            group = Group(pg_id=len(self._groups), key=key, name=name, desc=desc or name, ranks=ranks, rank=rank,
                          backend=backend, generation=self.generation, timeout_ms=timeout_ms,
                          time_added_ns=time.time_ns())
            self._groups.append(group)
            self._group_keys[key] = group
        return group.pg_id

    def note_event(self, kind: str, pg_id: int, *, reason: str | None = None, in_flight: Sequence[int] = (),
                   t_ns: int | None = None) -> None:
        """Keep a communicator event for the dump's ``events`` (the last :data:`MAX_EVENTS`): ``"abort"`` with
        its reason and the op_ids in flight (the attach hooks note every ``abort()``)."""
        group = self._group(pg_id)
        event = {"kind": str(kind), "pg": group.key, "generation": group.generation,
                 "time_ns": time.time_ns() if t_ns is None else int(t_ns), "reason": reason,
                 "in_flight": [int(i) for i in in_flight]}
        with self._lock:
            self._events.append(event)
            del self._events[:-MAX_EVENTS]

    @property
    def events(self) -> list[dict[str, Any]]:
        """The communicator events noted so far (oldest first)."""
        return [dict(e) for e in self._events]

    def group_key(self, pg_id: int) -> str:
        """The ``pg_config`` key of group ``pg_id``."""
        return self._group(pg_id).key

    def _group(self, pg_id: int) -> Group:
        try:
            return self._groups[pg_id]
        except (IndexError, TypeError):
            raise FlightRecorderError(f"unknown Flight Recorder group id {pg_id!r}") from None

    # ------------------------------------------------------------------ recording (hot path)
    def record(
        self,
        pg_id: int,
        op: str,
        *,
        inputs: Sequence[Any] = (),
        outputs: Sequence[Any] = (),
        op_id: int = -1,
        peer: int | None = None,
        tag: int = 0,
        timeout_ms: int | None = None,
        async_op: bool = False,
        state: str = "started",
        t_ns: int | None = None,
        root: int | None = None,
        reduce_op: str | None = None,
    ) -> int:
        """Record that this rank entered ``op`` on group ``pg_id``; return the record id (-1 when disabled).

        ``inputs`` / ``outputs`` are tensors (only their shapes and dtypes are kept); ``peer`` is the group rank of
        the p2p partner; ``root`` the group rank of a rooted collective's root, ``reduce_op`` a reduction's op
        (``"sum"``, ...); ``t_ns`` overrides the wall-clock time (tests, replays).
        """
        if state not in ("started", "scheduled"):
            raise FlightRecorderError(f"a new record is 'started' or 'scheduled', not {state!r}")
        if not self.capacity:
            return -1
        return self._record(
            pg_id, op, inputs, outputs, op_id, peer, tag, timeout_ms, async_op, state == "started",
            time.time_ns() if t_ns is None else t_ns, root, reduce_op,
        )

    def _record(
        self,
        pg_id: int,
        op: str,
        inputs: Sequence[Any],
        outputs: Sequence[Any],
        op_id: int,
        peer: int | None,
        tag: int,
        timeout_ms: int | None,
        async_op: bool,
        started: bool,
        now: int,
        root: int | None,
        reduce_op: str | None,
    ) -> int:
        """The hot path (positional arguments; the hooks call it directly)."""
        group = self._groups[pg_id]
        c = group.counters
        if op in P2P_OPS:
            is_p2p = True
            c[1] += 1  # _G_PSEQ
            cseq = c[0]
            pseq = c[1]
            c[5] = pseq  # _G_PENQ
            if started:
                c[6] = pseq  # _G_PSTART
        else:
            is_p2p = False
            c[0] += 1  # _G_CSEQ
            cseq = c[0]
            pseq = c[1]
            c[2] = cseq  # _G_CENQ
            if started:
                c[3] = cseq  # _G_CSTART
        if len(inputs) == 1:
            t = inputs[0]
            in_shapes: tuple[Any, ...] = (t.shape,)
            in_dtypes: tuple[Any, ...] = (t.dtype,)
        else:
            in_shapes = tuple([t.shape for t in inputs])
            in_dtypes = tuple([t.dtype for t in inputs])
        if len(outputs) == 1 and len(inputs) == 1 and outputs[0] is inputs[0]:
            out_shapes, out_dtypes = in_shapes, in_dtypes
        else:
            out_shapes = tuple([t.shape for t in outputs])
            out_dtypes = tuple([t.dtype for t in outputs])
        rid = next(self._ids)
        self._next_id = rid + 1
        self._ring[rid % self.capacity] = [
            rid,
            pg_id,
            cseq,
            pseq,
            op_id,
            op,
            is_p2p,
            peer,
            tag,
            in_shapes,
            in_dtypes,
            out_shapes,
            out_dtypes,
            group.timeout_ms if timeout_ms is None else timeout_ms,
            now,
            now if started else None,
            None,
            "started" if started else "scheduled",
            self._frames() if self.record_frames else None,
            get_ident(),
            self.generation,
            async_op,
            None,
            root,
            reduce_op,
        ]
        return rid

    def mark_started(self, record_id: int, *, t_ns: int | None = None) -> None:
        """Move a ``scheduled`` record to ``started``."""
        e = self._slot(record_id)
        if e is None or e[_STATE] != "scheduled":
            return
        e[_TSTARTED] = time.time_ns() if t_ns is None else t_ns
        e[_STATE] = "started"
        c = self._groups[e[_PG]].counters
        if e[_ISP2P]:
            c[_G_PSTART] = max(c[_G_PSTART], e[_PSEQ])
        else:
            c[_G_CSTART] = max(c[_G_CSTART], e[_CSEQ])

    def complete(
        self, record_id: int, state: str = "completed", *, error: str | None = None, t_ns: int | None = None
    ) -> None:
        """Finish record ``record_id`` with ``state`` (completed, error, timed_out, aborted).

        A record already overwritten by the ring, or already finished, is left alone.
        """
        if record_id < 0 or not self.capacity:
            return
        e = self._ring[record_id % self.capacity]
        if e is None or e[0] != record_id or e[_STATE] in _FINAL_STATES:
            return
        now = time.time_ns() if t_ns is None else t_ns
        if e[_TSTARTED] is None:
            e[_TSTARTED] = e[_TCREATED]
        e[_TDONE] = now
        e[_STATE] = state
        if error is not None:
            e[_ERROR] = error
        if state == "completed":
            c = self._groups[e[_PG]].counters
            if e[_ISP2P]:
                if e[_PSEQ] > c[_G_PDONE]:
                    c[_G_PDONE] = e[_PSEQ]
            elif e[_CSEQ] > c[_G_CDONE]:
                c[_G_CDONE] = e[_CSEQ]

    def _slot(self, record_id: int) -> list[Any] | None:
        if record_id < 0 or not self.capacity:
            return None
        e = self._ring[record_id % self.capacity]
        if e is None or e[_RID] != record_id:
            return None
        return e

    def _frames(self) -> tuple[tuple[CodeType, int], ...]:
        """The caller's stack, innermost first, without the recorder's and the Communicator's own frames."""
        f: Any = sys._getframe(1)
        skip = self._skip_prefix
        while f is not None and f.f_code.co_filename.startswith(skip):
            f = f.f_back
        out: list[tuple[CodeType, int]] = []
        cap = self.max_frames
        while f is not None and len(out) < cap:
            out.append((f.f_code, f.f_lineno))
            f = f.f_back
        return tuple(out)

    # ------------------------------------------------------------------ reading
    @property
    def recorded(self) -> int:
        """Records made since creation (including those the ring dropped)."""
        return self._next_id

    @property
    def dropped(self) -> int:
        """Records overwritten by the ring."""
        return max(0, self._next_id - self.capacity) if self.capacity else 0

    def add_source(self, pg_id: int, source: RecordSource) -> Callable[[], None]:
        """Merge what ``source`` records for group ``pg_id`` into :meth:`entries`, :meth:`snapshot`, :meth:`dump` and
        :meth:`pg_status` (the native process-group data path records in C++; its entries then appear in the dumps
        unchanged in format). Returns an undo that keeps a copy of what the source had recorded.

        Merged entries are ordered by creation time and numbered anew (``record_id`` 0, 1, ...) in the output.
        The removed sources' copies keep at most ``capacity`` entries together, the newest (a fault-tolerant group
        adds and removes one source per generation: the history stays bounded as the ring is)."""
        if not 0 <= pg_id < len(self._groups):
            raise FlightRecorderError(f"add_source: no group with pg_id {pg_id} (have {len(self._groups)})")
        entry = (pg_id, source)
        with self._lock:
            self._sources.append(entry)

        def undo() -> None:
            frozen = _Frozen(source.slots(), source.counters())
            with self._lock:
                if entry in self._sources:
                    idx = self._sources.index(entry)
                    self._sources[idx] = (pg_id, frozen)
                    self._trim_frozen()

        return undo

    def _trim_frozen(self) -> None:
        """Drop the oldest entries of removed sources beyond ``capacity`` in all (their counters stay)."""
        frozen = [src for _, src in self._sources if isinstance(src, _Frozen)]
        excess = sum(len(f._slots) for f in frozen) - self.capacity
        for f in frozen:  # oldest removed first; each one's slots oldest first
            if excess <= 0:
                break
            cut = min(excess, len(f._slots))
            f._slots = f._slots[cut:]
            excess -= cut

    def _source_counters(self) -> None:
        """Merge the sources' sequence counters into their groups' (each counter only grows: the larger is right)."""
        for pg_id, src in list(self._sources):
            c = self._groups[pg_id].counters
            for i, v in enumerate(src.counters()[:len(c)]):
                if v > c[i]:
                    c[i] = v

    def _live(self) -> list[list[Any]]:
        if not self.capacity:
            return []
        ring = list(self._ring)  # snapshot; slots keep mutating (states), which is fine
        live = [e for e in ring if e is not None]
        live.sort(key=lambda e: e[_RID])
        if not self._sources:
            return live
        extra: list[list[Any]] = []
        for pg_id, src in list(self._sources):
            extra.extend(self._source_slots(pg_id, src))
        if not extra:
            return live
        merged = sorted([list(e) for e in live] + extra, key=lambda e: (e[_TCREATED], e[_RID]))
        for i, e in enumerate(merged):
            e[_RID] = i
        return merged

    def _source_slots(self, pg_id: int, src: RecordSource) -> list[list[Any]]:
        """``src``'s slots with their group and (if the source left it out) generation filled in."""
        slots = src.slots()
        for slot in slots:
            slot[_PG] = pg_id
            if slot[_GEN] is None:
                slot[_GEN] = self._groups[pg_id].generation
        return slots

    def _entries_compat(self) -> list[dict[str, Any]]:
        """The pickle dump's ``entries``: ``format_entries(self._live(), ..., torch_compat=True)``, with the entries
        of building sources (:class:`BuildingSource`: the native ring, dicts made in C++) built by the source."""
        building = [(pg_id, src) for pg_id, src in self._sources if hasattr(src, "dicts")]
        if not self.capacity or not building:
            return format_entries(self._live(), self._groups, self.rank, torch_compat=True)
        live = [e for e in list(self._ring) if e is not None]
        for pg_id, src in self._sources:
            if not hasattr(src, "dicts"):
                live.extend(self._source_slots(pg_id, src))
        thread_names = {t.ident: t.name for t in threading.enumerate() if t.ident is not None}
        built: list[Built] = []
        for pg_id, src in building:
            built.extend(src.dicts(self._groups[pg_id], self.rank, thread_names))
        if not built:  # nothing built: _live() numbers as entries() does
            return format_entries(self._live(), self._groups, self.rank, torch_compat=True)
        return merge_built(live, self._groups, self.rank, built)

    def _entries_json(self) -> str:
        """The dump's ``entries`` as JSON text: what :meth:`entries` returns, with the entries of rendering sources
        (:class:`RenderingSource`) written by the source itself (the native ring: in C++, no slot lists)."""
        if not self.capacity:
            return "[]"
        rendering = [(pg_id, src) for pg_id, src in self._sources if hasattr(src, "render")]
        if not rendering:
            return entries_json(self._live(), self._groups, self.rank)
        others = [(pg_id, src) for pg_id, src in self._sources if not hasattr(src, "render")]
        live = [e for e in list(self._ring) if e is not None]
        for pg_id, src in others:
            live.extend(self._source_slots(pg_id, src))
        thread_names = {t.ident: t.name for t in threading.enumerate() if t.ident is not None}
        rendered: list[Rendered] = []
        for pg_id, src in rendering:
            rendered.extend(src.render(self._groups[pg_id], self.rank, thread_names))
        if not rendered:  # nothing to merge from the renderers: _live() numbers as entries() does
            return entries_json(self._live(), self._groups, self.rank)
        return entries_json(live, self._groups, self.rank, rendered)

    def entries(self) -> list[dict[str, Any]]:
        """The live records, oldest first, in the dump's entry schema (see :mod:`torchnext.comms.flight_recorder.format`)."""
        return format_entries(self._live(), self._groups, self.rank, torch_compat=False)

    def pg_config(self) -> dict[str, dict[str, Any]]:
        """Every registered communicator: key -> name, desc, ranks (PyTorch's string form and a list), ..."""
        return {g.key: g.config() for g in self._groups}

    def pg_status(self) -> dict[str, dict[str, int]]:
        """Per communicator: the last enqueued / started / completed collective and p2p sequence numbers (-1: none)."""
        if self._sources:
            self._source_counters()
        return {g.key: g.status() for g in self._groups}

    # ------------------------------------------------------------------ dumping
    def snapshot(self, *, reason: str = "manual", as_tuple: bool = False) -> dict[str, Any]:
        """The whole dump as a dict (what :meth:`dump` writes)."""
        snap = self._header(reason)
        snap["entries"] = (self._entries_compat() if as_tuple
                           else format_entries(self._live(), self._groups, self.rank, torch_compat=False))
        return snap

    def _header(self, reason: str) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "version": FR_SCHEMA_VERSION,
            "rank": self.rank,
            "world_size": self.world_size,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "versions": {
                "torchnext": _torchnext_version(),
                "torch": str(torch.__version__),
                "python": platform.python_version(),
            },
            "generation": self.generation,
            "capacity": self.capacity,
            "recorded": self._next_id,
            "dropped": self.dropped,
            "dump_reason": reason,
            "time_dumped_ns": time.time_ns(),
            "comm_lib_version": "",
            "pg_config": self.pg_config(),
            "pg_status": self.pg_status(),
            "stacks": thread_stacks(self.max_frames * 4),
            "events": self.events,
        }

    def dump(
        self, path_or_dir: str | os.PathLike[str], *, format: str = "json", reason: str = "manual", fsync: bool = False
    ) -> Path:
        """Write this rank's dump atomically and return its path.

        ``path_or_dir``: an existing folder, or a path ending in a separator, gets the standard file name
        (``torchnext_fr_rank_<rank>.json`` / ``torchnext_fr_trace_rank_<rank>``); anything else is the file path.
        ``format="pickle"`` writes the dict torchfrtrace (``python -m torch.distributed.flight_recorder.fr_trace``)
        reads; JSON is the default and the one to share (reading it runs no code).
        """
        if format not in _DUMP_FORMATS:
            raise FlightRecorderError(f"unknown dump format {format!r}; expected one of {_DUMP_FORMATS}")
        raw = os.fspath(path_or_dir)
        target = Path(raw)
        if target.is_dir() or raw.endswith(("/", os.sep)):
            target = target / dump_file_name(self.rank, format)
        with self._lock:
            if format == "json":
                header = json.dumps(self._header(reason), separators=(",", ":"), default=str)
                data = (header[:-1] + ',"entries":' + self._entries_json() + "}").encode()
            else:
                data = pickle.dumps(self.snapshot(reason=reason, as_tuple=True), protocol=4)
            atomic_write(target, data, fsync=fsync)
        return target

    def auto_dump(self, reason: str) -> list[Path]:
        """Dump to :attr:`dump_dir` in :attr:`auto_dump_formats` (no-op without a dump folder). Never raises:
        failures are kept in :attr:`dump_errors` and reported on stderr, since this runs inside hooks and handlers."""
        if self.dump_dir is None:
            return []
        paths = []
        for fmt in self.auto_dump_formats:
            try:
                paths.append(self.dump(str(self.dump_dir) + os.sep, format=fmt, reason=reason))
            except Exception as exc:  # a failed dump must not turn a diagnosable failure into a crash
                msg = f"torchnext Flight Recorder: rank {self.rank}: {fmt} dump ({reason}) failed: {exc!r}"
                self.dump_errors.append(msg)
                print(msg, file=sys.stderr)
        self.last_dump_paths = paths
        return paths


def _torchnext_version() -> str:
    from torchnext._version import __version__

    return __version__


class CommunicatorOption:
    """``Communicator(..., flight_recorder=value)``: True attaches a new recorder (``TORCHNEXT_FR_BUFFER_SIZE``
    entries, default 2000; 0 disables), a :class:`FlightRecorder` records the communicator too, False (the core
    never calls us then) nothing. Registered with :func:`torchnext.comms.extension.register_option`."""

    def check(self, value: object) -> None:
        if value is not True and not isinstance(value, FlightRecorder):
            raise TypeError(f"flight_recorder must be a bool or a FlightRecorder, got {value!r}")

    def attach(self, comm: Any, value: bool | FlightRecorder) -> None:
        if value is True:
            FlightRecorder.attach(comm, capacity=None)
        elif isinstance(value, FlightRecorder):
            value.add_communicator(comm)
