"""Exceptions raised by :mod:`torchnext.comms`.

Callers tell failures apart by class::

    CommError                    any failure of an issued communication op
    ├── CommTimeout              the op did not complete within its timeout
    ├── CommAborted              the communicator was aborted (before or while the op ran)
    ├── PeerFailure              a peer died or its connection broke (``.peer`` when known)
    └── CollectiveMismatch       members issued different ops, or one op with different arguments (consistency
                                 mode: refused on every rank before any data moved)
    HookError (RuntimeError)     a user hook raised (names the hook); not a communication failure

They are torch's exception types too, so ``except`` clauses written for torch.distributed keep working:
``CommError`` (and so every subclass) is a ``torch.distributed.DistBackendError`` -- hence a
``torch.distributed.DistError`` and a ``RuntimeError`` -- and ``PeerFailure`` is also a
``torch.distributed.DistNetworkError``.

Invalid arguments raise ``TypeError`` / ``ValueError`` before anything is issued.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch.distributed as dist

__all__ = [
    "CollectiveMismatch", "CommAborted", "CommError", "CommTimeout", "HookError", "PeerFailure", "classify_backend_error",
]


class CommError(dist.DistBackendError):
    """A communication op failed. The message names the op, its op_id, the communicator and its ranks.

    Attributes mirror the message so handlers need not parse it: ``op``, ``op_id``, ``comm_name``, ``rank``
    (this process's rank in the communicator) and ``ranks`` (global ranks of the members).
    """

    def __init__(
        self,
        detail: str,
        *,
        op: str | None = None,
        op_id: int | None = None,
        comm_name: str | None = None,
        rank: int | None = None,
        ranks: Sequence[int] | None = None,
    ) -> None:
        self.detail = detail
        self.op = op
        self.op_id = op_id
        self.comm_name = comm_name
        self.rank = rank
        self.ranks = tuple(ranks) if ranks is not None else None
        where = []
        if op is not None:
            where.append(f"{op} (op_id={op_id})" if op_id is not None else op)
        if comm_name is not None:
            where.append(f"on communicator {comm_name!r}")
        if rank is not None:
            where.append(f"rank {rank}")
        if self.ranks is not None:
            where.append(f"ranks {list(self.ranks)}")
        super().__init__(f"{' '.join(where)}: {detail}" if where else detail)


class CommTimeout(CommError):
    """The op did not complete within its timeout. The communicator is errored afterwards (see ``errored()``)."""


class CommAborted(CommError):
    """The communicator was aborted; the op was cancelled on this rank or refused."""


class PeerFailure(CommError, dist.DistNetworkError):
    """A peer process died or its connection broke. ``peer`` is its rank in the communicator when known."""

    def __init__(self, detail: str, *, peer: int | None = None, **kwargs: object) -> None:
        self.peer = peer
        if peer is not None:
            detail = f"peer rank {peer} failed: {detail}"
        super().__init__(detail, **kwargs)  # type: ignore[arg-type]


class CollectiveMismatch(CommError):
    """The members of a communicator did not issue the same op with agreeing arguments at the same point.

    Raised by the consistency mode (``Communicator(..., check_collectives=True)``, see
    :mod:`torchnext.comms.consistency`) from the op call on **every** member, before any data reached the backend.
    The message names the culprit ranks and what differs; so do the attributes:

    * ``culprits``: global ranks of the members that differ from the majority (or never arrived);
    * ``field``: what differs -- ``"op"``, ``"input_sizes"``, ``"output_sizes"``, ``"dtypes"``, ``"root"``,
      ``"reduce_op"``, ``"splits"`` (all_to_all), ``"p2p"`` (a send and its receive), or ``"arrival"`` (members
      that never issued the op);
    * ``seq``: the collective's sequence number on the communicator (p2p: the pair's message index);
    * ``fingerprints``: global rank -> what that member issued, as text;
    * ``breaks_communicator``: False when the communicator stays usable (every member refused the op, nothing
      moved); True for ``"arrival"``, after which the communicator is errored like after a timeout.
    """

    def __init__(
        self,
        detail: str,
        *,
        culprits: Sequence[int] = (),
        field: str = "op",
        seq: int | None = None,
        fingerprints: dict[int, str] | None = None,
        breaks_communicator: bool = False,
        **kwargs: object,
    ) -> None:
        self.culprits = tuple(culprits)
        self.field = field
        self.seq = seq
        self.fingerprints = dict(fingerprints or {})
        self.breaks_communicator = breaks_communicator
        super().__init__(detail, **kwargs)  # type: ignore[arg-type]


class HookError(RuntimeError):
    """A pre/post/abort hook raised. ``hook`` is the callable; the original exception is ``__cause__``."""

    def __init__(self, message: str, *, hook: object) -> None:
        self.hook = hook
        super().__init__(message)


# Backend error text -> our class. First match wins; no match -> CommError. Patterns cover Gloo and NCCL wording.
_BACKEND_ERROR_PATTERNS: tuple[tuple[re.Pattern[str], type[CommError]], ...] = (
    (re.compile(r"timed out|timeout|Watchdog caught collective operation timeout", re.IGNORECASE), CommTimeout),
    (
        re.compile(
            r"closed by peer|reset by peer|connection reset|broken pipe|remote worker crashing|"
            r"ECONNRESET|EPIPE|remote process exited|NCCL communicator was aborted|ncclRemoteError",
            re.IGNORECASE,
        ),
        PeerFailure,
    ),
)


def classify_backend_error(exc: BaseException) -> type[CommError]:
    """Map an exception raised by a backend (Gloo, NCCL, ...) to the :class:`CommError` subclass callers catch."""
    if isinstance(exc, CommError):
        return type(exc)
    text = str(exc)
    for pattern, cls in _BACKEND_ERROR_PATTERNS:
        if pattern.search(text):
            return cls
    return CommError
