"""Synthetic Flight Recorder traces: one recorder per rank, fed by a script, dumped to a folder.

For tests and documentation of the analyzer without a real job. Each :class:`Scenario` describes the ops each rank
issued (with controlled timestamps); :func:`write_scenario` records them with real :class:`FlightRecorder` objects
and dumps them. Real multi-rank runs with scripted faults live in ``tests/comms/test_fr_multirank.py``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from torchnext.comms.flight_recorder.recorder import FlightRecorder

__all__ = ["SCENARIOS", "Op", "Scenario", "write_scenario"]

_STEP = 10_000_000  # 10 ms between ops


@dataclass(frozen=True, kw_only=True)
class Op:
    """One op as a rank issued it."""

    op: str = "all_reduce"
    shape: tuple[int, ...] = (4,)
    dtype: torch.dtype = torch.float32
    peer: int | None = None
    delay_ns: int = 0
    """Entered this much later than the nominal time."""
    done: bool = True
    """False: still in flight at dump time."""
    pg: str = "world"


@dataclass(kw_only=True)
class Scenario:
    """Per-rank op lists; ``dead`` ranks write no dump."""

    world_size: int
    ops: dict[int, list[Op]]
    dead: frozenset[int] = frozenset()
    groups: dict[str, list[int]] = field(default_factory=dict)
    capacity: int = 100


def _uniform(world: int, n: int, edit: Callable[[int, int], Op | None] | None = None, **kw: object) -> Scenario:
    ops: dict[int, list[Op]] = {}
    for r in range(world):
        lst = []
        for i in range(n):
            op = edit(r, i) if edit is not None else Op()
            if op is not None:
                lst.append(op)
        ops[r] = lst
    return Scenario(world_size=world, ops=ops, **kw)  # type: ignore[arg-type]


def _hang_after(seq: int) -> Callable[[int, int], Op]:
    return lambda r, i: Op(done=i < seq - 1)


SCENARIOS: dict[str, Callable[[], Scenario]] = {
    "healthy": lambda: _uniform(3, 5),
    # rank 2 never enters all_reduce #3; ranks 0 and 1 are stuck in it
    "missing_rank": lambda: _uniform(3, 3, lambda r, i: None if (r == 2 and i == 2) else Op(done=i < 2)),
    "op_mismatch": lambda: _uniform(3, 3, lambda r, i: Op(op="broadcast" if (r == 1 and i == 1) else "all_reduce")),
    "size_mismatch": lambda: _uniform(3, 3, lambda r, i: Op(shape=(8,) if (r == 1 and i == 1) else (4,))),
    "dtype_mismatch": lambda: _uniform(
        3, 3, lambda r, i: Op(dtype=torch.bfloat16 if (r == 2 and i == 1) else torch.float32)
    ),
    "straggler": lambda: _uniform(3, 4, lambda r, i: Op(delay_ns=1_500_000_000 if (r == 1 and i == 2) else 0)),
    "unmatched_p2p": lambda: Scenario(
        world_size=2,
        ops={0: [Op(), Op(op="send", peer=1, done=False)], 1: [Op()]},
    ),
    # rank 2 died during all_reduce #3: no dump; ranks 0 and 1 are stuck in it
    "killed": lambda: _uniform(3, 3, _hang_after(3), dead=frozenset({2})),
}


def write_scenario(
    scenario: Scenario | str, directory: str | os.PathLike[str], *, formats: tuple[str, ...] = ("json",)
) -> list[Path]:
    """Record ``scenario`` with one FlightRecorder per rank and dump every live rank into ``directory``."""
    sc = SCENARIOS[scenario]() if isinstance(scenario, str) else scenario
    groups = sc.groups or {"world": list(range(sc.world_size))}
    paths = []
    t0 = time.time_ns() - 2 * _STEP * (1 + max((len(v) for v in sc.ops.values()), default=0))  # ends about now
    for r in range(sc.world_size):
        fr = FlightRecorder(sc.capacity, rank=r, world_size=sc.world_size, record_frames=True)
        pg_ids = {
            name: fr.add_group(name, ranks=ranks, desc="default_pg" if name == "world" else name)
            for name, ranks in groups.items()
            if r in ranks
        }
        for i, op in enumerate(sc.ops.get(r, [])):
            t = t0 + i * _STEP + op.delay_ns
            x = torch.zeros(op.shape, dtype=op.dtype)
            rid = fr.record(pg_ids[op.pg], op.op, inputs=[x], outputs=[x], op_id=i + 1, peer=op.peer, t_ns=t)
            if op.done:
                fr.complete(rid, t_ns=t + _STEP // 2)
        if r in sc.dead:
            continue
        for fmt in formats:
            paths.append(fr.dump(str(directory) + os.sep, format=fmt, reason="test"))
    return paths
