"""The fast JSON entry formatter against the reference dict formatter, on random slots."""

from __future__ import annotations

import json
import random
import sys

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchnext.comms.flight_recorder.entries import entries_json, format_entries
from torchnext.comms.flight_recorder.recorder import FlightRecorder

OPS = ["all_reduce", "broadcast", "send", "recv", "batch_p2p", "barrier", "all_gather", 'we"ird\\op']
DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.float8_e4m3fn]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(0, 60), capacity=st.integers(1, 40))
def test_fast_json_equals_reference(seed: int, n: int, capacity: int) -> None:
    rng = random.Random(seed)
    fr = FlightRecorder(capacity, rank=1, world_size=4, record_frames=rng.random() < 0.5)
    pgs = [fr.add_group("world", ranks=[0, 1, 2, 3]), fr.add_group("pair ü", ranks=[1, 3], desc='d"q')]
    for i in range(n):
        pg = rng.choice(pgs)
        op = rng.choice(OPS)
        peer = rng.choice([None, 0, 1]) if op in ("send", "recv") else None
        ins = [torch.empty([rng.randint(0, 3)] * rng.randint(0, 2), dtype=rng.choice(DTYPES))
               for _ in range(rng.randint(0, 3))]
        outs = ins if rng.random() < 0.5 else [torch.empty(2, dtype=rng.choice(DTYPES))]
        rid = fr.record(pg, op, inputs=ins, outputs=outs, op_id=i, peer=peer, tag=rng.randint(0, 3),
                        timeout_ms=rng.choice([None, 1000]), async_op=rng.random() < 0.5,
                        state=rng.choice(["started", "scheduled"]), t_ns=rng.randint(0, 10**18))
        if rng.random() < 0.7:
            fr.complete(rid, rng.choice(["completed", "error", "timed_out", "aborted"]),
                        error=rng.choice([None, "CommTimeout: x\n\"y\""]), t_ns=rng.randint(10**18, 2 * 10**18))
        if rng.random() < 0.1:
            fr.generation += 1
    live = fr._live()
    reference = format_entries(live, fr._groups, fr.rank, torch_compat=False)
    assert json.loads(entries_json(live, fr._groups, fr.rank)) == json.loads(json.dumps(reference))
    assert reference == fr.entries()


def test_dump_json_round_trips_entries(tmp_path: object) -> None:
    fr = FlightRecorder(10, rank=0, world_size=1, record_frames=True)
    pg = fr.add_group("world", ranks=[0])
    fr.complete(fr.record(pg, "all_reduce", inputs=[torch.ones(3)]))
    d = json.loads(fr.dump(str(tmp_path) + "/").read_text())
    assert d["entries"] == json.loads(json.dumps(fr.entries()))
    assert d["entries"][0]["frames"][0]["filename"] == sys._getframe().f_code.co_filename
