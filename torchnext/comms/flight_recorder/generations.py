"""How each generation of a rebuilt communicator ended, told from the dumps of the ranks that left one.

A fault-tolerant job records one communicator per generation (``FlightRecorder.add_communicator(comm,
generation=g)``): each has its own ``pg_config`` key, members, and the time it was added. Semantics::

    for each communicator key K of generation g, in generation order:
        aborts  = the "abort" events noted for K (time, reason, op_ids in flight)
        failed  = K's entries that ended in error / timed_out / aborted, or were still in flight at the dump
        if no abort and nothing failed: K did not end (or ended cleanly): nothing to tell
        next    = the communicator of the smallest generation > g (members, time added) -- of K's lineage when
                  there is one: the name without its generation token (``ft.g1.r0`` continues as ``ft.g2.r0``;
                  replica groups keep one communicator per group rank)
        vanished = members(K) - members(next); joined = members(next) - members(K)
        outcome = "failure"      when something failed or a member vanished
                  "reconfigured" when only members joined
                  "closed"       when K was aborted with nothing in flight and no generation followed
        -> GenerationEnd(in_flight per rank, vanished with the abort reasons (how they went: a closed connection,
           missed heartbeats, a reported failure), no_dump ranks, next generation and how long it took to form)

Times are seconds since the first recorded op of any dump (the timeline's origin).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from torchnext.comms.flight_recorder.loader import GroupInfo, RankDump

__all__ = ["GenerationEnd", "generation_ends"]

_FAILED = ("error", "timed_out", "aborted", "started", "scheduled")
_STATE_WORDS = {"error": "failed", "timed_out": "timed out", "aborted": "aborted", "started": "still running",
                "scheduled": "not started"}
_REASON_CHARS = 240
_GEN_TOKEN = re.compile(r"\.g\d+(?=\.|$)")


def _lineage(group: GroupInfo) -> str:
    """A communicator's name without its generation token: ``ft.g3.r1`` -> ``ft.r1`` (``job.g0`` -> ``job``)."""
    return _GEN_TOKEN.sub("", group.desc or group.key.split("@")[0])


@dataclass(kw_only=True)
class GenerationEnd:
    """How one generation's communicator ended."""

    pg: str
    generation: int
    members: list[int]
    outcome: str
    """``failure``, ``reconfigured`` (members joined) or ``closed`` (aborted with nothing in flight, last one)."""
    ended_s: float | None
    """First abort or failure of this generation, seconds since the first recorded op."""
    in_flight: dict[int, list[str]] = field(default_factory=dict)
    """rank -> the ops of this generation that did not complete (``all_reduce #21 (aborted)``)."""
    last_completed: str | None = None
    reasons: list[str] = field(default_factory=list)
    """Distinct abort reasons and errors of the failed ops, as the ranks recorded them."""
    vanished: list[int] = field(default_factory=list)
    joined: list[int] = field(default_factory=list)
    no_dump: list[int] = field(default_factory=list)
    next_pg: str | None = None
    next_generation: int | None = None
    next_members: list[int] | None = None
    next_formed_s: float | None = None
    message: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "pg": self.pg, "generation": self.generation, "members": self.members, "outcome": self.outcome,
            "ended_s": self.ended_s, "in_flight": {str(r): v for r, v in self.in_flight.items()},
            "last_completed": self.last_completed, "reasons": self.reasons, "vanished": self.vanished,
            "joined": self.joined, "no_dump": self.no_dump, "next_pg": self.next_pg,
            "next_generation": self.next_generation, "next_members": self.next_members,
            "next_formed_s": self.next_formed_s, "message": self.message,
        }


def _origin(dumps: list[RankDump]) -> int | None:
    return min((e["time_created_ns"] for d in dumps for e in d.entries), default=None)


def _seq(e: dict[str, Any]) -> int:
    return int(e["p2p_seq_id"] if e["is_p2p"] else e["collective_seq_id"])


