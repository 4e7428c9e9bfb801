"""The torchnext process group's own surface: ``comm.as_process_group()``, errors on bad input, Work semantics (a
future never raises), hooks and the Flight Recorder behind ``dist.*``, the ``torchnext run`` launcher, and the
environment variables mirrored from torch."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import torchnext  # noqa: F401  (registers the "torchnext" backend)
from torchnext._config import env_config
from torchnext.comms import CommAborted, Communicator, TorchnextProcessGroup
from torchnext.comms.process_group.launch import swap_backend
from torchnext.testing import RankContext, run_ranks

pytestmark = pytest.mark.timeout(300)


# ------------------------------------------------------------------------------------------ as_process_group
def as_pg_body(ctx: RankContext) -> dict[str, Any]:
    from torch.distributed.distributed_c10d import _resolve_process_group

    comm = Communicator(ctx.store, ctx.rank, ctx.world_size, name="mine", flight_recorder=True)
    seen: list[str] = []
    comm.register_pre_hook(lambda info: seen.append(info.op))
    pg = comm.as_process_group()
    out: dict[str, Any] = {"same": pg is comm.as_process_group(), "type": type(pg).__name__,
                           "resolved": _resolve_process_group(pg.group_name) is pg, "name": pg.group_name,
                           "size": (pg.size(), pg.rank())}
    t = torch.full((3,), float(ctx.rank + 1))
    dist.all_reduce(t, group=pg)  # no default group: dist.* on an explicit group
    out["sum"] = t.tolist()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2), process_group=pg)
    model(torch.randn(3, 4, generator=torch.Generator().manual_seed(ctx.rank))).sum().backward()
    out["grad_equal"] = model.module.weight.grad.clone().numpy()
    out["hooks_saw"] = sorted(set(seen))
    fr = comm.flight_recorder
    out["recorded"] = fr is not None and len(fr.entries()) >= 3
    comm.shutdown()
    return out


def test_as_process_group_wraps_an_existing_communicator() -> None:
    res = run_ranks(as_pg_body, 2, timeout=120)
    for r in res:
        assert r["same"] and r["type"] == "TorchnextProcessGroup" and r["resolved"] and r["name"] == "torchnext:mine"
        assert r["sum"] == [3.0, 3.0, 3.0] and r["recorded"]
        assert {"all_reduce", "broadcast"} <= set(r["hooks_saw"])  # DDP's parameter broadcast and gradient sums
    assert res[0]["size"] == (2, 0) and res[1]["size"] == (2, 1)
    assert res[0]["grad_equal"].tobytes() == res[1]["grad_equal"].tobytes()


# ------------------------------------------------------------------------------------------------- errors
def errors_body(ctx: RankContext, native: str) -> dict[str, str]:
    os.environ["TORCHNEXT_NATIVE_PG"] = native
    dist.init_process_group("torchnext", store=ctx.store, rank=ctx.rank, world_size=ctx.world_size)
    cases = {
        "meta": lambda: dist.all_reduce(torch.ones(2, device="meta")),
        "premul_int": lambda: dist.all_reduce(torch.ones(2, dtype=torch.int64), op=dist._make_nccl_premul_sum(2.0)),
        "band_float": lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND),
        "avg_int": lambda: dist.all_reduce(torch.ones(2, dtype=torch.int64), op=dist.ReduceOp.AVG),
        "two_tensors": lambda: dist.group.WORLD.allreduce([torch.ones(2), torch.ones(2)]),  # type: ignore[union-attr]
    }
    out = {}
    for name, fn in cases.items():
        try:
            fn()
            out[name] = "no error"
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    dist.barrier()  # the refusals left the group usable
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("native", ["0", "1"], ids=["python-path", "native-path"])
def test_bad_input_raises_before_issue_and_names_the_problem(native: str) -> None:
    """The same errors on both data paths (the native one sends these ops to the Python path's validation), except
    ``meta`` tensors: torch's dispatcher runs its own meta kernel for c10d ops on the native path, a no-op as with
    torch's own groups (docs/comms.md, "Known differences between the two paths")."""
    out = run_ranks(errors_body, 2, args=(native,), timeout=120)[0]
    if native == "0":
        assert out["meta"].startswith("ValueError") and "meta" in out["meta"] and "cpu" in out["meta"]
    else:
        assert out["meta"] == "no error"
    assert out["premul_int"].startswith("TypeError") and "PREMUL_SUM" in out["premul_int"]
    assert out["band_float"].startswith("TypeError") and "BAND" in out["band_float"]
    assert out["avg_int"].startswith("TypeError") and "AVG" in out["avg_int"]
    assert out["two_tensors"].startswith("ValueError") and "one tensor per call" in out["two_tensors"]


# ------------------------------------------------------------------------------------------- Work semantics
def work_body(ctx: RankContext) -> dict[str, Any]:
    dist.init_process_group("torchnext", store=ctx.store, rank=ctx.rank, world_size=ctx.world_size,
                            timeout=timedelta(seconds=30))
    out: dict[str, Any] = {}
    if ctx.rank == 0:
        t = torch.ones(4)
        work = dist.all_reduce(t, async_op=True)  # rank 1 joins only after the timed wait below
        assert work is not None
        try:
            work.wait(timedelta(milliseconds=200))
        except RuntimeError as exc:
            out["short_wait"] = str(exc)
        ctx.store.set("go", "1")
        out["then"] = (work.wait(), t.tolist())
        # a failure under a future: the future completes (outputs NaN), never raises; later calls raise
        stuck = torch.ones(4)
        stuck_int = torch.ones(4, dtype=torch.int64)
        work = dist.all_reduce(stuck, async_op=True)  # rank 1 never joins these
        work_int = dist.all_reduce(stuck_int, async_op=True)
        assert work is not None and work_int is not None
        fut, fut_int = work.get_future(), work_int.get_future()
        threading.Timer(0.2, lambda: dist.group.WORLD.abort()).start()  # type: ignore[union-attr]
        value, value_int = fut.wait(), fut_int.wait()
        out["future"] = (torch.isnan(value[0]).all().item(), torch.isnan(stuck).all().item())
        lowest = torch.iinfo(torch.int64).min
        out["future_int"] = ((value_int[0] == lowest).all().item(), (stuck_int == lowest).all().item())
        try:
            dist.all_reduce(torch.ones(1))
        except CommAborted as exc:
            out["after"] = type(exc).__name__
        ctx.store.set("done", "1")
    else:
        ctx.store.wait(["go"], timedelta(seconds=30))
        t = torch.ones(4)
        dist.all_reduce(t)
        ctx.store.wait(["done"], timedelta(seconds=30))
    return out


def test_work_wait_timeout_and_a_future_that_never_raises() -> None:
    out = run_ranks(work_body, 2, timeout=120)[0]
    assert "timed out" in out["short_wait"] and "still in flight" in out["short_wait"]
    assert out["then"] == (True, [2.0] * 4)
    assert out["future"] == (True, True)
    assert out["future_int"] == (True, True), "a failed op's integer outputs were not marked invalid"
    assert out["after"] == "CommAborted"


# ------------------------------------------------------------------------------------------------ launcher
def test_swap_backend() -> None:
    for name in (None, "gloo", "nccl", "cpu:gloo,cuda:nccl", "GLOO", "cpu:gloo, cuda:nccl"):
        assert swap_backend(name) == "torchnext", name
    assert swap_backend("mpi") == "mpi" and swap_backend("torchnext") == "torchnext"


def test_torchnext_run_gives_an_unedited_gloo_script_torchnext_groups(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import sys, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "sub = dist.new_group([0, 1], backend='gloo')\n"
        "t = torch.ones(2) * (dist.get_rank() + 1)\n"
        "dist.all_reduce(t, group=sub)\n"
        "print(f'RESULT {dist.get_rank()} {type(dist.group.WORLD).__name__} {type(sub).__name__} {t[0].item()} "
        "{sys.argv[1:]}', flush=True)\n"
        "dist.destroy_process_group()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHNEXT_", "MASTER_", "RANK", "WORLD_"))}
    proc = subprocess.run([sys.executable, "-m", "torchnext", "run", "--standalone", "--nproc-per-node", "2",
                           str(script), "--lr", "0.1"], capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = sorted(re.findall(r"RESULT \d \w+ \w+ [\d.]+ \[[^\]]*\]", proc.stdout))  # workers share stdout
    assert lines == [f"RESULT {r} TorchnextProcessGroup TorchnextProcessGroup 3.0 ['--lr', '0.1']" for r in range(2)]


# ------------------------------------------------------------------------------------------- environment
def test_flight_recorder_variables_mirror_torchs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in ("TORCHNEXT_FR_BUFFER_SIZE", "TORCHNEXT_FR_DUMP_DIR", "TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE"):
        monkeypatch.delenv(var, raising=False)
    assert (env_config().pg_fr_buffer_size, env_config().pg_fr_dump_dir) == (2000, None)
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "50")
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", str(tmp_path / "nccl_trace_rank_"))
    assert (env_config().pg_fr_buffer_size, env_config().pg_fr_dump_dir) == (50, str(tmp_path))
    monkeypatch.setenv("TORCHNEXT_FR_BUFFER_SIZE", "7")  # ours wins
    assert env_config().pg_fr_buffer_size == 7
    monkeypatch.setenv("TORCHNEXT_PG_CUDA_BACKEND", "mpi")
    with pytest.raises(ValueError, match="TORCHNEXT_PG_CUDA_BACKEND"):
        env_config()


