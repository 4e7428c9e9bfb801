"""Fault-tolerant DDP: torch's ``DistributedDataParallel`` across replica groups, averaging over the live ones.

``DistributedDataParallel(module, ft)`` is torch's DDP with two changes, both for fault tolerance:

* its gradients are all-reduced by a comm hook on ``ft.process_group`` (AVG over the live replica groups; with a
  hook DDP leaves averaging to the hook, so the divisor is the live count, not a size fixed at construction; the
  group runs it on a staging copy, so DDP's bucket buffer never reaches a backend that a reconfiguration may
  abandon mid-op), and a failure in that hook is recorded -- the step cannot commit -- instead of raising out of
  backward;
* DDP's own construction-time collectives (parameter-shape check, parameter broadcast) run on a one-rank group of
  this process, because a replica group that joins later builds its DDP while the others train: the state comes
  from healing instead. After construction that group's one remaining collective -- the all-reduce with which
  ``find_unused_parameters`` tells which parameters some rank used -- runs on ``ft.process_group``: a parameter
  unused here but used by another replica group (mixture-of-experts routing) must still receive the average, not
  be skipped as "globally unused". ``find_unused_parameters=True`` by default, which also keeps DDP from rebuilding
  its buckets after the first step -- a recovering replica must bucket exactly like the others. What it costs:
  torch's traversal of the autograd graph and the used map's all-reduce each step, ~2.5-3 ms of a 4-rank,
  20 ms-compute step on 2 cores (+14 % FT-DDP overhead against +8 % with ``find_unused_parameters=False``;
  ``benchmarks/ft/bench_parallel.py --all-used``). ``False`` is measured there but is not safe with replicas that
  join: torch's DDP then rebuilds its buckets after its first step, so a joiner's first step would be bucketed
  unlike the survivors'.

Semantics of one backward, per bucket ``b``::

    b = mean over live replica groups of b        # ft.process_group.allreduce([b], AVG)

**Data path.** Which code issues those ops is chosen once per DDP, at construction, and then per op::

    if native and the module is on CPU:     # TORCHNEXT_NATIVE_PG=1 and the extension loads (compiler, cache)
        comm hook: C++ (csrc/ddp.cpp AverageHook)          used map: C++ (_DDPGroup's all_reduce -> RouteBackend)
        vote_early: C++ (csrc/ddp.cpp Tracker: _Backward's rules; one Python call per step, the vote itself)
        per op:    backend = the current generation's native backend (ft.process_group.native_route())
                   backend ? backend.allreduce(...)       # no Python (the backend itself takes the group's Python
                                                           #   path when a hook or check_collectives asks for it)
                           : ft.process_group.allreduce(...)  # that generation is on the Python path: its method,
                                                              #   through torch's trampoline (one GIL take)
    else:                                   # TORCHNEXT_NATIVE_PG=0, no compiler, a CUDA module
        comm hook: Python (_average_over_live_groups; with vote_early _average_and_track, which counts the ops
                   in a _Backward)
        used map:  Python (_DDPGroup.allreduce -> ft.process_group.allreduce)

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
import itertools
import threading
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


class DistributedDataParallel(nn.parallel.DistributedDataParallel):
    """torch's DDP across the live replica groups of ``ft`` (see the module docstring). ``kwargs`` go to torch's
    DDP (``process_group`` is not accepted: the group is ``ft.process_group``)."""

    def __init__(self, module: nn.Module, ft: "FaultTolerant", *, vote_early: bool = False, **kwargs: Any) -> None:
        if "process_group" in kwargs:
            raise ValueError("torchnext.ft.DistributedDataParallel: process_group is ft.process_group; do not pass one")
        if not isinstance(vote_early, bool):
            raise TypeError(f"torchnext.ft.DistributedDataParallel: vote_early must be a bool, got {vote_early!r}")
        kwargs.setdefault("find_unused_parameters", True)
        local = Communicator(dist.HashStore(), 0, 1, name=f"ft-ddp-local-{next(_LOCAL)}")
        tracker = _Backward(ft, expect_used_map=bool(kwargs["find_unused_parameters"])) if vote_early else None
        group = _DDPGroup(local, ft.process_group, tracker)
        super().__init__(module, process_group=group, **kwargs)
        group.constructed = True
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

    def native_counts(self) -> dict[str, int] | None:
        """How many of this DDP's ops took each branch of the C++ data path (see the module docstring):
        ``bucket_native``/``bucket_group`` (comm hook: the native backend / the group's own method) and
        ``used_map_native``/``used_map_group``; None when this DDP uses the Python hook."""
        return None if self._ft_counts is None else dict(self._ft_counts.as_dict())


class _DDPGroup(TorchnextProcessGroup):
    """The process group torch's DDP is given: a one-rank group of this process while DDP is built (its parameter
    shape check and broadcast; a joining replica gets its state from healing); once ``constructed``, all-reduces --
    DDP issues exactly one on its own group, the used-parameter map of ``find_unused_parameters``, after every
    bucket -- go to the live replica groups (``ft.process_group``: a failure there is recorded, not raised).
    Buckets never come here: the comm hook sends them to ``ft.process_group`` itself. On the C++ path
    (:meth:`route_all_reduce`) its all_reduce is C++ from then on (:class:`_RoutedDDPGroup`)."""

    def __init__(self, local: Communicator, ft_group: Any, tracker: "_Backward | None" = None) -> None:
        super().__init__({local.device.type: local}, description=local.name)
        self._ft_group = ft_group
        self._tracker = tracker
        self.constructed = False

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        if self.constructed:
            work = self._ft_group.allreduce(tensors, opts) if opts is not None else self._ft_group.allreduce(tensors)
            if self._tracker is not None:
                self._tracker.add(work.get_future(), used_map=True)
            return work
        return super().allreduce(tensors, opts)

    def route_all_reduce(self, backend: Any) -> None:
        """From now on all_reduce runs in C++ on ``backend`` (a ``RouteBackend``: through the fault-tolerant
        group's route); every other op stays on the Python methods (the one-rank local group)."""
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
