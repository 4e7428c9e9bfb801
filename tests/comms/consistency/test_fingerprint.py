"""Fingerprints: which arguments each op must agree on, digests, malformed peer data, naming the culprit."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch

from torchnext.comms import OpInfo
from torchnext.comms.consistency import Fingerprint, FingerprintError
from torchnext.comms.consistency.fingerprint import difference, exchange_difference


def _info(op: str, inputs: tuple[torch.Tensor, ...] = (), outputs: tuple[torch.Tensor, ...] = (), *,
          root: int | None = None, reduce_op: str | None = None, size: int = 3, splits: Any = ()) -> OpInfo:
    return OpInfo(op, 1, "w", tuple(range(size)), 0, size, False, root, None, reduce_op, inputs, outputs,
                  timedelta(seconds=1), None, (), splits)


def _fp(info: OpInfo, seq: int = 1) -> Fingerprint:
    return Fingerprint.of(info, seq).normalized()


def test_what_must_agree_per_op() -> None:
    t4, t6 = torch.ones(4), torch.ones(6)
    # all_reduce: sizes, dtypes and the reduce op
    base = _fp(_info("all_reduce", (t4,), (t4,), reduce_op="sum"))
    assert base.digest == _fp(_info("all_reduce", (t4,), (t4,), reduce_op="sum")).digest
    assert base.digest != _fp(_info("all_reduce", (t6,), (t6,), reduce_op="sum")).digest
    assert base.digest != _fp(_info("all_reduce", (t4,), (t4,), reduce_op="max")).digest
    assert base.digest != _fp(_info("all_reduce", (t4.int(),), (t4.int(),), reduce_op="sum")).digest
    # broadcast: the root too; gather: the root's list exists on the root only, so outputs are not compared
    assert _fp(_info("broadcast", (t4,), (t4,), root=0)).digest != _fp(_info("broadcast", (t4,), (t4,), root=1)).digest
    g_root = _fp(_info("gather", (t4,), (t4, t4, t4), root=0))
    assert g_root.digest == _fp(_info("gather", (t4,), (), root=0)).digest
    assert _fp(_info("scatter", (t4, t4, t4), (t4,), root=2)).digest == _fp(_info("scatter", (), (t4,), root=2)).digest
    # all_to_all: sizes legitimately differ per rank; only count and dtype go into the digest
    a = _fp(_info("all_to_all", (torch.ones(1), torch.ones(2), torch.ones(3)), (t4, t4, t4)))
    b = _fp(_info("all_to_all", (torch.ones(5), torch.ones(2), torch.ones(3)), (t4, t4, t4)))
    assert a.digest == b.digest
    assert Fingerprint.of(_info("all_to_all", (torch.ones(1), torch.ones(2), torch.ones(3)), (t4, t4, t4)), 1
                          ).exchange == ((1, 2, 3), (4, 4, 4))
    rows = Fingerprint.of(_info("all_to_all_single", (torch.ones(6, 2),), (torch.ones(3, 2),), splits=((1, 1, 1),
                                                                                                     (2, 2, 2))), 1)
    assert rows.exchange == ((2, 2, 2), (1, 1, 1))
    equal = Fingerprint.of(_info("all_to_all_single", (torch.ones(6, 2),), (torch.ones(6, 2),)), 1)
    assert equal.exchange == ((2, 2, 2), (2, 2, 2))
    assert _fp(_info("barrier")).digest == _fp(_info("barrier"), seq=9).digest  # seq is not part of the digest
    assert _fp(_info("barrier")).digest != _fp(_info("all_reduce", reduce_op="sum")).digest


def test_difference_names_the_minority_and_the_field() -> None:
    t4, t6 = torch.ones(4), torch.ones(6)
    fps = {r: _fp(_info("all_gather_single", (t6 if r == 1 else t4,), (torch.ones(18 if r == 1 else 12),)), 2)
           for r in range(3)}
    field, culprits, message = difference(fps, [10, 11, 12]) or ("", [], "")
    assert (field, culprits) == ("input_sizes", [11])
    assert message == "rank 11 entered all_gather_single #2 with input_sizes [6] where ranks [10, 12] have [4]"
    ops = {0: _fp(_info("all_reduce", (t4,), (t4,), reduce_op="sum")), 1: _fp(_info("barrier")),
           2: _fp(_info("all_reduce", (t4,), (t4,), reduce_op="sum"))}
    field, culprits, message = difference(ops) or ("", [], "")
    assert (field, culprits) == ("op", [1])
    assert message.startswith("rank 1 entered barrier #1 where ranks [0, 2] entered all_reduce #1")
    tie = {0: _fp(_info("broadcast", (t4,), (t4,), root=0)), 1: _fp(_info("broadcast", (t4,), (t4,), root=1))}
    field, culprits, message = difference(tie) or ("", [], "")
    assert (field, culprits) == ("root", [1]) and "no majority" in message
    assert difference({0: ops[0], 2: ops[2]}) is None


def test_exchange_difference_names_both_sides_of_a_pair() -> None:
    table = {0: ([1, 1], [1, 1]), 1: ([2, 1], [1, 1])}  # rank 1 sends 2 to rank 0, which expects 1
    culprits, message = exchange_difference(table, [0, 1], "rows") or ([], "")
    assert culprits == [0, 1]
    assert message == "rank 1 sends 2 rows to rank 0, which expects 1 from it"
    assert exchange_difference({0: ([1, 1], [1, 1]), 1: ([1, 1], [1, 1])}, [0, 1], "rows") is None


@pytest.mark.parametrize("raw,problem", [
    (b"", "not JSON"),
    (b"\xff\xfe", "not UTF-8"),
    (b"[1, 2]", "keys op, seq, parts"),
    (b'{"op": "", "seq": 1, "parts": []}', "op must be"),
    (b'{"op": "x", "seq": -1, "parts": []}', "seq must be"),
    (b'{"op": "x", "seq": true, "parts": []}', "seq must be"),
    (b'{"op": "x", "seq": 1, "parts": [[1, 2]]}', "parts must be"),
    (b'{"op": "x", "seq": 1, "parts": {}}', "parts must be"),
    (b'{"op": "x", "seq": 1, "parts": [], "extra": 1}', "keys op, seq, parts"),
    (b"{" * 100, "not JSON"),
    (b" " * 70000, "exceeds"),
])
def test_malformed_fingerprints_from_a_peer_are_refused_by_name(raw: bytes, problem: str) -> None:
    with pytest.raises(FingerprintError, match=problem) as info:
        Fingerprint.from_json(raw, source="rank 7")
    assert "rank 7" in str(info.value)


def test_round_trip() -> None:
    fp = Fingerprint.of(_info("reduce", (torch.ones(2, 3, dtype=torch.bfloat16),), (), root=1, reduce_op="max"), 5)
    back = Fingerprint.from_json(fp.to_json().encode(), source="x")
    assert back == fp.normalized() and back.digest == fp.digest
    assert back.text() == "reduce #5 root 1 reduce_op max input_sizes [2, 3] dtypes bfloat16"
