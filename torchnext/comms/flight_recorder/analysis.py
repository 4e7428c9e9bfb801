"""The hang analyzer behind ``torchnext fr analyze DIR``: match collectives across ranks and name what went wrong.

Semantics, per communicator (a ``pg_config`` key; a rebuilt communicator of a new generation has its own key, so
traces are stitched across reconfigurations without mixing generations)::

    for seq in the collective sequence numbers every member with a dump still has in its ring:
        entered = {rank: entry with collective_seq_id == seq}      # among the ranks whose dumps exist
        first difference among them, the ranks outside the majority being the culprits:
            ops -> op_mismatch; roots -> root_mismatch; reduce ops -> reduce_op_mismatch;
            sizes (per-op rule) -> size_mismatch; dtypes -> dtype_mismatch
        if a member never entered seq, or a member without a dump was in it while it did not complete:
            the entered ranks are a minority and the others' last collective completed -> extra_collective
            else -> missing_ranks (a consequence of the mismatch above, when there is one)
            and stop: what follows is a consequence
        else: lateness[rank] = entered_at[rank] - min(entered_at)   -> straggler when > threshold
    p2p: k-th send a->b (tag t) pairs with the k-th recv on b from a (tag t); leftovers -> unmatched_p2p
    window ops (one-sided, nothing to pair): one still "started" at the dump, or ended in error / timed_out
                                          -> window_op (names the rank, the target rank and where the target was)
    last_completed[pg] = the highest seq completed on every member

Issues come out likely culprit first: the mismatches (op, root, reduce_op, size, dtype), extra_collective,
missing_ranks, unmatched_p2p, window_op, straggler. A mismatch is a bug in itself and the usual cause of a hang that
follows it: the rank that called something else is the culprit, the ranks that then hang or die are its victims.
:attr:`Report.generations` tells how each generation of a rebuilt communicator ended
(:mod:`~torchnext.comms.flight_recorder.generations`). :meth:`Report.to_json` is the stable ``--json`` schema.
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from torchnext.comms.flight_recorder.generations import generation_ends
from torchnext.comms.flight_recorder.loader import GroupInfo, LoadProblem, RankDump, load_dir

__all__ = ["Issue", "IssueKind", "Report", "analyze", "analyze_dir"]

SCHEMA_VERSION = 1


class IssueKind(str, Enum):
    """Kinds of findings, in report order (most important first)."""

    OP_MISMATCH = "op_mismatch"
    ROOT_MISMATCH = "root_mismatch"
    REDUCE_OP_MISMATCH = "reduce_op_mismatch"
    SIZE_MISMATCH = "size_mismatch"
    DTYPE_MISMATCH = "dtype_mismatch"
    EXTRA_COLLECTIVE = "extra_collective"
    MISSING_RANKS = "missing_ranks"
    UNMATCHED_P2P = "unmatched_p2p"
    WINDOW_OP = "window_op"
    STRAGGLER = "straggler"


_KIND_ORDER = {k.value: i for i, k in enumerate(IssueKind)}

# Which entry fields must agree across ranks, per op (ops not listed: input and output sizes/dtypes).
_SIZE_RULES: dict[str, tuple[str, ...]] = {
    "all_to_all": (),
    "all_to_all_single": (),
    "all_to_all_v_single": (),
    "barrier": (),
    "gather": ("input_sizes",),
    "scatter": ("output_sizes",),
    "broadcast": ("input_sizes",),
    "reduce": ("input_sizes",),
}
_DTYPE_RULES: dict[str, tuple[str, ...]] = {
    "barrier": (),
    "gather": ("input_dtypes",),
    "scatter": ("output_dtypes",),
    "broadcast": ("input_dtypes",),
    "reduce": ("input_dtypes",),
}
_ROOT_OPS = frozenset({"broadcast", "reduce", "gather", "scatter"})
_REDUCE_OPS = frozenset({"all_reduce", "reduce", "reduce_scatter", "reduce_scatter_single"})
_SIZE_KILLS = "probably terminated by it: Gloo aborts a process that receives a message of an unexpected size"
_DEFAULT_SIZE_FIELDS = ("input_sizes", "output_sizes")
_DEFAULT_DTYPE_FIELDS = ("input_dtypes", "output_dtypes")
_MAX_ISSUES_PER_GROUP = 10


@dataclass(kw_only=True)
class Issue:
    """One finding. ``ranks`` are the culprits (global ranks); ``detail`` is JSON-ready."""

    kind: str
    pg: str
    seq: int | None
    op: str | None
    ranks: list[int]
    detail: dict[str, Any]
    generation: int = 0
    message: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "pg": self.pg,
            "generation": self.generation,
            "seq": self.seq,
            "op": self.op,
            "ranks": self.ranks,
            "message": self.message,
            "detail": self.detail,
        }


@dataclass(kw_only=True)
class Report:
    """What :func:`analyze` found."""

    issues: list[Issue] = field(default_factory=list)
    last_completed: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    groups: dict[str, GroupInfo] = field(default_factory=dict)
    dumps: list[RankDump] = field(default_factory=list)
    problems: list[LoadProblem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    ranks_without_dump: list[int] = field(default_factory=list)
    generations: list[Any] = field(default_factory=list)
    """How each generation that ended ended (:class:`~torchnext.comms.flight_recorder.generations.GenerationEnd`)."""

    @property
    def hang_point(self) -> Issue | None:
        """The first missing_ranks issue (where the job is stuck), if any."""
        return next((i for i in self.issues if i.kind == IssueKind.MISSING_RANKS.value), None)

    def to_json(self) -> dict[str, Any]:
        """The stable ``--json`` schema."""
        return {
            "schema_version": SCHEMA_VERSION,
            "issues": [i.to_json() for i in self.issues],
            "last_completed": self.last_completed,
            "groups": {
                k: {"desc": g.desc, "ranks": g.ranks, "generation": g.generation} for k, g in self.groups.items()
            },
            "dumps": [
                {
                    "rank": d.rank,
                    "path": d.path,
                    "source": d.source,
                    "version": d.version,
                    "world_size": d.world_size,
                    "generation": d.generation,
                    "dropped": d.dropped,
                    "entries": len(d.entries),
                    "host": d.host,
                    "pid": d.pid,
                    "dump_reason": d.dump_reason,
                    "notes": d.notes,
                }
                for d in self.dumps
            ],
            "ranks_without_dump": self.ranks_without_dump,
            "generations": [g.to_json() for g in self.generations],
            "problems": [{"path": p.path, "message": p.message, "skipped": p.skipped} for p in self.problems],
            "notes": self.notes,
        }


def _summary(e: dict[str, Any] | None) -> dict[str, Any] | None:
    if e is None:
        return None
    return {
        "pg": e["pg"],
        "op": e["op"],
        "seq": e["p2p_seq_id"] if e["is_p2p"] else e["collective_seq_id"],
        "state": e["state"],
        "time_created_ns": e["time_created_ns"],
        "frames": e.get("frames") or [],
    }


def _where(dump: RankDump | None) -> dict[str, Any]:
    """Where a rank was instead: its last recorded op (any communicator) and its main thread's stack at dump time."""
    if dump is None:
        return {"dump": False, "last_entry": None, "stack": []}
    last = max(dump.entries, key=lambda e: e["time_created_ns"], default=None)
    stack = dump.main_stack() or (last.get("frames") if last else []) or []
    return {"dump": True, "last_entry": _summary(last), "stack": stack, "dump_reason": dump.dump_reason}


