"""The membership protocol on the wire: line-delimited JSON framing, message schemas, mutual authentication.

One message = one JSON object on one line (``\\n``-terminated, UTF-8), never pickle. A coordinator reads lines of at
most :data:`MAX_LINE` bytes (members' messages are small); a member reads lines of at most
:data:`MAX_GENERATION_LINE` (a generation of up to :data:`MAX_MEMBERS` members). Reference::

    encode(msg)  == json.dumps(wire_form(msg), separators=(",", ":")).encode() + b"\\n"
    LineReader().feed(b'{"t":"hb"}\\n{"t":') == [{"t": "hb"}]      # the partial second line is kept
    check(decode(encode(gen)), COORDINATOR_MESSAGES) == gen       # a generation's compact form expands back

A generation goes on the wire compact (:func:`wire_form`): its replica groups once; ``members`` (the sorted ids of
the groups), ``donors`` (the donor's group) and ``quorum`` (= ``groups``) are left out when they are what the
receiver derives, and ``joiners`` is sent as its complement ``synced`` when that is shorter (a formation: every
group but the donor's joins). ``check`` derives them back (``Schema.derive``), so every reader sees the full message.

Everything a peer sends is untrusted: :meth:`LineReader.feed` turns every malformed line (bad UTF-8 or JSON, too
long, nested too deep, NaN, an integer of thousands of digits, not an object) into :class:`ProtocolError`, and
:func:`check` validates a message against its :class:`Schema` -- each field's type and range -- and returns only
the declared fields, so the code that acts on a message never meets a value of the wrong type. The receiver closes
that one connection with the error as the logged reason; nothing a peer sends can raise anything else.

Authentication (both ways, the job token never crosses the wire)::

    coordinator -> member   {"t": "challenge", "nonce": Ns, "proto": 3}
    member -> coordinator   {"t": "hello", "nonce": Nm, "proof": mac(token, "member", Ns, Nm), ...}
    coordinator -> member   {"t": "welcome", "proof": mac(token, "coordinator", Nm, Ns), ...}

``mac`` is HMAC-SHA256; both sides compare in constant time. A member therefore trusts a coordinator only after
it proved it knows the token, which matters once members connect to whatever listens at the standby's address.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "COORDINATOR_MESSAGES",
    "FOLLOWER",
    "GENERATION",
    "GENERATION_REF",
    "GEN_MESSAGE",
    "HELLO_TIMEOUT_S",
    "LEADER_MESSAGES",
    "MAX_GENERATION_LINE",
    "MAX_CHUNK",
    "MAX_GROUP",
    "MAX_LINE",
    "MAX_MEMBERS",
    "MEMBER_MESSAGES",
    "PROTOCOL_VERSION",
    "RELAY_MESSAGES",
    "RELAY_PEER_MESSAGES",
    "REPORT",
    "LineReader",
    "accept_tuned",
    "ProtocolError",
    "apply_delta",
    "Schema",
    "boolean",
    "check",
    "encode",
    "integer",
    "int_list",
    "groups",
    "mac",
    "new_nonce",
    "number",
    "optional",
    "record",
    "record_list",
    "recv_or_closed",
    "setup_accepted",
    "text",
    "tune_socket",
    "verify",
    "wire_form",
]

PROTOCOL_VERSION = 5
"""Version of the membership protocol; a hello with another version is rejected. 2: mutual authentication,
coordinator failover (reports, terms, prepare/promise). 3: generations in their compact form (:func:`wire_form`),
lists of up to :data:`MAX_MEMBERS` ids. 4: group sessions -- a replica group's leader joins, heartbeats and votes
for its whole group (``hello.followers``, ``welcome.members``), reports a follower's death (``lost``) and its failed
collectives (``fail.member``); see docs/fault_tolerance.md, "Membership hierarchy". 5: vote relays -- a leader may
offer a relay listener (``hello.relay``); per generation the coordinator names relays (``relay``), and a relay's
``vote`` stands for its chunk (``chunk``) or part of it (``heads``); see "Vote relays"."""

MAX_GROUP = 1024
"""Most ranks in one replica group a leader speaks for (its ``followers`` list holds at most ``MAX_GROUP - 1``)."""

MAX_CHUNK = 4096
"""Most sessions in one relay's chunk (a ``relay`` message's ``chunk``, a relayed ``vote``'s ``heads``)."""

