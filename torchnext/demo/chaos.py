"""``torchnext demo --chaos N``: a seeded schedule of N random faults, and the figures a chaos run ends with.

The schedule (:func:`chaos_schedule`), in plain Python::

    rng = random.Random(seed)
    width = (steps - HEAD - TAIL) / n                       # one slot per fault, never two in one slot
    for i in range(n):
        step = HEAD + round((i + 0.5) * width + rng.uniform(-width / 4, width / 4))
        kind = rng.choice(pool)                             # kill, hang, coordinator, partition (root + netns)
        rank = rng.randrange(ranks)                         # -1 for coordinator

Rules that keep a schedule survivable:

* **One at a time.** Faults sit in their own slots, at least ``MIN_GAP`` steps apart, and the launcher fires a fault
  only once every earlier one has recovered (the killed group's warm spares joined, or the standby coordinator in
  office committed a step): a fault whose step comes earlier waits for that, so two recoveries never overlap.
* **Coordinator faults.** The launcher starts one standby coordinator per coordinator fault (members get every
  address, in order): after a takeover the next standby in the list is the one left for the next coordinator fault.
  So any number of coordinator faults is sound, each with its own standby.
* **Partition or coordinator, not both.** A partition needs the network lab, which hosts a single coordinator
  process with no standby: the first of the two kinds drawn removes the other from the pool. ``partition`` is in
  the pool only when running as root with working network namespaces.
* **Room at both ends.** No fault in the first ``HEAD`` steps (the job forms) or the last ``TAIL`` steps (the last
  fault's spares must heal and join before the job ends).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from torchnext.demo.fault import Fault

__all__ = ["HEAD", "MIN_GAP", "TAIL", "chaos_schedule", "max_chaos", "percentile"]

HEAD = 4
"""No chaos fault before this committed step (the first generation forms, the spares warm up)."""
TAIL = 8
"""No chaos fault in the last this many steps (the last fault's replacement heals and joins before the end)."""
MIN_GAP = 6
"""Fewest steps between two chaos faults (slot width)."""


def max_chaos(steps: int) -> int:
    """The most faults ``--chaos`` fits into ``steps`` committed steps: ``(steps - HEAD - TAIL) // MIN_GAP``."""
    return max(0, (steps - HEAD - TAIL) // MIN_GAP)


def chaos_schedule(n: int, *, steps: int, ranks: int, seed: int, partition: bool = False) -> list[Fault]:
    """``n`` faults (:class:`~torchnext.demo.fault.Fault`), in step order, drawn with ``random.Random(seed)``
    (module docstring).

    Args:
        n: how many faults (0: none).
        steps: the run's committed steps.
        ranks: local ranks (a rank fault picks one of ``range(ranks)``).
        seed: the schedule's seed (the same seed, the same schedule).
        partition: whether ``partition`` faults may be drawn (root with network namespaces).

    Raises:
        ValueError: ``n < 0``, or more faults than :func:`max_chaos` fits into ``steps``.
    """
    if n < 0:
        raise ValueError(f"--chaos must be >= 0, got {n}")
    most = max_chaos(steps)
    if n > most:
        raise ValueError(f"--chaos {n}: --steps {steps} fits at most {most} faults (one per {MIN_GAP} steps, none in "
                         f"the first {HEAD} or the last {TAIL} steps); raise --steps to at least "
                         f"{HEAD + TAIL + MIN_GAP * n}")
    if n == 0:
        return []
    rng = random.Random(seed)
    pool = ["kill", "hang", "coordinator", *(["partition"] if partition else [])]
    width = (steps - HEAD - TAIL) / n
    jitter = max(0.0, (width - MIN_GAP) / 2)  # a fault stays inside its own slot, MIN_GAP from its neighbours
    faults: list[Fault] = []
    for i in range(n):
        step = HEAD + round((i + 0.5) * width + rng.uniform(-jitter, jitter))
        kind = rng.choice(pool)
        if kind in ("partition", "coordinator"):
            other = "coordinator" if kind == "partition" else "partition"
            pool = [k for k in pool if k != other]
        rank = -1 if kind == "coordinator" else rng.randrange(ranks)
        faults.append(Fault(kind=kind, rank=rank, step=step))
    return faults


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank ``q``-th percentile (``q`` in (0, 100]): ``sorted(values)[ceil(q / 100 * n) - 1]``; None
    for no values. With few values p99 is the maximum."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]
