"""FlightRecorder core: ring buffer, entry schema, pg_config/pg_status, dumps (no Communicator needed)."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from torchnext.comms.flight_recorder import format as _fr_format
from torchnext.comms.flight_recorder.recorder import FlightRecorder, FlightRecorderError

TORCH_FIELDS = set(_fr_format.TORCH_ENTRY_FIELDS)
OUR_FIELDS = set(_fr_format.TORCHNEXT_ENTRY_FIELDS)


def _recorder(capacity: int = 10, **kw: object) -> tuple[FlightRecorder, int]:
    fr = FlightRecorder(capacity, rank=1, world_size=3, **kw)  # type: ignore[arg-type]
    return fr, fr.add_group("world", ranks=[0, 1, 2], desc="default_pg")


def test_entry_schema_and_lifecycle() -> None:
    fr, pg = _recorder()
    x = torch.zeros(2, 3, dtype=torch.bfloat16)
    out = [torch.zeros(2, 3, dtype=torch.bfloat16) for _ in range(3)]
    rid = fr.record(pg, "all_gather", inputs=[x], outputs=out, op_id=7, timeout_ms=1234, t_ns=1000)
    (e,) = fr.entries()
    assert TORCH_FIELDS | OUR_FIELDS <= set(e)
    assert e["state"] == "started" and e["time_created_ns"] == 1000 and e["time_discovered_started_ns"] == 1000
    assert e["time_discovered_completed_ns"] is None and e["duration_ms"] is None and e["retired"] is False
    fr.complete(rid, t_ns=3_001_000)
    (e,) = fr.entries()
    assert e["record_id"] == 0 and e["pg_id"] == pg and e["process_group"] == ["world", "default_pg"]
    assert e["collective_seq_id"] == 1 and e["p2p_seq_id"] == 0 and e["op_id"] == 7
    assert e["profiling_name"] == "gloo:all_gather"
    assert e["input_sizes"] == [[2, 3]] and e["output_sizes"] == [[2, 3]] * 3
    assert e["input_dtypes"] == ["BFloat16"] and e["output_dtypes"] == ["BFloat16"] * 3
    assert e["state"] == "completed" and e["duration_ms"] == pytest.approx(3.0) and e["retired"] is True
    assert e["timeout_ms"] == 1234 and e["is_p2p"] is False
    assert e["rank"] == 1 and e["global_rank"] == 1 and e["generation"] == 0
    assert e["thread_name"] == threading.current_thread().name and e["thread_id"] == str(threading.get_ident())
    # a second completion (e.g. an abort after completion) does not rewrite a finished record
    fr.complete(rid, "aborted")
    assert fr.entries()[0]["state"] == "completed"


def test_error_states_and_pg_status() -> None:
    fr, pg = _recorder()
    x = torch.ones(1)
    a = fr.record(pg, "all_reduce", inputs=[x], outputs=[x])
    fr.complete(a)
    b = fr.record(pg, "all_reduce", inputs=[x], outputs=[x])
    fr.complete(b, "timed_out", error="CommTimeout: boom")
    fr.record(pg, "barrier")
    s = fr.record(pg, "send", inputs=[x], peer=2)
    fr.complete(s)
    status = fr.pg_status()["world"]
    assert status["last_enqueued_collective"] == 3
    assert status["last_started_collective"] == 3
    assert status["last_completed_collective"] == 1
    assert status["last_enqueued_p2p"] == status["last_completed_p2p"] == 1
    states = [e["state"] for e in fr.entries()]
    assert states == ["completed", "timed_out", "started", "completed"]
    assert fr.entries()[1]["error"] == "CommTimeout: boom"


def test_p2p_profiling_names_use_group_ranks() -> None:
    fr = FlightRecorder(10, rank=5, world_size=8)
    pg = fr.add_group("pair", ranks=[3, 5], backend="gloo")
    x = torch.ones(4)
    fr.record(pg, "send", inputs=[x], peer=0)
    fr.record(pg, "recv", outputs=[x], peer=0)
    s, r = fr.entries()
    assert s["profiling_name"] == "gloo:send 1->0" and s["is_p2p"] and s["peer_global"] == 3
    assert r["profiling_name"] == "gloo:recv 1<-0" and r["p2p_seq_id"] == 2 and r["collective_seq_id"] == 0
    assert fr.pg_config()["pair"]["ranks"] == "[3, 5]" and fr.pg_config()["pair"]["ranks_list"] == [3, 5]


def test_ring_wrap_and_dropped_count() -> None:
    fr, pg = _recorder(capacity=5)
    x = torch.ones(1)
    rids = [fr.record(pg, "all_reduce", inputs=[x], outputs=[x]) for _ in range(12)]
    for rid in rids:
        fr.complete(rid)  # overwritten records are ignored, live ones complete
    entries = fr.entries()
    assert [e["record_id"] for e in entries] == [7, 8, 9, 10, 11]
    assert [e["collective_seq_id"] for e in entries] == [8, 9, 10, 11, 12]
    assert all(e["state"] == "completed" for e in entries)
    assert fr.recorded == 12 and fr.dropped == 7


def test_capacity_zero_disables(tmp_path: Path) -> None:
    fr, pg = _recorder(capacity=0)
    assert not fr.enabled
    assert fr.record(pg, "all_reduce", inputs=[torch.ones(1)]) == -1
    fr.complete(-1)
    assert fr.entries() == [] and fr.dropped == 0
    dump = json.loads(fr.dump(tmp_path).read_text())
    assert dump["entries"] == [] and dump["capacity"] == 0


def test_env_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TORCHNEXT_FR_BUFFER_SIZE", "0")
    monkeypatch.setenv("TORCHNEXT_FR_DUMP_DIR", str(tmp_path))
    fr = FlightRecorder()
    assert fr.capacity == 0 and fr.dump_dir == tmp_path
    monkeypatch.setenv("TORCHNEXT_FR_BUFFER_SIZE", "17")
    assert FlightRecorder().capacity == 17
    monkeypatch.setenv("TORCHNEXT_FR_BUFFER_SIZE", "-1")
    with pytest.raises(ValueError, match="TORCHNEXT_FR_BUFFER_SIZE"):
        FlightRecorder()


def test_bad_arguments() -> None:
    with pytest.raises(FlightRecorderError, match="capacity"):
        FlightRecorder(-3)
    with pytest.raises(FlightRecorderError, match="capacity"):
        FlightRecorder(2.5)  # type: ignore[arg-type]
    fr, _ = _recorder()
    with pytest.raises(FlightRecorderError, match="dump format"):
        fr.dump("/tmp/x", format="yaml")
    with pytest.raises(FlightRecorderError, match="not a member"):
        fr.add_group("other", ranks=[0, 2])
    with pytest.raises(FlightRecorderError, match="unknown dump format"):
        FlightRecorder(4, auto_dump_formats=("xml",))
    with pytest.raises(FlightRecorderError, match="needs a dump folder"):
        fr.enable_dump_on_signal(signal.SIGUSR1)
    with pytest.raises(FlightRecorderError, match="needs a dump folder"):
        fr.enable_dump_on_exception()
    with pytest.raises(FlightRecorderError, match="'started' or 'scheduled'"):
        fr.record(0, "all_reduce", state="completed")


def test_frames_are_the_callers_and_capped() -> None:
    fr, pg = _recorder(record_frames=True, max_frames=3)

    def user_step() -> None:
        fr.record(pg, "all_reduce", inputs=[torch.ones(1)])

    user_step()
    frames = fr.entries()[0]["frames"]
    assert len(frames) == 3
    assert frames[0]["name"] == "user_step" and frames[0]["filename"] == __file__
    assert set(frames[0]) == {"name", "filename", "line"}
    fr2, pg2 = _recorder()
    fr2.record(pg2, "all_reduce", inputs=[torch.ones(1)])
    assert fr2.entries()[0]["frames"] == []


def test_concurrent_records_get_distinct_slots() -> None:
    fr, pg = _recorder(capacity=10_000)
    x = torch.ones(1)

    def work() -> None:
        for _ in range(500):
            fr.complete(fr.record(pg, "all_reduce", inputs=[x], outputs=[x]))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    entries = fr.entries()
    assert len(entries) == 2000 and len({e["record_id"] for e in entries}) == 2000
    assert all(e["state"] == "completed" for e in entries)


def test_generations_get_distinct_keys() -> None:
    fr, pg0 = _recorder()
    fr.record(pg0, "all_reduce", inputs=[torch.ones(1)])
    fr.generation = 1
    pg1 = fr.add_group("world", ranks=[0, 1])
    fr.record(pg1, "all_reduce", inputs=[torch.ones(1)])
    cfg = fr.pg_config()
    assert set(cfg) == {"world", "world@g1"} and cfg["world@g1"]["generation"] == 1
    a, b = fr.entries()
    assert (a["generation"], b["generation"]) == (0, 1)
    assert b["process_group"][0] == "world@g1" and b["collective_seq_id"] == 1


def test_dump_json_is_self_describing_and_atomic(tmp_path: Path) -> None:
    fr, pg = _recorder(capacity=2000, record_frames=True)
    x = torch.ones(256)
    for _ in range(2500):
        fr.complete(fr.record(pg, "all_reduce", inputs=[x], outputs=[x]))
    t0 = time.perf_counter()
    path = fr.dump(tmp_path, reason="unit")
    elapsed = time.perf_counter() - t0
    assert path == tmp_path / "torchnext_fr_rank_1.json"
    d = json.loads(path.read_text())
    for key in ("rank", "world_size", "host", "pid", "versions", "generation", "dropped", "version", "pg_config",
                "pg_status", "entries", "stacks", "dump_reason", "capacity", "recorded"):
        assert key in d, key
    assert d["rank"] == 1 and d["world_size"] == 3 and d["pid"] == os.getpid() and d["dropped"] == 500
    assert d["version"] == "2.10" and d["versions"]["torch"] == torch.__version__ and d["dump_reason"] == "unit"
    assert len(d["entries"]) == 2000 and d["pg_config"]["world"]["ranks"] == "[0, 1, 2]"
    assert any(k.startswith("MainThread") for k in d["stacks"])
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left behind
    assert elapsed < 0.5, f"dump of 2000 entries took {elapsed * 1e3:.0f} ms"  # goal 50 ms; see the benchmark


def test_dump_pickle_flavour(tmp_path: Path) -> None:
    fr, pg = _recorder()
    fr.record(pg, "all_reduce", inputs=[torch.ones(1)])
    path = fr.dump(str(tmp_path) + os.sep, format="pickle")
    assert path.name == "torchnext_fr_trace_rank_1"
    d = pickle.loads(path.read_bytes())
    assert d["entries"][0]["process_group"] == ("world", "default_pg")
    explicit = fr.dump(tmp_path / "custom.json")
    assert explicit.name == "custom.json" and json.loads(explicit.read_text())["rank"] == 1


def test_failed_write_keeps_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fr, pg = _recorder()
    path = fr.dump(tmp_path)
    before = path.read_bytes()
    fr.record(pg, "all_reduce", inputs=[torch.ones(1)])

    def broken_replace(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(_fr_format.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        fr.dump(tmp_path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_auto_dump_without_dir_is_noop_and_failures_are_kept(tmp_path: Path) -> None:
    fr, _ = _recorder()
    assert fr.auto_dump("x") == []
    blocker = tmp_path / "file"
    blocker.write_text("")
    fr.dump_dir = blocker / "sub"  # cannot create a folder under a file
    assert fr.auto_dump("x") == []
    assert fr.dump_errors and "dump (x) failed" in fr.dump_errors[0]


def test_dump_on_signal(tmp_path: Path) -> None:
    fr, pg = _recorder(dump_dir=tmp_path)
    fr.record(pg, "all_reduce", inputs=[torch.ones(1)])
    previous = signal.getsignal(signal.SIGUSR1)
    fr.enable_dump_on_signal(signal.SIGUSR1)
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 5
        while not (tmp_path / "torchnext_fr_rank_1.json").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        fr.detach()
    assert signal.getsignal(signal.SIGUSR1) == previous
    d = json.loads((tmp_path / "torchnext_fr_rank_1.json").read_text())
    assert d["dump_reason"] == "signal SIGUSR1" and len(d["entries"]) == 1
    main = next(v for k, v in d["stacks"].items() if k.startswith("MainThread"))
    assert main[0]["name"] == "test_dump_on_signal"  # where the main thread was when the signal arrived


def test_dump_on_unhandled_exception(tmp_path: Path) -> None:
    code = textwrap.dedent(
        f"""
        import torch
        from torchnext.comms.flight_recorder.recorder import FlightRecorder
        fr = FlightRecorder(8, rank=0, world_size=1, dump_dir={str(tmp_path)!r})
        pg = fr.add_group("world", ranks=[0])
        fr.record(pg, "all_reduce", inputs=[torch.ones(1)])
        fr.enable_dump_on_exception()
        raise ValueError("training diverged")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "training diverged" in proc.stderr  # the normal traceback still prints
    d = json.loads((tmp_path / "torchnext_fr_rank_0.json").read_text())
    assert d["dump_reason"].startswith("unhandled_exception: ValueError: training diverged")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_dump_on_unhandled_exception_in_a_thread(tmp_path: Path) -> None:
    fr, _ = _recorder(dump_dir=tmp_path)
    before = (sys.excepthook, threading.excepthook)
    fr.enable_dump_on_exception()
    try:
        def boom() -> None:
            raise RuntimeError("worker died")

        t = threading.Thread(target=boom, name="worker")
        t.start()
        t.join(timeout=30)
    finally:
        fr.detach()
    assert (sys.excepthook, threading.excepthook) == before  # detach() restored both
    d = json.loads((tmp_path / "torchnext_fr_rank_1.json").read_text())
    assert d["dump_reason"] == "unhandled_exception: RuntimeError in thread worker: worker died"