MAX_LINE = 1 << 16
"""Longest line a coordinator accepts (bytes): a member's messages are small; a longer line is a protocol violation.
(The largest is a hello carrying a report of a generation: its groups and quorum, ~13 bytes per member.)"""

MAX_MEMBERS = 1 << 17
"""Most member ids in one list of a message (a generation's groups, members, joiners)."""

MAX_GENERATION_LINE = 1 << 24
"""Longest line a member accepts (bytes): a generation of :data:`MAX_MEMBERS` members whose quorum differs from its
groups (~20 bytes per member at most) fits; a longer line is refused unread."""

HELLO_TIMEOUT_S = 10.0
"""A connection to any listener of the protocol (the coordinator, a leader's local channel, a relay) that proves
nothing within this long is closed."""
MAX_DEPTH = 8
"""Deepest accepted nesting of arrays and objects (the deepest real message has 4 levels)."""

_INT_MAX = (1 << 63) - 1


class ProtocolError(RuntimeError):
    """The peer sent something that is not a membership-protocol message (bad JSON, too long, not an object, a
    field of the wrong type or out of range)."""


def encode(msg: dict[str, Any]) -> bytes:
    """Serialise one message (a generation in its compact :func:`wire_form`)."""
    return json.dumps(wire_form(msg), separators=(",", ":")).encode() + b"\n"


def wire_form(msg: dict[str, Any]) -> dict[str, Any]:
    """``msg`` as sent: a generation (``"gen"``, or a ``"decision"``'s ``next``) without the fields the receiver
    derives (see the module docstring); any other message unchanged."""
    kind = msg.get("t")
    if kind == "decision" and isinstance(msg.get("next"), dict):
        return {**msg, "next": _compact_generation(msg["next"])}
    if kind == "gen":
        return _compact_generation(msg)
    return msg


def _compact_generation(gen: dict[str, Any]) -> dict[str, Any]:
    groups = gen.get("groups")
    if not isinstance(groups, list):
        return gen
    out = {k: v for k, v in gen.items() if k not in ("members", "donors", "quorum", "joiners")}
    members = sorted(m for g in groups for m in g)
    if list(gen.get("members", members)) != members:
        out["members"] = gen["members"]
    donor = gen.get("donor")
    if "donors" in gen and list(gen["donors"]) != next((list(g) for g in groups if donor in g), None):
        out["donors"] = gen["donors"]
    if "quorum" in gen and gen["quorum"] != groups:
        out["quorum"] = gen["quorum"]
    joiners = list(gen.get("joiners", ()))
    if 2 * len(joiners) > len(members):
        new = set(joiners)
        out["synced"] = [m for m in members if m not in new]
    else:
        out["joiners"] = joiners
    return out


def _expand_generation(where: str, gen: dict[str, Any]) -> dict[str, Any]:
    """The receiver's half of :func:`wire_form`: fill in what the sender left out, refusing contradictions."""
    groups = gen["groups"]
    ids = sorted(m for g in groups for m in g)  # `groups` is validated disjoint
    if gen["members"] is None:
        gen["members"] = ids
    elif sorted(gen["members"]) != ids:
        raise ProtocolError(f"{where}: members are not the ids of its replica groups")
    synced = gen.pop("synced")
    if synced is not None:
        if gen["joiners"] is not None:
            raise ProtocolError(f"{where}: both joiners and synced")
        have = set(synced)
        if not have <= set(ids):
            raise ProtocolError(f"{where}: synced names a member outside the generation")
        gen["joiners"] = [m for m in gen["members"] if m not in have]
    elif gen["joiners"] is None:
        gen["joiners"] = []
    elif not set(gen["joiners"]) <= set(ids):
        raise ProtocolError(f"{where}: joiners names a member outside the generation")
    if gen["donors"] is None:
        donors = next((list(g) for g in groups if gen["donor"] in g), None)
        if donors is None:
            raise ProtocolError(f"{where}: donor {gen['donor']} is in none of its replica groups")
        gen["donors"] = donors
    if gen["quorum"] is None:
        gen["quorum"] = [list(g) for g in groups]
    return gen


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_BRACKET = re.compile(rb"[\[\]{}]")


