"""The native data path of torchnext process groups (``TORCHNEXT_NATIVE_PG=1``, torchnext.comms.native): results
bitwise equal to torch's own Gloo group, abort unblocking waiters at once, timeouts, Flight Recorder entries from the
C++ ring in the dumps, the switch to the Python path while a hook is registered and back, the build cache, and the
Python path when no compiler is there. Two ranks as real processes on loopback (torchnext.testing.run_ranks: a
TCPStore on a free port), every wait bounded."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import torchnext  # noqa: F401  (registers the "torchnext" backend)
from torchnext.comms import CommAborted, CommTimeout
from torchnext.comms import native as native_ext
from torchnext.comms.flight_recorder import analyze_dir
from torchnext.comms.flight_recorder.entries import format_entries
from torchnext.comms.native import _build
from torchnext.testing import RankContext, run_ranks
from torchnext.testing.procfs import thread_names

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module", autouse=True)
def _extension() -> None:
    """Build (or load) the extension once here, so the ranks load it from the cache."""
    st = native_ext.status()
    if not st.available:
        pytest.skip(f"the native extension cannot be built here: {st.reason}")


def _init(ctx: RankContext, timeout_s: float = 30.0, dump_dir: str | None = None) -> Any:
    os.environ["TORCHNEXT_NATIVE_PG"] = "1"
    if dump_dir is not None:
        os.environ["TORCHNEXT_FR_DUMP_DIR"] = dump_dir
    dist.init_process_group("torchnext", store=ctx.store, rank=ctx.rank, world_size=ctx.world_size,
                            timeout=timedelta(seconds=timeout_s))
    pg = dist.group.WORLD
    if not pg.native:  # type: ignore[union-attr]
        raise RuntimeError(f"rank {ctx.rank}: the group is not on the native path")
    return pg


def _native_records(pg: Any) -> int:
    """Ops the C++ ring recorded (the Python recorder's own count stays 0 while the group is native)."""
    native = pg._native
    return int(native._mod.fr_recorded(native.backend))


# --------------------------------------------------------------------------------------- bitwise equal to Gloo
def equal_body(ctx: RankContext) -> dict[str, Any]:
    pg = _init(ctx)
    gloo = dist.new_group(backend="gloo")
    r, n = ctx.rank, ctx.world_size
    gen = torch.Generator().manual_seed(1234 + r)
    out: dict[str, Any] = {}

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32)

    def check(name: str, ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
        out[name] = all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))

    before = _native_records(pg)
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT):
        x = rand(1000)
        a, b = x.clone(), x.clone()
        dist.all_reduce(a, op=op, group=pg)
        dist.all_reduce(b, op=op, group=gloo)
        check(f"all_reduce/{op}", [a], [b])
    xi = torch.randint(-100, 100, (64,), generator=gen)
    a, b = xi.clone(), xi.clone()
    dist.all_reduce(a, group=pg)
    dist.all_reduce(b, group=gloo)
    check("all_reduce/int64", [a], [b])

    x = rand(3, 5)
    a_out, b_out = [torch.empty(3, 5) for _ in range(n)], [torch.empty(3, 5) for _ in range(n)]
    dist.all_gather(a_out, x, group=pg)
    dist.all_gather(b_out, x, group=gloo)
    check("all_gather", a_out, b_out)
    a1, b1 = torch.empty(n * 6), torch.empty(n * 6)
    dist.all_gather_into_tensor(a1, x.flatten()[:6].clone(), group=pg)
    dist.all_gather_into_tensor(b1, x.flatten()[:6].clone(), group=gloo)
    check("all_gather_into_tensor", [a1], [b1])

    ins = [rand(7) for _ in range(n)]
    a, b = torch.empty(7), torch.empty(7)
    dist.reduce_scatter(a, [t.clone() for t in ins], group=pg)
    dist.reduce_scatter(b, [t.clone() for t in ins], group=gloo)
    check("reduce_scatter", [a], [b])
    flat = rand(n * 4)
    a, b = torch.empty(4), torch.empty(4)
    dist.reduce_scatter_tensor(a, flat.clone(), group=pg)
    dist.reduce_scatter_tensor(b, flat.clone(), group=gloo)
    check("reduce_scatter_tensor", [a], [b])

    x = rand(33)
    a, b = x.clone(), x.clone()
    dist.broadcast(a, 1, group=pg)
    dist.broadcast(b, 1, group=gloo)
    check("broadcast", [a], [b])

    x = rand(n * 3, 2)
    a, b = torch.empty(n * 3, 2), torch.empty(n * 3, 2)
    dist.all_to_all_single(a, x.clone(), group=pg)
    dist.all_to_all_single(b, x.clone(), group=gloo)
    check("all_to_all_single", [a], [b])
    # the list form (uneven chunks) against torch's Gloo group's all_to_all_single over the same rows
    sizes = [1 + j for j in range(n)]  # rank r sends sizes[j] rows to rank j ...
    chunks = [rand(sizes[j], 3) for j in range(n)]
    recv = [torch.empty(sizes[r], 3) for _ in range(n)]  # ... and receives sizes[r] rows from everyone
    dist.all_to_all(recv, [c.clone() for c in chunks], group=pg)
    ref = torch.empty(sizes[r] * n, 3)
    dist.all_to_all_single(ref, torch.cat(chunks), [sizes[r]] * n, sizes, group=gloo)
    check("all_to_all", [torch.cat(recv)], [ref])

    dist.barrier(group=pg)
    x = rand(9)
    if r == 0:
        dist.send(x, 1, group=pg)
        dist.send(x, 1, group=gloo)
    else:
        a, b = torch.empty(9), torch.empty(9)
        dist.recv(a, 0, group=pg)
        dist.recv(b, 0, group=gloo)
        check("send_recv", [a], [b])
    out["native_ops"] = _native_records(pg) - before
    out["still_native"] = pg.native
    out["python_recorded"] = pg.communicator().flight_recorder.recorded
    return out


