"""Vote relays (protocol 5, issue 26): one level of aggregation between group sessions and the coordinator.

Per generation the coordinator cuts the sessions that offer a relay listener into chunks and names one session of
each chunk its relay (``relay`` message; :meth:`~torchnext.ft.membership.Membership._assign_relays`). A session of
a chunk sends its vote to its relay instead of the coordinator; the relay forwards the chunk's votes as one and fans
the coordinator's decision back out. Everything else (joins, heartbeats, generations, failures) stays on each
session's own coordinator connection. This module is the relay's bookkeeping, free of sockets, used by real leaders
(:mod:`torchnext.ft.group_session`) and the simulator alike, plus the relay channel's handshake.

Reference of one relay's chunk in generation ``gen`` (:class:`RelayChunk`)::

    connected = {relay} | {sessions of the chunk with an authenticated channel to it}
    on vote(h, gen, step) from a connected h:  voted[h] = step
    whenever every connected session voted step s (also after one disconnects):
        batch = {h: voted[h] == s} - already forwarded for s
        send up {"t": "vote", "gen": gen, "step": s, "chunk": true}     if batch is the whole chunk
                {"t": "vote", "gen": gen, "step": s, "heads": sorted(batch)}   otherwise
    on decision(gen, step) from the coordinator: to every connected session

A session never waits for a relay it cannot reach: with no channel (refused, closed, not yet connected) it votes
directly, and the relay does not wait for it either (it is not ``connected``). A session whose open vote went
directly sends it through the channel too once the relay welcomes it (the relay counts it as connected from its
hello on), and a relay named after its own vote went directly counts that vote in its chunk; the coordinator counts
each session once however many ways its vote arrives, and ignores a relay's vote for a step already decided. A relay or
a session that is connected but stalls (or a channel black-holed between them) is found by the relay channel's
liveness rule (:mod:`torchnext.ft.relay_link`, "Liveness"): within two heartbeat timeouts the session votes
directly and the relay stops waiting for it.

Relay channel handshake (the job token never crosses the wire)::

    relay   -> session   {"t": "challenge", "nonce": Nr, "proto": 5}
    session -> relay     {"t": "hello", "nonce": Ns, "proof": mac(token, "member", Nr, Ns), "member": h, "gen": g, ...}
    relay   -> session   {"t": "welcome", "proof": mac(token, "relay", Ns, Nr), "relay": r, "proto": 5}
"""

from __future__ import annotations

from typing import Any

from torchnext.ft._wire import PROTOCOL_VERSION, ProtocolError, mac, new_nonce, verify

__all__ = ["RelayChunk", "SessionHandshake", "answer_hello", "relay_challenge", "relay_hello", "relay_welcome",
           "verify_hello", "verify_welcome"]


class RelayChunk:
    """A relay's view of its chunk in one generation (see the module docstring). :meth:`vote`, :meth:`connect` and
    :meth:`disconnect` return the vote to send the coordinator now, or None."""

    __slots__ = ("_at", "_fwd", "_fwd_step", "connected", "gen", "members", "relay", "voted")

    def __init__(self, gen: int, relay: int, chunk: list[int] | tuple[int, ...]) -> None:
        if relay not in chunk:
            raise ValueError(f"relay {relay} is not in its chunk {list(chunk)[:8]}")
        self.gen, self.relay, self.members = gen, relay, frozenset(chunk)
        self.connected: set[int] = {relay}
        self.voted: dict[int, int] = {}
        self._at: dict[int, set[int]] = {}
        """step -> the connected sessions whose latest vote is for it."""
        self._fwd_step = -1
        self._fwd: set[int] = set()

    def connect(self, head: int) -> bool:
        """Session ``head`` holds an authenticated channel; False (ignored) when it is not of this chunk."""
        if head not in self.members:
            return False
        self.connected.add(head)
        return True

    def disconnect(self, head: int) -> dict[str, Any] | None:
        """Session ``head``'s channel closed: it votes directly from now on, and nobody waits for it here."""
        if head == self.relay or head not in self.connected:
            return None
        self.connected.discard(head)
        step = self.voted.pop(head, None)
        if step is not None:
            self._at[step].discard(head)
        return self._ready(max(self._at, default=-1))

    def vote(self, head: int, gen: int, step: int) -> dict[str, Any] | None:
        """Session ``head`` (connected, or the relay itself) voted for ``(gen, step)``."""
        if gen != self.gen or head not in self.connected:
            return None
        old = self.voted.get(head)
        if old is not None:
            if old == step:
                return None
            at = self._at[old]
            at.discard(head)
            if not at:
                del self._at[old]
        self.voted[head] = step
        self._at.setdefault(step, set()).add(head)
        return self._ready(step)

    def _ready(self, step: int) -> dict[str, Any] | None:
        at = self._at.get(step)
        if not at or len(at) < len(self.connected):
            return None
        if step != self._fwd_step:
            self._fwd_step, self._fwd = step, set()
        batch = at - self._fwd
        if not batch:
            return None
        self._fwd |= batch
        if len(batch) == len(self.members):
            return {"t": "vote", "gen": self.gen, "step": step, "chunk": True}
        return {"t": "vote", "gen": self.gen, "step": step, "heads": sorted(batch)}


