"""A DeviceMesh whose replicate dimension is the fault-tolerant group: FSDP2's HSDP across replica groups.

``device_mesh(ft, ("replicate", "shard"))`` returns a 2-D ``DeviceMesh`` over ``[ft.process_group, shard_group]``:
``fully_shard(module, mesh=mesh)`` then shards within this replica group (``shard_group``: by default the default
process group, i.e. one ``init_process_group(backend="torchnext")`` per replica group -- under torchrun, one
torchrun job per group) and all-reduces the gradient shards across the live replica groups.

A DeviceMesh stores global ranks and assumes its membership fixed, while the number of live replica groups changes;
so the mesh tensor has replicate extent 1 -- this group's own ranks -- and the replicate dimension's size comes from
its process group, which is what FSDP2 asks when it divides gradients (``group.size()`` on every reduction).
Semantics::

    mesh.get_group("replicate") is ft.process_group      # size() == live replica groups
    mesh.get_group("shard") is shard_group                # the ranks of this replica group
    mesh.mesh.tolist() == [dist.get_process_group_ranks(shard_group)]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from torchnext.ft.fault_tolerant import FaultTolerant

__all__ = ["device_mesh"]


def device_mesh(
    ft: FaultTolerant,
    mesh_dim_names: Sequence[str] = ("replicate", "shard"),
    shape: Sequence[int] | None = None,
    *,
    shard_group: Any = None,
    device_type: str = "cpu",
) -> DeviceMesh:
    """The HSDP mesh of ``ft`` (see the module docstring). ``shape`` ``(R, S)`` is checked, not used: ``S`` must be
    the shard group's size (= ``ft.group_size``); ``R`` is informational (the live count comes from
    ``ft.process_group``). The shard group is registered with ``ft`` (aborted when this replica group is removed).

    Raises:
        ValueError: not two dimension names, no shard group (no default group and none given), or sizes that
            disagree with the replica group.
    """
    from torch.distributed.device_mesh import DeviceMesh

    names = tuple(mesh_dim_names)
    if len(names) != 2 or len(set(names)) != 2:
        raise ValueError(f"device_mesh: expected two distinct dimension names (replicate, shard), got {names!r}")
    if shard_group is None:
        if not dist.is_initialized():
            raise ValueError("device_mesh: no shard group: call dist.init_process_group(backend='torchnext') for "
                             "this replica group first, or pass shard_group=")
        shard_group = dist.group.WORLD
    size = shard_group.size()
    if size != ft.group_size:
        raise ValueError(f"device_mesh: the shard group has {size} ranks but the replica group has "
                         f"group_size={ft.group_size}")
    if shape is not None:
        if len(shape) != 2 or int(shape[1]) != size:
            raise ValueError(f"device_mesh: shape {tuple(shape)} must be (replica groups, {size})")
    ranks = dist.get_process_group_ranks(shard_group)
    ft.register_local_group(shard_group)
    return DeviceMesh.from_group([ft.process_group, shard_group], device_type,
                                 mesh=torch.tensor([ranks], dtype=torch.int64), mesh_dim_names=names)