def test_results_are_bitwise_equal_to_torchs_gloo_group() -> None:
    res = run_ranks(equal_body, 2, timeout=300)
    for rank, r in enumerate(res):
        native_ops, python_recorded = r.pop("native_ops"), r.pop("python_recorded")
        assert r.pop("still_native") is True
        assert all(r.values()), (rank, r)
        assert native_ops == 14  # every op above ran in C++: 5 all_reduces, 9 others (a send or a recv each)
        assert python_recorded == 0  # ... and none on the Python path
    assert "send_recv" in res[1]


# ------------------------------------------------------------------------------------------------------- abort
def abort_body(ctx: RankContext) -> dict[str, Any]:
    pg = _init(ctx)
    out: dict[str, Any] = {}
    if ctx.rank == 0:
        work = dist.all_reduce(torch.ones(4), async_op=True)  # rank 1 never joins it
        raised: list[tuple[str, float]] = []

        def waiter() -> None:
            try:
                work.wait()
            except Exception as exc:
                raised.append((type(exc).__name__, time.monotonic()))

        threads = [threading.Thread(target=waiter) for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        t_abort = time.monotonic()
        pg.abort()
        for t in threads:
            t.join(timeout=5)
        out["alive"] = sum(t.is_alive() for t in threads)
        out["raised"] = [(name, at - t_abort) for name, at in raised]
        out["completed"] = work.is_completed()
        try:
            dist.all_reduce(torch.ones(4))
        except CommAborted as exc:
            out["next_call"] = str(exc)
        ctx.store.set("rank0_done", "1")
    else:
        ctx.store.wait(["rank0_done"], timedelta(seconds=60))
    return out


def test_abort_unblocks_every_waiter_within_100_ms() -> None:
    res = run_ranks(abort_body, 2, timeout=120)[0]
    assert res["alive"] == 0 and res["completed"] is True
    assert [name for name, _ in res["raised"]] == ["CommAborted"] * 3, res
    assert max(dt for _, dt in res["raised"]) < 0.1, res
    assert "refused" in res["next_call"]


# ------------------------------------------------------------------------------------- the synchronous path
def sync_path_body(ctx: RankContext) -> dict[str, Any]:
    """``opts.asyncOp=False`` (``async_op=False``): the op is waited for inside the call, which returns a finished
    Work; ``asyncOp=True`` returns at once. Rank 1 joins each op 0.4 s late."""
    pg = _init(ctx)
    out: dict[str, Any] = {}
    for async_op in (False, True):
        dist.barrier(group=pg)
        if ctx.rank == 1:
            time.sleep(0.4)
        opts = dist.AllreduceOptions()
        opts.asyncOp = async_op
        t = torch.full((4,), float(ctx.rank + 1))
        t0 = time.monotonic()
        work = pg.allreduce([t], opts)
        call_s = time.monotonic() - t0
        done_on_return = work.is_completed()
        work.wait()
        out[f"async={async_op}"] = (call_s, done_on_return, t.tolist())
    if ctx.rank == 0:  # abort() ends a synchronous op it cannot see a waiter of: the call itself returns
        opts = dist.AllreduceOptions()
        opts.asyncOp = False
        threading.Timer(0.3, pg.abort).start()
        t0 = time.monotonic()
        work = pg.allreduce([torch.ones(4)], opts)  # rank 1 never joins it
        out["aborted_call_s"] = time.monotonic() - t0
        try:
            work.wait()
        except CommAborted as exc:
            out["aborted_raised"] = type(exc).__name__
        ctx.store.set("rank0_done", "1")
    else:
        ctx.store.wait(["rank0_done"], timedelta(seconds=60))
    return out


def test_async_op_false_waits_inside_the_call_and_abort_ends_it() -> None:
    res = run_ranks(sync_path_body, 2, timeout=120)[0]
    call_s, done, value = res["async=False"]
    assert call_s > 0.3 and done is True and value == [3.0] * 4, res  # waited for rank 1 inside the call
    call_s, done, value = res["async=True"]
    assert call_s < 0.2 and done is False and value == [3.0] * 4, res  # returned before rank 1 joined
    assert 0.25 < res["aborted_call_s"] < 0.4 + 0.1 and res["aborted_raised"] == "CommAborted", res


# ----------------------------------------------------------------------------------------------------- timeout
def timeout_body(ctx: RankContext) -> dict[str, Any]:
    _init(ctx, timeout_s=1.0)
    out: dict[str, Any] = {}
    if ctx.rank == 0:
        unwaited = dist.all_reduce(torch.ones(4), async_op=True)  # nobody waits: the watchdog times it out
        fut = unwaited.get_future()
        time.sleep(1.6)
        out["unwaited"] = (unwaited.is_completed(), bool(torch.isnan(fut.wait()[0]).all()))
        t0 = time.monotonic()
        try:
            dist.barrier()
        except Exception as exc:
            out["next"] = (type(exc).__name__, "refused" in str(exc), time.monotonic() - t0)
        ctx.store.set("rank0_done", "1")
    else:
        ctx.store.wait(["rank0_done"], timedelta(seconds=60))
    return out


def sync_timeout_body(ctx: RankContext) -> dict[str, Any]:
    _init(ctx, timeout_s=1.0)
    out: dict[str, Any] = {}
    if ctx.rank == 0:
        t0 = time.monotonic()
        try:
            dist.all_reduce(torch.ones(4))
        except CommTimeout as exc:
            out["raised"] = (time.monotonic() - t0, str(exc))
        ctx.store.set("rank0_done", "1")
    else:
        ctx.store.wait(["rank0_done"], timedelta(seconds=60))
    return out


def test_timeout_raises_comm_timeout() -> None:
    seconds, text = run_ranks(sync_timeout_body, 2, timeout=120)[0]["raised"]
    assert 0.9 < seconds < 3.0, seconds
    assert "all_reduce" in text and "timeout of 1.000s" in text


def test_an_unwaited_op_times_out_and_the_next_call_raises() -> None:
    res = run_ranks(timeout_body, 2, timeout=120)[0]
    assert res["unwaited"] == (True, True)  # terminal, outputs marked invalid, the future did not raise
    name, refused, seconds = res["next"]
    assert (name, refused) == ("CommTimeout", True) and seconds < 1.0


def abort_grave_body(ctx: RankContext) -> dict[str, Any]:
    pg = _init(ctx, timeout_s=20.0)
    comm = pg.communicator()
    out: dict[str, Any] = {}
    if ctx.rank == 0:
        work = dist.all_reduce(torch.ones(64), async_op=True)  # rank 1 never joins: Gloo runs it on
        time.sleep(0.2)
        pg.abort()
        grave = comm._grave
        out["aborted"] = work.is_completed()
        out["grave_works"] = sum(len(w) for w in grave.works if type(w).__name__ == "RunningWorks")
        out["until_s"] = grave.until - time.perf_counter()
        ctx.store.set("rank0_aborted", "1")
    else:
        ctx.store.wait(["rank0_aborted"], timedelta(seconds=60))
    return out


def test_an_abort_hands_the_native_ops_inner_works_to_the_grave() -> None:
    """Gloo cannot cancel an op: after abort() finished a native op as ABORTED, its inner Gloo Work may still run.
    It goes to the communicator's grave with its deadline, so the reaper releases the backend -- and the interpreter's
    exit drains -- only once it ended (before: the grave held the Python path's orphans only, none on this path)."""
    res = run_ranks(abort_grave_body, 2, timeout=120)[0]
    assert res["aborted"] is True
    assert res["grave_works"] >= 1, res
    assert 10.0 < res["until_s"] <= 20.0, res  # the op's 20 s deadline, from its issue


# ------------------------------------------------------------------------------------------- Flight Recorder
def fr_body(ctx: RankContext, dump_dir: str) -> dict[str, Any]:
    pg = _init(ctx, dump_dir=dump_dir)
    for _ in range(3):
        dist.all_reduce(torch.ones(8))
    dist.broadcast(torch.ones(2), 0)
    rec = pg.communicator().flight_recorder
    rec.dump(dump_dir + os.sep, format="json")
    rec.dump(dump_dir + os.sep, format="pickle")
    return {"python_recorded": rec.recorded, "entries": [(e["profiling_name"], e["collective_seq_id"], e["state"])
                                                         for e in rec.entries()]}


def test_native_entries_are_in_the_dumps(tmp_path: Path) -> None:
    res = run_ranks(fr_body, 2, args=(str(tmp_path),), timeout=120)
    want = [("gloo:all_reduce", 1, "completed"), ("gloo:all_reduce", 2, "completed"),
            ("gloo:all_reduce", 3, "completed"), ("gloo:broadcast", 4, "completed")]
    for r in res:
        assert r["python_recorded"] == 0  # the entries came from the C++ ring
        assert r["entries"] == want
    for rank in range(2):
        dump = json.loads((tmp_path / f"torchnext_fr_rank_{rank}.json").read_text())
        assert [(e["profiling_name"], e["collective_seq_id"]) for e in dump["entries"]] == [w[:2] for w in want]
        status = next(iter(dump["pg_status"].values()))
        assert status["last_completed_collective"] == 4
    assert analyze_dir(tmp_path).issues == []
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


# -------------------------------------------------------------------------------------- switching paths
def rendered_dump_body(ctx: RankContext, dump_dir: str) -> dict[str, Any]:
    pg = _init(ctx)
    comm = pg.communicator()
    dist.all_reduce(torch.ones(3, 2))  # native (the C++ ring renders it)
    handle = comm.register_pre_hook(lambda info: None)
    dist.broadcast(torch.ones(2, dtype=torch.int64), 0)  # Python path: a slot of the Python recorder
    handle.remove()
    # a thread name JSON must escape (quote, backslash, newline, non-ASCII, beyond the BMP)
    issued, dumped = threading.Event(), threading.Event()

    def work() -> None:  # alive until the dump: the dump names live threads only
        dist.all_reduce(torch.ones(5), op=dist.ReduceOp.MAX)
        issued.set()
        dumped.wait(60)

    worker = threading.Thread(target=work, name='w\u00f6rker "q" \\ \n \U0001f600')
    worker.start()
    issued.wait(60)
    dist.all_gather_single(torch.empty(4), torch.ones(2))
    rec = comm.flight_recorder
    try:
        path = rec.dump(dump_dir + os.sep + f"r{ctx.rank}.json", format="json")
        reference = rec.entries()
        pickled = rec.dump(dump_dir + os.sep + f"r{ctx.rank}.pickle", format="pickle")
        reference_compat = format_entries(rec._live(), rec._groups, rec.rank, torch_compat=True)
    finally:
        dumped.set()
        worker.join(60)
    return {"dump": json.loads(Path(path).read_text())["entries"], "reference": reference,
            "pickle": pickle.loads(Path(pickled).read_bytes())["entries"], "reference_compat": reference_compat,
            "native_sources": sum(hasattr(src, "render") and hasattr(src, "dicts") for _, src in rec._sources)}


def test_the_dumps_of_native_entries_are_made_in_cpp_and_equal_the_reference(tmp_path: Path) -> None:
    """The JSON dump writes the C++ ring's entries in C++ (``fr_render``), the pickle dump has their dicts built
    there (``fr_dicts``), both merged with the Python recorder's by creation time: each equals the reference
    formatter on the same records (``entries()``; ``format_entries(..., torch_compat=True)``), field for field."""
    for r in run_ranks(rendered_dump_body, 2, args=(str(tmp_path),), timeout=120):
        assert r["native_sources"] >= 1
        assert [e["op"] for e in r["dump"]] == ["all_reduce", "broadcast", "all_reduce", "all_gather_single"]
        assert r["dump"] == r["reference"]
        assert r["dump"][2]["thread_name"] == 'w\u00f6rker "q" \\ \n \U0001f600'
        assert r["dump"][2]["reduce_op"] == "max" and r["dump"][1]["input_dtypes"] == ["Long"]
        assert r["pickle"] == r["reference_compat"]
        assert [e["record_id"] for e in r["pickle"]] == [0, 1, 2, 3]
        assert r["pickle"][0]["process_group"] == tuple(r["dump"][0]["process_group"])
        assert r["pickle"][2]["thread_name"] == r["dump"][2]["thread_name"]


def premul_body(ctx: RankContext) -> dict[str, Any]:
    pg = _init(ctx)
    n, r = ctx.world_size, ctx.rank
    out: dict[str, Any] = {}
    for name, factor in (("double", 0.25), ("tensor", torch.tensor([0.125]))):
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.arange(4 * n, dtype=torch.float32) * (r + 1) + 0.3).to(dtype)
            before = x.clone()
            got = torch.empty(4, dtype=dtype)
            lst = torch.empty(4, dtype=dtype)
            records = _native_records(pg)
            dist.reduce_scatter_tensor(got, x, op=dist._make_nccl_premul_sum(factor))
            dist.reduce_scatter(lst, list(x.chunk(n)), op=dist._make_nccl_premul_sum(factor))
            native_ops = _native_records(pg) - records
            # the reference: each rank's input times the factor in its own dtype (torch's mul), then the SUM
            f = factor.reshape(()) if isinstance(factor, torch.Tensor) else factor
            want = sum(torch.mul((torch.arange(4 * n, dtype=torch.float32) * (q + 1) + 0.3).to(dtype), f).to(dtype)
                       for q in range(n)).chunk(n)[r]
            out[f"{name}/{dtype}"] = (torch.equal(got, want), torch.equal(lst, want), torch.equal(x, before), native_ops)
    entry = pg.communicator().flight_recorder.entries()[-1]
    out["recorded"] = (entry["op"], entry["reduce_op"])
    with pytest.raises(TypeError, match="PREMUL_SUM needs a floating dtype"):  # the Python path's validation
        dist.reduce_scatter_tensor(torch.empty(4, dtype=torch.int64), torch.ones(4 * n, dtype=torch.int64),
                                   op=dist._make_nccl_premul_sum(0.5))
    return out


