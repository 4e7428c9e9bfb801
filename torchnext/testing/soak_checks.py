"""The soak's checks (:mod:`torchnext.testing.soak`): exact replay of the commit record, counterpart equality,
resource flatness. Each returns ``{"ok": bool, ...}`` with the figures it judged; a check that could not be made is
``ok=False`` and says why (never true for nothing compared)."""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from typing import Any

import torch

from torchnext.testing.ft_parallel import ddp_expected_weights

__all__ = ["NATIVE_WAITER", "WAITER", "check_job", "percentile", "resources_flat"]

WAITER = "torchnext-comms-waiter"
"""The Python name of a communicator's completion waiter thread (without its ``[name]`` suffix)."""


def percentile(xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0-100) of ``xs`` (nan when empty)."""
    s = sorted(xs)
    if not s:
        return float("nan")
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def _flat(groups: Sequence[Sequence[int]]) -> list[int]:
    return sorted(m for g in groups for m in g)


def _oracle(kind: str, ran: dict[int, dict[str, Any]], final: dict[int, dict[str, Any]],
            events: Sequence[dict[str, Any]], survivor: int) -> dict[str, Any]:
    """Every step ``0 .. S-1`` committed in exactly one generation, by one member list; the survivor applied each
    once; every other finisher's steps are consecutive except where it was healed into a generation starting at the
    step after the gap; DDP: the weights equal the exact replay; HSDP: every Adam step counter equals ``S``."""
    problems: list[str] = []
    gen_members: dict[int, list[int]] = {}
    step_gen: dict[int, int] = {}
    for m, r in ran.items():
        for g, groups in r["generations"].items():
            if gen_members.setdefault(int(g), _flat(groups)) != _flat(groups):
                problems.append(f"generation {g}: member {m} saw {_flat(groups)}, another {gen_members[int(g)]}")
        for g, s, _ in r["commits"]:
            if step_gen.setdefault(s - 1, g) != g:
                problems.append(f"step {s - 1} committed in generation {g} (member {m}) and {step_gen[s - 1]}: "
                                "split brain")
    firsts: dict[int, int] = {}
    for e in events:
        g = int(e["gen"])
        if gen_members.setdefault(g, sorted(e["members"])) != sorted(e["members"]):
            problems.append(f"generation {g}: member {e['member']} logged {sorted(e['members'])}, another "
                            f"{gen_members[g]}")
        firsts[g] = min(firsts.get(g, 1 << 62), int(e["step"]))
    if not final:
        return {"ok": False, "why": "no member finished: nothing to check", "problems": problems}
    steps = {r["step"] for r in final.values()}
    gens = {r["generation"] for r in final.values()}
    if len(steps) != 1 or len(gens) != 1:
        problems.append(f"the finishers disagree: steps {sorted(steps)}, generations {sorted(gens)}")
    total = max(steps)
    order = sorted(firsts.items(), key=lambda kv: kv[1])
    if any(g2 < g1 for (g1, _), (g2, _) in itertools.pairwise(order)):
        problems.append("generations first committed out of order")
    step_members: list[list[int]] = []
    healed_gaps = 0
    j = -1
    for s in range(total):
        while j + 1 < len(order) and order[j + 1][1] <= s:
            j += 1
        if j < 0:
            problems.append(f"step {s}: no generation had committed by then")
            break
        g = order[j][0]
        if step_gen.get(s, g) != g:
            problems.append(f"step {s}: a member logged its commit in generation {step_gen[s]}, the event log says {g}")
        step_members.append(gen_members[g])
    for m, r in final.items():
        hist = [s for s, _ in r["history"]]
        if not hist:
            problems.append(f"member {m}: finished without committing a step")
        # a gap is legitimate only where this member was healed into a generation starting at exactly that step
        # (it was left out -- partitioned, too slow -- and came back as a joiner); anything else lost or doubled a step
        heals = {int(c["step"]) for c in r.get("reconfigurations", ())
                 if m in c["joiners"] and c["healed"] is not None and "step" in c}
        bad = [(a, b) for a, b in itertools.pairwise(hist) if b != a + 1 and not (b > a and b in heals)]
        if bad:
            a, b = bad[0]
            what = "duplicate" if b <= a else "gap (not healed to that step)"
            problems.append(f"member {m}: {what} in its committed steps ({len(bad)} in all; the first: step {a} "
                            f"then {b}, of {len(hist)} commits from step {hist[0]})")
        healed_gaps += sum(1 for a, b in itertools.pairwise(hist) if b > a + 1 and b in heals)
        if hist and hist[-1] != total - 1:
            problems.append(f"member {m}: last committed step {hist[-1]}, not {total - 1}")
    surv = final.get(survivor)
    if surv is None:
        problems.append(f"the survivor (member {survivor}) did not finish")
    elif [s for s, _ in surv["history"]] != list(range(total)):
        problems.append("the survivor did not commit every step 0 .. S-1 exactly once")
    out: dict[str, Any] = {"steps": total, "generations": len(firsts), "finishers": sorted(final),
                           "healed_gaps": healed_gaps}
    if kind == "ddp" and not problems:
        replay = ddp_expected_weights(step_members)
        differ = [m for m, r in final.items()
                  if not all(torch.equal(torch.tensor(p, dtype=torch.float64), w)
                             for p, w in zip(r["params"], replay, strict=True))]
        if differ:
            problems.append(f"members {differ}: weights differ from the exact replay of {total} committed steps")
        out["replayed_steps"] = total
    elif kind == "hsdp":
        wrong = {m: r["optim_steps"] for m, r in final.items() if r["optim_steps"] != [total]}
        if wrong:
            problems.append(f"Adam step counters {wrong} differ from the {total} committed steps")
        out["adam_steps_checked"] = len(final)
    out.update(ok=not problems, problems=problems[:20])
    return out


def _counterparts(final: dict[int, dict[str, Any]], group_size: int) -> dict[str, Any]:
    """Rank ``r`` of every finishing replica group holds the same bytes; needs at least two whole groups."""
    by_group: dict[int, dict[int, dict[str, Any]]] = {}
    for r in final.values():
        by_group.setdefault(r["group"], {})[r["group_rank"]] = r
    whole = {g: ranks for g, ranks in by_group.items() if len(ranks) == group_size}
    if len(whole) < 2:
        return {"ok": False, "groups": len(whole),
                "why": f"only {len(whole)} whole replica group(s) finished: the check needs >= 2 and was not made"}
    differ = [r for r in range(group_size) if len({ranks[r]["digest"] for ranks in whole.values()}) != 1]
    return {"ok": not differ, "groups": len(whole), "ranks_differing": differ}


def check_job(kind: str, reports: dict[int, dict[str, Any]], events: Sequence[dict[str, Any]], *, survivor: int,
              expected_kill: Collection[int], group_size: int) -> dict[str, Any]:
    """Every check of one soak job from its members' reports and event log."""
    ran = {m: r for m, r in reports.items() if "commits" in r}
    final = {m: r for m, r in ran.items() if r["error"] is None}
    ended: dict[str, int] = {}
    for r in reports.values():
        key = (r["error"] or "finished").split(":")[0]
        ended[key] = ended.get(key, 0) + 1
    surv = reports.get(survivor)
    return {"oracle": _oracle(kind, ran, final, events, survivor), "counterparts": _counterparts(final, group_size),
            "max_commit_gap": surv.get("max_commit_gap") if surv else None,
            "long_gaps": surv.get("long_gaps", []) if surv else [],
            "survivor_reconfigurations": [{k: r.get(k) for k in ("gen", "step", "joiners", "reason", "timings", "healed")}
                                          for r in surv.get("reconfigurations", [])] if surv else [],
            "reports": len(reports),
            "sessions": _sessions(ran),
            "ended": ended, "sigkilled": len(expected_kill)}


