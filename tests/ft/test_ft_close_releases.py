"""A member that leaves leaves nothing of itself behind: ``ft.close()`` takes its process group out of torch's group
tables, and its generations' Communicators (with their native backends) become garbage. Before, torch's tables held
every closed member's group -- and through it each of its generations -- for the life of the process."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch
import torch.distributed as dist

from torchnext.comms import communicator
from torchnext.ft import FaultTolerant
from torchnext.testing.thread_members import thread_coordinator, thread_member

pytestmark = pytest.mark.timeout(120)


def _steps(ft: FaultTolerant, n: int) -> None:
    for _ in range(n):
        with ft.step() as step:
            ft.process_group.allreduce([torch.ones(4)]).wait()
            step.commit()


def test_a_closed_members_group_and_generations_are_released() -> None:
    world = dist.distributed_c10d._world
    with thread_coordinator(1) as coord:
        a = thread_member(coord, 0, min_size=1)
        a.join()
        stop = threading.Event()
        trainer = threading.Thread(target=lambda: [_steps(a, 1) for _ in iter(stop.is_set, True)], daemon=True)
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