def generation_ends(dumps: list[RankDump], groups: dict[str, GroupInfo]) -> list[GenerationEnd]:
    """Every communicator generation that ended, oldest first (see the module docstring)."""
    t0 = _origin(dumps)
    if t0 is None:
        return []
    by_rank = {d.rank: d for d in dumps}
    added: dict[str, int] = {}
    for d in dumps:
        for key, g in d.groups.items():
            if g.time_added_ns is not None:
                added[key] = min(added.get(key, g.time_added_ns), g.time_added_ns)
    order = sorted(groups, key=lambda k: (groups[k].generation, added.get(k, 0), k))
    out: list[GenerationEnd] = []
    for key in order:
        group = groups[key]
        aborts = [(d.rank, ev) for d in dumps for ev in d.events if ev["pg"] == key and ev["kind"] == "abort"]
        failed: dict[int, list[dict[str, Any]]] = {}
        completed: dict[str, Any] | None = None
        for d in dumps:
            for e in d.entries:
                if e["pg"] != key:
                    continue
                if e["state"] in _FAILED:
                    failed.setdefault(d.rank, []).append(e)
                elif not e["is_p2p"] and (completed is None or _seq(e) > _seq(completed)):
                    completed = e
        if not aborts and not failed:
            continue
        later = [k for k in order if groups[k].generation > group.generation]
        kin = [k for k in later if _lineage(groups[k]) == _lineage(group)]
        nxt = kin[0] if kin else later[0] if later else None
        members = sorted(group.ranks)
        next_members = sorted(groups[nxt].ranks) if nxt is not None else None
        vanished = sorted(set(members) - set(next_members)) if next_members is not None else []
        joined = sorted(set(next_members) - set(members)) if next_members is not None else []
        errored = any(e["state"] in ("error", "timed_out") for es in failed.values() for e in es)
        if failed and not aborts and not errored:  # only ops still in flight at the dumps: a hang, not an end
            continue
        if errored or vanished:
            outcome = "failure"
        elif joined:
            outcome = "reconfigured"
        elif nxt is None and not any(ev["in_flight"] for _, ev in aborts):
            outcome = "closed"
        else:
            outcome = "failure"
        times = [ev["time_ns"] for _, ev in aborts] + [
            e.get("time_discovered_completed_ns") or e["time_created_ns"] for es in failed.values() for e in es
        ]
        ended = min(times) if times else None
        reasons: list[str] = []
        for _, ev in sorted(aborts, key=lambda x: x[1]["time_ns"]):
            if ev["reason"] and ev["reason"] not in reasons:
                reasons.append(_short(ev["reason"]))
        for es in failed.values():
            for e in es:
                err = e.get("error")
                if err and e["state"] != "aborted" and _short(str(err)) not in reasons:
                    reasons.append(_short(str(err)))
        in_flight = {r: [f"{e['op']} #{_seq(e)} ({_STATE_WORDS.get(e['state'], e['state'])})" for e in es]
                     for r, es in sorted(failed.items())}
        formed = added.get(nxt) if nxt is not None else None
        end = GenerationEnd(
            pg=key, generation=group.generation, members=members, outcome=outcome,
            ended_s=None if ended is None else round((ended - t0) / 1e9, 3), in_flight=in_flight,
            last_completed=None if completed is None else f"{completed['op']} #{_seq(completed)}",
            reasons=reasons[:6], vanished=vanished, joined=joined,
            no_dump=[r for r in members if r not in by_rank], next_pg=nxt,
            next_generation=groups[nxt].generation if nxt is not None else None, next_members=next_members,
            next_formed_s=None if formed is None else round((formed - t0) / 1e9, 3),
        )
        end.message = _tell(end)
        out.append(end)
    return out


def _short(text: str) -> str:
    return text if len(text) <= _REASON_CHARS else text[: _REASON_CHARS - 3] + "..."


def _ranks(rs: list[int]) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {rs}"


def _tell(g: GenerationEnd) -> str:
    """The story of one generation's end, in a few lines of plain text."""
    head = f"generation {g.generation} ({g.pg!r}, members {g.members})"
    at = f" at {g.ended_s:.3f} s" if g.ended_s is not None else ""
    if g.outcome == "closed":
        lines = [f"{head} was closed{at} with nothing in flight" + (f": {g.reasons[0]}" if g.reasons else "")]
        return "\n".join(lines)
    verb = "ended in a failure" if g.outcome == "failure" else "was reconfigured"
    lines = [f"{head} {verb}{at}"]
    if g.in_flight:
        ops: dict[str, list[int]] = {}
        for r, names in g.in_flight.items():
            for n in names:
                ops.setdefault(n, []).append(r)
        lines.append("in flight: " + "; ".join(f"{n} on {_ranks(rs)}" for n, rs in ops.items()))
    else:
        lines.append("no op in flight (the ranks were between collectives"
                     + (f"; last completed: {g.last_completed})" if g.last_completed else ")"))
    if g.vanished:
        dead = [r for r in g.vanished if r in g.no_dump]
        lines.append(f"{_ranks(g.vanished)} vanished" + (f" ({_ranks(dead)} left no dump)" if dead else ""))
    elif g.no_dump:
        lines.append(f"{_ranks(g.no_dump)} left no dump (dead, or its dump failed)")
    if g.joined:
        lines.append(f"{_ranks(g.joined)} joined")
    if g.reasons:
        lines.append("how: " + " | ".join(g.reasons[:3]))
    if g.next_pg is not None:
        later = ""
        if g.next_formed_s is not None and g.ended_s is not None:
            later = f" {g.next_formed_s - g.ended_s:.3f} s later (at {g.next_formed_s:.3f} s)"
        lines.append(f"generation {g.next_generation} ({g.next_pg!r}, members {g.next_members}) formed{later}")
    return "\n".join(lines)
