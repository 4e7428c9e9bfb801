"""Fault-tolerant DDP: torch's ``DistributedDataParallel`` across replica groups, averaging over the live ones.

``DistributedDataParallel(module, ft)`` is torch's DDP with three changes, all for fault tolerance:

* its gradients are all-reduced by a comm hook on ``ft.process_group`` (AVG over the live replica groups; with a
  hook DDP leaves averaging to the hook, so the divisor is the live count, not a size fixed at construction; the
  group runs it on a staging copy, so DDP's bucket buffer never reaches a backend that a reconfiguration may
  abandon mid-op), and a failure in that hook is recorded -- the step cannot commit -- instead of raising out of
  backward;
* DDP's own construction-time collectives (parameter-shape check, parameter broadcast) run on a one-rank group of
  this process, because a replica group that joins later builds its DDP while the others train: the state comes
  from healing instead. After construction that group's one remaining collective -- the all-reduce with which
  ``find_unused_parameters=True`` tells which parameters some rank used -- runs on ``ft.process_group``: a
  parameter unused here but used by another replica group (mixture-of-experts routing) must still receive the
  average, not be skipped as "globally unused";
* its bucket layout is pinned (below).

**The bucket layout is pinned.** A joiner's first step must pair bucket for bucket with the survivors' step (the
same number of bucket all-reduces, the same sizes, the same order), so every member buckets alike whenever it
joined: the layout is a function of the model alone, the one torch's DDP builds at construction with
``find_unused_parameters=True``: buckets filled over the parameters in order, capped by ``bucket_cap_mb`` (the
first, when ``bucket_cap_mb`` is not given, by torch's 1 MiB first-bucket cap) or by ``bucket_cap_mb_list``, then
reversed::

    layout = reversed(buckets_by_size(parameters, caps))   # bucket 0, reduced first, holds the last parameters

torch's DDP would instead start from one bucket with ``find_unused_parameters=False`` and rebuild its buckets once,
in the order gradients became ready in the first backward, taking rank 0's order on its group. Here the initial
layout is the pinned one whatever the flag, and the one rebuild runs at construction: its two broadcasts on DDP's
group (the flattened indices with the bucket count, then the bucket sizes) are answered with the pinned layout --
"the pinned layout wins" instead of "rank 0's wins" -- so torch re-initializes the same buckets and never
rebuilds again. ``find_unused_parameters=False`` (torch's default, and ours) is therefore safe with joiners and
skips what ``True`` costs every step: torch's traversal of the autograd graph and the used map's all-reduce (see
docs/benchmarks.md). Pass ``True`` when some replica group may leave a parameter unused (mixture-of-experts).
``static_graph=True`` is refused: its first iteration all-reduces the used map once, so a joiner's first step
would issue an all-reduce the survivors' steps do not. DDP's broadcast of the module's buffers before each forward
(``broadcast_buffers``) stays on the one-rank group, as before: each member keeps its own buffers (a joiner's come
from healing). Any other broadcast on DDP's group after construction raises ``RuntimeError``.

Semantics of one backward, per bucket ``b``::

    b = mean over live replica groups of b        # ft.process_group.allreduce([b], AVG)

**Data path.** Which code issues those ops is chosen once per DDP, at construction, and then per op::

    if native and the module is on CPU:     # TORCHNEXT_NATIVE_PG=1 and the extension loads (compiler, cache)
        comm hook: C++ (csrc/ddp.cpp AverageHook)          used map (find_unused_parameters=True):
                                                           C++ (_DDPGroup's all_reduce -> RouteBackend)
        vote_early: C++ (csrc/ddp.cpp Tracker: _Backward's rules; one Python call per step, the vote itself)
        per op:    backend = the current generation's native backend (ft.process_group.native_route())
                   backend ? backend.allreduce(...)       # no Python (the backend itself takes the group's Python
                                                           #   path when a hook or check_collectives asks for it)
                           : ft.process_group.allreduce(...)  # that generation is on the Python path: its method,
                                                              #   through torch's trampoline (one GIL take)
    else:                                   # TORCHNEXT_NATIVE_PG=0, no compiler, a CUDA module
        comm hook: Python (_average_over_live_groups; with vote_early _average_and_track, which counts the ops
                   in a _Backward)
        used map:  Python (_DDPGroup.allreduce -> ft.process_group.allreduce; find_unused_parameters=True)

The per-op branch follows the group between generations and paths: a generation on the Python path (its
Communicator not Gloo on CPU, or the native backend failed to attach) empties the route; a user hook or
``check_collectives`` added mid-generation turns the native backend to the group's Python path for every op.
Both give the same op on the same backend, so the same bits; a failure is recorded the same way (the staged
backend's future completes with NaN, ``step.commit()`` drains the failure before the vote). Costs per bucket: the
C++ hook adds one mutex read of the route to the op; the Python hook adds a Python call under the GIL when the
bucket is ready, the op's arguments converted by pybind, and a ``then`` callback that takes the GIL again on the
thread completing the op. The used map costs one GIL take on the C++ path (torch's trampoline finds no Python
override on the group) instead of a Python call. ``vote_early`` on the C++ path counts the ops in C++ (a mutex
and a future callback per op) and takes the GIL once per step, to vote. Which branch each op took:
:meth:`DistributedDataParallel.native_counts`.
"""

