"""The fault-tolerant group never lets a backend write into the caller's tensors (ft/process_group.py).

An op abandoned by a reconfiguration keeps running in gloo (it cannot be cancelled) and may write into its buffers
later -- found by the FT-DDP chaos test: a survivor's late gloo write landed in DDP's reused bucket staging buffer
during the next generation's all_reduce, and the job committed NaN. Here the backend is a one-rank Communicator
whose ``all_reduce`` is wrapped so that the test sees which tensor the backend got, and can fail the op and then
write into the buffer "late", as an abandoned backend would.

These tests pin the Python path (``TORCHNEXT_NATIVE_PG=0``: the wrapped ``comm.all_reduce`` is a Python method the
native path never calls); the native path's staging is tested in test_ft_process_group_native.py.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from torchnext.comms.communicator import Communicator
from torchnext.comms.errors import PeerFailure
from torchnext.comms.work import Work, WorkStatus
from torchnext.ft.process_group import FaultTolerantProcessGroup

_AVG = dist.AllreduceOptions()
_AVG.reduceOp = dist.ReduceOp.AVG  # type: ignore[assignment]


class _Backend:
    """Wraps ``comm.all_reduce``: records the tensor it was given; ``fail_next`` makes the next op a Work that
    the test fails by hand (``fail()``), like a peer dying mid-op."""

    def __init__(self, comm: Communicator, ft: Any = None) -> None:
        self.seen: list[torch.Tensor] = []
        self.fail_next = False
        self.pending: Work | None = None
        self.ft = ft
        self.wrap(comm)

    def next_generation(self) -> None:
        """What a reconfiguration does after a failure: the failed generation's Communicator was aborted (a failed op
        of the group aborts it, so that its peers are released); the next one is a new Communicator."""
        assert self.comm.errored() is not None, "a failed op aborts its generation's Communicator"
        new = Communicator(dist.HashStore(), 0, 1, name=f"ft-staging-test.g{self.ft.generation + 1}")
        self.ft.generation += 1
        self.ft._newest_gen = self.ft.generation
        self.ft._comm = self.ft.comm = new
        self.wrap(new)

    def wrap(self, comm: Communicator) -> None:
        self.comm = comm
        real = comm.all_reduce

        def all_reduce(t: torch.Tensor, *args: Any, **kwargs: Any) -> Work:
            self.seen.append(t)
            if not self.fail_next:
                return real(t, *args, **kwargs)
            self.fail_next = False
            self.pending = Work(comm, "all_reduce", 999, None, [t], 30.0, None, True)
            self.pending.status = WorkStatus.IN_PROGRESS
            return self.pending

        comm.all_reduce = all_reduce  # type: ignore[method-assign]

    def fail(self) -> None:
        assert self.pending is not None
        self.pending._finish(WorkStatus.ERROR, PeerFailure("peer 1 died"), breaks_comm=False)


@pytest.fixture
def group(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("TORCHNEXT_NATIVE_PG", "0")
    comm = Communicator(dist.HashStore(), 0, 1, name="ft-staging-test")
    ft = SimpleNamespace(config=SimpleNamespace(name="staging"), rank=0, size=1, members=[0], member_id=0,
                         generation=1, _newest_gen=1, _comm=comm, comm=comm, on_reconfigure=lambda cb: None,
                         _early_vote=None)
    pg = FaultTolerantProcessGroup(ft)  # type: ignore[arg-type]
    backend = _Backend(comm, ft)
    yield pg, backend
    backend.comm.abort("test over")
    comm.abort("test over")


def test_the_backend_never_gets_the_callers_tensor_and_the_result_is_copied_back(group: Any) -> None:
    pg, backend = group
    t = torch.arange(8, dtype=torch.float32)
    pg.allreduce([t], _AVG).wait()
    assert backend.seen[-1] is not t and backend.seen[-1].data_ptr() != t.data_ptr()
    assert torch.equal(t, torch.arange(8, dtype=torch.float32))
    first = backend.seen[-1]
    u = torch.full((8,), 3.0)
    fut = pg.allreduce([u], _AVG).get_future()
    assert fut.wait()[0] is u and torch.equal(u, torch.full((8,), 3.0))
    assert backend.seen[-1] is first, "a buffer whose op succeeded is reused"


def test_a_failed_ops_buffer_is_dropped_and_its_late_writes_reach_nobody(group: Any) -> None:
    pg, backend = group
    grad = torch.ones(8)
    pg.allreduce([grad], _AVG).wait()  # a successful op: its buffer is in the pool
    pooled = backend.seen[-1]
    backend.fail_next = True
    work = pg.allreduce([grad], _AVG)
    fut = work.get_future()
    abandoned = backend.seen[-1]
    assert abandoned is pooled
    threading.Thread(target=backend.fail).start()
    assert fut.wait()[0] is grad
    assert torch.isnan(grad).all(), "a failed op marks the caller's tensor invalid"
    assert work.wait() is True  # recorded, not raised
    backend.next_generation()
    # the next generation's op on the same caller tensor: a fresh buffer, untouched by the abandoned op
    fresh = torch.full((8,), 5.0)
    pg.allreduce([fresh], _AVG).wait()
    assert backend.seen[-1] is not abandoned
    abandoned.fill_(-1.0)  # the abandoned backend finishes its op, late
    assert torch.equal(fresh, torch.full((8,), 5.0))
    again = torch.full((8,), 7.0)
    pg.allreduce([again], _AVG).wait()
    assert backend.seen[-1] is not abandoned, "a failed op's buffer never returns to the pool"


def test_a_wait_that_sees_the_failure_first_also_drops_the_buffer(group: Any) -> None:
    pg, backend = group
    t = torch.ones(4)
    backend.fail_next = True
    work = pg.allreduce([t], _AVG)
    abandoned = backend.seen[-1]
    threading.Timer(0.05, backend.fail).start()
    assert work.wait() is True
    assert torch.isnan(t).all()
    backend.next_generation()
    u = torch.ones(4)
    pg.allreduce([u], _AVG).wait()
    assert backend.seen[-1] is not abandoned and torch.equal(u, torch.ones(4))


def test_broadcast_and_coalesced_all_reduce_are_staged_too(group: Any) -> None:
    pg, backend = group
    a, b = torch.ones(3), torch.full((5,), 2.0)
    pg.allreduce_coalesced([a, b], _AVG).wait()
    assert all(s is not a and s is not b for s in backend.seen[-2:])
    assert torch.equal(a, torch.ones(3)) and torch.equal(b, torch.full((5,), 2.0))
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    c = torch.arange(4.0)
    pg.broadcast([c], opts).wait()
    assert torch.equal(c, torch.arange(4.0))


def test_bad_arguments_still_raise_at_once(group: Any) -> None:
    pg, _ = group
    with pytest.raises(TypeError, match=r"expected a torch\.Tensor"):
        pg.allreduce(["not a tensor"], _AVG)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="no tensors"):
        pg.allreduce_coalesced([], _AVG)