def _sessions(ran: dict[int, dict[str, Any]]) -> dict[str, int]:
    """How many members held each kind of membership session (``FaultTolerant.session``: leader, follower, flat)."""
    out: dict[str, int] = {}
    for r in ran.values():
        key = str(r.get("session"))
        out[key] = out.get(key, 0) + 1
    return out


NATIVE_WAITER = "tn-waiter"
"""The OS name of a native backend's waiter threads (``csrc/native.cpp``: ``WaiterPool``)."""

NATIVE_WAITERS_PER_COMM = 4
"""How many native waiter threads a live communicator's backend may hold: its pool grows to the most ops without a
future it ran at once (a heal's sends and receives)."""

LIVE_COMMS_SLACK = 2
"""Live Communicators a survivor may hold beyond its warm-up count at the end: a sample taken while a generation is
replaced sees the old one and the new one (and a DDP member's local one)."""


def resources_flat(base: dict[str, Any] | None, end: dict[str, Any] | None, rss_tolerance: float,
                   growth_per_fault: float = 0.0) -> dict[str, Any]:
    """Threads and fds not grown (by more than ``growth_per_fault`` per fault between them), RSS within
    ``+rss_tolerance``, between two of the survivor's samples.

    A communicator's completion waiter (``torchnext-comms-waiter``: one per communicator, started at its first op
    without a future -- a heal's send/recv -- and gone with it) is not counted as growth, but there may be no more
    of them than live communicators (``waiters``). Nor are the native path's waiter threads (``tn-waiter``: a pool
    per native backend that grows to the most ops without a future it ran at once, gone with the backend), at most
    :data:`NATIVE_WAITERS_PER_COMM` per live communicator.

    Live Communicators (``live_comms``, counted without a garbage collection) may differ by at most
    :data:`LIVE_COMMS_SLACK`: every superseded generation's Communicator must be freed by reference counting the moment
    the member lets go of it -- one kept in a reference cycle waits for a full collection, which a long job runs
    rarely (a 2,000-fault soak's survivors held 35 and 73 of them)."""
    if base is None or end is None:
        return {"ok": False, "why": "the survivor's samples at the warm-up point and at the end are not both there "
                                    "(too few faults?): the check was not made", "base": base, "end": end}
    faults = max(1, end["faults"] - base["faults"])
    waiters = {k: (r.get("py_threads") or {}).get(WAITER, 0) for k, r in (("base", base), ("end", end))}
    native = {k: (r.get("thread_names") or {}).get(NATIVE_WAITER, 0) for k, r in (("base", base), ("end", end))}
    growth = {"threads": (end["threads"] - waiters["end"] - native["end"])
              - (base["threads"] - waiters["base"] - native["base"]),
              "fds": end["fds"] - base["fds"], "rss_kib": end["rss_kib"] - base["rss_kib"]}
    allowed = growth_per_fault * (end["faults"] - base["faults"])
    live = end.get("live_comms")
    waiters_ok = live is None or (waiters["end"] <= live and native["end"] <= NATIVE_WAITERS_PER_COMM * live)
    comms = {k: r.get("live_comms") for k, r in (("base", base), ("end", end))}
    comms_ok = comms["base"] is None or comms["end"] is None or comms["end"] - comms["base"] <= LIVE_COMMS_SLACK
    return {"ok": growth["threads"] <= allowed and growth["fds"] <= allowed and waiters_ok and comms_ok
            and end["rss_kib"] <= base["rss_kib"] * (1 + rss_tolerance), "allowed_growth": allowed,
            "waiters": dict(waiters, native=native, ok=waiters_ok), "live_comms": dict(comms, ok=comms_ok),
            "base": base, "end": end, "growth": growth, "faults_between": end["faults"] - base["faults"],
            "per_fault": {k: v / faults for k, v in growth.items()},
            "rss_growth": end["rss_kib"] / base["rss_kib"] - 1}
