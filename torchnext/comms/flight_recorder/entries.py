"""Ring slots of the Flight Recorder and their formatting into dump entries.

A slot is a list (the cheapest mutable record in CPython) laid out by the ``_NAME`` indices below; it holds raw
objects (``torch.Size``, dtypes, integer times, code objects). :func:`format_entries` is the reference formatter
(dicts, used by ``entries()`` and the pickle dump); :func:`entries_json` is the fast path for JSON dumps: it writes
the same entries as JSON text from per-dump caches of every repeated piece (shapes, dtypes, frames, group fields).
``json.loads(entries_json(...)) == format_entries(...)`` is tested on random slots.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from types import CodeType
from typing import Any, Protocol

from torchnext.comms.flight_recorder.format import dtype_name

__all__ = ["P2P_OPS", "WINDOW_OPS", "Built", "Rendered", "entries_json", "format_entries", "group_dict",
           "group_fields", "merge_built"]

WINDOW_OPS = frozenset(
    {"window.put", "window.get", "window.get_rows", "window.accumulate", "window.signal", "window.wait_signal"}
)
"""One-sided RMA window ops (recorded with their target as ``peer``; never in torchfrtrace-compatible dumps)."""

P2P_OPS = frozenset({"send", "recv", "isend", "irecv", "batch_p2p"}) | WINDOW_OPS
"""Ops numbered by ``p2p_seq_id`` (point-to-point or one-sided: not every member takes part)."""
_FINAL_STATES = frozenset({"completed", "error", "timed_out", "aborted"})

(
    _RID,
    _PG,
    _CSEQ,
    _PSEQ,
    _OPID,
    _OP,
    _ISP2P,
    _PEER,
    _TAG,
    _INSHAPES,
    _INDTYPES,
    _OUTSHAPES,
    _OUTDTYPES,
    _TIMEOUT,
    _TCREATED,
    _TSTARTED,
    _TDONE,
    _STATE,
    _FRAMES,
    _TID,
    _GEN,
    _ASYNC,
    _ERROR,
    _ROOT,
    _ROP,
) = range(25)


class GroupLike(Protocol):
    pg_id: int
    key: str
    desc: str
    backend: str
    rank: int
    ranks: list[int]


def _profiling_name(g: GroupLike, op: str, peer: int | None, torch_compat: bool) -> str:
    if op in ("send", "isend") and peer is not None:
        return f"{g.backend}:send {g.rank}->{peer}"
    if op in ("recv", "irecv") and peer is not None:
        return f"{g.backend}:recv {g.rank}<-{peer}"
    if torch_compat and op == "batch_p2p":
        return f"{g.backend}:coalesced"  # the name torchfrtrace's parser knows for a group of p2p ops
    return f"{g.backend}:{op}"


def _frames(raw: tuple[tuple[CodeType, int], ...] | None) -> list[dict[str, Any]]:
    return [{"name": c.co_name, "filename": c.co_filename, "line": ln} for c, ln in raw or ()]


def _sizes(shapes: tuple[Any, ...]) -> list[list[int]]:
    return [list(x) for x in shapes]


def _dtypes(dtypes: tuple[Any, ...]) -> list[str]:
    return [dtype_name(x) for x in dtypes]


def format_entries(
    live: list[list[Any]], groups: list[Any], global_rank: int, *, torch_compat: bool
) -> list[dict[str, Any]]:
    """Slots -> entry dicts (the reference formatter). ``torch_compat``: ``process_group`` as a tuple and
    ``batch_p2p`` named ``coalesced``, as PyTorch's pickled dumps and torchfrtrace expect; it also shares equal
    size/dtype/frame lists between entries (pickle then writes each once)."""
    thread_names = {t.ident: t.name for t in threading.enumerate()}
    out: list[dict[str, Any]] = []
    shared: dict[Any, Any] = {}

    def conv(kind: str, raw: Any, make: Any) -> Any:
        if not torch_compat:
            return make(raw)
        k = (kind, raw)
        v = shared.get(k)
        if v is None:
            v = shared[k] = make(raw)
        return v

    for e in live:
        g = groups[e[_PG]]
        op, peer = e[_OP], e[_PEER]
        if torch_compat and op in WINDOW_OPS:
            continue  # torchfrtrace knows no one-sided ops (its p2p parser would reject them)
        t0, t1, state, tid = e[_TCREATED], e[_TDONE], e[_STATE], e[_TID]
        out.append(
            {
                "record_id": e[_RID],
                "pg_id": g.pg_id,
                "process_group": (g.key, g.desc) if torch_compat else [g.key, g.desc],
                "collective_seq_id": e[_CSEQ],
                "p2p_seq_id": e[_PSEQ],
                "op_id": e[_OPID],
                "profiling_name": _profiling_name(g, op, peer, torch_compat),
                "time_created_ns": t0,
                "time_discovered_started_ns": e[_TSTARTED],
                "time_discovered_completed_ns": t1,
                "duration_ms": (t1 - t0) / 1e6 if t1 is not None else None,
                "state": state,
                "input_sizes": conv("s", e[_INSHAPES], _sizes),
                "output_sizes": conv("s", e[_OUTSHAPES], _sizes),
                "input_dtypes": conv("d", e[_INDTYPES], _dtypes),
                "output_dtypes": conv("d", e[_OUTDTYPES], _dtypes),
                "timeout_ms": e[_TIMEOUT],
                "is_p2p": e[_ISP2P],
                "retired": state in _FINAL_STATES,
                "frames": conv("f", e[_FRAMES], _frames),
                "thread_name": thread_names.get(tid, "unknown"),
                "thread_id": str(tid),
                "op": op,
                "backend": g.backend,
                "rank": g.rank,
                "global_rank": global_rank,
                "generation": e[_GEN],
                "peer": peer,
                "peer_global": g.ranks[peer] if peer is not None and 0 <= peer < len(g.ranks) else None,
                "tag": e[_TAG],
                "async_op": e[_ASYNC],
                "error": e[_ERROR],
                "root": e[_ROOT],
                "root_global": g.ranks[e[_ROOT]] if e[_ROOT] is not None and 0 <= e[_ROOT] < len(g.ranks) else None,
                "reduce_op": e[_ROP],
            }
        )
    return out


_j = json.JSONEncoder(separators=(",", ":")).encode
_STATE_JSON = {st: _j(st) for st in ("scheduled", "started", *sorted(_FINAL_STATES))}


def _n(x: int | None) -> str:
    return "null" if x is None else str(int(x))


def group_fields(g: Any, op: str, peer: int | None, global_rank: int) -> str:
    """The group-dependent fields of one JSON entry, ``"pg_id"`` to ``"peer_global"`` (also what a pre-rendering
    source -- the native data path's C++ ring -- is given per ``(op, peer)``)."""
    return (f'"pg_id":{g.pg_id},"process_group":{_j([g.key, g.desc])},'
            f'"profiling_name":{_j(_profiling_name(g, op, peer, False))},"op":{_j(op)},'
            f'"backend":{_j(g.backend)},"rank":{g.rank},"global_rank":{global_rank},"peer":{_n(peer)},'
            f'"peer_global":{_n(g.ranks[peer] if peer is not None and 0 <= peer < len(g.ranks) else None)}')


def group_dict(g: Any, op: str, peer: int | None, global_rank: int) -> dict[str, Any]:
    """The group-dependent fields of one pickle-dump entry (``format_entries(..., torch_compat=True)``), with a
    ``"record_id"`` placeholder first: what a source that builds its entries' dicts -- the native ring -- copies into
    each entry of ``(op, peer)``."""
    return {"record_id": None, "pg_id": g.pg_id, "process_group": (g.key, g.desc),
            "profiling_name": _profiling_name(g, op, peer, True), "op": op, "backend": g.backend, "rank": g.rank,
            "global_rank": global_rank, "peer": peer,
            "peer_global": g.ranks[peer] if peer is not None and 0 <= peer < len(g.ranks) else None}


Built = tuple[int, int, dict[str, Any]]
"""An entry a source built itself for the pickle dump: ``(time_created_ns, record id, dict)``, the dict being the
entry of ``format_entries(..., torch_compat=True)`` but for its ``record_id`` (see :func:`group_dict` and
``csrc/native.cpp``'s ``entry_dicts``)."""


def merge_built(live: list[list[Any]], groups: list[Any], global_rank: int, built: Sequence[Built]) -> list[dict[str, Any]]:
    """Slots and built entries -> the pickle dump's entries, merged by creation time and numbered anew, as
    :func:`entries_json` merges rendered ones::

        [{**entry, "record_id": i} for i, entry in enumerate(sorted(live + built, key=(t_created, rid)))]
    """
    live = [e for e in live if e[_OP] not in WINDOW_OPS]  # format_entries drops them in torch_compat
    merged: list[tuple[int, int, dict[str, Any]]] = [
        (e[_TCREATED], e[_RID], d)
        for e, d in zip(live, format_entries(live, groups, global_rank, torch_compat=True), strict=True)]
    merged.extend(built)
    merged.sort(key=lambda x: (x[0], x[1]))
    out = []
    for i, (_, _, d) in enumerate(merged):
        d["record_id"] = i
        out.append(d)
    return out


Rendered = tuple[int, int, str]
"""An entry a source rendered itself: ``(time_created_ns, record id, text)``, the text being the entry's JSON after
``{"record_id":N,`` (see :func:`group_fields` and ``csrc/native.cpp``'s ``Ring::render``)."""


def entries_json(live: list[list[Any]], groups: list[Any], global_rank: int,
                 rendered: Sequence[Rendered] = ()) -> str:
    """Slots -> the JSON text of ``format_entries(live, groups, global_rank, torch_compat=False)`` (fast path).

    ``rendered``: entries of other sources, already JSON (:data:`Rendered`): merged with the slots by creation time
    and the whole numbered anew (``record_id`` 0, 1, ...), as :meth:`FlightRecorder.entries` numbers merged slots::

        no rendered: [{"record_id": slot.rid, ...} for slot in live]
        else:        [{"record_id": i, ...} for i, entry in enumerate(sorted(live + rendered, key=(t_created, rid)))]
    """
    tails = _tails(live, groups, global_rank)
    if not rendered:
        return "[" + ",".join(f'{{"record_id":{e[_RID]},{t}' for e, t in zip(live, tails, strict=True)) + "]"
    merged = [(e[_TCREATED], e[_RID], t) for e, t in zip(live, tails, strict=True)]
    merged.extend(rendered)
    merged.sort(key=lambda x: (x[0], x[1]))
    return "[" + ",".join(f'{{"record_id":{i},{m[2]}' for i, m in enumerate(merged)) + "]"


def _tails(live: list[list[Any]], groups: list[Any], global_rank: int) -> list[str]:
    """Each slot's JSON entry after ``{"record_id":N,``."""
    thread_names = {t.ident: t.name for t in threading.enumerate()}
    cache: dict[Any, str] = {}

    def cached(kind: str, key: Any, make: Any) -> str:
        k = (kind, key)
        text = cache.get(k)
        if text is None:
            text = cache[k] = make()
        return text

    parts: list[str] = []
    for e in live:
        g = groups[e[_PG]]
        op, peer = e[_OP], e[_PEER]
        t0, t1, state, tid, root = e[_TCREATED], e[_TDONE], e[_STATE], e[_TID], e[_ROOT]
        group_text = cached("g", (g.pg_id, op, peer), lambda g=g, op=op, peer=peer: group_fields(g, op, peer, global_rank))
        ins = cached("s", e[_INSHAPES], lambda e=e: _j([list(x) for x in e[_INSHAPES]]))
        outs = cached("s", e[_OUTSHAPES], lambda e=e: _j([list(x) for x in e[_OUTSHAPES]]))
        ind = cached("d", e[_INDTYPES], lambda e=e: _j([dtype_name(x) for x in e[_INDTYPES]]))
        outd = cached("d", e[_OUTDTYPES], lambda e=e: _j([dtype_name(x) for x in e[_OUTDTYPES]]))
        frames = cached("f", e[_FRAMES], lambda e=e: _j(_frames(e[_FRAMES])))
        thread = cached("t", tid, lambda tid=tid: f'"thread_name":{_j(thread_names.get(tid, "unknown"))},"thread_id":"{tid}"')
        parts.append(
            f'{group_text},"collective_seq_id":{e[_CSEQ]},"p2p_seq_id":{e[_PSEQ]},'
            f'"op_id":{e[_OPID]},"time_created_ns":{t0},"time_discovered_started_ns":{_n(e[_TSTARTED])},'
            f'"time_discovered_completed_ns":{_n(t1)},'
            f'"duration_ms":{"null" if t1 is None else repr((t1 - t0) / 1e6)},"state":{_STATE_JSON.get(state) or _j(state)},'
            f'"input_sizes":{ins},"output_sizes":{outs},"input_dtypes":{ind},"output_dtypes":{outd},'
            f'"timeout_ms":{_n(e[_TIMEOUT])},"is_p2p":{"true" if e[_ISP2P] else "false"},'
            f'"retired":{"true" if state in _FINAL_STATES else "false"},"frames":{frames},{thread},'
            f'"generation":{e[_GEN]},"tag":{_n(e[_TAG])},"async_op":{"true" if e[_ASYNC] else "false"},'
            f'"error":{"null" if e[_ERROR] is None else _j(e[_ERROR])},'
            f'"root":{_n(root)},"root_global":{_n(g.ranks[root] if root is not None and 0 <= root < len(g.ranks) else None)},'
            f'"reduce_op":{"null" if e[_ROP] is None else _j(e[_ROP])}}}'
        )
    return parts
