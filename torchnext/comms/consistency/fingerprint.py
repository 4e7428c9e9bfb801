"""What the members of a communicator compare before an op: its fingerprint, and how fingerprints differ.

Semantics (a tiny reference)::

    rule = rule_for(info.op)               # which arguments must agree across members for this op
    fp = Fingerprint.of(info, seq, rule)   # op, sequence number, and those arguments, as plain values
    fp.digest                              # 62-bit integer; equal digests <=> equal fingerprints (up to collisions)
    fp.exchange                            # all_to_all: (elements sent to each rank, received from each rank)
    difference({rank: fp, ...})            # None, or (field, culprits, message) naming what differs

Which arguments must agree (the registry :data:`RULES`; any other op: every input and output)::

    all_reduce, reduce_scatter[_single]   input and output sizes and dtypes, reduce op
    reduce                                input sizes and dtypes, root, reduce op
    broadcast, gather                     input sizes and dtypes, root   (gather's list exists on the root only)
    scatter                               output sizes and dtypes, root  (scatter's list exists on the root only)
    all_gather[_single], split            input and output sizes and dtypes
    all_to_all                            chunk count and dtype; then, pairwise, what i sends j = what j expects from i
    all_to_all_single                     row shape and dtype; then the split matrix, pairwise
    barrier                               the op alone

A fingerprint received from another member is untrusted input: :meth:`Fingerprint.from_json` checks every field
and raises :class:`FingerprintError` naming what is wrong.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from torchnext.comms.hooks import OpInfo

__all__ = ["RULES", "Fingerprint", "FingerprintError", "Rule", "difference", "rule_for"]

_MASK = (1 << 62) - 1
_MAX_TEXT = 1 << 16  # a fingerprint larger than this (64 KiB of JSON) is refused when it arrives from a peer


class FingerprintError(ValueError):
    """A fingerprint that arrived from another member is malformed (the message says what is wrong)."""


@dataclass(frozen=True, slots=True)
class Rule:
    """Which arguments of an op the members must agree on."""

    inputs: bool = True
    """Sizes and dtypes of the input tensors."""
    outputs: bool = True
    """Sizes and dtypes of the output tensors."""
    root: bool = False
    reduce_op: bool = False
    exchange: str | None = None
    """``"chunks"`` (all_to_all: per-rank tensors) or ``"rows"`` (all_to_all_single): sizes differ per pair, so
    only the dtype and the chunk count / row shape go into the digest, and the per-pair counts are compared
    afterwards (what rank i sends to j must be what j expects from i)."""


RULES: dict[str, Rule] = {
    "all_reduce": Rule(reduce_op=True),
    "reduce": Rule(outputs=False, root=True, reduce_op=True),
    "reduce_scatter": Rule(reduce_op=True),
    "reduce_scatter_single": Rule(reduce_op=True),
    "broadcast": Rule(outputs=False, root=True),
    "gather": Rule(outputs=False, root=True),
    "scatter": Rule(inputs=False, root=True),
    "all_gather": Rule(),
    "all_gather_single": Rule(),
    "all_to_all": Rule(inputs=False, outputs=False, exchange="chunks"),
    "all_to_all_single": Rule(inputs=False, outputs=False, exchange="rows"),
    "barrier": Rule(inputs=False, outputs=False),
}
_DEFAULT = Rule()


def rule_for(op: str) -> Rule:
    """The rule of ``op`` (every input and output must agree for an op the registry does not know)."""
    return RULES.get(op, _DEFAULT)


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _parts(info: OpInfo, rule: Rule) -> tuple[tuple[str, Any], ...]:
    """The compared arguments of ``info`` as ``(field, plain value)`` pairs, in report order."""
    parts: list[tuple[str, Any]] = []
    if rule.root:
        parts.append(("root", info.root))
    if rule.reduce_op:
        parts.append(("reduce_op", info.reduce_op))
    if rule.exchange == "chunks":
        tensors = (*info.inputs, *info.outputs)
        parts.append(("chunks", len(info.inputs)))
        parts.append(("dtypes", [_dtype(tensors[0])] if tensors else []))
    elif rule.exchange == "rows":
        parts.append(("row_shape", [list(t.shape[1:]) for t in (*info.inputs, *info.outputs)]))
        parts.append(("dtypes", [_dtype(t) for t in (*info.inputs, *info.outputs)]))
    else:
        if rule.inputs:
            parts.append(("input_sizes", [list(t.shape) for t in info.inputs]))
        if rule.outputs:
            parts.append(("output_sizes", [list(t.shape) for t in info.outputs]))
        dtypes = [_dtype(t) for t in info.inputs] if rule.inputs else []
        if rule.outputs:
            dtypes += [_dtype(t) for t in info.outputs]
        parts.append(("dtypes", dtypes))
    return tuple(parts)


def _exchange(info: OpInfo, rule: Rule) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(count sent to each rank, count expected from each rank): elements (all_to_all) or rows (_single)."""
    if rule.exchange == "chunks":
        return tuple(t.numel() for t in info.inputs), tuple(t.numel() for t in info.outputs)
    if rule.exchange == "rows":
        size = info.size
        if info.splits:
            out_splits, in_splits = info.splits
        else:
            out_splits, in_splits = (), ()
        inp, out = info.inputs[0], info.outputs[0]
        sends = tuple(in_splits) or (inp.shape[0] // size,) * size
        recvs = tuple(out_splits) or (out.shape[0] // size,) * size
        return tuple(int(x) for x in sends), tuple(int(x) for x in recvs)
    return None


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """One member's view of one op: what must agree across members (``parts``), numbered by ``seq``."""

    op: str
    seq: int
    parts: tuple[tuple[str, Any], ...]
    exchange: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    @classmethod
    def of(cls, info: OpInfo, seq: int, rule: Rule | None = None) -> Fingerprint:
        rule = rule or rule_for(info.op)
        return cls(op=info.op, seq=seq, parts=_parts(info, rule), exchange=_exchange(info, rule))

    @property
    def digest(self) -> int:
        """A 62-bit hash of ``op`` and ``parts`` (not ``seq``: the side channel pairs members in order already)."""
        text = repr((self.op, self.parts)).encode()
        return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & _MASK

    def value(self, field: str) -> Any:
        return self.op if field == "op" else dict(self.parts).get(field)

    def text(self) -> str:
        """``all_gather_single #2 input_sizes [6] output_sizes [18] dtypes float32``."""
        shown = " ".join(f"{k} {_show(v)}" for k, v in self.parts)
        return f"{self.op} #{self.seq}" + (f" {shown}" if shown else "")

    def to_json(self) -> str:
        return json.dumps({"op": self.op, "seq": self.seq, "parts": [[k, v] for k, v in self.parts]},
                          separators=(",", ":"))

    @classmethod
    def from_json(cls, data: bytes | str, *, source: str) -> Fingerprint:
        """Parse a fingerprint another member sent; ``FingerprintError`` naming ``source`` when malformed."""
        if isinstance(data, bytes):
            if len(data) > _MAX_TEXT:
                raise FingerprintError(f"{source}: fingerprint of {len(data)} bytes exceeds {_MAX_TEXT}")
            try:
                data = data.decode()
            except UnicodeDecodeError:
                raise FingerprintError(f"{source}: fingerprint is not UTF-8 text") from None
        try:
            obj = json.loads(data)
        except ValueError as exc:
            raise FingerprintError(f"{source}: fingerprint is not JSON ({exc})") from None
        if not isinstance(obj, dict) or set(obj) != {"op", "seq", "parts"}:
            raise FingerprintError(f"{source}: fingerprint must be an object with keys op, seq, parts")
        op, seq, parts = obj["op"], obj["seq"], obj["parts"]
        if not isinstance(op, str) or not op or len(op) > 200:
            raise FingerprintError(f"{source}: fingerprint op must be a non-empty string, got {op!r:.80}")
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            raise FingerprintError(f"{source}: fingerprint seq must be a non-negative int, got {seq!r:.80}")
        if not isinstance(parts, list) or not all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in parts
        ):
            raise FingerprintError(f"{source}: fingerprint parts must be a list of [field, value] pairs")
        return cls(op=op, seq=seq, parts=tuple((k, v) for k, v in parts))

    def normalized(self) -> Fingerprint:
        """The same fingerprint as it looks after a JSON round trip (what a peer compares against)."""
        return Fingerprint.from_json(self.to_json(), source="this rank")


def _show(v: Any) -> str:
    if isinstance(v, list) and len(v) == 1:
        return str(v[0])
    return str(v)


def _majority(values: dict[int, Any]) -> tuple[Any, list[int], bool]:
    """(the most common value, the ranks that differ from it, whether the choice was a tie).

    Ties go to the value of the lowest rank among the tied values (torch's checker reports against rank 0 too)."""
    keys = {r: json.dumps(v, sort_keys=True) for r, v in values.items()}
    counts = Counter(keys.values())
    best = max(counts.values())
    tie = sum(1 for c in counts.values() if c == best) > 1
    expected_key = next(keys[r] for r in sorted(values) if counts[keys[r]] == best)
    expected = next(values[r] for r in sorted(values) if keys[r] == expected_key)
    return expected, sorted(r for r in values if keys[r] != expected_key), tie


def difference(fps: dict[int, Fingerprint], ranks: Sequence[int] | None = None) -> tuple[str, list[int], str] | None:
    """What differs between the members' fingerprints of one op: ``(field, culprits, message)`` or None.

    ``fps`` maps a member's rank in the communicator to its fingerprint; ``ranks[r]`` is its global rank (culprits
    and the message use global ranks). The first field that differs is reported (op, then the op's arguments in
    report order); the culprits are the members outside the majority."""
    glob = list(ranks) if ranks is not None else sorted(fps)
    fields = ["op"] + [k for k, _ in next(iter(fps.values())).parts]
    for fp in fps.values():
        fields += [k for k, _ in fp.parts if k not in fields]
    for field in fields:
        values = {r: fp.value(field) for r, fp in fps.items()}
        expected, odd, tie = _majority(values)
        if not odd:
            continue
        others = sorted(glob[r] for r in values if r not in odd)
        seq = next(iter(fps.values())).seq
        op = _majority({r: fp.op for r, fp in fps.items()})[0]
        if field == "op":
            what = "; ".join(f"rank {glob[r]} entered {fps[r].op} #{fps[r].seq}" for r in odd)
            message = f"{what} where {_ranks(others)} entered {expected} #{seq}"
        else:
            what = "; ".join(f"rank {glob[r]} entered {op} #{seq} with {field} {_show(values[r])}" for r in odd)
            message = f"{what} where {_ranks(others)} {'has' if len(others) == 1 else 'have'} {_show(expected)}"
        if tie:
            message += (f" (no majority among the {len(fps)} members: the value of the lowest rank is taken as the "
                        "reference)")
        return field, sorted(glob[r] for r in odd), message
    return None


def exchange_difference(table: dict[int, tuple[Sequence[int], Sequence[int]]], ranks: Sequence[int],
                        unit: str) -> tuple[list[int], str] | None:
    """all_to_all: pairs where what rank i sends to j differs from what j expects from i: (culprits, message)."""
    bad: list[tuple[int, int, int, int]] = []
    for i, (sends, _) in sorted(table.items()):
        for j, (_, recvs) in sorted(table.items()):
            if sends[j] != recvs[i]:
                bad.append((i, j, int(sends[j]), int(recvs[i])))
    if not bad:
        return None
    shown = "; ".join(f"rank {ranks[i]} sends {s} {unit} to rank {ranks[j]}, which expects {r} from it"
                      for i, j, s, r in bad[:4])
    more = f" (and {len(bad) - 4} more pairs)" if len(bad) > 4 else ""
    culprits = sorted({ranks[i] for i, _, _, _ in bad} | {ranks[j] for _, j, _, _ in bad})
    return culprits, shown + more


def _ranks(rs: Sequence[int]) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {list(rs)}"