def test_premul_sum_reduce_scatters_run_natively_and_equal_the_reference() -> None:
    """FSDP2's gradient reduce-scatter (``PREMUL_SUM``, a double or a one-element tensor factor) stays on the C++
    path: SUM of each rank's ``input * factor`` in the input's dtype, the caller's input untouched; recorded as the
    Python path records it (a SUM); integer inputs go to the Python path, which raises."""
    for r in run_ranks(premul_body, 2, timeout=120):
        for key in ("double/torch.float32", "double/torch.bfloat16", "tensor/torch.float32", "tensor/torch.bfloat16"):
            assert r[key] == (True, True, True, 2), (key, r[key])
        assert r["recorded"] == ("reduce_scatter", "sum")


def switch_body(ctx: RankContext) -> dict[str, Any]:
    pg = _init(ctx)
    comm = pg.communicator()
    seen: list[tuple[str, int]] = []
    dist.all_reduce(torch.ones(2))  # op 1, native
    handle = comm.register_pre_hook(lambda info: seen.append((info.op, info.op_id)))
    on_hook = (pg.native, type(pg).__name__)
    dist.all_reduce(torch.ones(2))  # op 2, Python (the hook sees it)
    dist.broadcast(torch.ones(2), 0)  # op 3, Python
    handle.remove()
    after = pg.native
    dist.all_reduce(torch.ones(2))  # op 4, native again (the hook is gone)
    entries = comm.flight_recorder.entries()
    return {"on_hook": on_hook, "after": after, "seen": seen,
            "seq": [(e["profiling_name"], e["collective_seq_id"]) for e in entries],
            "op_ids": [e["op_id"] for e in entries]}