def _majority(values: dict[int, Any]) -> tuple[Any, list[int], bool]:
    """The most common value (ties: the one of the lowest rank), the ranks that differ from it, and whether it was
    a tie (then the choice of culprit is a convention: torch's checker reports against rank 0 too)."""
    counts = Counter(repr(v) for v in values.values())
    best = max(counts.values())
    winners = {k for k, c in counts.items() if c == best}
    expected_key = next(repr(values[r]) for r in sorted(values) if repr(values[r]) in winners)
    expected = next(values[r] for r in sorted(values) if repr(values[r]) == expected_key)
    return expected, sorted(r for r, v in values.items() if repr(v) != expected_key), len(winners) > 1


def _merge_groups(dumps: list[RankDump], notes: list[str]) -> dict[str, GroupInfo]:
    groups: dict[str, GroupInfo] = {}
    for d in dumps:
        for key, g in d.groups.items():
            if key not in groups:
                groups[key] = GroupInfo(key=key, desc=g.desc, ranks=list(g.ranks), generation=g.generation)
            elif sorted(groups[key].ranks) != sorted(g.ranks):
                notes.append(f"communicator {key!r}: rank {d.rank} lists members {g.ranks}, others {groups[key].ranks}")
    # Groups seen in entries but missing from pg_config (PyTorch's Gloo dumps): members = the ranks that used them.
    users: dict[str, set[int]] = defaultdict(set)
    descs: dict[str, str] = {}
    gens: dict[str, int] = {}
    for d in dumps:
        for e in d.entries:
            users[e["pg"]].add(d.rank)
            descs.setdefault(e["pg"], e.get("pg_desc", ""))
            gens.setdefault(e["pg"], int(e.get("generation", 0)))
    all_ranks = sorted(d.rank for d in dumps)
    for key, rs in users.items():
        if key in groups and groups[key].ranks:
            continue
        ranks = all_ranks if descs.get(key) == "default_pg" else sorted(rs)
        groups[key] = GroupInfo(key=key, desc=descs.get(key, ""), ranks=ranks, generation=gens.get(key, 0))
        notes.append(f"communicator {key!r}: members not in pg_config, inferred from the dumps as {ranks}")
    return groups