def test_group_needs_matching_communicators() -> None:
    with pytest.raises(ValueError, match="at least one"):
        TorchnextProcessGroup({})
    with pytest.raises(TypeError, match="Communicator"):
        TorchnextProcessGroup({"cpu": object()})  # type: ignore[dict-item]


def test_invalid_values_per_dtype() -> None:
    """What marks a failed op's output: NaN for floating point (float8 and complex included), the extreme value of
    an integer type (signed: its minimum, unsigned: its maximum), nothing for bool."""
    import math

    from torchnext.comms.process_group.work import invalid_value, mark_invalid

    for dt in (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2,
               torch.complex64):
        v = invalid_value(dt)
        assert isinstance(v, float) and math.isnan(v), dt
    for dt in (torch.int8, torch.int16, torch.int32, torch.int64):
        assert invalid_value(dt) == torch.iinfo(dt).min, dt
    for dt in (torch.uint8, torch.uint16, torch.uint32, torch.uint64):
        assert invalid_value(dt) == torch.iinfo(dt).max, dt
    assert invalid_value(torch.bool) is None
    ts = [torch.ones(3), [torch.ones(2, dtype=torch.int32), torch.ones(2, dtype=torch.uint8)],
          torch.ones(2, dtype=torch.bool), torch.ones(2, dtype=torch.float8_e4m3fn)]
    mark_invalid(ts)
    assert torch.isnan(ts[0]).all() and torch.isnan(ts[3].float()).all()
    assert ts[1][0].tolist() == [torch.iinfo(torch.int32).min] * 2 and ts[1][1].tolist() == [255, 255]
    assert ts[2].tolist() == [True, True]