def relay_challenge(nonce: str) -> dict[str, Any]:
    """The relay's first message on a new channel."""
    return {"t": "challenge", "nonce": nonce, "proto": PROTOCOL_VERSION}


def relay_hello(token: str, challenge: str, nonce: str, member: int, gen: int) -> dict[str, Any]:
    """A session's answer to the relay's ``challenge`` (its own fresh ``nonce``)."""
    return {"t": "hello", "nonce": nonce, "proof": mac(token, "member", challenge, nonce), "proto": PROTOCOL_VERSION,
            "member": member, "gen": gen}


def verify_hello(token: str, challenge: str, hello: dict[str, Any]) -> str | None:
    """Why a checked hello is refused (``"bad_request: ..."``, ``"auth: ..."``), or None when it proves the token."""
    if hello["t"] != "hello":
        return "bad_request: the first message must be a hello"
    if hello["proto"] != PROTOCOL_VERSION:
        return f"bad_request: protocol version {hello['proto']}, expected {PROTOCOL_VERSION}"
    if not verify(token, "member", challenge, hello["nonce"], hello["proof"]):
        return "auth: wrong job token"
    return None


def relay_welcome(token: str, hello_nonce: str, challenge: str, relay: int) -> dict[str, Any]:
    """The relay's proof that it knows the token."""
    return {"t": "welcome", "proof": mac(token, "relay", hello_nonce, challenge), "proto": PROTOCOL_VERSION,
            "relay": relay}


def verify_welcome(token: str, nonce: str, challenge: str, welcome: dict[str, Any]) -> bool:
    """The relay's ``welcome`` proves the token (``nonce``: the session's, ``challenge``: the relay's)."""
    return welcome["proto"] == PROTOCOL_VERSION and verify(token, "relay", nonce, challenge, welcome["proof"])


def answer_hello(token: str, challenge: str, relay: int, hello: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
    """The relay's answer to the first checked message of a new channel (``challenge``: the nonce it sent). Reference::

        why = verify_hello(token, challenge, hello)
        if why is not None:
            code, _, reason = why.partition(": ")
            return {"t": "reject", "code": code, "reason": reason}, None        # send it, then close the channel
        return relay_welcome(token, hello["nonce"], challenge, relay), hello["member"]   # the channel is the member's
    """
    why = verify_hello(token, challenge, hello)
    if why is not None:
        code, _, reason = why.partition(": ")
        return {"t": "reject", "code": code, "reason": reason}, None
    return relay_welcome(token, hello["nonce"], challenge, relay), hello["member"]


class SessionHandshake:
    """A session's side of the relay channel's handshake, free of sockets (real leaders and the simulator). Reference::

        shake = SessionHandshake(token, member=h, gen=g, relay=r)
        shake.feed(challenge) == relay_hello(token, challenge["nonce"], shake.nonce, h, g)   # send it
        shake.feed(welcome) is None and shake.done                     # the relay proved the token and is relay r

    Raises :class:`~torchnext.ft._wire.ProtocolError` (close the channel, vote directly) for a ``reject``, a message
    out of order, a welcome that does not prove the token, or one from a listener that is another session's."""

    __slots__ = ("_gen", "_member", "_relay", "_token", "challenge", "done", "nonce")

    def __init__(self, token: str, *, member: int, gen: int, relay: int) -> None:
        self._token, self._member, self._gen, self._relay = token, member, gen, relay
        self.nonce = ""
        self.challenge = ""
        self.done = False

    def feed(self, msg: dict[str, Any]) -> dict[str, Any] | None:
        """One checked message of the relay (``RELAY_MESSAGES``); the reply to send, if any."""
        kind = msg["t"]
        if kind == "reject":
            raise ProtocolError(f"the relay refused: {msg.get('code')}")
        if kind == "challenge" and not self.nonce:
            self.nonce, self.challenge = new_nonce(), msg["nonce"]
            return relay_hello(self._token, self.challenge, self.nonce, self._member, self._gen)
        if kind != "welcome" or not self.nonce or self.done:
            raise ProtocolError(f"the relay sent {kind!r} out of its handshake's order")
        if not verify_welcome(self._token, self.nonce, self.challenge, msg):
            raise ProtocolError("the relay did not prove it knows the job token")
        if msg["relay"] != self._relay:
            raise ProtocolError(f"the listener is session {msg['relay']}'s relay listener, not relay {self._relay}'s")
        self.done = True
        return None
