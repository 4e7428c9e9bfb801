"""The analyzer on synthetic traces, corrupt inputs, PyTorch's own dumps, the CLI, timelines and torchfrtrace."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from torchnext.cli import main as cli_main
from torchnext.comms.flight_recorder.analysis import analyze_dir
from torchnext.comms.flight_recorder.loader import load_file
from torchnext.comms.flight_recorder.recorder import FlightRecorder
from torchnext.testing.fr_scenarios import write_scenario

EXPECTED = {
    # scenario: (kind, culprit ranks, seq, op)
    "missing_rank": ("missing_ranks", [2], 3, "all_reduce"),
    "killed": ("missing_ranks", [2], 3, "all_reduce"),
    "op_mismatch": ("op_mismatch", [1], 2, "all_reduce"),
    "size_mismatch": ("size_mismatch", [1], 2, "all_reduce"),
    "dtype_mismatch": ("dtype_mismatch", [2], 2, "all_reduce"),
    "straggler": ("straggler", [1], 3, "all_reduce"),
    "unmatched_p2p": ("unmatched_p2p", [0], 1, "send"),
}


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = cli_main(["fr", "analyze", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("scenario", sorted(EXPECTED))
def test_synthetic_diagnosis(scenario: str, tmp_path: Path) -> None:
    write_scenario(scenario, tmp_path)
    report = analyze_dir(tmp_path)
    kind, ranks, seq, op = EXPECTED[scenario]
    first = report.issues[0]
    assert (first.kind, first.ranks, first.seq, first.op, first.pg) == (kind, ranks, seq, op, "world")
    assert len(report.issues) == 1, [i.message for i in report.issues]


def test_straggler_detail_has_every_ranks_lateness(tmp_path: Path) -> None:
    write_scenario("straggler", tmp_path)
    detail = analyze_dir(tmp_path).issues[0].detail
    assert detail["entered_after_first_ms"] == {"0": 0.0, "1": 1500.0, "2": 0.0}
    assert detail["late_count"] == 1 and detail["threshold_ms"] == 500.0


def test_healthy_and_last_completed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_scenario("healthy", tmp_path)
    report = analyze_dir(tmp_path)
    assert report.issues == [] and report.last_completed == {"world": {"seq": 5, "op": "all_reduce", "generation": 0}}
    rc, out, _ = _cli(capsys, str(tmp_path), "--fail-on-issues")
    assert rc == 0 and "no issues found" in out


def test_missing_rank_detail_names_where_the_rank_was(tmp_path: Path) -> None:
    write_scenario("missing_rank", tmp_path)
    issue = analyze_dir(tmp_path).issues[0]
    where = issue.detail["missing"]["2"]
    assert where["last_entry"]["op"] == "all_reduce" and where["last_entry"]["seq"] == 2
    assert where["stack"] and where["stack"][0]["name"] == "write_scenario"  # rank 2's main thread at dump time
    assert issue.detail["entered"] == {"0": "started", "1": "started"}


def test_json_schema_and_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_scenario("missing_rank", tmp_path)
    rc, out, _ = _cli(capsys, str(tmp_path), "--json")
    assert rc == 0
    doc = json.loads(out)
    assert set(doc) >= {"issues", "last_completed", "schema_version", "dumps", "problems"}
    issue = doc["issues"][0]
    assert {"kind", "pg", "seq", "op", "ranks", "detail"} <= set(issue)
    assert (issue["kind"], issue["pg"], issue["seq"], issue["op"], issue["ranks"]) == (
        "missing_ranks", "world", 3, "all_reduce", [2])
    assert doc["last_completed"]["world"]["seq"] == 2
    rc, _, _ = _cli(capsys, str(tmp_path), "--fail-on-issues")
    assert rc == 1
    rc, _, err = _cli(capsys, str(tmp_path / "nope"))
    assert rc == 2 and "not a folder" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, _, err = _cli(capsys, str(empty))
    assert rc == 2 and "no usable Flight Recorder dump" in err


def test_corrupt_files_get_a_message_each_and_analysis_continues(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_scenario("missing_rank", tmp_path)
    good = (tmp_path / "torchnext_fr_rank_0.json").read_bytes()
    (tmp_path / "truncated.json").write_bytes(good[: len(good) // 2])
    (tmp_path / "random.bin").write_bytes(os.urandom(4096).replace(b"\x80", b"\x81").replace(b"{", b"(") + b"x")
    (tmp_path / "tiny87").write_bytes(b"{" + b"x" * 86)
    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "list.json").write_text("[1, 2, 3]")
    (tmp_path / "nokeys.json").write_text('{"hello": 1}')
    (tmp_path / "future.json").write_text(json.dumps({"version": "9.1", "entries": [], "rank": 7}))
    (tmp_path / "torchnext_fr_trace_rank_0").write_bytes(pickle.dumps({"version": "2.10", "entries": []}))
    rc, out, err = _cli(capsys, str(tmp_path))
    assert rc == 0, err
    assert "missing_ranks" in out  # the good dumps were still analysed
    msgs = {Path(line.split(": ", 2)[1]).name: line for line in err.splitlines() if line.startswith("skipped")}
    assert "truncated JSON" in msgs["truncated.json"]
    assert "neither JSON nor pickle" in msgs["random.bin"]
    assert "JSON" in msgs["tiny87"]
    assert "empty file" in msgs["empty"]
    assert "top level is list" in msgs["list.json"]
    assert "missing key" in msgs["nokeys.json"]
    assert "unsupported Flight Recorder version '9.1'" in msgs["future.json"]
    assert "--allow-pickle" in msgs["torchnext_fr_trace_rank_0"]


def test_text_output_escapes_text_from_dumps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Error messages in dumps contain brackets ("[/__w/pytorch/.../pair.cc:553]"): never read as rich markup."""
    fr = FlightRecorder(8, rank=0, world_size=1, record_frames=True)
    pg = fr.add_group("w[/x]", ranks=[0])
    rid = fr.record(pg, "all_reduce", inputs=[torch.ones(1)])
    fr.complete(rid, "error", error="PeerFailure: [/__w/gloo/pair.cc:553] Connection closed [bold]")
    fr.dump(tmp_path, reason="peer_failure: [/__w/gloo/pair.cc:553] closed")
    rc, out, _ = _cli(capsys, str(tmp_path))
    assert rc == 0 and "[/__w/gloo/pair.cc:553] closed" in out and "w[/x]" in out