def _values(entries: dict[int, dict[str, Any]], fields: Iterable[str]) -> dict[int, Any]:
    return {r: tuple(repr(e.get(f)) for f in fields) for r, e in entries.items()}


def _analyze_group(
    key: str,
    group: GroupInfo,
    by_rank: dict[int, RankDump],
    straggler_ns: int,
    report: Report,
) -> None:
    members = group.ranks
    with_dump = [r for r in members if r in by_rank]
    no_dump = [r for r in members if r not in by_rank]
    seqs: dict[int, dict[int, dict[str, Any]]] = {}
    start: dict[int, int] = {}
    for r in with_dump:
        mine: dict[int, dict[str, Any]] = {}
        for e in by_rank[r].entries:
            if e["pg"] == key and not e["is_p2p"]:
                mine.setdefault(int(e["collective_seq_id"]), e)
        seqs[r] = mine
        dropped = by_rank[r].dropped
        if mine:
            start[r] = min(mine) if dropped else 1
        elif not dropped:
            start[r] = 1
    known = [r for r in with_dump if r in start]
    top = max((max(m) for m in seqs.values() if m), default=0)
    if not known or top == 0:
        report.last_completed[key] = None
        return
    first = max(start[r] for r in known)
    issues: list[Issue] = []
    lateness: dict[int, list[tuple[int, int, str]]] = defaultdict(list)
    last_completed: dict[str, Any] | None = None
    for seq in range(first, top + 1):
        entered = {r: seqs[r][seq] for r in known if seq in seqs[r]}
        missing = [r for r in known if seq not in seqs[r]]
        ops = {r: e["op"] for r, e in entered.items()}
        op = _majority(ops)[0] if ops else None
        incomplete = any(e["state"] != "completed" for e in entered.values())
        stuck = bool(missing or (no_dump and incomplete and entered))
        mismatch = _mismatch(key, group, seq, entered, ops, no_dump if stuck else [])
        if mismatch is not None:
            issues.append(mismatch)
        if stuck:
            issues.append(_missing_issue(key, group, seq, op, entered, missing, no_dump, incomplete, by_rank, seqs,
                                         mismatch))
            break
        if mismatch is None and len(entered) > 1:
            t0 = min(e["time_created_ns"] for e in entered.values())
            for r, e in entered.items():
                lateness[r].append((e["time_created_ns"] - t0, seq, str(op)))
        if entered and not missing and not incomplete:
            last_completed = {"seq": seq, "op": op, "generation": group.generation}
        if len(issues) >= _MAX_ISSUES_PER_GROUP:
            report.notes.append(f"communicator {key!r}: more than {_MAX_ISSUES_PER_GROUP} issues; later ones not shown")
            break
    for r, lates in sorted(lateness.items()):
        worst = max(lates)
        count = sum(1 for late, _, _ in lates if late > straggler_ns)
        if worst[0] > straggler_ns:
            issues.append(
                Issue(
                    kind=IssueKind.STRAGGLER.value,
                    pg=key,
                    generation=group.generation,
                    seq=worst[1],
                    op=worst[2],
                    ranks=[r],
                    detail={
                        "late_ms": round(worst[0] / 1e6, 3),
                        "late_count": count,
                        "threshold_ms": straggler_ns / 1e6,
                        "entered_after_first_ms": _offsets(seqs, worst[1]),
                    },
                    message=f"rank {r} entered {worst[2]} #{worst[1]} on {key!r} {worst[0] / 1e6:.1f} ms after the "
                    f"first rank ({count} collective(s) late by more than {straggler_ns / 1e6:.0f} ms)",
                )
            )
    report.issues.extend(issues)
    report.last_completed[key] = last_completed


