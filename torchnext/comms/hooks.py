"""Hook argument types and the hook lists of a :class:`~torchnext.comms.Communicator`.

When hooks run (the contract the Flight Recorder builds on):

* **pre hooks** run on the issuing thread, after argument validation and before the op is handed to the backend,
  in registration order, each with an :class:`OpInfo`.
* **post hooks** run **exactly once per op whose pre hooks ran**, when the op reaches a terminal state
  (COMPLETED, ERROR, TIMED_OUT, ABORTED), in registration order, each with a :class:`PostHookArgs` carrying the
  same ``op_id``. They run on the thread that moves the op to that state: for COMPLETED/ERROR the issuing thread
  for sync collectives on Gloo; for async collectives on Gloo the thread that waits on the Work (when it waits
  within the op's first slice), else the backend's completion thread or the communicator's watcher thread (see
  :mod:`torchnext.comms.work`); the waiting thread for TIMED_OUT, the thread calling ``abort()`` for ABORTED. They finish before any ``wait()`` on
  the op returns, so after a synchronous op returns its post hooks have run. Keep them short and thread-safe.
* **check hooks** run on the issuing thread after the pre hooks, right before the op is handed to the backend,
  with the same :class:`OpInfo`. They exist for checks that may *refuse* an op (the consistency mode of
  :mod:`torchnext.comms.consistency` compares the op across members there): a check hook that raises a
  :class:`~torchnext.comms.CommError` refuses the op on this rank, and the op call raises that exception as is.
  The post hooks then run with status ERROR and that exception. The communicator stays usable after a
  :class:`~torchnext.comms.CollectiveMismatch` whose ``breaks_communicator`` is False, and is errored after any
  other refusal (as after a failed op).
* **abort hooks** run once per communicator, on the thread calling ``abort()``, after the communicator is marked
  aborted and before in-flight ops are cancelled, each with an :class:`AbortHookArgs`.
* **shutdown hooks** run once, on the thread calling ``shutdown()``, after the ops in flight finished and before
  the backend is released, with the communicator (extensions release what they built on it).

A hook that raises (other than a check hook refusing an op with a ``CommError``): the remaining hooks of that list
still run (post/abort/shutdown) or are skipped (pre/check), and a
:class:`~torchnext.comms.HookError` naming the hook surfaces: a pre hook's error is raised from the op call and the
op is **not issued on this rank** (peers that did issue it wait until their timeout or an abort); a post hook's
error is raised by ``Work.wait()`` / the synchronous op (the op itself completed); an abort hook's error is raised
by ``abort()`` after the abort finished; a shutdown hook's by ``shutdown()`` after the shutdown finished.
"""

from __future__ import annotations

import itertools
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

import torch

from torchnext.comms.errors import CollectiveMismatch, CommError, HookError

F = TypeVar("F", bound=Callable[..., Any])

if TYPE_CHECKING:
    from torchnext.comms._ops import P2POp
    from torchnext.comms.work import Work, WorkStatus

__all__ = ["AbortHookArgs", "OpInfo", "PostHookArgs", "RemovableHandle", "mirrored_natively", "native_equivalent"]

_NATIVE_MARK = "__torchnext_native_equivalent__"


def native_equivalent(fn: F) -> F:
    """Mark hook ``fn`` as one whose work the native process-group data path does itself (the Flight Recorder's
    record/complete hooks: the C++ ring records the same entries), so registering it does not switch a group to
    the Python path (see :mod:`torchnext.comms.process_group.native`)."""
    setattr(fn, _NATIVE_MARK, True)
    return fn


def mirrored_natively(fn: object) -> bool:
    """Whether hook ``fn`` (a function or a bound method) is marked with :func:`native_equivalent`."""
    return bool(getattr(fn, _NATIVE_MARK, False))


class OpInfo(NamedTuple):
    """What a pre hook sees: one op as issued on this rank (an immutable named tuple: cheap on the hot path)."""

    op: str
    """Op name, e.g. ``"all_reduce"`` (the Communicator method name; ``"split"`` for a split's exchange)."""
    op_id: int
    """Per-communicator counter, starting at 1, incremented for every op issued through the public API (window ops,
    ``op`` ``"window.<name>"``: the window's own sequence)."""
    comm_name: str
    """Name of the communicator."""
    ranks: tuple[int, ...]
    """Global ranks of the communicator's members."""
    rank: int
    """This process's rank in the communicator."""
    size: int
    """Number of members."""
    async_op: bool
    """Whether the caller asked for a Work."""
    root: int | None
    """Root rank (broadcast, reduce, gather, scatter), else None."""
    peer: int | None
    """Peer rank (send, recv), else None. batch_p2p: None (see ``inputs``/``outputs``)."""
    reduce_op: str | None
    """The :class:`~torchnext.comms.ReduceOp` value for reductions, else None."""
    inputs: tuple[torch.Tensor, ...]
    """Tensors read by the op on this rank."""
    outputs: tuple[torch.Tensor, ...]
    """Tensors written by the op on this rank (in-place ops list the same tensor in both)."""
    timeout: timedelta
    """The op's effective timeout."""
    tag: int | None = None
    """The p2p tag of ``send``/``recv``; None for other ops."""
    batch: tuple[P2POp, ...] = ()
    """``batch_p2p``: its ops, validated, in the caller's order (kind, tensor, peer, tag); () for other ops."""
    splits: tuple[tuple[int, ...], tuple[int, ...]] | tuple[()] = ()
    """``all_to_all_single`` with explicit splits: ``(output_splits, input_splits)`` in rows per rank (an empty
    tuple stands for equal splits); () for other ops."""


