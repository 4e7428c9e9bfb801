"""Argument validation, thread-safety enforcement, backend registry, AVG emulation, from_env, lifecycle."""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from torchnext.comms import (
    BackendHandle,
    CommError,
    Communicator,
    P2POp,
    ReduceOp,
    get_backend,
    register_backend,
)
from torchnext.comms.backends import BackendConfig
from torchnext.testing import RankContext, run_ranks, run_threads


def _bad_inputs(ctx: RankContext) -> None:
    comm = Communicator(ctx.store, ctx.rank, 2, timeout=timedelta(seconds=30), name="bad")
    t = torch.ones(4)
    cases: list[tuple[type[Exception], str, Any]] = [
        (ValueError, "size \\* tensor.numel\\(\\) = 2 \\* 4 = 8", lambda: comm.all_gather_single(torch.empty(7), t)),
        (ValueError, "root=2 is out of range", lambda: comm.broadcast(t, 2)),
        (ValueError, "root=-1 is out of range", lambda: comm.reduce(t, -1)),
        (TypeError, "root must be an int", lambda: comm.gather(t, None, root="0")),
        (ValueError, "not contiguous", lambda: comm.all_reduce(torch.ones(4, 4).t())),
        (TypeError, "dtype mismatch", lambda: comm.all_gather_single(torch.empty(8, dtype=torch.int64), t)),
        (TypeError, "dtype mismatch", lambda: comm.all_gather([torch.empty(4), torch.empty(4, dtype=torch.bfloat16)], t)),
        (ValueError, "size mismatch", lambda: comm.all_gather([torch.empty(4), torch.empty(5)], t)),
        (ValueError, "must hold 2 tensors", lambda: comm.all_gather([torch.empty(4)], t)),
        (TypeError, "must be a torch.Tensor", lambda: comm.all_reduce([1, 2])),
        (ValueError, "unknown reduce op 'mean'", lambda: comm.all_reduce(t, "mean")),
        (TypeError, "must be a torchnext.comms.ReduceOp", lambda: comm.all_reduce(t, dist.ReduceOp.SUM)),
        (TypeError, "ReduceOp.AVG needs a floating dtype", lambda: comm.all_reduce(torch.ones(2, dtype=torch.int64), ReduceOp.AVG)),
        (ValueError, "is on meta", lambda: comm.all_reduce(torch.empty(2, device="meta"))),
        (ValueError, "input has 4 elements but must have size \\* output.numel\\(\\)", lambda: comm.reduce_scatter_single(torch.empty(3), t)),
        (ValueError, "input_splits sums to 3", lambda: comm.all_to_all_single(torch.empty(4), t, [2, 2], [1, 2])),
        (ValueError, "output_splits must have 2 entries", lambda: comm.all_to_all_single(torch.empty(4), t, [4], [2, 2])),
        (ValueError, "not divisible", lambda: comm.all_to_all_single(torch.empty(3), torch.ones(3))),
        (ValueError, "this rank", lambda: comm.send(t, ctx.rank)),
        (ValueError, "tag must be", lambda: comm.recv(t, 1 - ctx.rank, tag=-1)),
        (TypeError, "must be a P2POp", lambda: comm.batch_p2p([("send", t, 1)])),
        (ValueError, "non-empty list", lambda: comm.batch_p2p([])),
        (ValueError, "kind must be 'send' or 'recv'", lambda: comm.batch_p2p([P2POp("put", t, 1 - ctx.rank)])),  # type: ignore[arg-type]
        (ValueError, "timeout must be positive", lambda: comm.all_reduce(t, timeout=0)),
        (TypeError, "timeout must be a timedelta", lambda: comm.all_reduce(t, timeout="1s")),
        (ValueError, "gather_list must be None on non-root", lambda: comm.gather(t, [t, t], root=1 - ctx.rank) if ctx.rank == 0 else comm.gather(t, [t, t], root=0)),
    ]
    for exc_type, pattern, call in cases:
        with pytest.raises(exc_type, match=pattern):
            call()
    # nothing was issued: op ids were not consumed and the communicator is healthy
    seen: list[int] = []
    comm.register_pre_hook(lambda info: seen.append(info.op_id))
    comm.all_reduce(t)
    assert seen == [1] and t.tolist() == [2.0] * 4 and comm.errored() is None


def test_bad_inputs_raise_clear_errors_before_issue() -> None:
    run_threads(_bad_inputs, 2, timeout=60)


def _concurrent_issue(ctx: RankContext) -> str:
    comm = Communicator(ctx.store, ctx.rank, 2, timeout=timedelta(seconds=30), name="conc")
    if ctx.rank == 1:
        ctx.store.wait(["tried"], timedelta(seconds=30))
        comm.all_reduce(torch.ones(1))
        return ""
    started = threading.Event()
    t = threading.Thread(target=lambda: (started.set(), comm.all_reduce(torch.ones(1))))
    t.start()
    started.wait(5)
    time.sleep(0.3)  # the other thread is now blocked in its all_reduce (rank 1 has not joined)
    try:
        comm.barrier()
        msg = "no error"
    except RuntimeError as exc:
        msg = str(exc)
    ctx.store.set("tried", "1")
    t.join(30)
    return msg


