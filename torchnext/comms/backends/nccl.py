"""NCCL backend (CUDA tensors): ``torch.distributed.ProcessGroupNCCL``.

Needs a CUDA build and a GPU; not exercised on the CPU CI (its tests skip with a reason). Connection is made eager
with ``eager_connect_single_device`` so the Communicator is usable on return; ``abort()`` calls the backend's own
abort (NCCL communicators can be aborted), so in-flight kernels are cancelled, not only abandoned.
Completion semantics follow ProcessGroupNCCL: a Work's future completes once the op is enqueued on its stream.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torchnext.comms.backends import BackendConfig, BackendHandle

__all__ = ["create"]


def create(cfg: BackendConfig) -> BackendHandle:
    """Connect a ``ProcessGroupNCCL`` over ``cfg.store`` on ``cfg.device`` (default: the current CUDA device)."""
    if not dist.is_nccl_available():
        raise RuntimeError("this torch build has no NCCL support (torch.distributed.is_nccl_available() is False)")
    if not torch.cuda.is_available():
        raise RuntimeError("the nccl backend needs a CUDA device; none is available")
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.device is None else torch.device(cfg.device)
    if device.type != "cuda":
        raise ValueError(f"the nccl backend communicates CUDA tensors; got device={device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = cfg.timeout
    pg = dist.ProcessGroupNCCL(cfg.store, cfg.rank, cfg.size, opts)
    pg.eager_connect_single_device(device)
    return BackendHandle(pg=pg, device=device, native_avg=True, uneven_all_to_all=True, abort_fn=pg.abort, shutdown_fn=pg.shutdown)