# No `from __future__ import annotations`: DDP checks the comm hook's annotations as objects.
import contextlib
import itertools
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from torchnext.comms import native as _native_ext
from torchnext.comms.communicator import Communicator
from torchnext.comms.process_group import TorchnextProcessGroup

if TYPE_CHECKING:
    from torchnext.ft.fault_tolerant import FaultTolerant

__all__ = ["DistributedDataParallel"]

_LOCAL = itertools.count()
_NAME = "torchnext.ft.DistributedDataParallel"

_Layout = tuple[tuple[int, ...], ...]
"""Buckets in the order they are reduced, each the indices of its parameters (into the Reducer's parameters)."""


class DistributedDataParallel(nn.parallel.DistributedDataParallel):
    """torch's DDP across the live replica groups of ``ft``, with a pinned bucket layout (see the module docstring).

    ``kwargs`` go to torch's DDP, ``find_unused_parameters`` defaulting to torch's ``False``: every parameter
    takes part in every backward of every replica group. Pass ``True`` when one may not (mixture-of-experts
    routing): the used map is then reduced over the live replica groups. Reference of one step, per bucket ``b`` of
    :meth:`bucket_layout` (the same list on every member, fixed from construction on)::

        for b in bucket_layout():
            grads[b] = mean over live replica groups of grads[b]

    Raises:
        ValueError: ``process_group`` is passed (the group is ``ft.process_group``), or ``static_graph=True`` (its
            first iteration all-reduces the used-parameter map once: a joiner's first step would issue an
            all-reduce the survivors' steps do not).
        TypeError: ``vote_early`` is not a bool.
        RuntimeError: this torch's DDP did not take the pinned layout at construction.
    """

    def __init__(self, module: nn.Module, ft: "FaultTolerant", *, vote_early: bool = False, **kwargs: Any) -> None:
        if "process_group" in kwargs:
            raise ValueError(f"{_NAME}: process_group is ft.process_group; do not pass one")
        if not isinstance(vote_early, bool):
            raise TypeError(f"{_NAME}: vote_early must be a bool, got {vote_early!r}")
        if kwargs.get("static_graph"):
            raise ValueError(f"{_NAME}: static_graph=True is not supported: its first iteration all-reduces the "
                             "used-parameter map once, so a replica group that joins later would issue an "
                             "all-reduce in its first step that the others' steps do not")
        local = Communicator(dist.HashStore(), 0, 1, name=f"ft-ddp-local-{next(_LOCAL)}")
        group = _DDPGroup(local, ft.process_group)
        super().__init__(module, process_group=group, **kwargs)
        group.constructed = True
        self._ft_ddp_group = group
        self._pin_layout()
        tracker = _Backward(ft, expect_used_map=bool(self.find_unused_parameters)) if vote_early else None
        group._tracker = tracker
        self._ft_local = local
        self._ft_group = ft.process_group
        self.vote_early = vote_early
        self._ft_counts: Any = None
        route = self._ft_group.native_route() if self.device_type == "cpu" else None
        if route is not None:
            mod = _native_ext.module()
            self._ft_counts = mod.RouteCounts()
            native_tracker = None if tracker is None else mod.Tracker(tracker.expect_used_map, ft._vote_early)
            mod.register_ddp_hook(self.reducer, route, self._ft_group, self._ft_counts, native_tracker)
            if self.logger is not None:
                self.logger._set_comm_hook_name("torchnext.ft average over live groups (C++)")
            group.route_all_reduce(mod.create_route_backend(route, self._ft_group, self._ft_counts, native_tracker,
                                                            0, 1))
        elif tracker is None:
            self.register_comm_hook(self._ft_group, _average_over_live_groups)
        else:
            self.register_comm_hook(tracker, _average_and_track)

    def bucket_layout(self) -> list[list[int]]:
        """The Reducer's buckets now, in the order they are reduced: each the indices of its parameters (into the
        parameters DDP reduces: the module's that require grad, in ``module.parameters()`` order, shared ones
        once). Equal on every member whenever it joined, and from construction on."""
        if not hasattr(self, "reducer"):  # torch built none: every parameter's all-reduce is delayed
            return []
        index = {id(p): i for i, p in enumerate(self._ft_params)}
        return [[index[id(p)] for p in b.parameters()] for b in self.reducer._get_zeros_like_grad_buckets()]

    def native_counts(self) -> dict[str, int] | None:
        """How many of this DDP's ops took each branch of the C++ data path (see the module docstring):
        ``bucket_native``/``bucket_group`` (comm hook: the native backend / the group's own method) and
        ``used_map_native``/``used_map_group``; None when this DDP uses the Python hook."""
        return None if self._ft_counts is None else dict(self._ft_counts.as_dict())

    # ------------------------------------------------------------------------------------ the pinned layout
    def _ddp_init_helper(self, *args: Any, **kwargs: Any) -> None:
        """torch's helper (it builds the Reducer), handed a bucket config that answers as for
        ``find_unused_parameters=True, static_graph=False`` -- capped buckets from the start whatever the flag;
        then the Reducer's layout is recorded as the pinned one."""
        params = kwargs["parameters"] if "parameters" in kwargs else args[0]
        config = getattr(self, "_bucket_config", None)
        if not _answers_limits(config):
            warnings.warn(f"{_NAME}: this torch ({torch.__version__}) has no DDP bucket config with "
                          "compute_bucket_size_limits(static_graph=, find_unused_parameters=), on which pinning the "
                          "bucket layout relies; running with find_unused_parameters=True (a layout fixed at "
                          "construction, and the used-parameter map every step)", RuntimeWarning, stacklevel=4)
            self.find_unused_parameters = True
            super()._ddp_init_helper(*args, **kwargs)
        else:
            object.__setattr__(self, "_bucket_config", _PinnedBucketConfig(config))
            try:
                super()._ddp_init_helper(*args, **kwargs)
            finally:
                object.__setattr__(self, "_bucket_config", config)
        self._ft_params = list(params)
        self._ft_layout = tuple(tuple(b) for b in self.bucket_layout())

    def _pin_layout(self) -> None:
        """Run torch's one rebuild now (``find_unused_parameters=False``), answered with the pinned layout, and
        check that the Reducer holds it."""
        layout: _Layout | None = getattr(self, "_ft_layout", None)
        if layout is None:  # torch built no Reducer (every parameter's all-reduce delayed): nothing to bucket
            return
        self._ft_ddp_group.pin(layout)
        if not self.find_unused_parameters:
            self.reducer._push_all_rebuilt_params()
            self.reducer._rebuild_buckets()
        got = tuple(tuple(b) for b in self.bucket_layout())
        if got != layout:
            raise RuntimeError(f"{_NAME}: this torch's ({torch.__version__}) DDP did not keep the pinned bucket layout "
                               f"at construction (pinned {_show(layout)}, the Reducer holds {_show(got)}); pass "
                               "find_unused_parameters=True (torch never rebuilds its buckets then)")

    def _distributed_broadcast_coalesced(self, tensors: Any, buffer_size: int, authoritative_rank: int = 0) -> None:
        """The module's buffers (``broadcast_buffers``): on the one-rank group, each member's own."""
        with self._ft_ddp_group.buffers():
            super()._distributed_broadcast_coalesced(tensors, buffer_size, authoritative_rank)

    def _set_static_graph(self) -> None:
        raise ValueError(f"{_NAME}: static_graph is not supported (see the class docstring)")