def test_mixed_versions_are_flagged_but_used(tmp_path: Path) -> None:
    write_scenario("missing_rank", tmp_path)
    p = tmp_path / "torchnext_fr_rank_1.json"
    d = json.loads(p.read_text())
    d["version"] = "2.8"
    p.write_text(json.dumps(d))
    report = analyze_dir(tmp_path)
    assert report.issues[0].kind == "missing_ranks" and report.issues[0].ranks == [2]
    (problem,) = report.problems
    assert not problem.skipped and "version 2.8 differs from 2.10" in problem.message


def test_pickle_needs_flag_and_is_restricted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_scenario("missing_rank", tmp_path, formats=("pickle",))
    rc, _, err = _cli(capsys, str(tmp_path))
    assert rc == 2 and "--allow-pickle" in err
    rc, out, _ = _cli(capsys, str(tmp_path), "--allow-pickle", "--json")
    assert rc == 0 and json.loads(out)["issues"][0]["ranks"] == [2]

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, (f"touch {marker}",))

    (tmp_path / "evil_rank_9").write_bytes(pickle.dumps({"version": "2.10", "entries": [Evil()]}))
    rc, _, err = _cli(capsys, str(tmp_path), "--allow-pickle")
    assert rc == 0 and not marker.exists()
    assert "refusing to load global" in err and "evil_rank_9" in err


def test_both_flavours_of_one_rank_count_once(tmp_path: Path) -> None:
    write_scenario("missing_rank", tmp_path, formats=("json", "pickle"))
    report = analyze_dir(tmp_path, allow_pickle=True)
    assert [d.rank for d in report.dumps] == [0, 1, 2] and report.problems == []
    assert all(d.source == "torchnext-json" for d in report.dumps)
    assert sum("another dump of rank" in n for n in report.notes) == 3
    assert [(i.kind, i.ranks) for i in report.issues] == [("missing_ranks", [2])]


def test_truncated_pickle(tmp_path: Path) -> None:
    write_scenario("healthy", tmp_path, formats=("pickle",))
    p = tmp_path / "torchnext_fr_trace_rank_0"
    p.write_bytes(p.read_bytes()[:100])
    with pytest.raises(ValueError, match="truncated pickle"):
        load_file(p, allow_pickle=True)


def test_generations_are_analysed_separately(tmp_path: Path) -> None:
    """Generation 0: 3 healthy ranks; rank 2 dies; generation 1 = ranks 0, 1 where rank 1 misses a collective."""
    x = torch.ones(4)
    for r in (0, 1):
        fr = FlightRecorder(50, rank=r, world_size=3)
        g0 = fr.add_group("world", ranks=[0, 1, 2])
        for i in range(3):
            fr.complete(fr.record(g0, "all_reduce", inputs=[x], outputs=[x], t_ns=i * 10**6), t_ns=i * 10**6 + 1)
        fr.complete(fr.record(g0, "all_reduce", inputs=[x], outputs=[x], t_ns=5 * 10**6), "error", t_ns=6 * 10**6)
        fr.generation = 1
        g1 = fr.add_group("world", ranks=[0, 1])
        for i in range(2 if r == 0 else 1):
            fr.record(g1, "all_reduce", inputs=[x], outputs=[x], t_ns=(10 + i) * 10**6)
        fr.dump(tmp_path)
    report = analyze_dir(tmp_path)
    kinds = [(i.kind, i.pg, i.generation, i.ranks, i.seq) for i in report.issues]
    assert ("missing_ranks", "world", 0, [2], 4) in kinds  # rank 2 died in generation 0 (no dump)
    assert ("missing_ranks", "world@g1", 1, [1], 2) in kinds
    assert report.last_completed["world"] == {"seq": 3, "op": "all_reduce", "generation": 0}


