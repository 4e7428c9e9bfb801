"""The communicators a Flight Recorder knows: one :class:`Group` per communicator (or generation of one), with the
per-group sequence counters behind ``pg_status`` and the description behind ``pg_config``."""

from __future__ import annotations

from typing import Any

__all__ = ["Group", "unique_key"]

# Per-group counters: [collective seq, p2p seq, last enq/started/completed collective, last enq/started/completed p2p]
_G_CSEQ, _G_PSEQ, _G_CENQ, _G_CSTART, _G_CDONE, _G_PENQ, _G_PSTART, _G_PDONE = range(8)


class Group:
    """One communicator known to the recorder."""

    __slots__ = ("backend", "counters", "desc", "generation", "key", "name", "pg_id", "rank", "ranks", "time_added_ns",
                 "timeout_ms")

    def __init__(
        self,
        *,
        pg_id: int,
        key: str,
        name: str,
        desc: str,
        ranks: list[int],
        rank: int,
        backend: str,
        generation: int,
        timeout_ms: int | None,
        time_added_ns: int | None = None,
    ) -> None:
        self.pg_id = pg_id
        self.key = key
        self.name = name
        self.desc = desc
        self.ranks = ranks
        self.rank = rank
        self.backend = backend
        self.generation = generation
        self.timeout_ms = timeout_ms
        self.time_added_ns = time_added_ns
        self.counters = [0, 0, -1, -1, -1, -1, -1, -1]

    def config(self) -> dict[str, Any]:
        """This group's ``pg_config`` entry (PyTorch's fields -- ``name``, ``desc``, ``ranks`` as a string -- plus
        ours)."""
        return {
            "name": self.key,
            "desc": self.desc,
            "ranks": str(self.ranks),
            "ranks_list": list(self.ranks),
            "comm_name": self.name,
            "generation": self.generation,
            "backend": self.backend,
            "pg_id": self.pg_id,
            "rank": self.rank,
            "time_added_ns": self.time_added_ns,
        }

    def status(self) -> dict[str, int]:
        """This group's ``pg_status`` entry: last enqueued / started / completed sequence numbers (-1: none)."""
        c = self.counters
        return {
            "last_enqueued_collective": c[_G_CENQ],
            "last_started_collective": c[_G_CSTART],
            "last_completed_collective": c[_G_CDONE],
            "last_enqueued_p2p": c[_G_PENQ],
            "last_started_p2p": c[_G_PSTART],
            "last_completed_p2p": c[_G_PDONE],
        }


def unique_key(by_key: dict[str, Group], key: str, ranks: list[int], generation: int) -> str:
    """``key``, or ``key#2``, ``key#3``, ... when another group already holds it: the same name registered twice
    (e.g. sibling splits with one name) keeps ``pg_config`` keys unique; the same group again keeps its key."""
    base, n = key, 1
    while key in by_key:
        existing = by_key[key]
        if existing.ranks == ranks and existing.generation == generation:
            break
        n += 1
        key = f"{base}#{n}"
    return key
