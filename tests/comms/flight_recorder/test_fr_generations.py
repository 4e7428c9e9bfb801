"""The report tells a failure: which op was in flight where, who vanished and how, when the next generation formed;
the timeline marks failed/aborted ops and generation boundaries; a clean close is not worded as a crash."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from torchnext.comms import CommError, Communicator, FlightRecorder
from torchnext.comms.flight_recorder import analyze_dir
from torchnext.comms.flight_recorder.timeline import render_timeline, timeline_marks
from torchnext.testing import RankContext, RankExited, crash_now, run_ranks


def generations_body(ctx: RankContext, d: str) -> Any:
    """Generation 0 of 3 members; member 2 dies inside all_reduce #3; the survivors abort it the way the
    fault-tolerance layer does (with the reason), rebuild generation 1 without it, train on, and close it."""
    comm = Communicator(ctx.store, ctx.rank, 3, timeout=timedelta(seconds=60), name="job.g0")
    fr = FlightRecorder.attach(comm, dump_dir=d)
    t = torch.ones(4)
    for _ in range(2):
        comm.all_reduce(t)
    if ctx.rank == 2:
        time.sleep(0.2)  # the others are inside all_reduce #3 when it dies
        crash_now()
    try:
        comm.all_reduce(t)
    except CommError:
        pass
    comm.abort("generation 1 announced (member 2 connection closed (process exited or crashed))")
    time.sleep(0.1)  # the next generation takes a while to form
    comm1 = Communicator(ctx.store, ctx.rank, 2, timeout=timedelta(seconds=60), name="job.g1", global_ranks=[0, 1])
    fr.add_communicator(comm1, generation=1)
    for _ in range(3):
        comm1.all_reduce(t)
    comm1.abort("the job finished at step 5")  # a clean close: nothing in flight
    fr.dump(d + os.sep, reason="end")
    return True


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("generations")
    results = run_ranks(generations_body, 3, args=(str(d),), timeout=180, allow_exit=[2])
    assert isinstance(results[2], RankExited) and results[:2] == [True, True]
    return d


def test_the_report_tells_the_failure(dumps: Path) -> None:
    report = analyze_dir(dumps)
    g0, g1 = report.generations
    assert (g0.pg, g0.generation, g0.members, g0.outcome) == ("job.g0", 0, [0, 1, 2], "failure")
    assert g0.in_flight == {0: ["all_reduce #3 (failed)"], 1: ["all_reduce #3 (failed)"]}
    assert g0.vanished == [2] and g0.no_dump == [2]
    assert g0.next_pg == "job.g1@g1" and g0.next_members == [0, 1]
    assert g0.ended_s is not None and g0.next_formed_s is not None and g0.next_formed_s - g0.ended_s >= 0.09
    assert any("member 2 connection closed" in r for r in g0.reasons), g0.reasons
    assert "all_reduce #3 (failed) on ranks [0, 1]" in g0.message
    assert "rank 2 vanished (rank 2 left no dump)" in g0.message
    assert "generation 1 ('job.g1@g1', members [0, 1]) formed" in g0.message
    # the end of the last generation is a close, not a crash
    assert (g1.outcome, g1.in_flight) == ("closed", {})
    assert "was closed" in g1.message and "the job finished at step 5" in g1.message
    assert "failure" not in g1.message and "crash" not in g1.message
    assert report.to_json()["generations"][0]["vanished"] == [2]


def test_the_timeline_marks_failures_and_generations(dumps: Path, tmp_path: Path) -> None:
    report = analyze_dir(dumps)
    marks = timeline_marks(report)
    kinds = {(m.kind, m.rank) for m in marks}
    assert ("generation", None) in kinds
    assert {("error", 0), ("error", 1), ("abort", 0), ("abort", 1)} <= kinds
    boundary = next(m for m in marks if m.kind == "generation")
    assert boundary.label == "generation 1 (job.g1@g1): members [0, 1]"
    out = render_timeline(report, tmp_path / "t.html")
    html = out.read_text()
    assert "generation 1 (job.g1@g1): members [0, 1]" in html
    assert "abort() of job.g0: generation 1 announced" in html
    assert "all_reduce #3 (job.g0) error" in html
    pytest.importorskip("matplotlib")
    png = render_timeline(report, tmp_path / "t.png")
    assert png.stat().st_size > 5000


def test_each_generation_continues_in_its_own_lineage() -> None:
    """Replica groups of two ranks keep one replicate communicator per group rank (``ft.g<g>.r0``, ``ft.g<g>.r1``):
    generation 1's r0 communicator is followed by generation 2's r0, not by whichever was added first."""
    from torchnext.comms.flight_recorder.generations import generation_ends
    from torchnext.comms.flight_recorder.loader import GroupInfo, RankDump

    def group(name: str, gen: int, ranks: list[int], added: int) -> GroupInfo:
        return GroupInfo(key=f"{name}@g{gen}", desc=name, ranks=ranks, generation=gen, time_added_ns=added)

    groups = {g.key: g for g in (group("ft.g1.r0", 1, [0, 2], 1), group("ft.g1.r1", 1, [1, 3], 2),
                                  group("ft.g2.r1", 2, [1], 5), group("ft.g2.r0", 2, [0], 6))}
    dumps = []
    for rank, mine in ((0, ("ft.g1.r0@g1", "ft.g2.r0@g2")), (1, ("ft.g1.r1@g1", "ft.g2.r1@g2"))):
        entry = {"op": "all_reduce", "pg": mine[0], "state": "completed", "is_p2p": False, "seq_id": 1,
                 "time_created_ns": 10, "collective_seq_id": 1}
        abort = {"pg": mine[0], "kind": "abort", "time_ns": 20, "reason": "generation 2 announced", "in_flight": []}
        dumps.append(RankDump(path=f"r{rank}", source="torchnext-json", rank=rank, version="x", entries=[entry],
                              groups={k: groups[k] for k in mine}, events=[abort]))
    ends = {e.pg: e for e in generation_ends(dumps, groups)}
    assert ends["ft.g1.r0@g1"].next_pg == "ft.g2.r0@g2" and ends["ft.g1.r0@g1"].vanished == [2]
    assert ends["ft.g1.r1@g1"].next_pg == "ft.g2.r1@g2" and ends["ft.g1.r1@g1"].vanished == [3]
    assert ends["ft.g1.r0@g1"].joined == [] and ends["ft.g1.r1@g1"].joined == []
