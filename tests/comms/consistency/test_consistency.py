"""Consistency mode on real processes: every mismatch raises CollectiveMismatch on every rank, nobody dies.

Each rank is a process (``torchnext.testing.run_ranks``: parent-hosted store, bounded waits, children reaped).
Communicators get a generous timeout (connecting under load is slow); only the op meant to wait for a member that
never comes gets a short per-op timeout (``FAULT_S``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch

from torchnext.comms import CollectiveMismatch, CommAborted, Communicator, FlightRecorder, P2POp
from torchnext.testing import RankContext, run_ranks

FAULT_S = 2.0
SETUP_S = 60.0

Case = Callable[[Communicator, bool], object]


def _all_to_all_rows(comm: Communicator, me: bool) -> object:
    n = comm.size
    splits = [1] * n
    out_splits = [1] * n
    if me:  # sends 2 rows to rank 0, which expects 1 from it
        splits[0] = 2
    inp = torch.ones(sum(splits), 3)
    out = torch.empty(sum(out_splits), 3)
    return comm.all_to_all_single(out, inp, out_splits, splits)


def _all_to_all_chunks(comm: Communicator, me: bool) -> object:
    n = comm.size
    ins = [torch.ones(3 if me and j == 0 else 2) for j in range(n)]
    outs = [torch.empty(2) for _ in range(n)]
    return comm.all_to_all(outs, ins)


CASES: dict[str, tuple[Case, str]] = {
    # name: (what each rank calls -- the culprit's variant when `me` --, the field CollectiveMismatch names)
    "size": (lambda c, me: c.all_gather_single(torch.empty((6 if me else 4) * c.size), torch.ones(6 if me else 4)),
             "input_sizes"),
    "dtype": (lambda c, me: c.all_reduce(torch.ones(4, dtype=torch.int32 if me else torch.float32)), "dtypes"),
    "op": (lambda c, me: c.broadcast(torch.ones(4), 0) if me else c.all_reduce(torch.ones(4)), "op"),
    "root": (lambda c, me: c.broadcast(torch.ones(4), 1 if me else 0), "root"),
    "reduce_op": (lambda c, me: c.all_reduce(torch.ones(4), "max" if me else "sum"), "reduce_op"),
    # one rank skips a collective: its next one (a barrier) meets the others' all_reduce
    "skip": (lambda c, me: (None if me else c.all_reduce(torch.ones(4)), c.barrier()), "op"),
    # one rank issues an extra all_reduce where the others go on to a barrier
    "extra": (lambda c, me: (c.all_reduce(torch.ones(4)) if me else None, c.barrier()), "op"),
    "all_to_all_rows": (_all_to_all_rows, "splits"),
    "all_to_all_chunks": (_all_to_all_chunks, "splits"),
    "async": (lambda c, me: c.all_reduce(torch.ones(5 if me else 4), async_op=True), "input_sizes"),
}


def checked_body(ctx: RankContext, culprit: int) -> dict[str, Any]:
    comm = Communicator(ctx.store, ctx.rank, ctx.world_size, timeout=timedelta(seconds=SETUP_S),
                        check_collectives=True, name="chk")
    fr = FlightRecorder.attach(comm, capacity=200)
    me = ctx.rank == culprit
    out: dict[str, Any] = {}
    for name, (case, _) in CASES.items():
        t0 = time.perf_counter()
        try:
            case(comm, me)
            out[name] = None
        except CollectiveMismatch as exc:
            out[name] = {"culprits": list(exc.culprits), "field": exc.field, "message": str(exc),
                         "breaks": exc.breaks_communicator, "s": time.perf_counter() - t0}
        t = torch.full((3,), float(ctx.rank))
        comm.all_reduce(t)  # still usable: the refused op moved nothing anywhere
        out[f"{name}_after"] = t.tolist()
    out["errored"] = comm.errored()
    out["recorded_errors"] = [e["error"] for e in fr.entries() if e["state"] == "error"]
    comm.shutdown()
    return out


@pytest.mark.parametrize("world,culprit", [(3, 1), (4, 3)])
def test_every_mismatch_raises_on_every_rank(world: int, culprit: int) -> None:
    results = run_ranks(checked_body, world, args=(culprit,), timeout=240)
    expected_sum = float(sum(range(world)))
    for rank, out in enumerate(results):
        for name, (_, field) in CASES.items():
            got = out[name]
            assert got is not None, (rank, name)
            assert got["field"] == field, (rank, name, got)
            if field == "splits":  # pairwise: the culprit and the rank it disagrees with
                assert got["culprits"] == sorted({0, culprit}), (rank, name, got)
            else:
                assert got["culprits"] == [culprit], (rank, name, got)
            assert f"rank {culprit}" in got["message"], got["message"]
            assert "nothing was sent" in got["message"]
            assert got["breaks"] is False
            assert out[f"{name}_after"] == [expected_sum] * 3, (rank, name)
        assert out["errored"] is None
        # the Flight Recorder saw every refused op, with its reason
        assert len(out["recorded_errors"]) == len(CASES), out["recorded_errors"]
        assert all("CollectiveMismatch" in e for e in out["recorded_errors"])
    size = results[0]["size"]["message"]
    assert f"rank {culprit} entered all_gather_single #1 with input_sizes [6] where ranks" in size, size
    assert "have [4]" in size


def p2p_body(ctx: RankContext) -> dict[str, Any]:
    comm = Communicator(ctx.store, ctx.rank, ctx.world_size, timeout=timedelta(seconds=SETUP_S),
                        check_collectives=True, name="p2p")
    out: dict[str, Any] = {}
    peer = 1 - ctx.rank if ctx.rank < 2 else None
    if peer is not None:
        # 1. a send of 6 elements meets a receive of 4: both sides refuse, nothing is sent
        try:
            if ctx.rank == 0:
                comm.send(torch.ones(6), 1)
            else:
                comm.recv(torch.empty(4), 0)
            out["size"] = None
        except CollectiveMismatch as exc:
            out["size"] = (exc.field, list(exc.culprits), str(exc))
        # 2. a matching exchange still works afterwards, sync and batched
        buf = torch.empty(4)
        if ctx.rank == 0:
            comm.send(torch.arange(4.0), 1)
        else:
            comm.recv(buf, 0)
        out["sync"] = buf.tolist() if ctx.rank == 1 else None
        got = torch.empty(2)
        comm.batch_p2p([P2POp("send", torch.full((2,), float(ctx.rank)), peer), P2POp("recv", got, peer)])
        out["batch"] = got.tolist()
        # 3. async isend/irecv posted on both sides before either waits (must not deadlock under the mode)
        got2 = torch.empty(3)
        ws = [comm.send(torch.full((3,), 7.0 + ctx.rank), peer, async_op=True), comm.recv(got2, peer, async_op=True)]
        for w in ws:
            assert w is not None
            w.wait()
        out["async"] = got2.tolist()
        # 4. dtype: a sync batch where rank 1 receives int32
        try:
            t = torch.ones(2, dtype=torch.int32 if ctx.rank == 1 else torch.float32)
            comm.batch_p2p([P2POp("send" if ctx.rank == 0 else "recv", t, peer)])
            out["dtype"] = None
        except CollectiveMismatch as exc:
            out["dtype"] = (exc.field, list(exc.culprits))
    t = torch.ones(1)
    comm.all_reduce(t)
    out["after"] = t.item()
    comm.shutdown()
    return out


def test_p2p_pairs_compare_what_they_can() -> None:
    results = run_ranks(p2p_body, 3, timeout=240)
    for rank in (0, 1):
        out = results[rank]
        field, culprits, message = out["size"]
        assert (field, culprits) == ("p2p", [0, 1]), out
        assert "[6] float32 here" in message or "[4] float32 here" in message, message
        assert out["batch"] == [float(1 - rank)] * 2
        assert out["async"] == [7.0 + (1 - rank)] * 3
        assert out["dtype"] == ("p2p", [0, 1])
    assert results[1]["sync"] == [0.0, 1.0, 2.0, 3.0]
    assert all(out["after"] == 3.0 for out in results)


def arrival_body(ctx: RankContext, culprit: int, how: str) -> dict[str, Any]:
    comm = Communicator(ctx.store, ctx.rank, ctx.world_size, timeout=timedelta(seconds=SETUP_S),
                        check_collectives=True, name=f"arr-{how}")
    t = torch.ones(2)
    comm.all_reduce(t)
    others = ctx.world_size - 1
    if how == "extra":  # the culprit issues one all_reduce more; the others are done and shut down
        if ctx.rank != culprit:
            comm.shutdown()
            return {"shutdown": True}
        try:
            comm.all_reduce(t, timeout=FAULT_S)
            return {"error": None}
        except CollectiveMismatch as exc:
            return {"error": (exc.field, list(exc.culprits), str(exc), exc.breaks_communicator)}
    if ctx.rank == culprit:  # skips the last all_reduce
        if how == "shutdown":
            comm.shutdown()
            return {"shutdown": True}
        deadline = time.monotonic() + 60  # comes back late, after the others gave up
        while ctx.store.add("gave_up", 0) < others and time.monotonic() < deadline:
            time.sleep(0.05)
        try:
            comm.all_reduce(t)
            return {"late": None}
        except CollectiveMismatch as exc:
            return {"late": (exc.field, list(exc.culprits), str(exc), exc.breaks_communicator),
                    "errored": comm.errored() is not None}
    t0 = time.perf_counter()
    try:
        comm.all_reduce(t, timeout=FAULT_S)
        res: dict[str, Any] = {"error": None}
    except CollectiveMismatch as exc:
        res = {"error": (exc.field, list(exc.culprits), str(exc), exc.breaks_communicator)}
    res["s"] = time.perf_counter() - t0
    res["errored"] = comm.errored() is not None
    ctx.store.add("gave_up", 1)
    return res


@pytest.mark.parametrize("world,culprit,how", [(3, 1, "late"), (4, 2, "late"), (3, 2, "shutdown"),
                                               (4, 0, "shutdown"), (3, 1, "extra"), (4, 3, "extra")])
def test_a_member_that_never_comes_is_named(world: int, culprit: int, how: str) -> None:
    results = run_ranks(arrival_body, world, args=(culprit, how), timeout=240)
    if how == "extra":  # only the culprit has an op to raise from; the others had finished
        field, culprits, message, breaks = results[culprit]["error"]
        assert (field, culprits, breaks) == ("arrival", [culprit], True), results[culprit]
        assert f"rank {culprit} issued a collective more than the others" in message, message
        return
    for rank, out in enumerate(results):
        if rank == culprit:
            if how == "late":
                field, culprits, message, breaks = out["late"]
                assert (field, culprits, breaks) == ("arrival", [culprit], True), out
                assert f"this rank ({culprit}) entered all_reduce #2 after" in message, message
                assert out["errored"]
            continue
        field, culprits, message, breaks = out["error"]
        assert (field, culprits, breaks) == ("arrival", [culprit], True), out
        assert f"rank {culprit} did not enter all_reduce #2" in message, message
        assert out["errored"]  # the side group's pairs closed: errored, like after a timeout
        if how == "shutdown":  # named at once, from the member's own marker
            assert "shut down its communicator after collective #1" in message, message
            assert out["s"] < FAULT_S, out["s"]
        else:
            assert out["s"] >= FAULT_S * 0.9, out["s"]


def abort_body(ctx: RankContext) -> dict[str, Any]:
    import threading

    comm = Communicator(ctx.store, ctx.rank, ctx.world_size, timeout=timedelta(seconds=SETUP_S),
                        check_collectives=True, name="abort")
    comm.all_reduce(torch.ones(1))
    if ctx.rank == 1:
        ctx.store.wait(["aborted"], timedelta(seconds=60))
        return {}
    timer = threading.Timer(0.5, comm.abort, args=("test gave up",))
    timer.start()
    t0 = time.perf_counter()
    try:
        comm.all_reduce(torch.ones(1))  # blocked in the check: rank 1 never comes
        out: dict[str, Any] = {"error": None}
    except CommAborted as exc:
        out = {"error": type(exc).__name__}
    out["after_abort_s"] = time.perf_counter() - t0 - 0.5
    ctx.store.set("aborted", "1")
    return out


def test_abort_unblocks_a_check_at_once() -> None:
    out = run_ranks(abort_body, 2, timeout=120)[0]
    assert out["error"] == "CommAborted"
    assert out["after_abort_s"] < 0.2, out


def option_body(ctx: RankContext) -> Any:
    import os

    os.environ["TORCHNEXT_CHECK_COLLECTIVES"] = "1"
    on = Communicator(ctx.store, ctx.rank, 2, timeout=timedelta(seconds=SETUP_S), name="env-on")
    del os.environ["TORCHNEXT_CHECK_COLLECTIVES"]
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    detail = Communicator(ctx.store, ctx.rank, 2, timeout=timedelta(seconds=SETUP_S), name="env-detail")
    off = Communicator(ctx.store, ctx.rank, 2, timeout=timedelta(seconds=SETUP_S), name="explicit-off",
                       check_collectives=False)
    del os.environ["TORCH_DISTRIBUTED_DEBUG"]
    plain = Communicator(ctx.store, ctx.rank, 2, timeout=timedelta(seconds=SETUP_S), name="plain")
    child = on.split([0, 1])
    assert child is not None
    no_hooks = not plain._check_hooks.snapshot and not off._check_hooks.snapshot
    return on.check_collectives, detail.check_collectives, off.check_collectives, plain.check_collectives, \
        child.check_collectives, no_hooks


def test_env_vars_and_split_children() -> None:
    for res in run_ranks(option_body, 2, timeout=120):
        assert res == (True, True, False, False, True, True)


def test_bad_option_value_fails_before_connecting() -> None:
    import torch.distributed as dist

    store = dist.HashStore()
    with pytest.raises(TypeError, match="check_collectives must be a bool"):
        Communicator(store, 0, 1, check_collectives="yes")  # type: ignore[arg-type]


def pg_body(ctx: RankContext) -> dict[str, Any]:
    import os

    import torch.distributed as dist

    import torchnext  # noqa: F401  (registers the "torchnext" backend)

    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"  # torch's own switch turns the mode on for torchnext groups
    dist.init_process_group(backend="torchnext", store=ctx.store, rank=ctx.rank, world_size=ctx.world_size,
                            timeout=timedelta(seconds=SETUP_S))
    out: dict[str, Any] = {}
    n = 6 if ctx.rank == 1 else 4
    try:
        dist.all_gather_into_tensor(torch.empty(n * ctx.world_size), torch.ones(n))
        out["world"] = None
    except dist.DistBackendError as exc:  # torch's class: existing except clauses keep working
        out["world"] = (type(exc).__name__, list(getattr(exc, "culprits", ())))
    t = torch.ones(2)
    dist.all_reduce(t)
    out["after"] = t.tolist()
    sub = dist.new_group([0, 1])
    if ctx.rank < 2:
        try:
            dist.broadcast(torch.ones(3), src=ctx.rank, group=sub)  # each thinks it is the root
            out["sub"] = None
        except dist.DistBackendError as exc:
            out["sub"] = (type(exc).__name__, getattr(exc, "field", None))
    dist.destroy_process_group()
    return out


def test_process_group_mode_from_torch_distributed_debug() -> None:
    for rank, out in enumerate(run_ranks(pg_body, 3, timeout=240)):
        assert out["world"] == ("CollectiveMismatch", [1]), out
        assert out["after"] == [3.0, 3.0]
        if rank < 2:
            assert out["sub"] == ("CollectiveMismatch", "root"), out