def _compared(op: str | None) -> list[tuple[IssueKind, tuple[str, ...]]]:
    """The fields compared across ranks for ``op``, in report order (after the op itself)."""
    out: list[tuple[IssueKind, tuple[str, ...]]] = []
    if op in _ROOT_OPS:
        out.append((IssueKind.ROOT_MISMATCH, ("root",)))
    if op in _REDUCE_OPS:
        out.append((IssueKind.REDUCE_OP_MISMATCH, ("reduce_op",)))
    out.append((IssueKind.SIZE_MISMATCH, _SIZE_RULES.get(str(op), _DEFAULT_SIZE_FIELDS)))
    out.append((IssueKind.DTYPE_MISMATCH, _DTYPE_RULES.get(str(op), _DEFAULT_DTYPE_FIELDS)))
    return out


def _mismatch(
    key: str, group: GroupInfo, seq: int, entered: dict[int, dict[str, Any]], ops: dict[int, str],
    no_dump: list[int],
) -> Issue | None:
    """The first difference among the ranks that entered collective ``seq`` (op, root, reduce op, sizes, dtypes),
    or None. ``no_dump`` are members without a dump while the collective did not complete: named as its likely
    victims."""
    if len(entered) < 2:
        return None
    kind: IssueKind
    values: dict[int, dict[str, Any]]
    detail: dict[str, Any]
    if len(set(ops.values())) > 1:
        expected_op, odd, tie = _majority(ops)
        kind, op = IssueKind.OP_MISMATCH, expected_op
        detail = {"ops": {str(r): o for r, o in ops.items()}, "expected": expected_op}
        what = "; ".join(f"rank {r} entered {ops[r]} #{seq}" for r in odd)
        message = f"{what} on {key!r} where {_rank_list(sorted(set(ops) - set(odd)))} entered {expected_op}"
    else:
        op = next(iter(ops.values()))
        found: tuple[IssueKind, dict[int, dict[str, Any]], Any, list[int], bool] | None = None
        for candidate, fields_ in _compared(op):
            if not fields_:
                continue
            vals = {r: {f: e.get(f) for f in fields_} for r, e in entered.items()}
            expected, odd, tie = _majority(vals)
            if odd:
                found = (candidate, vals, expected, odd, tie)
                break
        if found is None:
            return None
        kind, values, expected, odd, tie = found
        detail = {"values": {str(r): v for r, v in values.items()}, "expected": expected}
        what = "; ".join(f"rank {r} entered {op} #{seq} on {key!r} with {_fmt_fields(values[r])}" for r in odd)
        others = sorted(set(entered) - set(odd))
        message = f"{what} where {_rank_list(others)} reported {_fmt_fields(expected)}"
    if tie:
        message += (f" (no majority among the {len(entered)} ranks with a dump: the lowest rank's value is taken as "
                    "the reference)")
        detail["tie"] = True
    if no_dump:
        detail["no_dump"] = list(no_dump)
        kills = kind in (IssueKind.SIZE_MISMATCH, IssueKind.OP_MISMATCH)
        message += f"; {_rank_list(no_dump)} left no dump" + (f" ({_SIZE_KILLS})" if kills else "")
    return Issue(kind=kind.value, pg=key, generation=group.generation, seq=seq, op=op, ranks=odd, detail=detail,
                 message=message)