def _depth_ok(line: bytes) -> bool:
    """Nesting of ``[``/``{`` outside strings stays within :data:`MAX_DEPTH` (checked before ``json.loads``, whose
    recursion a line of 100 000 ``[`` would otherwise exhaust). Strings are dropped by a regular expression and only
    the brackets are walked in Python, so a generation of thousands of ids costs microseconds, not a Python loop over
    every byte (:func:`_depth_ok_reference`, which it equals on every input)."""
    if line.count(b"[") + line.count(b"{") <= MAX_DEPTH:
        return True
    outside = _STRING.sub(b"", line)
    quote = outside.find(b'"')  # an unterminated string: the rest of the line is inside it
    depth = 0
    for b in _BRACKET.findall(outside if quote < 0 else outside[:quote]):
        if b in (b"[", b"{"):
            depth += 1
            if depth > MAX_DEPTH:
                return False
        else:
            depth -= 1
    return True


def _depth_ok_reference(line: bytes) -> bool:
    """Nesting of ``[``/``{`` outside strings stays within :data:`MAX_DEPTH` (checked before ``json.loads``, whose
    recursion a line of 100 000 ``[`` would otherwise exhaust)."""
    if line.count(b"[") + line.count(b"{") <= MAX_DEPTH:
        return True
    depth = 0
    in_str = False
    escaped = False
    for b in line:
        if in_str:
            if escaped:
                escaped = False
            elif b == 0x5C:  # backslash
                escaped = True
            elif b == 0x22:  # quote
                in_str = False
        elif b == 0x22:
            in_str = True
        elif b in (0x5B, 0x7B):
            depth += 1
            if depth > MAX_DEPTH:
                return False
        elif b in (0x5D, 0x7D):
            depth -= 1
    return True


_HOT = {b'{"t":"hb"}': "hb", b'{"t":"ping"}': "ping"}
"""The lines sent most (every member every heartbeat interval, both ways): recognised without ``json.loads``."""

_VOTE = re.compile(rb'\{"t":"vote","gen":(0|[1-9][0-9]{0,17}),"step":(0|[1-9][0-9]{0,17})(,"chunk":true)?\}')
"""A vote as :func:`encode` writes it (every session every step): parsed without ``json.loads``. JSON numbers have
no leading zeros; 18 digits stay below 2**63. Any other spelling takes the general path."""

_DECODER = json.JSONDecoder(parse_constant=_no_constant)
"""One decoder for every line (``json.loads`` with an argument builds a new one per call)."""


