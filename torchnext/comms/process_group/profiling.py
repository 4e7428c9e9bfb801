"""Profiler annotations on the Python path of torchnext process groups.

torch's own groups appear in a profiler trace through the dispatcher (``c10d::allreduce_``) and their backend
(``gloo:all_reduce``). An op of a torchnext group on the Python path reaches the group without the dispatcher's
record, so it names itself: ``torchnext:<op>`` around the op's issue (as ``gloo:<op>`` is around Gloo's), with the
inner backend's own record inside it. On the native path the dispatcher's record is there already. Reference::

    with annotate("all_reduce"):      # record_function("torchnext:all_reduce") while a profiler runs
        issue the op                  # else nothing: one C call (~0.2 us) per op
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.autograd.profiler import record_function

__all__ = ["PREFIX", "annotate"]

PREFIX = "torchnext:"
"""The prefix of every record's name: ``torchnext:all_reduce``, ``torchnext:broadcast``, ..."""

_enabled = torch._C._autograd._profiler_enabled  # any profiler (torch.profiler, legacy, started from C++)
_NOTHING = contextlib.nullcontext()
_NAMES: dict[str, str] = {}


def annotate(op: str) -> Any:
    """A context manager recording ``torchnext:<op>`` while a profiler runs; a shared no-op otherwise."""
    if not _enabled():
        return _NOTHING
    name = _NAMES.get(op)
    if name is None:
        name = _NAMES[op] = PREFIX + op
    return record_function(name)