def _missing_issue(
    key: str, group: GroupInfo, seq: int, op: str | None, entered: dict[int, dict[str, Any]], missing: list[int],
    no_dump: list[int], incomplete: bool, by_rank: dict[int, RankDump], seqs: dict[int, dict[int, dict[str, Any]]],
    cause: Issue | None,
) -> Issue:
    """Members that never entered collective ``seq`` (missing_ranks), or -- when those that entered are a minority
    and the others are not stuck in a collective -- the ranks that issued one collective more (extra_collective)."""
    states = {str(r): e["state"] for r, e in entered.items()}
    times = {str(r): e["time_created_ns"] for r, e in entered.items()}
    settled = all(seqs[r].get(seq - 1, {}).get("state", "completed") == "completed" for r in missing)
    if missing and len(missing) > len(entered) and settled and not no_dump:
        culprits = sorted(entered)
        where = {str(r): _where(by_rank.get(r)) for r in missing}
        last = _fmt_last(where[str(missing[0])]["last_entry"])
        return Issue(
            kind=IssueKind.EXTRA_COLLECTIVE.value, pg=key, generation=group.generation, seq=seq, op=op,
            ranks=culprits,
            detail={"entered": states, "entered_time_ns": times, "missing": where, "no_dump": []},
            message=f"{_rank_list(culprits)} entered {op} #{seq} on {key!r}, which {_rank_list(missing)} never "
            f"entered (their last was {last}): {_rank_list(culprits)} issued a collective more than the others "
            "(or the others are stuck outside any collective: see their stacks)",
        )
    culprits = sorted(missing + (no_dump if incomplete else []))
    where = {str(r): _where(by_rank.get(r)) for r in culprits}
    first_in = min(times.values(), default=None)
    early = [
        r for r in culprits
        if r in by_rank and first_in is not None and (by_rank[r].time_dumped_ns or first_in) < first_in
    ]
    for r in early:
        where[str(r)]["dumped_before_others_entered"] = True
    names = ", ".join(
        f"rank {r} " + ("left no dump (dead, or its dump failed)" if r in no_dump
                        else "was at " + _fmt_last(where[str(r)]["last_entry"]))
        for r in culprits
    )
    detail: dict[str, Any] = {"entered": states, "entered_time_ns": times, "missing": where,
                              "no_dump": [r for r in culprits if r in no_dump]}
    message = f"{op} #{seq} on {key!r}: ranks {culprits} never entered it ({names})"
    if early:
        message += (f"; ranks {early} dumped before the others entered it, so they may simply not have got there"
                    " yet (dumps taken at different times, not necessarily a hang)")
    if cause is not None:
        detail["consequence_of"] = cause.kind
        message += f"; a consequence of the {cause.kind.replace('_', ' ')} above"
    return Issue(kind=IssueKind.MISSING_RANKS.value, pg=key, generation=group.generation, seq=seq, op=op,
                 ranks=culprits, detail=detail, message=message)


def _fmt_fields(values: dict[str, Any]) -> str:
    """``{"input_sizes": [[6]], "output_sizes": [[18]]}`` -> ``input [6], output [18]``."""
    parts = []
    for f, v in values.items():
        name = f.removesuffix("_sizes").removesuffix("_dtypes") + (" dtype" if f.endswith("_dtypes") else "")
        if isinstance(v, (list, tuple)) and len(v) == 1:
            v = v[0]
        parts.append(f"{name} {v}")
    return ", ".join(parts)