# ------------------------------------------------------------------------------------------ profiler records
def profiled_body(ctx: RankContext, native: str) -> dict[str, Any]:
    from torchnext.comms.process_group.profiling import annotate

    os.environ["TORCHNEXT_NATIVE_PG"] = native
    comm = Communicator(ctx.store, ctx.rank, ctx.world_size, name="prof")
    pg = comm.as_process_group()
    t = torch.ones(4)
    dist.all_reduce(t, group=pg)  # warm
    quiet = annotate("all_reduce")  # no profiler: the shared no-op
    with torch.profiler.profile() as prof:
        dist.all_reduce(t, group=pg)
        dist.broadcast(t, 0, group=pg)
        dist.all_reduce(t, group=pg, async_op=True).wait()
    events = [(e.name, e.thread, e.time_range.start, e.time_range.end) for e in prof.events()]
    ours = [e for e in events if e[0] == "torchnext:all_reduce"]
    inner = [e for e in events if e[0] == "gloo:all_reduce"]
    # ours on the issuing thread (as the dispatcher's c10d:: record of torch's groups), Gloo's on its worker thread
    # running the op, each begun after an issue of ours
    nested = len({o[1] for o in ours}) == 1 and all(any(o[2] <= i[2] for o in ours) for i in inner)
    on_native = bool(pg.native)
    comm.shutdown()
    return {"names": sorted({e[0] for e in events}), "ours": len(ours), "inner": len(inner), "nested": nested,
            "quiet_is_shared": quiet is annotate("broadcast"), "native": on_native}


def test_python_path_ops_are_named_in_profiler_traces() -> None:
    """torch's own groups show ``c10d::allreduce_`` (the dispatcher) and ``gloo:all_reduce``; an op of a torchnext
    group on the Python path shows ``torchnext:all_reduce`` on the issuing thread, and the inner backend's record."""
    for r in run_ranks(profiled_body, 2, args=("0",), timeout=120):
        assert r["native"] is False
        assert {"torchnext:all_reduce", "torchnext:broadcast"} <= set(r["names"]), r["names"]
        assert r["ours"] == 2 and r["inner"] >= 1 and r["nested"], r
        assert r["quiet_is_shared"]


def test_native_path_ops_show_torchs_own_records_in_profiler_traces() -> None:
    """On the native path a torchnext group's op is what a torch group's is to the profiler: the dispatcher's
    ``c10d::allreduce_`` and the inner backend's ``gloo:all_reduce`` (no Python record of ours)."""
    for r in run_ranks(profiled_body, 2, args=("1",), timeout=120):
        assert r["native"] is True
        assert {"c10d::allreduce_", "c10d::broadcast_", "gloo:all_reduce"} <= set(r["names"]), r["names"]
        assert r["ours"] == 0
