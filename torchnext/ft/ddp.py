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
  its buckets after the first step -- a recovering replica must bucket exactly like the others.

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
from torchnext.comms.process_group import TorchnextProcessGroup

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
        group = _DDPGroup(local, ft.process_group)
        super().__init__(module, process_group=group, **kwargs)
        group.constructed = True
        self._ft_local = local
        self._ft_group = ft.process_group
        self.register_comm_hook(self._ft_group, _average_over_live_groups)


class _DDPGroup(TorchnextProcessGroup):
    """The process group torch's DDP is given: a one-rank group of this process while DDP is built (its parameter
    shape check and broadcast; a joining replica gets its state from healing); once ``constructed``, all-reduces --
    DDP issues exactly one on its own group, the used-parameter map of ``find_unused_parameters``, after every
    bucket -- go to the live replica groups (``ft.process_group``: a failure there is recorded, not raised).
    Buckets never come here: the comm hook sends them to ``ft.process_group`` itself."""

    def __init__(self, local: Communicator, ft_group: Any) -> None:
        super().__init__({local.device.type: local}, description=local.name)
        self._ft_group = ft_group
        self.constructed = False

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        if self.constructed:
            return self._ft_group.allreduce(tensors, opts) if opts is not None else self._ft_group.allreduce(tensors)
        return super().allreduce(tensors, opts)


_AVG = dist.AllreduceOptions()
_AVG.reduceOp = dist.ReduceOp.AVG  # type: ignore[assignment]  # pybind converts the RedOpType


def _average_over_live_groups(group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The comm hook (its state is ``ft.process_group``)."""
    work = group.allreduce([bucket.buffer()], _AVG)
    return work.get_future().then(lambda fut: fut.value()[0])