def _answers_limits(config: Any) -> bool:
    """Whether torch's bucket config answers ``compute_bucket_size_limits(static_graph=, find_unused_parameters=)``
    with two lists (torch 2.13's ``_BucketCapacityConfig``)."""
    fn = getattr(config, "compute_bucket_size_limits", None)
    if not callable(fn):
        return False
    try:
        limits = fn(static_graph=False, find_unused_parameters=True)
    except TypeError:
        return False
    return isinstance(limits, tuple) and len(limits) == 2 and all(isinstance(x, list) for x in limits)


class _PinnedBucketConfig:
    """torch's bucket config, whose ``compute_bucket_size_limits`` answers as for ``static_graph=False,
    find_unused_parameters=True`` (capped buckets from construction on); everything else is torch's own."""

    def __init__(self, config: Any) -> None:
        self._config = config

    def compute_bucket_size_limits(self, static_graph: bool, find_unused_parameters: bool) -> Any:
        return self._config.compute_bucket_size_limits(static_graph=False, find_unused_parameters=True)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def _show(layout: Sequence[Sequence[int]]) -> str:
    return "[" + ", ".join("[" + " ".join(map(str, b)) + "]" for b in layout) + "]"


class _DDPGroup(TorchnextProcessGroup):
    """The process group torch's DDP is given: a one-rank group of this process while DDP is built (its parameter
    shape check and broadcast; a joining replica gets its state from healing). Once ``constructed``:

    * all-reduces -- DDP issues one on its own group, the used-parameter map of ``find_unused_parameters=True``,
      after every bucket -- go to the live replica groups (``ft.process_group``: a failure there is recorded, not
      raised). Buckets never come here: the comm hook sends them to ``ft.process_group`` itself. On the C++ path
      (:meth:`route_all_reduce`) its all_reduce is C++ from then on (:class:`_RoutedDDPGroup`);
    * broadcasts are the Reducer's bucket rebuild syncing its layout -- answered with the layout given to :meth:`pin` --
      or, inside :meth:`buffers`, the module's buffers (on the one-rank group). Reference::

          rebuild:  broadcast(t: int32[n_params + 1]) -> t = [*flattened pinned layout, number of buckets]
                    broadcast(t: int32[number of buckets]) -> t = [len(b) for b in pinned layout]
          anything else: RuntimeError
    """

    def __init__(self, local: Communicator, ft_group: Any, tracker: "_Backward | None" = None) -> None:
        super().__init__({local.device.type: local}, description=local.name)
        self._ft_group = ft_group
        self._tracker = tracker
        self.constructed = False
        self._layout: _Layout | None = None
        self._answers: list[torch.Tensor] = []  # the rebuild's two broadcasts, in order
        self._next = 0
        self._in_buffers = 0

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        if self.constructed:
            work = self._ft_group.allreduce(tensors, opts) if opts is not None else self._ft_group.allreduce(tensors)
            if self._tracker is not None:
                self._tracker.add(work.get_future(), used_map=True)
            return work
        return super().allreduce(tensors, opts)

    def pin(self, layout: _Layout) -> None:
        """The layout a bucket rebuild's broadcasts are answered with."""
        self._layout = layout
        self._answers = [torch.tensor([*(i for b in layout for i in b), len(layout)], dtype=torch.int32),
                         torch.tensor([len(b) for b in layout], dtype=torch.int32)]
        self._next = 0

    @contextlib.contextmanager
    def buffers(self) -> Iterator[None]:
        """Broadcasts inside are the module's buffers: they run on the one-rank group."""
        self._in_buffers += 1
        try:
            yield
        finally:
            self._in_buffers -= 1

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        if self.constructed and not self._in_buffers:
            self._answer_rebuild(tensors, 0 if opts is None else int(opts.rootRank))
        return super().broadcast(tensors, opts)  # one rank, root 0: the contents stay

    def _answer_rebuild(self, tensors: list[torch.Tensor], root: int) -> None:
        t = tensors[0] if len(tensors) == 1 else None
        want = self._answers[self._next] if self._answers else None
        if (want is None or t is None or root != 0 or t.dtype != torch.int32 or t.dim() != 1
                or t.numel() != want.numel()):
            what = ", ".join(f"{x.dtype} {tuple(x.shape)}" for x in tensors)
            expected = "none (no layout pinned)" if want is None else \
                f"torch.int32 ({want.numel()},), the bucket rebuild's {('indices', 'sizes')[self._next]}"
            self._next = 0
            raise RuntimeError(f"{_NAME}: a broadcast of [{what}] from root {root} on DDP's own group after "
                               f"construction; the only ones expected are a bucket rebuild's, next {expected}, "
                               "and the module's buffers (broadcast_buffers)")
        t.copy_(want)
        self._next = (self._next + 1) % len(self._answers)

    def route_all_reduce(self, backend: Any) -> None:
        """From now on all_reduce runs in C++ on ``backend`` (a ``RouteBackend``: through the fault-tolerant
        group's route); every other op stays on the Python methods (the one-rank local group, the pinned
        layout's answers)."""
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM, backend)
        self._tracker = None  # the backend counts the used map for the early vote (its own tracker)
        object.__setattr__(self, "__class__", _RoutedDDPGroup)