def test_timeline_html_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_scenario("missing_rank", tmp_path / "d")
    html_out = tmp_path / "t.html"
    rc, _, _ = _cli(capsys, str(tmp_path / "d"), "--timeline", str(html_out))
    assert rc == 0
    doc = html_out.read_text()
    assert "<svg" in doc and "rank 2 !" in doc and "hang: all_reduce #3" in doc and "<script" not in doc
    png = tmp_path / "t.png"
    pytest.importorskip("matplotlib")
    rc, _, _ = _cli(capsys, str(tmp_path / "d"), "--timeline", str(png))
    assert rc == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rc, _, err = _cli(capsys, str(tmp_path / "d"), "--timeline", str(tmp_path / "t.svgz"))
    assert rc == 2 and "use .png or .html" in err


def test_timeline_png_without_matplotlib(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    write_scenario("healthy", tmp_path / "d")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    rc, _, err = _cli(capsys, str(tmp_path / "d"), "--timeline", str(tmp_path / "t.png"))
    assert rc == 2 and "needs matplotlib" in err and "torchnext[plot]" in err


@pytest.mark.parametrize("scenario", ["missing_rank", "killed"])
def test_torchfrtrace_reads_our_pickle_dumps(scenario: str, tmp_path: Path) -> None:
    write_scenario(scenario, tmp_path, formats=("json", "pickle"))
    cmd = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(tmp_path)]
    if scenario == "killed":
        cmd.append("--allow-incomplete-ranks")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    if scenario == "missing_rank":
        assert "Not all ranks joining collective" in out and "missing ranks: {2}" in out
    else:
        assert "missed FR dumps from ranks ({2})" in out


_TORCH_JOB = textwrap.dedent(
    """
    import os, pickle, sys, torch, torch.distributed as dist
    rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    store = dist.TCPStore("127.0.0.1", port, 2, False, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    t = torch.ones(4)
    for _ in range(3 if rank == 0 else 2):
        dist.all_reduce(t, async_op=True)  # rank 1 skips the third all_reduce; nobody waits, nobody hangs
    dist.barrier(group=dist.new_group([0, 1], backend="gloo")) if False else None
    from torch._C._distributed_c10d import _dump_fr_trace, _dump_fr_trace_json
    with open(os.path.join(out, f"torch_trace_rank_{rank}"), "wb") as f:
        f.write(_dump_fr_trace())
    with open(os.path.join(out, "json", f"torch_trace_rank_{rank}.json"), "wb") as f:
        f.write(_dump_fr_trace_json())
    sys.stdout.flush()
    os._exit(0)
    """
)


def test_reads_pytorchs_own_dumps(tmp_path: Path) -> None:
    """A real torch.distributed Gloo job dumped by PyTorch's recorder (pickle and JSON flavours)."""
    (tmp_path / "json").mkdir()
    store = torch.distributed.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    env = dict(os.environ, TORCH_FR_BUFFER_SIZE="100")
    procs = [
        subprocess.Popen([sys.executable, "-c", _TORCH_JOB, str(r), str(store.port), str(tmp_path)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for r in range(2)
    ]
    try:
        outs = [p.communicate(timeout=120)[0].decode() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), outs
    for folder, allow in ((tmp_path, True), (tmp_path / "json", False)):
        report = analyze_dir(folder, allow_pickle=allow)
        assert [d.source for d in report.dumps] == ["torch-pickle" if allow else "torch-json"] * 2
        issue = report.issues[0]
        assert (issue.kind, issue.ranks, issue.seq, issue.op) == ("missing_ranks", [1], 3, "all_reduce")
        assert any("inferred from the dumps" in n for n in report.notes)


def test_missing_rank_that_dumped_before_the_others_entered_is_flagged(tmp_path: Path) -> None:
    """Dumps taken at different moments of a healthy job: rank 1 dumped before rank 0 entered all_reduce #2."""
    x = torch.ones(2)
    fr1 = FlightRecorder(10, rank=1, world_size=2)
    pg1 = fr1.add_group("world", ranks=[0, 1])
    fr1.complete(fr1.record(pg1, "all_reduce", inputs=[x]))
    fr1.dump(tmp_path)
    fr0 = FlightRecorder(10, rank=0, world_size=2)
    pg0 = fr0.add_group("world", ranks=[0, 1])
    fr0.complete(fr0.record(pg0, "all_reduce", inputs=[x]))
    fr0.record(pg0, "all_reduce", inputs=[x])
    fr0.dump(tmp_path)
    issue = analyze_dir(tmp_path).issues[0]
    assert (issue.kind, issue.ranks, issue.seq) == ("missing_ranks", [1], 2)
    assert issue.detail["missing"]["1"]["dumped_before_others_entered"] is True
    assert "not necessarily a hang" in issue.message
