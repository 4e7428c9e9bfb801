"""The membership protocol on the wire: line-delimited JSON framing, message schemas, mutual authentication.

One message = one JSON object on one line (``\\n``-terminated, UTF-8, at most :data:`MAX_LINE` bytes), never
pickle. Reference::

    encode(msg)  == json.dumps(msg, separators=(",", ":")).encode() + b"\\n"
    LineReader().feed(b'{"t":"hb"}\\n{"t":') == [{"t": "hb"}]      # the partial second line is kept

Everything a peer sends is untrusted: :meth:`LineReader.feed` turns every malformed line (bad UTF-8 or JSON, too
long, nested too deep, NaN, an integer of thousands of digits, not an object) into :class:`ProtocolError`, and
:func:`check` validates a message against its :class:`Schema` -- each field's type and range -- and returns only
the declared fields, so the code that acts on a message never meets a value of the wrong type. The receiver closes
that one connection with the error as the logged reason; nothing a peer sends can raise anything else.

Authentication (both ways, the job token never crosses the wire)::

    coordinator -> member   {"t": "challenge", "nonce": Ns, "proto": 2}
    member -> coordinator   {"t": "hello", "nonce": Nm, "proof": mac(token, "member", Ns, Nm), ...}
    coordinator -> member   {"t": "welcome", "proof": mac(token, "coordinator", Nm, Ns), ...}

``mac`` is HMAC-SHA256; both sides compare in constant time. A member therefore trusts a coordinator only after
it proved it knows the token, which matters once members connect to whatever listens at the standby's address.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "COORDINATOR_MESSAGES",
    "GENERATION",
    "GENERATION_REF",
    "MAX_LINE",
    "MEMBER_MESSAGES",
    "PROTOCOL_VERSION",
    "REPORT",
    "LineReader",
    "ProtocolError",
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
    "text",
    "tune_socket",
    "verify",
]

PROTOCOL_VERSION = 2
"""Version of the membership protocol; a hello with another version is rejected. 2: mutual authentication,
coordinator failover (reports, terms, prepare/promise)."""

MAX_LINE = 1 << 16
"""Longest accepted line (bytes): membership messages are small; a longer line is a protocol violation."""

MAX_DEPTH = 8
"""Deepest accepted nesting of arrays and objects (the deepest real message has 4 levels)."""

_INT_MAX = (1 << 63) - 1


class ProtocolError(RuntimeError):
    """The peer sent something that is not a membership-protocol message (bad JSON, too long, not an object, a
    field of the wrong type or out of range)."""


def encode(msg: dict[str, Any]) -> bytes:
    """Serialise one message."""
    return json.dumps(msg, separators=(",", ":")).encode() + b"\n"


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _depth_ok(line: bytes) -> bool:
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


def decode(line: bytes) -> dict[str, Any]:
    """One line -> one message object with a string ``"t"``; :class:`ProtocolError` otherwise."""
    if not _depth_ok(line):
        raise ProtocolError(f"nested deeper than {MAX_DEPTH} levels: {line[:80]!r}")
    try:
        msg = json.loads(line, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and huge integers are ValueErrors too
        raise ProtocolError(f"not JSON ({exc}): {line[:80]!r}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
        raise ProtocolError(f"not a message object: {line[:80]!r}")
    return msg


class LineReader:
    """Accumulates received bytes and yields complete messages (see :func:`decode`)."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """Append ``data``; return the complete messages. :class:`ProtocolError` on the first malformed line (the
        messages before it in this call are lost with the connection, which the caller closes)."""
        self._buf += data
        out: list[dict[str, Any]] = []
        while True:
            nl = self._buf.find(b"\n")
            if nl < 0:
                if len(self._buf) > MAX_LINE:
                    raise ProtocolError(f"line longer than {MAX_LINE} bytes")
                return out
            if nl > MAX_LINE:
                raise ProtocolError(f"line longer than {MAX_LINE} bytes")
            line = bytes(self._buf[:nl])
            del self._buf[: nl + 1]
            if not line.strip():
                continue
            out.append(decode(line))


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


def int_list(max_len: int = 4096, lo: int = 0) -> Validator:
    """A list of at most ``max_len`` ints ``>= lo``."""
    item = integer(lo)

    def v(where: str, x: object) -> list[int]:
        if not isinstance(x, list) or len(x) > max_len:
            raise ProtocolError(f"{where} must be a list of at most {max_len} ints, got {_show(x)}")
        return [item(f"{where}[{i}]", y) for i, y in enumerate(x)]

    return v


def groups(where: str, x: object) -> list[list[int]]:
    """Replica groups: a list of non-empty lists of member ids, no id twice."""
    if not isinstance(x, list) or len(x) > 4096:
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


def record(schema: Schema) -> Validator:
    """A nested object validated by ``schema``."""

    def v(where: str, x: object) -> dict[str, Any]:
        if not isinstance(x, dict):
            raise ProtocolError(f"{where} must be an object, got {_show(x)}")
        return _fields(where, x, schema)

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
    return out


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

GENERATION_REF = Schema(required={"gen": integer(1), "term": integer(1), "groups": groups, "quorum": groups,
                                  "step": _ID}, optional={"joiners": int_list()}, defaults={"joiners": []})
"""A generation as a member remembers it (in a report)."""

REPORT = Schema(
    required={"term": _ID, "step": _ID, "synced": boolean, "attempted": _ID},
    optional={"entered": record(GENERATION_REF), "vote": record(Schema(required={"gen": _ID, "step": _ID}))},
)
"""What a member that lost its coordinator tells the next one (see :mod:`torchnext.ft.election`)."""

MEMBER_MESSAGES: dict[str, Schema] = {
    "hello": Schema(
        required={"nonce": text(64), "proof": text(128), "proto": integer(0, 1 << 16), "step": _ID},
        optional={"member": _ID, "pid": _ID, "group": _ID, "group_rank": _ID, "group_size": integer(1),
                  "coordinators": integer(1, 64), "report": record(REPORT)},
        defaults={"group_rank": 0, "group_size": 1, "coordinators": 1},
    ),
    "hb": Schema(),
    "vote": Schema(required={"gen": _ID, "step": _ID}),
    "fail": Schema(required={"gen": _ID}, optional={"reason": _REASON, "end": text(32)}, defaults={"reason": ""}),
    "bye": Schema(optional={"done": boolean}, defaults={"done": False}),
    "promise": Schema(required={"term": integer(1)}),
}
"""Messages a member sends to a coordinator (its first one is a ``hello``). A ``fail`` with ``end`` (a code of
:data:`torchnext.ft.membership.END_CODES`) ends the job instead of asking for a new generation; a coordinator that
predates the field drops it and regenerates."""

GENERATION = Schema(
    required={"gen": integer(1), "members": int_list(), "step": _ID, "donor": _ID, "joiners": int_list(),
              "abort": boolean, "groups": groups, "donors": int_list(), "term": integer(1), "quorum": groups},
    optional={"reason": _REASON}, defaults={"reason": ""},
)

COORDINATOR_MESSAGES: dict[str, Schema] = {
    "challenge": Schema(required={"nonce": text(64), "proto": integer(0, 1 << 16)}),
    "welcome": Schema(
        required={"proof": text(128), "member": _ID, "store_port": integer(1, 65535), "proto": integer(0, 1 << 16),
                  "heartbeat_interval_s": number(1e-3), "heartbeat_timeout_s": number(1e-3), "term": _ID,
                  "role": text(16)},
        optional={"quorum_timeout_s": number(), "grow_timeout_s": number()},
    ),
    "reject": Schema(required={"code": text(40)}, optional={"reason": _REASON}, defaults={"reason": ""}),
    "ping": Schema(),
    "gen": GENERATION,
    "decision": Schema(required={"gen": _ID, "step": _ID, "committed": _ID},
                       optional={"next": record(GENERATION)}),
    "wait": Schema(required={"gen": _ID}, optional={"reason": _REASON}, defaults={"reason": ""}),
    "removed": Schema(required={"gen": _ID}, optional={"reason": _REASON}, defaults={"reason": ""}),
    "fatal": Schema(required={"code": text(40)}, optional={"reason": _REASON}, defaults={"reason": ""}),
    "finished": Schema(required={"step": _ID}, optional={"by": _ID}),
    "prepare": Schema(required={"term": integer(1)}),
}
"""Messages a coordinator sends to a member."""


def tune_socket(sock: socket.socket) -> None:
    """TCP_NODELAY (tiny messages must not wait for Nagle) and keepalive."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
