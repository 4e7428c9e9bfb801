"""Deferred commit decisions (``FaultTolerantConfig(defer_commit=True)``): a step's optimizer update is applied
before the coordinator's decision arrives, and revoked if the decision is a refusal.

Without deferral ``step.commit()`` sends the vote and waits for the decision -- a round trip through the
coordinator on every step's critical path (~0.8-1.4 ms on a loaded 2-core machine). With it, ``step.commit()``
sends the vote and returns at once; the decision is awaited at the next ``step.commit()``, where it has normally
long arrived. Semantics, per member (``s`` = ``ft.step_count`` when the attempt began)::

    ft.step():                                       # the attempt begins (its generation settled)
        begin copying state_dict() on the snapshot thread       # the state before s's update
    step.commit():                                   # deferred
        if step s-1 is provisional: await its decision          # the vote for s is sent only after it
            refused: load_state_dict(snapshot of s-1); step_count = s - 1; return False   # this attempt fails too
        vote(s)                                      # as without deferral; cannot vote -> return False
        keep the copy begun at ft.step() as s's snapshot
        step_count = s + 1                           # provisional: the caller applies opt.step() now
        return True
    entering a generation announced with committed count c (before any healing):
        c == s + 1: step s was committed          c == s: step s is revoked (load_state_dict(snapshot))
    ft.confirm(): await the provisional step's decision now; True when committed or none was pending
    ft.finish(): confirm(); raises StepRevoked when the last step was revoked (train it again)

What holds as without deferral: a committed step is applied exactly once on every member (a refused one never
stays applied: it is reverted before this member votes again, and before it donates state to a joiner -- the
generation it enters says which steps were committed); the vote for ``s + 1`` is sent only after the decision of
``s`` was received, so the coordinator sees the same sequence of votes. What changes: ``ft.step_count`` counts a
provisional step; a refused step costs one more attempt (the one computed on top of it is discarded); the member
holds two more copies of its state (:class:`StateSnapshots`) and copies it once per attempt, overlapping forward
and backward, which must not write it (an optimizer update or an in-place change of a parameter belongs after
``step.commit()``; a buffer that forward updates, such as BatchNorm's running statistics, may be copied before or
after that update -- without deferral a failed attempt's buffer updates are not reverted at all); an exception
raised in the block after ``step.commit()`` returned True makes the member leave the group if the step turns out
committed (its optimizer update may be half-applied), as an early vote's does. ``DistributedDataParallel(vote_early=True)`` does
not vote early under deferral: the vote for ``s`` must follow ``s - 1``'s decision, which the training thread
awaits.

Replica groups of one rank only (FT-DDP): ``FaultTolerant`` refuses ``defer_commit`` with ``group_size > 1``. FT-HSDP
with deferral passed its chaos schedules (where each group runs its generation agreement, ``_lockstep``, before every
attempt: whether a decision has arrived when the next attempt begins differs from rank to rank), but one of two
240-fault soaks (``bench_soak.py --faults 240 --minutes 4 --warmup-faults 20 --seed 5 --defer-commit``) stalled
after a coordinator failover -- the standby took office and no step committed within 90 s -- and it is not yet
explained; the same seed passes without deferral.
"""

from __future__ import annotations

import concurrent.futures
import copy
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Provisional", "StateSnapshots", "StepRevoked"]


class StepRevoked(RuntimeError):
    """``ft.finish()`` under ``defer_commit``: the last step, applied provisionally, was refused by the coordinator
    and reverted; ``ft.step_count`` is one lower. Train that step again (``while ft.step_count < total or not
    ft.confirm(): ...``), then finish."""


@dataclass(kw_only=True)
class Provisional:
    """A step applied before its decision: voted in generation ``gen`` for committed count ``step``; ``snapshot`` is
    the state before its optimizer update; ``decision`` the coordinator's decision once received out of turn (by
    a drain of the event queue), else None."""

    gen: int
    step: int
    snapshot: Any
    decision: dict[str, Any] | None = None
    refusal: str | None = None
    """Why it was refused, when a refusal (a quorum wait) was received out of turn."""


