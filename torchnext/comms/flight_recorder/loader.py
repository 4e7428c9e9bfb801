"""Reading Flight Recorder dumps: ours (JSON or pickle) and PyTorch's own (pickle or JSON).

Every file is checked on its own; a bad file yields a :class:`LoadProblem` with a message naming the file and what
is wrong with it, and the other files are still read. Pickle files are read only when the caller allows it
(unpickling can run code), and even then through a restricted unpickler that builds plain containers only.
"""

from __future__ import annotations

import ast
import io
import json
import os
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["DumpFormatError", "GroupInfo", "LoadProblem", "RankDump", "load_dir", "load_file"]

_REQUIRED_TOP = ("version", "entries")
_REQUIRED_ENTRY = ("process_group", "collective_seq_id", "profiling_name", "state", "time_created_ns")
_RANK_FROM_NAME = re.compile(r"(\d+)(?:\.json|\.pkl|\.pickle)?$")
_SAFE_GLOBALS = {
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "tuple"),
    ("builtins", "list"),
    ("builtins", "dict"),
    ("builtins", "int"),
    ("builtins", "float"),
    ("builtins", "str"),
    ("builtins", "bytes"),
    ("builtins", "bool"),
    ("builtins", "complex"),
    ("collections", "OrderedDict"),
}


class DumpFormatError(ValueError):
    """A file is not a readable Flight Recorder dump (the message says why)."""


@dataclass(frozen=True, kw_only=True)
class LoadProblem:
    """One file that could not be used, and why."""

    path: str
    message: str
    skipped: bool = True
    """False for warnings about a file that was still used (e.g. a differing version)."""


@dataclass(kw_only=True)
class GroupInfo:
    """A communicator as described by one dump's ``pg_config``."""

    key: str
    desc: str
    ranks: list[int]
    generation: int = 0
    time_added_ns: int | None = None
    """When this rank's recorder started recording the communicator (None when the dump does not say)."""


@dataclass(kw_only=True)
class RankDump:
    """One rank's dump, normalised: entries carry ``op``, ``pg``, ``peer_global``, ``generation``, ``tag``."""

    path: str
    source: str
    """``torchnext-json``, ``torchnext-pickle``, ``torch-pickle`` or ``torch-json``."""
    rank: int
    version: str
    world_size: int | None = None
    generation: int = 0
    dropped: int | None = None
    """Records the ring overwrote; ``None`` when the dump does not say (PyTorch's)."""
    recorded: int | None = None
    host: str | None = None
    pid: int | None = None
    dump_reason: str | None = None
    time_dumped_ns: int | None = None
    groups: dict[str, GroupInfo] = field(default_factory=dict)
    pg_status: dict[str, Any] = field(default_factory=dict)
    stacks: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    entries: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    """Communicator events (``kind`` "abort", ``pg``, ``generation``, ``time_ns``, ``reason``, ``in_flight``
    op_ids), oldest first; empty for PyTorch's dumps."""
    notes: list[str] = field(default_factory=list)

    def main_stack(self) -> list[dict[str, Any]]:
        """The main thread's stack at dump time (empty when the dump has none)."""
        for name, frames in self.stacks.items():
            if name.startswith("MainThread"):
                return frames
        return []


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load global {module}.{name} (only plain containers are allowed)")


def _sniff(data: bytes) -> str:
    if not data:
        raise DumpFormatError("empty file")
    if data[:1] == b"\x80":
        return "pickle"
    if data.lstrip()[:1] in (b"{", b"["):
        return "json"
    raise DumpFormatError(f"not a Flight Recorder dump (neither JSON nor pickle; {len(data)} bytes, starts {data[:8]!r})")


