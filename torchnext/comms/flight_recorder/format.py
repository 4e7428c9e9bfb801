"""The Flight Recorder dump format: field names, dtype names, file names and atomic writing.

One dump file per rank. Its top level (JSON object or pickled ``dict``)::

    {
      "format": "torchnext.flight_recorder", "format_version": 1,
      "version": "2.10",                 # PyTorch's FR schema version (what torchfrtrace checks)
      "rank": 0, "world_size": 4, "host": "node1", "pid": 1234,
      "versions": {"torchnext": ..., "torch": ..., "python": ...},
      "generation": 0, "capacity": 2000, "recorded": 2412, "dropped": 412,
      "dump_reason": "timeout", "time_dumped_ns": ...,
      "pg_config": {pg_key: {"name", "desc", "ranks" (str, as PyTorch writes it), "ranks_list", "generation",
                             "backend", "pg_id"}},
      "pg_status": {pg_key: {"last_enqueued_collective", "last_started_collective", "last_completed_collective",
                             "last_enqueued_p2p", "last_started_p2p", "last_completed_p2p"}},
      "stacks": {"MainThread (140...)": [{"name", "filename", "line"}, ...]},   # every thread at dump time
      "entries": [ENTRY, ...]            # oldest first
    }

ENTRY carries PyTorch's FR fields (:data:`TORCH_ENTRY_FIELDS`) and ours (:data:`TORCHNEXT_ENTRY_FIELDS`).
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "FR_SCHEMA_VERSION",
    "JSON_PREFIX",
    "PICKLE_PREFIX",
    "TORCH_ENTRY_FIELDS",
    "TORCHNEXT_ENTRY_FIELDS",
    "atomic_write",
    "thread_stacks",
    "dtype_name",
    "dump_file_name",
]

FORMAT_NAME = "torchnext.flight_recorder"
FORMAT_VERSION = 1
FR_SCHEMA_VERSION = "2.10"

JSON_PREFIX = "torchnext_fr_rank_"
"""JSON dumps are named ``torchnext_fr_rank_<rank>.json``."""
PICKLE_PREFIX = "torchnext_fr_trace_rank_"
"""Pickle dumps are named ``<prefix><rank>`` (no suffix), the naming torchfrtrace's loader infers ranks from.
The two prefixes do not contain each other, so both flavours can share one folder."""

TORCH_ENTRY_FIELDS = (
    "record_id",
    "pg_id",
    "process_group",
    "collective_seq_id",
    "p2p_seq_id",
    "op_id",
    "profiling_name",
    "time_created_ns",
    "time_discovered_started_ns",
    "time_discovered_completed_ns",
    "duration_ms",
    "state",
    "input_sizes",
    "output_sizes",
    "input_dtypes",
    "output_dtypes",
    "timeout_ms",
    "is_p2p",
    "retired",
    "frames",
    "thread_name",
    "thread_id",
)
TORCHNEXT_ENTRY_FIELDS = (
    "op",
    "backend",
    "rank",
    "global_rank",
    "generation",
    "peer",
    "peer_global",
    "tag",
    "async_op",
    "error",
)

# PyTorch's FR writes c10 ScalarType names ("Float"); we write the same so both analyzers compare like with like.
_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "Float",
    torch.float64: "Double",
    torch.float16: "Half",
    torch.bfloat16: "BFloat16",
    torch.int8: "Char",
    torch.uint8: "Byte",
    torch.int16: "Short",
    torch.int32: "Int",
    torch.int64: "Long",
    torch.bool: "Bool",
    torch.complex64: "ComplexFloat",
    torch.complex128: "ComplexDouble",
}


def dtype_name(dtype: torch.dtype) -> str:
    """c10 ScalarType name of ``dtype`` (``torch.float32 -> "Float"``); unknown dtypes: ``str(dtype)`` sans prefix."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = str(dtype).removeprefix("torch.")
        _DTYPE_NAMES[dtype] = name
    return name


def dump_file_name(rank: int, fmt: str) -> str:
    """File name of rank ``rank``'s dump in format ``fmt`` (``"json"`` or ``"pickle"``)."""
    if fmt == "json":
        return f"{JSON_PREFIX}{rank}.json"
    return f"{PICKLE_PREFIX}{rank}"


def atomic_write(path: Path, data: bytes, *, fsync: bool = False) -> None:
    """Write ``data`` to ``path`` so that readers see either the old file or the whole new one, never a part.

    The bytes go to a hidden temporary file in the same folder, which then replaces ``path`` (``os.replace`` is
    atomic on POSIX and Windows). ``fsync=True`` also makes the file durable across a power loss.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def thread_stacks(depth: int) -> dict[str, list[dict[str, Any]]]:
    """Python stack of every thread right now (innermost first), keyed ``"<name> (<ident>)"``; the dumping
    recorder's own frames (recorder, _attach, format) on top of a stack are left out."""
    names = {t.ident: t.name for t in threading.enumerate()}
    folder = os.path.dirname(os.path.abspath(__file__))
    here = {os.path.join(folder, f) for f in ("recorder.py", "_attach.py", "format.py")}
    out: dict[str, list[dict[str, Any]]] = {}
    for ident, frame in sys._current_frames().items():
        frames: list[dict[str, Any]] = []
        f: Any = frame
        while f is not None and f.f_code.co_filename in here:
            f = f.f_back
        while f is not None and len(frames) < depth:
            frames.append({"name": f.f_code.co_name, "filename": f.f_code.co_filename, "line": f.f_lineno})
            f = f.f_back
        out[f"{names.get(ident, 'unknown')} ({ident})"] = frames
    return out