def test_concurrent_issue_from_two_threads_is_refused() -> None:
    msg = run_threads(_concurrent_issue, 2, timeout=60)[0]
    assert "another thread is issuing" in msg and "barrier" in msg


def _no_avg_factory(cfg: BackendConfig) -> BackendHandle:
    handle = get_backend("gloo")(cfg)
    handle.native_avg = False
    return handle


def _avg_emulation(ctx: RankContext) -> list[list[float]]:
    comm = Communicator(ctx.store, ctx.rank, 2, backend="gloo-no-avg", name="avg")
    a = torch.tensor([1.0, 2.0]) * (ctx.rank + 1)
    comm.all_reduce(a, ReduceOp.AVG)
    b = torch.tensor([4.0, 8.0]) * (ctx.rank + 1)
    comm.reduce(b, 1, "avg")
    out = torch.empty(1, dtype=torch.bfloat16)
    comm.reduce_scatter(out, [torch.full((1,), 3.0 * (ctx.rank + 1), dtype=torch.bfloat16)] * 2, ReduceOp.AVG)
    w = comm.all_reduce(torch.ones(2), ReduceOp.AVG, async_op=True)
    assert w is not None
    return [a.tolist(), b.tolist(), out.float().tolist(), w.result()[0].tolist()]


def test_avg_emulated_when_backend_lacks_it() -> None:
    register_backend("gloo-no-avg", _no_avg_factory, replace=True)
    res = run_threads(_avg_emulation, 2, timeout=60)
    assert res[0][0] == res[1][0] == [1.5, 3.0]
    assert res[1][1] == [6.0, 12.0]  # root divides
    assert res[0][2] == res[1][2] == [4.5]
    assert res[0][3] == [1.0, 1.0]


def test_backend_registry_errors() -> None:
    with pytest.raises(ValueError, match=r"unknown backend 'nope'.*gloo"):
        get_backend("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_backend("gloo", _no_avg_factory)
    with pytest.raises(TypeError, match="callable"):
        register_backend("x", 3)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised on a machine without CUDA")
def test_nccl_backend_on_cpu_machine_raises_clearly() -> None:
    cfg = BackendConfig(store=dist.HashStore(), rank=0, size=1, timeout=timedelta(seconds=5), device=None, name="n")
    with pytest.raises(RuntimeError, match=r"NCCL|CUDA"):
        get_backend("nccl")(cfg)


def _nccl_allreduce(ctx: RankContext) -> float:
    torch.cuda.set_device(ctx.rank)
    comm = Communicator(ctx.store, ctx.rank, 2, backend="nccl")
    t = torch.ones(4, device="cuda")
    comm.all_reduce(t)
    torch.cuda.synchronize()
    comm.abort()
    return float(t[0].item())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="nccl backend needs 2 CUDA devices")
def test_nccl_all_reduce_and_abort() -> None:  # pragma: no cover - GPU only
    assert run_ranks(_nccl_allreduce, 2, timeout=120, start_method="spawn") == [2.0, 2.0]


def _from_env(ctx: RankContext) -> tuple[int, int, float]:
    os.environ.update(RANK=str(ctx.rank), WORLD_SIZE=str(ctx.world_size), MASTER_ADDR=ctx.store_host,
                      MASTER_PORT=str(ctx.store_port))
    comm = Communicator.from_env(name="env", timeout=30)
    t = torch.ones(1)
    comm.all_reduce(t)
    return comm.rank, comm.size, t.item()


def test_from_env_uses_torchrun_variables() -> None:
    assert run_ranks(_from_env, 2, timeout=60) == [(0, 2, 2.0), (1, 2, 2.0)]


def test_from_env_reports_missing_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="RANK"):
        Communicator.from_env()


def _lifecycle(ctx: RankContext) -> None:
    with pytest.raises(ValueError, match="rank must be an int in \\[0, 2\\)"):
        Communicator(ctx.store, 5, 2)
    with pytest.raises(ValueError, match="name"):
        Communicator(ctx.store, ctx.rank, 2, name="a/b")
    with pytest.raises(TypeError, match="Store"):
        Communicator("localhost:1234", ctx.rank, 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gloo backend communicates CPU"):
        Communicator(ctx.store, ctx.rank, 2, device="cuda")
    comm = Communicator(ctx.store, ctx.rank, 2, name="life")
    assert (comm.rank, comm.size, comm.ranks, comm.backend, str(comm.device)) == (ctx.rank, 2, [0, 1], "gloo", "cpu")
    assert "life" in repr(comm)
    assert comm.backend_handle.pg is not None and comm.timeout == timedelta(seconds=300)
    comm.store.set("probe", "1")  # namespaced: visible under torchnext/life/ in the shared store
    assert ctx.store.get("torchnext/life/probe") == b"1"
    comm.barrier()
    comm.shutdown()
    comm.shutdown()
    with pytest.raises(CommError, match="shut down"):
        comm.all_reduce(torch.ones(1))


def test_construction_errors_and_shutdown() -> None:
    run_threads(_lifecycle, 2, timeout=60)


def test_reduce_op_coercion() -> None:
    assert ReduceOp.coerce("SUM") is ReduceOp.SUM and ReduceOp.coerce(ReduceOp.MAX) is ReduceOp.MAX
    assert ReduceOp.AVG.to_c10d() == dist.ReduceOp.AVG