class _RoutedDDPGroup(_DDPGroup):
    """A :class:`_DDPGroup` whose all_reduce is torch's C++ ``ProcessGroup`` method (its CPU backend: the route)."""

    allreduce = dist.ProcessGroup.__dict__["allreduce"]


class _Backward:
    """The early vote of ``DistributedDataParallel(vote_early=True)``: one backward's fault-tolerant ops (every
    bucket's all_reduce, then the used-parameter map's when ``find_unused_parameters``) and, when the last of them
    completed, ``ft``'s vote for the step -- sent by the thread that completed it, not when the training thread
    reaches ``step.commit()``. Reference::

        on each op issued: pending += 1          on each completion: pending -= 1
        if the last bucket and (the used map, if expected) were issued and pending == 0: ft._vote_early()

    The C++ path counts the same way (``csrc/ddp.cpp``: ``Tracker``); on both, the future backward waits on
    completes only after the vote left (the Python hook's ``then``; the C++ hook's chained future).

    Contract: no fault-tolerant collective follows backward in the step (``ft.process_group`` raises), and the
    optimizer step is applied iff ``step.commit()``; a block that raises after the vote leaves the group if the
    others committed (see :func:`torchnext.ft.step._voted_then_raised`)."""

    def __init__(self, ft: "FaultTolerant", *, expect_used_map: bool) -> None:
        self.ft = ft
        self.group = ft.process_group
        self.expect_used_map = expect_used_map
        self._lock = threading.Lock()
        self._pending = 0
        self._last_bucket = False
        self._used_map = False

    def add(self, fut: torch.futures.Future[Any], *, last_bucket: bool = False, used_map: bool = False) -> None:
        with self._lock:
            if last_bucket or used_map:  # the used map comes after the last bucket; a new backward starts over
                self._last_bucket = self._last_bucket or last_bucket
                self._used_map = self._used_map or used_map
            self._pending += 1
        fut.add_done_callback(self._done)

    def _done(self, _fut: torch.futures.Future[Any]) -> None:
        with self._lock:
            self._pending -= 1
            ready = (self._pending == 0 and self._last_bucket
                     and (self._used_map or not self.expect_used_map))
            if ready:
                self._last_bucket = self._used_map = False
        if ready:
            self.ft._vote_early()


_AVG = dist.AllreduceOptions()
_AVG.reduceOp = dist.ReduceOp.AVG  # type: ignore[assignment]  # pybind converts the RedOpType


def _average_over_live_groups(group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The comm hook (its state is ``ft.process_group``)."""
    work = group.allreduce([bucket.buffer()], _AVG)
    return work.get_future().then(lambda fut: fut.value()[0])


def _average_and_track(tracker: _Backward, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The comm hook with ``vote_early`` (its state is the :class:`_Backward`)."""
    work = tracker.group.allreduce([bucket.buffer()], _AVG)
    fut = work.get_future()
    tracker.add(fut, last_bucket=bucket.is_last())
    return fut.then(lambda f: f.value()[0])