def _rank_list(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _offsets(seqs: dict[int, dict[int, dict[str, Any]]], seq: int) -> dict[str, float]:
    """How late each rank entered collective ``seq`` after the first one (ms)."""
    times = {r: m[seq]["time_created_ns"] for r, m in seqs.items() if seq in m}
    t0 = min(times.values())
    return {str(r): round((t - t0) / 1e6, 3) for r, t in sorted(times.items())}


def _fmt_last(last: dict[str, Any] | None) -> str:
    if last is None:
        return "nothing recorded"
    return f"{last['op']} #{last['seq']} on {last['pg']!r} ({last['state']})"


def _analyze_p2p(key: str, group: GroupInfo, by_rank: dict[int, RankDump], report: Report) -> None:
    sends: dict[tuple[int, int, Any], list[dict[str, Any]]] = defaultdict(list)
    recvs: dict[tuple[int, int, Any], list[dict[str, Any]]] = defaultdict(list)
    for r in group.ranks:
        d = by_rank.get(r)
        if d is None:
            continue
        for e in d.entries:
            if e["pg"] != key or not e["is_p2p"] or e.get("peer_global") is None:
                continue
            if e["op"] in ("send", "isend"):
                sends[(r, int(e["peer_global"]), e.get("tag", 0))].append(e)
            elif e["op"] in ("recv", "irecv"):
                recvs[(int(e["peer_global"]), r, e.get("tag", 0))].append(e)
    for pair in sorted(set(sends) | set(recvs)):
        src, dst, tag = pair
        ds, dd = by_rank.get(src), by_rank.get(dst)
        if (ds is not None and ds.dropped) or (dd is not None and dd.dropped):
            report.notes.append(f"p2p {src}->{dst} on {key!r}: a ring dropped entries, pairs not checked")
            continue
        s_list, r_list = sends.get(pair, []), recvs.get(pair, [])
        for s, rv in zip(s_list, r_list, strict=False):
            # the first difference wins: sizes, then dtypes
            for what, kind in (("sizes", IssueKind.SIZE_MISMATCH), ("dtypes", IssueKind.DTYPE_MISMATCH)):
                sent, got = s.get(f"input_{what}"), rv.get(f"output_{what}")
                if sent != got:
                    report.issues.append(
                        Issue(
                            kind=kind.value,
                            pg=key,
                            generation=group.generation,
                            seq=s["p2p_seq_id"],
                            op="send",
                            ranks=[src, dst],
                            detail={f"send_{what}": sent, f"recv_{what}": got},
                            message=f"send {src}->{dst} (tag {tag}) of {sent} met a recv of {got}",
                        )
                    )
                    break
        n = min(len(s_list), len(r_list))
        for e, me, peer, what in [(e, src, dst, "send") for e in s_list[n:]] + [
            (e, dst, src, "recv") for e in r_list[n:]
        ]:
            partner = by_rank.get(peer)
            verb = "recv" if what == "send" else "send"
            arrow = f"{me}->{peer}" if what == "send" else f"{me}<-{peer}"
            report.issues.append(
                Issue(
                    kind=IssueKind.UNMATCHED_P2P.value,
                    pg=key,
                    generation=group.generation,
                    seq=e["p2p_seq_id"],
                    op=what,
                    ranks=[me],
                    detail={"peer": peer, "tag": tag, "state": e["state"], "peer_where": _where(partner)},
                    message=f"{what} {arrow} (tag {tag}, p2p #{e['p2p_seq_id']}, {e['state']}) on {key!r} has no "
                    f"matching {verb} on rank {peer}" + ("" if partner is not None else " (rank has no dump)"),
                )
            )


def analyze(
    dumps: list[RankDump], *, problems: Iterable[LoadProblem] = (), straggler_ms: float = 500.0
) -> Report:
    """Match the dumps' collectives across ranks and report issues (see the module docstring)."""
    report = Report(dumps=list(dumps), problems=list(problems))
    by_rank = {d.rank: d for d in dumps}
    for d in dumps:
        report.notes.extend(f"rank {d.rank}: {n}" for n in d.notes)
    report.groups = _merge_groups(list(dumps), report.notes)
    members = sorted({r for g in report.groups.values() for r in g.ranks})
    world = {ws for d in dumps if isinstance(ws := d.world_size, int)}
    expected = set(members) | (set(range(max(world))) if world else set())
    report.ranks_without_dump = sorted(expected - set(by_rank))
    straggler_ns = int(straggler_ms * 1e6)
    for key in sorted(report.groups, key=lambda k: (report.groups[k].generation, k)):
        group = report.groups[key]
        _analyze_group(key, group, by_rank, straggler_ns, report)
        _analyze_p2p(key, group, by_rank, report)
        _analyze_window(key, group, by_rank, report)
    report.issues.sort(key=lambda i: (_KIND_ORDER.get(i.kind, 99), i.generation, i.pg, i.seq or 0))
    report.generations = generation_ends(report.dumps, report.groups)
    return report


_WINDOW_STUCK = ("started", "error", "timed_out")


def _analyze_window(key: str, group: GroupInfo, by_rank: dict[int, RankDump], report: Report) -> None:
    """One-sided window ops that did not complete: still in flight at the dump, failed, or timed out."""
    for r in group.ranks:
        d = by_rank.get(r)
        if d is None:
            continue
        for e in d.entries:
            op = e["op"]
            if e["pg"] != key or not op.startswith("window.") or e["state"] not in _WINDOW_STUCK:
                continue
            peer = e.get("peer_global")
            partner = by_rank.get(int(peer)) if peer is not None else None
            verb = "waits for a signal from" if op == "window.wait_signal" else "targets"
            report.issues.append(
                Issue(
                    kind=IssueKind.WINDOW_OP.value,
                    pg=key,
                    generation=group.generation,
                    seq=e["p2p_seq_id"],
                    op=op,
                    ranks=[r],
                    detail={"peer": peer, "state": e["state"], "error": e.get("error"), "peer_where": _where(partner)},
                    message=f"{op} on rank {r} {verb} rank {peer} and is {e['state']} on {key!r}"
                    + (f": {e['error']}" if e.get("error") else "")
                    + ("" if partner is not None or peer is None else f" (rank {peer} has no dump)"),
                )
            )


def analyze_dir(
    directory: str | os.PathLike[str], *, allow_pickle: bool = False, straggler_ms: float = 500.0
) -> Report:
    """:func:`analyze` the dumps in ``directory`` (see :func:`torchnext.comms.flight_recorder.loader.load_dir`)."""
    dumps, problems = load_dir(directory, allow_pickle=allow_pickle)
    return analyze(dumps, problems=problems, straggler_ms=straggler_ms)
