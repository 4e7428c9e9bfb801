"""Window ops across ranks on both transports, checked against a reference computed independently here.

Each rank registers a tensor of its own size, shape and dtype; every op (put, get, get_rows, accumulate with each
reduce op, signal/wait_signal, async variants, flush, fence) is checked on every pair.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from torchnext.comms import Communicator, ReduceOp, WindowTransport
from torchnext.testing import RankContext, run_ranks, run_threads

DTYPES = [torch.float32, torch.int64, torch.bfloat16, torch.float64]


def _shape(r: int) -> tuple[int, int]:
    return (r + 3, 4)  # different sizes per rank


def _initial(r: int) -> torch.Tensor:
    rows, cols = _shape(r)
    return (torch.arange(rows * cols) + 100 * r).to(DTYPES[r % len(DTYPES)]).view(rows, cols)


def _ops_scenario(ctx: RankContext, transport: str) -> dict[str, Any]:
    r, n = ctx.rank, ctx.world_size
    comm = Communicator(ctx.store, r, n, timeout=timedelta(seconds=30), name="w")
    win = comm.new_window(_initial(r), transport=transport)
    out: dict[str, Any] = {"transport": [win.transport(p).value for p in range(n)]}
    out["numels"], out["shapes"] = win.numels, win.shapes
    out["dtypes"] = [str(d) for d in win.dtypes]
    out["segment_gone"] = not os.path.exists(win._segment.path)
    keys = dist.PrefixStore("window0", comm.store)  # this rank's keys (and rank 0's token) are deleted after setup
    out["keys_gone"] = not any(keys.check([k]) for k in [f"meta/{r}", f"tcp/{r}"] + (["token"] if r == 0 else []))
    # epoch 1: reads of the initial memory (sync, async, out=, get_rows)
    gets: dict[int, Any] = {}
    for p in range(n):
        g = win.get(p, 2, 5)
        w = win.get(p, async_op=True)
        o = torch.empty(3, dtype=win.dtypes[p])
        win.get(p, 1, 3, out=o)
        rows = win.get_rows(p, torch.tensor([p + 2, 0, 1, p + 2]))
        wr = win.get_rows(p, [1], async_op=True)
        assert not isinstance(w, torch.Tensor) and not isinstance(wr, torch.Tensor)
        gets[p] = (g.tolist(), w.result()[0].tolist(), o.tolist(), rows.tolist(), wr.result()[0].tolist(),
                   w.status.name)
    out["gets"] = gets
    win.fence()
    # epoch 2: every rank puts its rank id into element r of every peer, accumulates into row 1
    for p in range(n):
        dt = win.dtypes[p]
        win.put(torch.tensor([10 * r + 1], dtype=dt), p, r)
        win.accumulate(torch.full((4,), r + 1, dtype=dt), p, 4, ReduceOp.SUM)
        w = win.accumulate(torch.full((4,), r + 2, dtype=dt), p, 8, "max", async_op=True)
        assert w is not None
        win.flush(p)
        out.setdefault("flushed", []).append(w.is_completed())
    win.fence()
    out["after_epoch2"] = win.tensor.view(-1).tolist()
    win.fence()  # nobody writes epoch 3 before everyone read epoch 2
    # epoch 3: product and min on the last row, one rank at a time through signals (a token ring)
    last = (_shape(r)[0] - 1) * 4
    prev, nxt = (r - 1) % n, (r + 1) % n
    if r != 0:
        win.wait_signal(prev, 1, timeout=20)
    for p in range(n):
        plast = (_shape(p)[0] - 1) * 4
        win.accumulate(torch.full((2,), 2, dtype=win.dtypes[p]), p, plast, ReduceOp.PRODUCT)
        win.accumulate(torch.full((2,), -r, dtype=win.dtypes[p]), p, plast + 2, ReduceOp.MIN)
    win.signal(nxt)
    if r == 0:
        win.wait_signal(prev, 1, timeout=20)
    win.fence()
    out["last_row"] = win.tensor.view(-1)[last:].tolist()
    win.fence()
    # signal ordering: a put, then a signal to the same target; the target sees the put once it sees the signal
    payload = torch.full((4,), 7 + r, dtype=win.dtypes[nxt])
    win.put(payload, nxt, 0, async_op=True)
    win.signal(nxt, 5, async_op=True)
    got = win.wait_signal(prev, 6, timeout=20)  # 1 (ring) + 5
    out["ordered"] = (got, win.tensor.view(-1)[:4].tolist())
    out["counts"] = [win.signal_count(p) for p in range(n)]
    win.close()
    comm.shutdown()
    return out


def _reference(n: int) -> list[dict[str, Any]]:
    mem = [_initial(r).clone().view(-1).double() for r in range(n)]
    res = []
    for r in range(n):
        t = mem[r].clone()
        for o in range(n):
            t[o] = 10 * o + 1
        t[4:8] += sum(o + 1 for o in range(n))
        t[8:12] = torch.maximum(t[8:12], torch.tensor(float(n + 1)))
        last = (_shape(r)[0] - 1) * 4
        after2 = t.clone()
        t[last : last + 2] *= 2**n
        t[last + 2 : last + 4] = torch.minimum(t[last + 2 : last + 4], torch.tensor(float(-(n - 1))))
        res.append({"after_epoch2": after2, "last_row": t[last:]})
    return res


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("world", [2, 3])
def test_every_op_matches_reference(transport: str, world: int) -> None:
    results = run_ranks(_ops_scenario, world, args=(transport,), timeout=90)
    ref = _reference(world)
    for r, res in enumerate(results):
        assert res["transport"] == [transport] * world
        assert res["numels"] == [_shape(p)[0] * 4 for p in range(world)]
        assert res["shapes"] == [_shape(p) for p in range(world)]
        assert res["dtypes"] == [str(DTYPES[p % 4]) for p in range(world)]
        assert res["segment_gone"], "the owner unlinks its shm segment once peers mapped it"
        assert res["keys_gone"]
        for p, (g, whole, o, rows, row1, status) in res["gets"].items():
            init = _initial(p)
            flat = init.view(-1)
            assert g == flat[2:7].tolist() and whole == flat.tolist() and o == flat[1:4].tolist()
            assert rows == init[[p + 2, 0, 1, p + 2]].tolist() and row1 == init[[1]].tolist()
            assert status == "COMPLETED"
        assert all(res["flushed"])
        dt = DTYPES[r % 4]
        assert res["after_epoch2"] == ref[r]["after_epoch2"].to(dt).tolist()
        assert res["last_row"] == ref[r]["last_row"].to(dt).tolist()
        prev = (r - 1) % world
        got, first4 = res["ordered"]
        assert got == 6 and first4 == [7 + prev] * 4  # the put is visible once its signal is
        assert res["counts"][prev] == 6


_RACE_NUMEL = 1 << 17  # large enough that unlocked read-modify-writes overlap (the test fails without the lock)


def _accumulate_race(ctx: RankContext, transport: str | None, iters: int, fake_hosts: int = 0) -> Any:
    n = ctx.world_size
    if fake_hosts:  # pretend ranks live on `fake_hosts` hosts: shm within a "host", TCP across
        import torchnext.comms.window._connect as connect_mod

        connect_mod.host_key = lambda: f"fake-host-{ctx.rank % fake_hosts}"
    comm = Communicator(ctx.store, ctx.rank, n, timeout=timedelta(seconds=60), name="acc")
    with comm.new_window(torch.zeros(_RACE_NUMEL, dtype=torch.int64), transport=transport) as win:
        kinds = [win.transport(p).value for p in range(n)]
        ones = torch.ones(_RACE_NUMEL, dtype=torch.int64)
        win.fence()
        works = []
        for i in range(iters):
            for p in range(n):
                if i % 2:
                    works.append(win.accumulate(ones, p, 0, async_op=True))
                else:
                    win.accumulate(ones, p)
        for w in works:
            assert w is not None and w.wait()
        win.fence()
        result = torch.unique(win.tensor).tolist()
    comm.shutdown()
    return (kinds, result) if fake_hosts else result


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_concurrent_accumulates_lose_no_update(transport: str) -> None:
    iters = 40
    for res in run_ranks(_accumulate_race, 4, args=(transport, iters), timeout=120):
        assert res == [4 * iters]


def test_concurrent_accumulates_from_threads_of_one_process() -> None:
    # ranks as threads: the per-file thread lock (record locks do not exclude threads) carries atomicity
    iters = 120
    for res in run_threads(_accumulate_race, 4, args=("shm", iters), timeout=120):
        assert res == [4 * iters]


def _auto_and_empty(ctx: RankContext) -> dict[str, Any]:
    comm = Communicator(ctx.store, ctx.rank, ctx.world_size, timeout=timedelta(seconds=30), name="auto")
    t = torch.empty(0) if ctx.rank == 1 else torch.arange(6.0) * (ctx.rank + 1)
    with comm.new_window(t) as win:
        kinds = [win.transport(p) for p in range(ctx.world_size)]
        empty = win.get(1).tolist()
        full = win.get(0).tolist()
        win.put(torch.empty(0), 1, 0)
        win.fence()
    comm.shutdown()
    return {"kinds": kinds, "empty": empty, "full": full}


def test_auto_transport_is_shm_on_one_host_and_empty_registrations_work() -> None:
    for res in run_ranks(_auto_and_empty, 3, timeout=60):
        assert res["kinds"] == [WindowTransport.SHM] * 3
        assert res["empty"] == [] and res["full"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_mixed_transports_share_the_target_lock() -> None:
    # ranks 0, 2 on "host 0" and 1, 3 on "host 1": each target gets accumulates from a same-host peer (shm, its
    # file lock) and from other-host peers (TCP, applied by its service thread under the same lock)
    iters = 100
    for r, (kinds, res) in enumerate(run_ranks(_accumulate_race, 4, args=(None, iters, 2), timeout=120)):
        assert kinds == ["shm" if p % 2 == r % 2 else "tcp" for p in range(4)]
        assert res == [4 * iters]
