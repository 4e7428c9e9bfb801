"""Every collective x dtype x sync/async on 2, 3 and 4 real processes, against results computed independently.

Each rank builds the deterministic inputs of *all* ranks with plain torch and derives the expected output with
torch's own reductions (``torch.stack(...).sum(0)``, ``.prod``, ``.amin``...), so the oracle shares no code with
the Communicator. One spawned group per world size runs the whole matrix (process start is the expensive part).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import pytest
import torch

from torchnext.comms import Communicator, P2POp, ReduceOp, Work, WorkStatus
from torchnext.testing import RankContext, run_ranks

DTYPES = (torch.float32, torch.bfloat16, torch.int64)
N = 5  # elements per chunk: odd on purpose


def x(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Deterministic small integers in [-2, 2] (exact in bfloat16 under sums/products of <= 4 ranks)."""
    return ((torch.arange(n) + 3 * rank + 5 * salt) % 5 - 2).to(dtype)


_BITWISE = {ReduceOp.BAND: torch.bitwise_and, ReduceOp.BOR: torch.bitwise_or, ReduceOp.BXOR: torch.bitwise_xor}


def reduce_ref(xs: list[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    if op in _BITWISE:  # integer inputs only: reduce exactly, in the input dtype
        acc = xs[0].clone()
        for t in xs[1:]:
            acc = _BITWISE[op](acc, t)
        return acc
    s = torch.stack([t.double() for t in xs])
    out = {
        ReduceOp.SUM: lambda: s.sum(0),
        ReduceOp.PRODUCT: lambda: s.prod(0),
        ReduceOp.MIN: lambda: s.amin(0),
        ReduceOp.MAX: lambda: s.amax(0),
        ReduceOp.AVG: lambda: s.mean(0),
    }[op]()
    return out.to(xs[0].dtype)


def ops_for(dtype: torch.dtype) -> list[ReduceOp]:
    """The ops defined for ``dtype``: AVG for floating dtypes only, the bitwise ops for integer dtypes only."""
    floating = dtype.is_floating_point
    return [op for op in ReduceOp if (op is not ReduceOp.AVG or floating) and (op not in _BITWISE or not floating)]


class Checker:
    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.failures: list[str] = []
        self.count = 0

    def run(self, label: str, async_op: bool, call: Callable[[bool], Work | None], expect: Callable[[], list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        self.count += 1
        try:
            ret = call(async_op)
            if async_op:
                if not isinstance(ret, Work):
                    raise AssertionError(f"async call returned {ret!r}")
                if ret.wait(timeout=30) is not True or not ret.is_completed() or ret.status is not WorkStatus.COMPLETED:
                    raise AssertionError(f"work not completed: {ret!r}")
                if ret.exception() is not None or ret.duration_s is None:
                    raise AssertionError("completed work has an exception or no duration")
            elif ret is not None:
                raise AssertionError(f"sync call returned {ret!r}")
            for got, want in expect():
                if got.dtype != want.dtype or got.shape != want.shape:
                    raise AssertionError(f"dtype/shape {got.dtype}{tuple(got.shape)} != {want.dtype}{tuple(want.shape)}")
                if want.dtype.is_floating_point:
                    torch.testing.assert_close(got, want)
                elif not torch.equal(got, want):
                    raise AssertionError(f"{got.tolist()} != {want.tolist()}")
        except Exception as exc:
            self.failures.append(f"rank {self.comm.rank} {label} async={async_op}: {exc!r}")


def _cases(ck: Checker, comm: Communicator, dtype: torch.dtype, a: bool) -> None:
    """Every op once for ``dtype`` (sync or async)."""
    ws, r = comm.size, comm.rank
    last = ws - 1
    tag = f"{dtype}"
    for op in ops_for(dtype):
        t = x(r, N, dtype)
        ck.run(f"all_reduce {op.name} {tag}", a, lambda a, t=t, op=op: comm.all_reduce(t, op, async_op=a),
               lambda t=t, op=op: [(t, reduce_ref([x(q, N, dtype) for q in range(ws)], op))])
    for op in (ReduceOp.SUM, ReduceOp.MAX, *([ReduceOp.AVG] if dtype.is_floating_point else [])):
        t = x(r, N, dtype, 1)
        ck.run(f"reduce {op.name} {tag}", a, lambda a, t=t, op=op: comm.reduce(t, 1 % ws, op, async_op=a),
               lambda t=t, op=op: [(t, reduce_ref([x(q, N, dtype, 1) for q in range(ws)], op))] if r == 1 % ws else [])
    t = x(r, N, dtype, 2)
    ck.run(f"broadcast {tag}", a, lambda a, t=t: comm.broadcast(t, last, async_op=a),
           lambda t=t: [(t, x(last, N, dtype, 2))])
    outs = [torch.empty(N, dtype=dtype) for _ in range(ws)]
    ck.run(f"all_gather {tag}", a, lambda a, outs=outs: comm.all_gather(outs, x(r, N, dtype, 3), async_op=a),
           lambda outs=outs: [(o, x(q, N, dtype, 3)) for q, o in enumerate(outs)])
    out = torch.empty(ws, N, dtype=dtype)
    ck.run(f"all_gather_single {tag}", a, lambda a, out=out: comm.all_gather_single(out, x(r, N, dtype, 4), async_op=a),
           lambda out=out: [(out, torch.stack([x(q, N, dtype, 4) for q in range(ws)]))])
    for op in (ReduceOp.SUM, ReduceOp.MIN, *([ReduceOp.AVG] if dtype.is_floating_point else [])):
        out = torch.empty(N, dtype=dtype)
        ck.run(f"reduce_scatter {op.name} {tag}", a,
               lambda a, out=out, op=op: comm.reduce_scatter(out, [x(r, N, dtype, j) for j in range(ws)], op, async_op=a),
               lambda out=out, op=op: [(out, reduce_ref([x(q, N, dtype, r) for q in range(ws)], op))])
        out = torch.empty(N, dtype=dtype)
        ck.run(f"reduce_scatter_single {op.name} {tag}", a,
               lambda a, out=out, op=op: comm.reduce_scatter_single(out, x(r, N * ws, dtype, 6), op, async_op=a),
               lambda out=out, op=op: [(out, reduce_ref([x(q, N * ws, dtype, 6)[r * N:(r + 1) * N] for q in range(ws)], op))])
    # all_to_all with uneven chunks: rank i sends i + j + 1 elements to rank j
    outs = [torch.empty(r + j + 1, dtype=dtype) for j in range(ws)]
    ck.run(f"all_to_all uneven {tag}", a,
           lambda a, outs=outs: comm.all_to_all(outs, [x(r, r + j + 1, dtype, j) for j in range(ws)], async_op=a),
           lambda outs=outs: [(o, x(j, j + r + 1, dtype, r)) for j, o in enumerate(outs)])
    in_splits = [r + j + 1 for j in range(ws)]
    out_splits = [j + r + 1 for j in range(ws)]
    out = torch.empty(sum(out_splits), 2, dtype=dtype)
    inp = torch.cat([x(r, 2 * s, dtype, j).view(s, 2) for j, s in enumerate(in_splits)])
    ck.run(f"all_to_all_single splits {tag}", a,
           lambda a, out=out, inp=inp: comm.all_to_all_single(out, inp, out_splits, in_splits, async_op=a),
           lambda out=out: [(out, torch.cat([x(j, 2 * s, dtype, r).view(s, 2) for j, s in enumerate(out_splits)]))])
    out = torch.empty(ws * 2, dtype=dtype)
    ck.run(f"all_to_all_single even {tag}", a,
           lambda a, out=out: comm.all_to_all_single(out, x(r, ws * 2, dtype, 8), async_op=a),
           lambda out=out: [(out, torch.cat([x(j, ws * 2, dtype, 8)[2 * r:2 * r + 2] for j in range(ws)]))])
    glist = [torch.empty(N, dtype=dtype) for _ in range(ws)] if r == 0 else None
    ck.run(f"gather {tag}", a, lambda a, g=glist: comm.gather(x(r, N, dtype, 9), g, 0, async_op=a),
           lambda g=glist: [(o, x(q, N, dtype, 9)) for q, o in enumerate(g or [])])
    t = torch.empty(N, dtype=dtype)
    slist = [x(100 + q, N, dtype) for q in range(ws)] if r == last else None
    ck.run(f"scatter {tag}", a, lambda a, t=t, s=slist: comm.scatter(t, s, last, async_op=a),
           lambda t=t: [(t, x(100 + r, N, dtype))])
    # point to point on a ring: async send, then recv
    t = torch.empty(N, dtype=dtype)

    def ring(a: bool, t: torch.Tensor = t) -> Work | None:
        w = comm.send(x(r, N, dtype, 11), (r + 1) % ws, tag=3, async_op=True)
        ret = comm.recv(t, (r - 1) % ws, tag=3, async_op=a)
        assert w is not None
        w.wait(timeout=30)
        return ret

    ck.run(f"send/recv ring {tag}", a, ring, lambda t=t: [(t, x((r - 1) % ws, N, dtype, 11))])
    t = torch.empty(N, dtype=dtype)
    ck.run(f"batch_p2p ring {tag}", a,
           lambda a, t=t: comm.batch_p2p([P2POp("recv", t, (r - 1) % ws), P2POp("send", x(r, N, dtype, 12), (r + 1) % ws)], async_op=a),
           lambda t=t: [(t, x((r - 1) % ws, N, dtype, 12))])
    ck.run(f"barrier {tag}", a, lambda a: comm.barrier(async_op=a), lambda: [])


def _matrix(ctx: RankContext) -> tuple[int, list[str]]:
    ws, r = ctx.world_size, ctx.rank
    comm = Communicator(ctx.store, r, ws, timeout=timedelta(seconds=60))
    ck = Checker(comm)
    for dtype in DTYPES:
        for a in (False, True):
            _cases(ck, comm, dtype, a)
    # several async ops in flight at once, waited in reverse order
    ts = [x(r, N, torch.float32, k) for k in range(4)]
    works = [comm.all_reduce(t, async_op=True) for t in ts]
    for w in reversed(works):
        assert w is not None
        w.wait(timeout=30)
    for k, t in enumerate(ts):
        if not torch.equal(t, reduce_ref([x(q, N, torch.float32, k) for q in range(ws)], ReduceOp.SUM)):
            ck.failures.append(f"rank {r}: concurrent async all_reduce {k} wrong: {t.tolist()}")
    ints = torch.ones(3, dtype=torch.int64)
    try:
        comm.all_reduce(ints, ReduceOp.AVG)
        ck.failures.append("integer AVG did not raise")
    except TypeError as exc:
        if "AVG" not in str(exc):
            ck.failures.append(f"integer AVG message unclear: {exc}")
    comm.shutdown()
    comm.shutdown()  # idempotent
    return ck.count, ck.failures


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_collective_matrix(world_size: int) -> None:
    results = run_ranks(_matrix, world_size, timeout=240)
    failures = [f for _, fs in results for f in fs]
    assert all(count >= 140 for count, _ in results), [c for c, _ in results]
    assert not failures, "\n".join(failures[:40])


def _late_peer_body(ctx: RankContext) -> int:
    """FSDP2's HSDP pattern on two communicators: async reduce-scatters into reused buffers, each output fed into an
    all_reduce on the other communicator, the peer arriving late now and then (past the unwaited-op grace). Every
    result must be the exact sum, also after the buffers were reused (a late write of an op declared complete would
    land in a later result)."""
    import random
    import time

    a = Communicator(ctx.store, ctx.rank, ctx.world_size, name="rs")
    b = Communicator(ctx.store, ctx.rank, ctx.world_size, name="ar")
    delays = random.Random(ctx.rank)
    n = 1 << 14
    inp = torch.empty(2 * n)
    outs = [torch.empty(n), torch.empty(n)]
    wrong = 0
    for i in range(120):
        out = outs[i % 2]
        inp.fill_(float(i + ctx.rank))
        if delays.random() < 0.2:
            time.sleep(0.03)
        work = a.reduce_scatter_single(out, inp, async_op=True)
        assert work is not None
        work.wait()
        ar = b.all_reduce(out, async_op=True)
        assert ar is not None
        ar.wait()
        expected = 2 * (2 * i + 1)  # i + (i + 1) reduce-scattered, then summed over the two ranks again
        wrong += int(not bool((out == expected).all()))
    a.shutdown()
    b.shutdown()
    return wrong


def test_async_reduce_scatter_with_a_late_peer_is_exact() -> None:
    assert run_ranks(_late_peer_body, 2, timeout=120) == [0, 0]
