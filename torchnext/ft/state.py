"""The state a fault-tolerant member heals: parameters, buffers and optimizer state, as this rank's local shards.

With FSDP2 every parameter (and its optimizer state) is a DTensor whose local tensor is this rank's shard; with DDP
or no parallelism it is a plain tensor. Healing copies state rank by rank (rank r of a joining replica group from
rank r of a donor group), so what a member sends is its *local* shards -- never an unsharded copy. Semantics::

    state = sharded_state(model, opt)         # {"model": {name: local tensor}, "optim": [{key: local tensor}]}
    load_sharded_state(state, model, opt)     # copy back in place; creates optimizer state a fresh process lacks

The tensors of :func:`sharded_state` *are* the local shards (no copies), so healing receives into them in place.
Use with :class:`~torchnext.ft.FaultTolerant`::

    FaultTolerant(cfg, state_dict=lambda: sharded_state(model, opt),
                  load_state_dict=lambda s: load_sharded_state(s, model, opt))
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["load_sharded_state", "local", "sharded_state"]


def local(t: torch.Tensor) -> torch.Tensor:
    """``t``'s local shard (a DTensor's local tensor; any other tensor itself)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def sharded_state(model: torch.nn.Module, *optimizers: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's parameters, buffers and optimizer state as local tensors (views, no copies); see the module
    docstring. Optimizer state is listed per parameter in ``param_groups`` order."""
    state: dict[str, Any] = {
        "model": {name: local(t.detach()) for name, t in (*model.named_parameters(), *model.named_buffers())},
        "optim": [],
    }
    for opt in optimizers:
        per_param = []
        for group in opt.param_groups:
            for p in group["params"]:
                entries = opt.state.get(p, {})
                per_param.append({k: local(v) if isinstance(v, torch.Tensor) else v for k, v in entries.items()})
        state["optim"].append(per_param)
    return state


def load_sharded_state(state: dict[str, Any], model: torch.nn.Module, *optimizers: torch.optim.Optimizer) -> None:
    """Copy ``state`` (from :func:`sharded_state` on a peer) into ``model`` and ``optimizers`` in place.

    Raises:
        ValueError: the state's structure differs (parameter names, number of optimizers or parameters).
    """
    tensors = dict((*model.named_parameters(), *model.named_buffers()))
    if set(tensors) != set(state["model"]):
        raise ValueError(f"load_sharded_state: the state has tensors {sorted(state['model'])[:5]}... but the model "
                         f"has {sorted(tensors)[:5]}...")
    with torch.no_grad():
        for name, t in tensors.items():
            dst = local(t)
            if dst.data_ptr() != state["model"][name].data_ptr():
                dst.copy_(state["model"][name])
    if len(optimizers) != len(state["optim"]):
        raise ValueError(f"load_sharded_state: {len(state['optim'])} optimizer states for {len(optimizers)} optimizers")
    for opt, per_param in zip(optimizers, state["optim"], strict=True):
        params = [p for group in opt.param_groups for p in group["params"]]
        if len(params) != len(per_param):
            raise ValueError(f"load_sharded_state: optimizer state for {len(per_param)} parameters, the optimizer "
                             f"has {len(params)}")
        for p, entries in zip(params, per_param, strict=True):
            mine = opt.state.setdefault(p, {})
            for key, value in entries.items():
                if not isinstance(value, torch.Tensor):
                    mine[key] = value
                elif key in mine and isinstance(mine[key], torch.Tensor):
                    with torch.no_grad():
                        dst = local(mine[key])
                        if dst.data_ptr() != value.data_ptr():
                            dst.copy_(value)
                else:
                    mine[key] = _like(p, value)


def _like(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """A new optimizer-state tensor for ``param`` holding ``value``: a DTensor placed like ``param`` when it is
    one and ``value`` is a shard of its shape; the plain tensor otherwise (``step`` counters)."""
    mesh = getattr(param, "device_mesh", None)
    if mesh is not None and value.shape == local(param).shape:
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(value.clone(), mesh, param.placements, run_check=False,  # type: ignore[attr-defined]
                                  shape=param.shape, stride=param.stride())
    return value.clone()