class PostHookArgs(NamedTuple):
    """What a post hook sees: the op's terminal state (an immutable named tuple)."""

    info: OpInfo
    """The same object the pre hooks received (same ``op_id``)."""
    work: Work
    """The op's Work (terminal)."""
    status: WorkStatus
    """COMPLETED, ERROR, TIMED_OUT or ABORTED."""
    duration_s: float
    """Seconds from issue to the terminal state."""
    exception: BaseException | None
    """The op's exception (None when COMPLETED)."""

    @property
    def op_id(self) -> int:
        """``info.op_id``."""
        return self.info.op_id


@dataclass(frozen=True, slots=True)
class AbortHookArgs:
    """What an abort hook sees."""

    comm_name: str
    ranks: tuple[int, ...]
    rank: int
    reason: str | None
    """The ``reason`` passed to ``abort()``."""
    in_flight: tuple[int, ...]
    """op_ids of the ops in flight on this rank when abort was called (they are cancelled right after)."""


A = TypeVar("A")


class RemovableHandle:
    """Returned by ``register_*_hook``; ``remove()`` unregisters the hook (idempotent)."""

    __slots__ = ("_key", "_registry")

    def __init__(self, registry: HookList[Any], key: int) -> None:
        self._registry: HookList[Any] | None = registry
        self._key = key

    def remove(self) -> None:
        if self._registry is not None:
            self._registry._remove(self._key)
            self._registry = None


class HookList(Generic[A]):
    """Ordered hooks of one kind. ``snapshot`` is a tuple replaced on change, so running never sees a half update."""

    __slots__ = ("_hooks", "_keys", "_watchers", "kind", "snapshot")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._hooks: dict[int, Callable[[A], object]] = {}
        self._keys = itertools.count()
        self._watchers: tuple[Callable[[], object], ...] = ()
        self.snapshot: tuple[Callable[[A], object], ...] = ()

    def watch(self, fn: Callable[[], object]) -> Callable[[], None]:
        """Call ``fn()`` after every change of the list (a hook added or removed), on the changing thread; returns
        an undo. How a process group learns that a hook now asks for the Python path, and when it no longer does."""
        self._watchers = (*self._watchers, fn)

        def undo() -> None:
            self._watchers = tuple(w for w in self._watchers if w is not fn)

        return undo

    def _changed(self) -> None:
        for fn in self._watchers:
            fn()

    def add(self, fn: Callable[[A], object]) -> RemovableHandle:
        if not callable(fn):
            raise TypeError(f"{self.kind} hook must be callable, got {fn!r}")
        key = next(self._keys)
        self._hooks[key] = fn
        self.snapshot = tuple(self._hooks.values())
        if self._watchers:
            self._changed()
        return RemovableHandle(self, key)

    def _remove(self, key: int) -> None:
        if self._hooks.pop(key, None) is not None:
            self.snapshot = tuple(self._hooks.values())
            if self._watchers:
                self._changed()

    def run(self, args: A, *, stop_on_error: bool) -> HookError | None:
        """Call every hook with ``args`` in order; return the first failure as a HookError (never raises)."""
        first: HookError | None = None
        for fn in self.snapshot:
            try:
                fn(args)
            except Exception as exc:
                if first is None:
                    first = _hook_error(self.kind, fn, exc)
                if stop_on_error:
                    break
        return first

    def refusal(self, args: A) -> tuple[BaseException, bool] | None:
        """Run check hooks: None when every hook passed, else ``(exception, breaks_communicator)`` for the first
        that raised (later hooks are skipped). A :class:`CommError` is the hook refusing the op and is returned as
        is; it leaves the communicator usable only when it is a ``CollectiveMismatch`` with
        ``breaks_communicator=False``. Any other exception is a bug in the hook: a ``HookError`` (which breaks
        nothing: the op was not issued)."""
        for fn in self.snapshot:
            try:
                fn(args)
            except CommError as exc:
                return exc, not (isinstance(exc, CollectiveMismatch) and not exc.breaks_communicator)
            except Exception as exc:
                return _hook_error(self.kind, fn, exc), False
        return None


def _hook_error(kind: str, fn: object, exc: BaseException) -> HookError:
    """``HookError`` caused by ``exc``. The hook's traceback is kept as text (a note on ``exc``, printed with it), not
    as frames: those reach back to the op's Work, which stores the error -- a cycle that would keep the Work, its
    communicator and backend alive until a full collection."""
    err = HookError(f"{kind} hook {_hook_name(fn)} raised {exc!r}", hook=fn)
    if exc.__traceback__ is not None:
        exc.add_note("hook traceback (most recent call last):\n" + "".join(traceback.format_tb(exc.__traceback__)))
        exc.__traceback__ = None
    err.__cause__ = exc
    return err


def _hook_name(fn: object) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    module = getattr(fn, "__module__", None)
    return f"{module}.{name}" if module else str(name)