def test_communicator_flag_attach_detach_and_split_single_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from torchnext.comms import Communicator

    with pytest.raises(TypeError, match="flight_recorder must be a bool or a FlightRecorder"):
        Communicator(dist.HashStore(), 0, 1, flight_recorder="yes")  # type: ignore[arg-type]
    monkeypatch.setenv("TORCHNEXT_FR_BUFFER_SIZE", "7")
    comm = Communicator(dist.HashStore(), 0, 1, name="solo", flight_recorder=True)
    fr = comm.flight_recorder
    assert fr is not None and fr.capacity == 7
    t = torch.ones(3)
    comm.all_reduce(t)
    w = comm.broadcast(t, 0, async_op=True)
    assert w is not None and w.wait()
    child = comm.split([0], name="kid")
    assert child is not None and child.flight_recorder is fr
    child.all_reduce(t)
    e = fr.entries()
    assert [(x["process_group"][0], x["op"], x["collective_seq_id"], x["op_id"], x["state"]) for x in e] == [
        ("solo", "all_reduce", 1, 1, "completed"),
        ("solo", "broadcast", 2, 2, "completed"),
        ("solo", "split", 3, 3, "completed"),
        ("kid", "all_reduce", 1, 1, "completed"),
    ]
    assert e[1]["async_op"] is True and e[0]["timeout_ms"] == 300_000
    assert fr.pg_config()["kid"]["ranks_list"] == [0] and fr.pg_status()["solo"]["last_completed_collective"] == 3
    fr.detach()
    comm.all_reduce(t)
    child.all_reduce(t)
    assert len(fr.entries()) == 4 and comm.flight_recorder is None
    other = FlightRecorder(5, rank=0, world_size=1)
    comm2 = Communicator(dist.HashStore(), 0, 1, name="second", flight_recorder=other)
    comm2.all_reduce(t)
    assert [x["process_group"][0] for x in other.entries()] == ["second"]
    for c in (comm, child, comm2):
        c.shutdown()


