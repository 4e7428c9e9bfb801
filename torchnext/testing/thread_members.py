"""Fault-tolerant members as threads of one process, against an in-process coordinator: the fixture of tests that
need a few real members and no processes (members share the GIL, so the heartbeats are generous).

::

    with thread_coordinator(3) as coord:
        fts = [thread_member(coord, i, min_size=3) for i in range(3)]   # each joins when its thread first steps
        results = run_each([lambda ft=ft: train(ft) for ft in fts])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torchnext.ft import Coordinator, CoordinatorConfig, FaultTolerant, FaultTolerantConfig, MembershipConfig

__all__ = ["thread_coordinator", "thread_member"]

HEARTBEAT_INTERVAL_S = 0.1
HEARTBEAT_TIMEOUT_S = 3.0
"""Generous: member threads share one process (and the GIL) on a loaded machine; a member held up for a second is
not dead here."""


def thread_coordinator(initial_size: int, *, min_size: int | None = None, **membership: Any) -> Coordinator:
    """An in-process coordinator for ``initial_size`` thread members (``min_size`` defaults to all of them), with
    :data:`HEARTBEAT_TIMEOUT_S`; ``membership`` overrides any other :class:`~torchnext.ft.MembershipConfig` field."""
    cfg = {"min_size": initial_size if min_size is None else min_size, "initial_size": initial_size,
           "heartbeat_interval_s": HEARTBEAT_INTERVAL_S, "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
           "quorum_timeout_s": 10.0, **membership}
    return Coordinator(CoordinatorConfig(membership=MembershipConfig(**cfg)))


def thread_member(coord: Coordinator, member_id: int, *, min_size: int,
                  state_dict: Callable[[], Any] | None = None, load_state_dict: Callable[[Any], object] | None = None,
                  join: bool = True, **config: Any) -> FaultTolerant:
    """A member of ``coord``'s job (its address and token), with bounded waits (an op 20 s, a reconfiguration 15 s);
    ``config`` overrides any other :class:`~torchnext.ft.FaultTolerantConfig` field. ``state_dict``,
    ``load_state_dict`` and ``join``: as :class:`~torchnext.ft.FaultTolerant`'s (a member that joins a running job
    heals through them)."""
    cfg = {"timeout_s": 20.0, "reconfigure_timeout_s": 15.0, **config}
    return FaultTolerant(FaultTolerantConfig(coordinator=coord.address, token=coord.token, member_id=member_id,
                                             min_size=min_size, **cfg),
                         state_dict=state_dict, load_state_dict=load_state_dict, join=join)