class StateSnapshots:
    """Copies of a state (nested dicts, lists and tuples of tensors and plain values), taken on a worker thread while
    the training thread goes on, their tensor buffers reused. Reference::

        begin(state); ...; done() == copy.deepcopy(state)   # tensors detached; shares no storage with ``state``;
                                                             # copied between begin() and done(): the caller must
                                                             # not write ``state``'s tensors meanwhile
        release(copy)     # its buffers may be written by a later copy
        a copy never released (it was loaded back: a loader may keep its tensors) is never written again

    Under ``defer_commit`` two copies live at once in steady state: the provisional step's, and the one being taken
    for the next attempt. One worker thread, started on first use and ended by :meth:`close`."""

    def __init__(self) -> None:
        self._free: list[Any] = []
        self._pending: concurrent.futures.Future[Any] | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def begin(self, state: Any) -> None:
        """Start copying ``state`` (the previous copy begun and not taken by :meth:`done` is released). The structure
        is built here, on the caller's thread; the worker copies every plain tensor in one ``torch._foreach_copy_``
        (the GIL released throughout: the training thread's forward is not made to hand it back and forth); a
        tensor subclass (a DTensor) is cloned here."""
        self.discard()
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="torchnext-ft-snapshot")
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        with torch.no_grad():
            taken = _plan(state, self._free.pop() if self._free else None, dsts, srcs)
        self._pending = self._pool.submit(_copy_all, taken, dsts, srcs)

    def done(self) -> Any:
        """The copy begun last (waits for it); None if none was begun."""
        pending, self._pending = self._pending, None
        return None if pending is None else pending.result()

    def discard(self) -> None:
        """Release the copy begun and not taken, if any."""
        taken = self.done()
        if taken is not None:
            self.release(taken)

    def release(self, taken: Any) -> None:
        if len(self._free) < 2:
            self._free.append(taken)

    def close(self) -> None:
        """End the worker thread; drop every buffer."""
        pool, self._pool = self._pool, None
        self._pending = None
        self._free.clear()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def _copy_all(taken: Any, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> Any:
    if dsts:
        with torch.no_grad():
            torch._foreach_copy_(dsts, srcs)
    return taken


def _plan(value: Any, into: Any, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> Any:
    """The copy of ``value`` with every plain tensor's destination (``into``'s when it fits, else a new one) and its
    source appended to ``dsts``/``srcs``, to be copied later."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if type(t) is not torch.Tensor:
            return t.clone()
        fits = (type(into) is torch.Tensor and into.shape == t.shape and into.dtype == t.dtype
                and into.device == t.device and into.is_contiguous()
                and into.untyped_storage().data_ptr() != t.untyped_storage().data_ptr())
        dst = into if fits else torch.empty_like(t, memory_format=torch.contiguous_format)
        dsts.append(dst)
        srcs.append(t)
        return dst
    if isinstance(value, dict):
        prev = into if isinstance(into, dict) else {}
        items = {k: _plan(v, prev.get(k), dsts, srcs) for k, v in value.items()}
        out: Any = items if type(value) is dict else type(value)(items)
        if hasattr(value, "_metadata"):  # a module's state_dict: load_state_dict reads its versions
            out._metadata = copy.deepcopy(value._metadata)
        return out
    if isinstance(value, (list, tuple)):
        before: Any = into if isinstance(into, (list, tuple)) and len(into) == len(value) else [None] * len(value)
        seq = [_plan(v, b, dsts, srcs) for v, b in zip(value, before, strict=True)]
        if type(value) in (list, tuple):
            return type(value)(seq)
        return type(value)(*seq) if hasattr(value, "_fields") else type(value)(seq)  # a namedtuple takes fields
    return copy.deepcopy(value)