def test_a_recorder_failure_never_blocks_an_op(capsys: pytest.CaptureFixture[str]) -> None:
    import torch.distributed as dist

    from torchnext.comms import Communicator

    comm = Communicator(dist.HashStore(), 0, 1, name="solo", flight_recorder=True)
    fr = comm.flight_recorder
    assert fr is not None
    fr._groups.clear()  # simulate a recorder bug: every record now fails
    t = torch.ones(2)
    comm.all_reduce(t)
    comm.all_reduce(t)
    assert torch.equal(t, torch.ones(2))
    assert len(fr.dump_errors) == 1 and "pre hook failed" in fr.dump_errors[0]
    assert "pre hook failed" in capsys.readouterr().err
    comm.shutdown()


def test_removed_sources_keep_at_most_capacity_entries_the_newest() -> None:
    """A fault-tolerant group on the native path adds and removes one source (a C++ ring) per generation: the
    removed ones' copies stay in the dumps, bounded as the ring is, newest kept, their sequence counters kept."""
    fr, pg = _recorder(capacity=4)

    class Source:
        def __init__(self, first_t: int) -> None:
            other, opg = _recorder(capacity=10)
            for i in range(3):
                other.complete(other.record(opg, "all_reduce", inputs=[torch.ones(1)], outputs=[torch.ones(1)],
                                            op_id=first_t + i, t_ns=first_t + i))
            self._slots = other._live()

        def slots(self) -> list[list[object]]:
            return [list(s) for s in self._slots]

        def counters(self) -> list[int]:
            return [3, 0, 3, 3, 3, -1, -1, -1]

    for gen in range(3):
        undo = fr.add_source(pg, Source(first_t=100 * (gen + 1)))
        undo()
    ops = [e["op_id"] for e in fr.entries()]
    assert ops == [202, 300, 301, 302], ops
    assert fr.pg_status()["world"]["last_completed_collective"] == 3
