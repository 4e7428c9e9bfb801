"""Consistency mode: the members of a communicator compare every op before issuing it, so that a mismatch raises
:class:`~torchnext.comms.CollectiveMismatch` on every member instead of crashing or hanging one.

Turn it on per communicator or for the whole process::

    comm = Communicator(store, rank, size, check_collectives=True)
    # or TORCHNEXT_CHECK_COLLECTIVES=1 (every Communicator and every backend="torchnext" group built without an
    # explicit check_collectives=); unset, TORCH_DISTRIBUTED_DEBUG=DETAIL turns it on too

What happens on a mismatch (sizes, dtypes, op, root, reduce op, all_to_all splits, a send and its receive, a member
that skipped or added a collective)::

    try:
        comm.all_gather_single(out, t)        # rank 1 passes 6 elements, ranks 0 and 2 pass 4
    except CollectiveMismatch as exc:          # raised on ranks 0, 1 and 2 alike, nothing was sent
        exc.culprits == (1,); exc.field == "input_sizes"
    comm.all_reduce(t)                         # still usable: the refused op moved no data anywhere

A member that never arrives (it skipped the last collective, shut down, or hangs elsewhere) is named after the op's
timeout (or at once, when it shut down its communicator) with ``field="arrival"``; that leaves the communicator
errored, like a timeout does. See :mod:`torchnext.comms.consistency.checker` for the protocol and docs/comms.md for
its cost and when to turn it on.

Importing this package registers the ``check_collectives=`` option of :class:`~torchnext.comms.Communicator`.
"""

from __future__ import annotations

from typing import Any

from torchnext.comms.consistency.checker import Checker as Checker
from torchnext.comms.consistency.checker import attach as attach
from torchnext.comms.consistency.fingerprint import RULES as RULES
from torchnext.comms.consistency.fingerprint import Fingerprint as Fingerprint
from torchnext.comms.consistency.fingerprint import FingerprintError as FingerprintError
from torchnext.comms.consistency.fingerprint import Rule as Rule
from torchnext.comms.extension import register_option

__all__ = ["RULES", "Checker", "Fingerprint", "FingerprintError", "Rule", "attach"]


class CheckOption:
    """``Communicator(..., check_collectives=True)``: attach a :class:`Checker` once the communicator is connected
    (False: the core never calls us)."""

    def check(self, value: object) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"check_collectives must be a bool or None, got {value!r}")

    def attach(self, comm: Any, value: bool) -> None:
        if value:
            attach(comm)


register_option("check_collectives", CheckOption())