def _decode(path: Path, data: bytes, *, allow_pickle: bool) -> tuple[str, Any]:
    kind = _sniff(data)
    if kind == "json":
        try:
            return kind, json.loads(data)
        except UnicodeDecodeError as exc:
            raise DumpFormatError(f"malformed JSON (not UTF-8 text: {exc.reason} at byte {exc.start})") from None
        except json.JSONDecodeError as exc:
            tail = data.rstrip()[-1:]
            hint = "truncated" if tail not in (b"}", b"]") or exc.pos >= len(data.rstrip()) - 1 else "malformed"
            raise DumpFormatError(f"{hint} JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    if not allow_pickle:
        raise DumpFormatError("pickle file skipped: pass --allow-pickle to read it (unpickling can run code)")
    try:
        return kind, _RestrictedUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as exc:
        truncated = isinstance(exc, EOFError) or "truncated" in str(exc)
        reason = "truncated pickle (the file ends early)" if truncated else f"unreadable pickle: {exc}"
        raise DumpFormatError(reason) from None


def _check_version(version: Any) -> str:
    v = str(version)
    m = re.fullmatch(r"(\d+)\.(\d+)", v)
    if not m:
        raise DumpFormatError(f"unsupported Flight Recorder version {version!r} (expected 'MAJOR.MINOR', e.g. '2.10')")
    major, minor = int(m.group(1)), int(m.group(2))
    if major != 2 or minor < 2:
        raise DumpFormatError(f"unsupported Flight Recorder version {v!r} (this analyzer reads 2.2 ... 2.x)")
    return v


def _ranks_of(cfg: dict[str, Any]) -> list[int]:
    raw = cfg.get("ranks_list", cfg.get("ranks", []))
    if isinstance(raw, str):
        try:
            raw = ast.literal_eval(raw) if raw.strip() else []
        except (ValueError, SyntaxError):
            raise DumpFormatError(f"pg_config ranks {raw!r} is not a list") from None
    if not isinstance(raw, (list, tuple, set)):
        raise DumpFormatError(f"pg_config ranks {raw!r} is not a list")
    return [int(r) for r in raw]


def _parse_profiling_name(name: str) -> tuple[str, str, int | None, int | None]:
    """``"gloo:send 0->1"`` -> (backend, op, src, dst) in group ranks (src/dst None for collectives)."""
    backend, _, rest = name.partition(":")
    if not rest:
        backend, rest = "", name
    parts = rest.split(" ", 1)
    op = parts[0]
    src = dst = None
    if len(parts) == 2:
        meta = parts[1]
        if "->" in meta:
            s, d = meta.split("->", 1)
            src, dst = int(s), int(d)
        elif "<-" in meta:
            d, s = meta.split("<-", 1)
            src, dst = int(s), int(d)
    return backend, op, src, dst


def _normalise_entry(e: dict[str, Any], groups: dict[str, GroupInfo], rank: int, gen: int) -> dict[str, Any]:
    pg = e["process_group"]
    if not isinstance(pg, (list, tuple)) or len(pg) < 1:
        raise DumpFormatError(f"entry {e.get('record_id')}: process_group {pg!r} is not (name, desc)")
    key = str(pg[0])
    desc = str(pg[1]) if len(pg) > 1 else ""
    backend, op, src, dst = _parse_profiling_name(str(e["profiling_name"]))
    out = dict(e)
    out["pg"] = key
    out["pg_desc"] = desc
    out.setdefault("op", op)
    out.setdefault("backend", backend)
    out["is_p2p"] = bool(e.get("is_p2p", op in ("send", "recv")))
    out.setdefault("p2p_seq_id", 0)
    out.setdefault("generation", gen)
    out.setdefault("tag", 0)
    out.setdefault("record_id", -1)
    out.setdefault("input_sizes", [])
    out.setdefault("output_sizes", [])
    out.setdefault("input_dtypes", [])
    out.setdefault("output_dtypes", [])
    out.setdefault("frames", [])
    for k in ("time_discovered_started_ns", "time_discovered_completed_ns"):
        if not e.get(k):  # PyTorch's JSON writes 0 for "not known"
            out[k] = None
    if out["is_p2p"] and out.get("peer_global") is None and src is not None and dst is not None:
        members = groups[key].ranks if key in groups and groups[key].ranks else None
        peer_local = dst if op == "send" else src
        me_local = src if op == "send" else dst
        if members and 0 <= peer_local < len(members):
            out["peer_global"] = members[peer_local]
        elif members is None:
            out["peer_global"] = peer_local
        out.setdefault("rank", me_local)
    out["global_rank"] = rank
    return out


def load_file(path: str | os.PathLike[str], *, allow_pickle: bool = False) -> RankDump:
    """Read and normalise one dump file; raises :class:`DumpFormatError` naming what is wrong."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise DumpFormatError(f"cannot read: {exc.strerror or exc}") from None
    kind, obj = _decode(p, data, allow_pickle=allow_pickle)
    if not isinstance(obj, dict):
        raise DumpFormatError(f"not a Flight Recorder dump (top level is {type(obj).__name__}, expected an object)")
    missing = [k for k in _REQUIRED_TOP if k not in obj]
    if missing:
        raise DumpFormatError(f"not a Flight Recorder dump: missing key(s) {missing}")
    version = _check_version(obj["version"])
    ours = obj.get("format") == "torchnext.flight_recorder"
    source = f"{'torchnext' if ours else 'torch'}-{kind}"
    if "rank" in obj:
        rank = obj["rank"]
    else:
        m = _RANK_FROM_NAME.search(p.name)
        if not m:
            raise DumpFormatError("cannot tell the rank: no 'rank' key and no rank number at the end of the file name")
        rank = int(m.group(1))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise DumpFormatError(f"bad rank {rank!r}")
    gen = int(obj.get("generation", 0) or 0)
    dump = RankDump(
        path=str(p),
        source=source,
        rank=rank,
        version=version,
        world_size=obj.get("world_size"),
        generation=gen,
        dropped=obj.get("dropped"),
        recorded=obj.get("recorded"),
        host=obj.get("host"),
        pid=obj.get("pid"),
        dump_reason=obj.get("dump_reason"),
        time_dumped_ns=obj.get("time_dumped_ns"),
        pg_status=obj.get("pg_status") or {},
        stacks=obj.get("stacks") or {},
    )
    pg_config = obj.get("pg_config") or {}
    if not isinstance(pg_config, dict):
        raise DumpFormatError(f"pg_config is a {type(pg_config).__name__}, expected an object")
    for key, cfg in pg_config.items():
        if not isinstance(cfg, dict):
            raise DumpFormatError(f"pg_config[{key!r}] is not an object")
        if key == "":
            dump.notes.append("pg_config is empty/broken (PyTorch Gloo dumps): group members inferred from the dumps")
            continue
        added = cfg.get("time_added_ns")
        dump.groups[str(key)] = GroupInfo(
            key=str(key), desc=str(cfg.get("desc", "")), ranks=_ranks_of(cfg), generation=int(cfg.get("generation", 0)),
            time_added_ns=added if isinstance(added, int) and not isinstance(added, bool) else None,
        )
    dump.events = _events(obj.get("events"), dump.notes)
    raw_entries = obj["entries"]
    if not isinstance(raw_entries, list):
        raise DumpFormatError(f"'entries' is a {type(raw_entries).__name__}, expected a list")
    bad = 0
    first_bad = ""
    for e in raw_entries:
        try:
            if not isinstance(e, dict):
                raise DumpFormatError(f"entry is a {type(e).__name__}")
            absent = [k for k in _REQUIRED_ENTRY if k not in e]
            if absent:
                raise DumpFormatError(f"entry {e.get('record_id', '?')} lacks {absent}")
            dump.entries.append(_normalise_entry(e, dump.groups, rank, gen))
        except (DumpFormatError, ValueError, TypeError) as exc:
            bad += 1
            first_bad = first_bad or str(exc)
    if bad:
        dump.notes.append(f"{bad} malformed entr{'y' if bad == 1 else 'ies'} skipped (first: {first_bad})")
    if dump.dropped is None and dump.entries and dump.entries[0].get("record_id", -1) > 0:
        dump.dropped = int(dump.entries[0]["record_id"])  # record ids start at 0: the gap was dropped
    dump.entries.sort(key=lambda e: (e.get("record_id", -1), e["time_created_ns"]))
    return dump


def _events(raw: Any, notes: list[str]) -> list[dict[str, Any]]:
    """The dump's ``events``, each checked (a malformed one is skipped with a note)."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        notes.append(f"'events' is a {type(raw).__name__}, expected a list: ignored")
        return []
    out = []
    for i, e in enumerate(raw):
        try:
            if not isinstance(e, dict):
                raise TypeError(f"a {type(e).__name__}")
            t = e["time_ns"]
            if not isinstance(t, int) or isinstance(t, bool):
                raise TypeError(f"time_ns {t!r}")
            reason = e.get("reason")
            out.append({"kind": str(e["kind"]), "pg": str(e["pg"]), "generation": int(e.get("generation", 0)),
                        "time_ns": t, "reason": None if reason is None else str(reason),
                        "in_flight": [int(x) for x in e.get("in_flight") or []]})
        except (KeyError, TypeError, ValueError) as exc:
            notes.append(f"event {i} malformed ({exc}): skipped")
    return out


def _same_event(a: RankDump, b: RankDump) -> bool:
    """Two flavours written by one dump call (same process, same records, within a second)."""
    return (
        a.pid == b.pid
        and a.recorded == b.recorded
        and abs((a.time_dumped_ns or 0) - (b.time_dumped_ns or 0)) < 1_000_000_000
    )


def _pick(a: RankDump, b: RankDump) -> RankDump:
    """Of two dumps of one rank keep the newest; of two flavours of one dump keep the JSON one."""
    if _same_event(a, b) and a.source.endswith("json") != b.source.endswith("json"):
        keep, drop = (a, b) if a.source.endswith("json") else (b, a)
    else:
        keep, drop = (b, a) if (b.time_dumped_ns or 0) > (a.time_dumped_ns or 0) else (a, b)
    keep.notes.append(f"another dump of rank {keep.rank} ignored: {drop.path}")
    return keep


def load_dir(directory: str | os.PathLike[str], *, allow_pickle: bool = False) -> tuple[list[RankDump], list[LoadProblem]]:
    """Read every (non-hidden) file in ``directory``: the usable dumps (one per rank: the newest when a rank has
    several, e.g. a JSON and a pickle dump) and one problem per file that could not be used."""
    d = Path(directory)
    if not d.is_dir():
        raise DumpFormatError(f"{directory}: not a folder")
    dumps: dict[int, RankDump] = {}
    problems: list[LoadProblem] = []
    for p in sorted(d.iterdir()):
        if p.name.startswith(".") or not p.is_file():
            continue
        try:
            dump = load_file(p, allow_pickle=allow_pickle)
        except DumpFormatError as exc:
            problems.append(LoadProblem(path=str(p), message=str(exc)))
            continue
        prev = dumps.get(dump.rank)
        if prev is not None:
            dump = _pick(prev, dump)
        dumps[dump.rank] = dump
    versions = {dmp.version for dmp in dumps.values()}
    if len(versions) > 1:
        common = max(versions, key=lambda v: sum(dmp.version == v for dmp in dumps.values()))
        for dmp in dumps.values():
            if dmp.version != common:
                problems.append(
                    LoadProblem(
                        path=dmp.path,
                        message=f"version {dmp.version} differs from {common} used by the other dumps; analysed anyway",
                        skipped=False,
                    )
                )
    return [dumps[r] for r in sorted(dumps)], problems
