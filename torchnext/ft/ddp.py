"""Fault-tolerant DDP: torch's ``DistributedDataParallel`` across replica groups, averaging over the live ones.

``DistributedDataParallel(module, ft)`` is torch's DDP with two changes, both for fault tolerance:

* its gradients are all-reduced by a comm hook on ``ft.process_group`` (AVG over the live replica groups; with a
  hook DDP leaves averaging to the hook, so the divisor is the live count, not a size fixed at construction; the
  group runs it on a staging copy, so DDP's bucket buffer never reaches a backend that a reconfiguration may
  abandon mid-op), and a failure in that hook is recorded -- the step cannot commit -- instead of raising out of
  backward;
* DDP's own construction-time collectives (parameter-shape check, parameter broadcast) run on a one-rank group of
  this process, because a replica group that joins later builds its DDP while the others train: the state comes
  from healing instead. ``find_unused_parameters=True`` by default, which also keeps DDP from rebuilding its buckets
  after the first step -- a recovering replica must bucket exactly like the others.

Semantics of one backward, per bucket ``b``::

    b = mean over live replica groups of b        # ft.process_group.allreduce([b], AVG)
"""

# No `from __future__ import annotations`: DDP checks the comm hook's annotations as objects.
import itertools
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from torchnext.comms.communicator import Communicator

if TYPE_CHECKING:
    from torchnext.ft.fault_tolerant import FaultTolerant

__all__ = ["DistributedDataParallel"]

_LOCAL = itertools.count()


class DistributedDataParallel(nn.parallel.DistributedDataParallel):
    """torch's DDP across the live replica groups of ``ft`` (see the module docstring). ``kwargs`` go to torch's
    DDP (``process_group`` is not accepted: the group is ``ft.process_group``)."""

    def __init__(self, module: nn.Module, ft: "FaultTolerant", **kwargs: Any) -> None:
        if "process_group" in kwargs:
            raise ValueError("torchnext.ft.DistributedDataParallel: process_group is ft.process_group; do not pass one")
        kwargs.setdefault("find_unused_parameters", True)
        local = Communicator(dist.HashStore(), 0, 1, name=f"ft-ddp-local-{next(_LOCAL)}")
        super().__init__(module, process_group=local.as_process_group(), **kwargs)
        self._ft_local = local
        self._ft_group = ft.process_group
        self.register_comm_hook(_HookState(self._ft_group), _average_over_live_groups)


_AVG = dist.AllreduceOptions()
_AVG.reduceOp = dist.ReduceOp.AVG  # type: ignore[assignment]  # pybind converts the RedOpType


class _HookState:
    """The comm hook's state: the fault-tolerant group."""

    def __init__(self, group: Any) -> None:
        self.group = group


def _average_over_live_groups(state: _HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    work = state.group.allreduce([bucket.buffer()], _AVG)
    return work.get_future().then(lambda fut: fut.value()[0])
