"""The post hook that keeps an abandoned backend's late writes out of the caller's tensors (fault tolerance).

Used by :class:`~torchnext.ft.FaultTolerant` on its generations' Communicators and named by
:class:`~torchnext.ft.process_group.FaultTolerantProcessGroup` as what its native path covers (staging does the same
there), so it lives below both.
"""

from __future__ import annotations

import torch

from torchnext.comms.hooks import PostHookArgs
from torchnext.comms.work import WorkStatus

__all__ = ["quarantine_cancelled"]


def quarantine_cancelled(args: PostHookArgs) -> None:
    """Post hook: give the tensors of an aborted op fresh storage, so the abandoned backend's late writes land in
    the old storage -- kept alive by the communicator (``Communicator.retain``) until its backend is released, when
    no late write can land any more (:mod:`torchnext.comms.reaper`), then freed."""
    if args.status is not WorkStatus.ABORTED:
        return
    comm = args.work.communicator
    with torch.no_grad():
        for t in args.info.outputs:
            try:
                comm.retain(t.untyped_storage())
                fresh = t.clone()
                t.set_(fresh.untyped_storage(), fresh.storage_offset(), fresh.size(), fresh.stride())
            except RuntimeError:
                pass
