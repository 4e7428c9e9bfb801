"""A member that leaves leaves nothing of itself behind: ``ft.close()`` takes its process group out of torch's group
tables, and its generations' Communicators (with their native backends) become garbage. Before, torch's tables held
every closed member's group -- and through it each of its generations -- for the life of the process."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from torchnext.comms import communicator
from torchnext.ft import FaultTolerant
from torchnext.testing import ft_parallel
from torchnext.testing.thread_members import thread_coordinator, thread_member

pytestmark = pytest.mark.timeout(120)


def _steps(ft: FaultTolerant, n: int) -> None:
    for _ in range(n):
        with ft.step() as step:
            ft.process_group.allreduce([torch.ones(4)]).wait()
            step.commit()


def _training(step: Callable[[], object]) -> tuple[threading.Event, threading.Thread]:
    """A thread (not started yet) that calls ``step()`` until the event is set: the survivor training beside the
    members that join and close."""
    stop = threading.Event()
    return stop, threading.Thread(target=lambda: [step() for _ in iter(stop.is_set, True)], daemon=True)


def test_a_closed_members_group_and_generations_are_released() -> None:
    world = dist.distributed_c10d._world
    with thread_coordinator(1) as coord:
        a = thread_member(coord, 0, min_size=1)
        a.join()
        stop, trainer = _training(lambda: _steps(a, 1))
        trainer.start()
        gone: list[weakref.ref[object]] = []
        pgs: list[weakref.ref[object]] = []
        try:
            for k in range(2):
                b = thread_member(coord, 100 + k, min_size=1)
                b.join()
                _steps(b, 2)
                pg = b.process_group
                assert pg in world.pg_map
                gone.extend(weakref.ref(c) for c in communicator._LIVE if c.name.startswith("ft.") and c.rank == 1)
                pgs.append(weakref.ref(pg))
                b.close()
                assert pg not in world.pg_map and pg not in world.pg_names and pg not in world.pg_to_tag
                del b, pg
        finally:
            stop.set()
            trainer.join(30)
        assert gone, "the joining members ran no generation of their own: nothing was checked"
        assert a.process_group in world.pg_map, "closing another member unregistered this one's group"
        for _ in range(3):
            gc.collect()
        alive = [r() for r in gone if r() is not None]
        assert not alive, f"closed members' Communicators still reachable: {alive}"
        assert all(r() is None for r in pgs), "a closed member's process group is still reachable"
        a.close()
        assert a.process_group not in world.pg_map


def test_superseded_generations_are_freed_without_a_garbage_collection() -> None:
    """Every generation a survivor leaves behind, and every Communicator of a member that closed, is freed by
    reference counting the moment it is let go -- no cycle keeps it for a full collection, which a long job runs
    rarely (before: each generation's Communicator and native backend referred to each other through the
    Communicator's hooks; a 2,000-fault soak's survivors held 35 and 73 of them)."""
    seen: dict[int, weakref.ref[object]] = {}  # every generation's Communicator either member stepped in

    def note(ft: FaultTolerant) -> None:
        comm = ft.comm
        seen.setdefault(id(comm), weakref.ref(comm))

    def steps(ft: FaultTolerant, n: int) -> None:
        for _ in range(n):
            _steps(ft, 1)
            note(ft)

    with thread_coordinator(1) as coord:
        a = thread_member(coord, 0, min_size=1)
        a.join()
        stop, trainer = _training(lambda: steps(a, 1))
        gc.collect()
        gc.disable()
        try:
            trainer.start()
            for k in range(2):
                b = thread_member(coord, 200 + k, min_size=1)
                b.join()
                steps(b, 2)
                b.close()
                del b
            stop.set()
            trainer.join(30)
            current = a.comm
            refs = [r for r in seen.values() if r() is not current]
            assert len(refs) >= 3, "too few generations were superseded: nothing much was checked"
            deadline = time.monotonic() + 10.0  # a backend thread's completion callback may hold one a moment
            while any(r() is not None for r in refs) and time.monotonic() < deadline:
                time.sleep(0.05)
            kept = [r() for r in refs if r() is not None]
            assert not kept, (f"superseded or closed members' Communicators kept alive: {kept}; held by "
                              f"{ft_parallel._referrer_chains(kept, depth=14, budget=600)}")
            del kept, current
        finally:
            stop.set()
            gc.enable()
        a.close()
