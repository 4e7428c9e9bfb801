"""Cross-host channel: one window service per rank (a listening socket + one thread per connected origin).

Why a service at all: torch.distributed has no one-sided data path on Gloo (no get, no RMA), so a target must
answer requests by itself. The service is deliberately small: fixed binary headers (``struct``, no pickle), every
request checked against the target's registered size and dtype before any byte is written, one request in flight
per connection (FIFO: a reply means the op is applied at the target).

Wire format (network byte order)::

    challenge (target -> origin)  32 random bytes (a fresh nonce per connection)
    hello   (origin -> target)  MAGIC "TNW2", u32 origin rank, 32-byte proof = HMAC-SHA256(token, nonce, origin)
    verdict (target -> origin)  u8: 0 accepted; anything else / EOF: refused (the target then closes)
    request (origin -> target)  u8 op, u8 dtype code, u16 aux (reduce op), u32 request id,
                                i64 offset (signal: value), i64 numel, u64 payload bytes, then the payload
    reply   (target -> origin)  u8 status, 3 pad, u32 request id, u64 payload bytes, then the payload
                                (status != 0: payload is a UTF-8 error message)

The token (``secrets.token_bytes(32)``, one per window) is broadcast by rank 0 over the communicator itself, never
written to the store (the store has no authentication: anyone who reaches it could read it), and never crosses the
wire: the hello carries an HMAC proof over the target's nonce, compared with ``hmac.compare_digest``. A connection
without a valid proof gets a refusal and is closed before any request is read.

Hostile input ends one connection, never the service: a bad hello, a peer silent for ``_HELLO_TIMEOUT_S``, more
than :data:`MAX_PENDING` connections still in their handshake (the newest is refused), a malformed request header
(answered with a status, or the connection closed when its payload length cannot be trusted); each is logged on the
``torchnext.comms.window`` logger with the reason.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import hashlib
import hmac
import logging
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from torchnext.comms.errors import CommError, CommTimeout, PeerFailure
from torchnext.comms.reduce_op import ReduceOp
from torchnext.comms.window.segment import ACCUMULATE, DTYPES, Segment, dtype_code

__all__ = ["CHALLENGE_BYTES", "HELLO", "MAGIC", "MAX_PENDING", "TcpChannel", "TcpService", "WindowAuthError", "proof"]

_LOG = logging.getLogger("torchnext.comms.window")

MAGIC = b"TNW2"
HELLO = struct.Struct("!4sI32s")
CHALLENGE_BYTES = 32
MAX_PENDING = 64
"""Connections in their handshake at once; a new one beyond this is refused at once."""
MAX_GET_ROWS = 1 << 20
"""Most indices one ``get_rows`` request may carry (beyond the target's row count)."""
REQUEST = struct.Struct("!BBHIqqQ")
REPLY = struct.Struct("!B3xIQ")
ACCEPTED = b"\x00"
REFUSED = b"\x01"
_HELLO_TIMEOUT_S = 10.0
_REDUCE_OPS: tuple[ReduceOp, ...] = tuple(ReduceOp)


class WindowAuthError(CommError):
    """The target's window service refused the connection (wrong or missing window token)."""


class Op(enum.IntEnum):
    PUT = 1
    GET = 2
    GET_ROWS = 3
    ACCUMULATE = 4
    SIGNAL = 5
    FLUSH = 6


class Status(enum.IntEnum):
    OK = 0
    BOUNDS = 1
    DTYPE = 2
    BAD_REQUEST = 3
    CLOSED = 4
    FAILED = 5


class _Reject(Exception):
    def __init__(self, status: Status, message: str) -> None:
        self.status = status
        super().__init__(message)


def proof(token: bytes, nonce: bytes, origin: int) -> bytes:
    """``HMAC-SHA256(token, "torchnext-window" | nonce | origin)``: the hello's proof that the origin holds the
    window token (the token itself never crosses the wire)."""
    return hmac.new(token, b"torchnext-window\0" + nonce + origin.to_bytes(4, "big"), hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view``; False on EOF before the first byte, ``ConnectionError`` on EOF mid-way."""
    got = 0
    n = len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            if got == 0:
                return False
            raise ConnectionError("connection closed mid-message")
        got += k
    return True


def _bytes(t: torch.Tensor) -> memoryview:
    """Zero-copy byte view of a contiguous CPU tensor (any dtype)."""
    if t.numel() == 0:
        return memoryview(b"")
    arr: Any = t.reshape(-1).view(torch.uint8).numpy()
    return memoryview(arr).cast("B")


# --------------------------------------------------------------------------------------------------- the service
class TcpService:
    """Serves one rank's :class:`Segment` to origins holding the window token. Binds only to ``host``."""

    def __init__(self, segment: Segment, token: bytes, host: str, shape: tuple[int, ...], world: int) -> None:
        self.segment = segment
        self._token = token
        self._shape = shape
        self._world = world
        self._closed = False
        self._pending = 0
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._sock = socket.create_server((host, 0), backlog=max(16, 2 * world))
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._handlers: dict[int, Callable[[int, int, int, int, bytearray], memoryview | None]] = {
            Op.PUT: self._put, Op.GET: self._get, Op.GET_ROWS: self._get_rows, Op.ACCUMULATE: self._accumulate,
            Op.SIGNAL: self._signal, Op.FLUSH: self._flush,
        }
        self._thread = threading.Thread(target=self._accept_loop, name="torchnext-window-service", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop accepting, close every connection (origins then see ``PeerFailure``/``WindowClosed``)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes accept()
        self._sock.close()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=5)

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, addr = self._sock.accept()
            except OSError as exc:
                if self._closed or exc.errno is None:
                    return
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    time.sleep(0.05)  # out of descriptors: let the handshakes in flight finish or time out
                continue  # ECONNABORTED and friends: that connection is gone, the listener is fine
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                if self._pending >= MAX_PENDING:
                    _LOG.warning("torchnext window service: refusing %s: %d connections already in their handshake",
                                 addr, self._pending)
                    conn.close()
                    continue
                self._pending += 1
                self._conns.add(conn)
            try:
                threading.Thread(target=self._serve, args=(conn, addr), name="torchnext-window-conn",
                                 daemon=True).start()
            except RuntimeError:  # cannot start a thread: shed this connection, keep serving the others
                with self._lock:
                    self._pending -= 1
                    self._conns.discard(conn)
                conn.close()

    def _serve(self, conn: socket.socket, addr: Any) -> None:
        authenticated = False
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(_HELLO_TIMEOUT_S)
            nonce = os.urandom(CHALLENGE_BYTES)
            conn.sendall(nonce)
            hello = bytearray(HELLO.size)
            if not _recv_exact(conn, memoryview(hello)):
                return
            magic, origin, mac = HELLO.unpack(hello)
            if magic != MAGIC or not 0 <= origin < self._world or not hmac.compare_digest(
                    mac, proof(self._token, nonce, origin)):
                _LOG.warning("torchnext window service: refused %s: %s", addr,
                             "bad magic" if magic != MAGIC else f"origin {origin} out of range"
                             if not 0 <= origin < self._world else "wrong window token")
                conn.sendall(REFUSED)
                return
            authenticated = True
            with self._lock:
                self._pending -= 1
            conn.sendall(ACCEPTED)
            conn.settimeout(None)
            header = bytearray(REQUEST.size)
            hview = memoryview(header)
            while _recv_exact(conn, hview):
                op, code, aux, req_id, offset, numel, plen = REQUEST.unpack(header)
                self._one(conn, origin, op, code, aux, req_id, offset, numel, plen)
        except (OSError, ConnectionError) as exc:
            if not self._closed:
                _LOG.info("torchnext window service: connection from %s ended: %s", addr, exc)
        except Exception:  # a bug triggered by this peer's bytes: this connection goes, the service stays
            _LOG.exception("torchnext window service: internal error on a request from %s", addr)
        finally:
            with self._lock:
                if not authenticated:
                    self._pending -= 1
                self._conns.discard(conn)
            conn.close()

    def _one(self, conn: socket.socket, origin: int, op: int, code: int, aux: int, req_id: int, offset: int,
             numel: int, plen: int) -> None:
        try:
            expected = self._check(op, code, offset, numel, plen)
        except _Reject as rej:
            # The payload is not trusted: drain it only when its length is the one the header implies.
            if 0 < plen <= (1 << 34):
                _drain(conn, plen)
                self._reply(conn, rej.status, req_id, str(rej).encode())
            else:
                self._reply(conn, rej.status, req_id, str(rej).encode())
                raise ConnectionError("bad request length") from None
            return
        payload = bytearray(expected)
        if expected and not _recv_exact(conn, memoryview(payload)):
            raise ConnectionError("EOF in payload")
        if self._closed:
            self._reply(conn, Status.CLOSED, req_id, b"target window is closed")
            return
        try:
            out = self._handlers[op](origin, aux, offset, numel, payload)
        except _Reject as rej:
            self._reply(conn, rej.status, req_id, str(rej).encode())
            return
        except Exception as exc:  # report, keep serving
            self._reply(conn, Status.FAILED, req_id, f"{type(exc).__name__}: {exc}".encode())
            return
        self._reply(conn, Status.OK, req_id, out)

    @staticmethod
    def _reply(conn: socket.socket, status: int, req_id: int, payload: bytes | memoryview | None) -> None:
        n = 0 if payload is None else len(payload)
        if n and n < 65536:
            conn.sendall(REPLY.pack(status, req_id, n) + bytes(payload))  # type: ignore[arg-type]
            return
        conn.sendall(REPLY.pack(status, req_id, n))
        if n:
            conn.sendall(payload)  # type: ignore[arg-type]

    def _check(self, op: int, code: int, offset: int, numel: int, plen: int) -> int:
        """Validate a request header; return the payload length to read. Raises :class:`_Reject`."""
        seg = self.segment
        if op not in self._handlers:
            raise _Reject(Status.BAD_REQUEST, f"unknown op {op}")
        if op in (Op.SIGNAL, Op.FLUSH):
            if plen:
                raise _Reject(Status.BAD_REQUEST, "unexpected payload")
            return 0
        if code >= len(DTYPES) or DTYPES[code] != seg.dtype:
            got = DTYPES[code] if code < len(DTYPES) else f"code {code}"
            raise _Reject(Status.DTYPE, f"dtype {got} does not match the target's registered dtype {seg.dtype}")
        if op == Op.GET_ROWS:
            if len(self._shape) != 2:
                raise _Reject(Status.BAD_REQUEST, f"get_rows needs a 2-D registered tensor, target has shape {list(self._shape)}")
            if numel < 0 or numel > max(self._shape[0], MAX_GET_ROWS) or plen != numel * 8:
                raise _Reject(Status.BAD_REQUEST, f"get_rows: {plen} payload bytes for {numel} int64 indices")
            return plen
        if numel < 0 or offset < 0 or offset + numel > seg.numel:
            raise _Reject(Status.BOUNDS, f"elements [{offset}, {offset + numel}) outside the target's [0, {seg.numel})")
        want = numel * seg.data.element_size() if op in (Op.PUT, Op.ACCUMULATE) else 0
        if plen != want:
            raise _Reject(Status.BAD_REQUEST, f"payload of {plen} bytes, expected {want}")
        return want

    def _put(self, origin: int, aux: int, offset: int, numel: int, payload: bytearray) -> None:
        if numel:
            self.segment.data[offset : offset + numel].copy_(torch.frombuffer(payload, dtype=self.segment.dtype))

    def _get(self, origin: int, aux: int, offset: int, numel: int, payload: bytearray) -> memoryview:
        return _bytes(self.segment.data[offset : offset + numel])

    def _get_rows(self, origin: int, aux: int, offset: int, numel: int, payload: bytearray) -> memoryview:
        rows, cols = self._shape
        if numel == 0:
            return memoryview(b"")
        idx = torch.frombuffer(payload, dtype=torch.int64)
        if int(idx.min()) < 0 or int(idx.max()) >= rows:
            raise _Reject(Status.BOUNDS, f"row index outside [0, {rows})")
        return _bytes(torch.index_select(self.segment.data.view(rows, cols), 0, idx))

    def _accumulate(self, origin: int, aux: int, offset: int, numel: int, payload: bytearray) -> None:
        if aux >= len(_REDUCE_OPS) or _REDUCE_OPS[aux] not in ACCUMULATE:
            raise _Reject(Status.BAD_REQUEST, f"unsupported accumulate op code {aux}")
        if numel:
            src = torch.frombuffer(payload, dtype=self.segment.dtype)
            with self.segment.lock():
                ACCUMULATE[_REDUCE_OPS[aux]](self.segment.data[offset : offset + numel], src)

    def _signal(self, origin: int, aux: int, offset: int, numel: int, payload: bytearray) -> None:
        self.segment.add_signal(origin, offset)

    def _flush(self, origin: int, aux: int, offset: int, numel: int, payload: bytearray) -> None:
        return None


def _drain(conn: socket.socket, n: int) -> None:
    buf = bytearray(min(n, 1 << 20))
    view = memoryview(buf)
    while n:
        k = conn.recv_into(view[: min(n, len(buf))])
        if k == 0:
            raise ConnectionError("EOF while draining")
        n -= k


# --------------------------------------------------------------------------------------------------- the client
class TcpChannel:
    """Origin-side connection to ``target``'s service. One request in flight at a time (a lock); every op waits for
    the reply, so its completion means it was applied at the target.

    Errors: EOF / reset → ``PeerFailure`` (the channel stays broken); no reply within ``timeout_s`` →
    ``CommTimeout`` (also breaks the channel: the stream position is unknown); a refused hello → ``WindowAuthError``.
    A status error from the target maps to the window's own exception classes through ``errors``.
    """

    def __init__(self, target: int, origin: int, address: tuple[str, int], token: bytes, timeout_s: float,
                 err_ctx: dict[str, Any], errors: dict[int, type[Exception]]) -> None:
        self.target = target
        self._ctx = err_ctx
        self._errors = errors
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._broken: CommError | None = None
        self._req = 0
        self._reply_buf = bytearray(REPLY.size)
        try:
            sock = socket.create_connection(address, timeout=timeout_s)
        except OSError as exc:
            raise PeerFailure(f"cannot connect to its window service at {address}: {exc}", peer=target,
                              op="new_window", **err_ctx) from exc
        self._sock = sock
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nonce = bytearray(CHALLENGE_BYTES)
            if not _recv_exact(sock, memoryview(nonce)):
                raise ConnectionError("the window service closed the connection before its challenge")
            sock.sendall(HELLO.pack(MAGIC, origin, proof(token, bytes(nonce), origin)))
            verdict = sock.recv(1)
        except OSError as exc:
            sock.close()
            raise PeerFailure(f"window hello failed: {exc}", peer=target, op="new_window", **err_ctx) from exc
        if verdict != ACCEPTED:
            sock.close()
            raise WindowAuthError(f"window service of rank {target} at {address} refused the connection "
                                  "(wrong window token)", op="new_window", **err_ctx)

    def alive(self) -> bool:
        if self._broken is not None:
            return False
        if not self._lock.acquire(blocking=False):
            return True  # a request is in flight; it will report a failure itself
        try:
            r, _, _ = select.select([self._sock], [], [], 0)
            return not r  # an idle connection becomes readable only at EOF / reset
        finally:
            self._lock.release()

    def _request(self, opname: str, op: Op, code: int, aux: int, offset: int, numel: int,
                 payload: memoryview | None, into: memoryview | None) -> None:
        with self._lock:
            if self._broken is not None:
                raise PeerFailure(f"connection is broken since: {self._broken.detail}", peer=self.target,
                                  op=opname, **self._ctx) from self._broken
            self._req = (self._req + 1) & 0xFFFFFFFF
            sock = self._sock
            try:
                sock.settimeout(self._timeout_s)
                plen = 0 if payload is None else len(payload)
                sock.sendall(REQUEST.pack(op, code, aux, self._req, offset, numel, plen))
                if plen:
                    sock.sendall(payload)  # type: ignore[arg-type]
                if not _recv_exact(sock, memoryview(self._reply_buf)):
                    raise ConnectionError("connection closed by the target")
                status, req_id, n = REPLY.unpack(self._reply_buf)
                if req_id != self._req:
                    raise ConnectionError(f"reply {req_id} out of sequence (expected {self._req})")
                if status == Status.OK:
                    if n:
                        if into is None or len(into) != n:
                            raise ConnectionError(f"unexpected reply of {n} bytes")
                        if not _recv_exact(sock, into):
                            raise ConnectionError("connection closed by the target")
                    return
                msg = bytearray(n)
                if n:
                    _recv_exact(sock, memoryview(msg))
            except TimeoutError as exc:
                self._broken = CommTimeout(f"no reply from rank {self.target} within {self._timeout_s:.3f}s",
                                           op=opname, **self._ctx)
                sock.close()
                raise self._broken from exc
            except (OSError, ConnectionError) as exc:
                self._broken = PeerFailure(f"{type(exc).__name__}: {exc}", peer=self.target, op=opname, **self._ctx)
                sock.close()
                raise self._broken from exc
        cls = self._errors.get(status, CommError)
        text = f"rank {self.target} rejected {opname}: {msg.decode(errors='replace')}"
        if issubclass(cls, CommError):
            raise cls(text, op=opname, **self._ctx)
        raise cls(text)

    def put(self, offset: int, src: torch.Tensor) -> None:
        self._request("window.put", Op.PUT, dtype_code(src.dtype), 0, offset, src.numel(), _bytes(src), None)

    def get(self, offset: int, out: torch.Tensor) -> None:
        self._request("window.get", Op.GET, dtype_code(out.dtype), 0, offset, out.numel(), None, _bytes(out))

    def get_rows(self, indices: torch.Tensor, out: torch.Tensor) -> None:
        self._request("window.get_rows", Op.GET_ROWS, dtype_code(out.dtype), 0, 0, indices.numel(),
                      _bytes(indices), _bytes(out))

    def accumulate(self, offset: int, src: torch.Tensor, op: ReduceOp) -> None:
        self._request("window.accumulate", Op.ACCUMULATE, dtype_code(src.dtype), _REDUCE_OPS.index(op), offset,
                      src.numel(), _bytes(src), None)

    def signal(self, value: int) -> None:
        self._request("window.signal", Op.SIGNAL, 0, 0, value, 0, None, None)

    def flush(self) -> None:
        self._request("window.flush", Op.FLUSH, 0, 0, 0, 0, None, None)

    def close(self) -> None:
        """Close the connection; a request blocked on it in another thread fails at once (``PeerFailure``)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.close()