def decode(line: bytes) -> dict[str, Any]:
    """One line -> one message object with a string ``"t"``; :class:`ProtocolError` otherwise."""
    hot = _HOT.get(line)
    if hot is not None:
        return {"t": hot}
    vote = _VOTE.fullmatch(line)
    if vote is not None:
        if vote[3]:
            return {"t": "vote", "gen": int(vote[1]), "step": int(vote[2]), "chunk": True}
        return {"t": "vote", "gen": int(vote[1]), "step": int(vote[2])}
    if not _depth_ok(line):
        raise ProtocolError(f"nested deeper than {MAX_DEPTH} levels: {line[:80]!r}")
    try:
        msg = _DECODER.decode(line.decode())
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and huge integers are ValueErrors too
        raise ProtocolError(f"not JSON ({exc}): {line[:80]!r}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
        raise ProtocolError(f"not a message object: {line[:80]!r}")
    return msg


class LineReader:
    """Accumulates received bytes and yields complete messages (see :func:`decode`) of at most ``max_line`` bytes
    (:data:`MAX_LINE`; a member reading its coordinator uses :data:`MAX_GENERATION_LINE`). ``decoder`` turns one
    line into a message (default :func:`decode`; it raises :class:`ProtocolError` on a malformed one)."""

    __slots__ = ("_buf", "_scanned", "decoder", "max_line")

    def __init__(self, max_line: int = MAX_LINE, decoder: Callable[[bytes], dict[str, Any]] | None = None) -> None:
        self._buf = bytearray()
        self._scanned = 0
        self.max_line = max_line
        self.decoder = decoder or decode

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """Append ``data``; return the complete messages. :class:`ProtocolError` on the first malformed line (the
        messages before it in this call are lost with the connection, which the caller closes)."""
        n = len(data)
        if not self._buf and data.find(b"\n") == n - 1 and 1 < n <= self.max_line and data[0] == 0x7B:
            # the common case, one whole message line ("{...") in one read: no buffer copies (the loop below is
            # the reference: find(...) == n - 1 means the only newline is the last byte)
            return [self.decoder(data[:-1])]
        self._buf += data
        limit = self.max_line
        out: list[dict[str, Any]] = []
        while True:
            nl = self._buf.find(b"\n", self._scanned)  # a long line arriving in pieces is scanned once
            if nl < 0:
                self._scanned = len(self._buf)
                if len(self._buf) > limit:
                    raise ProtocolError(f"line longer than {limit} bytes")
                return out
            self._scanned = 0
            if nl > limit:
                raise ProtocolError(f"line longer than {limit} bytes")
            line = bytes(self._buf[:nl])
            del self._buf[: nl + 1]
            if not line.strip():
                continue
            out.append(self.decoder(line))


# ------------------------------------------------------------------------------------------------------ schemas
Validator = Callable[[str, object], Any]
"""``validator(where, value) -> value``: raises :class:`ProtocolError` naming ``where`` when ``value`` is wrong."""


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def integer(lo: int = 0, hi: int = _INT_MAX) -> Validator:
    """An int (not a bool) in ``[lo, hi]``."""

    def v(where: str, x: object) -> int:
        if not _is_int(x) or not lo <= x <= hi:  # type: ignore[operator]
            raise ProtocolError(f"{where} must be an int in [{lo}, {hi}], got {_show(x)}")
        return int(x)  # type: ignore[call-overload]

    return v


def number(lo: float = 0.0, hi: float = 1e9) -> Validator:
    """A finite int or float in ``[lo, hi]`` (returned as float)."""

    def v(where: str, x: object) -> float:
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not lo <= x <= hi:
            raise ProtocolError(f"{where} must be a number in [{lo}, {hi}], got {_show(x)}")
        return float(x)

    return v


def text(max_len: int) -> Validator:
    """A string of at most ``max_len`` characters that encodes as UTF-8 (no lone surrogates)."""

    def v(where: str, x: object) -> str:
        if not isinstance(x, str) or len(x) > max_len:
            raise ProtocolError(f"{where} must be a string of at most {max_len} characters, got {_show(x)}")
        try:
            x.encode()
        except UnicodeEncodeError:
            raise ProtocolError(f"{where} is not valid text (lone surrogate)") from None
        return x

    return v


def boolean(where: str, x: object) -> bool:
    """A JSON ``true``/``false``."""
    if not isinstance(x, bool):
        raise ProtocolError(f"{where} must be true or false, got {_show(x)}")
    return x


def optional(inner: Validator) -> Validator:
    """``null`` or what ``inner`` accepts."""

    def v(where: str, x: object) -> Any:
        return None if x is None else inner(where, x)

    return v


def int_list(max_len: int = MAX_MEMBERS, lo: int = 0) -> Validator:
    """A list of at most ``max_len`` ints ``>= lo``."""
    item = integer(lo)

    def v(where: str, x: object) -> list[int]:
        if not isinstance(x, list) or len(x) > max_len:
            raise ProtocolError(f"{where} must be a list of at most {max_len} ints, got {_show(x)}")
        return [item(f"{where}[{i}]", y) for i, y in enumerate(x)]

    return v


def groups(where: str, x: object) -> list[list[int]]:
    """Replica groups: a list of non-empty lists of member ids, no id twice."""
    if not isinstance(x, list) or len(x) > MAX_MEMBERS:
        raise ProtocolError(f"{where} must be a list of replica groups, got {_show(x)}")
    inner = int_list()
    out = [inner(f"{where}[{i}]", g) for i, g in enumerate(x)]
    ids = [m for g in out for m in g]
    if any(not g for g in out) or len(set(ids)) != len(ids):
        raise ProtocolError(f"{where}: replica groups must be non-empty and disjoint, got {_show(x)}")
    return out


@dataclass(frozen=True)
class Schema:
    """The fields of one message type: ``required`` must be present, ``optional`` may be (default ``None`` or the
    given default). Unknown fields are dropped."""

    required: Mapping[str, Validator] = field(default_factory=dict)
    optional: Mapping[str, Validator] = field(default_factory=dict)
    defaults: Mapping[str, Any] = field(default_factory=dict)
    derive: Callable[[str, dict[str, Any]], dict[str, Any]] | None = None
    """Applied to the validated fields: fills in what the sender may leave out (a generation's compact form)."""


def record(schema: Schema) -> Validator:
    """A nested object validated by ``schema``."""

    def v(where: str, x: object) -> dict[str, Any]:
        if not isinstance(x, dict):
            raise ProtocolError(f"{where} must be an object, got {_show(x)}")
        return _fields(where, x, schema)

    return v


def record_list(schema: Schema, max_len: int) -> Validator:
    """A list of at most ``max_len`` objects, each validated by ``schema``."""
    item = record(schema)

    def v(where: str, x: object) -> list[dict[str, Any]]:
        if not isinstance(x, list) or len(x) > max_len:
            raise ProtocolError(f"{where} must be a list of at most {max_len} objects, got {_show(x)}")
        return [item(f"{where}[{i}]", y) for i, y in enumerate(x)]

    return v


def _fields(where: str, msg: Mapping[str, Any], schema: Schema) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, valid in schema.required.items():
        if name not in msg:
            raise ProtocolError(f"{where}: missing field {name!r}")
        out[name] = valid(f"{where}.{name}", msg[name])
    for name, valid in schema.optional.items():
        value = msg.get(name)
        out[name] = schema.defaults.get(name) if value is None else valid(f"{where}.{name}", value)
    return out if schema.derive is None else schema.derive(where, out)


def check(msg: dict[str, Any], schemas: Mapping[str, Schema]) -> dict[str, Any]:
    """Validate ``msg`` against ``schemas[msg["t"]]``; return ``{"t": ..., <declared fields>}``.

    Raises:
        ProtocolError: an unknown message type, a missing field, or a field of the wrong type or out of range.
    """
    kind = msg["t"]
    schema = schemas.get(kind)
    if schema is None:
        raise ProtocolError(f"unexpected message type {kind[:40]!r} (expected one of {sorted(schemas)})")
    return {"t": kind, **_fields(kind, msg, schema)}


def _show(x: object) -> str:
    r = repr(x)
    return r if len(r) <= 60 else r[:57] + "..."


# ------------------------------------------------------------------------------------------------ authentication
def new_nonce() -> str:
    """A fresh random challenge (hex)."""
    return secrets.token_hex(16)


def mac(token: str, role: str, first: str, second: str) -> str:
    """``HMAC-SHA256(token, role | first | second)`` as hex: the proof that a peer knows the job token."""
    msg = "\0".join(("torchnext-ft", role, first, second)).encode()
    return hmac.new(token.encode(), msg, hashlib.sha256).hexdigest()


def verify(token: str, role: str, first: str, second: str, proof: str) -> bool:
    """Constant-time check of a :func:`mac` proof."""
    return hmac.compare_digest(mac(token, role, first, second).encode(), proof.encode())


# --------------------------------------------------------------------------------------------- the messages
_ID = integer()
_REASON = text(2000)

GENERATION_REF = Schema(required={"gen": integer(1), "term": integer(1), "groups": groups, "step": _ID},
                        optional={"joiners": int_list(), "quorum": groups}, defaults={"joiners": []})
"""A generation as a member remembers it (in a report); a ``quorum`` left out (or null) is its ``groups``."""

REPORT = Schema(
    required={"term": _ID, "step": _ID, "synced": boolean, "attempted": _ID},
    optional={"entered": record(GENERATION_REF), "vote": record(Schema(required={"gen": _ID, "step": _ID}))},
)
"""What a member that lost its coordinator tells the next one (see :mod:`torchnext.ft.election`)."""

FOLLOWER = Schema(required={"step": _ID}, optional={"member": _ID, "pid": _ID})
"""A follower a leader joins with its group (``hello.followers``, ranks 1 .. S-1 in order): the id it asks for (None:
assigned), its committed step."""

MEMBER_MESSAGES: dict[str, Schema] = {
    "hello": Schema(
        required={"nonce": text(64), "proof": text(128), "proto": integer(0, 1 << 16), "step": _ID},
        optional={"member": _ID, "pid": _ID, "group": _ID, "group_rank": _ID, "group_size": integer(1),
                  "coordinators": integer(1, 64), "report": record(REPORT),
                  "followers": record_list(FOLLOWER, MAX_GROUP - 1), "coordinator_timeout_s": number(1e-3),
                  "relay": text(256)},
        defaults={"group_rank": 0, "group_size": 1, "coordinators": 1},
    ),
    "hb": Schema(),
    "vote": Schema(required={"gen": _ID, "step": _ID}, optional={"chunk": boolean, "heads": int_list(MAX_CHUNK)},
                   defaults={"chunk": False}),
    "fail": Schema(required={"gen": _ID}, optional={"reason": _REASON, "end": text(32), "member": _ID},
                   defaults={"reason": ""}),
    "lost": Schema(required={"member": _ID, "hung": boolean}, optional={"reason": _REASON}, defaults={"reason": ""}),
    "bye": Schema(optional={"done": boolean}, defaults={"done": False}),
    "promise": Schema(required={"term": integer(1)}),
}
"""Messages a member sends to a coordinator (its first one is a ``hello``). A ``fail`` with ``end`` (a code of
:data:`torchnext.ft.membership.END_CODES`) ends the job instead of asking for a new generation; a coordinator that
predates the field drops it and regenerates.

A **group session** (protocol 4) is a hello with ``followers`` (``group_rank`` 0, ``group_size`` = 1 + their
count): the leader joins its whole group, and from then on its ``hb`` and ``vote`` stand for every rank of the
group, a ``fail`` may name the ``member`` that reported, and ``lost`` reports a follower's death (``hung``: by
silence on the local channel; else its channel closed). ``lost`` or ``fail.member`` naming a member outside the
sender's group is a protocol violation.

Silence (protocol 4): any message counts as a heartbeat, so a member skips its ``hb`` when it sent something else
within the interval (votes while training); a hello's ``coordinator_timeout_s`` (the member's own) lets the
coordinator ping that connection only every quarter of it, and not at all while it wrote something else since.

Vote relays (protocol 5): a leader's hello may carry ``relay`` (``host:port`` of its relay listener). A ``vote`` from
the relay of a chunk (named by the coordinator's ``relay`` message of that generation) with ``chunk`` stands for every
session of its chunk, with ``heads`` for those listed (each must be in its chunk); a vote with neither is the
sender's own. See docs/fault_tolerance.md, "Vote relays"."""

GENERATION = Schema(
    required={"gen": integer(1), "step": _ID, "donor": _ID, "abort": boolean, "groups": groups, "term": integer(1)},
    optional={"reason": _REASON, "members": int_list(), "joiners": int_list(), "synced": int_list(),
              "donors": int_list(), "quorum": groups},
    defaults={"reason": ""}, derive=_expand_generation,
)
"""A generation; on the wire in its compact form (see the module docstring), checked into the full one: ``gen,
members, step, donor, joiners, abort, groups, donors, term, quorum, reason``."""


def _gen_or_delta(where: str, gen: dict[str, Any]) -> dict[str, Any]:
    """A ``gen`` message: the full form expanded (:func:`_expand_generation`), or a delta (``base`` set, no
    ``groups``) left for :func:`apply_delta`, which needs the receiver's generation ``base``."""
    if gen["base"] is None:
        if gen["groups"] is None:
            raise ProtocolError(f"{where}: a generation needs its groups or a base")
        for name in ("drop", "add", "quorum_base"):
            gen.pop(name)
        gen.pop("base")
        return _expand_generation(where, gen)
    if gen["groups"] is not None or gen["members"] is not None or gen["synced"] is not None:
        raise ProtocolError(f"{where}: a delta (base) lists no groups, members or synced")
    if gen["joiners"] is None:
        gen["joiners"] = []
    return gen


GEN_MESSAGE = Schema(
    required={"gen": integer(1), "step": _ID, "donor": _ID, "abort": boolean, "term": integer(1)},
    optional={**GENERATION.optional, "groups": groups, "base": integer(1), "drop": int_list(), "add": groups,
              "quorum_base": boolean},
    defaults={"reason": ""}, derive=_gen_or_delta,
)
"""A ``gen`` message (protocol 4): a full generation (:data:`GENERATION`), or a **delta** against the generation
``base`` the receiver holds -- ``drop`` (the ids leaving, whole groups), ``add`` (the groups joining), ``quorum``
(absent: the new groups; ``quorum_base``: ``base``'s groups) -- which a coordinator sends to the sessions that hold
``base``, so that a generation after a failure costs each of them bytes per change, not per member
(:func:`apply_delta` expands it)."""


def apply_delta(gen: dict[str, Any], base: int, base_groups: list[list[int]]) -> dict[str, Any]:
    """``gen`` (a checked delta of :data:`GEN_MESSAGE`) expanded against the receiver's generation ``base`` with
    replica groups ``base_groups``, in place, into the full form; a full ``gen`` is returned as it is. Reference::

        groups = sorted([g for g in base_groups if not set(g) & set(drop)] + add, key=min)

    Raises:
        ProtocolError: the delta is against another generation, drops part of a group or an id not in ``base``,
        or adds a group that overlaps the others.
    """
    if gen.get("base") is None:
        return gen
    where = f"gen {gen['gen']}"
    if gen["base"] != base:
        raise ProtocolError(f"{where}: a delta against generation {gen['base']}, but this member holds {base}")
    drop = set(gen.pop("drop") or ())
    keep: list[list[int]] = []
    gone: set[int] = set()
    for g in base_groups:
        hit = drop.intersection(g)
        if hit and len(hit) != len(g):
            raise ProtocolError(f"{where}: drops part of replica group {g}")
        if hit:
            gone.update(g)
        else:
            keep.append(list(g))
    if gone != drop:
        raise ProtocolError(f"{where}: drops ids that generation {base} does not hold: {sorted(drop - gone)[:8]}")
    full = groups(f"{where}.groups", sorted(keep + [list(g) for g in gen.pop("add") or ()], key=min))
    quorum_base = gen.pop("quorum_base")
    gen.pop("base")
    gen["groups"] = full
    if quorum_base:
        if gen["quorum"] is not None:
            raise ProtocolError(f"{where}: both quorum and quorum_base")
        gen["quorum"] = [list(g) for g in base_groups]
    return _expand_generation(where, gen)

COORDINATOR_MESSAGES: dict[str, Schema] = {
    "challenge": Schema(required={"nonce": text(64), "proto": integer(0, 1 << 16)}),
    "welcome": Schema(
        required={"proof": text(128), "member": _ID, "store_port": integer(1, 65535), "proto": integer(0, 1 << 16),
                  "heartbeat_interval_s": number(1e-3), "heartbeat_timeout_s": number(1e-3), "term": _ID,
                  "role": text(16)},
        optional={"quorum_timeout_s": number(), "grow_timeout_s": number(), "members": int_list(MAX_GROUP),
                  "group_heartbeat_interval_s": number(1e-3), "group_heartbeat_timeout_s": number(1e-3),
                  "store_host": text(256)},
    ),
    "reject": Schema(required={"code": text(40)}, optional={"reason": _REASON}, defaults={"reason": ""}),
    "ping": Schema(),
    "gen": GEN_MESSAGE,
    "decision": Schema(required={"gen": _ID, "step": _ID, "committed": _ID},
                       optional={"next": record(GENERATION)}),
    "wait": Schema(required={"gen": _ID}, optional={"reason": _REASON}, defaults={"reason": ""}),
    "removed": Schema(required={"gen": _ID}, optional={"reason": _REASON}, defaults={"reason": ""}),
    "fatal": Schema(required={"code": text(40)}, optional={"reason": _REASON}, defaults={"reason": ""}),
    "finished": Schema(required={"step": _ID}, optional={"by": _ID}),
    "prepare": Schema(required={"term": integer(1)}),
    "relay": Schema(required={"gen": integer(1), "relay": _ID, "at": text(256), "chunk": int_list(MAX_CHUNK)}),
}
"""Messages a coordinator sends to a member. A group session's ``welcome`` carries ``members`` (its group's ids by
group rank) and the local level's heartbeat settings; every later message is for the whole group (its leader relays
it to the followers)."""

LEADER_MESSAGES: dict[str, Schema] = {
    **COORDINATOR_MESSAGES,
    "failover": Schema(optional={"reason": _REASON}, defaults={"reason": ""}),
    "store": Schema(required={"host": text(256), "port": integer(1, 65535), "term": _ID, "role": text(16)}),
}
"""Messages a group session's leader sends its followers over the local channel: the coordinator's, relayed as they
came (after its own challenge and ``welcome``, which names the follower's id, the coordinator's ``store_host`` and
the local heartbeat settings), plus ``failover`` (the leader lost its coordinator and fails over: abort the
collectives and wait) and ``store`` (a new coordinator took the group: its store, term and role)."""


RELAY_PEER_MESSAGES: dict[str, Schema] = {
    "hello": Schema(required={"nonce": text(64), "proof": text(128), "proto": integer(0, 1 << 16), "member": _ID,
                              "gen": _ID}),
    "hb": Schema(),
    "vote": Schema(required={"gen": _ID, "step": _ID}),
    "bye": Schema(optional={"done": boolean}, defaults={"done": False}),
}
"""Messages a session sends to its relay's listener (protocol 5): ``hello`` proving the job token (as to a
coordinator: ``mac(token, "member", relay's nonce, own nonce)``) with its member id (a session head) and the
generation it holds, then its votes."""

RELAY_MESSAGES: dict[str, Schema] = {
    "challenge": Schema(required={"nonce": text(64), "proto": integer(0, 1 << 16)}),
    "welcome": Schema(required={"proof": text(128), "proto": integer(0, 1 << 16), "relay": _ID}),
    "reject": Schema(required={"code": text(40)}, optional={"reason": _REASON}, defaults={"reason": ""}),
    "ping": Schema(),
    "decision": COORDINATOR_MESSAGES["decision"],
}
"""Messages a relay sends a session of its chunk: its ``challenge``, the ``welcome`` proving it knows the token
(``mac(token, "relay", session's nonce, relay's nonce)``), and the coordinator's decisions as they came."""


def tune_socket(sock: socket.socket) -> None:
    """TCP_NODELAY (tiny messages must not wait for Nagle) and keepalive."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


def setup_accepted(sock: socket.socket, timeout: float | None) -> bool:
    """Prepare a socket just accepted by a listener of the protocol. Reference::

        tune_socket(sock); sock.settimeout(timeout)   # 0.0: non-blocking; a float: it bounds sendall
        return True                                    # on OSError: sock.close(); return False

    False: the connection is already gone (closed here); the listener is fine."""
    try:
        tune_socket(sock)
        sock.settimeout(timeout)
    except OSError:
        sock.close()
        return False
    return True


def accept_tuned(listener: socket.socket, timeout: float | None) -> socket.socket | None:
    """One connection from ``listener``, prepared by :func:`setup_accepted`; None when there was none (a
    non-blocking listener with an empty backlog) or it broke before it was set up (the listener is fine)."""
    try:
        sock, _ = listener.accept()
    except OSError:
        return None
    return sock if setup_accepted(sock, timeout) else None


def recv_or_closed(sock: socket.socket, size: int = 1 << 16) -> bytes:
    """``sock.recv(size)`` of a socket that ``select`` said is readable; ``b""`` (the channel closed) when the
    connection broke (reset, timed out): the reader treats both alike."""
    try:
        return sock.recv(size)
    except OSError:
        return b""