def test_a_hook_switches_the_group_to_the_python_path_and_back() -> None:
    for r in run_ranks(switch_body, 2, timeout=120):
        assert r["on_hook"] == (False, "TorchnextProcessGroup")
        assert r["after"] is True
        assert r["seen"] == [("all_reduce", 2), ("broadcast", 3)]  # op ids continue across the switches
        assert r["seq"] == [("gloo:all_reduce", 1), ("gloo:all_reduce", 2), ("gloo:broadcast", 3),
                            ("gloo:all_reduce", 4)]
        assert r["op_ids"] == [1, 2, 3, 4]


# ---------------------------------------------------------------------------------------------- build cache
def test_the_build_is_cached() -> None:
    t0 = time.perf_counter()
    res = _build.build()
    assert res.built is False and time.perf_counter() - t0 < 10.0
    assert (res.folder / "build.json").exists() and res.folder == _build.cache_folder()


def test_a_checkout_at_another_path_uses_the_finished_build(tmp_path: Path) -> None:
    """CI runs a copy of the tree at another path: ``build()`` must import the finished build, never hand it to
    ninja (whose build file names the old source paths, so it recompiled -- 30 s, the .so rewritten under a
    process that has it loaded). No compiler or ninja on PATH: any recompile fails."""
    pkg = Path(_build.__file__).resolve().parents[3] / "torchnext"
    shutil.copytree(pkg, tmp_path / "torchnext", ignore=shutil.ignore_patterns("__pycache__"))
    code = ("import time; t0 = time.perf_counter()\n"
            "import torchnext; from torchnext.comms.native import _build\n"
            "res = _build.build()\n"
            "print('RESULT', torchnext.__file__, res.built, res.folder, round(time.perf_counter() - t0, 3))\n")
    env = {**os.environ, "PATH": "/nonexistent", "TORCHNEXT_CXX": "/nonexistent/c++", "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    _, where, built, folder, _seconds = line.split(" ")
    assert where.startswith(str(tmp_path)) and built == "False" and folder == str(_build.cache_folder())


def test_a_built_extension_loads_without_a_compiler_or_ninja() -> None:
    """A fresh process imports the cached build straight from its folder: no compiler check, no ninja run."""
    code = ("import time, torch; t0 = time.perf_counter()\n"
            "from torchnext.comms import native\n"
            "st = native.status()\n"
            "print('RESULT', st.available, st.reason.split(' at ')[0], round(time.perf_counter() - t0, 3))\n")
    env = {**os.environ, "PATH": "/nonexistent", "TORCHNEXT_CXX": "/nonexistent/c++"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    _, available, rest = line.split(" ", 2)
    how = rest.rsplit(" ", 1)[0]
    assert (available, how) == ("True", "from the cache"), proc.stdout + proc.stderr


def test_the_cache_key_follows_torchs_version(monkeypatch: pytest.MonkeyPatch) -> None:
    key = _build.cache_key()
    monkeypatch.setattr(torch, "__version__", "0.0.0+other")
    assert _build.cache_key() != key


def test_without_a_compiler_groups_use_the_python_path(tmp_path: Path) -> None:
    code = (
        "import logging, torch.distributed as dist, torchnext\n"
        "from torchnext.comms import native\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "dist.init_process_group('torchnext', store=dist.HashStore(), rank=0, world_size=1)\n"
        "pg = dist.group.WORLD\n"
        "import torch; t = torch.ones(2); dist.all_reduce(t)\n"
        "print('RESULT', pg.native, type(pg).__name__, native.status().available, t.tolist())\n"
    )
    env = {**os.environ, "TORCHNEXT_NATIVE_PG": "1", "TORCHNEXT_CXX": "/nonexistent/c++",
           "TORCHNEXT_KERNEL_CACHE": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "RESULT False TorchnextProcessGroup False [1.0, 1.0]" in proc.stdout
    assert proc.stderr.count("native process-group path unavailable") == 1
    assert "/nonexistent/c++" in proc.stderr


# ------------------------------------------------------------------------------------------ consistency mode
def consistency_body(ctx: RankContext) -> dict[str, Any]:
    os.environ["TORCHNEXT_NATIVE_PG"] = "1"
    os.environ["TORCHNEXT_CHECK_COLLECTIVES"] = "1"
    dist.init_process_group("torchnext", store=ctx.store, rank=ctx.rank, world_size=ctx.world_size,
                            timeout=timedelta(seconds=30))
    pg = dist.group.WORLD
    t = torch.ones(3)
    dist.all_reduce(t)
    return {"native": pg.native, "checked": pg.communicator().check_collectives,  # type: ignore[union-attr]
            "value": t.tolist(), "native_records": _native_records(pg)}


def test_the_consistency_mode_keeps_the_group_on_the_python_path() -> None:
    for r in run_ranks(consistency_body, 2, timeout=120):
        assert r == {"native": False, "checked": True, "value": [2.0, 2.0, 2.0], "native_records": 0}


# ------------------------------------------------------------------------------ abort at a random point of a run
def abort_race_body(ctx: RankContext, seed: int) -> dict[str, Any]:
    import random

    pg = _init(ctx)
    rng = random.Random(seed)
    works: list[Any] = []
    if ctx.rank == 0:
        stop = threading.Event()
        t_abort: list[float] = []

        def aborter() -> None:
            time.sleep(rng.uniform(0.05, 0.4))
            t_abort.append(time.monotonic())
            pg.abort()
            t_abort.append(time.monotonic())
            stop.set()

        threading.Thread(target=aborter, daemon=True).start()
        refused = 0
        while not stop.is_set() and len(works) < 20000:
            try:
                works.append(dist.all_reduce(torch.ones(4), async_op=True))
            except CommAborted:
                refused += 1
                break
        stop.wait(30)
        terminal_at_return = all(w.is_completed() for w in works)  # abort() returned: nothing is left in flight
        outcomes: dict[str, int] = {}
        for w in works:
            try:
                w.wait()
                name = "completed"
            except CommAborted:
                name = "aborted"
            outcomes[name] = outcomes.get(name, 0) + 1
        states = [e["state"] for e in pg.communicator().flight_recorder.entries()]
        ctx.store.set("rank0_done", "1")
        return {"issued": len(works), "outcomes": outcomes, "all_completed": terminal_at_return,
                "abort_s": t_abort[1] - t_abort[0], "states": sorted(set(states)), "entries": len(states)}
    # rank 1 joins every all_reduce rank 0 may issue until rank 0 is done (its own ops then fail or are left)
    try:
        while not ctx.store.check(["rank0_done"]):
            dist.all_reduce(torch.ones(4))
    except Exception:
        pass
    ctx.store.wait(["rank0_done"], timedelta(seconds=60))
    return {}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_abort_at_a_random_point_leaves_every_work_in_one_terminal_state(seed: int) -> None:
    res = run_ranks(abort_race_body, 2, args=(seed,), timeout=120)[0]
    assert res["all_completed"] is True
    assert sum(res["outcomes"].values()) == res["issued"] > 0
    assert set(res["outcomes"]) <= {"completed", "aborted"}, res
    assert res["abort_s"] < 0.1, res  # abort() finished every op in flight (hundreds to thousands) within 100 ms
    assert set(res["states"]) <= {"completed", "aborted"}, res  # one final state per entry, none left "started"


def two_threads_native_body(ctx: RankContext) -> dict[str, Any]:
    """Two threads of each rank all_reduce on one native group at once, 200 ops each (values chosen so that any
    pairing of the ranks' ops sums the same); then a thread issuing plain all_reduces beside one whose ops the fast
    path sends to the Python path (PREMUL_SUM), zeros (the two kinds pair with each other in any order): every op
    completes, nothing deadlocks between the issue lock and the GIL."""
    import threading

    pg = _init(ctx)
    errors: list[str] = []
    sums: list[float] = []
    go = threading.Barrier(2)

    def run(n: int, value: float, premul: bool = False) -> None:
        go.wait(30)
        try:
            for _ in range(n):
                t = torch.full((4,), value)
                if premul:
                    dist.all_reduce(t, op=dist._make_nccl_premul_sum(2.0))  # type: ignore[attr-defined]
                else:
                    dist.all_reduce(t)
                sums.append(float(t[0]))
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")

    def phase(*targets: tuple[Any, ...]) -> bool:
        threads = [threading.Thread(target=run, args=a) for a in targets]
        for th in threads:
            th.start()
        for th in threads:
            th.join(90)
        return any(th.is_alive() for th in threads)

    alive = phase((200, float(ctx.rank + 1)), (200, float(ctx.rank + 1)))
    plain = sorted(set(sums))
    sums.clear()
    alive = alive or phase((100, 0.0), (20, 0.0, True))
    native = pg.native  # type: ignore[union-attr]
    dist.destroy_process_group()
    return {"errors": errors, "plain": plain, "mixed": (len(sums), sorted(set(sums))), "alive": alive,
            "native": native}


def test_two_threads_issuing_on_one_native_group_are_serialized() -> None:
    for r in run_ranks(two_threads_native_body, 2, timeout=180):
        assert r["errors"] == [] and not r["alive"], r
        assert r["plain"] == [3.0] and r["mixed"] == (120, [0.0]) and r["native"], r


def named_threads_body(ctx: RankContext) -> dict[str, int]:
    _init(ctx)
    x = torch.ones(4)
    if ctx.rank == 0:
        dist.send(x, 1)  # Gloo's send/recv Works have no future: a native waiter thread waits on them
    else:
        dist.recv(x, 0)
    dist.all_reduce(x)
    names = thread_names()
    return {n: names[n] for n in ("tn-watchdog", "tn-waiter")}


def test_the_native_backends_threads_are_named() -> None:
    """Its watchdog and waiter threads carry names (``tn-watchdog``, ``tn-waiter``): ``top -H`` and ``/proc`` tell
    them from Python's, and the soak's resource check counts the waiter pool apart (a pool grows to the most ops
    without a future it ran at once: not a leak)."""
    for counts in run_ranks(named_threads_body, 2, timeout=120):
        assert counts["tn-watchdog"] >= 1 and counts["tn-waiter"] >= 1, counts
